//! The producer's side of NodePlans, as `nodeplan plan … --nodeplan` and `plan status --node` use
//! it: the object a push creates, the spec it leaves on an existing NodePlan, the spec patches of
//! pause, resume and cancel, which NodePlans belong to a node, and the text `status` prints. Pure
//! functions (the time is an argument), tested by tables; the CLI (`src/cli/plan_cmd/nodeplan.rs`)
//! does the API calls around them.
//!
//! It writes `spec` and `metadata` only: the status is the agent's record (a producer's role cannot
//! write it, see `deploy/nodeplan-rbac.yaml`), and what a NodePlan means for the plan-state flow is
//! [`super::wire`]'s business, not this module's.

use super::resource::{self, Condition, NODE_LABEL, NodePlanSpec, NodePlanStatus};
use super::source::node_label_value;
use super::wire;
use crate::plan::failure::shown;
use kube::api::DynamicObject;
use serde_json::{Value, json};

/// A spec switch the CLI flips with a JSON merge patch (scalars merge as they should).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    Pause,
    Resume,
    Cancel,
}

impl Control {
    /// The spec field and the value it gets.
    pub fn field(self) -> (&'static str, bool) {
        match self {
            Control::Pause => ("paused", true),
            Control::Resume => ("paused", false),
            Control::Cancel => ("canceled", true),
        }
    }

    /// The JSON merge patch that sets it.
    pub fn patch(self) -> Value {
        let (field, value) = self.field();
        json!({"spec": {field: value}})
    }
}

/// The spec patch of `reset`: a new run token (the same plan runs again from its first
/// instruction, with a fresh record), and neither paused nor canceled.
pub fn reset_patch(token: &str) -> Value {
    json!({"spec": {"runToken": token, "paused": false, "canceled": false}})
}

/// A NodePlan to create for `node`: labelled with [`node_label_value`] and naming the node in
/// `spec.nodeName` (the agent's watch selects by both; the definition's CEL rules require the
/// name, and the status-writer policy reads it), `spec.plan` the plan JSON as an object.
pub fn new_nodeplan(namespace: &str, name: &str, node: &str, priority: Option<i32>, plan: Value) -> Value {
    let label = node_label_value(node);
    let mut spec = json!({"plan": plan, "nodeName": node});
    if let Some(p) = priority {
        spec["priority"] = json!(p);
    }
    json!({
        "apiVersion": format!("{}/{}", resource::GROUP, resource::VERSION),
        "kind": resource::KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": {NODE_LABEL: label}},
        "spec": spec,
    })
}

/// The object a push replaces `existing` with (sent as a PUT carrying its resourceVersion):
/// `spec.plan` replaced as a whole, `spec.canceled` cleared, `spec.priority` set when given, every
/// other field kept. A JSON merge patch would not do: it merges objects key by key, so a probe the
/// new plan no longer has would survive in `spec.plan.probes`.
pub fn replace_plan(existing: &DynamicObject, plan: Value, priority: Option<i32>) -> DynamicObject {
    let mut next = existing.clone();
    // Omitted, the server keeps the field managers as they are.
    next.metadata.managed_fields = None;
    if !next.data.get("spec").is_some_and(Value::is_object) {
        next.data["spec"] = json!({});
    }
    // A NodePlan written before spec.nodeName was required gets it from its label (a hashed
    // label has it already): the definition's CEL rules refuse a spec without it.
    let node = match spec_node_name(existing) {
        None => node_name(existing).map(str::to_string),
        Some(_) => None,
    };
    let spec = &mut next.data["spec"];
    spec["plan"] = plan;
    if let Some(node) = node {
        spec["nodeName"] = json!(node);
    }
    if spec.get("canceled").is_some() {
        spec["canceled"] = json!(false);
    }
    if let Some(p) = priority {
        spec["priority"] = json!(p);
    }
    next
}

/// The plan as the API server stores it: object members whose value is null removed, at every
/// depth (the server drops them from fields its schema does not mark nullable; the agent reads a
/// null as absent anyway), so what a producer compares is what it will read back.
pub fn drop_nulls(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|_, x| !x.is_null());
            m.values_mut().for_each(drop_nulls);
        }
        Value::Array(a) => a.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}

