//! The fleet benchmark (issue 14): one real kube-apiserver, N agents (default 200; `--agents 500`
//! or NODEPLAN_BENCH_AGENTS), each with its own plan Secret and directories. Prints, side by side:
//!
//! 1. rollout time of a trivial plan to every node: `nodeplan rollout --max-concurrent 100%`
//!    against the baseline of writing every Secret directly (as many writes in flight as the
//!    CLI's fan-out, `fleet::objects::PARALLEL`) and waiting for all to succeed;
//! 2. cancel fan-out: `nodeplan plan cancel --selector` over every node running a long
//!    instruction, p50/p99 from the command's start to each Secret showing `canceled`;
//! 3. idle: API writes per agent-hour (Secrets and Leases, from a watch), agent RSS (sum and per
//!    agent) and CPU, and the API server's CPU, over two windows (NODEPLAN_BENCH_IDLE_SECS, default
//!    60 each), each beginning once the agents have settled (NODEPLAN_BENCH_SETTLE_SECS, default
//!    55: an agent's Lease goes idle one `leaseDuration` after its last plan, 40 s, at the next
//!    renewal, up to 10 s later): one with every node holding a succeeded plan (a node's usual
//!    state between plans; before phase 2), one after the cancel (every node holding a canceled
//!    plan).
//!
//! With NODEPLAN_BENCH_BASELINE=<an older nodeplan binary>, phases 2 and 3 run again with that
//! build's agents (in a namespace of their own, after this build's have stopped) and the ratios are
//! printed; with NODEPLAN_BENCH_ROUNDS=R as well, R fleets of each build, in the order A B B A ...
//! (the fleet that runs first is slower: see `main`). Phase 2 also prints what each part of the
//! fan-out cost: the CLI's run, each agent's part (from the cancel landing to `canceled`), CPU
//! by process and API requests by verb. Each agent of this build uses one inotify instance; when
//! the user's `fs.inotify.max_user_instances` leaves fewer than N, it says so (see `inotify_room`).
//!
//! With `-- --side-by-side` (and NODEPLAN_BENCH_BASELINE) it measures instead idle agents of both
//! builds at the same time on one API server, N of each (`--agents 20` is enough): CPU and
//! wake-ups per agent ([`side_by_side`]), after the settling time, over the idle window. Their
//! Secrets carry no plan, or with `--succeeded` a trivial plan each agent runs as it starts and
//! then holds `succeeded` (a node's usual state between Rancher's plans).
//!
//! With `-- --cycles N` (and NODEPLAN_BENCH_BASELINE) it measures instead one agent of each build,
//! A B B A, through N plans each started and canceled ([`cycles`]): the agent's CPU per start
//! (the plan written → `in-progress`) and per cancel (the annotation → `canceled`), each counted
//! until 300 ms after the state was written so the work that follows it (the Event, the status
//! board) is in. The per-cancel cost of the fleet's fan-out, without 500 agents.
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
    _pids: tempfile::TempDir,
    agent: std::process::Child,
}

/// A directory for an agent's `pidDirectory` where a node has it: on a tmpfs (a node's
/// `/run/nodeplan/pids`; `/run` is a tmpfs wherever systemd runs), here `/dev/shm`. Elsewhere, and
/// before 6 December 2026, beside the rest under the system's temporary directory: on this
/// machine's ext4 root the status board's replacements alone cost an agent about an eighth of its
/// CPU per plan started or canceled (a twentieth on a tmpfs; docs/benchmarks.md), which a node
/// does not pay.
fn pid_dir() -> tempfile::TempDir {
    const TMPFS_MAGIC: rustix::fs::FsWord = 0x0102_1994;
    let shm = Path::new("/dev/shm");
    let on_tmpfs = rustix::fs::statfs(shm).is_ok_and(|f| f.f_type == TMPFS_MAGIC);
    let mut b = tempfile::Builder::new();
    b.prefix("nodeplan-bench-pids");
    if on_tmpfs && let Ok(d) = b.tempdir_in(shm) {
        return d;
    }
    b.tempdir().expect("tempdir")
}

