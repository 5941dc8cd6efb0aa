//! `nodeplan plan logs`: what each instruction of a plan printed, decoded from where its agent
//! keeps it (a local plan's `.pos`, a plan Secret's output keys, a NodePlan's status), with how it
//! ended; then the periodic instructions' last results. Only the current plan's: an output kept
//! for an earlier plan (a Secret's `applied-output` after a new plan was assigned) is never shown
//! as this one's. Pure: it reads what it is given and returns lines.
//!
//! Lines of output are shown after `| ` (stderr of a periodic instruction after `! `), with
//! control characters escaped and the values of the instruction's own `env` masked, as a
//! failure's lines are ([`crate::plan::failure`]).

use crate::local::pos::Pos;
use crate::nodeplan::resource::NodePlanStatus;
use crate::plan::failure::{self, Failure, Mask};
use crate::plan::{Checkpoint, PeriodicInstructionOutput, PlanState, ValidPlan};
use crate::remote::client::SecretSnapshot;
use crate::remote::wire;
use std::collections::BTreeMap;

/// How far the plan got, as its agent recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Every one-time instruction succeeded.
    Succeeded,
    /// The run failed: at this instruction when the agent said which.
    Failed(Option<Failure>),
    /// Stopped at a boundary (paused, canceled): this many instructions done.
    Stopped { completed: usize, state: String },
    /// Nothing recorded of this plan yet (pending, or its first run still going).
    NotYet(String),
    /// Pending or in progress again after a failed run of the same plan, shown as it failed.
    Again { state: String, failure: Option<Failure> },
}

/// What an agent kept of one plan.
#[derive(Debug, Clone)]
pub struct Kept {
    pub progress: Progress,
    /// The one-time outputs kept for this plan (by instruction name; saveOutput ones only).
    pub outputs: BTreeMap<String, Vec<u8>>,
    pub periodic: BTreeMap<String, PeriodicInstructionOutput>,
}

/// The logs of `plan` from what was kept: one header line per instruction, its output after it,
/// then the periodic instructions'.
pub fn lines(plan: &ValidPlan, kept: &Kept) -> Vec<String> {
    let mut out = one_time_lines(plan, kept);
    out.extend(periodic_lines(plan, &kept.periodic));
    out
}

fn one_time_lines(plan: &ValidPlan, kept: &Kept) -> Vec<String> {
    let n = plan.plan.instructions.len();
    let mut out = Vec::new();
    let failed = match &kept.progress {
        Progress::NotYet(state) => {
            out.push(format!("no output kept for this plan yet ({state})"));
            None
        }
        Progress::Again { state, failure } => {
            out.push(format!("{state} again; its last finished run failed:"));
            Some(failure)
        }
        Progress::Failed(failure) => Some(failure),
        _ => None,
    };
    for (i, ins) in plan.plan.instructions.iter().enumerate() {
        let name = shown_name(&ins.common.name);
        let (outcome, ran) = match (&kept.progress, failed) {
            (Progress::Succeeded, _) => ("ok".to_string(), true),
            (_, Some(Some(f))) => match f.instruction {
                None => ("not run (the files failed)".into(), false),
                Some(k) if i + 1 < k => ("ok".into(), true),
                Some(k) if i + 1 == k => (format!("FAILED ({})", failure::shown_line(&f.outcome)), true),
                Some(_) => ("not run".into(), false),
            },
            (_, Some(None)) => ("failed run".into(), kept.outputs.contains_key(&ins.common.name)),
            (Progress::Stopped { completed, .. }, _) if i < *completed => ("ok".into(), true),
            // The instruction the stop interrupted: its output was saved as it stopped.
            (Progress::Stopped { completed, state }, _)
                if i == *completed && kept.outputs.contains_key(&ins.common.name) =>
            {
                (format!("stopped while running ({state})"), true)
            }
            // Without saveOutput, whether it had started cannot be told.
            (Progress::Stopped { completed, state }, _) if i == *completed && !ins.save_output => {
                (format!("not completed ({state})"), false)
            }
            (Progress::Stopped { state, .. }, _) => (format!("not run ({state})"), false),
            _ => continue,
        };
        out.push(format!("instruction {}/{n} {name}: {outcome}", i + 1));
        if !ran {
            continue;
        }
        let mask = Mask::of_env(&ins.common.env);
        match kept.outputs.get(&ins.common.name) {
            Some(o) => out.extend(output_lines(o, "| ", &mask)),
            None => match failed {
                // The failure keeps the last lines of an instruction whose output is not saved.
                Some(Some(f)) if f.instruction == Some(i + 1) && !f.last_lines.is_empty() => {
                    out.push("  (its last lines, kept with the failure; saveOutput is false)".into());
                    out.extend(f.last_lines.iter().map(|l| format!("  | {}", failure::shown_line(l))));
                }
                _ if !ins.save_output => out.push("  (output not kept: saveOutput is false)".into()),
                _ => out.push("  (no output)".into()),
            },
        }
    }
    out
}

