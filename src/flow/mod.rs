//! The plan-state flow with pause and cancel (rules R1–R12 of `docs/rules.md`), written once as pure functions and
//! shared by remote mode (the Secret) and local mode (the `.pos` file).
//!
//! [`decide`] maps what a source sees (state, annotation values, checkpoint) to a [`Decision`];
//! [`record`] maps a finished run to the [`Record`] of what to write. This module owns those rules
//! and nothing else: no I/O, no clock, no processes; the sources own storage and encodings, and
//! [`crate::reconcile`] owns the loop that calls these functions. It depends on [`crate::plan`]
//! only. The rules it implements are stated in `docs/rules.md`.

use crate::plan::{Checkpoint, Hold, Interruption, InvalidAnnotation, PeriodicInstructionOutput, PlanState};
use std::collections::BTreeMap;

/// What a source knows about one plan at reconcile time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub checksum: String,
    pub state: PlanState,
    /// The resolved pause/cancel values (R1, R2).
    pub hold: Result<Hold, InvalidAnnotation>,
    /// The stored checkpoint, already checked to belong to `checksum`.
    pub checkpoint: Option<Checkpoint>,
    /// Number of one-time instructions.
    pub total: usize,
}

/// A state change with its checkpoint, written together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub state: PlanState,
    pub checkpoint: Checkpoint,
}

/// How to run a plan, and what to commit before anything runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunPlan {
    /// `pending`: write `in-progress` (and bump the revision) before anything runs, with a
    /// paused plan's checkpoint (marked not paused) folded into the same write; then the files and
    /// the one-time instructions from `resume_from`.
    Begin { resume_from: usize, resume: Option<Checkpoint> },
    /// `in-progress`: the files and the one-time instructions from `resume_from` (a resume writes
    /// its transition first).
    Continue { resume_from: usize, resume: Option<Transition> },
    /// `succeeded`: periodic instructions only (a resume writes its transition first).
    Periodic { resume: Option<Transition> },
    /// No plan state at all (remote mode's legacy checksum flow): the source decided; nothing is
    /// committed before the run.
    Legacy { one_time: bool },
}

impl RunPlan {
    /// The state the run happens in.
    pub fn effective(&self) -> PlanState {
        match self {
            RunPlan::Begin { .. } | RunPlan::Continue { .. } | RunPlan::Legacy { .. } => PlanState::InProgress,
            RunPlan::Periodic { .. } => PlanState::Succeeded,
        }
    }
    /// Run the files and one-time instructions.
    pub fn one_time(&self) -> bool {
        match self {
            RunPlan::Begin { .. } | RunPlan::Continue { .. } => true,
            RunPlan::Periodic { .. } => false,
            RunPlan::Legacy { one_time } => *one_time,
        }
    }
    /// Absolute index of the first one-time instruction to run.
    pub fn resume_from(&self) -> usize {
        match self {
            RunPlan::Begin { resume_from, .. } | RunPlan::Continue { resume_from, .. } => *resume_from,
            RunPlan::Periodic { .. } | RunPlan::Legacy { .. } => 0,
        }
    }
    /// What to write before anything runs, if anything.
    pub fn commit(&self) -> Option<Commit> {
        match self {
            RunPlan::Begin { resume, .. } => Some(Commit::Begin { resume: resume.clone() }),
            RunPlan::Continue { resume, .. } | RunPlan::Periodic { resume } => resume.clone().map(Commit::Resume),
            RunPlan::Legacy { .. } => None,
        }
    }
}

/// A write a source makes before (or instead of) a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Commit {
    /// pending → in-progress (bumping the revision), with a resume's checkpoint folded in.
    Begin { resume: Option<Checkpoint> },
    /// A paused plan resumes: its state and unpaused checkpoint.
    Resume(Transition),
    /// A pause or cancel recorded at reconcile time (R4, R7).
    Record(Transition),
}