/// A plan file's bytes (already checked as a plan) as `spec.plan` holds them: nulls dropped
/// ([`drop_nulls`]), and refused when this agent would refuse it in a NodePlan.
pub fn plan_object(raw: &[u8]) -> Result<Value, String> {
    let mut plan: Value = serde_json::from_slice(raw).map_err(|e| e.to_string())?;
    drop_nulls(&mut plan);
    resource::check_spec(&json!({ "plan": plan })).map_err(|e| format!("as a NodePlan: {e}"))?;
    Ok(plan)
}

/// The node label of an object.
fn label_of(o: &DynamicObject) -> Option<&str> {
    o.metadata.labels.as_ref()?.get(NODE_LABEL).map(String::as_str)
}

fn spec_node_name(o: &DynamicObject) -> Option<&str> {
    o.data.pointer("/spec/nodeName").and_then(Value::as_str).filter(|n| !n.is_empty())
}

/// The node a NodePlan is for (unescaped): its label, or `spec.nodeName` when the label is a hash;
/// `None` without a label.
pub fn node_name(o: &DynamicObject) -> Option<&str> {
    match (label_of(o), spec_node_name(o)) {
        (None, _) => None,
        (Some(label), Some(name)) if label.starts_with("h-") => Some(name),
        (Some(label), _) => Some(label),
    }
}

/// The node a NodePlan is for, as people read it (for the line refusing a push for another).
pub fn node_of(o: &DynamicObject) -> String {
    match node_name(o) {
        None => format!("no node (it has no {NODE_LABEL} label)"),
        Some(name) => format!("node {}", shown(name, 80)),
    }
}

/// The spec of an object (default when absent or unreadable: the CLI only shows it).
pub fn spec_of(o: &DynamicObject) -> NodePlanSpec {
    o.data.get("spec").cloned().and_then(|s| serde_json::from_value(s).ok()).unwrap_or_default()
}

/// The status the agent wrote, or why it cannot be read.
pub fn status_of(o: &DynamicObject) -> Result<NodePlanStatus, String> {
    match o.data.get("status") {
        None | Some(Value::Null) => Ok(NodePlanStatus::default()),
        Some(s) => serde_json::from_value(s.clone()).map_err(|e| format!("unreadable status: {e}")),
    }
}

/// The checksum of an object's `spec.plan` as the agent computes it (what `status.planChecksum`
/// is compared with).
pub fn plan_checksum(o: &DynamicObject) -> Option<String> {
    wire::plan_checksum(&spec_of(o))
}

/// After a push: a line saying the agent will not run the plan again, when the pushed plan is the
/// one the status already records as applied or failed (its status is keyed by the run, and such
/// a run is final; a canceled one runs again once the push clears the cancel).
pub fn push_note(o: &DynamicObject) -> Option<String> {
    let status = status_of(o).ok()?;
    let checksum = plan_checksum(o)?;
    let finished = matches!(status.phase.as_str(), "Applied" | "Failed");
    (finished && status.plan_checksum == checksum).then(|| {
        format!(
            "note: this plan is unchanged and its run is over (phase {}); `nodeplan plan reset` runs it again",
            shown(&status.phase, 20)
        )
    })
}

