//! A plan carried through the API server (issue 40), measured as system-agent was: Rancher's write
//! of a new plan (`plan` and `plan-state: pending` in one PATCH) → `plan-state: succeeded` seen by
//! a watch, for a plan of three `/bin/true` instructions, p50/p95 of N (default 30, or
//! NODEPLAN_BENCH_N) per runner, on one kube-apiserver, in one run:
//!
//! - A: this build's agent (default config: its Lease, kept outcomes, Events);
//! - B: a previous build, named by NODEPLAN_BENCH_BASELINE (optional), run A B B A;
//! - F, the floor: a bare client in this process that makes the same reads and writes as an agent
//!   and nothing else (its watch's event → `in-progress` → the three instructions → `succeeded`),
//!   through the agent's own client settings (HTTP/2, `TCP_NODELAY`).
//!
//! Each runner has its own namespace and Secret; the writes and the watch that times them go
//! through one client of this process. It prints p50/p95 per runner, A against F, A against B,
//! A against system-agent's figures from issue 40 (27.7 / 35.8 ms on this 2-core machine), and
//! the requests each runner made per plan (the API server's audit log). Not a test: it asserts
//! nothing.
//!
//! With NODEPLAN_BENCH_IDLE_SECS=S it then leaves the agents idle (55 s to settle, then S s) and
//! prints what each asked of the API server per hour, by verb and resource.
//!
//! Run: `cargo bench --bench remote_plan` (needs the cache built by
//! tools/build-kube-apiserver.sh; NODEPLAN_K8S_BIN picks another).

#[path = "../tests/k8s_support/mod.rs"]
mod k8s_support;

use base64::Engine as _;
use futures::StreamExt as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const NODEPLAN: &str = env!("CARGO_BIN_EXE_nodeplan");
const SECRET: &str = "machine-plan";
/// system-agent's figures (issue 40, kube-apiserver 1.20.2, this machine): p50 and p95 in ms.
const SYSTEM_AGENT: (f64, f64) = (27.7, 35.8);

fn b64(v: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(v)
}

