//! NodePlan mode end to end: the real `nodeplan agent` binary against a real kube-apiserver (built
//! with the vendor fix that lets it serve custom resources, see tools/build-kube-apiserver.sh),
//! the CRD installed through the API, one namespace per test. The producer's side is played by
//! the test through its own client. Timeouts are hang guards.

mod common;
mod k8s_support;

use common::*;
use k8s_support::{ControlPlane, wait_events};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use nodeplan::nodeplan::resource::NodePlanStatus;
use nodeplan::nodeplan::source::api_resource;
use serde_json::json;
use std::time::{Duration, Instant};

macro_rules! control_plane {
    () => {
        match ControlPlane::shared_for_custom_resources().await {
            Some(cp) => cp,
            None => return,
        }
    };
}

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
    async fn new(cp: &ControlPlane, test: &str) -> Node {
        Node::new_with(cp, test, &cp.kubeconfig_yaml()).await
    }

    /// The agent connects with `kubeconfig` (the test's own client stays the admin's).
    async fn new_with(cp: &ControlPlane, test: &str, kubeconfig: &str) -> Node {
        Node::named(cp, test, kubeconfig, "node-a").await
    }

    /// The node `node`, in a namespace of its own.
    async fn named(cp: &ControlPlane, test: &str, kubeconfig: &str, node: &str) -> Node {
        cp.install_nodeplan_crd().await;
        let namespace = cp.new_namespace(test).await;
        let api = Api::namespaced_with(cp.client().await, &namespace, &api_resource());
        let mode = format!("nodePlanEnabled: true\nnodeName: {node}\n");
        Node { node: ClusterNode::new(&mode, kubeconfig, &namespace), api, namespace }
    }

    /// Create a NodePlan for `node` as a producer does: labelled for it, and naming it in
    /// `spec.nodeName` unless `spec` names a node itself.
    async fn create(&self, name: &str, node: &str, mut spec: serde_json::Value) {
        if spec.get("nodeName").is_none() {
            spec["nodeName"] = json!(node);
        }
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "agent.cattle.io/v1alpha1",
            "kind": "NodePlan",
            "metadata": {"name": name, "namespace": self.namespace, "labels": {"cattle.io/node": node}},
            "spec": spec,
        }))
        .unwrap();
        self.api.create(&PostParams::default(), &obj).await.unwrap();
    }

    async fn patch_spec(&self, name: &str, spec: serde_json::Value) {
        self.api.patch(name, &PatchParams::default(), &Patch::Merge(json!({"spec": spec}))).await.unwrap();
    }

    async fn status(&self, name: &str) -> NodePlanStatus {
        let o = self.api.get(name).await.unwrap();
        o.data.get("status").cloned().map(|s| serde_json::from_value(s).unwrap()).unwrap_or_default()
    }

    /// Poll the NodePlan's status (the observable outcome) until `pred` holds.
    async fn wait(&self, name: &str, what: &str, pred: impl Fn(&NodePlanStatus) -> bool) -> NodePlanStatus {
        let deadline = Instant::now() + GUARD;
        loop {
            let s = self.status(name).await;
            if pred(&s) {
                return s;
            }
            assert!(Instant::now() < deadline, "nodeplan {name} never got {what}: {s:?}");
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

#[tokio::test]
async fn a_nodeplan_is_applied_with_its_results_readable_in_status() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-apply").await;
    let marker = n.p("marker");
    let plan =
        json!({"instructions": [sh("one", &format!("echo one >> {marker}; echo out-one")), sh("two", "exit 0")]});
    n.create("install", "node-a", json!({"plan": plan})).await;
    n.create("elsewhere", "node-b", json!({"plan": {"instructions": [sh("x", &format!("echo x >> {marker}"))]}})).await;
    let mut agent = n.agent();
    // The agent watches its node's NodePlans by field selector where the API server selects them
    // by spec.nodeName (the definition's selectableFields: 1.31 and later), by label alone on 1.20.
    if cp.version().at_least(1, 31) {
        agent.wait_log(&format!(
            "NodePlan mode: watching NodePlans labelled cattle.io/node=node-a in namespace {} with the field selector spec.nodeName=node-a",
            n.namespace
        ));
    } else {
        k8s_support::loud(&format!(
            "kube-apiserver {}: no field selector on NodePlans, the agent selects by label",
            cp.version()
        ));
        agent.wait_log("by label only: the API server does not select NodePlans by spec.nodeName");
    }
    let s = n.wait("install", "Applied", phase("Applied")).await;
    assert_eq!((s.progress.as_str(), s.successes, s.attempts), ("2/2", 1, 1));
    assert_eq!(s.observed_generation, 1);
    assert_eq!(s.instructions.len(), 2);
    assert_eq!((s.instructions[0].name.as_str(), s.instructions[0].output.as_str()), ("one", "out-one\n"));
    assert_eq!(s.instructions[0].exit_code, Some(0));
    assert!(s.conditions.iter().any(|c| c.type_ == "Applied" && c.status == "True"));
    agent.wait_log("succeeded (2/2 instructions)");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "one\n", "another node's plan never runs here");
    // Events regarding the NodePlan, readable with kubectl.
    wait_events(&n.api.clone().into_client(), &n.namespace, "install", "Started and Succeeded", |ev| {
        ev.iter().any(|e| e.0 == "Started") && ev.iter().any(|e| e.0 == "Succeeded" && e.1.contains("2/2"))
    })
    .await;
    let out = cp.kubectl().args(["get", "events", "-n", &n.namespace]).output().unwrap();
    let events = String::from_utf8_lossy(&out.stdout);
    assert!(events.contains("Succeeded") && events.contains("nodeplan/install"), "{events}");
    // The node's Lease, held by this agent while it runs.
    let out = cp
        .kubectl()
        .args(["get", "lease", "nodeplan-node-node-a", "-n", &n.namespace, "-o", "jsonpath={.spec.holderIdentity}"])
        .output()
        .unwrap();
    let holder = String::from_utf8_lossy(&out.stdout);
    // `<node>/<boot id>/<pid namespace>/<pid>/<start time>`.
    let pid = holder.rsplit('/').nth(1).unwrap_or_default();
    assert!(holder.starts_with("node-a/") && pid == agent.child.id().to_string(), "{holder:?}");
    assert_eq!(n.status("elsewhere").await.phase, "", "and its status is not touched");
    // `kubectl get nodeplans` (built from the apiserver's source) shows the printer columns.
    let out = cp.kubectl().args(["get", "nodeplans", "-n", &n.namespace]).output().unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let header: Vec<&str> = table.lines().next().unwrap_or_default().split_whitespace().collect();
    assert_eq!(header, ["NAME", "NODE", "PHASE", "PROGRESS", "AGE"], "{table}");
    let row = table.lines().find(|l| l.starts_with("install ")).unwrap_or_else(|| panic!("{table}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(&cols[..4], ["install", "node-a", "Applied", "2/2"], "{table}");
    assert_eq!(agent.stop(), 0);
}

#[tokio::test]
async fn the_schema_rejects_a_malformed_plan_and_the_agent_refuses_unknown_fields() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-refuse").await;
    // The API server rejects what the schema forbids: an instruction without a name.
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "agent.cattle.io/v1alpha1", "kind": "NodePlan",
        "metadata": {"name": "bad", "namespace": n.namespace, "labels": {"cattle.io/node": "node-a"}},
        "spec": {"nodeName": "node-a", "plan": {"instructions": [{"command": "true"}]}},
    }))
    .unwrap();
    match n.api.create(&PostParams::default(), &obj).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 422, "{s:?}");
            // What `kubectl create` and `nodeplan plan push` show: 1.20 names the field without
            // the item's index, the current release with it.
            let field = if cp.version().at_least(1, 21) {
                "spec.plan.instructions[0].name: Required value"
            } else {
                "spec.plan.instructions.name: Required value"
            };
            assert!(s.message.contains(field), "kube-apiserver {}: {s:?}", cp.version());
        }
        other => panic!("a malformed plan was accepted: {other:?}"),
    }
    // A field this agent does not know (a newer producer's) is refused in status, never ignored.
    let marker = n.p("marker");
    let spec = json!({"plan": {"instructions": [sh("a", &format!("echo ran >> {marker}"))]}, "rollout": {"batch": 2}});
    n.create("newer", "node-a", spec).await;
    let mut agent = n.agent();
    let s = n.wait("newer", "Failed", phase("Failed")).await;
    let c = s.conditions.iter().find(|c| c.type_ == "Applied").expect("a condition");
    assert_eq!(c.reason, "Unsupported");
    assert!(c.message.contains("spec.rollout"), "{c:?}");
    agent.wait_log("spec.rollout");
    assert!(!std::path::Path::new(&marker).exists(), "nothing ran");
    // Issue 43: fixed, it runs and shows its real phase; refused again and fixed again, it goes
    // back to that phase (it stayed Failed/Unsupported) without running again.
    n.patch_spec("newer", json!({"rollout": null})).await;
    n.wait("newer", "Applied once fixed", phase("Applied")).await;
    n.patch_spec("newer", json!({"rollout": {"batch": 3}})).await;
    n.wait("newer", "Failed again", phase("Failed")).await;
    n.patch_spec("newer", json!({"rollout": null})).await;
    let s = n.wait("newer", "Applied again", phase("Applied")).await;
    let c = s.conditions.iter().find(|c| c.type_ == "Applied").expect("a condition");
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "Applied"), "{c:?}");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "ran\n", "it ran once");
    assert_eq!(agent.stop(), 0);
}