fn write_0600(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).expect("write");
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
}

fn start_node(cp: &k8s_support::ControlPlane, ns: &str, name: &str, binary: &Path) -> Node {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().display().to_string();
    let pids = pid_dir();
    let p = pids.path().display();
    let conn = serde_json::json!({"kubeConfig": cp.kubeconfig_yaml(), "namespace": ns, "secretName": name});
    write_0600(&dir.path().join("conn.json"), &serde_json::to_vec(&conn).expect("json"));
    let cfg = format!(
        "remoteEnabled: true\nconnectionInfoFile: {d}/conn.json\nworkDirectory: {d}/work\npidDirectory: {p}/pids\n\
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
    Node { _dir: dir, _pids: pids, agent }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

/// Resident KiB of a process.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// CPU time of processes' threads by thread id, in nanoseconds: the time each thread ran, from its
/// `schedstat` (the scheduler's own clock). Not `stat`'s user and system ticks: those are sampled
/// at the timer tick (250 Hz here), and a process that wakes for well under a tick at a time (an
/// idle agent, each of 500 agents handling one cancel) can be charged nothing at all. Not a sum
/// per process either: a thread that exits (tokio's blocking threads do, after 10 s idle) would
/// take what it ran before the window out of the sum. Beside the time, how many times each thread
/// was given the CPU (`schedstat`'s third field): an idle process's cost on a quiet host is mostly
/// its wake-ups.
struct Cpu(BTreeMap<u32, (u64, u64)>);

impl Cpu {
    fn of(pids: impl IntoIterator<Item = u32>) -> Cpu {
        let mut by = BTreeMap::new();
        for pid in pids {
            for t in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
                let tid = t.file_name().to_str().and_then(|v| v.parse().ok());
                let stat = std::fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
                let fields: Vec<u64> = stat.split_whitespace().filter_map(|v| v.parse().ok()).collect();
                if let (Some(tid), [ns, _, runs]) = (tid, fields.as_slice()) {
                    by.insert(tid, (*ns, *runs));
                }
            }
        }
        Cpu(by)
    }

    /// Seconds run since `before`, by the threads alive now (what a thread that exited between
    /// ran in the window is not counted: idle threads exit).
    fn since(&self, before: &Cpu) -> f64 {
        self.delta(before, |v| v.0) as f64 / 1e9
    }

    /// Times the threads alive now were given the CPU since `before`.
    fn runs_since(&self, before: &Cpu) -> u64 {
        self.delta(before, |v| v.1)
    }

    fn delta(&self, before: &Cpu, field: fn(&(u64, u64)) -> u64) -> u64 {
        let then = |t: &u32| before.0.get(t).map_or(0, field);
        self.0.iter().map(|(t, now)| field(now).saturating_sub(then(t))).sum()
    }
}

/// The `program` process (kube-apiserver, etcd) serving `cp`, found by its data directory on its
/// command line.
fn server_pid(program: &str, dir: &Path) -> Option<u32> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let argv0 = cmd.split(|b| *b == 0).next().unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd);
        (String::from_utf8_lossy(argv0).ends_with(program) && cmd.contains(&needle)).then_some(pid)
    })
}

/// CPU time of the fleet's agents in all, the API server and etcd.
fn fleet_cpu(cp: &k8s_support::ControlPlane, nodes: &[Node]) -> [Cpu; 3] {
    let server = |p| Cpu::of(server_pid(p, cp.dir()));
    [Cpu::of(nodes.iter().map(|nd| nd.agent.id())), server("kube-apiserver"), server("etcd")]
}

/// CPU seconds used by waited-for children so far (the CLI runs).
fn children_cpu() -> f64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}