fn state(s: &Secret) -> Option<String> {
    s.data.as_ref()?.get("plan-state").map(|v| String::from_utf8_lossy(&v.0).into_owned())
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn plan(i: usize) -> Vec<u8> {
    let ins: Vec<_> = (0..3)
        .map(|k| serde_json::json!({"name": format!("i{k}"), "command": "/bin/true", "env": [format!("N={i}")]}))
        .collect();
    serde_json::to_vec(&serde_json::json!({ "instructions": ins })).expect("json")
}

/// A client with the agent's own settings (HTTP/2, `TCP_NODELAY`), sending `user_agent`: the
/// audit log tells this process's requests (`bench/…`) from the agents' (`nodeplan/…`).
fn fast_client(cp: &k8s_support::ControlPlane, user_agent: &'static str) -> kube::Client {
    let kc = kube::config::Kubeconfig::from_yaml(&cp.kubeconfig_yaml()).expect("kubeconfig");
    let rt = tokio::runtime::Handle::current();
    let config = std::thread::scope(|s| {
        s.spawn(|| rt.block_on(kube::Config::from_custom_kubeconfig(kc, &Default::default()))).join().expect("thread")
    })
    .expect("config");
    let builder = nodeplan::k8s::connection::builder(&config).expect("client").expect("HTTP/2 stack");
    let ua = tower::util::MapRequestLayer::new(move |mut req: http::Request<kube::client::Body>| {
        req.headers_mut().insert(http::header::USER_AGENT, http::HeaderValue::from_static(user_agent));
        req
    });
    builder.with_layer(&ua).build()
}

/// One runner: where its Secret is, and its agent's process (none for the floor).
struct Runner {
    name: String,
    ns: String,
    agent: Option<(std::process::Child, tempfile::TempDir, tempfile::TempDir)>,
    times: Vec<f64>,
}

fn start_agent(
    bin: &str,
    cp: &k8s_support::ControlPlane,
    ns: &str,
) -> (std::process::Child, tempfile::TempDir, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    // The PID directory where a node has it: a tmpfs (/run); /dev/shm here.
    let pids = tempfile::Builder::new()
        .prefix("nodeplan-bench-pids")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("tempdir");
    let d = dir.path().display().to_string();
    let conn = serde_json::json!({"kubeConfig": cp.kubeconfig_yaml(), "namespace": ns, "secretName": SECRET});
    std::fs::write(dir.path().join("conn.json"), serde_json::to_vec(&conn).expect("json")).expect("write");
    let cfg = format!(
        "remoteEnabled: true\nconnectionInfoFile: {d}/conn.json\nworkDirectory: {d}/work\nappliedPlanDirectory: {d}/applied\n\
         interlockDirectory: {d}/interlock\npidDirectory: {}\nnodePlanStateDirectory: {d}/nodeplans\n",
        pids.path().display()
    );
    std::fs::write(dir.path().join("config.yaml"), cfg).expect("write");
    for f in ["conn.json", "config.yaml"] {
        std::fs::set_permissions(dir.path().join(f), std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("chmod");
    }
    let child = std::process::Command::new(bin)
        .args(["agent", "--config"])
        .arg(dir.path().join("config.yaml"))
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the agent");
    (child, dir, pids)
}

/// The floor: what an agent must do for each plan, and nothing else.
async fn floor(client: kube::Client, ns: String) {
    let api: Api<Secret> = Api::namespaced(client, &ns);
    let params = WatchParams::default().fields(&format!("metadata.name={SECRET}"));
    let mut rv = "0".to_string();
    loop {
        let Ok(stream) = api.watch(&params, &rv).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let mut stream = std::pin::pin!(stream);
        while let Some(Ok(ev)) = stream.next().await {
            let s = match ev {
                WatchEvent::Added(s) | WatchEvent::Modified(s) => s,
                // Gone (410): from the latest, at once.
                WatchEvent::Error(_) => {
                    rv = "0".to_string();
                    break;
                }
                _ => continue,
            };
            rv = s.metadata.resource_version.clone().unwrap_or_default();
            if state(&s).as_deref() != Some("pending") {
                continue;
            }
            // Updates, as Rancher's per-machine Role allows (and as the agent writes).
            let write = |mut s: Secret, state: &str| {
                s.data.get_or_insert_default().insert("plan-state".into(), ByteString(state.as_bytes().to_vec()));
                s
            };
            let Ok(s) = api.replace(SECRET, &PostParams::default(), &write(s, "in-progress")).await else {
                continue;
            };
            for _ in 0..3 {
                let _ = tokio::process::Command::new("/bin/true").status().await;
            }
            let _ = api.replace(SECRET, &PostParams::default(), &write(s, "succeeded")).await;
        }
    }
}

/// Rancher's write of plan `i`, timed to `succeeded` through a watch opened before it.
async fn one(api: &Api<Secret>, i: usize) -> f64 {
    let rv = api.get(SECRET).await.expect("get").metadata.resource_version.unwrap_or_default();
    let params = WatchParams::default().fields(&format!("metadata.name={SECRET}"));
    let stream = api.watch(&params, &rv).await.expect("watch");
    let mut stream = std::pin::pin!(stream);
    let data = serde_json::json!({"data": {"plan": b64(&plan(i)), "plan-state": b64(b"pending")}});
    let t0 = Instant::now();
    api.patch(SECRET, &PatchParams::default(), &Patch::Merge(data)).await.expect("patch");
    let mut pending_seen = false;
    let deadline = Duration::from_secs(30);
    loop {
        let ev = tokio::time::timeout(deadline, stream.next()).await.expect("succeeded within 30 s");
        let Some(Ok(WatchEvent::Modified(s))) = ev else { continue };
        match state(&s).as_deref() {
            Some("pending") => pending_seen = true,
            Some("succeeded") if pending_seen => return t0.elapsed().as_secs_f64() * 1000.0,
            _ => {}
        }
    }
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::var("NODEPLAN_BENCH_N").ok().and_then(|v| v.parse().ok()).unwrap_or(30);
    let baseline = std::env::var("NODEPLAN_BENCH_BASELINE").ok();
    let Some(cp) = k8s_support::ControlPlane::start_audited().await else {
        eprintln!("remote_plan: no kube-apiserver cache; run tools/build-kube-apiserver.sh first");
        return;
    };
    let client = fast_client(&cp, "bench/rancher");
    let mut runners = Vec::new();
    let mut builds = vec![("A", NODEPLAN.to_string())];
    if let Some(b) = &baseline {
        builds.push(("B", b.clone()));
    }
    for (name, bin) in &builds {
        let ns = cp.new_namespace(&format!("bench-{}", name.to_lowercase())).await;
        runners.push(Runner { name: name.to_string(), agent: Some(start_agent(bin, &cp, &ns)), ns, times: Vec::new() });
    }
    let ns = cp.new_namespace("bench-floor").await;
    tokio::spawn(floor(fast_client(&cp, "bench/floor"), ns.clone()));
    runners.push(Runner { name: "F".into(), ns, agent: None, times: Vec::new() });
    // Each Secret starts with a plan applied (an agent's first plan takes its Lease).
    for r in &runners {
        let api: Api<Secret> = Api::namespaced(client.clone(), &r.ns);
        let data = BTreeMap::from([
            ("plan".to_string(), k8s_openapi::ByteString(plan(usize::MAX))),
            ("plan-state".to_string(), k8s_openapi::ByteString(b"pending".to_vec())),
        ]);
        let s = Secret {
            metadata: kube::api::ObjectMeta { name: Some(SECRET.into()), ..Default::default() },
            data: Some(data),
            ..Default::default()
        };
        api.create(&PostParams::default(), &s).await.expect("create");
        let t = Instant::now();
        while api.get(SECRET).await.ok().and_then(|s| state(&s)).as_deref() != Some("succeeded") {
            assert!(t.elapsed() < Duration::from_secs(60), "runner {} never applied its first plan", r.name);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // A B F F B A (A F F A without a baseline), half of N each time.
    let mut order: Vec<usize> = (0..runners.len()).collect();
    order.extend((0..runners.len()).rev());
    let mut i = 0;
    for &k in &order {
        let api: Api<Secret> = Api::namespaced(client.clone(), &runners[k].ns);
        for _ in 0..n.div_ceil(2) {
            let t = one(&api, i).await;
            runners[k].times.push(t);
            i += 1;
        }
    }
    // What each runner asked of the API server per plan, the warm-up plan's included (its Lease
    // taken, its first list): the Events of the last plan may come up to a second later.
    tokio::time::sleep(Duration::from_secs(3)).await;
    println!(
        "remote_plan: {n} plans each, Rancher's write -> succeeded through a watch (ms); kube-apiserver {}",
        cp.version()
    );
    println!("{:<6} {:>8} {:>8} {:>12}", "runner", "p50", "p95", "requests/plan");
    for r in &runners {
        // The agent's requests, or the floor's; a watch is counted once it ends.
        let who = if r.agent.is_some() { "nodeplan/" } else { "bench/floor" };
        let own = cp.audited(&r.ns, who).iter().filter(|a| a.verb != "watch").count();
        let per = own as f64 / (r.times.len() + 1) as f64;
        println!("{:<6} {:>8.1} {:>8.1} {:>12.2}", r.name, pct(&r.times, 0.5), pct(&r.times, 0.95), per);
    }
    let get = |name: &str| runners.iter().find(|r| r.name == name).map(|r| (pct(&r.times, 0.5), pct(&r.times, 0.95)));
    if let (Some(a), Some(f)) = (get("A"), get("F")) {
        println!("A / floor:        p50 {:.2}x  p95 {:.2}x", a.0 / f.0, a.1 / f.1);
        println!(
            "A / system-agent: p50 {:.2}x  p95 {:.2}x (its figures from issue 40)",
            a.0 / SYSTEM_AGENT.0,
            a.1 / SYSTEM_AGENT.1
        );
    }
    if let (Some(a), Some(b)) = (get("A"), get("B")) {
        println!("A / B:            p50 {:.2}x  p95 {:.2}x", a.0 / b.0, a.1 / b.1);
    }
    // Idle: what each agent asks of the API server per hour, holding a succeeded plan (a node's
    // usual state between Rancher's plans), after its Lease has gone idle.
    let idle = std::env::var("NODEPLAN_BENCH_IDLE_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(0u64);
    if idle > 0 {
        let settle = Duration::from_secs(55);
        eprintln!("remote_plan: idle window of {idle} s after {} s of settling", settle.as_secs());
        tokio::time::sleep(settle).await;
        let before: Vec<usize> = runners.iter().map(|r| cp.audited(&r.ns, "nodeplan/").len()).collect();
        tokio::time::sleep(Duration::from_secs(idle)).await;
        println!("idle, {idle} s: requests per agent-hour by verb and resource (watches counted as they end)");
        for (r, b) in runners.iter().zip(before) {
            if r.agent.is_none() {
                continue;
            }
            let mut by: BTreeMap<String, usize> = BTreeMap::new();
            for a in cp.audited(&r.ns, "nodeplan/").split_off(b) {
                *by.entry(format!("{} {}", a.verb, a.resource)).or_default() += 1;
            }
            let per_hour = |n: usize| n as f64 * 3600.0 / idle as f64;
            let shown: Vec<String> = by.iter().map(|(k, n)| format!("{k} {:.0}", per_hour(*n))).collect();
            println!("{:<6} {}", r.name, shown.join(", "));
        }
    }
    for r in &mut runners {
        if let Some((mut child, _, _)) = r.agent.take() {
            let _ =
                rustix::process::kill_process(rustix::process::Pid::from_child(&child), rustix::process::Signal::TERM);
            let _ = child.wait();
        }
    }
}
