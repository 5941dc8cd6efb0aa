//! Idle agent (`docs/rules.md#proof-idle`): resident memory and wake-ups per minute of
//! `nodeplan agent` in local mode holding a paused plan with one probe (so only the rescan and the
//! probe timer run), next to a `sleep` process as the floor. Wake-ups are context switches of all
//! the agent's threads (voluntary + involuntary) over the window. Not a test: it asserts nothing.
//! Run: `cargo bench --bench idle` (NODEPLAN_BENCH_SECS sets the window, default 30).

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

fn switches(pid: u32) -> u64 {
    let mut total = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        total += status
            .lines()
            .filter(|l| l.starts_with("voluntary_ctxt_switches") || l.starts_with("nonvoluntary_ctxt_switches"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    total
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let secs: u64 = std::env::var("NODEPLAN_BENCH_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(30);
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().display().to_string();
    std::fs::create_dir_all(dir.path().join("plans")).expect("mkdir");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for mut c in listener.incoming().flatten() {
            let mut buf = [0u8; 1024];
            let _ = c.read(&mut buf);
            let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    let plan = serde_json::json!({"instructions": [{"name": "a", "command": "true"}],
        "probes": {"web": {"httpGet": {"url": format!("http://127.0.0.1:{port}/")}}}});
    std::fs::write(dir.path().join("plans/held.plan"), serde_json::to_vec(&plan).expect("json")).expect("write");
    std::fs::write(dir.path().join("plans/held.paused"), b"").expect("write");
    let cfg = dir.path().join("config.yaml");
    std::fs::write(
        &cfg,
        format!("localEnabled: true\nlocalPlanDirectory: {d}/plans\nworkDirectory: {d}/work\npidDirectory: {d}/pids\n"),
    )
    .expect("write");
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let mut agent = std::process::Command::new(env!("CARGO_BIN_EXE_nodeplan"))
        .args(["agent", "--config"])
        .arg(&cfg)
        .env("NODEPLAN_LOG", "warn")
        .spawn()
        .expect("agent");
    let mut sleeper = std::process::Command::new("sleep").arg("3600").spawn().expect("sleep");
    std::thread::sleep(Duration::from_secs(6));
    let (a0, s0) = (switches(agent.id()), switches(sleeper.id()));
    std::thread::sleep(Duration::from_secs(secs));
    let (a1, s1) = (switches(agent.id()), switches(sleeper.id()));
    let per_min = |d: u64| d as f64 * 60.0 / secs as f64;
    println!("idle agent (local mode, 1 paused plan with 1 probe, probe period 5 s), over {secs} s:");
    println!("  nodeplan agent: RSS {} KiB, {:.0} wake-ups/min", rss_kib(agent.id()), per_min(a1 - a0));
    println!("  sleep (floor) : RSS {} KiB, {:.0} wake-ups/min", rss_kib(sleeper.id()), per_min(s1 - s0));
    let _ = agent.kill();
    let _ = agent.wait();
    let _ = sleeper.kill();
    let _ = sleeper.wait();
}