/// Wait (watching the selected Secrets) until every one of `n` shows `state` for the plan of
/// `checksum`; per node, when, and when the watch first showed it the cancel annotation (the
/// CLI's write had landed).
async fn wait_all(
    client: kube::Client,
    ns: String,
    n: usize,
    checksum: String,
    state: &'static str,
    started: Instant,
) -> (BTreeMap<String, Duration>, BTreeMap<String, Duration>) {
    let mut at = BTreeMap::new();
    let mut asked = BTreeMap::new();
    let scope = Scope { kind: Kind::Secrets, namespace: Some(ns), selector: "bench=fleet".into() };
    let mut stream = nodeplan::fleet::objects::watch(client, &scope);
    while at.len() < n {
        let Some(e) = tokio::time::timeout(Duration::from_secs(600), stream.next()).await.ok().flatten() else { break };
        if let Selected::Is(name, Object::Secret(s)) = e {
            if s.annotations.get("plan.cattle.io/canceled").is_some_and(|v| v == "true") {
                asked.entry(name.clone()).or_insert_with(|| started.elapsed());
            }
            let ours = s.data.get("plan").is_some_and(|p| nodeplan::plan::checksum(p) == checksum);
            let st = s.data.get("plan-state").map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
            if ours && st == state {
                at.entry(name).or_insert_with(|| started.elapsed());
            }
        }
    }
    (at, asked)
}

/// Write the plan into every Secret ([`push_all`]) and wait until each shows it `state`.
async fn push_and_wait(client: &kube::Client, ns: &str, names: &[String], raw: &[u8], state: &'static str) {
    let sum = nodeplan::plan::checksum(raw);
    let waiter = tokio::spawn(wait_all(client.clone(), ns.to_string(), names.len(), sum, state, Instant::now()));
    push_all(client, ns, names, raw).await;
    let _ = waiter.await;
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
    /// Over the fan-out (the CLI's start to the last `canceled`): the CLI's wall time, and CPU
    /// seconds of the agents in all, the API server, etcd and the CLI.
    cancel_cli_s: f64,
    /// Per node, from the cancel's landing (as the watch saw it) to `canceled`.
    agent_p50_ms: f64,
    agent_p99_ms: f64,
    cancel_cpu: [f64; 4],
    /// Requests the API server answered over the fan-out (and the two reads of its counters), by
    /// verb and resource.
    cancel_requests: BTreeMap<String, f64>,
    /// The idle window with every node holding a succeeded plan (a node's usual state between
    /// plans), before the long plan and its cancel.
    succeeded: Idle,
    /// The idle window after the cancel fan-out (every node holding a canceled plan).
    canceled_idle: Idle,
}

/// What an idle window measured.
struct Idle {
    writes_per_agent_hour: f64,
    rss_mib_each: f64,
    cpu_pct: f64,
    api_cpu_pct: f64,
    etcd_cpu_pct: f64,
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
    (settle_secs, idle_secs): (u64, u64),
) -> Measured {
    let n = names.len();
    let done = serde_json::json!({"instructions": [{"name": "done", "command": "true", "args": ["idle"]}]});
    let (_, raw) = plan_file(work, "done.plan", &done);
    push_and_wait(client, ns, names, &raw, "succeeded").await;
    let succeeded = idle(cp, client, ns, nodes, (settle_secs, idle_secs)).await;
    let long = serde_json::json!({"instructions": [{"name": "long", "command": "sleep", "args": ["600"]}]});
    let (_, raw) = plan_file(work, "long.plan", &long);
    let sum = nodeplan::plan::checksum(&raw);
    push_and_wait(client, ns, names, &raw, "in-progress").await;
    let requests0 = request_counters(client).await;
    let (cpu0, cli0) = (fleet_cpu(cp, nodes), children_cpu());
    let started = Instant::now();
    let waiter = tokio::spawn(wait_all(client.clone(), ns.to_string(), n, sum.clone(), "canceled", started));
    cli(ns, &cp.kubeconfig_path(), &["plan", "cancel", "-l", "bench=fleet"]);
    let cancel_cli_s = started.elapsed().as_secs_f64();
    let (at, asked) = waiter.await.expect("waiter");
    // Per node, from the cancel landing to `canceled`: the agent's part of the fan-out.
    let mut reacted: Vec<f64> =
        at.iter().filter_map(|(k, d)| Some(d.checked_sub(*asked.get(k)?)?.as_secs_f64() * 1000.0)).collect();
    let cpu1 = fleet_cpu(cp, nodes);
    let spent = |i: usize| cpu1[i].since(&cpu0[i]);
    let cancel_cpu = [spent(0), spent(1), spent(2), children_cpu() - cli0];
    let mut cancel_requests = request_counters(client).await;
    for (k, v) in &mut cancel_requests {
        *v -= requests0.get(k).copied().unwrap_or(0.0);
    }
    cancel_requests.retain(|_, v| *v >= 1.0);
    let mut ms: Vec<f64> = at.values().map(|d| d.as_secs_f64() * 1000.0).collect();
    let canceled_idle = idle(cp, client, ns, nodes, (settle_secs, idle_secs)).await;
    Measured {
        cancel_p50_ms: pct(&mut ms, 0.5),
        cancel_p99_ms: pct(&mut ms, 0.99),
        canceled: at.len(),
        cancel_cli_s,
        agent_p50_ms: pct(&mut reacted, 0.5),
        agent_p99_ms: pct(&mut reacted, 0.99),
        cancel_cpu,
        cancel_requests,
        succeeded,
        canceled_idle,
    }
}

