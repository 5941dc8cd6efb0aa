//! Custom resources on the test kube-apiserver (see `k8s_support`; 1.20.2 and the current release):
//! a CustomResourceDefinition with a structural schema, printer columns and the status subresource,
//! installed through the API, then objects of it written through kube-rs and read back with the
//! cache's `kubectl`.
//!
//! This is also the regression test of the build recipe: an apiserver built with Kubernetes 1.20's
//! vendored reflect2 1.0.1 under Go 1.19 dies with SIGSEGV on the first create of a custom resource
//! (recipe 1 of `tools/build-kube-apiserver.sh`).
//!
//! Both tests share the binary's control plane, each in its own namespace; the definition is
//! cluster-wide and installed idempotently by whichever test comes first. Timeouts are hang guards.

mod k8s_support;

use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_support::ControlPlane;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};
use serde_json::{Value, json};

/// Hang guard for the definition to be established and for kubectl.
const GUARD: Duration = Duration::from_secs(30);

const GROUP: &str = "nodeplan.test";
const VERSION: &str = "v1alpha1";
const KIND: &str = "NodePlan";
const PLURAL: &str = "nodeplans";

fn resource() -> ApiResource {
    ApiResource {
        group: GROUP.into(),
        version: VERSION.into(),
        api_version: format!("{GROUP}/{VERSION}"),
        kind: KIND.into(),
        plural: PLURAL.into(),
    }
}

/// The definition: a structural schema (spec.node required and non-empty, spec.instructions an
/// integer >= 0; status.phase from an enum), printer columns (APPLIED only with `-o wide`) and the
/// status subresource.
fn definition() -> CustomResourceDefinition {
    serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": format!("{PLURAL}.{GROUP}") },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": { "plural": PLURAL, "singular": "nodeplan", "kind": KIND, "listKind": "NodePlanList" },
            "versions": [{
                "name": VERSION,
                "served": true,
                "storage": true,
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "spec": {
                            "type": "object",
                            "required": ["node", "instructions"],
                            "properties": {
                                "node": { "type": "string", "minLength": 1 },
                                "instructions": { "type": "integer", "minimum": 0 },
                            },
                        },
                        "status": {
                            "type": "object",
                            "properties": {
                                "phase": { "type": "string", "enum": ["Pending", "Applying", "Applied", "Failed"] },
                                "appliedInstructions": { "type": "integer", "minimum": 0 },
                            },
                        },
                    },
                }},
                "subresources": { "status": {} },
                "additionalPrinterColumns": [
                    { "name": "Node", "type": "string", "jsonPath": ".spec.node" },
                    { "name": "Phase", "type": "string", "jsonPath": ".status.phase" },
                    { "name": "Applied", "type": "integer", "jsonPath": ".status.appliedInstructions", "priority": 1 },
                    { "name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp" },
                ],
            }],
        },
    }))
    .unwrap_or_else(|e| panic!("the definition does not parse as a CustomResourceDefinition: {e}"))
}

/// Install the definition (an existing one, from another test of this binary, is fine) and wait
/// until the apiserver reports it Established.
async fn install_definition(client: &kube::Client) {
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    let name = format!("{PLURAL}.{GROUP}");
    match crds.create(&PostParams::default(), &definition()).await {
        Ok(_) => {}
        Err(kube::Error::Api(st)) if st.code == 409 => {}
        Err(e) => panic!("create CustomResourceDefinition {name}: {e}"),
    }
    tokio::time::timeout(GUARD, await_condition(crds, &name, conditions::is_crd_established()))
        .await
        .unwrap_or_else(|_| panic!("{name} not Established within {GUARD:?}"))
        .unwrap_or_else(|e| panic!("watch {name}: {e}"));
}

async fn setup(cp: &ControlPlane, test: &str) -> Api<DynamicObject> {
    let client = cp.client().await;
    install_definition(&client).await;
    let ns = cp.new_namespace(test).await;
    Api::namespaced_with(client, &ns, &resource())
}

fn nodeplan(name: &str, body: Value) -> DynamicObject {
    DynamicObject::new(name, &resource()).data(body)
}

/// A create that must succeed; on failure, the apiserver log's tail (a crash shows there).
async fn create(cp: &ControlPlane, api: &Api<DynamicObject>, obj: &DynamicObject) -> DynamicObject {
    api.create(&PostParams::default(), obj).await.unwrap_or_else(|e| {
        panic!("create custom resource: {e}\n--- apiserver.log (tail) ---\n{}", cp.apiserver_log_tail(30))
    })
}

