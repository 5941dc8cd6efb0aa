//! Replacing a record that is shown but not synced (the agent's status board, `safefs::write_shown`,
//! written at every change of what the agent does) against the plain way of doing it, run side by
//! side in the same directory: write a temporary file, then rename it over the record. Prints, per
//! replacement, the CPU time and the bytes sent to the disk (from /proc/self/io: on ext4 a rename
//! over an existing file writes the new data out at once), and the ratios.
//!
//! The directory is a new one under NODEPLAN_BENCH_DIR (default: the system's temporary directory);
//! point it at the filesystem the agent's PID directory is on (`/var/lib/...`) to measure that one.
//!
//! Not a test: it asserts nothing. Run: `cargo bench --bench shown`.

use std::path::Path;
use std::time::Duration;

const N: usize = 500;

fn cpu() -> Duration {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Bytes this process sent to the disk: `write_bytes` counts a page when it is dirtied,
/// `cancelled_write_bytes` one that was dropped before it was written (its file removed first).
fn write_bytes() -> i64 {
    let io = std::fs::read_to_string("/proc/self/io").unwrap_or_default();
    let field = |key: &str| -> i64 {
        io.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
    };
    field("write_bytes: ") - field("cancelled_write_bytes: ")
}

/// Per replacement: CPU microseconds and bytes written to the disk (the last replacement's own
/// bytes are still in flight, one in `N`).
fn measure(dir: &Path, replace: impl Fn(&Path, &[u8])) -> (f64, f64) {
    let record = dir.join("agent-status");
    let body = |i: usize| format!("{{\"nodeplanFormat\": 1, \"pid\": 4242, \"updated\": \"{i:020}\"}}\n").repeat(12);
    replace(&record, body(0).as_bytes());
    // SAFETY: sync(2) takes no arguments; it flushes what earlier rounds left dirty.
    unsafe { libc::sync() };
    let (c0, w0) = (cpu(), write_bytes());
    for i in 1..=N {
        replace(&record, body(i).as_bytes());
    }
    let (c1, w1) = (cpu(), write_bytes());
    let n = N as f64;
    ((c1 - c0).as_secs_f64() * 1e6 / n, (w1 - w0) as f64 / n)
}

fn plain(record: &Path, data: &[u8]) {
    let tmp = record.with_extension("tmp");
    std::fs::write(&tmp, data).expect("write");
    std::fs::rename(&tmp, record).expect("rename");
}

fn shown(record: &Path, data: &[u8]) {
    nodeplan::safefs::write_shown(record, data, 0o600).expect("write_shown");
}

fn main() {
    let base = std::env::var_os("NODEPLAN_BENCH_DIR").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(&base).expect("tempdir");
    println!("{N} replacements of a 1 KiB record in {}", base.display());
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    // A B B A, so neither side always runs first.
    for round in 0..4 {
        if round == 0 || round == 3 {
            ours.push(measure(dir.path(), shown));
        } else {
            theirs.push(measure(dir.path(), plain));
        }
    }
    let mean = |v: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| v.iter().map(f).sum::<f64>() / v.len() as f64;
    let (oc, ow) = (mean(&ours, |m| m.0), mean(&ours, |m| m.1));
    let (tc, tw) = (mean(&theirs, |m| m.0), mean(&theirs, |m| m.1));
    println!("safefs::write_shown: {oc:.1} us of CPU, {ow:.0} bytes to the disk per replacement");
    println!("temporary file + rename over it: {tc:.1} us of CPU, {tw:.0} bytes to the disk per replacement");
    println!("write_shown / rename: CPU {:.2}x, bytes to the disk {ow:.0} against {tw:.0}", oc / tc);
}
