//! The NodePlan resource's Rust shape (`agent.cattle.io/v1alpha1`), and the checks the agent
//! makes of a spec before it runs anything: fields it does not know and the draft's fields it
//! does not support yet are refused, never ignored (a newer producer's plan must not run as a
//! smaller one).

use crate::plan::{Checkpoint, PeriodicInstructionOutput, ProbeStatus};
use kube::api::ApiResource;
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

/// The CustomResourceDefinition (`nodeplan crd`, `deploy/nodeplan-crd.yaml`).
pub const CRD_YAML: &str = include_str!("../../deploy/nodeplan-crd.yaml");

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
const PLAN_FIELDS: &[&str] = &["files", "instructions", "periodicInstructions", "probes"];
const FILE_FIELDS: &[&str] =
    &["path", "content", "directory", "uid", "gid", "permissions", "action", "dynamic", "minor"];
const INSTRUCTION_FIELDS: &[&str] = &["name", "image", "command", "args", "env", "saveOutput", "timeoutSeconds"];
const PERIODIC_FIELDS: &[&str] =
    &["name", "image", "command", "args", "env", "timeoutSeconds", "periodSeconds", "saveStderrOutput"];
const RETRY_FIELDS: &[&str] = &["maxAttempts", "backoffMultiplier", "initialDelay", "maxDelay"];
const PREFLIGHT_FIELDS: &[&str] = &["name", "probe", "required"];
const EXECUTION_FIELDS: &[&str] = &["timeout"];
const PROBE_FIELDS: &[&str] =
    &["initialDelaySeconds", "timeoutSeconds", "successThreshold", "failureThreshold", "httpGet", "fileExists"];

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
    v.as_object()?.keys().find(|k| !known.contains(&k.as_str())).map(|k| format!("{at}.{k}"))
}

fn unknown_in_items(v: Option<&Value>, at: &str, known: &[&str]) -> Option<String> {
    v?.as_array()?.iter().enumerate().find_map(|(i, item)| unknown_in(item, &format!("{at}[{i}]"), known))
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
    if let Some(f) = unknown_in(plan, "spec.plan", PLAN_FIELDS) {
        return Err(SpecError::Unknown(f));
    }
    if let Some(files) = plan.get("files").and_then(Value::as_array) {
        for (i, f) in files.iter().enumerate() {
            if f.get("contentRef").is_some() {
                return Err(SpecError::Unsupported(format!("spec.plan.files[{i}].contentRef")));
            }
        }
    }
    let found = unknown_in_items(plan.get("files"), "spec.plan.files", FILE_FIELDS)
        .or_else(|| unknown_in_items(plan.get("instructions"), "spec.plan.instructions", INSTRUCTION_FIELDS))
        .or_else(|| {
            unknown_in_items(plan.get("periodicInstructions"), "spec.plan.periodicInstructions", PERIODIC_FIELDS)
        })
        .or_else(|| {
            plan.get("probes")?
                .as_object()?
                .iter()
                .find_map(|(name, p)| unknown_in(p, &format!("spec.plan.probes.{name}"), PROBE_FIELDS))
        });
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

    #[test]
    fn the_crd_is_the_shipped_file_and_names_the_resource() {
        let crd: Value = serde_yaml_ng::from_str(CRD_YAML).unwrap();
        assert_eq!(crd["metadata"]["name"], format!("{PLURAL}.{GROUP}"));
        assert_eq!(crd["spec"]["names"]["kind"], KIND);
        assert_eq!(crd["spec"]["versions"][0]["name"], VERSION);
        assert!(crd["spec"]["versions"][0]["subresources"]["status"].is_object());
    }
}