/// The status code and message of an API error; panics on success or any other error.
fn api_error<T: std::fmt::Debug>(what: &str, res: kube::Result<T>) -> (u16, String) {
    match res {
        Err(kube::Error::Api(st)) => (st.code, st.message.clone()),
        other => panic!("{what}: expected an API error, got {other:?}"),
    }
}

/// The names of the objects `api` lists.
async fn names(api: &Api<DynamicObject>) -> Vec<String> {
    api.list(&Default::default())
        .await
        .unwrap_or_else(|e| panic!("list: {e}"))
        .items
        .into_iter()
        .filter_map(|o| o.metadata.name)
        .collect()
}

/// Run the cache's kubectl against the control plane; its stdout (panics unless it exits 0).
async fn kubectl(cp: &ControlPlane, args: &[&str]) -> String {
    let mut cmd = tokio::process::Command::from(cp.kubectl());
    cmd.args(args).kill_on_drop(true);
    let out = tokio::time::timeout(GUARD, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("kubectl {args:?} did not finish within {GUARD:?}"))
        .unwrap_or_else(|e| panic!("run kubectl {args:?}: {e}"));
    assert!(out.status.success(), "kubectl {args:?} failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap_or_else(|e| panic!("kubectl {args:?} printed non-UTF-8: {e}"))
}

/// kubectl's table as rows of cells: the header, then one row per object.
fn table(text: &str) -> Vec<Vec<String>> {
    text.lines().filter(|l| !l.trim().is_empty()).map(|l| l.split_whitespace().map(str::to_string).collect()).collect()
}

#[tokio::test]
async fn custom_resource_status_subresource_and_printer_columns() {
    let Some(cp) = ControlPlane::shared_for_custom_resources().await else { return };
    let api = setup(cp, "crd-status").await;
    let ns = api.namespace().unwrap_or_else(|| panic!("namespaced api")).to_string();

    // A create carrying a status and a field the schema does not know.
    let created = create(
        cp,
        &api,
        &nodeplan(
            "plan-a",
            json!({
                "spec": { "node": "node-a", "instructions": 3, "unknownField": "dropped" },
                "status": { "phase": "Applied" },
            }),
        ),
    )
    .await;
    assert_eq!(created.data["spec"], json!({ "node": "node-a", "instructions": 3 }), "structural schema prunes");
    assert!(created.data.get("status").is_none(), "with the status subresource, create ignores status");
    assert_eq!(created.metadata.generation, Some(1));

    // The status subresource writes status, leaves spec and generation alone.
    let pp = PatchParams::default();
    let patched = api
        .patch_status(
            "plan-a",
            &pp,
            &Patch::Merge(json!({ "status": { "phase": "Applying", "appliedInstructions": 2 } })),
        )
        .await
        .unwrap_or_else(|e| panic!("patch status: {e}"));
    assert_eq!(patched.data["status"], json!({ "phase": "Applying", "appliedInstructions": 2 }));
    assert_eq!(patched.data["spec"], created.data["spec"]);
    assert_eq!(patched.metadata.generation, Some(1), "a status write does not bump generation");

    // The main resource writes spec (bumping generation) and ignores status.
    let patched = api
        .patch("plan-a", &pp, &Patch::Merge(json!({ "spec": { "instructions": 4 }, "status": { "phase": "Failed" } })))
        .await
        .unwrap_or_else(|e| panic!("patch spec: {e}"));
    assert_eq!(patched.data["spec"]["instructions"], json!(4));
    assert_eq!(patched.data["status"]["phase"], json!("Applying"), "the main resource ignores status");
    assert_eq!(patched.metadata.generation, Some(2));
    let got = api.get_status("plan-a").await.unwrap_or_else(|e| panic!("get status: {e}"));
    assert_eq!(got.data["status"]["phase"], json!("Applying"));

    // kubectl prints the printer columns from spec and status; APPLIED (priority 1) only when wide.
    let wide = kubectl(cp, &["get", PLURAL, "-n", &ns, "-o", "wide"]).await;
    k8s_support::loud(&format!("kubectl get {PLURAL} -o wide:\n{wide}"));
    let rows = table(&wide);
    assert_eq!(rows.len(), 2, "a header and one row:\n{wide}");
    assert_eq!(rows[0], ["NAME", "NODE", "PHASE", "APPLIED", "AGE"], "header:\n{wide}");
    assert_eq!(rows[1][..4], ["plan-a", "node-a", "Applying", "2"], "row:\n{wide}");
    let narrow = kubectl(cp, &["get", PLURAL, "-n", &ns]).await;
    assert_eq!(table(&narrow)[0], ["NAME", "NODE", "PHASE", "AGE"], "header:\n{narrow}");

    // The printer column reads the live status.
    api.patch_status(
        "plan-a",
        &pp,
        &Patch::Merge(json!({ "status": { "phase": "Applied", "appliedInstructions": 4 } })),
    )
    .await
    .unwrap_or_else(|e| panic!("patch status: {e}"));
    let wide = kubectl(cp, &["get", &format!("{PLURAL}.{GROUP}"), "plan-a", "-n", &ns, "-o", "wide"]).await;
    assert_eq!(table(&wide)[1][..4], ["plan-a", "node-a", "Applied", "4"], "row:\n{wide}");
}

#[tokio::test]
async fn object_violating_the_schema_is_rejected_with_422() {
    let Some(cp) = ControlPlane::shared_for_custom_resources().await else { return };
    let api = setup(cp, "crd-invalid").await;
    let pp = PostParams::default();

    for (case, spec, field) in [
        ("a negative count", json!({ "node": "node-a", "instructions": -1 }), "spec.instructions"),
        ("a string for an integer", json!({ "node": "node-a", "instructions": "three" }), "spec.instructions"),
        ("a required field missing", json!({ "instructions": 1 }), "spec.node"),
        ("an empty string under minLength", json!({ "node": "", "instructions": 1 }), "spec.node"),
    ] {
        let (code, message) = api_error(case, api.create(&pp, &nodeplan("bad", json!({ "spec": spec }))).await);
        assert_eq!(code, 422, "{case}: {message}");
        assert!(message.contains(field), "{case}: the message names {field}: {message}");
    }

    // The status subresource validates too.
    create(cp, &api, &nodeplan("good", json!({ "spec": { "node": "node-a", "instructions": 1 } }))).await;
    let status = Patch::Merge(json!({ "status": { "phase": "Bogus" } }));
    let (code, message) =
        api_error("an enum violation", api.patch_status("good", &PatchParams::default(), &status).await);
    assert_eq!(code, 422, "{message}");
    assert!(message.contains("status.phase"), "{message}");

    // Nothing invalid was stored.
    assert_eq!(names(&api).await, ["good"]);
    let good = api.get_status("good").await.unwrap_or_else(|e| panic!("get status: {e}"));
    assert!(good.data.get("status").is_none(), "the rejected status was not stored: {:?}", good.data);
}

// ---------------------------------------------------------------------------------------------
// The shipped NodePlan definition (agent.cattle.io): its CEL rules, what `nodeplan crd` prints for
// each release, and the status-writer policy.

/// `nodeplan ARGS`: its exit code, stdout and stderr.
fn nodeplan_cmd(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nodeplan"))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run nodeplan {args:?}: {e}"));
    let text = |b: Vec<u8>| String::from_utf8(b).unwrap_or_else(|e| panic!("nodeplan {args:?} printed non-UTF-8: {e}"));
    (out.status.code().unwrap_or(-1), text(out.stdout), text(out.stderr))
}