/// R31 in NodePlan mode: the state directories' filesystem stops answering writes while a run
/// goes on. Its outcome still reaches the status; a NodePlan created meanwhile cannot save its run
/// and waits, and its cancel is written at once; after the thaw nothing of it runs and the saved
/// runs are removed in order.
#[tokio::test]
async fn a_frozen_state_disk_holds_neither_a_status_nor_a_cancel() {
    let cp = control_plane!();
    let Some(disk) = StateDisk::new() else { return };
    let n = Node::new(cp, "np-frozen-disk").await;
    n.state_on(&disk);
    let (go, started) = (n.fifo("go"), n.p("started"));
    let plan_a = json!({"plan": {"instructions": [sh("a", &format!("touch {started}; read x < {go}; true"))]}});
    n.create("a", "node-a", plan_a).await;
    let mut agent = disk.agent(&n.config);
    n.wait("a", "Executing", |s| s.state == Some(nodeplan::plan::PlanState::InProgress)).await;
    // Frozen once the instruction runs (its execution directory made), not merely committed.
    wait_for_file(&started);
    disk.freeze();
    release_fifo(&go);
    n.wait("a", "Applied while the disk is frozen", phase("Applied")).await;
    agent.wait_log("the disk did not answer in 5s); writing it");
    let ran = n.p("ran-b");
    n.create("b", "node-a", json!({"plan": {"instructions": [sh("b", &format!("touch {ran}"))]}})).await;
    agent.wait_log("cannot keep the run on this node");
    n.patch_spec("b", json!({"canceled": true})).await;
    n.wait("b", "Cancelled while the disk is frozen", phase("Cancelled")).await;
    disk.thaw();
    let done = n.p("ran-c");
    n.create("c", "node-a", json!({"plan": {"instructions": [sh("c", &format!("touch {done}"))]}})).await;
    n.wait("c", "Applied after the thaw", phase("Applied")).await;
    assert!(std::path::Path::new(&done).exists());
    assert!(!std::path::Path::new(&ran).exists(), "the canceled NodePlan never ran");
    let deadline = Instant::now() + GUARD;
    while !disk.list("nodeplans").is_empty() {
        assert!(Instant::now() < deadline, "a saved run stayed on the node: {:?}", disk.list("nodeplans"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(agent.stop(), 0);
}

/// A full state disk in NodePlan mode: a new NodePlan cannot save its run on the node, so it does
/// not begin. The agent says why in a `NotStarted` Event on the NodePlan (once), and the plan
/// begins once there is room again; nothing of it runs before.
#[tokio::test]
async fn a_full_state_disk_holds_a_nodeplan_until_there_is_room() {
    let cp = control_plane!();
    let Some(disk) = StateDisk::new() else { return };
    let n = Node::new(cp, "np-full-disk").await;
    n.state_on(&disk);
    n.create("a", "node-a", json!({"plan": {"instructions": [sh("a", "true")]}})).await;
    let mut agent = disk.agent(&n.config);
    n.wait("a", "Applied", phase("Applied")).await;
    disk.fill("filler");
    let ran = n.p("ran-b");
    n.create("b", "node-a", json!({"plan": {"instructions": [sh("b", &format!("touch {ran}"))]}})).await;
    let line = agent.wait_log("No space left on device");
    assert!(line.contains("retrying in"), "{line}");
    agent.wait_log("No space left on device");
    let said = wait_events(&n.api.clone().into_client(), &n.namespace, "b", "NotStarted", |ev| {
        ev.iter().any(|e| e.0 == "NotStarted")
    })
    .await;
    let not_started: Vec<_> = said.iter().filter(|e| e.0 == "NotStarted").collect();
    assert!(not_started.len() == 1 && not_started[0].2 == 1, "{said:?}");
    assert!(not_started[0].1.contains("No space left"), "{said:?}");
    assert!(!std::path::Path::new(&ran).exists(), "nothing of b ran on a full disk");
    disk.unfill("filler");
    n.wait("b", "Applied once there is room", phase("Applied")).await;
    assert!(std::path::Path::new(&ran).exists());
    agent.stop_cleanly();
}

#[tokio::test]
async fn pause_then_resume_without_rerunning_then_cancel_a_tree() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-pause").await;
    let (log, ready, gate) = (n.p("log"), n.fifo("ready"), n.fifo("gate"));
    let plan = json!({"instructions": [
        sh("one", &format!("echo one >> {log}")),
        sh("two", &format!("echo two >> {log}; echo > {ready}; read x < {gate}")),
        sh("three", &format!("echo three >> {log}")),
    ]});
    n.create("p", "node-a", json!({"plan": plan})).await;
    let mut agent = n.agent();
    read_fifo(&ready);
    n.patch_spec("p", json!({"paused": true})).await;
    agent.wait_log("pause requested");
    std::fs::write(&gate, b"go\n").unwrap();
    let s = n.wait("p", "Paused", phase("Paused")).await;
    let cp1 = s.checkpoint.expect("a checkpoint");
    assert_eq!((cp1.completed_instructions, cp1.paused), (2, true));
    assert_eq!(s.progress, "2/3");
    n.patch_spec("p", json!({"paused": false})).await;
    let s = n.wait("p", "Applied", phase("Applied")).await;
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "one\ntwo\nthree\n", "instruction three only after the resume");
    assert_eq!(s.instructions.len(), 3, "the results of the instructions not run again are kept");

    // Cancel a running tree, including a setsid grandchild.
    let (ready2, pids) = (n.fifo("ready2"), n.p("tree-pids"));
    let script = format!("setsid sleep 300 & echo $! > {pids}; echo $$ >> {pids}; echo > {ready2}; exec sleep 300");
    n.create("c", "node-a", json!({"plan": {"instructions": [sh("long", &script), sh("never", "true")]}})).await;
    read_fifo(&ready2);
    let started: Vec<i32> =
        std::fs::read_to_string(&pids).unwrap().lines().map(|l| l.trim().parse().unwrap()).collect();
    n.patch_spec("c", json!({"canceled": true})).await;
    let s = n.wait("c", "Cancelled", phase("Cancelled")).await;
    assert_eq!(s.checkpoint.map(|c| c.completed_instructions), Some(0));
    for pid in started {
        assert!(!alive(pid), "pid {pid} of the canceled tree survived");
    }
    assert_eq!(agent.stop(), 0);
}

/// Three NodePlans for one node from two producers run one at a time, highest priority first,
/// then the older; none overlaps another.
#[tokio::test]
async fn several_nodeplans_run_one_at_a_time_in_the_documented_order() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-order").await;
    let (order, busy, overlap) = (n.p("order"), n.p("busy"), n.p("overlap"));
    let step = |name: &str| {
        sh(
            name,
            &format!(
                "if ! mkdir {busy} 2>/dev/null; then touch {overlap}; fi; echo {name} >> {order}; sleep 0.2; rmdir {busy}"
            ),
        )
    };
    // Created before the agent starts, so all three wait together.
    n.create("b-producer-one", "node-a", json!({"plan": {"instructions": [step("low-old")]}})).await;
    tokio::time::sleep(Duration::from_millis(1100)).await; // creation timestamps have 1 s resolution
    n.create("a-producer-two", "node-a", json!({"plan": {"instructions": [step("low-new")]}})).await;
    n.create("z-producer-two", "node-a", json!({"priority": 10, "plan": {"instructions": [step("high")]}})).await;
    let mut agent = n.agent();
    for name in ["b-producer-one", "a-producer-two", "z-producer-two"] {
        n.wait(name, "Applied", phase("Applied")).await;
    }
    assert_eq!(std::fs::read_to_string(&order).unwrap(), "high\nlow-old\nlow-new\n");
    assert!(!std::path::Path::new(&overlap).exists(), "two NodePlans ran at once");
    assert_eq!(agent.stop(), 0);
}

