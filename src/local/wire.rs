//! The `.pos` file as the plan-state flow sees it: pure functions from a stored [`Pos`] to a
//! [`flow::Snapshot`], and from a commit or a finished run's [`Record`] to the fields written
//! back. No I/O and no clock (the time is an argument), so every rule here is a table test; the
//! local source ([`super::DirSource`]) reads and writes the files around them.
//!
//! What is local mode's own (and not the Secret's): a `.pos` written by system-agent (no plan
//! state) whose applied checksum is this plan's counts as succeeded; a failed plan is retried by
//! the agent itself after a back-off that grows with its failure count (local mode is its own
//! orchestrator); and a reset file sets the plan back to `pending`.

use super::pos::Pos;
use crate::flow::{self, CheckpointWrite, Commit, Record};
use crate::plan::{self, Failure, Hold, InvalidAnnotation, PlanState, format_unix_date, parse_unix_date};
use chrono::{DateTime, Utc};
use std::collections::BTreeMap;
use std::time::Duration;

/// When a failed plan is retried: `base` × 2^(failures−1), at most `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub base: Duration,
    pub max: Duration,
}

impl RetryPolicy {
    /// Delay before retrying a plan that failed `failures` times in a row.
    pub fn delay(&self, failures: i64) -> Duration {
        let exp = failures.clamp(1, 16) as u32 - 1;
        self.base.saturating_mul(1 << exp).min(self.max)
    }
}

/// Whether the `.pos` belongs to the plan with `checksum` (a new plan starts from `pending`).
pub fn same_plan(p: &Pos, checksum: &str) -> bool {
    p.plan_checksum == checksum || (p.plan_checksum.is_empty() && p.applied_checksum == checksum)
}

/// The stored state of the plan with `checksum`, as the flow should see it. A `.pos` written by
/// system-agent has no plan state: a plan it applied counts as succeeded (it is not run again
/// after a migration).
pub fn stored_state(p: &Pos, checksum: &str) -> PlanState {
    if p.plan_checksum.is_empty() && !p.applied_checksum.is_empty() && p.applied_checksum == checksum {
        return PlanState::Succeeded;
    }
    match &p.plan_state {
        Some(s) if p.plan_checksum == checksum => s.clone(),
        _ => PlanState::Pending,
    }
}

/// The flow's view of the plan with `checksum` (of `total` one-time instructions), and when a
/// failed plan is due for its retry if that is later than `now`. A failed plan that is due is
/// seen as `pending` (it runs again from its first instruction).
pub fn snapshot(
    p: &Pos,
    checksum: &str,
    hold: Result<Hold, InvalidAnnotation>,
    total: usize,
    now: DateTime<Utc>,
    retry: RetryPolicy,
) -> (flow::Snapshot, Option<Duration>) {
    let mut state = stored_state(p, checksum);
    let mut retry_in = None;
    if state == PlanState::Failed && hold == Ok(Hold::None) {
        let delay = chrono::Duration::from_std(retry.delay(p.failure_count)).unwrap_or_default();
        match parse_unix_date(&p.last_apply_time).map(|t| t + delay) {
            Some(due) if now < due => retry_in = (due - now).to_std().ok(),
            // Due, or no time recorded (retried at once).
            _ => state = PlanState::Pending,
        }
    }
    let checkpoint = p.checkpoint.clone().filter(|c| p.plan_checksum == checksum && c.checksum == checksum);
    (flow::Snapshot { checksum: checksum.to_string(), state, hold, checkpoint, total }, retry_in)
}

/// `CATTLE_AGENT_ATTEMPT_NUMBER`: one more than the failures of this plan so far.
pub fn attempt(p: &Pos, checksum: &str) -> i64 {
    if same_plan(p, checksum) { p.failure_count + 1 } else { 1 }
}

/// A reset: the plan runs again from its first instruction, its failures forgotten.
pub fn reset(p: &mut Pos) {
    p.plan_state = Some(PlanState::Pending);
    p.checkpoint = None;
    p.failure_count = 0;
}

