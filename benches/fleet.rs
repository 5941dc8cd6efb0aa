//! The fleet benchmark (issue 14): one real kube-apiserver, N agents (default 200; `--agents 500`
//! or NODEPLAN_BENCH_AGENTS), each with its own plan Secret and directories. Prints, side by side:
//!
//! 1. rollout time of a trivial plan to every node: `nodeplan rollout --max-concurrent 100%`
//!    against the baseline of writing every Secret directly (as many writes in flight as the
//!    CLI's fan-out, `fleet::objects::PARALLEL`) and waiting for all to succeed;
//! 2. cancel fan-out: `nodeplan plan cancel --selector` over every node running a long
//!    instruction, p50/p99 from the command's start to each Secret showing `canceled`;
//! 3. idle: API writes per agent-hour (Secrets and Leases, from a watch), agent RSS (sum and per
//!    agent) and CPU, and the API server's CPU, over a window (NODEPLAN_BENCH_IDLE_SECS, default 60).
//!
//! With NODEPLAN_BENCH_BASELINE=<an older nodeplan binary>, phases 2 and 3 run again with that
//! build's agents (in a namespace of their own, after this build's have stopped) and the ratios are
//! printed.
//!
//! With `-- --selectors` it measures instead what selecting a node's NodePlans costs the API
//! server ([`selectors`]): N watches like the agents' (one per node) by label, by field selector
//! (with the label, as the agent asks where it can) and, for reference, of the whole namespace,
//! while every NodePlan's spec changes a few times. Field selectors on NodePlans need a current
//! API server: `NODEPLAN_K8S_BIN=/var/tmp/nodeplan-k8s-1.37.2/bin`.
//!
//! Not a test: it asserts nothing. Run: `cargo bench --bench fleet [-- --agents 500]` (needs the
//! cache built by tools/build-kube-apiserver.sh).

#[path = "../tests/k8s_support/mod.rs"]
mod k8s_support;

use futures::StreamExt as _;
use nodeplan::fleet::objects::{Kind, Object, Scope, Selected};
use nodeplan::remote::client::{SecretClient, SecretRef};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const NODEPLAN: &str = env!("CARGO_BIN_EXE_nodeplan");

struct Node {
    _dir: tempfile::TempDir,
    agent: std::process::Child,
}

fn write_0600(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).expect("write");
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
}

fn start_node(cp: &k8s_support::ControlPlane, ns: &str, name: &str, binary: &Path) -> Node {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().display().to_string();
    let conn = serde_json::json!({"kubeConfig": cp.kubeconfig_yaml(), "namespace": ns, "secretName": name});
    write_0600(&dir.path().join("conn.json"), &serde_json::to_vec(&conn).expect("json"));
    let cfg = format!(
        "remoteEnabled: true\nconnectionInfoFile: {d}/conn.json\nworkDirectory: {d}/work\npidDirectory: {d}/pids\n\
         appliedPlanDirectory: \"\"\ninterlockDirectory: \"\"\nstopTimeout: 1s\n"
    );
    // More config lines for this build's agents (NODEPLAN_BENCH_CONFIG, e.g. `leaseDuration: 0s` to
    // measure what the Lease costs; a baseline build may not know them).
    let extra = match std::env::var("NODEPLAN_BENCH_CONFIG") {
        Ok(c) if binary == Path::new(NODEPLAN) => format!("{c}\n"),
        _ => String::new(),
    };
    write_0600(&dir.path().join("config.yaml"), format!("{cfg}{extra}").as_bytes());
    let agent = std::process::Command::new(binary)
        .args(["agent", "--config", &format!("{d}/config.yaml")])
        .env("NODEPLAN_LOG", "error")
        .env("CATTLE_NODE_NAME", name)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("agent");
    Node { _dir: dir, agent }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// Resident KiB and CPU ticks (user + system) of a process.
fn rss_and_ticks(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let tick = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    (rss, tick(11) + tick(12))
}

/// The kube-apiserver process serving `cp` (found by its data directory on its command line).
fn apiserver_pid(dir: &Path) -> Option<u32> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd);
        (cmd.contains("kube-apiserver") && cmd.contains(&needle)).then_some(pid)
    })
}