/// A NodePlan labelled for this node whose `spec.nodeName` names another node is not this node's
/// (the object says two things): it never runs here. It has the higher priority, so the agent
/// would run it first if it took it; the other NodePlan running alone shows it did not.
#[tokio::test]
async fn a_nodeplan_naming_another_node_in_its_spec_never_runs_here() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-othername").await;
    let order = n.p("order");
    let step = |name: &str| json!({"instructions": [sh(name, &format!("echo {name} >> {order}"))]});
    n.create("a-other", "node-a", json!({"priority": 10, "nodeName": "node-b", "plan": step("other")})).await;
    n.create("b-mine", "node-a", json!({"nodeName": "node-a", "plan": step("mine")})).await;
    let mut agent = n.agent();
    n.wait("b-mine", "Applied", phase("Applied")).await;
    assert_eq!(std::fs::read_to_string(&order).unwrap(), "mine\n", "only this node's NodePlan ran");
    assert!(n.status("a-other").await.plan_checksum.is_empty(), "nothing was written to the other node's");
    assert_eq!(agent.stop(), 0);
}

/// Deleting a NodePlan while it runs cancels it through the stop ladder (no finalizer).
#[tokio::test]
async fn deleting_a_running_nodeplan_stops_it() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-delete").await;
    let (ready, pid_file) = (n.fifo("ready"), n.p("pid"));
    let script = format!("echo $$ > {pid_file}; echo > {ready}; exec sleep 300");
    n.create("d", "node-a", json!({"plan": {"instructions": [sh("long", &script)]}})).await;
    let mut agent = n.agent();
    read_fifo(&ready);
    let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    n.api.delete("d", &DeleteParams::default()).await.unwrap();
    agent.wait_log("was deleted: canceling it");
    let deadline = Instant::now() + GUARD;
    while alive(pid) {
        assert!(Instant::now() < deadline, "the deleted plan's instruction still runs");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(n.api.get_opt("d").await.unwrap().is_none(), "no finalizer keeps it");
    assert_eq!(agent.stop(), 0);
}

/// A NodePlan `name` of node-a with one instruction, applied by the node's agent (started here and
/// returned): `Applied` (`what`), `1/1`, the instruction run once.
async fn applies_one_instruction(n: &Node, name: &str, what: &str) -> AgentProc {
    let marker = n.p("marker");
    n.create(name, "node-a", json!({"plan": {"instructions": [sh("a", &format!("echo a >> {marker}"))]}})).await;
    let agent = n.agent();
    let s = n.wait(name, what, phase("Applied")).await;
    assert_eq!(s.progress, "1/1");
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "a\n");
    agent
}

/// The shipped `deploy/nodeplan-rbac.yaml` is enough for an agent: bound to `nodeplan-agent` in
/// the node's namespace (and nothing else), it applies a NodePlan and writes its status, and it
/// cannot change a NodePlan's spec.
#[tokio::test]
async fn the_shipped_agent_role_is_enough_and_no_more() {
    use k8s_openapi::api::rbac::v1::Role;
    let cp = control_plane!();
    let n = Node::new_with(cp, "np-rbac", &cp.kubeconfig_yaml_as_agent()).await;
    let roles: Api<Role> = Api::namespaced(cp.client().await, &n.namespace);
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/nodeplan-rbac.yaml")).unwrap();
    for doc in manifest.split("\n---\n").filter(|d| d.contains("kind: Role")) {
        let role: Role = serde_yaml_ng::from_str(doc).unwrap();
        roles.create(&PostParams::default(), &role).await.unwrap();
    }
    cp.bind_agent(&n.namespace, "nodeplan-agent").await;
    let as_agent: Api<DynamicObject> = Api::namespaced_with(cp.agent_client().await, &n.namespace, &api_resource());
    // The authorizer picks the binding up asynchronously: wait until the agent may list.
    let deadline = Instant::now() + GUARD;
    while as_agent.list(&Default::default()).await.is_err() {
        assert!(Instant::now() < deadline, "the binding never took effect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut agent = applies_one_instruction(&n, "rbac", "Applied").await;
    // The agent's identity cannot rewrite the plan.
    let patch = Patch::Merge(json!({"spec": {"priority": 5}}));
    match as_agent.patch("rbac", &PatchParams::default(), &patch).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("the agent's role may change a spec: {other:?}"),
    }
    assert_eq!(agent.stop(), 0);
}

/// Under the status-writer policy (`nodeplan crd --admission-policy`, Kubernetes 1.30 and later),
/// the real agent of node-a, authenticated as `nodeplan:node:node-a` with the shipped agent Role,
/// applies its NodePlan and records the outcome. A control plane of its own: the policy is
/// cluster-wide, and the other tests' agents write as the admin.
#[tokio::test]
async fn the_nodes_own_agent_writes_its_status_under_the_status_writer_policy() {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let Some(cp) = ControlPlane::start_for_custom_resources().await else { return };
    if !cp.version().at_least(1, 30) {
        k8s_support::loud(&format!(
            "kube-apiserver {} has no ValidatingAdmissionPolicy: nothing to prove",
            cp.version()
        ));
        return;
    }
    let user = k8s_support::NODE_AGENTS[0].0;
    let n = Node::named(&cp, "np-vap", &cp.kubeconfig_yaml_as(user), "node-a").await;
    cp.install_status_policy(&n.namespace).await;
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/nodeplan-rbac.yaml")).unwrap();
    let doc = manifest.split("\n---\n").find(|d| d.contains("name: nodeplan-agent\n")).unwrap();
    let role: Role = serde_yaml_ng::from_str(doc).unwrap();
    Api::<Role>::namespaced(cp.client().await, &n.namespace).create(&PostParams::default(), &role).await.unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "node-a-agent", "namespace": n.namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "nodeplan-agent"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(cp.client().await, &n.namespace)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let mut agent = applies_one_instruction(&n, "mine", "Applied, written by the node's own agent").await;
    assert_eq!(agent.stop(), 0);
}

/// A `fileExists` probe (the NodePlan draft's probe kind): its status follows the path, right
/// after the run and then every probe period.
#[tokio::test]
async fn a_file_exists_probe_follows_its_path() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-file-probe").await;
    let ready = n.p("ready");
    let plan = json!({
        "instructions": [sh("make", &format!("touch {ready}"))],
        "probes": {"ready": {"fileExists": {"path": ready}, "successThreshold": 1, "failureThreshold": 1}},
    });
    n.create("f", "node-a", json!({"plan": plan})).await;
    let mut agent = n.agent();
    let healthy = |s: &NodePlanStatus| s.probe_statuses.get("ready").is_some_and(|p| p.healthy);
    let s = n.wait("f", "Applied and healthy", |s| s.phase == "Applied" && healthy(s)).await;
    assert_eq!(s.probe_statuses["ready"].success_count, 1);
    std::fs::remove_file(&ready).unwrap();
    n.wait("f", "unhealthy", |s| s.probe_statuses.get("ready").is_some_and(|p| !p.healthy)).await;
    assert_eq!(agent.stop(), 0);
}

