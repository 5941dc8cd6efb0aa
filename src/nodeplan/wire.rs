//! A NodePlan as the plan-state flow sees it, and the status written back: pure functions (the
//! time is an argument), tested by tables. The source ([`super::source`]) reads and writes the
//! objects around them.
//!
//! A run is identified by the checksum of `spec.plan` (its canonical JSON), not by
//! `metadata.generation`: flipping `spec.paused` or `spec.canceled` changes the generation but
//! is the same run, and acts on it at once.

use super::resource::{Condition, InstructionResult, NodePlanSpec, NodePlanStatus};
use crate::apply::ApplyResult;
use crate::flow::{self, CheckpointWrite, Commit, Record};
use crate::plan::{self, Hold, PlanState, ProbeStatus};
use chrono::{DateTime, SecondsFormat, Utc};
use std::cmp::Ordering;
use std::collections::BTreeMap;

/// The most output one instruction keeps in the status, and all instructions together: the
/// status must stay far below the object size limit (1.5 MiB on etcd's default).
pub const OUTPUT_CAP: usize = 16 << 10;
pub const OUTPUT_TOTAL_CAP: usize = 128 << 10;

/// The plan JSON of a spec (its canonical form: keys sorted), from which the checksum and the
/// validated plan come.
pub fn plan_bytes(spec: &NodePlanSpec) -> Option<Vec<u8>> {
    spec.plan.as_ref().filter(|p| !p.is_null()).and_then(|p| serde_json::to_vec(p).ok())
}

/// The checksum of a spec's plan: what identifies a run.
pub fn plan_checksum(spec: &NodePlanSpec) -> Option<String> {
    plan_bytes(spec).map(|b| plan::checksum(&b))
}

/// The order in which a node's waiting plans run: higher priority first, then the older, then
/// by name.
pub fn order(a: (i32, &str, &str), b: (i32, &str, &str)) -> Ordering {
    b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)).then_with(|| a.2.cmp(b.2))
}

/// The phase people see for a plan state.
pub fn phase(state: &PlanState) -> &'static str {
    match state {
        PlanState::Pending => "Pending",
        PlanState::InProgress => "Executing",
        PlanState::Paused => "Paused",
        PlanState::Succeeded => "Applied",
        PlanState::Failed => "Failed",
        PlanState::Canceled => "Cancelled",
        PlanState::Other(_) => "Unknown",
    }
}

/// The flow's view of a NodePlan whose plan has `checksum` (`total` one-time instructions).
pub fn snapshot(spec: &NodePlanSpec, status: &NodePlanStatus, checksum: &str, total: usize) -> flow::Snapshot {
    let ours = status.plan_checksum == checksum;
    let state = match &status.state {
        Some(s) if ours => s.clone(),
        _ => PlanState::Pending,
    };
    let hold = if spec.canceled {
        Hold::Cancel
    } else if spec.paused {
        Hold::Pause
    } else {
        Hold::None
    };
    let checkpoint = status.checkpoint.clone().filter(|c| ours && c.checksum == checksum);
    flow::Snapshot { checksum: checksum.to_string(), state, hold: Ok(hold), checkpoint, total }
}

/// `CATTLE_AGENT_ATTEMPT_NUMBER` of the next run of this plan.
pub fn attempt(status: &NodePlanStatus, checksum: &str) -> i64 {
    if status.plan_checksum == checksum { status.failures + 1 } else { 1 }
}

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// Which object and plan a status is written for.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// `metadata.generation` of the spec acted on.
    pub generation: i64,
    /// The checksum of `spec.plan`.
    pub checksum: &'a str,
    /// One-time instructions in the plan.
    pub total: usize,
}