/// `kubectl ARGS` with `input` on stdin: whether it exited 0, and its stdout and stderr.
async fn kubectl_with_input(cp: &ControlPlane, args: &[&str], input: &str) -> (bool, String) {
    use tokio::io::AsyncWriteExt as _;
    let mut cmd = tokio::process::Command::from(cp.kubectl());
    cmd.args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("run kubectl {args:?}: {e}"));
    let mut stdin = child.stdin.take().unwrap_or_else(|| panic!("kubectl's stdin"));
    stdin.write_all(input.as_bytes()).await.unwrap_or_else(|e| panic!("write to kubectl: {e}"));
    drop(stdin);
    let out = tokio::time::timeout(GUARD, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("kubectl {args:?} did not finish within {GUARD:?}"))
        .unwrap_or_else(|e| panic!("kubectl {args:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// The shipped NodePlan definition installed, and the NodePlans of a new namespace.
async fn shipped_nodeplans(cp: &ControlPlane, test: &str) -> Api<DynamicObject> {
    cp.install_nodeplan_crd().await;
    let ns = cp.new_namespace(test).await;
    Api::namespaced_with(cp.client().await, &ns, &nodeplan::nodeplan::resource::api_resource())
}

/// A NodePlan labelled for node-a with `spec`.
fn shipped(name: &str, spec: Value) -> DynamicObject {
    let mut o = DynamicObject::new(name, &nodeplan::nodeplan::resource::api_resource()).data(json!({"spec": spec}));
    o.metadata.labels = Some([("cattle.io/node".to_string(), "node-a".to_string())].into());
    o
}

/// The definition's CEL rules (`deploy/nodeplan-crd.yaml`) on a release that runs them (1.25 and
/// later): each refuses its bad object with its message, a good object is stored, and
/// `spec.nodeName` cannot change. 1.20 takes the same definition (it drops the rules) and so takes
/// those objects: said loudly. The structural checks added with them hold on both.
#[tokio::test]
async fn the_nodeplan_definition_enforces_its_cel_rules() {
    let Some(cp) = ControlPlane::shared_for_custom_resources().await else { return };
    let api = shipped_nodeplans(cp, "np-cel").await;
    let pp = PostParams::default();
    let plan = json!({"instructions": [{"name": "a", "command": "true"}]});
    let node_a = |extra: Value| {
        let mut spec = json!({"nodeName": "node-a", "plan": plan});
        spec.as_object_mut()
            .unwrap_or_else(|| panic!("an object"))
            .extend(extra.as_object().cloned().unwrap_or_default());
        spec
    };
    // Structural, so on every release.
    for (case, spec, field) in [
        (
            "more than 100 attempts",
            node_a(json!({"retryStrategy": {"maxAttempts": 101}})),
            "spec.retryStrategy.maxAttempts",
        ),
        (
            "a duration the agent cannot read",
            node_a(json!({"retryStrategy": {"initialDelay": "1d"}})),
            "spec.retryStrategy.initialDelay",
        ),
        (
            "a timeout the agent cannot read",
            node_a(json!({"execution": {"timeout": "5 min"}})),
            "spec.execution.timeout",
        ),
    ] {
        let (code, message) = api_error(case, api.create(&pp, &shipped("bad", spec)).await);
        assert_eq!(code, 422, "{case}: {message}");
        assert!(message.contains(field), "{case}: the message names {field}: {message}");
    }
    let rules = [
        ("no spec.nodeName", json!({"plan": plan}), "spec.nodeName must name the node this NodePlan is for"),
        (
            "a first wait longer than the longest",
            node_a(json!({"retryStrategy": {"initialDelay": "1h"}})),
            "spec.retryStrategy.initialDelay (default 10s) must not be longer than maxDelay (default 10m)",
        ),
        (
            "a longest wait under the 1 s floor",
            node_a(json!({"retryStrategy": {"initialDelay": "100ms", "maxDelay": "500ms"}})),
            "spec.retryStrategy.maxDelay must be at least 1s",
        ),
    ];
    let good =
        node_a(json!({"retryStrategy": {"initialDelay": "5", "maxDelay": "1m"}, "execution": {"timeout": "1.5h"}}));
    api.create(&pp, &shipped("good", good)).await.unwrap_or_else(|e| panic!("a good NodePlan: {e}"));
    if !cp.version().at_least(1, 25) {
        k8s_support::loud(&format!(
            "kube-apiserver {} runs no CEL rules: the definition is taken without them, and so are the NodePlans they refuse on 1.25 and later",
            cp.version()
        ));
        for (i, (case, spec, _)) in rules.into_iter().enumerate() {
            api.create(&pp, &shipped(&format!("taken-{i}"), spec)).await.unwrap_or_else(|e| panic!("{case}: {e}"));
        }
        return;
    }
    for (case, spec, message) in rules {
        let (code, got) = api_error(case, api.create(&pp, &shipped("bad", spec)).await);
        assert_eq!(code, 422, "{case}: {got}");
        assert!(got.contains(message), "{case}: the rule's message {message:?} in {got}");
    }
    let moved = Patch::Merge(json!({"spec": {"nodeName": "node-b"}}));
    let (code, got) = api_error("a NodePlan moved", api.patch("good", &PatchParams::default(), &moved).await);
    assert_eq!(code, 422, "{got}");
    assert!(got.contains("spec.nodeName cannot change once set"), "{got}");
    api.patch("good", &PatchParams::default(), &Patch::Merge(json!({"spec": {"paused": true}})))
        .await
        .unwrap_or_else(|e| panic!("any other change of the spec: {e}"));
    assert_eq!(names(&api).await, ["good"], "nothing refused was stored");
}

/// `nodeplan crd --kube-version V` prints what release V's kubectl takes (checked with the cache's
/// kubectl, of the API server's release, as a server-side dry run); on 1.20 the full definition is
/// refused by that kubectl, which is why the flag exists.
#[tokio::test]
async fn nodeplan_crd_prints_what_each_release_takes() {
    let Some(cp) = ControlPlane::shared_for_custom_resources().await else { return };
    let v = cp.version();
    let (code, crd, err) = nodeplan_cmd(&["crd", "--kube-version", &v.git]);
    assert_eq!((code, err.as_str()), (0, ""), "nodeplan crd --kube-version {v}");
    let (ok, out) = kubectl_with_input(cp, &["apply", "--dry-run=server", "-f", "-"], &crd).await;
    assert!(ok, "kubectl {v} takes nodeplan crd --kube-version {v}: {out}");
    let (_, full, _) = nodeplan_cmd(&["crd"]);
    let (ok, out) = kubectl_with_input(cp, &["apply", "--dry-run=server", "-f", "-"], &full).await;
    if v.at_least(1, 30) {
        assert!(ok, "kubectl {v} takes the full definition: {out}");
    } else {
        k8s_support::loud(&format!("kubectl {v} refuses the full definition, as expected: {}", out.trim()));
        assert!(!ok && out.contains("unknown field \"selectableFields\""), "{out}");
    }
}

/// The done-when of issue 22's part 4: on an API server with ValidatingAdmissionPolicies (1.30
/// and later), the policy `nodeplan crd --admission-policy` prints lets only the agent of the
/// NodePlan's `spec.nodeName` (the user `nodeplan:node:<node>`) write its status. Both node agents
/// hold the same RBAC grant, so a denial is the policy's. 1.20 has no such policies: said loudly,
/// and `nodeplan crd --admission-policy --kube-version 1.20` refuses in one line.
#[tokio::test]
async fn only_the_nodes_own_agent_writes_a_nodeplan_status() {
    let Some(cp) = ControlPlane::shared_for_custom_resources().await else { return };
    let (own, other_user) = (k8s_support::NODE_AGENTS[0].0, k8s_support::NODE_AGENTS[1].0);
    assert_eq!(own, nodeplan::nodeplan::resource::agent_user("node-a"));
    if !cp.version().at_least(1, 30) {
        let (code, out, err) = nodeplan_cmd(&["crd", "--admission-policy", "--kube-version", &cp.version().git]);
        assert_eq!((code, out.as_str(), err.lines().count()), (2, "", 1), "{err}");
        assert!(err.contains("has no ValidatingAdmissionPolicy"), "{err}");
        k8s_support::loud(&format!(
            "kube-apiserver {} has no ValidatingAdmissionPolicy: the status-writer policy is proven on 1.30 and later only",
            cp.version()
        ));
        return;
    }
    let ns = cp.new_namespace("np-status-writer").await;
    // Both node agents may write NodePlans' status in `ns` as far as RBAC goes.
    let api = cp.install_status_policy(&ns).await;
    let plan = json!({"instructions": [{"name": "a", "command": "true"}]});
    api.create(&PostParams::default(), &shipped("p", json!({"nodeName": "node-a", "plan": plan})))
        .await
        .unwrap_or_else(|e| panic!("create p: {e}"));
    let as_other: Api<DynamicObject> =
        Api::namespaced_with(cp.client_as(other_user).await, &ns, &nodeplan::nodeplan::resource::api_resource());
    let as_own: Api<DynamicObject> =
        Api::namespaced_with(cp.client_as(own).await, &ns, &nodeplan::nodeplan::resource::api_resource());
    let status = |phase: &str| Patch::Merge(json!({"status": {"phase": phase}}));

    // Another node's agent is denied, by the policy, with the agent it expects named.
    let (code, message) =
        api_error("another node's agent", as_other.patch_status("p", &PatchParams::default(), &status("Failed")).await);
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains(&format!(
            "only {own}, the agent of node node-a, may write this NodePlan status; {other_user} may not"
        )),
        "{message}"
    );
    // A replace is the same operation to admission.
    let mut whole = api.get_status("p").await.unwrap_or_else(|e| panic!("{e}"));
    whole.data["status"] = json!({"phase": "Failed"});
    let (code, _) =
        api_error("another node's agent's PUT", as_other.replace_status("p", &PostParams::default(), &whole).await);
    assert_eq!(code, 403);
    // The node's own agent writes it.
    let written = as_own
        .patch_status("p", &PatchParams::default(), &status("Applied"))
        .await
        .unwrap_or_else(|e| panic!("the node's own agent: {e}"));
    assert_eq!(written.data["status"]["phase"], "Applied");
    // Nobody else, cluster admins included (delete the binding to write a status by hand).
    let (code, message) =
        api_error("an admin", api.patch_status("p", &PatchParams::default(), &status("Failed")).await);
    assert_eq!(code, 403, "{message}");
    let stored = api.get_status("p").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stored.data["status"], json!({"phase": "Applied"}), "only the own agent's write landed");
}