/// The checksum that identifies a run of `spec` (what `status.planChecksum` names).
fn run_of(spec: &serde_json::Value) -> String {
    let spec: nodeplan::nodeplan::resource::NodePlanSpec = serde_json::from_value(spec.clone()).unwrap();
    nodeplan::nodeplan::wire::plan_checksum(&spec).unwrap()
}

fn condition<'a>(s: &'a NodePlanStatus, type_: &str) -> Option<&'a nodeplan::nodeplan::resource::Condition> {
    s.conditions.iter().find(|c| c.type_ == type_)
}

/// A failing plan is retried with back-off until `maxAttempts` runs, each with its attempt number;
/// then it stays failed and says it is not retried again. What made it fail (the instruction, its
/// exit status, its last output lines with its env value masked) is in `status.failure`, the
/// Applied condition, the Failed Event's note and `plan status --nodeplan` (issue 24).
#[tokio::test]
async fn a_failing_plan_is_retried_until_max_attempts() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-retry").await;
    let log = n.p("log");
    let mut flaky = sh("flaky", &format!("echo $CATTLE_AGENT_ATTEMPT_NUMBER >> {log}; echo no space for $KEY; exit 3"));
    flaky["env"] = json!(["KEY=s3cret-key"]);
    let plan = json!({"instructions": [flaky]});
    let retry = json!({"maxAttempts": 3, "initialDelay": "100ms", "backoffMultiplier": 2});
    n.create("r", "node-a", json!({"plan": plan, "retryStrategy": retry})).await;
    let mut agent = n.agent();
    let s = n.wait("r", "three failed runs", |s| s.phase == "Failed" && s.failures == 3).await;
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "1\n2\n3\n", "three runs, numbered");
    assert_eq!((s.attempts, s.instructions[0].exit_code), (3, Some(3)));
    assert_eq!(s.execution_state.next_retry, "", "no fourth run is scheduled");
    agent.wait_log("failed (0/1 instructions)");
    // Events: one per attempt started, and the same failure three times is one event counted 3
    // times (what keeps a crash loop from flooding the API server).
    let ev = wait_events(&n.api.clone().into_client(), &n.namespace, "r", "Failed counted 3 times", |ev| {
        ev.iter().any(|(reason, _, count)| reason == "Failed" && *count == 3)
    })
    .await;
    let started = ev.iter().filter(|(reason, _, _)| reason == "Started").count();
    assert_eq!(started, 3, "{ev:?}");
    assert_eq!(ev.iter().filter(|(reason, _, _)| reason == "Failed").count(), 1, "{ev:?}");
    let why = "instruction 1/1 flaky: exit status 3; last output: no space for ***";
    let note = &ev.iter().find(|(reason, _, _)| reason == "Failed").unwrap().1;
    let id = nodeplan::plan::id_of(&serde_json::to_vec(&plan).unwrap()).unwrap();
    assert_eq!(note, &format!("plan {id}: failed (0/1 instructions): {why}"));
    let f = s.failure.clone().expect("status.failure");
    assert_eq!((f.instruction, f.name.as_str(), f.outcome.as_str()), (Some(1), "flaky", "exit status 3"));
    assert_eq!(f.last_lines, ["no space for ***"]);
    // The saved output in the status is masked as well (issue 41).
    assert_eq!(s.instructions[0].output, "no space for ***\n");
    assert_eq!(condition(&s, "Applied").unwrap().message, format!("plan failed: {why}"));
    let out = nodeplan_cmd(cp, &["plan", "status", "--nodeplan", &format!("{}/r", n.namespace)]).output().unwrap();
    let status = String::from_utf8_lossy(&out.stdout);
    assert!(
        status.contains("failure:    instruction 1/1 flaky: exit status 3\n            | no space for ***\n"),
        "{status}"
    );
    assert!(!status.contains("s3cret"), "{status}");
    let out = nodeplan_cmd(cp, &["plan", "logs", "--nodeplan", &format!("{}/r", n.namespace)]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "instruction 1/1 flaky: FAILED (exit status 3)\n  | no space for ***\n"
    );
    let out =
        agent_status_until(&n.config, "the failure", |o| o.contains("failed: instruction 1/1 flaky: exit status 3"));
    assert!(out.contains("source:     nodeplans: the NodePlans of node node-a (Lease: held as "), "{out}");
    // The same plan with a new run token runs again from its first instruction.
    n.patch_spec(
        "r",
        json!({"runToken": "again", "plan": {"instructions": [sh("fixed", &format!("echo fixed >> {log}"))]}}),
    )
    .await;
    let s = n.wait("r", "Applied", phase("Applied")).await;
    assert_eq!((s.attempts, s.failures, s.successes), (1, 0, 1));
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "1\n2\n3\nfixed\n");
    assert_eq!(s.failure, None, "a success clears the failure");
    assert_eq!(agent.stop(), 0);
}

/// Issue 24, a plan that fails at its second instruction: its progress adds up with its results
/// (1/2, where it said 0/2 beside `result 1/2 ok`), and the failing instruction, its exit status
/// and its last output lines are in `plan status --nodeplan` (text and JSON), `plan logs` and the
/// fleet table (`plan status -l … --nodeplans`).
#[tokio::test]
async fn a_plan_failing_at_its_second_instruction_says_so_everywhere() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-second").await;
    let plan = json!({"instructions": [sh("prepare", "echo ready"), sh("boom", "echo disk full; exit 3")]});
    n.create("f", "node-a", json!({"plan": plan})).await;
    let mut agent = n.agent();
    let s = n.wait("f", "failed", |s| s.phase == "Failed").await;
    assert_eq!(s.progress, "1/2", "{s:?}");
    let target = format!("{}/f", n.namespace);
    let out = nodeplan_cmd(cp, &["plan", "status", "--nodeplan", &target]).output().unwrap();
    let status = String::from_utf8_lossy(&out.stdout);
    for want in [
        "progress:   1/2 instructions done\n",
        "failure:    instruction 2/2 boom: exit status 3\n            | disk full\n",
        "result:     1/2 prepare: ok (exit 0)\n",
    ] {
        assert!(status.contains(want), "{want:?} not in:\n{status}");
    }
    let out = nodeplan_cmd(cp, &["plan", "status", "--nodeplan", &target, "-o", "json"]).output().unwrap();
    let row: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((&row["state"], &row["completed"], &row["total"]), (&json!("failed"), &json!(1), &json!(2)), "{row}");
    assert!(row["error"].as_str().unwrap_or_default().contains("instruction 2/2 boom: exit status 3"), "{row}");
    let out = nodeplan_cmd(cp, &["plan", "logs", "--nodeplan", &target]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "instruction 1/2 prepare: ok\n  | ready\ninstruction 2/2 boom: FAILED (exit status 3)\n  | disk full\n"
    );
    let out = nodeplan_cmd(cp, &["plan", "status", "-l", "cattle.io/node=node-a", "--nodeplans", "-n", &n.namespace])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("1/2") && table.contains("instruction 2/2 boom: exit status 3; last output: disk full"),
        "{table}"
    );
    assert_eq!(agent.stop(), 0);
}

/// A `retryStrategy` that asks for no wait at all (`initialDelay: 0s`, `backoffMultiplier: 1`) is
/// held to the floor: 1 s after the first failure, then 2 s, then 4 s (it retried dozens of times
/// a second, writing the object as often).
#[tokio::test]
async fn an_eager_retry_strategy_is_held_to_the_floor() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-eager").await;
    let log = n.p("log");
    let plan = json!({"instructions": [sh("flaky", &format!("date +%s.%N >> {log}; exit 3"))]});
    let retry = json!({"maxAttempts": 4, "initialDelay": "0s", "backoffMultiplier": 1});
    n.create("r", "node-a", json!({"plan": plan, "retryStrategy": retry})).await;
    let mut agent = n.agent();
    n.wait("r", "four failed runs", |s| s.phase == "Failed" && s.failures == 4).await;
    let at: Vec<f64> = std::fs::read_to_string(&log).unwrap().lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(at.len(), 4, "{at:?}");
    let gaps: Vec<f64> = at.windows(2).map(|w| w[1] - w[0]).collect();
    for (gap, floor) in gaps.iter().zip([1.0, 2.0, 4.0]) {
        assert!(
            *gap >= floor - 0.05,
            "a retry came {gap:.3}s after the run before it, under the {floor}s floor: {gaps:?}"
        );
    }
    assert_eq!(agent.stop(), 0);
}

