//! The NodePlan resource's Rust shape (`agent.cattle.io/v1alpha1`), and the checks the agent
//! makes of a spec before it runs anything: fields it does not know and the draft's fields it
//! does not support yet are refused, never ignored (a newer producer's plan must not run as a
//! smaller one).

use crate::k8s::watch::{Decided, KubeListWatch};
use crate::plan::{Checkpoint, PeriodicInstructionOutput, ProbeStatus};
use kube::api::{Api, ApiResource, DynamicObject};
use kube::core::GroupVersionKind;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// The API resource of NodePlans.
pub fn api_resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk(GROUP, VERSION, KIND);
    ApiResource::from_gvk_with_plural(&gvk, PLURAL)
}

/// The value of the node label for a node name: the name itself, or for a name longer than a
/// label value may be (63 characters), `h-` and the first 40 hex digits of its SHA-256 (the
/// NodePlan then names the node in `spec.nodeName`).
pub fn node_label_value(node: &str) -> String {
    let valid = node.len() <= 63
        && node.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && node.starts_with(|c: char| c.is_ascii_alphanumeric())
        && node.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        node.to_string()
    } else {
        let hex = crate::plan::checksum(node.as_bytes());
        format!("h-{}", &hex[..40])
    }
}

pub const GROUP: &str = "agent.cattle.io";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "NodePlan";
pub const PLURAL: &str = "nodeplans";
/// The label that selects a node's NodePlans.
pub const NODE_LABEL: &str = "cattle.io/node";
/// `"true"`: stop the running plan through the stop ladder and start the new spec at once.
pub const FORCE_UPDATE: &str = "agent.cattle.io/force-update";

/// The CustomResourceDefinition (`nodeplan crd`, `deploy/nodeplan-crd.yaml`), for API servers
/// that enforce its CEL rules and select by its selectable field; [`crd_yaml`] gives older ones
/// theirs.
pub const CRD_YAML: &str = include_str!("../../deploy/nodeplan-crd.yaml");

/// The ValidatingAdmissionPolicy and its binding that let only a node's own agent write its
/// NodePlans' status (`nodeplan crd --admission-policy`, `deploy/nodeplan-status-policy.yaml`).
pub const STATUS_POLICY_YAML: &str = include_str!("../../deploy/nodeplan-status-policy.yaml");

/// The user name of node `node`'s agent, the identity [`STATUS_POLICY_YAML`] lets write the
/// status of the NodePlans whose `spec.nodeName` is `node`.
pub fn agent_user(node: &str) -> String {
    format!("nodeplan:node:{node}")
}

/// The first release whose API server runs the definition's CEL rules (`x-kubernetes-validations`,
/// on by default since 1.25); before it, the field is unknown and kubectl refuses the definition.
pub const CEL_SINCE: (u32, u32) = (1, 25);
/// The first release that knows `selectableFields` (1.30 alpha, on by default from 1.31).
pub const SELECTABLE_SINCE: (u32, u32) = (1, 30);
/// The first release with `admissionregistration.k8s.io/v1` ValidatingAdmissionPolicies.
pub const POLICY_SINCE: (u32, u32) = (1, 30);

/// A Kubernetes release as `1.20`, `v1.20.2` or `1.37.2`: (major, minor).
pub fn parse_kube_version(text: &str) -> Result<(u32, u32), String> {
    let bad = || format!("{} is not a Kubernetes version such as 1.20 or v1.37.2", crate::quoted(text));
    let parts: Vec<&str> = text.strip_prefix('v').unwrap_or(text).split('.').collect();
    let numbers = (2..=3).contains(&parts.len())
        && parts.iter().all(|p| !p.is_empty() && p.len() <= 9 && p.bytes().all(|b| b.is_ascii_digit()));
    match parts.as_slice() {
        [major, minor, ..] if numbers => Ok((major.parse().map_err(|_| bad())?, minor.parse().map_err(|_| bad())?)),
        _ => Err(bad()),
    }
}

