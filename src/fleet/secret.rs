//! A node's plan Secret as a [`Standing`]: the plan-state flow's keys (and the legacy
//! applied/failed checksums) read the way the agent writes them. Pure.

use super::{Outcome, Standing};
use crate::plan::{self, Checkpoint, PlanState};
use crate::remote::client::SecretSnapshot;
use crate::remote::wire;

/// The label Rancher gives a machine's plan Secret: the machine's name.
pub const MACHINE_NAME: &str = "rke.cattle.io/machine-name";

/// Where the node of the plan Secret `name` stands. The node is the machine Rancher names in
/// the Secret's labels, else the Secret's name.
pub fn standing(name: &str, s: &SecretSnapshot) -> Standing {
    let text = |k: &str| wire::text(s, k).unwrap_or_default();
    let node = s.labels.get(MACHINE_NAME).filter(|m| !m.is_empty()).map_or(name, String::as_str);
    let mut st = Standing {
        node: node.to_string(),
        state: "no plan".into(),
        last_change: text(wire::LAST_APPLY_TIME),
        annotations: s.annotations.clone(),
        ..Standing::default()
    };
    let Some(raw) = s.data.get(wire::PLAN) else { return st };
    let checksum = plan::checksum(raw);
    if let Ok(p) = plan::parse(raw) {
        st.id = p.id();
        st.total = p.plan.instructions.len();
        st.probe_names = p.plan.probes.keys().cloned().collect();
    }
    let checkpoint = Checkpoint::read(s.data.get(wire::PLAN_CHECKPOINT).map(Vec::as_slice), &checksum);
    let failure = wire::failure(s, &checksum);
    let why = super::failure_text(wire::failure_count(s), failure.as_ref());
    let failed = || Outcome::Failed(format!("failed ({why})"));
    let (state, outcome) = match wire::plan_state(s) {
        Some(PlanState::Succeeded) => ("succeeded".to_string(), Outcome::Succeeded),
        Some(PlanState::Failed) => ("failed".into(), failed()),
        Some(PlanState::Canceled) => ("canceled".into(), Outcome::Failed("canceled".into())),
        // Paused after its one-time instructions succeeded (only its periodic ones are held).
        Some(PlanState::Paused)
            if checkpoint.as_ref().is_some_and(|c| c.resume_state == Some(PlanState::Succeeded)) =>
        {
            ("paused".into(), Outcome::Succeeded)
        }
        Some(other) => (other.as_str().to_string(), Outcome::Running),
        None => match wire::legacy_outcome(s, &checksum) {
            Some(true) => ("applied".into(), Outcome::Succeeded),
            Some(false) => ("failed".into(), failed()),
            None => ("pending".into(), Outcome::Running),
        },
    };
    st.completed = match (&state[..], &checkpoint) {
        ("succeeded" | "applied", _) => Some(st.total),
        (_, Some(cp)) => Some(cp.completed_instructions.min(st.total)),
        ("pending", None) => Some(0),
        // Those before the one that failed.
        ("failed", None) => failure.and_then(|f| f.instruction).map(|n| n.saturating_sub(1).min(st.total)),
        _ => None,
    };
    if state == "failed" {
        st.notes.push(why.clone());
    }
    let a = wire::annotations(s);
    match plan::resolve_annotations(&a) {
        Err(e) => st.notes.push(e.to_string()),
        Ok(_) => {
            if plan::parse_annotation_value(a.canceled) == Ok(true) && state != "canceled" {
                st.notes.push("cancel asked".into());
            } else if plan::parse_annotation_value(a.paused) == Ok(true) && state != PlanState::Paused.as_str() {
                st.notes.push("pause asked".into());
            }
        }
    }
    st.probes = wire::probe_statuses(s);
    st.plan = Some(checksum);
    st.state = state;
    st.outcome = outcome;
    st
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::row_of;
    use crate::remote::client::test_snapshot as snap;

    fn row_of_secret(name: &str, s: &SecretSnapshot) -> crate::fleet::Row {
        row_of(&standing(name, s))
    }

    #[test]
    fn the_node_is_the_machine_rancher_names_else_the_secret() {
        let mut s = snap(&serde_json::json!({"instructions": []}), &[], &[]);
        assert_eq!(standing("m-plan", &s).node, "m-plan");
        s.labels.insert(MACHINE_NAME.into(), "pool-a-m1".into());
        assert_eq!(standing("m-plan", &s).node, "pool-a-m1");
    }

    #[test]
    fn rows_of_every_state() {
        let p =
            serde_json::json!({"instructions": [{"name": "a", "command": "true"}, {"name": "b", "command": "true"}]});
        let sum = plan::checksum(&serde_json::to_vec(&p).unwrap_or_default());
        let cp = format!(r#"{{"checksum":"{sum}","completedInstructions":1,"totalInstructions":2,"paused":true}}"#);
        let probes = r#"{"web":{"healthy":true},"db":{"healthy":false}}"#;
        // The agent names the instruction that failed: the ones before it are done.
        let second = plan::Failure::instruction(&sum, 1, 2, "b", "exit status 3".into(), b"", &[]);
        let second = serde_json::to_string(&second).unwrap();
        let rows = [
            (snap(&p, &[("plan-state", "pending")], &[]), "pending", Some(0), ""),
            (snap(&p, &[("plan-state", "in-progress")], &[]), "in-progress", None, ""),
            (snap(&p, &[("plan-state", "paused"), ("plan-checkpoint", &cp)], &[]), "paused", Some(1), ""),
            (snap(&p, &[("plan-state", "succeeded"), ("probe-statuses", probes)], &[]), "succeeded", Some(2), ""),
            (snap(&p, &[("plan-state", "failed"), ("failure-count", "3")], &[]), "failed", None, "3 failures"),
            (
                snap(&p, &[("plan-state", "failed"), ("failure-count", "1"), ("failed-instruction", &second)], &[]),
                "failed",
                Some(1),
                "1 failure: instruction 2/2 b: exit status 3",
            ),
            (snap(&p, &[("applied-checksum", &sum)], &[]), "applied", Some(2), ""),
            (snap(&p, &[("failed-checksum", &sum), ("failure-count", "1")], &[]), "failed", None, "1 failure"),
            (
                snap(&p, &[("plan-state", "in-progress")], &[(plan::ANNOTATION_CANCELED, "true")]),
                "in-progress",
                None,
                "cancel asked",
            ),
            (snap(&p, &[("plan-state", "pending")], &[(plan::ANNOTATION_PAUSED, "yes")]), "pending", Some(0), "paused"),
        ];
        for (s, state, completed, error) in rows {
            let r = row_of_secret("n", &s);
            assert_eq!((r.state.as_str(), r.completed, r.total), (state, completed, 2), "{r:?}");
            assert!(r.error.contains(error), "{error:?} in {r:?}");
            assert_eq!(r.plan, plan::id(&serde_json::from_value(p.clone()).unwrap()), "the id every command shows");
        }
        let r = row_of_secret("n", &snap(&p, &[("plan-state", "succeeded"), ("probe-statuses", probes)], &[]));
        assert_eq!((r.probes_healthy, r.probes), (1, 2));
        let mut none = snap(&p, &[], &[]);
        none.data.clear();
        assert_eq!(row_of_secret("n", &none).state, "no plan");
    }

    #[test]
    fn outcomes() {
        let p = serde_json::json!({"instructions": [{"name": "a", "command": "true"}]});
        let sum = plan::checksum(&serde_json::to_vec(&p).unwrap_or_default());
        let done_cp = format!(
            r#"{{"checksum":"{sum}","completedInstructions":1,"totalInstructions":1,"resumeState":"succeeded","paused":true}}"#
        );
        let why = plan::Failure::instruction(&sum, 0, 1, "a", "exit status 3".into(), b"oops\n", &[]);
        let why = serde_json::to_string(&why).unwrap();
        let rows = [
            (snap(&p, &[("plan-state", "pending")], &[]), Outcome::Running),
            (snap(&p, &[("plan-state", "paused")], &[]), Outcome::Running),
            (snap(&p, &[("plan-state", "paused"), ("plan-checkpoint", &done_cp)], &[]), Outcome::Succeeded),
            (snap(&p, &[("plan-state", "succeeded")], &[]), Outcome::Succeeded),
            (snap(&p, &[("plan-state", "canceled")], &[]), Outcome::Failed("canceled".into())),
            (
                snap(&p, &[("plan-state", "failed"), ("failure-count", "2")], &[]),
                Outcome::Failed("failed (2 failures)".into()),
            ),
            (snap(&p, &[("applied-checksum", &sum)], &[]), Outcome::Succeeded),
            (snap(&p, &[("failed-checksum", &sum)], &[]), Outcome::Failed("failed (0 failures)".into())),
            (
                snap(&p, &[("plan-state", "failed"), ("failure-count", "1"), ("failed-instruction", &why)], &[]),
                Outcome::Failed("failed (1 failure: instruction 1/1 a: exit status 3; last output: oops)".into()),
            ),
            (snap(&p, &[], &[]), Outcome::Running),
        ];
        for (s, want) in rows {
            let st = standing("n", &s);
            assert_eq!(st.outcome, want, "{st:?}");
            assert_eq!(st.plan.as_deref(), Some(sum.as_str()));
        }
    }
}
