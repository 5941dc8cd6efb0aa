//! Instruction overhead (SPEC §7): a plan of 500 trivial instructions (`/bin/true`) applied by
//! `nodeplan apply` against one shell running the same 500 commands in sequence, side by side in
//! one run. Prints the times and the ratio (target: at most 1.5×). Not a test: it asserts nothing.
//!
//! Run: `cargo bench --bench instructions` (NODEPLAN_BENCH_N and NODEPLAN_BENCH_REPS override).

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
    let ins: Vec<serde_json::Value> =
        (0..n).map(|i| serde_json::json!({"name": format!("t{i}"), "command": "/bin/true"})).collect();
    let plan = dir.path().join("bench.plan");
    std::fs::write(&plan, serde_json::to_vec(&serde_json::json!({ "instructions": ins })).expect("json"))
        .expect("write plan");
    let script = "/bin/true\n".repeat(n);
    let pid_dir = format!("/run/nodeplan-bench-{}", std::process::id());

    let mut np = Vec::new();
    let mut np_nocg = Vec::new();
    let mut shell = Vec::new();
    let apply = |cgroup: &str| {
        let t = Instant::now();
        let st = Command::new(env!("CARGO_BIN_EXE_nodeplan"))
            .args(["apply", &plan.to_string_lossy(), "--work-dir"])
            .arg(dir.path().join("work"))
            .args(["--pid-dir", &pid_dir, "--cgroup", cgroup])
            .env("NODEPLAN_LOG", "warn")
            .stderr(std::process::Stdio::null())
            .status()
            .expect("run nodeplan");
        assert!(st.success(), "nodeplan apply failed");
        t.elapsed()
    };
    for _ in 0..reps {
        np.push(apply("auto"));
        np_nocg.push(apply("off"));
        let t = Instant::now();
        let st = Command::new("sh").args(["-c", &script]).status().expect("run sh");
        shell.push(t.elapsed());
        assert!(st.success());
    }
    let _ = std::fs::remove_dir_all(&pid_dir);
    let (a, b, c) = (median(np), median(shell), median(np_nocg));
    println!("instructions: {n} × /bin/true, median of {reps} runs");
    println!(
        "  nodeplan apply : {:>8.1} ms ({:.0} µs per instruction)",
        a.as_secs_f64() * 1e3,
        a.as_secs_f64() * 1e6 / n as f64
    );
    println!("  nodeplan, no cgroups (--cgroup off): {:>8.1} ms", c.as_secs_f64() * 1e3);
    println!(
        "  one shell      : {:>8.1} ms ({:.0} µs per command)",
        b.as_secs_f64() * 1e3,
        b.as_secs_f64() * 1e6 / n as f64
    );
    println!(
        "  ratio          : {:.2}× (target ≤ 1.5×); without cgroups {:.2}×",
        a.as_secs_f64() / b.as_secs_f64(),
        c.as_secs_f64() / b.as_secs_f64()
    );
}