/// How long ago, as `kubectl get` shows it: `45s`, `12m`, `5h`, `3d`.
pub fn age(created: i64, now: i64) -> String {
    let s = now.saturating_sub(created).max(0);
    match s {
        0..120 => format!("{s}s"),
        120..7200 => format!("{}m", s / 60),
        7200..172_800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// The `Applied` condition, which says where the plan stands and why.
fn applied(status: &NodePlanStatus) -> Option<&Condition> {
    status.conditions.iter().find(|c| c.type_ == "Applied")
}

/// How wide the MESSAGE column may get.
const MESSAGE_CHARS: usize = 60;

/// One NodePlan of `plan status --node` (its JSON and YAML too).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    pub namespace: String,
    pub name: String,
    /// The id of the plan its spec holds (`plan::id`; `-` without a runnable plan).
    pub plan: String,
    pub priority: i32,
    pub phase: String,
    pub progress: String,
    pub attempts: i64,
    pub age: String,
    pub message: String,
}

/// The NodePlans of `objects` that `node`'s agent runs, in the order it runs them
/// ([`wire::order`]; per namespace, since an agent watches one), as table rows. `now`: Unix
/// seconds.
pub fn rows(objects: &[DynamicObject], node: &str, now: i64) -> Vec<Row> {
    let mut mine: Vec<(&DynamicObject, (i32, String, String))> =
        objects.iter().filter(|o| wire::is_for_node(o, node)).map(|o| (o, wire::order_key(o))).collect();
    mine.sort_by(|(a, ka), (b, kb)| {
        a.metadata
            .namespace
            .cmp(&b.metadata.namespace)
            .then_with(|| wire::order((ka.0, &ka.1, &ka.2), (kb.0, &kb.1, &kb.2)))
    });
    mine.into_iter()
        .map(|(o, (priority, _, name))| {
            let status = status_of(o);
            let dash = |s: &str| if s.is_empty() { "-".to_string() } else { shown(s, 20) };
            let created = o.metadata.creation_timestamp.as_ref().map_or(now, |t| t.0.as_second());
            let (phase, progress, attempts, message) = match &status {
                Ok(s) => (
                    dash(&s.phase),
                    dash(&s.progress),
                    s.attempts,
                    applied(s).map_or_else(String::new, |c| shown(&c.message, MESSAGE_CHARS)),
                ),
                Err(e) => ("?".into(), "-".into(), 0, shown(e, MESSAGE_CHARS)),
            };
            let plan = wire::plan_bytes(&spec_of(o)).and_then(|b| crate::plan::id_of(&b));
            Row {
                namespace: o.metadata.namespace.clone().unwrap_or_default(),
                name: shown(&name, 253),
                plan: plan.unwrap_or_else(|| "-".into()),
                priority,
                phase,
                progress,
                attempts,
                age: age(created, now),
                message,
            }
        })
        .collect()
}

/// The table of `plan status --node`: a header and one line per row, columns padded to their
/// widest cell (NAMESPACE first with `with_namespace`; the plan id after the name when `wide`).
pub fn table(rows: &[Row], with_namespace: bool, wide: bool) -> Vec<String> {
    let mut cells: Vec<Vec<String>> = vec![
        ["NAMESPACE", "NAME", "PLAN", "PRIORITY", "PHASE", "PROGRESS", "ATTEMPTS", "AGE", "MESSAGE"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
    ];
    for r in rows {
        cells.push(vec![
            r.namespace.clone(),
            r.name.clone(),
            r.plan.clone(),
            r.priority.to_string(),
            r.phase.clone(),
            r.progress.clone(),
            r.attempts.to_string(),
            r.age.clone(),
            r.message.clone(),
        ]);
    }
    for row in &mut cells {
        if !wide {
            row.remove(2);
        }
        if !with_namespace {
            row.remove(0);
        }
    }
    crate::columns(&cells)
}

/// A label and its value, aligned as every `plan status` prints them.
fn line(label: &str, value: impl std::fmt::Display) -> String {
    format!("{:<12}{value}", format!("{label}:"))
}

/// The text of `plan status --nodeplan`: the plan (its id, the same after a reset), phase,
/// progress, the spec's switches, attempts, conditions, per-instruction results and probes.
pub fn status_lines(o: &DynamicObject) -> Vec<String> {
    let spec = spec_of(o);
    let namespace = o.metadata.namespace.as_deref().unwrap_or_default();
    let name = o.metadata.name.as_deref().unwrap_or_default();
    let mut out =
        vec![line("nodeplan", format!("{namespace}/{name} (for {}, priority {})", node_of(o), spec.priority))];
    let checksum = match wire::valid_plan(&spec) {
        Ok((vp, checksum)) => {
            out.push(line(
                "plan",
                format!("{} ({})", vp.id(), crate::count(vp.plan.instructions.len(), "instruction")),
            ));
            if !spec.run_token.is_empty() {
                out.push(line("run token", format!("{} (set by a reset)", shown(&spec.run_token, 64))));
            }
            Some(checksum)
        }
        Err(e) => {
            out.push(line("plan", format!("not runnable: {}", shown(&e, 200))));
            None
        }
    };
    let status = match status_of(o) {
        Ok(s) => s,
        Err(e) => {
            out.push(line("status", shown(&e, 200)));
            return out;
        }
    };
    if status.phase.is_empty() {
        out.push(line("phase", "- (the agent has not written a status yet)"));
    } else {
        out.push(line("phase", shown(&status.phase, 40)));
    }
    let stale = !status.plan_checksum.is_empty() && Some(&status.plan_checksum) != checksum.as_ref();
    if stale {
        out.push(line(
            "status of",
            "an earlier run (another spec.plan or run token): the agent has not started this one yet",
        ));
    }
    if !status.progress.is_empty() {
        out.push(line("progress", format!("{} instructions done", shown(&status.progress, 40))));
    }
    out.push(line("control", format!("paused={} canceled={}", spec.paused, spec.canceled)));
    let last = if status.last_apply_time.is_empty() {
        "never".to_string()
    } else {
        shown(&crate::plan::shown_time(&status.last_apply_time), 40)
    };
    out.push(line(
        "attempts",
        format!(
            "{} ({} failed in a row, {} succeeded); last {last}",
            status.attempts, status.failures, status.successes
        ),
    ));
    for c in &status.conditions {
        out.push(line(
            "condition",
            format!(
                "{}={} ({}): {}",
                shown(&c.type_, 40),
                shown(&c.status, 10),
                shown(&c.reason, 40),
                shown(&c.message, 200)
            ),
        ));
    }
    if let Some(f) = status.failure.clone().filter(|f| Some(&f.checksum) == checksum.as_ref()) {
        out.extend(f.bounded().status_lines());
    }
    let total = status.instructions.len();
    for (i, r) in status.instructions.iter().enumerate() {
        let code = r.exit_code.map_or_else(String::new, |c| format!(" (exit {c})"));
        let outcome = if r.outcome.is_empty() { "not run" } else { r.outcome.as_str() };
        out.push(line("result", format!("{}/{total} {}: {}{code}", i + 1, shown(&r.name, 80), shown(outcome, 40))));
    }
    for (name, p) in &status.probe_statuses {
        let h = if p.healthy { "healthy" } else { "unhealthy" };
        out.push(line(
            "probe",
            format!("{}: {h} (successes {}, failures {})", shown(name, 80), p.success_count, p.failure_count),
        ));
    }
    if !status.blocked.is_empty() {
        out.push(line("blocked", shown(&status.blocked, 200)));
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn nulls_are_dropped_at_every_depth_as_the_api_server_stores_a_plan() {
        let mut p =
            json!({"files": null, "instructions": [{"name": "a", "env": null, "args": ["x", null]}], "probes": {}});
        drop_nulls(&mut p);
        assert_eq!(p, json!({"instructions": [{"name": "a", "args": ["x", null]}], "probes": {}}));
    }

    use super::*;
    use crate::nodeplan::wire::is_for_node;

    fn object(v: Value) -> DynamicObject {
        serde_json::from_value(v).unwrap()
    }

    fn plan_a() -> Value {
        json!({"instructions": [{"name": "a", "command": "true"}], "probes": {"p": {"fileExists": {"path": "/x"}}}})
    }

    #[test]
    fn control_patches_set_one_spec_field() {
        let rows = [
            (Control::Pause, json!({"spec": {"paused": true}})),
            (Control::Resume, json!({"spec": {"paused": false}})),
            (Control::Cancel, json!({"spec": {"canceled": true}})),
        ];
        for (c, want) in rows {
            assert_eq!(c.patch(), want, "{c:?}");
        }
    }

    #[test]
    fn a_new_nodeplan_is_labelled_for_its_node_and_names_a_long_one_in_the_spec() {
        let long = format!("node-{}", "x".repeat(70));
        let rows = [
            ("node-a", None, json!({"cattle.io/node": "node-a"}), json!({"plan": plan_a(), "nodeName": "node-a"})),
            (
                "node-a",
                Some(-3),
                json!({"cattle.io/node": "node-a"}),
                json!({"plan": plan_a(), "priority": -3, "nodeName": "node-a"}),
            ),
            (
                long.as_str(),
                Some(7),
                json!({"cattle.io/node": node_label_value(&long)}),
                json!({"plan": plan_a(), "priority": 7, "nodeName": long}),
            ),
        ];
        for (node, priority, labels, spec) in rows {
            let o = new_nodeplan("ns", "p", node, priority, plan_a());
            assert_eq!(o["metadata"], json!({"name": "p", "namespace": "ns", "labels": labels}), "{node}");
            assert_eq!(o["spec"], spec, "{node}");
            assert_eq!(
                (o["apiVersion"].as_str(), o["kind"].as_str()),
                (Some("agent.cattle.io/v1alpha1"), Some("NodePlan"))
            );
            // The agent of that node takes it.
            assert!(is_for_node(&object(o.clone()), node), "{node}");
            assert!(!is_for_node(&object(o), "node-b"), "{node}");
        }
    }

    #[test]
    fn a_push_replaces_the_whole_plan_clears_the_cancel_and_keeps_the_rest() {
        let existing = object(json!({
            "apiVersion": "agent.cattle.io/v1alpha1", "kind": "NodePlan",
            "metadata": {"name": "p", "namespace": "ns", "resourceVersion": "42", "labels": {"cattle.io/node": "n"},
                         "managedFields": [{"manager": "kubectl"}]},
            "spec": {"plan": plan_a(), "priority": 5, "paused": true, "canceled": true, "nodeName": "n"},
            "status": {"phase": "Cancelled"},
        }));
        let new_plan = json!({"instructions": [{"name": "b", "command": "true"}]});
        let rows = [
            (None, json!({"plan": new_plan, "priority": 5, "paused": true, "canceled": false, "nodeName": "n"})),
            (Some(1), json!({"plan": new_plan, "priority": 1, "paused": true, "canceled": false, "nodeName": "n"})),
        ];
        for (priority, want) in rows {
            let next = replace_plan(&existing, new_plan.clone(), priority);
            assert_eq!(next.data["spec"], want, "no probe of the old plan survives");
            assert_eq!(next.metadata.resource_version.as_deref(), Some("42"), "the precondition");
            assert_eq!(next.metadata.managed_fields, None);
            assert_eq!(next.metadata.labels, existing.metadata.labels);
        }
        // A spec without the switches gets none; an object without a spec gets one.
        let bare = object(json!({"metadata": {"name": "p"}, "spec": {"plan": plan_a()}}));
        assert_eq!(replace_plan(&bare, new_plan.clone(), None).data["spec"], json!({"plan": new_plan}));
        let none = object(json!({"metadata": {"name": "p"}}));
        assert_eq!(replace_plan(&none, new_plan.clone(), None).data["spec"], json!({"plan": new_plan}));
        // A NodePlan written before spec.nodeName was required gets it from its label.
        let labelled =
            object(json!({"metadata": {"name": "p", "labels": {"cattle.io/node": "n"}}, "spec": {"plan": plan_a()}}));
        assert_eq!(
            replace_plan(&labelled, new_plan.clone(), None).data["spec"],
            json!({"plan": new_plan, "nodeName": "n"})
        );
    }

    #[test]
    fn which_node_a_nodeplan_is_for() {
        let long = "l".repeat(64);
        let hashed = node_label_value(&long);
        let o = |labels: Value, spec: Value| object(json!({"metadata": {"name": "p", "labels": labels}, "spec": spec}));
        let rows = [
            (o(json!({"cattle.io/node": "n"}), json!({})), "n", true, "node n"),
            (o(json!({"cattle.io/node": "n"}), json!({})), "m", false, "node n"),
            (o(json!({}), json!({})), "n", false, "no node (it has no cattle.io/node label)"),
            (o(json!({"cattle.io/node": hashed}), json!({"nodeName": long})), long.as_str(), true, ""),
            // The hash alone is not enough: the agent matches the full name too.
            (o(json!({"cattle.io/node": hashed}), json!({"nodeName": "other"})), long.as_str(), false, "node other"),
            (o(json!({"cattle.io/node": hashed}), json!({})), long.as_str(), false, ""),
            // A short name under a hashed label is not what that node's agent selects.
            (o(json!({"cattle.io/node": hashed}), json!({"nodeName": "n"})), "n", false, "node n"),
            // A spec that names the node agrees with its label; one that names another wins.
            (o(json!({"cattle.io/node": "n"}), json!({"nodeName": "n"})), "n", true, "node n"),
            (o(json!({"cattle.io/node": "n"}), json!({"nodeName": "m"})), "n", false, ""),
            (o(json!({"cattle.io/node": "n"}), json!({"nodeName": "m"})), "m", false, ""),
            (o(json!({"cattle.io/node": "n"}), json!({"nodeName": ""})), "n", true, "node n"),
        ];
        for (obj, node, want, who) in rows {
            assert_eq!(is_for_node(&obj, node), want, "{node} {:?}", obj.metadata.labels);
            if !who.is_empty() {
                assert_eq!(node_of(&obj), who);
            }
        }
    }

    #[test]
    fn shown_values_are_one_line_and_cut() {
        let rows = [
            ("plain", 10, "plain"),
            ("a\nb\tc", 10, "a\\nb\\tc"),
            ("abcdef", 3, "abc…"),
            ("ééé", 2, "éé…"),
            ("", 5, ""),
        ];
        for (s, max, want) in rows {
            assert_eq!(shown(s, max), want, "{s:?}");
        }
    }

    #[test]
    fn ages_read_as_kubectl_shows_them() {
        let rows = [(0, "0s"), (-5, "0s"), (119, "119s"), (120, "2m"), (7199, "119m"), (7200, "2h"), (172_800, "2d")];
        for (ago, want) in rows {
            assert_eq!(age(1_000_000 - ago, 1_000_000), want, "{ago}");
        }
    }

    fn listed(name: &str, ns: &str, node: &str, priority: Option<i64>, created: &str, status: Value) -> DynamicObject {
        let mut spec = json!({"plan": plan_a()});
        if let Some(p) = priority {
            spec["priority"] = json!(p);
        }
        object(json!({
            "metadata": {"name": name, "namespace": ns, "creationTimestamp": created, "labels": {"cattle.io/node": node}},
            "spec": spec, "status": status,
        }))
    }

    #[test]
    fn a_nodes_table_lists_its_plans_in_run_order() {
        let now = "2026-01-01T01:00:00Z".parse::<k8s_openapi::jiff::Timestamp>().unwrap().as_second();
        let applied = json!({"phase": "Applied", "progress": "1/1", "attempts": 1,
            "conditions": [{"type": "Applied", "status": "True", "reason": "Applied", "message": "plan succeeded"}]});
        let long_message = format!("unknown field spec.x{}", "y".repeat(100));
        let refused = json!({"phase": "Failed",
            "conditions": [{"type": "Other", "message": "not this one"},
                           {"type": "Applied", "status": "False", "reason": "Unsupported", "message": long_message}]});
        let objects = [
            listed("b", "ns", "n", None, "2026-01-01T00:00:02Z", json!({})),
            listed("z", "ns", "n", Some(10), "2026-01-01T00:59:30Z", applied),
            listed("c", "ns", "n", None, "2026-01-01T00:00:01Z", refused),
            listed("a", "ns", "n", None, "2026-01-01T00:00:02Z", json!({"phase": 7})),
            listed("other-node", "ns", "m", Some(99), "2026-01-01T00:00:00Z", json!({})),
            listed("first-ns", "another", "n", Some(-1), "2026-01-01T00:00:00Z", json!({})),
        ];
        let rows = rows(&objects, "n", now);
        let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["first-ns", "z", "c", "a", "b"], "namespace, then priority, age, name");
        assert_eq!(
            rows[1],
            Row {
                namespace: "ns".into(),
                name: "z".into(),
                plan: crate::plan::id_of(&serde_json::to_vec(&plan_a()).unwrap()).unwrap(),
                priority: 10,
                phase: "Applied".into(),
                progress: "1/1".into(),
                attempts: 1,
                age: "30s".into(),
                message: "plan succeeded".into(),
            }
        );
        assert_eq!(rows[2].message, shown(&long_message, MESSAGE_CHARS), "the Applied condition's, cut");
        assert_eq!((rows[3].phase.as_str(), rows[3].age.as_str()), ("?", "59m"), "an unreadable status");
        assert_eq!((rows[4].phase.as_str(), rows[4].progress.as_str(), rows[4].message.as_str()), ("-", "-", ""));

        let t = table(&rows[1..2], false, false);
        assert_eq!(
            t,
            [
                "NAME   PRIORITY   PHASE     PROGRESS   ATTEMPTS   AGE   MESSAGE",
                "z      10         Applied   1/1        1          30s   plan succeeded",
            ]
        );
        let t = table(&rows, true, false);
        assert!(t[0].starts_with("NAMESPACE   NAME       PRIORITY"), "{t:?}");
        assert!(t[5].starts_with("ns          b          0          -"), "{t:?}");
        assert_eq!(t[5], t[5].trim_end(), "no trailing spaces");
        assert_eq!(table(&[], false, false).len(), 1, "the header alone");
        let t = table(&rows[1..2], false, true);
        assert!(t[0].starts_with("NAME   PLAN           PRIORITY"), "wide: the plan id after the name: {t:?}");
        assert!(t[1].starts_with(&format!("z      {}   10", rows[1].plan)), "{t:?}");
    }

    #[test]
    fn status_shows_the_agents_record_of_this_plan() {
        let spec = json!({"plan": plan_a(), "priority": 2, "paused": true});
        let checksum = wire::plan_checksum(&serde_json::from_value(spec.clone()).unwrap()).unwrap();
        let status = json!({
            "phase": "Applied", "progress": "1/1", "planChecksum": checksum, "attempts": 2, "failures": 0,
            "successes": 1, "lastApplyTime": "2026-01-01T00:00:00Z",
            "conditions": [{"type": "Applied", "status": "True", "reason": "Applied", "message": "plan succeeded\nok"}],
            "instructions": [{"name": "a", "outcome": "ok", "exitCode": 0}, {"name": "b", "outcome": "FAILED"}, {"name": "c"}],
            "probeStatuses": {"p": {"healthy": true, "successCount": 3, "failureCount": 0}},
        });
        let o = object(json!({"metadata": {"name": "p", "namespace": "ns", "labels": {"cattle.io/node": "n"}},
                              "spec": spec, "status": status}));
        let want = [
            "nodeplan:   ns/p (for node n, priority 2)".to_string(),
            format!(
                "plan:       {} (1 instruction)",
                crate::plan::id_of(&serde_json::to_vec(&plan_a()).unwrap()).unwrap()
            ),
            "phase:      Applied".into(),
            "progress:   1/1 instructions done".into(),
            "control:    paused=true canceled=false".into(),
            "attempts:   2 (0 failed in a row, 1 succeeded); last 2026-01-01T00:00:00Z".into(),
            "condition:  Applied=True (Applied): plan succeeded\\nok".into(),
            "result:     1/3 a: ok (exit 0)".into(),
            "result:     2/3 b: FAILED".into(),
            "result:     3/3 c: not run".into(),
            "probe:      p: healthy (successes 3, failures 0)".into(),
        ];
        assert_eq!(status_lines(&o), want);
        assert_eq!(
            push_note(&o).as_deref(),
            Some(
                "note: this plan is unchanged and its run is over (phase Applied); `nodeplan plan reset` runs it again"
            )
        );

        // A status of an earlier plan says so; a NodePlan without status says the agent has not
        // looked; neither gets a push note.
        let mut earlier = o.clone();
        earlier.data["status"]["planChecksum"] = json!("0123456789abcdef");
        let lines = status_lines(&earlier);
        assert!(
            lines.contains(
                &"status of:  an earlier run (another spec.plan or run token): the agent has not started this one yet"
                    .into()
            ),
            "{lines:#?}"
        );
        assert_eq!(push_note(&earlier), None);
        let mut fresh = o.clone();
        fresh.data["status"] = Value::Null;
        let lines = status_lines(&fresh);
        assert_eq!(lines[2], "phase:      - (the agent has not written a status yet)");
        assert_eq!(push_note(&fresh), None);
        // A spec the agent cannot run and a status it cannot read are shown as such.
        let bad = object(json!({"metadata": {"name": "p"}, "spec": {"plan": {"files": [{"path": "rel"}]}},
                                "status": {"attempts": "many"}}));
        let lines = status_lines(&bad);
        assert!(lines[1].starts_with("plan:       not runnable: ") && lines[1].contains("files[0].path"), "{lines:?}");
        assert!(lines[2].starts_with("status:     unreadable status: "), "{lines:?}");
    }
}