/// Phase 3, an idle window of the fleet: after `settle_secs`, API writes, memory and CPU over
/// `idle_secs`.
async fn idle(
    cp: &k8s_support::ControlPlane,
    client: &kube::Client,
    ns: &str,
    nodes: &[Node],
    (settle_secs, idle_secs): (u64, u64),
) -> Idle {
    let n = nodes.len();
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
    tokio::time::sleep(Duration::from_secs(settle_secs)).await;
    writes.store(0, std::sync::atomic::Ordering::Relaxed);
    let (api, etcd) = (server_pid("kube-apiserver", cp.dir()), server_pid("etcd", cp.dir()));
    let agents = || Cpu::of(nodes.iter().map(|nd| nd.agent.id()));
    let (before, api_before, etcd_before) = (agents(), Cpu::of(api), Cpu::of(etcd));
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let (cpu, api_cpu, etcd_cpu) =
        (agents().since(&before), Cpu::of(api).since(&api_before), Cpu::of(etcd).since(&etcd_before));
    counter.abort();
    let secs = idle_secs as f64;
    let rss_total: u64 = nodes.iter().map(|nd| rss_kib(nd.agent.id())).sum();
    Idle {
        writes_per_agent_hour: writes.load(std::sync::atomic::Ordering::Relaxed) as f64 / n as f64 * 3600.0 / secs,
        rss_mib_each: rss_total as f64 / 1024.0 / n as f64,
        cpu_pct: cpu / secs * 100.0,
        api_cpu_pct: api_cpu / secs * 100.0,
        etcd_cpu_pct: etcd_cpu / secs * 100.0,
    }
}