/// Write a transition of the plan with `checksum`.
pub fn commit(p: &mut Pos, checksum: &str, c: &Commit) {
    if !same_plan(p, checksum) {
        p.failure_count = 0;
    }
    p.plan_state = Some(c.state());
    p.plan_checksum = checksum.to_string();
    match c {
        // A start without a resume leaves no checkpoint behind (a new plan's starts clean).
        Commit::Begin { resume: None } => p.checkpoint = None,
        _ => p.checkpoint = c.checkpoint().cloned(),
    }
}

/// Write a finished run's record (`probes`: statuses taken right after it).
/// `failure`: what made a failed run fail.
pub fn record(p: &mut Pos, checksum: &str, r: &Record, failure: Option<&Failure>, now: DateTime<Utc>) {
    let empty = BTreeMap::new();
    if let Some(s) = &r.state {
        p.plan_state = Some(s.clone());
        p.plan_checksum = checksum.to_string();
    }
    match &r.checkpoint {
        CheckpointWrite::Keep => {}
        CheckpointWrite::Clear => p.checkpoint = None,
        CheckpointWrite::Set(c) => p.checkpoint = Some(c.clone()),
    }
    let output = plan::encode_one_time_output(r.one_time_output.as_ref().unwrap_or(&empty));
    match r.succeeded {
        Some(true) => {
            p.applied_checksum = checksum.to_string();
            p.output = output;
            p.failure_count = 0;
            p.failed_checksum.clear();
            p.failed_output.clear();
            p.last_failure = None;
            p.success_count += 1;
            p.last_apply_time = format_unix_date(now);
        }
        Some(false) => failed(p, checksum, output, failure, now),
        None => {
            if r.one_time_output.is_some() {
                p.output = output;
            }
        }
    }
    if let Some(o) = &r.periodic_output {
        p.periodic_output = plan::encode_periodic_output(o);
    }
}