/// The status with a new state: phase, progress and the `Applied` condition follow it; a new
/// plan starts its counters over.
fn with_state(prev: &NodePlanStatus, t: Target<'_>, state: PlanState, now: DateTime<Utc>) -> NodePlanStatus {
    let Target { generation, checksum, total } = t;
    let mut s = prev.clone();
    if s.plan_checksum != checksum {
        s = NodePlanStatus { probe_statuses: prev.probe_statuses.clone(), ..NodePlanStatus::default() };
        s.plan_checksum = checksum.to_string();
    }
    s.observed_generation = generation;
    s.phase = phase(&state).to_string();
    let completed = s.checkpoint.as_ref().map_or(0, |c| c.completed_instructions);
    s.progress = match state {
        PlanState::Succeeded => format!("{total}/{total}"),
        _ => format!("{completed}/{total}"),
    };
    let (status, reason) = match state {
        PlanState::Succeeded => ("True", "Applied"),
        PlanState::Pending => ("False", "Pending"),
        PlanState::InProgress => ("False", "Executing"),
        PlanState::Paused => ("False", "Paused"),
        PlanState::Failed => ("False", "Failed"),
        PlanState::Canceled => ("False", "Cancelled"),
        PlanState::Other(_) => ("Unknown", "Unknown"),
    };
    set_condition(&mut s.conditions, "Applied", status, reason, &format!("plan {}", state), generation, now);
    s.state = Some(state);
    s
}

/// Set a condition, keeping its transition time when its status does not change.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: &str,
    reason: &str,
    message: &str,
    generation: i64,
    now: DateTime<Utc>,
) {
    let c = Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: time(now),
        observed_generation: generation,
    };
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(old) => {
            let since = if old.status == c.status { old.last_transition_time.clone() } else { c.last_transition_time };
            *old = Condition { last_transition_time: since, ..c };
        }
        None => conditions.push(c),
    }
}

/// A transition written before (or instead of) a run.
pub fn commit(prev: &NodePlanStatus, t: Target<'_>, c: &Commit, now: DateTime<Utc>) -> NodePlanStatus {
    let total = t.total;
    let mut s = with_state(prev, t, c.state(), now);
    match c {
        Commit::Begin { resume: None } => {
            s.checkpoint = None;
            s.instructions.clear();
        }
        _ => s.checkpoint = c.checkpoint().cloned(),
    }
    if matches!(c, Commit::Begin { .. }) {
        s.attempts = s.failures + 1;
        s.progress = format!("{}/{total}", s.checkpoint.as_ref().map_or(0, |c| c.completed_instructions));
    }
    s
}

/// Plain text of an instruction's saved output, its tail kept within `cap` bytes.
fn plain(out: &[u8], cap: usize) -> String {
    let tail = &out[out.len().saturating_sub(cap)..];
    String::from_utf8_lossy(tail).into_owned()
}

/// Per-instruction results of a run, merged into the previous ones (a resume keeps the results of
/// the instructions it does not run again); outputs capped per instruction and in total.
fn results(prev: &[InstructionResult], result: &ApplyResult, now: DateTime<Utc>) -> Vec<InstructionResult> {
    let mut out: Vec<InstructionResult> = prev.to_vec();
    for r in result.reports.iter().filter(|r| !r.periodic) {
        let end = now;
        let start = end - chrono::Duration::from_std(r.elapsed).unwrap_or_default();
        let saved = result.one_time_output.get(&r.name).map(|o| plain(o, OUTPUT_CAP)).unwrap_or_default();
        let item = InstructionResult {
            name: r.name.clone(),
            outcome: crate::apply::result_word(&r.outcome).to_string(),
            exit_code: Some(i64::from(r.outcome.exit_code())).filter(|c| *c >= 0),
            start_time: time(start),
            end_time: time(end),
            output: saved,
        };
        match out.get_mut(r.index) {
            Some(slot) => *slot = item,
            None => {
                while out.len() < r.index {
                    out.push(InstructionResult::default());
                }
                out.push(item);
            }
        }
    }
    // The total cap: the oldest outputs go first.
    let mut total: usize = out.iter().map(|r| r.output.len()).sum();
    for r in out.iter_mut() {
        if total <= OUTPUT_TOTAL_CAP {
            break;
        }
        total -= r.output.len();
        r.output = String::from("(output dropped: the status keeps at most 128 KiB of outputs)");
        total += r.output.len();
    }
    out
}