/// The definition for an API server of release `kube` (`None`: a current one): [`CRD_YAML`]
/// itself, or for a release that does not know them, without the CEL rules ([`CEL_SINCE`]) and
/// the selectable field ([`SELECTABLE_SINCE`]). A 1.20 API server would drop them itself, but its
/// kubectl refuses a definition with fields it does not know.
pub fn crd_yaml(kube: Option<(u32, u32)>) -> Result<String, String> {
    let Some(version) = kube.filter(|v| *v < SELECTABLE_SINCE) else { return Ok(CRD_YAML.to_string()) };
    let mut crd: Value = serde_yaml_ng::from_str(CRD_YAML).map_err(|e| format!("the shipped definition: {e}"))?;
    if let Some(versions) = crd.pointer_mut("/spec/versions").and_then(Value::as_array_mut) {
        for v in versions.iter_mut().filter_map(Value::as_object_mut) {
            v.remove("selectableFields");
        }
    }
    if version < CEL_SINCE {
        drop_key(&mut crd, "x-kubernetes-validations");
    }
    let body = serde_yaml_ng::to_string(&crd).map_err(|e| format!("the definition: {e}"))?;
    Ok(format!(
        "# The NodePlan custom resource for Kubernetes {}.{} (`nodeplan crd --kube-version`), without\n\
         # what this release does not know: {}.\n\
         # deploy/nodeplan-crd.yaml is the commented original.\n{body}",
        version.0,
        version.1,
        if version < CEL_SINCE {
            "the CEL rules and the selectable field spec.nodeName"
        } else {
            "the selectable field spec.nodeName"
        },
    ))
}

/// Remove every member named `key`, at every depth.
fn drop_key(v: &mut Value, key: &str) {
    match v {
        Value::Object(m) => {
            m.remove(key);
            m.values_mut().for_each(|x| drop_key(x, key));
        }
        Value::Array(a) => a.iter_mut().for_each(|x| drop_key(x, key)),
        _ => {}
    }
}

/// The status-writer policy for an API server of release `kube` (`None`: a current one); a
/// release without ValidatingAdmissionPolicies ([`POLICY_SINCE`]) has none.
pub fn status_policy_yaml(kube: Option<(u32, u32)>) -> Result<&'static str, String> {
    match kube {
        Some(v) if v < POLICY_SINCE => Err(format!(
            "Kubernetes {}.{} has no ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1 needs {}.{} or later): \
             only RBAC guards NodePlans' status there (see SECURITY.md)",
            v.0, v.1, POLICY_SINCE.0, POLICY_SINCE.1
        )),
        _ => Ok(STATUS_POLICY_YAML),
    }
}

/// A field selector's value with `\\`, `,` and `=` escaped (as Kubernetes' `fields.EscapeValue`).
fn field_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        if matches!(c, '\\' | ',' | '=') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The list/watch of node `node`'s NodePlans in `namespace`, and what log lines call it: those
/// labelled [`NODE_LABEL`] for the node and, where the API server selects NodePlans by
/// `spec.nodeName` (a definition with `selectableFields` on Kubernetes 1.31 or later), whose
/// `spec.nodeName` is the node. One log line says which, once the first list answers. Either way
/// the agent still checks each NodePlan's label and `spec.nodeName` itself
/// ([`super::wire::is_for_node`]).
pub fn node_watch(api: Api<DynamicObject>, node: &str, namespace: &str) -> (KubeListWatch<DynamicObject>, String) {
    let labels = format!("{NODE_LABEL}={}", node_label_value(node));
    let fields = format!("spec.nodeName={}", field_value(node));
    let what = format!("NodePlans labelled {labels} in namespace {namespace}");
    let (said, selector) = (what.clone(), fields.clone());
    let (by_label, label_selector) = (api.clone(), labels.clone());
    let looked = std::sync::atomic::AtomicBool::new(false);
    let decided: Decided = Box::new(move |outcome| match outcome {
        Ok(()) => {
            tracing::info!("NodePlan mode: watching {said} with the field selector {selector}");
            if !looked.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tokio::spawn(name_the_unnamed(by_label.clone(), label_selector.clone()));
            }
        }
        Err(why) => tracing::info!(
            "NodePlan mode: watching {said} by label only: the API server does not select NodePlans by spec.nodeName ({why})"
        ),
    });
    let lw = KubeListWatch::preferring(api, &labels, &fields, decided);
    (lw, what)
}