/// A NodePlan whose status would outgrow the object beside its large spec (400 instructions
/// with long names and arguments: a 1.5 MB spec, a status of another 0.8 MB, past the 2 MiB etcd
/// takes) still records its outcome, shortened: `Applied`, and an agent restart runs nothing
/// again.
#[tokio::test]
async fn a_status_that_outgrows_the_object_still_records_the_outcome() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-big").await;
    let runs = n.p("runs");
    let pad = "p".repeat(1600);
    let instructions: Vec<serde_json::Value> = (0..400)
        .map(|i| {
            json!({
                "name": format!("{i:04}-{}", "n".repeat(1500)),
                "command": "sh",
                "args": ["-c", format!("echo . >> {runs}; echo {}", "o".repeat(400)), pad],
                "saveOutput": true
            })
        })
        .collect();
    n.create("big", "node-a", json!({"plan": {"instructions": instructions}})).await;
    let mut agent = n.agent();
    let deadline = Instant::now() + Duration::from_secs(120);
    let s = loop {
        let s = n.status("big").await;
        if s.phase == "Applied" {
            break s;
        }
        assert!(Instant::now() < deadline, "never Applied: {} {}", s.phase, s.progress);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(s.progress, "400/400");
    agent.wait_log("the status is shortened to fit");
    assert_eq!(agent.stop(), 0);
    let mut again = n.agent();
    again.wait_log("NodePlan mode: watching");
    n.wait("big", "still Applied", phase("Applied")).await;
    tokio::time::sleep(Duration::from_secs(3)).await; // observation window: nothing may start
    assert_eq!(std::fs::read_to_string(&runs).unwrap().lines().count(), 400, "run once");
    assert_eq!(again.stop(), 0);
}

/// A failing required preflight check keeps the plan Pending (nothing runs) and is checked again
/// with back-off; once it passes the plan runs. A failing optional check is reported only.
#[tokio::test]
async fn a_required_preflight_check_holds_the_plan_until_it_passes() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-preflight").await;
    let (gate, marker) = (n.p("gate"), n.p("marker"));
    let checks = json!([
        {"name": "gate-open", "probe": {"fileExists": {"path": gate}}},
        {"name": "nice-to-have", "required": false, "probe": {"fileExists": {"path": n.p("absent")}}},
    ]);
    let plan = json!({"instructions": [sh("go", &format!("touch {marker}"))]});
    n.create("pf", "node-a", json!({"plan": plan, "preflightChecks": checks})).await;
    let mut agent = n.agent();
    let s =
        n.wait("pf", "a failed preflight", |s| condition(s, "Preflight").is_some_and(|c| c.status == "False")).await;
    assert_eq!(s.phase, "Pending");
    let c = condition(&s, "Preflight").unwrap();
    assert!(c.message.contains("gate-open") && !c.message.contains("nice-to-have"), "{c:?}");
    agent.wait_log("preflight checks failed (gate-open)");
    assert!(!std::path::Path::new(&marker).exists(), "nothing ran");
    std::fs::write(&gate, b"").unwrap();
    let s = n.wait("pf", "Applied", phase("Applied")).await;
    assert!(std::path::Path::new(&marker).exists());
    let c = condition(&s, "Preflight").unwrap();
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "OptionalCheckFailed"), "{c:?}");
    assert!(c.message.contains("nice-to-have"), "{c:?}");
    assert_eq!(agent.stop(), 0);
}

/// A run past `spec.execution.timeout` is stopped through the stop ladder (its whole tree) and
/// fails with reason Timeout; the next instruction never runs.
#[tokio::test]
async fn a_run_past_its_timeout_is_stopped_and_fails_with_reason_timeout() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-timeout").await;
    let (ready, pids, never) = (n.fifo("ready"), n.p("tree-pids"), n.p("never"));
    let script = format!("setsid sleep 300 & echo $! > {pids}; echo $$ >> {pids}; echo > {ready}; exec sleep 300");
    let plan = json!({"instructions": [sh("hang", &script), sh("after", &format!("touch {never}"))]});
    n.create("t", "node-a", json!({"plan": plan, "execution": {"timeout": "2s"}})).await;
    let mut agent = n.agent();
    read_fifo(&ready);
    let started: Vec<i32> =
        std::fs::read_to_string(&pids).unwrap().lines().map(|l| l.trim().parse().unwrap()).collect();
    let s = n.wait("t", "Failed", phase("Failed")).await;
    let c = condition(&s, "Applied").unwrap();
    assert_eq!(c.reason, "Timeout", "{c:?}");
    assert!(c.message.contains("timeout of 2s"), "{c:?}");
    assert_eq!((s.failures, s.checkpoint.clone()), (1, None));
    agent.wait_log("exceeded its timeout of 2s");
    for pid in started {
        assert!(!alive(pid), "pid {pid} of the timed-out tree survived");
    }
    assert!(!std::path::Path::new(&never).exists(), "the next instruction ran");
    assert_eq!(agent.stop(), 0);
}

/// A plan's spec changing while it runs does not change what runs: the running plan finishes,
/// then the new one runs. With the force-update annotation the running one is stopped at once.
#[tokio::test]
async fn a_spec_change_waits_for_the_running_plan_unless_forced() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-change").await;
    let (log, ready, gate) = (n.p("log"), n.fifo("ready"), n.fifo("gate"));
    let x = json!({"instructions": [sh("x", &format!("echo x-start >> {log}; echo > {ready}; read g < {gate}; echo x-end >> {log}"))]});
    let y = json!({"instructions": [sh("y", &format!("echo y >> {log}"))]});
    n.create("c", "node-a", json!({"plan": x})).await;
    let mut agent = n.agent();
    read_fifo(&ready);
    n.patch_spec("c", json!({"plan": y})).await;
    // The agent sees the change (interrupts are looked at every second and on every event) and
    // keeps running x: the gate is opened only after a later event has surely been seen.
    n.patch_spec("c", json!({"priority": 1})).await;
    release_fifo(&gate);
    let want = run_of(&json!({"plan": y}));
    let s = n.wait("c", "y applied", |s| s.phase == "Applied" && s.plan_checksum == want).await;
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "x-start\nx-end\ny\n", "x finished first");
    assert_eq!(s.instructions[0].name, "y");

    // Forced: x2 is stopped through the ladder and y2 starts.
    let (ready2, pid_file) = (n.fifo("ready2"), n.p("pid"));
    let x2 = json!({"instructions": [sh("x2", &format!("echo x2-start >> {log}; echo $$ > {pid_file}; echo > {ready2}; exec sleep 300"))]});
    let y2 = json!({"instructions": [sh("y2", &format!("echo y2 >> {log}"))]});
    n.create("f", "node-a", json!({"plan": x2})).await;
    read_fifo(&ready2);
    let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    n.api
        .patch(
            "f",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {"agent.cattle.io/force-update": "true"}}, "spec": {"plan": y2}}),
            ),
        )
        .await
        .unwrap();
    agent.wait_log("stopping the running one");
    let want = run_of(&json!({"plan": y2}));
    n.wait("f", "y2 applied", |s| s.phase == "Applied" && s.plan_checksum == want).await;
    assert!(!alive(pid), "the replaced run still runs");
    assert!(std::fs::read_to_string(&log).unwrap().ends_with("x2-start\ny2\n"));
    assert_eq!(agent.stop(), 0);
}

