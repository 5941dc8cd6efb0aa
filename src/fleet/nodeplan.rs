//! A NodePlan as a [`Standing`]: its `spec.plan` (the plan's checksum is of its canonical JSON, as
//! the agent computes it) and the status its agent wrote, believed only for the run the spec
//! names now (`status.planChecksum` is the run's identity: the plan and `spec.runToken`). Until
//! the agent has taken a run up the node is `pending`. Pure.

use super::{Outcome, Standing};
use crate::nodeplan::cli_wire;
use crate::nodeplan::resource::NodePlanStatus;
use crate::nodeplan::wire::{self, REFUSALS};
use crate::plan::{self, PlanState};
use kube::api::DynamicObject;


/// Why the agent refused the spec of `generation`, if it did.
fn refused(status: &NodePlanStatus, generation: i64) -> Option<String> {
    let c = status.conditions.iter().find(|c| c.type_ == "Applied")?;
    (status.phase == "Failed" && c.observed_generation >= generation && REFUSALS.contains(&c.reason.as_str()))
        .then(|| format!("refused: {}: {}", c.reason, crate::plan::failure::shown(&c.message, 120)))
}

/// Where the node of the NodePlan `key` stands.
pub fn standing(key: &str, o: &DynamicObject) -> Standing {
    let spec = cli_wire::spec_of(o);
    let mut st = Standing {
        node: cli_wire::node_name(o)
            .map_or_else(|| format!("{key} (no node label)"), |n| crate::plan::failure::shown(n, 80)),
        state: "no plan".into(),
        annotations: o.metadata.annotations.clone().unwrap_or_default(),
        ..Standing::default()
    };
    let status = cli_wire::status_of(o).unwrap_or_else(|e| {
        st.notes.push(e);
        NodePlanStatus::default()
    });
    st.last_change = status.last_apply_time.clone();
    let Some(bytes) = wire::plan_bytes(&spec) else { return st };
    st.plan = Some(plan::checksum(&bytes));
    if let Ok(p) = plan::parse(&bytes) {
        st.id = p.id();
        st.total = p.plan.instructions.len();
        st.probe_names = p.plan.probes.keys().cloned().collect();
    }
    let run = wire::plan_checksum(&spec).unwrap_or_default();
    let ours = status.plan_checksum == run;
    let failure = status.failure.clone().filter(|f| f.checksum == run).map(|f| f.bounded());
    let why = super::failure_text(status.failures, failure.as_ref());
    let failed = || Outcome::Failed(format!("failed ({why})"));
    // A refusal of the current spec is what the node shows, whatever its earlier run did.
    let refusal = refused(&status, o.metadata.generation.unwrap_or_default());
    let (state, outcome) = match status.state.clone().filter(|_| ours) {
        _ if refusal.is_some() => ("refused".into(), Outcome::Failed(refusal.clone().unwrap_or_default())),
        Some(PlanState::Succeeded) => ("succeeded".to_string(), Outcome::Succeeded),
        // Retried by the spec's strategy: not over.
        Some(PlanState::Failed) if !status.execution_state.next_retry.is_empty() && !spec.canceled => {
            st.notes.push(format!("retry at {}", crate::plan::failure::shown(&status.execution_state.next_retry, 40)));
            ("failed".into(), Outcome::Running)
        }
        Some(PlanState::Failed) => ("failed".into(), failed()),
        // A canceled run whose cancel is cleared runs again.
        Some(PlanState::Canceled) if !spec.canceled => ("canceled".into(), Outcome::Running),
        Some(PlanState::Canceled) => ("canceled".into(), Outcome::Failed("canceled".into())),
        Some(PlanState::Paused)
            if status.checkpoint.as_ref().is_some_and(|c| c.resume_state == Some(PlanState::Succeeded)) =>
        {
            ("paused".into(), Outcome::Succeeded)
        }
        Some(other) => (other.as_str().to_string(), Outcome::Running),
        None => ("pending".into(), Outcome::Running),
    };
    st.completed = match state.as_str() {
        "succeeded" => Some(st.total),
        "pending" if !ours => Some(0),
        _ if ours => {
            status.progress.split_once('/').and_then(|(c, _)| c.parse::<usize>().ok()).map(|c| c.min(st.total))
        }
        _ => None,
    };
    if state == "failed" {
        st.notes.push(why.clone());
    }
    if let Outcome::Failed(why) = &outcome
        && state == "refused"
    {
        st.notes.push(why.clone());
    }
    if !status.blocked.is_empty() {
        st.notes.push(format!("blocked: {}", crate::plan::failure::shown(&status.blocked, 120)));
    }
    if spec.canceled && state != "canceled" {
        st.notes.push("cancel asked".into());
    } else if spec.paused && state != "paused" {
        st.notes.push("pause asked".into());
    }
    st.probes = status.probe_statuses.into_iter().filter(|(n, _)| st.probe_names.contains(n)).collect();
    st.state = state;
    st.outcome = outcome;
    st
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn object(spec: Value, status: Value, generation: i64) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "agent.cattle.io/v1alpha1", "kind": "NodePlan",
            "metadata": {"name": "p", "namespace": "ns", "generation": generation, "resourceVersion": "7",
                         "labels": {"cattle.io/node": "node-a"}},
            "spec": spec, "status": status,
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn standings_of_every_state() {
        let p = json!({"instructions": [{"name": "a", "command": "true"}, {"name": "b", "command": "true"}],
                       "probes": {"web": {"fileExists": {"path": "/tmp"}}}});
        let spec = json!({"plan": p});
        let sum = plan::checksum(&serde_json::to_vec(&p).unwrap_or_default());
        let run = wire::plan_checksum(&serde_json::from_value(spec.clone()).unwrap_or_default()).unwrap_or_default();
        let with_token = json!({"plan": p, "runToken": "again"});
        let st = |state: &str, more: Value| {
            let mut s = json!({"planChecksum": run, "state": state, "observedGeneration": 2});
            if let (Some(s), Some(m)) = (s.as_object_mut(), more.as_object()) {
                s.extend(m.clone());
            }
            s
        };
        let done_cp = json!({"checksum": run, "completedInstructions": 2, "totalInstructions": 2,
                             "resumeState": "succeeded", "paused": true});
        let refusal = json!({"phase": "Failed", "planChecksum": "old", "state": "succeeded", "conditions": [
            {"type": "Applied", "status": "False", "reason": "Unsupported", "message": "spec.locking is not supported", "observedGeneration": 2}]});
        let failed = || Outcome::Failed("failed (1 failure)".into());
        type Case<'a> = (&'a str, Value, Value, &'a str, Outcome, Option<usize>);
        let rows: Vec<Case> = vec![
            ("not taken up", spec.clone(), json!({}), "pending", Outcome::Running, Some(0)),
            (
                "another run's status",
                spec.clone(),
                json!({"planChecksum": "old", "state": "succeeded"}),
                "pending",
                Outcome::Running,
                Some(0),
            ),
            ("a new run token", with_token.clone(), st("succeeded", json!({})), "pending", Outcome::Running, Some(0)),
            (
                "executing",
                spec.clone(),
                st("in-progress", json!({"progress": "1/2"})),
                "in-progress",
                Outcome::Running,
                Some(1),
            ),
            (
                "succeeded",
                spec.clone(),
                st("succeeded", json!({"progress": "2/2"})),
                "succeeded",
                Outcome::Succeeded,
                Some(2),
            ),
            (
                "paused after succeeding",
                spec.clone(),
                st("paused", json!({"checkpoint": done_cp})),
                "paused",
                Outcome::Succeeded,
                None,
            ),
            ("failed", spec.clone(), st("failed", json!({"failures": 1})), "failed", failed(), None),
            (
                "failed, retried later",
                spec.clone(),
                st("failed", json!({"failures": 1, "executionState": {"nextRetry": "2026-12-01T10:00:00Z"}})),
                "failed",
                Outcome::Running,
                None,
            ),
            (
                "canceled",
                json!({"plan": p, "canceled": true}),
                st("canceled", json!({})),
                "canceled",
                Outcome::Failed("canceled".into()),
                None,
            ),
            (
                "canceled, then cleared: runs again",
                spec.clone(),
                st("canceled", json!({})),
                "canceled",
                Outcome::Running,
                None,
            ),
            (
                "refused",
                spec.clone(),
                refusal.clone(),
                "refused",
                Outcome::Failed("refused: Unsupported: spec.locking is not supported".into()),
                None,
            ),
            (
                "refused after its run had succeeded (issue 43: it showed succeeded)",
                spec.clone(),
                st("succeeded", json!({"phase": "Failed", "conditions": refusal["conditions"].clone()})),
                "refused",
                Outcome::Failed("refused: Unsupported: spec.locking is not supported".into()),
                None,
            ),
        ];
        for (what, spec, status, state, outcome, completed) in rows {
            let s = standing("p", &object(spec, status, 2));
            assert_eq!((s.state.as_str(), &s.outcome, s.completed), (state, &outcome, completed), "{what}: {s:?}");
            assert_eq!(s.plan.as_deref(), Some(sum.as_str()), "{what}: the plan's checksum, not the run's");
            assert_eq!((s.node.as_str(), s.total), ("node-a", 2));
        }
        // A refusal of an older generation is not this spec's.
        assert_eq!(standing("p", &object(spec.clone(), refusal, 3)).outcome, Outcome::Running);
        let none = standing("p", &object(json!({}), json!({}), 1));
        assert_eq!((none.state.as_str(), none.plan), ("no plan", None));
        let asked = standing("p", &object(json!({"plan": p, "paused": true}), st("in-progress", json!({})), 2));
        assert!(asked.notes.contains(&"pause asked".to_string()), "{asked:?}");
    }

    #[test]
    fn only_the_plans_probes_count() {
        let p = json!({"instructions": [], "probes": {"web": {"fileExists": {"path": "/tmp"}}}});
        let run =
            wire::plan_checksum(&serde_json::from_value(json!({"plan": p})).unwrap_or_default()).unwrap_or_default();
        let status = |web: bool| {
            json!({"planChecksum": run, "state": "succeeded",
                   "probeStatuses": {"web": {"healthy": web}, "old": {"healthy": false}}})
        };
        let s = standing("p", &object(json!({"plan": p}), status(true), 1));
        assert!(s.healthy() && s.probes.len() == 1, "{s:?}");
        assert!(!standing("p", &object(json!({"plan": p}), status(false), 1)).healthy());
        let unreported =
            standing("p", &object(json!({"plan": p}), json!({"planChecksum": run, "state": "succeeded"}), 1));
        assert!(!unreported.healthy(), "a probe not reported yet is not healthy");
    }
}