/// Each periodic instruction's last result and output.
fn periodic_lines(plan: &ValidPlan, periodic: &BTreeMap<String, PeriodicInstructionOutput>) -> Vec<String> {
    let mut out = Vec::new();
    let m = plan.plan.periodic_instructions.len();
    for (i, p) in plan.plan.periodic_instructions.iter().enumerate() {
        let name = shown_name(&p.common.name);
        let Some(o) = periodic.get(&p.common.name) else {
            out.push(format!("periodic instruction {}/{m} {name}: not run yet", i + 1));
            continue;
        };
        let when = match (o.last_successful_run_time.as_str(), o.last_failed_run_time.as_str()) {
            ("", "") => String::new(),
            (ok, "") => format!(", last success {}", failure::shown_line(ok)),
            ("", bad) => format!(", last failure {}", failure::shown_line(bad)),
            (ok, bad) => {
                format!(", last success {}, last failure {}", failure::shown_line(ok), failure::shown_line(bad))
            }
        };
        out.push(format!("periodic instruction {}/{m} {name}: exit status {}{when}", i + 1, o.exit_code));
        let mask = Mask::of_env(&p.common.env);
        out.extend(output_lines(&o.stdout, "| ", &mask));
        out.extend(output_lines(&o.stderr, "! ", &mask));
    }
    out
}

/// What a local plan's `.pos` keeps of the plan with `checksum`.
pub fn of_pos(p: &Pos, checksum: &str) -> Kept {
    let outputs = |raw: &[u8]| crate::plan::decode_one_time_output(raw).unwrap_or_default();
    let periodic = crate::plan::decode_periodic_output(&p.periodic_output).unwrap_or_default();
    let state = p.plan_state.clone().filter(|_| p.plan_checksum == checksum);
    let failure = p.last_failure.clone().filter(|f| f.checksum == checksum).map(Failure::bounded);
    let (progress, outputs) = progress(
        state,
        p.checkpoint.as_ref(),
        checksum,
        (p.applied_checksum == checksum).then(|| outputs(&p.output)),
        (p.failed_checksum == checksum).then(|| outputs(&p.failed_output)),
        failure,
        outputs(&p.output),
    );
    Kept { progress, outputs, periodic }
}

/// What a plan Secret keeps of the plan it holds.
pub fn of_secret(s: &SecretSnapshot, checksum: &str) -> Kept {
    let key = |k: &str| wire::text(s, k).unwrap_or_default();
    let checkpoint = Checkpoint::read(s.data.get(wire::PLAN_CHECKPOINT).map(Vec::as_slice), checksum);
    let state = wire::plan_state(s).or_else(|| match wire::legacy_outcome(s, checksum) {
        Some(true) => Some(PlanState::Succeeded),
        Some(false) => Some(PlanState::Failed),
        None => None,
    });
    let (progress, outputs) = progress(
        state,
        checkpoint.as_ref(),
        checksum,
        (key(wire::APPLIED_CHECKSUM) == checksum).then(|| wire::one_time_output(s, wire::APPLIED_OUTPUT)),
        (key(wire::FAILED_CHECKSUM) == checksum).then(|| wire::one_time_output(s, wire::FAILED_OUTPUT)),
        wire::failure(s, checksum),
        wire::one_time_output(s, wire::APPLIED_OUTPUT),
    );
    Kept { progress, outputs, periodic: wire::periodic_output(s) }
}

