//! Where a local plan file stands, as a [`Standing`]: what `plan status FILE -o json|yaml|name`
//! prints, in the shape a plan Secret's or a NodePlan's row has. The `.pos` beside the plan is
//! the agent's record (read by the caller, trusted as the agent trusts it); a record of another
//! plan (the file changed since) counts for nothing.

use super::{Outcome, Standing};
use crate::local::pos::Pos;
use crate::plan::{self, PlanState};

/// The standing of the plan file `name` (`raw` its bytes) whose agent's record is `pos`.
pub fn standing(name: &str, raw: &[u8], pos: &Pos) -> Standing {
    let checksum = plan::checksum(raw);
    let mut st = Standing { node: name.to_string(), plan: Some(checksum.clone()), ..Standing::default() };
    match plan::parse(raw) {
        Ok(p) => {
            st.id = p.id();
            st.total = p.plan.instructions.len();
            st.probe_names = p.plan.probes.keys().cloned().collect();
        }
        Err(e) => st.notes.push(e.to_string()),
    }
    let current = pos.plan_checksum == checksum;
    let state = pos.plan_state.clone().filter(|_| current);
    st.state = state.as_ref().map_or_else(|| "pending".to_string(), |s| s.as_str().to_string());
    st.outcome = match state {
        Some(PlanState::Succeeded) => Outcome::Succeeded,
        Some(PlanState::Failed) => Outcome::Failed(st.state.clone()),
        Some(PlanState::Canceled) => Outcome::Failed("canceled".into()),
        _ => Outcome::Running,
    };
    let checkpoint = pos.checkpoint.as_ref().filter(|c| current && c.checksum == checksum);
    let failure = pos.last_failure.as_ref().filter(|f| current && f.checksum == checksum);
    st.completed = match (&st.state[..], checkpoint) {
        ("succeeded", _) => Some(st.total),
        (_, Some(cp)) => Some(cp.completed_instructions.min(st.total)),
        ("pending", None) => Some(0),
        // Those before the one that failed.
        ("failed", None) => failure.and_then(|f| f.instruction).map(|n| n.saturating_sub(1).min(st.total)),
        _ => None,
    };
    if current {
        st.last_change = pos.last_apply_time.clone();
        st.probes = pos.probe_status.clone();
    }
    if st.state == "failed" {
        st.notes.push(super::failure_text(pos.failure_count, failure));
    }
    if !pos.blocked.is_empty() {
        st.notes.push(format!("blocked: {}", pos.blocked));
    }
    st
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Checkpoint;

    const RAW: &[u8] = br#"{"instructions": [{"name": "a", "command": "true"}, {"name": "b", "command": "false"}]}"#;

    #[test]
    fn a_plan_file_stands_as_its_record_says_and_only_for_its_own_plan() {
        let checksum = plan::checksum(RAW);
        let fresh = standing("x.plan", RAW, &Pos::default());
        assert_eq!((fresh.state.as_str(), fresh.completed, fresh.total), ("pending", Some(0), 2));
        assert_eq!(fresh.id, plan::id_of(RAW).unwrap());
        let failure = plan::Failure::files(&checksum, 2, "boom");
        let failed = Pos {
            plan_checksum: checksum.clone(),
            plan_state: Some(PlanState::Failed),
            checkpoint: Some(Checkpoint {
                checksum: checksum.clone(),
                completed_instructions: 1,
                total_instructions: 2,
                ..Checkpoint::default()
            }),
            failure_count: 1,
            last_apply_time: "Wed Dec  2 12:00:00 UTC 2026".into(),
            last_failure: Some(failure),
            ..Pos::default()
        };
        let st = standing("x.plan", RAW, &failed);
        assert_eq!((st.state.as_str(), st.completed), ("failed", Some(1)));
        assert!(matches!(st.outcome, Outcome::Failed(_)));
        assert!(st.notes.iter().any(|n| n.starts_with("1 failure") && n.contains("boom")), "{:?}", st.notes);
        // The record of another plan (the file was edited since): pending, nothing of that record.
        let other = Pos { plan_checksum: "other".into(), ..failed };
        let st = standing("x.plan", RAW, &other);
        assert_eq!((st.state.as_str(), st.completed, st.last_change.as_str()), ("pending", Some(0), ""));
        assert!(st.notes.is_empty(), "{:?}", st.notes);
    }
}