/// Wait (watching the selected Secrets) until every one of `n` satisfies `done`; per node, when.
async fn wait_all(
    client: kube::Client,
    ns: String,
    n: usize,
    checksum: String,
    state: &'static str,
    started: Instant,
) -> BTreeMap<String, Duration> {
    let mut at = BTreeMap::new();
    let scope = Scope { kind: Kind::Secrets, namespace: Some(ns), selector: "bench=fleet".into() };
    let mut stream = nodeplan::fleet::objects::watch(client, &scope);
    while at.len() < n {
        let Some(e) = tokio::time::timeout(Duration::from_secs(600), stream.next()).await.ok().flatten() else { break };
        if let Selected::Is(name, Object::Secret(s)) = e {
            let ours = s.data.get("plan").is_some_and(|p| nodeplan::plan::checksum(p) == checksum);
            let st = s.data.get("plan-state").map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
            if ours && st == state {
                at.entry(name).or_insert_with(|| started.elapsed());
            }
        }
    }
    at
}

/// The baseline orchestrator: write the plan into every Secret, as many writes in flight as the
/// CLI's fan-out.
async fn push_all(client: &kube::Client, ns: &str, names: &[String], raw: &[u8]) {
    futures::stream::iter(names.iter().map(|name| {
        let c = SecretClient::new(client.clone(), SecretRef { namespace: ns.to_string(), name: name.clone() });
        let patch = nodeplan::remote::wire::push_patch(raw);
        async move { c.orchestrator_patch(patch).await.map(|_| ()) }
    }))
    .buffer_unordered(nodeplan::fleet::objects::PARALLEL)
    .for_each(|r| async move {
        if let Err(e) = r {
            eprintln!("fleet: {e}");
        }
    })
    .await;
}

fn plan_file(dir: &Path, name: &str, plan: &serde_json::Value) -> (PathBuf, Vec<u8>) {
    let raw = serde_json::to_vec(plan).expect("json");
    let path = dir.join(name);
    std::fs::write(&path, &raw).expect("write");
    (path, raw)
}

/// The plan Secrets of a fleet, labelled `bench=fleet`, in a namespace of their own.
async fn fleet_secrets(cp: &k8s_support::ControlPlane, client: &kube::Client, n: usize) -> (String, Vec<String>) {
    let ns = cp.new_namespace("fleet").await;
    let names: Vec<String> = (0..n).map(|i| format!("node-{i:04}")).collect();
    for name in &names {
        let c = SecretClient::new(client.clone(), SecretRef { namespace: ns.clone(), name: name.clone() });
        c.create(BTreeMap::new(), BTreeMap::new()).await.expect("create");
        c.orchestrator_patch(serde_json::json!({"metadata": {"labels": {"bench": "fleet"}}})).await.expect("label");
    }
    (ns, names)
}

/// What the cancel fan-out and the idle window measured of one fleet.
struct Measured {
    cancel_p50_ms: f64,
    cancel_p99_ms: f64,
    canceled: usize,
    writes_per_agent_hour: f64,
    rss_mib_each: f64,
    cpu_pct: f64,
    api_cpu_pct: f64,
}

/// Run `args` of the current `nodeplan` against the fleet's namespace.
fn cli(ns: &str, kubeconfig: &Path, args: &[&str]) {
    let out = std::process::Command::new(NODEPLAN)
        .args(args)
        .args(["-n", ns, "--kubeconfig"])
        .arg(kubeconfig)
        .output()
        .expect("nodeplan");
    if !out.status.success() {
        eprintln!("fleet: {args:?} exited {:?}: {}", out.status.code(), String::from_utf8_lossy(&out.stderr));
    }
}