/// The progress of a plan from its recorded state, and the outputs that are this plan's: those
/// of a success or a failure recorded for it, or (stopped at a boundary) the outputs written with
/// its checkpoint.
fn progress(
    state: Option<PlanState>,
    checkpoint: Option<&Checkpoint>,
    checksum: &str,
    applied: Option<BTreeMap<String, Vec<u8>>>,
    failed: Option<BTreeMap<String, Vec<u8>>>,
    failure: Option<Failure>,
    at_checkpoint: BTreeMap<String, Vec<u8>>,
) -> (Progress, BTreeMap<String, Vec<u8>>) {
    let stopped = checkpoint.filter(|c| c.checksum == checksum);
    match (state, applied, failed) {
        (Some(PlanState::Succeeded), Some(o), _) => (Progress::Succeeded, o),
        (Some(PlanState::Failed), _, Some(o)) => (Progress::Failed(failure), o),
        (Some(s @ (PlanState::Paused | PlanState::Canceled)), _, _) if stopped.is_some() => {
            let completed = stopped.map_or(0, |c| c.completed_instructions);
            (Progress::Stopped { completed, state: s.as_str().to_string() }, at_checkpoint)
        }
        // A retry of a failed run keeps the failure's output until it ends.
        (Some(s @ (PlanState::InProgress | PlanState::Pending)), _, Some(o)) => {
            (Progress::Again { state: s.as_str().to_string(), failure }, o)
        }
        (Some(s), _, _) => (Progress::NotYet(s.as_str().to_string()), BTreeMap::new()),
        (None, _, _) => (Progress::NotYet("pending".into()), BTreeMap::new()),
    }
}

/// The logs of a NodePlan's current run from its status (per-instruction results).
pub fn of_nodeplan(plan: &ValidPlan, status: &NodePlanStatus, run: &str) -> Vec<String> {
    if status.plan_checksum != run || status.instructions.is_empty() {
        let state = status.state.as_ref().filter(|_| status.plan_checksum == run).map_or("pending", |s| s.as_str());
        let kept = Kept {
            progress: Progress::NotYet(state.to_string()),
            outputs: BTreeMap::new(),
            periodic: status.periodic_outputs.clone(),
        };
        return lines(plan, &kept);
    }
    let n = plan.plan.instructions.len();
    let mut out = Vec::new();
    for (i, ins) in plan.plan.instructions.iter().enumerate() {
        let r = status.instructions.get(i);
        let outcome = match r {
            Some(r) if !r.outcome.is_empty() => {
                let code = r
                    .exit_code
                    .filter(|_| r.outcome != "ok")
                    .map_or_else(String::new, |c| format!(" (exit status {c})"));
                format!("{}{code}", failure::shown_line(&r.outcome))
            }
            _ => "not run".into(),
        };
        out.push(format!("instruction {}/{n} {}: {outcome}", i + 1, shown_name(&ins.common.name)));
        match r.map(|r| r.output.as_str()) {
            Some(o) if !o.is_empty() => out.extend(output_lines(o.as_bytes(), "| ", &Mask::of_env(&ins.common.env))),
            Some(_) if r.is_some_and(|r| !r.outcome.is_empty()) && !ins.save_output => {
                out.push("  (output not kept: saveOutput is false)".into())
            }
            _ => {}
        }
    }
    out.extend(periodic_lines(plan, &status.periodic_outputs));
    out
}