/// Once, where the agent selects its NodePlans by `spec.nodeName`: say which NodePlans carry the
/// node's label but name no node (made before the definition required `spec.nodeName`). The
/// field selector never shows them to the agent, so they would not run without a word.
async fn name_the_unnamed(api: Api<DynamicObject>, labels: String) {
    let lp = kube::api::ListParams::default().labels(&labels);
    let listed = match tokio::time::timeout(std::time::Duration::from_secs(15), api.list(&lp)).await {
        Ok(Ok(l)) => l,
        _ => return,
    };
    for o in listed.items.iter().filter(|o| unnamed(o)) {
        tracing::warn!(
            "nodeplan {}/{}: labelled {labels} but its spec names no nodeName: this agent selects NodePlans by spec.nodeName and never runs it; set spec.nodeName (nodeplan plan push does)",
            o.metadata.namespace.as_deref().unwrap_or_default(),
            o.metadata.name.as_deref().unwrap_or_default()
        );
    }
}

/// Whether a NodePlan names no node in `spec.nodeName`.
fn unnamed(o: &DynamicObject) -> bool {
    o.data.get("spec").and_then(|s| s.get("nodeName")).and_then(Value::as_str).is_none_or(str::is_empty)
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodePlanSpec {
    /// The node, when its name is longer than a label value can hold.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub node_name: String,
    /// Higher runs first; then creation time, then name.
    pub priority: i32,
    pub paused: bool,
    pub canceled: bool,
    /// The plan JSON as a structured object.
    pub plan: Option<Value>,
    /// With `plan`, what identifies a run: a new token runs the same plan again from its first
    /// instruction.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub run_token: String,
    pub retry_strategy: Option<RetryStrategy>,
    pub preflight_checks: Option<Vec<PreflightCheck>>,
    pub execution: Option<Execution>,
    pub plan_ref: Option<Value>,
    pub locking: Option<Value>,
}

/// Retries of a failed run (absent: a failed plan is not retried).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RetryStrategy {
    /// Runs in all, the first included (0: the default, 3).
    pub max_attempts: i64,
    /// Each wait is this many times the one before (absent: 2).
    pub backoff_multiplier: Option<f64>,
    /// The wait before the first retry (empty: 10s).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub initial_delay: String,
    /// The longest wait (empty: 10m).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub max_delay: String,
}

/// A probe that must pass before a run starts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PreflightCheck {
    pub name: String,
    /// A probe of the plan's probe kinds (`httpGet`, `fileExists`).
    pub probe: Value,
    /// A failing required check keeps the plan from starting; an optional one is reported only.
    pub required: bool,
}

impl Default for PreflightCheck {
    fn default() -> Self {
        PreflightCheck { name: String::new(), probe: Value::Null, required: true }
    }
}

/// Bounds on a run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Execution {
    /// The longest a run may execute (`30m`); empty: no limit.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub timeout: String,
}

/// Where the current run stands, as the draft names it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ExecutionState {
    /// When the current run started (or resumed): RFC 3339. A timeout counts from here.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub started: String,
    /// Who holds the node's plan lock while this plan waits for it.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub lock_holder: String,
    /// When a failed run is retried: RFC 3339.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub next_retry: String,
}

/// One instruction's result as the status shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct InstructionResult {
    pub name: String,
    /// `succeeded`, `failed`, `canceled`, `timed out`, …
    pub outcome: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i64>,
    /// RFC 3339.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub start_time: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub end_time: String,
    /// Plain text (lossy UTF-8), capped; only for instructions with `saveOutput`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub output: String,
}

/// A standard condition.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    pub reason: String,
    pub message: String,
    pub last_transition_time: String,
    pub observed_generation: i64,
}