/// An agent SIGKILLed while a plan runs, whose spec changed meanwhile, recovers the plan it was
/// running (kept on the node), not the newest spec: that run goes on from its first instruction,
/// then the new plan runs.
#[tokio::test]
async fn a_restarted_agent_recovers_the_run_in_progress_not_the_newest_spec() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-crash-change").await;
    let (log, ready, gate) = (n.p("log"), n.fifo("ready"), n.fifo("gate"));
    let x = json!({"instructions": [sh("x", &format!("echo x-start >> {log}; echo > {ready}; read g < {gate}; echo x-end >> {log}"))]});
    let y = json!({"instructions": [sh("y", &format!("echo y >> {log}"))]});
    n.create("c", "node-a", json!({"plan": x})).await;
    let agent = n.agent();
    read_fifo(&ready);
    let x_run = run_of(&json!({"plan": x}));
    n.wait("c", "x executing", |s| s.phase == "Executing" && s.plan_checksum == x_run).await;
    n.patch_spec("c", json!({"plan": y})).await;
    agent.crash();
    let mut agent = n.agent();
    agent.wait_log("that run goes on first");
    // Recovery stopped the old x; x runs again from its first instruction.
    read_fifo(&ready);
    release_fifo(&gate);
    let want = run_of(&json!({"plan": y}));
    n.wait("c", "y applied", |s| s.phase == "Applied" && s.plan_checksum == want).await;
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "x-start\nx-start\nx-end\ny\n");
    assert_eq!(agent.stop(), 0);
}

/// A canceled plan stays canceled while `spec.canceled` is set; clearing it runs the plan again
/// from its first instruction.
#[tokio::test]
async fn clearing_the_cancel_runs_the_plan_again_from_the_start() {
    let cp = control_plane!();
    let n = Node::new(cp, "np-uncancel").await;
    let log = n.p("log");
    let plan =
        json!({"instructions": [sh("one", &format!("echo one >> {log}")), sh("two", &format!("echo two >> {log}"))]});
    n.create("u", "node-a", json!({"plan": plan, "canceled": true})).await;
    let mut agent = n.agent();
    let s = n.wait("u", "Cancelled", phase("Cancelled")).await;
    assert_eq!(s.progress, "0/2");
    agent.wait_log("canceled");
    assert!(!std::path::Path::new(&log).exists());
    n.patch_spec("u", json!({"canceled": false})).await;
    let s = n.wait("u", "Applied", phase("Applied")).await;
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "one\ntwo\n");
    assert_eq!(s.checkpoint, None);
    assert_eq!(agent.stop(), 0);
}

/// A NodePlan that would start while another source's plan holds the node's plan lock waits,
/// Pending, with a condition naming the holder; it starts once the lock is released.
#[tokio::test]
async fn a_nodeplan_waiting_for_the_lock_names_the_holder() {
    let cp = control_plane!();
    cp.install_nodeplan_crd().await;
    let namespace = cp.new_namespace("np-lock").await;
    let api: Api<DynamicObject> = Api::namespaced_with(cp.client().await, &namespace, &api_resource());
    let plans = tempfile::tempdir().unwrap();
    let mode = format!(
        "nodePlanEnabled: true\nnodeName: node-a\nlocalEnabled: true\nlocalPlanDirectory: {}\n",
        plans.path().display()
    );
    let node = ClusterNode::new(&mode, &cp.kubeconfig_yaml(), &namespace);
    let n = Node { node, api, namespace };
    let (log, ready, gate) = (n.p("log"), n.fifo("ready"), n.fifo("gate"));
    let local = json!({"instructions": [sh("local", &format!("echo local-start >> {log}; echo > {ready}; read g < {gate}; echo local-end >> {log}"))]});
    let local_path = plans.path().join("hold.plan");
    std::fs::write(&local_path, serde_json::to_vec(&local).unwrap()).unwrap();
    let mut agent = n.agent();
    read_fifo(&ready);
    n.create("w", "node-a", json!({"plan": {"instructions": [sh("np", &format!("echo nodeplan >> {log}"))]}})).await;
    let s = n.wait("w", "a Waiting condition", |s| condition(s, "Waiting").is_some()).await;
    let c = condition(&s, "Waiting").unwrap();
    assert_eq!((s.phase.as_str(), c.reason.as_str()), ("Pending", "LockHeld"));
    assert!(c.message.contains(&format!("local:{}", local_path.display())), "{c:?}");
    assert!(s.execution_state.lock_holder.starts_with("local:"), "{s:?}");
    release_fifo(&gate);
    let s = n.wait("w", "Applied", phase("Applied")).await;
    assert!(condition(&s, "Waiting").is_none() && s.execution_state.lock_holder.is_empty(), "{s:?}");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "local-start\nlocal-end\nnodeplan\n");
    assert_eq!(agent.stop(), 0);
}

// ---- Fleets of NodePlans (issue 14) ----

/// `count` nodes `<prefix>-<i>`, each with its agent in a namespace of its own (the layout
/// SECURITY.md recommends), each with the NodePlan `app` labelled `pool=<pool>` holding `first`,
/// applied.
async fn nodeplan_fleet(cp: &ControlPlane, prefix: &str, count: usize, pool: &str) -> Vec<(Node, AgentProc)> {
    let mut out = Vec::new();
    let first = json!({"instructions": [sh("first", "true")]});
    for i in 0..count {
        let node = Node::named(cp, prefix, &cp.kubeconfig_yaml(), &format!("{prefix}-{i}")).await;
        node.create("app", &format!("{prefix}-{i}"), json!({"plan": first})).await;
        node.api
            .patch("app", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"pool": pool}}})))
            .await
            .unwrap();
        let agent = node.agent();
        out.push((node, agent));
    }
    for (node, _) in &out {
        node.wait("app", "the first plan applied", phase("Applied")).await;
    }
    out
}

/// An instruction that notes `tag` in the node directory's `runs`, then waits for its `gate`
/// (a FIFO the test opens), then fails when the node directory holds `fail`.
fn gated(tag: &str) -> serde_json::Value {
    let script = format!(
        r#"d="$CATTLE_AGENT_EXECUTION_PWD"; while [ ! -e "$d/config.yaml" ]; do [ "$d" = / ] && exit 9; d=$(dirname "$d"); done
echo {tag} >> "$d/runs"; cat "$d/gate" > /dev/null; test ! -e "$d/fail""#
    );
    sh("gated", &script)
}