/// A finished run's record.
pub fn record(
    prev: &NodePlanStatus,
    t: Target<'_>,
    rec: &Record,
    result: &ApplyResult,
    probes: Option<&BTreeMap<String, ProbeStatus>>,
    now: DateTime<Utc>,
) -> NodePlanStatus {
    let total = t.total;
    let mut s = match &rec.state {
        Some(state) => with_state(prev, t, state.clone(), now),
        None => NodePlanStatus { observed_generation: t.generation, ..prev.clone() },
    };
    match &rec.checkpoint {
        CheckpointWrite::Keep => {}
        CheckpointWrite::Clear => s.checkpoint = None,
        CheckpointWrite::Set(c) => {
            s.progress = format!("{}/{total}", c.completed_instructions);
            s.checkpoint = Some(c.clone());
        }
    }
    if rec.state.is_some() {
        s.instructions = results(&s.instructions, result, now);
    }
    match rec.succeeded {
        Some(true) => {
            s.successes += 1;
            s.failures = 0;
            s.last_apply_time = time(now);
        }
        Some(false) => {
            s.failures += 1;
            s.successes = 0;
            s.last_apply_time = time(now);
        }
        None => {}
    }
    if let Some(p) = probes {
        s.probe_statuses = p.clone();
    }
    if let Some(p) = &rec.periodic_output {
        s.periodic_outputs = p.clone();
    }
    s
}

/// A spec the agent refuses to run: `Failed` with the reason, never run as an empty plan.
pub fn refused(
    prev: &NodePlanStatus,
    generation: i64,
    reason: &str,
    message: &str,
    now: DateTime<Utc>,
) -> NodePlanStatus {
    let mut s = NodePlanStatus { observed_generation: generation, ..prev.clone() };
    s.phase = "Failed".into();
    set_condition(&mut s.conditions, "Applied", "False", reason, message, generation, now);
    s
}

