//! Cancel latency (`docs/rules.md#proof-cancel-latency`, R15): from the response to the
//! orchestrator's PATCH that sets `plan.cattle.io/canceled=true` to (a) SIGTERM arriving in the
//! running instruction (the helper records CLOCK_REALTIME in its signal handler) and (b) the
//! instruction's process being gone (pidfd readable), over at least 50 cancels against a real
//! kube-apiserver. Prints p50/p99 and the ratio against system-agent's 2 s polling interval (mean
//! wait 1 s). Not a test.
//!
//! Run: `cargo bench --bench cancel_latency` (needs the cache built by tools/build-kube-apiserver.sh;
//! NODEPLAN_BENCH_N overrides the number of cancels).

#[path = "../tests/k8s_support/mod.rs"]
mod k8s_support;

use base64::Engine as _;
use nodeplan::remote::client::{SecretClient, SecretRef};
use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

const HELPER: &str = env!("CARGO_BIN_EXE_nodeplan-test-helper");
const NODEPLAN: &str = env!("CARGO_BIN_EXE_nodeplan");

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// Block until the process is gone (its pidfd becomes readable), returning the time.
fn wait_gone(pid: i32) -> u128 {
    let Some(p) = rustix::process::Pid::from_raw(pid) else { return now_ns() };
    if let Ok(fd) = rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()) {
        use std::os::fd::AsRawFd;
        let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        unsafe { libc::poll(&mut pfd, 1, -1) };
    }
    now_ns()
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::var("NODEPLAN_BENCH_N").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
    let Some(cp) = k8s_support::ControlPlane::start().await else {
        eprintln!("cancel_latency: no kube-apiserver cache; run tools/build-kube-apiserver.sh first");
        return;
    };
    let ns = cp.new_namespace("bench").await;
    let client = SecretClient::new(cp.client().await, SecretRef { namespace: ns.clone(), name: "machine-plan".into() });
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().display().to_string();
    let conn = serde_json::json!({"kubeConfig": cp.kubeconfig_yaml(), "namespace": ns, "secretName": "machine-plan"});
    std::fs::write(dir.path().join("conn.json"), serde_json::to_vec(&conn).expect("json")).expect("write");
    let cfg = format!(
        "remoteEnabled: true\nconnectionInfoFile: {d}/conn.json\nworkDirectory: {d}/work\npidDirectory: {d}/pids\nappliedPlanDirectory: \"\"\n"
    );
    std::fs::write(dir.path().join("config.yaml"), cfg).expect("write");
    for f in ["conn.json", "config.yaml"] {
        std::fs::set_permissions(dir.path().join(f), std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("chmod");
    }
    let ready = dir.path().join("ready");
    let c = std::ffi::CString::new(ready.to_string_lossy().as_bytes()).expect("path");
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let mut agent = std::process::Command::new(NODEPLAN)
        .args(["agent", "--config", &format!("{d}/config.yaml")])
        .env("NODEPLAN_LOG", "warn")
        .spawn()
        .expect("agent");

    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let mut to_term = Vec::new();
    let mut to_gone = Vec::new();
    for i in 0..n {
        let rec = dir.path().join(format!("term-{i}"));
        let plan = serde_json::json!({"instructions": [{"name": "wait", "command": HELPER,
            "args": ["record-term", rec.to_string_lossy(), ready.to_string_lossy()]}]});
        let plan = serde_json::to_string(&plan).expect("json");
        if i == 0 {
            let data = BTreeMap::from([
                ("plan".to_string(), plan.into_bytes()),
                ("plan-state".to_string(), b"pending".to_vec()),
            ]);
            client.create(data, BTreeMap::new()).await.expect("create");
        } else {
            client
                .orchestrator_patch(serde_json::json!({
                    "metadata": {"annotations": {"plan.cattle.io/canceled": null}},
                    "data": {"plan": b64(&plan), "plan-state": b64("pending")}
                }))
                .await
                .expect("patch");
        }
        let r = ready.clone();
        let pid: i32 = tokio::task::spawn_blocking(move || {
            std::fs::read_to_string(r).unwrap_or_default().trim().parse().unwrap_or(0)
        })
        .await
        .expect("ready");
        let gone = tokio::task::spawn_blocking(move || wait_gone(pid));
        client
            .orchestrator_patch(serde_json::json!({"metadata": {"annotations": {"plan.cattle.io/canceled": "true"}}}))
            .await
            .expect("cancel");
        let t0 = now_ns();
        let t_gone = gone.await.expect("gone");
        let t_term: u128 = std::fs::read_to_string(&rec).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(t_gone);
        to_term.push(t_term.saturating_sub(t0) as f64 / 1e6);
        to_gone.push(t_gone.saturating_sub(t0) as f64 / 1e6);
    }
    let _ = agent.kill();
    let _ = agent.wait();
    let polling_mean_ms = 1000.0;
    let (t50, t99) = (pct(&mut to_term, 0.5), pct(&mut to_term, 0.99));
    let (g50, g99) = (pct(&mut to_gone, 0.5), pct(&mut to_gone, 0.99));
    println!("cancel latency over {n} cancels (from the PATCH response):");
    println!("  → SIGTERM in the instruction: p50 {t50:>8.2} ms, p99 {t99:>8.2} ms");
    println!("  → process tree gone         : p50 {g50:>8.2} ms, p99 {g99:>8.2} ms");
    println!(
        "  system-agent polls every 2 s (mean wait 1 s): p50 ratio {:.4}× ({:.0}× faster)",
        t50 / polling_mean_ms,
        polling_mean_ms / t50.max(0.001)
    );
}
