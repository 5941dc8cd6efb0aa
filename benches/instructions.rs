//! Instruction overhead (`docs/rules.md#proof-instruction-overhead`): a plan of 500 trivial
//! instructions (`/bin/true`) applied by `nodeplan apply` against one shell running the same 500
//! commands in sequence, side by side in one run. Prints the times and the ratios (target: at most
//! 1.2×, issue 40). Not a test: it asserts nothing.
//!
//! Every instruction gets its own execution directory (system-agent's layout), so the work
//! directory's filesystem is part of the cost. The first line puts it on tmpfs (`/dev/shm`) to
//! show what nodeplan itself adds; the others put it on the disk, fresh for every run as on a node
//! (where the previous apply's directories were wiped long before), and back to back in one
//! directory. On an ext4 without a journal (this machine's root), every inode allocation in the
//! seconds after many deletions walks the recently freed inodes (`recently_deleted` in the
//! kernel's `find_inode_bit`), which is a property of that filesystem, not of nodeplan.
//!
//! Run: `cargo bench --bench instructions` (NODEPLAN_BENCH_N and NODEPLAN_BENCH_REPS override).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let n: usize = std::env::var("NODEPLAN_BENCH_N").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    let reps: usize = std::env::var("NODEPLAN_BENCH_REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let dir = tempfile::tempdir().expect("tempdir");
    let shm = tempfile::tempdir_in("/dev/shm").ok();
    let ins: Vec<serde_json::Value> =
        (0..n).map(|i| serde_json::json!({"name": format!("t{i}"), "command": "/bin/true"})).collect();
    let plan = dir.path().join("bench.plan");
    std::fs::write(&plan, serde_json::to_vec(&serde_json::json!({ "instructions": ins })).expect("json"))
        .expect("write plan");
    let script = "/bin/true\n".repeat(n);
    // PID records on a tmpfs, as on a node (`/run` is one wherever systemd runs; not on every
    // build machine).
    let tmpfs = if Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/run" };
    let pid_dir = format!("{tmpfs}/nodeplan-bench-pids-{}", std::process::id());

    let mut fresh = 0;
    let mut apply = |cgroup: &str, base: &Path, same: bool| {
        fresh += 1;
        let work: PathBuf = if same { base.join("same") } else { base.join(format!("work{fresh}")) };
        let t = Instant::now();
        let st = Command::new(env!("CARGO_BIN_EXE_nodeplan"))
            .args(["apply", &plan.to_string_lossy(), "--work-dir"])
            .arg(work)
            .args(["--pid-dir", &pid_dir, "--cgroup", cgroup])
            .env("NODEPLAN_LOG", "warn")
            .stderr(std::process::Stdio::null())
            .status()
            .expect("run nodeplan");
        assert!(st.success(), "nodeplan apply failed");
        t.elapsed()
    };
    let (mut tmpfs, mut disk, mut nocg, mut same, mut shell) = (vec![], vec![], vec![], vec![], vec![]);
    // Warm-up: page cache, the cgroup root, the PID directory.
    apply("auto", dir.path(), false);
    for _ in 0..reps {
        if let Some(s) = &shm {
            tmpfs.push(apply("auto", s.path(), false));
        }
        disk.push(apply("auto", dir.path(), false));
        nocg.push(apply("off", dir.path(), false));
        same.push(apply("auto", dir.path(), true));
        let t = Instant::now();
        let st = Command::new("sh").args(["-c", &script]).status().expect("run sh");
        shell.push(t.elapsed());
        assert!(st.success());
    }
    let _ = std::fs::remove_dir_all(&pid_dir);
    let sh = median(shell);
    let line = |what: &str, d: Duration| {
        println!(
            "  {what:<58} {:>7.1} ms  {:>5.0} µs each  {:.2}×",
            d.as_secs_f64() * 1e3,
            d.as_secs_f64() * 1e6 / n as f64,
            d.as_secs_f64() / sh.as_secs_f64()
        )
    };
    println!("instructions: {n} × /bin/true, median of {reps} runs (ratio to one shell; target ≤ 1.2×)");
    line("one shell running the same commands", sh);
    if !tmpfs.is_empty() {
        line("nodeplan apply, work dir on tmpfs", median(tmpfs));
    }
    line("nodeplan apply, fresh work dir on this disk", median(disk));
    line("  the same with --cgroup off", median(nocg));
    line("  back to back in one work dir (wipes 500 dirs first)", median(same));
}