/// The status the agent writes through the status subresource.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodePlanStatus {
    pub observed_generation: i64,
    /// `Pending`, `Executing`, `Paused`, `Applied`, `Failed`, `Cancelled`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub phase: String,
    /// `completed/total` one-time instructions.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub progress: String,
    /// The plan this status belongs to: the checksum of `spec.plan`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub plan_checksum: String,
    /// The plan-state value of the shared flow (`pending`, `in-progress`, …).
    #[serde(skip_serializing_if = "Option::is_none", with = "crate::plan::optional_state")]
    pub state: Option<crate::plan::PlanState>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<Checkpoint>,
    /// Attempts of this plan (1 for the first run).
    pub attempts: i64,
    pub failures: i64,
    pub successes: i64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub last_apply_time: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub instructions: Vec<InstructionResult>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub probe_statuses: BTreeMap<String, ProbeStatus>,
    /// The periodic instructions' last results (their schedule survives restarts).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub periodic_outputs: BTreeMap<String, PeriodicInstructionOutput>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Why the plan is blocked (a leftover process could not be stopped).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub blocked: String,
    /// What made the plan fail (a failed run; kept while it is retried, cleared at a success).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<crate::plan::Failure>,
    #[serde(skip_serializing_if = "is_default")]
    pub execution_state: ExecutionState,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// The fields of `spec` this agent knows, and those of the draft it does not support yet.
const SPEC_FIELDS: &[&str] = &[
    "nodeName",
    "priority",
    "paused",
    "canceled",
    "plan",
    "runToken",
    "retryStrategy",
    "preflightChecks",
    "execution",
    "planRef",
    "locking",
];
const RETRY_FIELDS: &[&str] = &["maxAttempts", "backoffMultiplier", "initialDelay", "maxDelay"];
const PREFLIGHT_FIELDS: &[&str] = &["name", "probe", "required"];
const EXECUTION_FIELDS: &[&str] = &["timeout"];
use crate::plan::fields::PROBE_FIELDS;

/// Why a spec is not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// A field of the draft this agent does not implement yet.
    #[error("{0} is not supported by this agent yet")]
    Unsupported(String),
    /// A field this agent does not know (a newer producer).
    #[error("unknown field {0}: this agent does not know it, so the plan is not run")]
    Unknown(String),
    #[error("spec.plan is missing")]
    NoPlan,
}

impl SpecError {
    /// The status condition reason.
    pub fn reason(&self) -> &'static str {
        match self {
            SpecError::Unsupported(_) | SpecError::Unknown(_) => "Unsupported",
            SpecError::NoPlan => "NoPlan",
        }
    }
}

fn unknown_in(v: &Value, at: &str, known: &[&str]) -> Option<String> {
    crate::plan::fields::unknown_in(v, at, known).into_iter().next()
}

fn unknown_in_items(v: Option<&Value>, at: &str, known: &[&str]) -> Option<String> {
    crate::plan::fields::unknown_in_items(v, at, known).into_iter().next()
}