/// Failure bookkeeping: the plan failed (an instruction, or files that could not be written).
pub fn failed(p: &mut Pos, checksum: &str, failed_output: Vec<u8>, failure: Option<&Failure>, now: DateTime<Utc>) {
    p.failure_count = if same_plan(p, checksum) { p.failure_count + 1 } else { 1 };
    p.plan_state = Some(PlanState::Failed);
    p.plan_checksum = checksum.to_string();
    p.failed_checksum = checksum.to_string();
    p.failed_output = failed_output;
    p.last_failure = failure.cloned();
    p.success_count = 0;
    p.last_apply_time = format_unix_date(now);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Checkpoint;

    const C: &str = "c0ffee";
    const POLICY: RetryPolicy = RetryPolicy { base: Duration::from_secs(30), max: Duration::from_secs(300) };

    fn now() -> DateTime<Utc> {
        parse_unix_date("Mon Nov 30 12:00:00 UTC 2026").unwrap()
    }

    fn cp(paused: bool) -> Checkpoint {
        Checkpoint {
            checksum: C.into(),
            completed_instructions: 1,
            total_instructions: 3,
            resume_state: paused.then_some(PlanState::InProgress),
            paused,
            termination_incomplete: false,
        }
    }

    fn pos(state: &str, checksum: &str) -> Pos {
        Pos { plan_state: Some(PlanState::parse(state)), plan_checksum: checksum.into(), ..Pos::default() }
    }

    fn state_of(p: &Pos) -> (PlanState, Option<Duration>) {
        let (s, retry) = snapshot(p, C, Ok(Hold::None), 3, now(), POLICY);
        (s.state, retry)
    }

    /// What a stored `.pos` means for this plan.
    #[test]
    fn the_state_a_pos_gives_a_plan() {
        let migrated = Pos { applied_checksum: C.into(), ..Pos::default() };
        let migrated_other = Pos { applied_checksum: "old".into(), ..Pos::default() };
        let failed_at = |secs_ago: i64, failures: i64| Pos {
            failure_count: failures,
            last_apply_time: format_unix_date(now() - chrono::Duration::seconds(secs_ago)),
            ..pos("failed", C)
        };
        let rows: [(&str, Pos, PlanState, Option<Duration>); 11] = [
            ("no .pos: a new plan", Pos::default(), PlanState::Pending, None),
            ("system-agent applied this plan", migrated, PlanState::Succeeded, None),
            ("system-agent applied another plan", migrated_other, PlanState::Pending, None),
            ("another plan's state", pos("succeeded", "other"), PlanState::Pending, None),
            ("this plan in progress", pos("in-progress", C), PlanState::InProgress, None),
            ("this plan paused", pos("paused", C), PlanState::Paused, None),
            ("this plan canceled", pos("canceled", C), PlanState::Canceled, None),
            ("failed once 10 s ago: due in 20 s", failed_at(10, 1), PlanState::Failed, Some(Duration::from_secs(20))),
            ("failed once 30 s ago: due", failed_at(30, 1), PlanState::Pending, None),
            (
                "failed 3 times 100 s ago: due in 20 s",
                failed_at(100, 3),
                PlanState::Failed,
                Some(Duration::from_secs(20)),
            ),
            ("failed without a time: due", pos("failed", C), PlanState::Pending, None),
        ];
        for (what, p, state, retry) in rows {
            assert_eq!(state_of(&p), (state, retry), "{what}");
        }
        // The retry is capped, and a held failed plan is not retried.
        assert_eq!(POLICY.delay(20), Duration::from_secs(300));
        let (s, retry) = snapshot(&pos("failed", C), C, Ok(Hold::Pause), 3, now(), POLICY);
        assert_eq!((s.state, retry), (PlanState::Failed, None));
    }

    #[test]
    fn a_checkpoint_counts_only_for_its_own_plan() {
        let mut p = Pos { checkpoint: Some(cp(true)), ..pos("paused", C) };
        assert_eq!(snapshot(&p, C, Ok(Hold::None), 3, now(), POLICY).0.checkpoint, Some(cp(true)));
        p.plan_checksum = "other".into();
        assert_eq!(snapshot(&p, C, Ok(Hold::None), 3, now(), POLICY).0.checkpoint, None);
        p.plan_checksum = C.into();
        p.checkpoint = Some(Checkpoint { checksum: "other".into(), ..cp(true) });
        assert_eq!(snapshot(&p, C, Ok(Hold::None), 3, now(), POLICY).0.checkpoint, None);
    }

    /// A `.pos` as system-agent writes it reads, and a plan it applied is not run again.
    #[test]
    fn a_pos_written_by_system_agent() {
        let raw = br#"{"appliedChecksum":"c0ffee","output":"H4sIAAAAAAAA/6quBQQAAP//Q7+m1gIAAAA=","probeStatus":{"kubelet":{"healthy":true,"successCount":3}}}"#;
        let p = super::super::pos::parse_pos(raw).unwrap();
        let (s, _) = snapshot(&p, C, Ok(Hold::None), 2, now(), POLICY);
        assert_eq!((s.state, s.checkpoint), (PlanState::Succeeded, None));
        assert_eq!(attempt(&p, C), 1);
        assert!(p.probe_status["kubelet"].healthy);
    }

    #[test]
    fn commits_write_state_checksum_and_checkpoint() {
        let mut p = Pos { failure_count: 2, checkpoint: Some(cp(false)), ..pos("canceled", "old") };
        commit(&mut p, C, &Commit::Begin { resume: None });
        assert_eq!((p.plan_state.clone(), p.plan_checksum.as_str()), (Some(PlanState::InProgress), C));
        assert_eq!((p.checkpoint.clone(), p.failure_count), (None, 0), "a new plan starts clean");

        let mut p = Pos { failure_count: 2, ..pos("failed", C) };
        commit(&mut p, C, &Commit::Begin { resume: None });
        assert_eq!(p.failure_count, 2, "a retry of the same plan keeps counting");
        assert_eq!(attempt(&p, C), 3);

        let t = flow::Transition { state: PlanState::Paused, checkpoint: cp(true) };
        commit(&mut p, C, &Commit::Record(t));
        assert_eq!((p.plan_state.clone(), p.checkpoint.clone()), (Some(PlanState::Paused), Some(cp(true))));
        commit(&mut p, C, &Commit::Begin { resume: Some(cp(false)) });
        assert_eq!((p.plan_state.clone(), p.checkpoint.clone()), (Some(PlanState::InProgress), Some(cp(false))));
    }

    #[test]
    fn records_write_the_counters_and_outputs() {
        let outputs = BTreeMap::from([("a".to_string(), b"out".to_vec())]);
        let ok = Record {
            state: Some(PlanState::Succeeded),
            checkpoint: CheckpointWrite::Clear,
            succeeded: Some(true),
            one_time_output: Some(outputs.clone()),
            periodic_output: Some(BTreeMap::new()),
        };
        let mut p =
            Pos { failure_count: 2, failed_checksum: C.into(), checkpoint: Some(cp(false)), ..pos("in-progress", C) };
        record(&mut p, C, &ok, None, now());
        assert_eq!(
            (p.plan_state.clone(), p.applied_checksum.as_str(), p.success_count),
            (Some(PlanState::Succeeded), C, 1)
        );
        assert_eq!((p.failure_count, p.failed_checksum.as_str(), p.checkpoint.clone()), (0, "", None));
        assert_eq!(plan::decode_one_time_output(&p.output).unwrap(), outputs);
        assert_eq!(p.last_apply_time, "Mon Nov 30 12:00:00 UTC 2026");

        let fail = Record { state: Some(PlanState::Failed), succeeded: Some(false), ..ok.clone() };
        let why = Failure::instruction(C, 0, 1, "a", "exit status 3".into(), b"out\n", &[]);
        record(&mut p, C, &fail, Some(&why), now());
        record(&mut p, C, &fail, Some(&why), now());
        assert_eq!((p.plan_state.clone(), p.failure_count, p.success_count), (Some(PlanState::Failed), 2, 0));
        assert_eq!(p.last_failure.as_ref(), Some(&why), "what made it fail is kept beside it");
        assert_eq!(plan::decode_one_time_output(&p.failed_output).unwrap(), outputs);
        assert_eq!(p.applied_checksum, C, "the last success stays recorded");

        // A pause keeps its checkpoint and counters; a periodic pass writes only its outputs.
        let paused = Record {
            state: Some(PlanState::Paused),
            checkpoint: CheckpointWrite::Set(cp(true)),
            one_time_output: Some(outputs.clone()),
            ..Record::default()
        };
        record(&mut p, C, &paused, None, now());
        assert_eq!(
            (p.plan_state.clone(), p.failure_count, p.checkpoint.clone()),
            (Some(PlanState::Paused), 2, Some(cp(true)))
        );
        let before = p.clone();
        record(&mut p, C, &Record::default(), None, now());
        assert_eq!(p, before, "a shutdown writes nothing");
        assert!(p.last_failure.is_some(), "a pause keeps the last failure");
        let mut after = p.clone();
        record(&mut after, C, &ok, None, now());
        assert_eq!(after.last_failure, None, "a success clears it");

        // Files that could not be written are a failure of this plan; another plan's count restarts.
        let mut q = Pos { failure_count: 4, ..pos("failed", "other") };
        failed(&mut q, C, Vec::new(), None, now());
        assert_eq!(
            (q.plan_state.clone(), q.failure_count, q.failed_checksum.as_str()),
            (Some(PlanState::Failed), 1, C)
        );
    }

    #[test]
    fn a_reset_runs_the_plan_from_its_first_instruction() {
        let mut p = Pos { failure_count: 3, checkpoint: Some(cp(false)), ..pos("canceled", C) };
        reset(&mut p);
        assert_eq!(state_of(&p), (PlanState::Pending, None));
        assert_eq!((p.failure_count, p.checkpoint), (0, None));
    }
}