fn show(what: &str, n: usize, idle_secs: u64, m: &Measured) {
    println!(
        "{what}: cancel fan-out to {n} running nodes: p50 {:.0} ms, p99 {:.0} ms ({} of {n} canceled; system-agent polls every 2 s)",
        m.cancel_p50_ms, m.cancel_p99_ms, m.canceled
    );
    let [agents, api, etcd, cli] = m.cancel_cpu;
    println!(
        "{what}: over the fan-out: from a cancel's landing to canceled p50 {:.0} ms, p99 {:.0} ms; the CLI ran {:.2}s; CPU seconds: agents {agents:.2} ({:.1} ms each), API server {api:.2}, etcd {etcd:.2}, CLI {cli:.2}",
        m.agent_p50_ms,
        m.agent_p99_ms,
        m.cancel_cli_s,
        agents * 1000.0 / n as f64
    );
    let requests: Vec<String> = m.cancel_requests.iter().map(|(k, v)| format!("{k} {v:.0}")).collect();
    println!("{what}: API requests over the fan-out: {}", requests.join(", "));
    for (state, i) in [("succeeded", &m.succeeded), ("canceled", &m.canceled_idle)] {
        println!(
            "{what}: idle holding a {state} plan, {idle_secs}s: {:.0} API writes per agent-hour (Secrets and Leases; an idle agent's Lease renewal alone is about 15), agents' RSS {:.1} MiB each, agents' CPU {:.2}% of one core in all, API server CPU {:.2}% and etcd {:.2}% of one core ({:.2} s and {:.2} s per 180 s; system-agent's 200, issue 40: 5.5 s and 1.65 s)",
            i.writes_per_agent_hour,
            i.rss_mib_each,
            i.cpu_pct,
            i.api_cpu_pct,
            i.etcd_cpu_pct,
            i.api_cpu_pct * 1.8,
            i.etcd_cpu_pct * 1.8
        );
    }
}

fn stop(nodes: Vec<Node>) {
    for nd in &nodes {
        unsafe { libc::kill(nd.agent.id() as i32, libc::SIGTERM) };
    }
    for mut nd in nodes {
        let _ = nd.agent.wait();
    }
}

