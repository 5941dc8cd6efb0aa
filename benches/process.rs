//! Process-layer benchmarks (`docs/rules.md#proof-output`), printed as ratios against a baseline
//! run side by side:
//! 1. spawn-and-wait of `/bin/true` through the supervisor vs `std::process::Command`;
//! 2. capturing 1 GiB of stdout (line-structured) vs `cat > /dev/null` reading the same stream,
//!    with the peak RSS of the process doing the capture.
//!
//! Not a test: it asserts nothing. Run: `cargo bench --bench process`.

use nodeplan::process::{CgroupMode, SpawnSpec, StopSignal, Supervisor, SupervisorConfig};
use std::process::Command;
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;

fn source(bytes: u64) -> String {
    format!("yes nodeplan-benchmark-line-of-output-0123456789abcdefghijklmnopqrstuvwxyz | head -c {bytes}")
}

fn peak_rss_kib() -> i64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    ru.ru_maxrss
}

fn capture_child(bytes: u64) {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    let before = peak_rss_kib();
    let t = Instant::now();
    let out = rt.block_on(async {
        let sup = Supervisor::new(SupervisorConfig::default());
        sup.run(SpawnSpec::new("sh", ["-c", &source(bytes)]), &mut StopSignal::never()).await
    });
    let took = t.elapsed();
    assert!(out.outcome.success(), "{}", out.outcome);
    println!("{} {} {}", took.as_nanos(), before, peak_rss_kib());
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--capture-child") {
        capture_child(args.get(2).and_then(|b| b.parse().ok()).unwrap_or(GIB));
        return;
    }
    let n: usize = std::env::var("NODEPLAN_BENCH_N").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    for mode in [CgroupMode::Auto, CgroupMode::Off] {
        let sup = Supervisor::new(SupervisorConfig { cgroup: mode.clone(), ..Default::default() });
        let t = Instant::now();
        rt.block_on(async {
            for _ in 0..n {
                let r = sup.run(SpawnSpec::new("/bin/true", Vec::<String>::new()), &mut StopSignal::never()).await;
                assert!(r.outcome.success());
            }
        });
        let ours = t.elapsed();
        let t = Instant::now();
        for _ in 0..n {
            assert!(Command::new("/bin/true").status().expect("spawn").success());
        }
        let std_t = t.elapsed();
        println!("spawn-and-wait /bin/true × {n} (cgroups {mode:?}):");
        println!("  supervisor            : {:>7.1} µs each", ours.as_secs_f64() * 1e6 / n as f64);
        println!("  std::process::Command : {:>7.1} µs each", std_t.as_secs_f64() * 1e6 / n as f64);
        println!("  ratio                 : {:.2}×", ours.as_secs_f64() / std_t.as_secs_f64());
    }

    let bytes: u64 = std::env::var("NODEPLAN_BENCH_BYTES").ok().and_then(|v| v.parse().ok()).unwrap_or(GIB);
    let me = std::env::current_exe().expect("current exe");
    let out = Command::new(&me).args(["--capture-child", &bytes.to_string()]).output().expect("capture child");
    let text = String::from_utf8_lossy(&out.stdout);
    let f: Vec<i64> = text.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    let [nanos, rss_before, rss_peak] = f[..] else { panic!("capture child said {text:?}") };
    let ours = Duration::from_nanos(nanos as u64);
    let t = Instant::now();
    assert!(
        Command::new("sh")
            .args(["-c", &format!("{} | cat > /dev/null", source(bytes))])
            .status()
            .expect("sh")
            .success()
    );
    let base = t.elapsed();
    let gib = bytes as f64 / GIB as f64;
    println!("capture of {gib:.2} GiB of stdout:");
    println!(
        "  supervisor (64 KiB cap) : {:>7.2} s, {:>7.0} MiB/s",
        ours.as_secs_f64(),
        bytes as f64 / ours.as_secs_f64() / 1048576.0
    );
    println!(
        "  cat > /dev/null         : {:>7.2} s, {:>7.0} MiB/s",
        base.as_secs_f64(),
        bytes as f64 / base.as_secs_f64() / 1048576.0
    );
    println!("  ratio                   : {:.2}×", ours.as_secs_f64() / base.as_secs_f64());
    println!(
        "  peak RSS of the capturing process: {} MiB (before the run: {} MiB)",
        rss_peak / 1024,
        rss_before / 1024
    );
}
