//! NodePlan mode under faults, end to end: the real `nodeplan agent` binary against a real
//! kube-apiserver (see `k8s_support`), the CRD installed through the API, one namespace per test.
//! The agent is SIGKILLed mid-plan, the API server restarts mid-plan, and a Secret plan and a
//! NodePlan share one agent. Handshakes are FIFOs the instructions write to or wait on and the
//! agent's log lines; timeouts are hang guards.

mod common;
mod k8s_support;

use common::*;
use k8s_support::ControlPlane;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use nodeplan::nodeplan::resource::NodePlanStatus;
use nodeplan::nodeplan::source::api_resource;
use nodeplan::plan;
use nodeplan::remote::client::{SecretClient, SecretRef, SecretSnapshot};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// A node with NodePlan mode on (plus `extra_mode`), its namespace and the producer's client.
struct Node {
    node: ClusterNode,
    api: Api<DynamicObject>,
    namespace: String,
}

impl std::ops::Deref for Node {
    type Target = ClusterNode;
    fn deref(&self) -> &ClusterNode {
        &self.node
    }
}

impl Node {
    async fn new(cp: &ControlPlane, test: &str, kubeconfig: &str, extra_mode: &str) -> Node {
        cp.install_nodeplan_crd().await;
        let namespace = cp.new_namespace(test).await;
        let api = Api::namespaced_with(cp.client().await, &namespace, &api_resource());
        let mode = format!("nodePlanEnabled: true\nnodeName: node-a\n{extra_mode}");
        Node { node: ClusterNode::new(&mode, kubeconfig, &namespace), api, namespace }
    }

    async fn create(&self, name: &str, plan: serde_json::Value) {
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "agent.cattle.io/v1alpha1",
            "kind": "NodePlan",
            "metadata": {"name": name, "namespace": self.namespace, "labels": {"cattle.io/node": "node-a"}},
            "spec": {"plan": plan, "nodeName": "node-a"},
        }))
        .unwrap();
        self.api.create(&PostParams::default(), &obj).await.unwrap();
    }

    async fn status(&self, name: &str) -> NodePlanStatus {
        let o = self.api.get(name).await.unwrap();
        o.data.get("status").cloned().map(|s| serde_json::from_value(s).unwrap()).unwrap_or_default()
    }

    /// Poll the NodePlan's status until `pred` holds (a failed read, e.g. while the API server
    /// comes back, is read again).
    async fn wait(&self, name: &str, what: &str, pred: impl Fn(&NodePlanStatus) -> bool) -> NodePlanStatus {
        let deadline = Instant::now() + GUARD;
        loop {
            let s = match self.api.get(name).await {
                Ok(o) => o.data.get("status").cloned().map(|s| serde_json::from_value(s).unwrap()),
                Err(_) => None,
            };
            if let Some(s) = s {
                if pred(&s) {
                    return s;
                }
                assert!(Instant::now() < deadline, "nodeplan {name} never got {what}: {s:?}");
            }
            assert!(Instant::now() < deadline, "nodeplan {name} never got {what} (no status read)");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

fn sh(name: &str, script: &str) -> serde_json::Value {
    json!({"name": name, "command": "sh", "args": ["-c", script], "saveOutput": true})
}

fn phase(p: &'static str) -> impl Fn(&NodePlanStatus) -> bool {
    move |s| s.phase == p
}

/// Let the agent's user read the NodePlans of `namespace` and do `status_verbs` on their status
/// (replaced on every call; the authorizer picks a change up asynchronously).
async fn grant(cp: &ControlPlane, namespace: &str, status_verbs: &[&str]) {
    use k8s_openapi::api::rbac::v1::Role;
    let role_name = "nodeplan-recovery-agent";
    let mut rules =
        vec![json!({"apiGroups": ["agent.cattle.io"], "resources": ["nodeplans"], "verbs": ["get", "list", "watch"]})];
    if !status_verbs.is_empty() {
        rules.push(json!({"apiGroups": ["agent.cattle.io"], "resources": ["nodeplans/status"], "verbs": status_verbs}));
    }
    let role = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": role_name, "namespace": namespace},
        "rules": rules,
    });
    let pp = PatchParams::apply("nodeplan-tests").force();
    Api::<Role>::namespaced(cp.client().await, namespace).patch(role_name, &pp, &Patch::Apply(&role)).await.unwrap();
    cp.bind_agent(namespace, role_name).await;
}