/// The plan JSON of a spec, validated as any plan is.
pub fn valid_plan(spec: &NodePlanSpec) -> Result<(plan::ValidPlan, String), String> {
    let raw = plan_bytes(spec).ok_or("spec.plan is missing")?;
    let checksum = plan::checksum(&raw);
    plan::parse(&raw).map(|vp| (vp, checksum)).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Checkpoint, Interruption};
    use serde_json::json;

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-11-30T12:00:00Z").unwrap().with_timezone(&Utc)
    }

    fn spec(paused: bool, canceled: bool) -> NodePlanSpec {
        NodePlanSpec {
            paused,
            canceled,
            plan: Some(json!({"instructions": [{"name": "a", "command": "true"}, {"name": "b", "command": "true"}]})),
            ..NodePlanSpec::default()
        }
    }

    #[test]
    fn the_flow_sees_the_spec_switches_and_the_status_of_this_plan_only() {
        let (vp, c) = valid_plan(&spec(false, false)).unwrap();
        assert_eq!(vp.plan.instructions.len(), 2);
        let mine = NodePlanStatus { plan_checksum: c.clone(), state: Some(PlanState::Paused), ..Default::default() };
        let other = NodePlanStatus { plan_checksum: "old".into(), ..mine.clone() };
        let rows = [
            (spec(false, false), &mine, PlanState::Paused, Hold::None),
            (spec(true, false), &mine, PlanState::Paused, Hold::Pause),
            (spec(true, true), &mine, PlanState::Paused, Hold::Cancel),
            (spec(false, false), &other, PlanState::Pending, Hold::None),
        ];
        for (sp, st, state, hold) in rows {
            let s = snapshot(&sp, st, &c, 2);
            assert_eq!((s.state, s.hold), (state, Ok(hold)));
        }
        // Key order in the object does not change the checksum (canonical JSON).
        let reordered = NodePlanSpec {
            plan: Some(json!({"instructions": [{"command": "true", "name": "a"}, {"command": "true", "name": "b"}]})),
            ..NodePlanSpec::default()
        };
        assert_eq!(valid_plan(&reordered).unwrap().1, c);
    }

    #[test]
    fn waiting_plans_run_by_priority_then_age_then_name() {
        let mut v = [
            (0, "2026-01-02T00:00:00Z", "b"),
            (5, "2026-01-03T00:00:00Z", "z"),
            (0, "2026-01-01T00:00:00Z", "c"),
            (0, "2026-01-02T00:00:00Z", "a"),
        ];
        v.sort_by(|x, y| order(*x, *y));
        let names: Vec<&str> = v.iter().map(|x| x.2).collect();
        assert_eq!(names, ["z", "c", "a", "b"]);
    }

    #[test]
    fn statuses_follow_the_flow() {
        let t = |generation| Target { generation, checksum: "c", total: 2 };
        let begun = commit(&NodePlanStatus::default(), t(3), &Commit::Begin { resume: None }, now());
        assert_eq!((begun.phase.as_str(), begun.progress.as_str(), begun.attempts), ("Executing", "0/2", 1));
        assert_eq!(begun.conditions[0].status, "False");
        let cp = Checkpoint {
            checksum: "c".into(),
            completed_instructions: 1,
            total_instructions: 2,
            resume_state: Some(PlanState::InProgress),
            paused: true,
            termination_incomplete: false,
        };
        let result = ApplyResult { completed: 1, interruption: Some(Interruption::Paused), ..Default::default() };
        let paused = Record {
            state: Some(PlanState::Paused),
            checkpoint: CheckpointWrite::Set(cp.clone()),
            ..Default::default()
        };
        let p = record(&begun, t(4), &paused, &result, None, now());
        assert_eq!((p.phase.as_str(), p.progress.as_str(), p.checkpoint.clone()), ("Paused", "1/2", Some(cp)));
        assert_eq!(p.observed_generation, 4);
        let ok = Record {
            state: Some(PlanState::Succeeded),
            checkpoint: CheckpointWrite::Clear,
            succeeded: Some(true),
            ..Default::default()
        };
        let later = now() + chrono::Duration::seconds(60);
        let done = record(&p, t(5), &ok, &ApplyResult::default(), None, later);
        assert_eq!((done.phase.as_str(), done.progress.as_str(), done.successes), ("Applied", "2/2", 1));
        assert_eq!((done.checkpoint.clone(), done.state.clone()), (None, Some(PlanState::Succeeded)));
        assert_eq!(done.conditions.len(), 1);
        assert_eq!(
            (done.conditions[0].status.as_str(), done.conditions[0].last_transition_time.as_str()),
            ("True", "2026-11-30T12:01:00Z")
        );
        // A new plan starts over (probe statuses stay until the new plan's probes run).
        let again =
            commit(&done, Target { generation: 6, checksum: "new", total: 1 }, &Commit::Begin { resume: None }, later);
        assert_eq!((again.successes, again.plan_checksum.as_str(), again.progress.as_str()), (0, "new", "0/1"));
    }

    #[test]
    fn outputs_are_plain_text_capped_per_instruction_and_per_object() {
        let big = vec![b'x'; OUTPUT_CAP * 2];
        assert_eq!(plain(&big, OUTPUT_CAP).len(), OUTPUT_CAP);
        let prev: Vec<InstructionResult> = (0..20)
            .map(|i| InstructionResult { name: format!("i{i}"), output: "y".repeat(OUTPUT_CAP), ..Default::default() })
            .collect();
        let out = results(&prev, &ApplyResult::default(), now());
        let total: usize = out.iter().map(|r| r.output.len()).sum();
        assert!(total <= OUTPUT_TOTAL_CAP, "{total}");
        assert_eq!(out[19].output.len(), OUTPUT_CAP, "the newest outputs are kept");
    }
}