/// Check a spec (as the API server returned it) before anything runs: the first field that makes
/// it unrunnable by this agent.
pub fn check_spec(spec: &Value) -> Result<(), SpecError> {
    if let Some(f) = unknown_in(spec, "spec", SPEC_FIELDS) {
        return Err(SpecError::Unknown(f));
    }
    for (field, what) in [("planRef", "spec.planRef"), ("locking", "spec.locking")] {
        if spec.get(field).is_some_and(|v| !v.is_null()) {
            return Err(SpecError::Unsupported(what.into()));
        }
    }
    let found = spec
        .get("retryStrategy")
        .and_then(|r| unknown_in(r, "spec.retryStrategy", RETRY_FIELDS))
        .or_else(|| spec.get("execution").and_then(|e| unknown_in(e, "spec.execution", EXECUTION_FIELDS)))
        .or_else(|| unknown_in_items(spec.get("preflightChecks"), "spec.preflightChecks", PREFLIGHT_FIELDS))
        .or_else(|| {
            spec.get("preflightChecks")?.as_array()?.iter().enumerate().find_map(|(i, c)| {
                unknown_in(c.get("probe")?, &format!("spec.preflightChecks[{i}].probe"), PROBE_FIELDS)
            })
        });
    if let Some(f) = found {
        return Err(SpecError::Unknown(f));
    }
    let Some(plan) = spec.get("plan").filter(|p| !p.is_null()) else { return Err(SpecError::NoPlan) };
    if let Some(files) = plan.get("files").and_then(Value::as_array) {
        for (i, f) in files.iter().enumerate() {
            if f.get("contentRef").is_some() {
                return Err(SpecError::Unsupported(format!("spec.plan.files[{i}].contentRef")));
            }
        }
    }
    let found = crate::plan::fields::unknown_plan_keys(plan, "spec.plan").into_iter().next();
    match found {
        Some(f) => Err(SpecError::Unknown(f)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn specs_this_agent_cannot_run_are_refused_with_the_field_named() {
        let plan = json!({"instructions": [{"name": "a", "command": "true"}], "probes": {"p": {"httpGet": {"url": "http://x"}}}});
        let rows: [(Value, Result<(), SpecError>); 14] = [
            (
                json!({"plan": plan, "runToken": "t", "retryStrategy": {"maxAttempts": 2, "initialDelay": "1s"},
                       "preflightChecks": [{"name": "c", "probe": {"fileExists": {"path": "/x"}}}],
                       "execution": {"timeout": "5m"}}),
                Ok(()),
            ),
            (
                json!({"plan": plan, "retryStrategy": {"maxAttempts": 2, "jitter": true}}),
                Err(SpecError::Unknown("spec.retryStrategy.jitter".into())),
            ),
            (
                json!({"plan": plan, "preflightChecks": [{"name": "c", "probe": {"exec": {}}}]}),
                Err(SpecError::Unknown("spec.preflightChecks[0].probe.exec".into())),
            ),
            (
                json!({"plan": plan, "execution": {"timeout": "5m", "deadline": "x"}}),
                Err(SpecError::Unknown("spec.execution.deadline".into())),
            ),
            (json!({"plan": plan, "paused": true, "priority": 3}), Ok(())),
            (json!({}), Err(SpecError::NoPlan)),
            (json!({"plan": plan, "colour": "blue"}), Err(SpecError::Unknown("spec.colour".into()))),
            (json!({"planRef": {"oci": "x"}}), Err(SpecError::Unsupported("spec.planRef".into()))),
            (json!({"plan": plan, "locking": {"enabled": false}}), Err(SpecError::Unsupported("spec.locking".into()))),
            (
                json!({"plan": {"files": [{"path": "/a", "contentRef": {"oci": "x"}}]}}),
                Err(SpecError::Unsupported("spec.plan.files[0].contentRef".into())),
            ),
            (
                json!({"plan": {"instructions": [{"name": "a", "retries": 3}]}}),
                Err(SpecError::Unknown("spec.plan.instructions[0].retries".into())),
            ),
            (json!({"plan": {"probes": {"f": {"fileExists": {"path": "/x"}}}}}), Ok(())),
            (
                json!({"plan": {"probes": {"f": {"tcpSocket": {"port": 1}}}}}),
                Err(SpecError::Unknown("spec.plan.probes.f.tcpSocket".into())),
            ),
            (json!({"plan": {"hooks": []}}), Err(SpecError::Unknown("spec.plan.hooks".into()))),
        ];
        for (spec, want) in rows {
            assert_eq!(check_spec(&spec), want, "{spec}");
        }
    }

    /// Every member named `key`, at any depth, with its path.
    fn find_key(v: &Value, key: &str, at: &str, found: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    if k == key {
                        found.push(format!("{at}.{k}"));
                    }
                    find_key(x, key, &format!("{at}.{k}"), found);
                }
            }
            Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| find_key(x, key, &format!("{at}[{i}]"), found)),
            _ => {}
        }
    }

    fn keys(yaml: &str, key: &str) -> Vec<String> {
        let v: Value = serde_yaml_ng::from_str(yaml).unwrap();
        let mut found = Vec::new();
        find_key(&v, key, "", &mut found);
        found
    }

    #[test]
    fn each_release_gets_the_definition_it_knows() {
        let full = crd_yaml(None).unwrap();
        assert_eq!(full, CRD_YAML);
        let rules = keys(&full, "x-kubernetes-validations");
        assert_eq!(
            rules,
            [
                ".spec.versions[0].schema.openAPIV3Schema.properties.spec.properties.retryStrategy.x-kubernetes-validations",
                ".spec.versions[0].schema.openAPIV3Schema.properties.spec.x-kubernetes-validations"
            ]
        );
        assert_eq!(keys(&full, "selectableFields"), [".spec.versions[0].selectableFields"]);
        // (release, CEL rules kept, selectable field kept)
        for (release, cel, selectable) in [
            ((1, 20), false, false),
            ((1, 24), false, false),
            ((1, 25), true, false),
            ((1, 29), true, false),
            ((1, 30), true, true),
            ((1, 37), true, true),
        ] {
            let text = crd_yaml(Some(release)).unwrap();
            assert_eq!(!keys(&text, "x-kubernetes-validations").is_empty(), cel, "{release:?}");
            assert_eq!(!keys(&text, "selectableFields").is_empty(), selectable, "{release:?}");
            // Everything else is the same definition.
            let mut want: Value = serde_yaml_ng::from_str(CRD_YAML).unwrap();
            let got: Value = serde_yaml_ng::from_str(&text).unwrap();
            if !cel {
                drop_key(&mut want, "x-kubernetes-validations");
            }
            if !selectable {
                drop_key(&mut want, "selectableFields");
            }
            assert_eq!(got, want, "{release:?}");
        }
    }

    #[test]
    fn the_status_policy_is_only_for_releases_that_have_policies() {
        assert_eq!(status_policy_yaml(None), Ok(STATUS_POLICY_YAML));
        assert_eq!(status_policy_yaml(Some((1, 30))), Ok(STATUS_POLICY_YAML));
        let e = status_policy_yaml(Some((1, 20))).unwrap_err();
        assert!(e.starts_with("Kubernetes 1.20 has no ValidatingAdmissionPolicy") && !e.contains('\n'), "{e}");
        // The policy and its binding, for the resource's status, naming the agent as agent_user does.
        let docs: Vec<Value> =
            serde_yaml_ng::Deserializer::from_str(STATUS_POLICY_YAML).map(|d| Value::deserialize(d).unwrap()).collect();
        assert_eq!(docs.len(), 2);
        assert_eq!(docs[0]["kind"], "ValidatingAdmissionPolicy");
        assert_eq!(docs[1]["kind"], "ValidatingAdmissionPolicyBinding");
        assert_eq!(docs[1]["spec"]["policyName"], docs[0]["metadata"]["name"]);
        let rule = &docs[0]["spec"]["matchConstraints"]["resourceRules"][0];
        assert_eq!(rule["resources"], json!([format!("{PLURAL}/status")]));
        assert_eq!(rule["apiGroups"], json!([GROUP]));
        let agent = docs[0]["spec"]["variables"][0]["expression"].as_str().unwrap();
        assert!(agent.contains(&format!("'{}' + oldObject.spec.nodeName", agent_user(""))), "{agent}");
    }

    #[test]
    fn kubernetes_versions() {
        for (text, want) in [("1.20", Ok((1, 20))), ("v1.37.2", Ok((1, 37))), ("1.31.0", Ok((1, 31)))] {
            assert_eq!(parse_kube_version(text), want, "{text}");
        }
        for bad in ["", "1", "1.", "v", "1.x", "1.2.3.4", "1.-2", " 1.20", "99999999999.1", "1.20 "] {
            let e = parse_kube_version(bad).unwrap_err();
            assert!(e.contains("is not a Kubernetes version") && !e.contains('\n'), "{bad:?}: {e}");
        }
    }

    #[test]
    fn field_selector_values_are_escaped() {
        assert_eq!(field_value("node-a"), "node-a");
        assert_eq!(field_value(r"a,b=c\d"), r"a\,b\=c\\d");
    }

    #[test]
    fn the_crd_is_the_shipped_file_and_names_the_resource() {
        let crd: Value = serde_yaml_ng::from_str(CRD_YAML).unwrap();
        assert_eq!(crd["metadata"]["name"], format!("{PLURAL}.{GROUP}"));
        assert_eq!(crd["spec"]["names"]["kind"], KIND);
        assert_eq!(crd["spec"]["versions"][0]["name"], VERSION);
        assert!(crd["spec"]["versions"][0]["subresources"]["status"].is_object());
    }
}