/// Wait until the agent's user may (or may not) write the status of `name`: a dry-run write of
/// the status as it is (a conflict means it got past the authorizer).
async fn until_status_writable(as_agent: &Api<DynamicObject>, name: &str, allowed: bool) {
    let deadline = Instant::now() + GUARD;
    let dry_run = PostParams { dry_run: true, ..PostParams::default() };
    loop {
        let now = match as_agent.get(name).await {
            Ok(o) => match as_agent.replace_status(name, &dry_run, &o).await {
                Ok(_) => Some(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Some(true),
                Err(kube::Error::Api(s)) if s.code == 403 => Some(false),
                Err(e) => panic!("dry-run status write of {name}: {e}"),
            },
            Err(_) => None,
        };
        if now == Some(allowed) {
            return;
        }
        assert!(Instant::now() < deadline, "the role change never took effect (want allowed = {allowed})");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn checks_out(s: &NodePlanStatus, progress: &str) {
    assert_eq!(s.phase, "Applied", "{s:?}");
    assert_eq!(s.progress, progress, "{s:?}");
    assert_eq!((s.attempts, s.successes, s.failures), (1, 1, 0), "counters: {s:?}");
    assert!(s.checkpoint.is_none(), "no checkpoint left: {s:?}");
    assert!(s.conditions.iter().any(|c| c.type_ == "Applied" && c.status == "True"), "{s:?}");
    assert!(s.instructions.iter().all(|i| i.exit_code == Some(0)), "{:?}", s.instructions);
}

/// R17 in NodePlan mode: the agent SIGKILLed while an instruction runs leaves that instruction
/// running; the next agent stops it before anything runs, runs the plan again from its first
/// instruction (its side effect shows twice), and the status ends `Applied` with one attempt and
/// one success.
#[tokio::test]
async fn a_killed_agent_mid_plan_stops_the_leftover_and_runs_the_plan_again() {
    let Some(cp) = ControlPlane::shared_for_custom_resources().await else { return };
    let n = Node::new(cp, "np-sigkill", &cp.kubeconfig_yaml(), "").await;
    let (log, ready, gate, pidfile, overlap) =
        (n.p("log"), n.fifo("ready"), n.fifo("gate"), n.p("pid"), n.p("overlap"));
    let plan = json!({"instructions": [
        sh("one", &format!("echo one >> {log}; echo out-one")),
        sh("two", &format!("{}; echo two >> {log}; echo > {ready}; read x < {gate}; echo out-two", overlap_check(&pidfile, &overlap, "two"))),
        sh("three", &format!("echo three >> {log}")),
    ]});
    n.create("k", plan).await;

    let first = n.agent();
    let first_pid = first.child.id();
    read_fifo(&ready);
    n.wait("k", "Executing", phase("Executing")).await;
    let leftover: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    first.crash();
    assert!(alive(leftover), "a SIGKILLed agent leaves its instruction running (what the next one must stop)");
    assert_eq!(n.status("k").await.phase, "Executing", "the status still says the plan runs");

    let mut second = n.agent();
    // The second run of instruction two is the handshake: by then recovery must have stopped the
    // first run's instruction, and instruction one must have run again.
    read_fifo(&ready);
    let left = started_by(first_pid);
    let was_alive = alive(leftover);
    kill_all(&left);
    assert!(!was_alive && left.is_empty(), "the leftover tree is stopped before the re-run (R17): {left:?}");
    assert!(!Path::new(&overlap).exists(), "two copies of instruction two ran at once");
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        "one\ntwo\none\ntwo\n",
        "the plan ran again from instruction one"
    );
    release_fifo(&gate);

    let s = n.wait("k", "Applied", phase("Applied")).await;
    checks_out(&s, "3/3");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "one\ntwo\none\ntwo\nthree\n");
    let outputs: Vec<(&str, &str)> = s.instructions.iter().map(|i| (i.name.as_str(), i.output.as_str())).collect();
    assert_eq!(outputs, [("one", "out-one\n"), ("two", "out-two\n"), ("three", "")]);
    second.wait_log("succeeded (3/3 instructions)");
    assert_eq!(second.stop(), 0);
}

/// R13 in NodePlan mode: the API server goes away while an instruction runs and the plan finishes
/// while it is down (its outcome cannot be written); once the server is back, the status shows
/// `Applied` with the instructions' results without any change to the NodePlan bringing it there
/// (same generation, no write by the test). That it lands at the watch's relist rather than at
/// the write's back-off step is shown by
/// `a_kept_status_lands_when_the_watch_lists_again_not_at_its_back_off_step`.
#[tokio::test]
async fn an_apiserver_restart_mid_plan_loses_no_status() {
    let Some(mut own) = ControlPlane::start_for_custom_resources().await else { return };
    let n = Node::new(&own, "np-outage", &own.kubeconfig_yaml(), "").await;
    let (log, ready, go) = (n.p("log"), n.fifo("ready"), n.fifo("go"));
    let plan = json!({"instructions": [
        sh("one", &format!("echo one >> {log}; echo out-one")),
        sh("two", &format!("echo > {ready}; cat {go} > /dev/null; echo done")),
    ]});
    n.create("o", plan).await;
    let mut agent = n.agent();
    read_fifo(&ready);
    n.wait("o", "Executing", phase("Executing")).await;
    let generation = n.api.get("o").await.unwrap().metadata.generation;

    own.stop_apiserver().await;
    release_fifo(&go);
    // The plan finished while the server was down: its outcome could not be written.
    agent.wait_log("succeeded (2/2 instructions)");
    agent.wait_log("cannot write the outcome of nodeplan");
    own.start_apiserver().await;

    let s = n.wait("o", "Applied after the outage", phase("Applied")).await;
    checks_out(&s, "2/2");
    let outputs: Vec<(&str, &str)> = s.instructions.iter().map(|i| (i.name.as_str(), i.output.as_str())).collect();
    assert_eq!(outputs, [("one", "out-one\n"), ("two", "done\n")]);
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "one\n", "run once");
    assert_eq!(n.api.get("o").await.unwrap().metadata.generation, generation, "the spec never changed");
    assert_eq!(agent.stop(), 0);
}