/// Phase 2, the cancel fan-out over every node running a long instruction (this build's CLI,
/// whatever the agents' build), and phase 3, idle writes, memory and CPU over `idle_secs`.
async fn cancel_and_idle(
    cp: &k8s_support::ControlPlane,
    client: &kube::Client,
    ns: &str,
    names: &[String],
    nodes: &[Node],
    work: &Path,
    idle_secs: u64,
) -> Measured {
    let n = names.len();
    let long = serde_json::json!({"instructions": [{"name": "long", "command": "sleep", "args": ["600"]}]});
    let (_, raw) = plan_file(work, "long.plan", &long);
    let sum = nodeplan::plan::checksum(&raw);
    let running = tokio::spawn(wait_all(client.clone(), ns.to_string(), n, sum.clone(), "in-progress", Instant::now()));
    push_all(client, ns, names, &raw).await;
    let _ = running.await;
    let started = Instant::now();
    let waiter = tokio::spawn(wait_all(client.clone(), ns.to_string(), n, sum.clone(), "canceled", started));
    cli(ns, &cp.kubeconfig_path(), &["plan", "cancel", "-l", "bench=fleet"]);
    let at = waiter.await.expect("waiter");
    let mut ms: Vec<f64> = at.values().map(|d| d.as_secs_f64() * 1000.0).collect();

    let writes = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = {
        let (client, ns, writes) = (client.clone(), ns.to_string(), writes.clone());
        tokio::spawn(async move {
            use kube::runtime::{WatchStreamExt as _, watcher};
            let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> = kube::Api::namespaced(client.clone(), &ns);
            let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = kube::Api::namespaced(client, &ns);
            let a = watcher(secrets, watcher::Config::default()).applied_objects().map(|_| ());
            let b = watcher(leases, watcher::Config::default()).applied_objects().map(|_| ());
            let mut both = std::pin::pin!(futures::stream::select(a, b));
            let mut listed = 0usize;
            while both.next().await.is_some() {
                // The initial lists are not writes.
                if listed < 2 * n {
                    listed += 1;
                    continue;
                }
                writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    writes.store(0, std::sync::atomic::Ordering::Relaxed);
    let api = apiserver_pid(cp.dir());
    let before: Vec<(u64, u64)> = nodes.iter().map(|nd| rss_and_ticks(nd.agent.id())).collect();
    let api_before = api.map(|p| rss_and_ticks(p).1).unwrap_or(0);
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let after: Vec<(u64, u64)> = nodes.iter().map(|nd| rss_and_ticks(nd.agent.id())).collect();
    let api_after = api.map(|p| rss_and_ticks(p).1).unwrap_or(0);
    counter.abort();
    let hz = 100.0; // USER_HZ
    let secs = idle_secs as f64;
    let rss_total: u64 = after.iter().map(|(r, _)| r).sum();
    let cpu: f64 = after.iter().zip(&before).map(|(a, b)| (a.1.saturating_sub(b.1)) as f64 / hz).sum();
    Measured {
        cancel_p50_ms: pct(&mut ms, 0.5),
        cancel_p99_ms: pct(&mut ms, 0.99),
        canceled: at.len(),
        writes_per_agent_hour: writes.load(std::sync::atomic::Ordering::Relaxed) as f64 / n as f64 * 3600.0 / secs,
        rss_mib_each: rss_total as f64 / 1024.0 / n as f64,
        cpu_pct: cpu / secs * 100.0,
        api_cpu_pct: (api_after.saturating_sub(api_before)) as f64 / hz / secs * 100.0,
    }
}

fn show(what: &str, n: usize, idle_secs: u64, m: &Measured) {
    println!(
        "{what}: cancel fan-out to {n} running nodes: p50 {:.0} ms, p99 {:.0} ms ({} of {n} canceled; system-agent polls every 2 s)",
        m.cancel_p50_ms, m.cancel_p99_ms, m.canceled
    );
    println!(
        "{what}: idle, {idle_secs}s: {:.0} API writes per agent-hour (Secrets and Leases; the Lease renewal alone is 360), agents' RSS {:.1} MiB each, agents' CPU {:.2}% of one core in all, API server CPU {:.2}% of one core",
        m.writes_per_agent_hour, m.rss_mib_each, m.cpu_pct, m.api_cpu_pct
    );
}

fn stop(nodes: Vec<Node>) {
    for nd in &nodes {
        unsafe { libc::kill(nd.agent.id() as i32, libc::SIGTERM) };
    }
    for mut nd in nodes {
        let _ = nd.agent.wait();
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args
        .windows(2)
        .find(|w| w[0] == "--agents")
        .and_then(|w| w[1].parse().ok())
        .or_else(|| std::env::var("NODEPLAN_BENCH_AGENTS").ok().and_then(|v| v.parse().ok()))
        .unwrap_or(200);
    let idle_secs: u64 = std::env::var("NODEPLAN_BENCH_IDLE_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(60);
    // An older build to measure beside this one (its agents only; the CLI is this build's).
    let baseline = std::env::var_os("NODEPLAN_BENCH_BASELINE").map(PathBuf::from);
    let Some(cp) = k8s_support::ControlPlane::start().await else {
        eprintln!("fleet: no kube-apiserver cache; run tools/build-kube-apiserver.sh first");
        return;
    };
    if args.iter().any(|a| a == "--selectors") {
        selectors(&cp, n).await;
        return;
    }
    let client = cp.client().await;
    let (ns, names) = fleet_secrets(&cp, &client, n).await;
    let t0 = Instant::now();
    let nodes: Vec<Node> = names.iter().map(|name| start_node(&cp, &ns, name, Path::new(NODEPLAN))).collect();
    println!("fleet: {n} agents on one kube-apiserver (started in {:.1}s)", t0.elapsed().as_secs_f64());
    let work = tempfile::tempdir().expect("tempdir");

    // 1. Rollout of a trivial plan: directly, then through `nodeplan rollout`.
    let direct = serde_json::json!({"instructions": [{"name": "a", "command": "true", "args": ["direct"]}]});
    let (_, raw) = plan_file(work.path(), "direct.plan", &direct);
    let sum = nodeplan::plan::checksum(&raw);
    let started = Instant::now();
    let waiter = tokio::spawn(wait_all(client.clone(), ns.clone(), n, sum.clone(), "succeeded", started));
    push_all(&client, &ns, &names, &raw).await;
    let at = waiter.await.expect("waiter");
    let direct_s = at.values().max().copied().unwrap_or_default().as_secs_f64();
    let rolled = serde_json::json!({"instructions": [{"name": "a", "command": "true", "args": ["rollout"]}]});
    let (path, _) = plan_file(work.path(), "rollout.plan", &rolled);
    let started = Instant::now();
    cli(
        &ns,
        &cp.kubeconfig_path(),
        &["rollout", &path.to_string_lossy(), "-l", "bench=fleet", "--max-concurrent", "100%"],
    );
    let rollout_s = started.elapsed().as_secs_f64();
    println!(
        "rollout of a trivial plan to {n} nodes: nodeplan rollout {rollout_s:.2}s | writing the Secrets directly {direct_s:.2}s ({} of {n} succeeded) | ratio {:.2}",
        at.len(),
        rollout_s / direct_s
    );

    let now = cancel_and_idle(&cp, &client, &ns, &names, &nodes, work.path(), idle_secs).await;
    show("this build", n, idle_secs, &now);
    stop(nodes);
    let Some(baseline) = baseline else { return };
    // The same fleet of the older build, on the same API server, one after the other (never both
    // at once: they would share the cores).
    let (ns, names) = fleet_secrets(&cp, &client, n).await;
    let nodes: Vec<Node> = names.iter().map(|name| start_node(&cp, &ns, name, &baseline)).collect();
    let then = cancel_and_idle(&cp, &client, &ns, &names, &nodes, work.path(), idle_secs).await;
    show(&format!("baseline {}", baseline.display()), n, idle_secs, &then);
    stop(nodes);
    println!(
        "this build / baseline: idle agents' CPU {:.2}x, API server CPU {:.2}x, cancel p50 {:.2}x, p99 {:.2}x, RSS {:.2}x",
        now.cpu_pct / then.cpu_pct,
        now.api_cpu_pct / then.api_cpu_pct,
        now.cancel_p50_ms / then.cancel_p50_ms,
        now.cancel_p99_ms / then.cancel_p99_ms,
        now.rss_mib_each / then.rss_mib_each
    );
}

/// The API server's counters of watch events sent for NodePlans: (events, bytes), summed over
/// the label sets that name them (`apiserver_watch_events_total` and
/// `apiserver_watch_events_sizes_sum`; 1.20 labels them by kind, later releases by resource).
async fn watch_counters(client: &kube::Client) -> (f64, f64) {
    let Ok(req) = http::Request::get("/metrics").body(Vec::new()) else { return (0.0, 0.0) };
    let text = client.request_text(req).await.unwrap_or_default();
    let sum = |name: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(name) && (l.contains("\"nodeplans\"") || l.contains("\"NodePlan\"")))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    };
    (sum("apiserver_watch_events_total{"), sum("apiserver_watch_events_sizes_sum{"))
}

/// How one agent's NodePlans are selected in [`selectors`].
#[derive(Clone, Copy, PartialEq)]
enum Selection {
    Label,
    /// As the agent does where the API server can: the field selector spec.nodeName with the label.
    Field,
    /// The whole namespace (a reference: what no selector at all costs).
    Everything,
}

/// The selector comparison (`-- --selectors`): `n` NodePlans, one per node, and for each way of
/// selecting, `n` list/watches through the agent's own `k8s::watch::pump` while every NodePlan's
/// spec changes `ROUNDS` times (each watch waits for its node's last change, or for all of them
/// when it watches everything). Prints the API server's CPU and the watch events and bytes it
/// sent, and the ratios against the label selector.
async fn selectors(cp: &k8s_support::ControlPlane, n: usize) {
    use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
    use nodeplan::k8s::watch::{KubeListWatch, Latest, pump};
    use nodeplan::nodeplan::resource;
    const ROUNDS: usize = 5;
    cp.install_nodeplan_crd().await;
    let ns = cp.new_namespace("selectors").await;
    let client = cp.client().await;
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &resource::api_resource());
    let names: Vec<String> = (0..n).map(|i| format!("node-{i:04}")).collect();
    let parallel = nodeplan::fleet::objects::PARALLEL;
    futures::stream::iter(names.iter().map(|node| {
        let obj =
            nodeplan::nodeplan::cli_wire::new_nodeplan(&ns, node, node, None, serde_json::json!({"instructions": []}));
        let api = api.clone();
        async move {
            let obj: DynamicObject = serde_json::from_value(obj).expect("object");
            api.create(&PostParams::default(), &obj).await.map(|_| ())
        }
    }))
    .buffer_unordered(parallel)
    .for_each(|r| async move { r.expect("create a NodePlan") })
    .await;
    let api_pid = apiserver_pid(cp.dir());
    println!("selectors: {n} NodePlans, {n} watches, {ROUNDS} changes of every spec (kube-apiserver {})", cp.version());
    let mut results: Vec<(Selection, f64, f64, f64)> = Vec::new();
    for (round_base, selection) in [(0, Selection::Label), (100, Selection::Field), (200, Selection::Everything)] {
        let field_ok = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut rxs = Vec::new();
        let mut pumps = Vec::new();
        for node in &names {
            let (tx, rx) = tokio::sync::watch::channel::<Latest<DynamicObject>>((0, BTreeMap::new()));
            let napi: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &resource::api_resource());
            let label = format!("{}={}", resource::NODE_LABEL, resource::node_label_value(node));
            let task = match selection {
                Selection::Label => tokio::spawn(pump(KubeListWatch::labelled(napi, &label), node.clone(), tx)),
                Selection::Everything => tokio::spawn(pump(KubeListWatch::labelled(napi, ""), node.clone(), tx)),
                Selection::Field => {
                    let ok = field_ok.clone();
                    let decided: nodeplan::k8s::watch::Decided = Box::new(move |o| {
                        if o.is_ok() {
                            ok.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    });
                    let lw = KubeListWatch::preferring(napi, &label, &format!("spec.nodeName={node}"), decided);
                    tokio::spawn(pump(lw, node.clone(), tx))
                }
            };
            pumps.push(task);
            rxs.push(rx);
        }
        for rx in &mut rxs {
            while rx.borrow().0 == 0 {
                if rx.changed().await.is_err() {
                    break;
                }
            }
        }
        if selection == Selection::Field && field_ok.load(std::sync::atomic::Ordering::Relaxed) < n {
            println!(
                "selectors: this API server does not select NodePlans by spec.nodeName: no field selector to measure"
            );
            pumps.iter().for_each(|p| p.abort());
            continue;
        }
        let (events0, bytes0) = watch_counters(&client).await;
        let ticks0 = api_pid.map(|p| rss_and_ticks(p).1).unwrap_or(0);
        let started = Instant::now();
        for round in 0..ROUNDS {
            let token = format!("r{}", round_base + round);
            futures::stream::iter(names.iter().map(|name| {
                let (api, token) = (api.clone(), token.clone());
                async move {
                    let patch = Patch::Merge(serde_json::json!({"spec": {"runToken": token}}));
                    api.patch(name, &PatchParams::default(), &patch).await.map(|_| ())
                }
            }))
            .buffer_unordered(parallel)
            .for_each(|r| async move { r.expect("patch a NodePlan") })
            .await;
        }
        // Every watch has seen the last change of what it watches.
        let last = format!("r{}", round_base + ROUNDS - 1);
        let seen = |latest: &Latest<DynamicObject>, node: &str| {
            let done = |o: &DynamicObject| o.data.pointer("/spec/runToken").and_then(|v| v.as_str()) == Some(&last);
            match selection {
                Selection::Everything => latest.1.len() == n && latest.1.values().all(done),
                _ => latest.1.get(node).is_some_and(done),
            }
        };
        for (rx, node) in rxs.iter_mut().zip(&names) {
            while !seen(&rx.borrow(), node) {
                if tokio::time::timeout(Duration::from_secs(120), rx.changed()).await.is_err() {
                    eprintln!("selectors: the watch of {node} never saw {last}");
                    break;
                }
            }
        }
        let secs = started.elapsed().as_secs_f64();
        let cpu = api_pid.map(|p| rss_and_ticks(p).1).unwrap_or(0).saturating_sub(ticks0) as f64 / 100.0;
        let (events1, bytes1) = watch_counters(&client).await;
        pumps.iter().for_each(|p| p.abort());
        drop(rxs);
        results.push((selection, cpu, events1 - events0, bytes1 - bytes0));
        let name = match selection {
            Selection::Label => "label selector",
            Selection::Field => "field selector (with the label)",
            Selection::Everything => "the whole namespace",
        };
        println!(
            "selectors: {name}: API server CPU {cpu:.2}s over {secs:.1}s; {:.0} watch events, {:.1} MiB sent",
            events1 - events0,
            (bytes1 - bytes0) / 1048576.0
        );
    }
    if let Some(&(_, cpu_l, ev_l, b_l)) = results.iter().find(|r| r.0 == Selection::Label) {
        for (selection, cpu, ev, b) in &results {
            let name = match selection {
                Selection::Label => continue,
                Selection::Field => "field/label",
                Selection::Everything => "whole namespace/label",
            };
            println!(
                "selectors: {name}: API server CPU {:.2}x, events {:.2}x, bytes {:.2}x",
                cpu / cpu_l,
                ev / ev_l,
                b / b_l
            );
        }
    }
}