/// The logs of the plan a selected object holds (a plan Secret's or a NodePlan's), or why there
/// are none.
pub fn of_object(o: &super::objects::Object) -> Result<Vec<String>, String> {
    use super::objects::Object;
    match o {
        Object::Secret(s) => {
            let raw = s.data.get(wire::PLAN).ok_or("the Secret holds no plan")?;
            let plan = crate::plan::parse(raw).map_err(|e| format!("its plan: {e}"))?;
            Ok(lines(&plan, &of_secret(s, &crate::plan::checksum(raw))))
        }
        Object::NodePlan(o) => {
            use crate::nodeplan::{cli_wire, wire as np};
            let (plan, run) = np::valid_plan(&cli_wire::spec_of(o)).map_err(|e| format!("its plan: {e}"))?;
            Ok(of_nodeplan(&plan, &cli_wire::status_of(o)?, &run))
        }
    }
}

fn shown_name(name: &str) -> String {
    failure::shown_line(failure::display_name(name))
}

/// `output` as indented lines after `mark`, masked (as a whole) and escaped.
fn output_lines(output: &[u8], mark: &str, mask: &Mask) -> Vec<String> {
    mask.lines(output).iter().map(|l| format!("  {mark}{}", failure::shown_line(l))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::encode_one_time_output;

    fn plan() -> ValidPlan {
        crate::plan::parse(
            serde_json::json!({
                "instructions": [
                    {"name": "prepare", "command": "true", "saveOutput": true},
                    {"name": "boom", "command": "true", "saveOutput": true, "env": ["KEY=s3cret-key"]},
                    {"name": "quiet", "command": "true"}
                ],
                "periodicInstructions": [{"name": "check", "command": "true", "periodSeconds": 60}]
            })
            .to_string()
            .as_bytes(),
        )
        .unwrap()
    }

    fn outputs(pairs: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect()
    }

    #[test]
    fn a_failed_run_shows_each_instruction_its_outcome_and_output_masked() {
        let p = plan();
        let f = Failure::instruction(&p.checksum, 1, 3, "boom", "exit status 3".into(), b"", &[]);
        let kept = Kept {
            progress: Progress::Failed(Some(f)),
            outputs: outputs(&[("prepare", "ready\n"), ("boom", "key s3cret-key\n\x1b[2Jgone\n")]),
            periodic: BTreeMap::from([(
                "check".to_string(),
                PeriodicInstructionOutput {
                    name: "check".into(),
                    stdout: b"fine\n".to_vec(),
                    stderr: b"warn\n".to_vec(),
                    exit_code: 0,
                    last_successful_run_time: "Wed Dec  2 12:00:00 UTC 2026".into(),
                    ..Default::default()
                },
            )]),
        };
        assert_eq!(
            lines(&p, &kept),
            [
                "instruction 1/3 prepare: ok",
                "  | ready",
                "instruction 2/3 boom: FAILED (exit status 3)",
                "  | key ***",
                "  | \\u{1b}[2Jgone",
                "instruction 3/3 quiet: not run",
                "periodic instruction 1/1 check: exit status 0, last success Wed Dec  2 12:00:00 UTC 2026",
                "  | fine",
                "  ! warn",
            ]
        );
    }

    #[test]
    fn only_the_current_plans_outputs_are_shown() {
        let p = plan();
        let old = Pos {
            applied_checksum: "an-earlier-plan".into(),
            output: encode_one_time_output(&outputs(&[("prepare", "old output\n")])),
            ..Pos::default()
        };
        let logs = lines(&p, &of_pos(&old, &p.checksum));
        assert_eq!(logs[0], "no output kept for this plan yet (pending)");
        assert!(!logs.iter().any(|l| l.contains("old output")), "{logs:?}");
        // Succeeded: every instruction ok, one without saveOutput says so.
        let done = Pos {
            applied_checksum: p.checksum.clone(),
            plan_checksum: p.checksum.clone(),
            plan_state: Some(PlanState::Succeeded),
            output: encode_one_time_output(&outputs(&[("prepare", "new\n"), ("boom", "")])),
            ..Pos::default()
        };
        let logs = lines(&p, &of_pos(&done, &p.checksum));
        assert_eq!(
            logs[..5],
            [
                "instruction 1/3 prepare: ok",
                "  | new",
                "instruction 2/3 boom: ok",
                "instruction 3/3 quiet: ok",
                "  (output not kept: saveOutput is false)"
            ]
        );
        assert_eq!(logs[5], "periodic instruction 1/1 check: not run yet");
        // Paused after one instruction: the first is ok, the others wait.
        let cp = Checkpoint {
            checksum: p.checksum.clone(),
            completed_instructions: 1,
            total_instructions: 3,
            resume_state: Some(PlanState::InProgress),
            paused: true,
            termination_incomplete: false,
        };
        let paused = Pos {
            plan_checksum: p.checksum.clone(),
            plan_state: Some(PlanState::Paused),
            checkpoint: Some(cp),
            output: encode_one_time_output(&outputs(&[("prepare", "so far\n")])),
            ..Pos::default()
        };
        let logs = lines(&p, &of_pos(&paused, &p.checksum));
        assert_eq!(logs[..3], ["instruction 1/3 prepare: ok", "  | so far", "instruction 2/3 boom: not run (paused)"]);
        // Canceled while the second ran: its output was saved as it stopped.
        let cp = Checkpoint { resume_state: None, paused: false, ..paused.checkpoint.clone().unwrap() };
        let canceled = Pos {
            plan_state: Some(PlanState::Canceled),
            checkpoint: Some(cp.clone()),
            output: encode_one_time_output(&outputs(&[("prepare", "so far\n"), ("boom", "half\n")])),
            ..paused.clone()
        };
        let logs = lines(&p, &of_pos(&canceled, &p.checksum));
        assert_eq!(
            logs[2..5],
            ["instruction 2/3 boom: stopped while running (canceled)", "  | half", "instruction 3/3 quiet: not run (canceled)"]
        );
        // Canceled at the third, which keeps no output: whether it had started cannot be told.
        let at_quiet = Pos { checkpoint: Some(Checkpoint { completed_instructions: 2, ..cp }), ..canceled };
        let logs = lines(&p, &of_pos(&at_quiet, &p.checksum));
        assert_eq!(logs[4], "instruction 3/3 quiet: not completed (canceled)");
    }

    #[test]
    fn a_failure_without_saved_output_shows_the_lines_it_kept() {
        let p = plan();
        let f = Failure::instruction(&p.checksum, 2, 3, "quiet", "signal: killed".into(), b"last words\n", &[]);
        let kept = Kept { progress: Progress::Failed(Some(f)), outputs: BTreeMap::new(), periodic: BTreeMap::new() };
        let logs = lines(&p, &kept);
        assert_eq!(
            logs[4..7],
            [
                "instruction 3/3 quiet: FAILED (signal: killed)",
                "  (its last lines, kept with the failure; saveOutput is false)",
                "  | last words"
            ]
        );
    }

    #[test]
    fn a_retry_keeps_showing_the_failed_run_until_it_ends() {
        let p = plan();
        let f = Failure::instruction(&p.checksum, 1, 3, "boom", "exit status 3".into(), b"", &[]);
        let retrying = Pos {
            plan_checksum: p.checksum.clone(),
            plan_state: Some(PlanState::InProgress),
            failed_checksum: p.checksum.clone(),
            failed_output: encode_one_time_output(&outputs(&[("prepare", "ready\n"), ("boom", "disk full\n")])),
            last_failure: Some(f),
            ..Pos::default()
        };
        let logs = lines(&p, &of_pos(&retrying, &p.checksum));
        assert_eq!(
            logs[..5],
            [
                "in-progress again; its last finished run failed:",
                "instruction 1/3 prepare: ok",
                "  | ready",
                "instruction 2/3 boom: FAILED (exit status 3)",
                "  | disk full",
            ]
        );
        // A failed run of an earlier plan is not this one's.
        let other = Pos { failed_checksum: "an-earlier-plan".into(), ..retrying };
        assert_eq!(lines(&p, &of_pos(&other, &p.checksum))[0], "no output kept for this plan yet (in-progress)");
    }
}