/// Wait until the node's `runs` holds `want` (its instruction noted its start; a bounded poll of
/// an outcome, as `Node::wait` polls a status).
fn wait_runs(node: &Node, want: &str) {
    let deadline = Instant::now() + GUARD;
    while std::fs::read_to_string(node.p("runs")).unwrap_or_default() != want {
        assert!(Instant::now() < deadline, "{} never ran the plan", node.namespace);
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn nodeplan_cmd(cp: &ControlPlane, args: &[&str]) -> std::process::Command {
    let mut c = std::process::Command::new(NODEPLAN);
    c.args(args).arg("--kubeconfig").arg(cp.kubeconfig_path());
    c.stdin(std::process::Stdio::null());
    c
}

/// The largest number of nodes with `plan` in `spec.plan` and not over yet, over every change the
/// test's own watch of the NodePlans sees, until all `count` nodes are over with it.
fn in_flight_history(
    client: kube::Client,
    selector: &str,
    plan: &serde_json::Value,
    count: usize,
) -> (std::sync::mpsc::Receiver<()>, tokio::task::JoinHandle<usize>) {
    use nodeplan::fleet::objects::{self, Kind, Scope, Selected};
    let (listed_tx, listed) = std::sync::mpsc::channel();
    let scope = Scope { kind: Kind::NodePlans, namespace: None, selector: selector.to_string() };
    let spec = nodeplan::nodeplan::resource::NodePlanSpec { plan: Some(plan.clone()), ..Default::default() };
    let checksum = nodeplan::plan::checksum(&nodeplan::nodeplan::wire::plan_bytes(&spec).unwrap());
    let task = tokio::spawn(async move {
        use futures::StreamExt as _;
        let mut stream = objects::watch(client, &scope);
        let mut flying: std::collections::BTreeMap<String, (bool, bool)> = Default::default();
        let mut most = 0;
        while let Some(e) = stream.next().await {
            match e {
                Selected::Listed => {
                    let _ = listed_tx.send(());
                }
                Selected::Is(key, o) => {
                    let st = o.standing(&key);
                    let ours = st.plan.as_deref() == Some(checksum.as_str());
                    let running = st.outcome == nodeplan::fleet::Outcome::Running;
                    flying.insert(key, (ours && running, ours && !running));
                    most = most.max(flying.values().filter(|f| f.0).count());
                    if flying.values().filter(|f| f.1).count() == count {
                        return most;
                    }
                }
                _ => {}
            }
        }
        most
    });
    (listed, task)
}

/// Issue 14 over NodePlans: six nodes, one namespace each, their NodePlans picked across
/// namespaces (`--nodeplans -A`). A second NodePlan of one node in the selection is refused
/// before anything is written (exit 2). The rollout with `--max-concurrent 2 --max-errors 1` is
/// interrupted with two nodes in flight (exit 8), and the same command continues without running
/// any node twice; one node fails, within the budget (exit 1). A watch of the test's own checks
/// from the NodePlans' history that never more than two nodes were in flight, and `plan status
/// --nodeplans -o json` shows every node's row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_over_nodeplans_one_per_node_across_namespaces() {
    let cp = control_plane!();
    let mut fleet = nodeplan_fleet(cp, "npr", 6, "npr").await;
    let gates: Vec<String> = fleet.iter().map(|(n, _)| n.fifo("gate")).collect();
    std::fs::write(fleet[4].0.p("fail"), b"").unwrap();
    let plan = json!({"instructions": [gated("two")]});
    let plan_file = fleet[0].0.p("two.plan");
    std::fs::write(&plan_file, serde_json::to_vec(&plan).unwrap()).unwrap();
    let roll = ["rollout", plan_file.as_str(), "-l", "pool=npr", "--nodeplans", "-A"];
    let limits = ["--max-concurrent", "2", "--max-errors", "1"];

    // Two selected NodePlans of one node: refused, nothing written.
    fleet[0].0.create("extra", "npr-0", json!({"plan": {"instructions": []}})).await;
    let label = |v: Option<&str>| Patch::Merge(json!({"metadata": {"labels": {"pool": v}}}));
    fleet[0].0.api.patch("extra", &PatchParams::default(), &label(Some("npr"))).await.unwrap();
    let out = nodeplan_cmd(cp, &roll).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("node npr-0 has two selected NodePlans"), "{err}");
    fleet[0].0.api.patch("extra", &PatchParams::default(), &label(None)).await.unwrap();
    for (node, _) in &fleet {
        let o = node.api.get("app").await.unwrap();
        assert_eq!(o.metadata.generation, Some(1), "the refused rollout wrote nothing");
    }

    let (listed, history) = in_flight_history(cp.client().await, "pool=npr", &plan, 6);
    listed.recv_timeout(GUARD).expect("the history watch listed the nodes");
    let key_of: std::collections::BTreeMap<String, usize> =
        fleet.iter().enumerate().map(|(i, (n, _))| (format!("{}/app", n.namespace), i)).collect();
    let started = |line: &str| line.strip_suffix(": starting").and_then(|k| key_of.get(k).copied());
    let mut first = nodeplan_cmd(cp, &roll).args(limits).stdout(std::process::Stdio::piped()).spawn().unwrap();
    let lines = lines_of(first.stdout.take().unwrap());
    let mut in_flight = Vec::new();
    while in_flight.len() < 2 {
        let l = lines.recv_timeout(GUARD).expect("the rollout started two nodes");
        in_flight.extend(started(&l));
    }
    for &i in &in_flight {
        wait_runs(&fleet[i].0, "two\n");
    }
    unsafe { libc::kill(first.id() as i32, libc::SIGINT) };
    assert_eq!(exit_code(&mut first, "the interrupted rollout"), Some(8));
    for &i in &in_flight {
        release_fifo(&gates[i]);
    }

    // The same command continues: each node it starts is released in turn (a handshake: the
    // release returns once that node's instruction opened its gate).
    let mut second = nodeplan_cmd(cp, &roll).args(limits).stdout(std::process::Stdio::piped()).spawn().unwrap();
    let lines = lines_of(second.stdout.take().unwrap());
    let mut printed = Vec::new();
    let mut released = in_flight.clone();
    while released.len() < 6 {
        let l = lines.recv_timeout(GUARD).unwrap_or_else(|_| panic!("the rollout stopped starting: {printed:#?}"));
        printed.push(l.clone());
        if let Some(i) = started(&l) {
            assert!(!released.contains(&i), "node {i} started twice: {printed:#?}");
            release_fifo(&gates[i]);
            released.push(i);
        }
    }
    assert_eq!(exit_code(&mut second, "the continued rollout"), Some(1), "one failure, within the budget");
    for (i, (node, _)) in fleet.iter().enumerate() {
        assert_eq!(std::fs::read_to_string(node.p("runs")).unwrap(), "two\n", "node {i} ran once");
    }
    let most = tokio::time::timeout(GUARD, history).await.expect("the history watch ended").unwrap();
    assert_eq!(most, 2, "never more than 2 in flight, and 2 at some point");

    let out =
        nodeplan_cmd(cp, &["plan", "status", "-l", "pool=npr", "--nodeplans", "-A", "-o", "json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list["kind"], "List", "{list}");
    let rows = list["items"].as_array().unwrap();
    assert!(rows.iter().all(|r| r["kind"] == "NodePlan"), "{rows:?}");
    let states: Vec<(String, String)> = rows
        .iter()
        .map(|r| (r["node"].as_str().unwrap().to_string(), r["state"].as_str().unwrap().to_string()))
        .collect();
    let mut want: Vec<(String, String)> =
        (0..6).filter(|i| *i != 4).map(|i| (format!("npr-{i}"), "succeeded".to_string())).collect();
    want.insert(0, ("npr-4".into(), "failed".into()));
    assert_eq!(states, want, "failures first, then by node");
    for (_, a) in &mut fleet {
        a.stop();
    }
}

/// Issue 14 over NodePlans: `rollout cancel --nodeplans` cancels the nodes in flight through
/// `spec.canceled` and the rollout ends with exit 4 starting nothing more; run again, it starts
/// anew, its canceled nodes too; `plan pause|resume -l --nodeplans` write every selected
/// NodePlan's spec; a node past `--timeout` is given up on (canceled, counted failed: exit 7 with
/// `--max-errors 0`). The plan holds a null the API server drops: the rollout compares the plan as
/// stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollout_cancel_fan_out_and_timeout_over_nodeplans() {
    let cp = control_plane!();
    let mut fleet = nodeplan_fleet(cp, "npc", 3, "npc").await;
    let gates: Vec<String> = fleet.iter().map(|(n, _)| n.fifo("gate")).collect();
    let ns = fleet[0].0.namespace.clone();
    // A null the API server drops from what it stores: the rollout compares the stored plan.
    let plan = json!({"files": null, "instructions": [gated("two")]});
    let plan_file = fleet[0].0.p("two.plan");
    std::fs::write(&plan_file, serde_json::to_vec(&plan).unwrap()).unwrap();
    let mut run =
        nodeplan_cmd(cp, &["rollout", &plan_file, "-l", "pool=npc", "--nodeplans", "-A", "--max-concurrent", "2"])
            .args(["-n", &ns])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
    let lines = lines_of(run.stdout.take().unwrap());
    let key_of: std::collections::BTreeMap<String, usize> =
        fleet.iter().enumerate().map(|(i, (n, _))| (format!("{}/app", n.namespace), i)).collect();
    let mut started = Vec::new();
    while started.len() < 2 {
        let l = lines.recv_timeout(GUARD).expect("the rollout started two nodes");
        started.extend(l.strip_suffix(": starting").and_then(|k| key_of.get(k)).copied());
    }
    // Both run their instruction (it waits on its gate) before the cancel.
    for &i in &started {
        wait_runs(&fleet[i].0, "two\n");
    }
    let out =
        nodeplan_cmd(cp, &["rollout", "cancel", "-l", "pool=npc", "--nodeplans", "-A", "-n", &ns]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("(2 of its nodes canceled)"), "{stdout}");
    assert_eq!(exit_code(&mut run, "the canceled rollout"), Some(4));
    // The rollout counts its canceled nodes as canceled, not as failures (issue 24).
    let tail: Vec<String> = std::iter::from_fn(|| lines.recv_timeout(GUARD).ok()).collect();
    assert!(
        tail.iter().any(|l| l == "canceled: 0 of 3 nodes succeeded, 2 canceled, 0 failed, 1 not started"),
        "{tail:#?}"
    );
    let mut phases = Vec::new();
    for (node, _) in &fleet {
        let o = node.api.get("app").await.unwrap();
        let canceled = o.data.pointer("/spec/canceled").and_then(serde_json::Value::as_bool) == Some(true);
        if canceled {
            node.wait("app", "canceled", phase("Cancelled")).await;
        }
        phases.push(canceled);
    }
    assert_eq!(phases.iter().filter(|c| **c).count(), 2, "the two in flight canceled, the third never started");

    // The canceled rollout run again starts anew, its canceled nodes too (released as they start).
    let mut again =
        nodeplan_cmd(cp, &["rollout", &plan_file, "-l", "pool=npc", "--nodeplans", "-A", "--max-concurrent", "2"])
            .args(["-n", &ns])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
    let lines = lines_of(again.stdout.take().unwrap());
    let mut printed = Vec::new();
    let mut released = 0;
    while released < 3 {
        let l = lines.recv_timeout(GUARD).unwrap_or_else(|_| panic!("the rerun stopped starting: {printed:#?}"));
        printed.push(l.clone());
        if let Some(i) = l.strip_suffix(": starting").and_then(|k| key_of.get(k)) {
            release_fifo(&gates[*i]);
            released += 1;
        }
    }
    assert_eq!(exit_code(&mut again, "the rerun"), Some(0), "{printed:#?}");
    assert!(printed.iter().any(|l| l.contains("(2 canceled nodes start anew)")), "{printed:#?}");
    let mut runs: Vec<String> = fleet.iter().map(|(n, _)| std::fs::read_to_string(n.p("runs")).unwrap()).collect();
    runs.sort();
    assert_eq!(runs, ["two\n", "two\ntwo\n", "two\ntwo\n"], "the canceled nodes ran again, the other once");

    // The fan-out: resume and cancel every selected NodePlan in one pass.
    let out = nodeplan_cmd(cp, &["plan", "pause", "-l", "pool=npc", "--nodeplans", "-A"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("paused 3 NodePlans"), "{out:?}");
    for (node, _) in &fleet {
        let o = node.api.get("app").await.unwrap();
        assert_eq!(o.data.pointer("/spec/paused"), Some(&json!(true)));
    }
    let out = nodeplan_cmd(cp, &["plan", "resume", "-l", "pool=npc", "--nodeplans", "-A"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");

    // A node past --timeout is given up on: canceled, counted failed.
    let plan = json!({"instructions": [gated("three")]});
    std::fs::write(&plan_file, serde_json::to_vec(&plan).unwrap()).unwrap();
    let out = nodeplan_cmd(cp, &["rollout", &plan_file, "-l", "pool=npc", "--nodeplans", "-A", "-n", &ns])
        .args(["--timeout", "2s", "--max-errors", "0"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(7), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("in flight longer than 2s: canceled, counted failed"), "{stdout}");
    let mut timed_out = 0;
    for (node, _) in &fleet {
        let o = node.api.get("app").await.unwrap();
        if o.metadata.annotations.unwrap_or_default().get("rollout.nodeplan.cattle.io/timed-out").map(String::as_str)
            == Some("true")
        {
            timed_out += 1;
            assert_eq!(o.data.pointer("/spec/canceled"), Some(&json!(true)));
            node.wait("app", "canceled at the timeout", phase("Cancelled")).await;
        }
    }
    assert_eq!(timed_out, 1, "one node at a time: the first timed out, the budget stopped the rest");
    for (_, a) in &mut fleet {
        a.stop();
    }
}

/// Issue 14 over NodePlans: `--wait-healthy` counts a node done only once the probes of the run
/// it started pass there. The first rollout's plan has a probe `ready` on a file that exists (done);
/// the second's has a probe of the same name on a file that does not: its run succeeds, but the
/// probe's history of the first run is not carried into it, so the node never counts done and is
/// given up at `--timeout` (exit 7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_healthy_over_nodeplans_counts_only_this_runs_probes() {
    let cp = control_plane!();
    let mut fleet = nodeplan_fleet(cp, "nph", 1, "nph").await;
    let there = fleet[0].0.p("there");
    std::fs::write(&there, b"").unwrap();
    let probe =
        |path: &str| json!({"ready": {"fileExists": {"path": path}, "successThreshold": 1, "failureThreshold": 3}});
    let plan_file = fleet[0].0.p("probed.plan");
    let roll = |extra: &[&str]| {
        nodeplan_cmd(cp, &["rollout", &plan_file, "-l", "pool=nph", "--nodeplans", "-A", "--wait-healthy"])
            .args(extra)
            .output()
            .unwrap()
    };
    let first = json!({"instructions": [sh("one", "true")], "probes": probe(&there)});
    std::fs::write(&plan_file, serde_json::to_vec(&first).unwrap()).unwrap();
    let out = roll(&[]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let s = fleet[0].0.status("app").await;
    assert!(s.probe_statuses.get("ready").is_some_and(|p| p.healthy), "{s:?}");

    let missing = fleet[0].0.p("missing");
    let second = json!({"instructions": [sh("two", "true")], "probes": probe(&missing)});
    std::fs::write(&plan_file, serde_json::to_vec(&second).unwrap()).unwrap();
    let out = roll(&["--timeout", "3s", "--max-errors", "0"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(7), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("in flight longer than 3s"), "{stdout}");
    let s = fleet[0].0.status("app").await;
    assert!(s.probe_statuses.get("ready").is_some_and(|p| !p.healthy), "this run's probe failed: {s:?}");
    for (_, a) in &mut fleet {
        a.stop();
    }
}

/// A NodePlan made before the definition required `spec.nodeName` (labelled for the node, naming
/// none): where the API server selects NodePlans by `spec.nodeName`, the agent never sees it, and
/// says so in one warning line naming it; where it cannot (1.20), the agent watches by label and
/// runs it. A control plane of its own: the definition is installed old, then upgraded.
#[tokio::test]
async fn a_nodeplan_naming_no_node_is_named_in_a_warning_or_runs() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use nodeplan::nodeplan::resource::{CRD_YAML, SELECTABLE_SINCE, crd_yaml};
    let Some(cp) = ControlPlane::start_for_custom_resources().await else { return };
    let crds: Api<CustomResourceDefinition> = Api::all(cp.client().await);
    let parse = |yaml: &str| -> CustomResourceDefinition { serde_yaml_ng::from_str(yaml).unwrap() };
    let old = crd_yaml(Some((1, 24))).unwrap();
    crds.create(&PostParams::default(), &parse(&old)).await.unwrap();
    let n = Node::new(&cp, "np-unnamed").await;
    let log = n.p("log");
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "agent.cattle.io/v1alpha1", "kind": "NodePlan",
        "metadata": {"name": "old", "namespace": n.namespace, "labels": {"cattle.io/node": "node-a"}},
        "spec": {"plan": {"instructions": [sh("old", &format!("echo old >> {log}"))]}},
    }))
    .unwrap();
    n.api.create(&PostParams::default(), &obj).await.unwrap();
    let mut current = parse(CRD_YAML);
    let name = "nodeplans.agent.cattle.io";
    current.metadata.resource_version = crds.get(name).await.unwrap().metadata.resource_version;
    crds.replace(name, &PostParams::default(), &current).await.unwrap();
    let (major, minor) = SELECTABLE_SINCE;
    if !cp.version().at_least(major, minor) {
        k8s_support::loud(&format!(
            "kube-apiserver {} selects no NodePlans by spec.nodeName: they run by label",
            cp.version()
        ));
        let mut agent = n.agent();
        n.wait("old", "Applied (watched by label)", |s| s.phase == "Applied").await;
        assert_eq!(agent.stop(), 0);
        return;
    }
    // The upgraded definition is in force once the server takes the field selector.
    let by_field = kube::api::ListParams::default().fields("spec.nodeName=node-a");
    let deadline = Instant::now() + Duration::from_secs(30);
    while n.api.list(&by_field).await.is_err() {
        assert!(Instant::now() < deadline, "the server never took the field selector");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut agent = n.agent();
    let line = agent.wait_log("but its spec names no nodeName");
    assert!(line.contains(&format!("nodeplan {}/old", n.namespace)) && line.contains("WARN"), "{line}");
    assert!(!std::path::Path::new(&log).exists(), "the agent never sees it");
    assert_eq!(agent.stop(), 0);
}