impl Commit {
    /// The state this write leaves the plan in.
    pub fn state(&self) -> PlanState {
        match self {
            Commit::Begin { .. } => PlanState::InProgress,
            Commit::Resume(t) | Commit::Record(t) => t.state.clone(),
        }
    }
    /// The checkpoint this write stores (`None`: the stored one is left as it is).
    pub fn checkpoint(&self) -> Option<&Checkpoint> {
        match self {
            Commit::Begin { resume } => resume.as_ref(),
            Commit::Resume(t) | Commit::Record(t) => Some(&t.checkpoint),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// R3: an invalid annotation value. Write nothing, run nothing, no probes; retry with backoff.
    Invalid(InvalidAnnotation),
    /// A pause or cancel to record (R4, R7); then only observe (probes).
    Record {
        transition: Transition,
        partial_cancel: bool,
    },
    /// Held or terminal: only probes run (R10). Nothing about the plan state is written.
    Observe,
    Run(RunPlan),
}

fn carried_incomplete(cp: &Option<Checkpoint>) -> bool {
    cp.as_ref().is_some_and(|c| c.termination_incomplete)
}

/// `paused` is never a state to resume into.
fn sanitize(state: &Option<PlanState>) -> Option<PlanState> {
    state.clone().filter(|s| *s != PlanState::Paused)
}

/// Where a plan resumes when neither annotation holds it: (effective state, resume index).
pub fn resolve_resume(state: &PlanState, cp: Option<&Checkpoint>, total: usize) -> (PlanState, usize) {
    let paused_cp = cp.filter(|c| c.paused);
    match (state, paused_cp) {
        (PlanState::Paused, None) => (cp.and_then(|c| sanitize(&c.resume_state)).unwrap_or(PlanState::InProgress), 0),
        (_, Some(c)) => {
            (sanitize(&c.resume_state).unwrap_or(PlanState::InProgress), c.completed_instructions.min(total))
        }
        (s, None) => (s.clone(), 0),
    }
}

/// The reconcile-entry rules.
pub fn decide(s: &Snapshot) -> Decision {
    let hold = match &s.hold {
        Err(e) => return Decision::Invalid(e.clone()),
        Ok(h) => *h,
    };
    // A succeeded plan ran all of its one-time instructions (it keeps no checkpoint).
    let completed = match s.state {
        PlanState::Succeeded => s.total,
        _ => s.checkpoint.as_ref().map_or(0, |c| c.completed_instructions).min(s.total),
    };
    match hold {
        Hold::Cancel => {
            // Write-once: a failed or canceled plan is not written again (R7).
            if matches!(s.state, PlanState::Failed | PlanState::Canceled) {
                return Decision::Observe;
            }
            Decision::Record {
                transition: Transition {
                    state: PlanState::Canceled,
                    checkpoint: Checkpoint {
                        checksum: s.checksum.clone(),
                        completed_instructions: completed,
                        total_instructions: s.total,
                        resume_state: None,
                        paused: false,
                        termination_incomplete: carried_incomplete(&s.checkpoint),
                    },
                },
                partial_cancel: completed > 0 && completed < s.total,
            }
        }
        Hold::Pause => {
            // A suspended checkpoint under `in-progress` is a restart's (R23), not a pause: the
            // pause is still to be recorded there (at the restart's boundary), or the plan would
            // show `in-progress` while held. Under any other state it is the pause already made.
            let restart_point = s.state == PlanState::InProgress;
            if s.checkpoint.as_ref().is_some_and(|c| c.paused) && !restart_point {
                return Decision::Observe;
            }
            let resume_state = (s.state != PlanState::Paused).then(|| s.state.clone());
            Decision::Record {
                transition: Transition {
                    state: PlanState::Paused,
                    checkpoint: Checkpoint {
                        checksum: s.checksum.clone(),
                        completed_instructions: completed,
                        total_instructions: s.total,
                        resume_state,
                        paused: true,
                        termination_incomplete: carried_incomplete(&s.checkpoint),
                    },
                },
                partial_cancel: false,
            }
        }
        Hold::None => {
            let (effective, resume_from) = resolve_resume(&s.state, s.checkpoint.as_ref(), s.total);
            let suspended = s.state == PlanState::Paused || s.checkpoint.as_ref().is_some_and(|c| c.paused);
            let resume = suspended.then(|| Transition {
                state: effective.clone(),
                checkpoint: Checkpoint {
                    checksum: s.checksum.clone(),
                    completed_instructions: s.checkpoint.as_ref().map_or(0, |c| c.completed_instructions),
                    total_instructions: s.checkpoint.as_ref().map_or(s.total, |c| c.total_instructions),
                    resume_state: None,
                    paused: false,
                    termination_incomplete: carried_incomplete(&s.checkpoint),
                },
            });
            match effective {
                PlanState::Pending => {
                    Decision::Run(RunPlan::Begin { resume_from, resume: resume.map(|t| t.checkpoint) })
                }
                PlanState::InProgress => Decision::Run(RunPlan::Continue { resume_from, resume }),
                PlanState::Succeeded => Decision::Run(RunPlan::Periodic { resume }),
                // failed, canceled, unknown: monitoring only; a resume commit is still recorded.
                _ => match resume {
                    Some(transition) => Decision::Record { transition, partial_cancel: false },
                    None => Decision::Observe,
                },
            }
        }
    }
}

/// What a run did, as far as the plan state is concerned (the applyinator's result, reduced).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ran {
    /// All one-time instructions ran and succeeded (false when they were not run).
    pub one_time_succeeded: bool,
    /// Absolute index: one past the last completed one-time instruction.
    pub completed: usize,
    pub interruption: Option<Interruption>,
    /// A stopped tree may have survivors.
    pub termination_incomplete: bool,
    pub one_time_output: BTreeMap<String, Vec<u8>>,
    pub periodic_output: BTreeMap<String, PeriodicInstructionOutput>,
    /// The pass stopped after an instruction that asked for the agent to restart (R23).
    pub restart: bool,
}

/// What to do with the stored checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum CheckpointWrite {
    /// Leave it as it is.
    #[default]
    Keep,
    /// Remove it (a finished plan has none).
    Clear,
    Set(Checkpoint),
}