/// R17 in NodePlan mode: a run that finished while its status could not be written is recorded on
/// the node, and an agent started after a crash writes that outcome instead of running the plan a
/// second time. The agent's status writes are refused (its role loses `nodeplans/status`, its
/// watch goes on) while the instruction finishes; once the refusal is logged, the agent is
/// SIGKILLed, the role comes back and a new agent starts.
#[tokio::test]
async fn a_finished_run_is_written_after_a_crash_not_run_again() {
    let Some(cp) = ControlPlane::shared_for_custom_resources().await else { return };
    let n = Node::new(cp, "np-kept", &cp.kubeconfig_yaml_as_agent(), "").await;
    let as_agent: Api<DynamicObject> = Api::namespaced_with(cp.agent_client().await, &n.namespace, &api_resource());
    grant(cp, &n.namespace, &["get", "update", "patch"]).await;
    // It may publish Events: the refusal is told on the NodePlan too.
    let events: k8s_openapi::api::rbac::v1::Role = serde_json::from_value(json!({
        "metadata": {"name": "events", "namespace": n.namespace},
        "rules": [{"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "get", "patch"]}],
    }))
    .unwrap();
    Api::namespaced(cp.client().await, &n.namespace).create(&PostParams::default(), &events).await.unwrap();
    cp.bind_agent(&n.namespace, "events").await;
    let (ready, go, marker) = (n.fifo("ready"), n.fifo("go"), n.p("marker"));
    n.create(
        "k",
        json!({"instructions": [
            sh("a", &format!("echo ran >> {marker}; echo > {ready}; cat {go} > /dev/null; echo done")),
        ]}),
    )
    .await;
    until_status_writable(&as_agent, "k", true).await;
    let mut agent = n.agent();
    read_fifo(&ready);
    n.wait("k", "Executing", phase("Executing")).await;
    grant(cp, &n.namespace, &[]).await;
    until_status_writable(&as_agent, "k", false).await;
    release_fifo(&go);
    next_failure(&mut agent);
    k8s_support::wait_events(&cp.client().await, &n.namespace, "k", "Refused", |ev| {
        ev.iter().any(|e| e.0 == "Refused" && e.1.contains("forbids the agent to") && e.1.contains("nodeplans/status"))
    })
    .await;
    agent.crash();
    grant(cp, &n.namespace, &["get", "update", "patch"]).await;
    until_status_writable(&as_agent, "k", true).await;
    assert_eq!(n.status("k").await.phase, "Executing", "the outcome did not land before the crash");

    let mut agent = n.agent();
    agent.wait_log("its outcome was kept on the node");
    let s = n.wait("k", "Applied from the kept outcome", phase("Applied")).await;
    checks_out(&s, "1/1");
    assert_eq!(s.instructions[0].output, "done\n");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "ran\n", "the finished run did not run again");
    assert_eq!(agent.stop(), 0);
}

/// A silent partition in NodePlan mode, without a Lease (as under Rancher's per-machine role,
/// which grants no Leases): only the watch's own liveness bound can notice it. A cancel written
/// right after the heal stops the running instruction, and a new NodePlan created right after a
/// second heal is applied, each within 30 s of the heal; nothing runs twice and the agent is
/// never restarted.
#[tokio::test]
async fn a_silent_partition_heals_without_a_restart_or_a_lease() {
    heals_without_a_lease("np-silence", Hole::Silence).await;
}

/// The same when the path slows to a trickle (a byte each way every 50 ms) and the connections
/// that were slow stay slow after the heal: nothing is closed and no request of the agent's but
/// its watch is in flight, so only the connection's PINGs (answered too late behind the trickling
/// event) move it to a new connection; without them the watch would wait out its 320 s bound.
#[tokio::test]
async fn a_slow_path_heals_without_a_restart_or_a_lease() {
    heals_without_a_lease("np-slow", Hole::Slow).await;
}

async fn heals_without_a_lease(name: &str, hole: Hole) {
    const HOLE: Duration = Duration::from_secs(12);
    const AFTER_HEAL: Duration = Duration::from_secs(30);
    let Some(cp) = ControlPlane::shared_for_custom_resources().await else { return };
    let server = cp.server_url();
    let relay = Relay::start(server.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap());
    let n = Node::new(cp, name, &relay.kubeconfig(&cp.kubeconfig_yaml(), &server), "leaseDuration: 0s\n").await;
    let (ready, pid, marker) = (n.fifo("ready"), n.p("pid"), n.p("marker"));
    n.create(
        "c",
        json!({"instructions": [
            sh("one", &format!("echo one >> {marker}")),
            sh("long", &format!("echo long >> {marker}; echo $$ > {pid}; echo > {ready}; exec sleep 600")),
        ]}),
    )
    .await;
    let mut agent = n.agent();
    read_fifo(&ready);
    let long: i32 = std::fs::read_to_string(&pid).unwrap().trim().parse().unwrap();
    n.wait("c", "Executing", phase("Executing")).await;

    hole.open(&relay);
    tokio::time::sleep(HOLE).await; // the fault itself: the hole lasts this long
    hole.close(&relay);
    let healed = Instant::now();
    let cancel = json!({"spec": {"canceled": true}});
    n.api.patch("c", &PatchParams::default(), &Patch::Merge(&cancel)).await.unwrap();
    let deadline = healed + AFTER_HEAL;
    while alive(long) {
        assert!(Instant::now() < deadline, "the running instruction still runs {AFTER_HEAL:?} after the heal");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let canceled = healed.elapsed();
    n.wait("c", "Cancelled", phase("Cancelled")).await;

    hole.open(&relay);
    tokio::time::sleep(HOLE).await;
    hole.close(&relay);
    let healed = Instant::now();
    n.create("d", json!({"instructions": [sh("next", &format!("echo next >> {marker}"))]})).await;
    n.wait("d", "Applied", phase("Applied")).await;
    let applied = healed.elapsed();
    assert!(applied < AFTER_HEAL, "applied {applied:?} after the heal");
    eprintln!("heal to canceled: {canceled:?}; heal to applied: {applied:?}");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\nlong\nnext\n", "nothing ran twice");
    assert_eq!(agent.stop(), 0, "the same agent all along");
}

/// The point of the NodePlan watch's relist: a status write kept through an outage lands as soon
/// as the watch lists again after the API server is reachable, not at the write's next back-off
/// step. The outage is a broken connection to an API server that stays up (through a [`Relay`]): a
/// watch resumed from its last resourceVersion (kube's watcher) then says nothing until the next
/// change, and only a relist tells the agent it is back. Deterministic handshakes on the agent's
/// log and the authorizer, not timing:
/// - the agent's status writes are refused first (its role loses `update` on `nodeplans/status`;
///   its watch goes on), so the outcome's back-off grows (1, 2, 4, 8, 16 s) while the watch is
///   healthy and nothing about the NodePlan changes;
/// - then the status writes are allowed again (a role change: nothing the watch sees), the agent's
///   connection is cut until its watch has failed to list, and restored: the watch lists again
///   ("is back"), and the kept outcome lands then, long before the back-off's next step.
#[tokio::test]
async fn a_kept_status_lands_when_the_watch_lists_again_not_at_its_back_off_step() {
    let Some(cp) = ControlPlane::shared_for_custom_resources().await else { return };
    let server = cp.server_url();
    let target: u16 = server.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap();
    let proxy = Relay::start(target);
    let kubeconfig = cp.kubeconfig_yaml_as_agent().replace(&server, &format!("https://127.0.0.1:{}", proxy.port));
    let n = Node::new(cp, "np-relist", &kubeconfig, "").await;
    let as_agent: Api<DynamicObject> = Api::namespaced_with(cp.agent_client().await, &n.namespace, &api_resource());
    grant(cp, &n.namespace, &["get", "update", "patch"]).await;
    let deadline = Instant::now() + GUARD;
    while as_agent.list(&Default::default()).await.is_err() {
        assert!(Instant::now() < deadline, "the binding never took effect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (ready, go) = (n.fifo("ready"), n.fifo("go"));
    n.create("r", json!({"instructions": [sh("a", &format!("echo > {ready}; cat {go} > /dev/null; echo done"))]}))
        .await;
    let mut agent = n.agent();
    read_fifo(&ready);
    n.wait("r", "Executing", phase("Executing")).await;
    let resource_version = n.api.get("r").await.unwrap().metadata.resource_version;

    grant(cp, &n.namespace, &[]).await;
    until_status_writable(&as_agent, "r", false).await;
    release_fifo(&go);
    let (mut at, mut step) = next_failure(&mut agent);
    while step < Duration::from_secs(16) {
        (at, step) = next_failure(&mut agent);
    }
    assert_eq!(
        n.api.get("r").await.unwrap().metadata.resource_version,
        resource_version,
        "nothing was written to the NodePlan meanwhile"
    );

    grant(cp, &n.namespace, &["get", "update", "patch"]).await;
    until_status_writable(&as_agent, "r", true).await;
    proxy.cut();
    agent.wait_log("failed; listing again in");
    proxy.heal();
    agent.wait_log("the watch of NodePlans labelled cattle.io/node=node-a");
    let s = n.wait("r", "Applied once the API server is reachable again", phase("Applied")).await;
    let landed = Instant::now();
    assert!(
        landed + Duration::from_secs(2) < at + step,
        "written when the watch listed again ({:?} before the back-off's next step), not at that step",
        (at + step).saturating_duration_since(landed)
    );
    checks_out(&s, "1/1");
    assert_eq!(s.instructions[0].output, "done\n");
    let late: Vec<String> = agent.drain().into_iter().filter(|l| retrying_in(l).is_some()).collect();
    assert!(late.is_empty(), "no failed attempt once the watch was back: {late:#?}");
    assert_eq!(agent.stop(), 0);
}

/// The plan Secret's state (for the waits of the mixed test).
async fn secret(client: &SecretClient) -> SecretSnapshot {
    client.get().await.unwrap().expect("the secret exists")
}

fn val(s: &SecretSnapshot, key: &str) -> String {
    s.data.get(key).map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default()
}

async fn wait_secret(client: &SecretClient, what: &str, pred: impl Fn(&SecretSnapshot) -> bool) -> SecretSnapshot {
    let deadline = Instant::now() + GUARD;
    loop {
        let s = secret(client).await;
        if pred(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "the secret never got {what}: plan-state {:?}", val(&s, "plan-state"));
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The one loop looks at the plan Secret while a NodePlan runs (to say that it waits); that look
/// must not count as the legacy flow's first run after a start. A Secret without `plan-state`
/// whose plan is already applied (its `applied-checksum`) is applied once more at every start, as
/// system-agent does: here it arrives while a NodePlan runs, and runs once the NodePlan is done.
#[tokio::test]
async fn a_legacy_plan_seen_while_a_nodeplan_runs_is_still_applied_at_start() {
    let Some(cp) = ControlPlane::shared_for_custom_resources().await else { return };
    let n = Node::new(cp, "np-legacy", &cp.kubeconfig_yaml(), "remoteEnabled: true\n").await;
    let client =
        SecretClient::new(cp.client().await, SecretRef { namespace: n.namespace.clone(), name: "machine-plan".into() });
    let (ready, go, marker) = (n.fifo("ready"), n.fifo("go"), n.p("marker"));
    n.create("hold", json!({"instructions": [sh("hold", &format!("echo > {ready}; cat {go} > /dev/null"))]})).await;
    let mut agent = n.agent();
    read_fifo(&ready);
    let raw = serde_json::to_vec(&json!({"instructions": [sh("again", &format!("echo again >> {marker}"))]})).unwrap();
    let checksum = plan::checksum(&raw);
    let data =
        BTreeMap::from([("plan".to_string(), raw), ("applied-checksum".to_string(), checksum.as_bytes().to_vec())]);
    client.create(data, BTreeMap::new()).await.unwrap();
    let id = plan::id_of(
        &serde_json::to_vec(&json!({"instructions": [sh("again", &format!("echo again >> {marker}"))]})).unwrap(),
    )
    .unwrap();
    agent.wait_log(&format!("plan {id}: waiting for nodeplan {}/hold to finish", n.namespace));
    release_fifo(&go);
    n.wait("hold", "Applied", phase("Applied")).await;
    agent.wait_log(&format!("plan {id}: applying (1 instruction)"));
    let deadline = Instant::now() + GUARD;
    while std::fs::read_to_string(&marker).unwrap_or_default() != "again\n" {
        assert!(Instant::now() < deadline, "the legacy plan was not applied at start");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(agent.stop(), 0);
}

/// One agent, two sources: the plan Secret (remote mode) and a NodePlan on the same node never run
/// at the same time, whichever starts first. Each instruction writes `start NAME` and `end NAME`
/// to one file; the file must be those pairs, never interleaved, and both plans finish. A gate
/// holds the first plan's instruction until the other plan has been taken up and is waiting for its
/// turn (a Secret plan still `pending` with a log line saying it waits, a NodePlan Pending with a
/// Waiting condition naming the holder).
#[tokio::test]
async fn a_secret_plan_and_a_nodeplan_on_one_node_never_overlap() {
    let Some(cp) = ControlPlane::shared_for_custom_resources().await else { return };
    let n = Node::new(cp, "np-mixed", &cp.kubeconfig_yaml(), "remoteEnabled: true\n").await;
    let client =
        SecretClient::new(cp.client().await, SecretRef { namespace: n.namespace.clone(), name: "machine-plan".into() });
    let shared = n.p("shared");
    let step = |name: &str, gate: Option<(&str, &str)>| {
        let wait = gate.map(|(ready, go)| format!("echo > {ready}; cat {go} > /dev/null; ")).unwrap_or_default();
        sh(name, &format!("echo start {name} >> {shared}; {wait}sleep 0.1; echo end {name} >> {shared}"))
    };
    let started = |name: &str| std::fs::read_to_string(&shared).unwrap_or_default().contains(&format!("start {name}"));

    // 1. The NodePlan runs first; the Secret's plan arrives while its first instruction is held.
    let (ready1, go1) = (n.fifo("ready1"), n.fifo("go1"));
    n.create("np1", json!({"instructions": [step("n1", Some((&ready1, &go1))), step("n2", None)]})).await;
    let mut agent = n.agent();
    read_fifo(&ready1);
    let plan1 = json!({"instructions": [step("s1", None), step("s2", None)]});
    let raw1 = serde_json::to_vec(&plan1).unwrap();
    let checksum1 = plan::checksum(&raw1);
    let data = BTreeMap::from([("plan".to_string(), raw1), ("plan-state".to_string(), b"pending".to_vec())]);
    client.create(data, BTreeMap::new()).await.unwrap();
    // Taken up and waiting for its turn, with nothing committed meanwhile (no `in-progress`
    // before its turn: the loop looks at it while the NodePlan runs, and says it waits).
    let id1 = plan::id_of(&serde_json::to_vec(&plan1).unwrap()).unwrap();
    agent.wait_log(&format!("plan {id1}: waiting for nodeplan {}/np1 to finish", n.namespace));
    let s = client.get().await.unwrap().unwrap();
    assert_eq!(val(&s, "plan-state"), "pending", "nothing committed before its turn");
    assert!(!started("s1"), "the Secret's plan started while the NodePlan ran");
    release_fifo(&go1);
    checks_out(&n.wait("np1", "Applied", phase("Applied")).await, "2/2");
    let s = wait_secret(&client, "succeeded", |s| val(s, "plan-state") == "succeeded").await;
    assert_eq!(val(&s, "applied-checksum"), checksum1);

    // 2. The Secret's plan runs first; a NodePlan arrives while its first instruction is held.
    let (ready2, go2) = (n.fifo("ready2"), n.fifo("go2"));
    let plan2 = json!({"instructions": [step("s3", Some((&ready2, &go2))), step("s4", None)]});
    let raw2 = serde_json::to_vec(&plan2).unwrap();
    let checksum2 = plan::checksum(&raw2);
    use base64::Engine as _;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    client.orchestrator_patch(json!({"data": {"plan": b64(&raw2), "plan-state": b64(b"pending")}})).await.unwrap();
    read_fifo(&ready2);
    n.create("np2", json!({"instructions": [step("n3", None), step("n4", None)]})).await;
    let waiting = n
        .wait("np2", "Pending with a Waiting condition", |s| {
            s.phase == "Pending" && s.conditions.iter().any(|c| c.type_ == "Waiting" && c.reason == "LockHeld")
        })
        .await;
    assert!(waiting.execution_state.lock_holder.starts_with("remote:"), "{waiting:?}");
    assert!(!started("n3"), "the NodePlan started while the Secret's plan ran");
    release_fifo(&go2);
    checks_out(&n.wait("np2", "Applied", phase("Applied")).await, "2/2");
    wait_secret(&client, "the second plan succeeded", |s| {
        val(s, "plan-state") == "succeeded" && val(s, "applied-checksum") == checksum2
    })
    .await;

    let text = std::fs::read_to_string(&shared).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    for pair in lines.chunks(2) {
        let name = pair[0].strip_prefix("start ").unwrap_or_else(|| panic!("interleaved:\n{text}"));
        assert_eq!(pair.get(1).copied(), Some(format!("end {name}").as_str()), "interleaved:\n{text}");
    }
    let order: Vec<&str> = lines.iter().filter_map(|l| l.strip_prefix("start ")).collect();
    assert_eq!(order, ["n1", "n2", "s1", "s2", "s3", "s4", "n3", "n4"], "{text}");
    assert_eq!(agent.stop(), 0);
}