/// Say so when the agents cannot each have an inotify instance: they share one user's
/// `fs.inotify.max_user_instances` (128 by default; a node's one agent has its own). An agent
/// without one looks for Rancher's agent every 5 s instead (src/remote/rival.rs), which is the
/// idle cost of a node with no inotify left, not of a node.
fn inotify_room(n: usize) {
    let limit: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let in_use = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|p| std::fs::read_dir(p.path().join("fd")).ok())
        .flatten()
        .flatten()
        .filter(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t.as_os_str() == "anon_inode:inotify"))
        .count();
    if in_use + n > limit {
        println!(
            "fleet: WARNING fs.inotify.max_user_instances is {limit} and {in_use} are in use: about {} of {n} agents have no inotify and look for Rancher's agent every 5 s (raise it for this run to measure one agent per node: sysctl fs.inotify.max_user_instances={})",
            (in_use + n).saturating_sub(limit).min(n),
            (in_use + 2 * n).next_power_of_two()
        );
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
    let settle_secs: u64 = std::env::var("NODEPLAN_BENCH_SETTLE_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(55);
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
    if let Some(n) = args.windows(2).find(|w| w[0] == "--cycles").and_then(|w| w[1].parse().ok()) {
        cycles(&cp, n, baseline.as_deref()).await;
        return;
    }
    if args.iter().any(|a| a == "--side-by-side") {
        let Some(baseline) = baseline else {
            eprintln!("fleet: --side-by-side measures against NODEPLAN_BENCH_BASELINE=<an older nodeplan binary>");
            return;
        };
        let succeeded = args.iter().any(|a| a == "--succeeded");
        side_by_side(&cp, n, &baseline, (settle_secs, idle_secs), succeeded).await;
        return;
    }
    inotify_room(n);
    let client = cp.client().await;
    let (ns, names) = fleet_secrets(&cp, &client, n).await;
    // What the API server and etcd cost with no agent at all, subtracted below: on a 2-core
    // machine their own idle work is most of what the idle windows see.
    let alone = plane_alone(&cp, idle_secs).await;
    println!("the control plane alone, {idle_secs}s: API server {:.2}% and etcd {:.2}% of one core", alone.0, alone.1);
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
    let (at, _) = waiter.await.expect("waiter");
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

    let first = cancel_and_idle(&cp, &client, &ns, &names, &nodes, work.path(), (settle_secs, idle_secs)).await;
    show("this build", n, idle_secs, &first);
    per_agent("this build", n, alone, &first);
    stop(nodes);
    let Some(baseline) = baseline else { return };
    // The same fleet of the older build, on the same API server, one after the other (never both
    // at once: they would share the cores). The order matters: a fleet measured later runs on an
    // API server that has warmed up (this build measured against itself: p50 1.37x, p99 1.20x
    // for the fleet that ran first). With NODEPLAN_BENCH_ROUNDS=R the fleets run as
    // A B B A A B ..., R of each, and the ratios are of the means.
    let rounds: usize = std::env::var("NODEPLAN_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1);
    let (mut ours, mut theirs) = (vec![first], Vec::new());
    for i in 1..2 * rounds {
        let this = i % 4 == 0 || i % 4 == 3;
        let (what, binary) = match this {
            true => ("this build".to_string(), PathBuf::from(NODEPLAN)),
            false => (format!("baseline {}", baseline.display()), baseline.clone()),
        };
        let (ns, names) = fleet_secrets(&cp, &client, n).await;
        let nodes: Vec<Node> = names.iter().map(|name| start_node(&cp, &ns, name, &binary)).collect();
        let m = cancel_and_idle(&cp, &client, &ns, &names, &nodes, work.path(), (settle_secs, idle_secs)).await;
        show(&what, n, idle_secs, &m);
        per_agent(&what, n, alone, &m);
        stop(nodes);
        if this { ours.push(m) } else { theirs.push(m) }
    }
    let ratio = |f: fn(&Measured) -> f64| {
        let mean = |ms: &[Measured]| ms.iter().map(f).sum::<f64>() / ms.len() as f64;
        mean(&ours) / mean(&theirs)
    };
    println!(
        "this build / baseline ({rounds} of each): idle agents' CPU {:.2}x holding a succeeded plan, {:.2}x a canceled one; API server CPU {:.2}x and {:.2}x; etcd CPU {:.2}x (succeeded); cancel p50 {:.2}x, p99 {:.2}x, agents' CPU over the fan-out {:.2}x, RSS {:.2}x",
        ratio(|m| m.succeeded.cpu_pct),
        ratio(|m| m.canceled_idle.cpu_pct),
        ratio(|m| m.succeeded.api_cpu_pct),
        ratio(|m| m.canceled_idle.api_cpu_pct),
        ratio(|m| m.succeeded.etcd_cpu_pct),
        ratio(|m| m.cancel_p50_ms),
        ratio(|m| m.cancel_p99_ms),
        ratio(|m| m.cancel_cpu[0]),
        ratio(|m| m.canceled_idle.rss_mib_each),
    );
    let added = |m: &Measured| m.succeeded.api_cpu_pct + m.succeeded.etcd_cpu_pct - alone.0 - alone.1;
    let mean = |ms: &[Measured]| ms.iter().map(added).sum::<f64>() / ms.len() as f64;
    println!(
        "this build / baseline: API server + etcd CPU per idle agent (holding a succeeded plan, above the control plane alone) {:.2}x",
        mean(&ours) / mean(&theirs)
    );
}

/// The API server's and etcd's CPU (% of one core) over `secs` with no agent running.
async fn plane_alone(cp: &k8s_support::ControlPlane, secs: u64) -> (f64, f64) {
    let (api, etcd) = (server_pid("kube-apiserver", cp.dir()), server_pid("etcd", cp.dir()));
    let (a, e) = (Cpu::of(api), Cpu::of(etcd));
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let s = secs as f64;
    (Cpu::of(api).since(&a) / s * 100.0, Cpu::of(etcd).since(&e) / s * 100.0)
}

/// What each idle agent adds to the API server and etcd, above the control plane alone.
fn per_agent(what: &str, n: usize, alone: (f64, f64), m: &Measured) {
    for (state, i) in [("succeeded", &m.succeeded), ("canceled", &m.canceled_idle)] {
        let api = (i.api_cpu_pct - alone.0) * 10.0 / n as f64;
        let etcd = (i.etcd_cpu_pct - alone.1) * 10.0 / n as f64;
        println!(
            "{what}: each idle agent holding a {state} plan adds {api:.3} ms of API server CPU and {etcd:.3} ms of etcd CPU per second ({:.1} ms per 180 s in all)",
            (api + etcd) * 180.0
        );
    }
}

/// One agent of this build (and of `baseline`: A B B A) through `n` plans each started and canceled:
/// its CPU per start and per cancel, and the ratios.
async fn cycles(cp: &k8s_support::ControlPlane, n: usize, baseline: Option<&Path>) {
    let client = cp.client().await;
    let work = tempfile::tempdir().expect("tempdir");
    let builds: Vec<(&str, &Path)> = match baseline {
        Some(b) => vec![
            ("this build", Path::new(NODEPLAN)),
            ("baseline", b),
            ("baseline", b),
            ("this build", Path::new(NODEPLAN)),
        ],
        None => vec![("this build", Path::new(NODEPLAN))],
    };
    let mut means: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for (what, binary) in builds {
        let (ns, names) = fleet_secrets(cp, &client, 1).await;
        let node = start_node(cp, &ns, &names[0], binary);
        let pid = node.agent.id();
        let secret = SecretClient::new(client.clone(), SecretRef { namespace: ns.clone(), name: names[0].clone() });
        let (mut start, mut cancel) = (0.0, 0.0);
        // Run 0 warms up (connections, the first directories) and is not counted.
        for i in 0..=n {
            let long = serde_json::json!({"instructions": [{"name": "long", "command": "sleep", "args": ["600", i.to_string()]}]});
            let (_, raw) = plan_file(work.path(), "cycle.plan", &long);
            let sum = nodeplan::plan::checksum(&raw);
            let settled = || tokio::time::sleep(Duration::from_millis(300));
            let cpu0 = Cpu::of([pid]);
            push_and_wait(&client, &ns, &names, &raw, "in-progress").await;
            settled().await;
            let cpu1 = Cpu::of([pid]);
            let canceled =
                tokio::spawn(wait_all(client.clone(), ns.clone(), 1, sum.clone(), "canceled", Instant::now()));
            let patch = nodeplan::remote::wire::annotation_patch(nodeplan::plan::ANNOTATION_CANCELED, Some("true"));
            if let Err(e) = secret.orchestrator_patch(patch).await {
                eprintln!("fleet: cancel: {e}");
            }
            let _ = canceled.await;
            settled().await;
            if i > 0 {
                start += cpu1.since(&cpu0);
                cancel += Cpu::of([pid]).since(&cpu1);
            }
        }
        stop(vec![node]);
        let (start_ms, cancel_ms) = (start * 1000.0 / n as f64, cancel * 1000.0 / n as f64);
        println!(
            "{what} ({}): CPU per start {start_ms:.2} ms, per cancel {cancel_ms:.2} ms ({n} plans)",
            binary.display()
        );
        means.entry(what).or_default().push((start_ms, cancel_ms));
    }
    let mean = |v: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| v.iter().map(f).sum::<f64>() / v.len() as f64;
    if let (Some(a), Some(b)) = (means.get("this build"), means.get("baseline")) {
        println!(
            "this build / baseline: CPU per start {:.2}x, per cancel {:.2}x",
            mean(a, |m| m.0) / mean(b, |m| m.0),
            mean(a, |m| m.1) / mean(b, |m| m.1)
        );
    }
}

/// Idle agents of this build and of `baseline`, `n` of each, at the same time on one API server
/// (each with a plan Secret of its own and no plan): after `settle_secs`, their CPU time and
/// wake-ups per agent per 10 s over `idle_secs`, and the ratios. Both builds share the host and
/// the API server for the whole window, so neither is measured on a quieter one; a few minutes
/// for 20 of each, where the A B B A fleets take a quarter of an hour.
async fn side_by_side(
    cp: &k8s_support::ControlPlane,
    n: usize,
    baseline: &Path,
    (settle_secs, idle_secs): (u64, u64),
    succeeded: bool,
) {
    inotify_room(2 * n);
    let client = cp.client().await;
    let (ours_ns, ours_names) = fleet_secrets(cp, &client, n).await;
    let (theirs_ns, theirs_names) = fleet_secrets(cp, &client, n).await;
    let plan = serde_json::json!({"instructions": [{"name": "a", "command": "true"}]});
    let raw = serde_json::to_vec(&plan).expect("plan");
    if succeeded {
        push_all(&client, &ours_ns, &ours_names, &raw).await;
        push_all(&client, &theirs_ns, &theirs_names, &raw).await;
    }
    // Started in turns, so neither build's agents start on a busier API server.
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for (a, b) in ours_names.iter().zip(&theirs_names) {
        ours.push(start_node(cp, &ours_ns, a, Path::new(NODEPLAN)));
        theirs.push(start_node(cp, &theirs_ns, b, baseline));
    }
    println!(
        "fleet: {n} idle agents of this build and {n} of {} side by side, {}; settling {settle_secs}s",
        baseline.display(),
        if succeeded { "each holding a succeeded plan" } else { "no plan" }
    );
    if succeeded {
        let sum = nodeplan::plan::checksum(&raw);
        for ns in [&ours_ns, &theirs_ns] {
            wait_all(client.clone(), ns.clone(), n, sum.clone(), "succeeded", Instant::now()).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(settle_secs)).await;
    let cpu = |nodes: &[Node]| Cpu::of(nodes.iter().map(|nd| nd.agent.id()));
    let before = [cpu(&ours), cpu(&theirs)];
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let after = [cpu(&ours), cpu(&theirs)];
    let per_agent_10s = |v: f64| v / n as f64 / idle_secs as f64 * 10.0;
    let ms = |i: usize| per_agent_10s(after[i].since(&before[i]) * 1000.0);
    let runs = |i: usize| per_agent_10s(after[i].runs_since(&before[i]) as f64);
    for (i, what) in [(0, "this build".to_string()), (1, format!("baseline {}", baseline.display()))] {
        println!("{what}: idle, {idle_secs}s: {:.3} ms of CPU and {:.1} wake-ups per agent per 10 s", ms(i), runs(i));
    }
    println!(
        "this build / baseline, side by side: idle agents' CPU {:.2}x, wake-ups {:.2}x",
        ms(0) / ms(1),
        runs(0) / runs(1)
    );
    stop(ours);
    stop(theirs);
}

/// The API server's `/metrics` text (empty when it cannot be read: the counters then read 0).
async fn metrics_text(client: &kube::Client) -> String {
    let Ok(req) = http::Request::get("/metrics").body(Vec::new()) else { return String::new() };
    client.request_text(req).await.unwrap_or_default()
}

/// The API server's count of requests answered, by verb and resource (`apiserver_request_total`,
/// summed over codes and scopes), watches excluded.
async fn request_counters(client: &kube::Client) -> BTreeMap<String, f64> {
    let mut by = BTreeMap::new();
    let text = metrics_text(client).await;
    for l in text.lines().filter(|l| l.starts_with("apiserver_request_total{")) {
        let label = |k: &str| l.split(&format!("{k}=\"")).nth(1).and_then(|r| r.split('"').next()).unwrap_or("");
        let (verb, resource) = (label("verb"), label("resource"));
        if verb == "WATCH" || resource.is_empty() {
            continue;
        }
        if let Some(v) = l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()) {
            *by.entry(format!("{verb} {resource}")).or_default() += v;
        }
    }
    by
}

/// The API server's counters of watch events sent for NodePlans: (events, bytes), summed over
/// the label sets that name them (`apiserver_watch_events_total` and
/// `apiserver_watch_events_sizes_sum`; 1.20 labels them by kind, later releases by resource).
async fn watch_counters(client: &kube::Client) -> (f64, f64) {
    let text = metrics_text(client).await;
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
    let api_pid = server_pid("kube-apiserver", cp.dir());
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
        let cpu0 = Cpu::of(api_pid);
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
        let cpu = Cpu::of(api_pid).since(&cpu0);
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