/// What to write after a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Record {
    pub state: Option<PlanState>,
    pub checkpoint: CheckpointWrite,
    /// `Some(true)`: success bookkeeping (applied checksum, counters reset, success count +1);
    /// `Some(false)`: failure bookkeeping (failed checksum, failure count +1). `None`: neither.
    pub succeeded: Option<bool>,
    pub one_time_output: Option<BTreeMap<String, Vec<u8>>>,
    pub periodic_output: Option<BTreeMap<String, PeriodicInstructionOutput>>,
}

/// A restart point (R23, R26): `in-progress` with a suspended checkpoint after `completed`, as a
/// pause's resuming into `in-progress`, with the outputs so far.
fn restart_point(snap: &Snapshot, completed: usize, total: usize, incomplete: bool, result: &Ran) -> Record {
    let mut r = Record {
        state: Some(PlanState::InProgress),
        checkpoint: CheckpointWrite::Set(Checkpoint {
            checksum: snap.checksum.clone(),
            completed_instructions: completed,
            total_instructions: total,
            resume_state: Some(PlanState::InProgress),
            paused: true,
            termination_incomplete: incomplete,
        }),
        ..Default::default()
    };
    nonempty_outputs(&mut r, result);
    r
}

/// The run's outputs, where it has any.
fn nonempty_outputs(r: &mut Record, result: &Ran) {
    if !result.one_time_output.is_empty() {
        r.one_time_output = Some(result.one_time_output.clone());
    }
    if !result.periodic_output.is_empty() {
        r.periodic_output = Some(result.periodic_output.clone());
    }
}

/// Map a finished run to what must be written. A shutdown writes nothing: the plan stays
/// `in-progress` and a restarted agent re-runs it from its first instruction (R17). A restart
/// request before the last instruction (R23) keeps the plan `in-progress` with a suspended
/// checkpoint (as a pause's, resuming into `in-progress`), so the restarted agent goes on after
/// the instruction that asked, never running it again. A run stopped by the Lease's fence (R26)
/// is recorded as such a restart point, so whoever holds the Lease next goes on there.
pub fn record(snap: &Snapshot, run: &RunPlan, result: &Ran) -> Record {
    let incomplete = result.termination_incomplete || carried_incomplete(&snap.checkpoint);
    let one_time = run.one_time();
    // A succeeded plan's periodic pass comes after every one-time instruction: a pause or cancel
    // that stops it records them all done, as `decide` does when the hold lands between passes.
    let (completed, total) = match run {
        _ if one_time => (result.completed, snap.total),
        RunPlan::Periodic { .. } => (snap.total, snap.total),
        _ => (0, 0),
    };
    match result.interruption {
        Some(Interruption::Shutdown) => Record::default(),
        Some(Interruption::Fenced) if !one_time => Record::default(),
        Some(Interruption::Fenced) => restart_point(snap, completed, total, incomplete, result),
        None if one_time && result.restart && !result.one_time_succeeded => {
            restart_point(snap, completed, total, incomplete, result)
        }
        Some(i @ (Interruption::Paused | Interruption::Canceled)) => {
            let paused = i == Interruption::Paused;
            let resume_state = match (paused, one_time) {
                (false, _) => None,
                (true, true) => Some(PlanState::InProgress),
                (true, false) => Some(run.effective()),
            };
            let mut r = Record {
                state: Some(if paused { PlanState::Paused } else { PlanState::Canceled }),
                checkpoint: CheckpointWrite::Set(Checkpoint {
                    checksum: snap.checksum.clone(),
                    completed_instructions: completed,
                    total_instructions: total,
                    resume_state,
                    paused,
                    termination_incomplete: incomplete,
                }),
                ..Default::default()
            };
            nonempty_outputs(&mut r, result);
            r
        }
        None if one_time => Record {
            state: Some(if result.one_time_succeeded { PlanState::Succeeded } else { PlanState::Failed }),
            checkpoint: CheckpointWrite::Clear,
            succeeded: Some(result.one_time_succeeded),
            one_time_output: Some(result.one_time_output.clone()),
            periodic_output: Some(result.periodic_output.clone()),
        },
        None => Record { periodic_output: Some(result.periodic_output.clone()), ..Default::default() },
    }
}

#[cfg(test)]
mod tests;
