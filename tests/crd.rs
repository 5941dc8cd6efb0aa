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
    let names: Vec<String> = api
        .list(&Default::default())
        .await
        .unwrap_or_else(|e| panic!("list: {e}"))
        .items
        .into_iter()
        .filter_map(|o| o.metadata.name)
        .collect();
    assert_eq!(names, ["good"]);
    let good = api.get_status("good").await.unwrap_or_else(|e| panic!("get status: {e}"));
    assert!(good.data.get("status").is_none(), "the rejected status was not stored: {:?}", good.data);
}
