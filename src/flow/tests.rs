use super::*;
use crate::plan::{Annotations, resolve_annotations};

const STATES: [&str; 7] = ["pending", "in-progress", "succeeded", "failed", "canceled", "paused", "weird"];
const VALUES: [Option<&str>; 5] = [None, Some("true"), Some("false"), Some("True"), Some("")];

fn cp(completed: usize, paused: bool, resume: &str) -> Checkpoint {
    Checkpoint {
        checksum: "c".into(),
        completed_instructions: completed,
        total_instructions: 3,
        resume_state: (!resume.is_empty()).then(|| PlanState::parse(resume)),
        paused,
        termination_incomplete: false,
    }
}

fn snap(state: &str, paused: Option<&str>, canceled: Option<&str>, checkpoint: Option<Checkpoint>) -> Snapshot {
    Snapshot {
        checksum: "c".into(),
        state: PlanState::parse(state),
        hold: resolve_annotations(&Annotations { paused, canceled }),
        checkpoint,
        total: 3,
    }
}

/// The suppression matrix: every plan-state × paused × canceled × checkpoint, each decided
/// from scratch (as a fresh agent after a restart would).
#[test]
fn suppression_matrix() {
    let checkpoints = [None, Some(cp(1, true, "in-progress")), Some(cp(1, false, "")), Some(cp(2, true, "succeeded"))];
    let mut rows = 0;
    for state in STATES {
        for paused in VALUES {
            for canceled in VALUES {
                for checkpoint in &checkpoints {
                    rows += 1;
                    let s = snap(state, paused, canceled, checkpoint.clone());
                    let d = decide(&s);
                    let what =
                        format!("state={state} paused={paused:?} canceled={canceled:?} cp={checkpoint:?}: {d:?}");
                    let cancel = canceled == Some("true");
                    let pause_valid = matches!(paused, None | Some("true") | Some("false"));
                    let cancel_valid = matches!(canceled, None | Some("true") | Some("false"));
                    if cancel {
                        // R2: a valid cancel wins even when paused is invalid.
                        assert!(!matches!(d, Decision::Run(_) | Decision::Invalid(_)), "{what}");
                        if matches!(state, "failed" | "canceled") {
                            assert_eq!(d, Decision::Observe, "write-once: {what}");
                        } else {
                            let Decision::Record { transition, .. } = &d else { panic!("{what}") };
                            assert_eq!(transition.state, PlanState::Canceled);
                            assert!(
                                !transition.checkpoint.paused && transition.checkpoint.resume_state.is_none(),
                                "{what}"
                            );
                        }
                    } else if !pause_valid || !cancel_valid {
                        assert!(matches!(d, Decision::Invalid(_)), "R3 writes nothing: {what}");
                    } else if paused == Some("true") {
                        assert!(!matches!(d, Decision::Run(_)), "a paused plan never executes: {what}");
                        if checkpoint.as_ref().is_some_and(|c| c.paused) && state != "in-progress" {
                            assert_eq!(d, Decision::Observe, "a second pause writes nothing: {what}");
                        } else {
                            let Decision::Record { transition, .. } = &d else { panic!("{what}") };
                            assert_eq!(transition.state, PlanState::Paused);
                            assert!(transition.checkpoint.paused);
                            assert_ne!(transition.checkpoint.resume_state, Some(PlanState::Paused), "{what}");
                        }
                    } else {
                        // Neither annotation holds the plan: the baseline.
                        let (effective, _) = resolve_resume(&s.state, s.checkpoint.as_ref(), 3);
                        match (&d, effective.as_str()) {
                            (Decision::Run(r), "pending" | "in-progress") => assert!(r.one_time(), "{what}"),
                            (Decision::Run(r), "succeeded") => assert!(!r.one_time(), "{what}"),
                            (Decision::Run(_), _) => panic!("only pending, in-progress and succeeded run: {what}"),
                            (Decision::Observe | Decision::Record { .. }, "failed" | "canceled" | "weird") => {}
                            _ => panic!("{what}"),
                        }
                    }
                }
            }
        }
    }
    assert_eq!(rows, 7 * 5 * 5 * 4);
}

#[test]
fn baseline_runs_without_an_annotation() {
    let run = |state: &str| match decide(&snap(state, None, None, None)) {
        Decision::Run(r) => Some((r.one_time(), matches!(r, RunPlan::Begin { .. }), r.resume_from())),
        _ => None,
    };
    assert_eq!(run("pending"), Some((true, true, 0)));
    assert_eq!(run("in-progress"), Some((true, false, 0)), "crash recovery re-runs from the start");
    assert_eq!(run("succeeded"), Some((false, false, 0)), "periodic instructions only");
    assert_eq!(run("failed"), None);
    assert_eq!(run("canceled"), None, "cancel is terminal after the annotation is removed (R8)");
    assert_eq!(run("weird"), None);
}

#[test]
fn pause_records_a_checkpoint_once() {
    let d = decide(&snap("in-progress", Some("true"), None, Some(cp(1, false, ""))));
    let Decision::Record { transition, .. } = d else { panic!() };
    assert_eq!(
        transition.checkpoint,
        Checkpoint {
            checksum: "c".into(),
            completed_instructions: 1,
            total_instructions: 3,
            resume_state: Some(PlanState::InProgress),
            paused: true,
            termination_incomplete: false
        }
    );
    assert_eq!(decide(&snap("paused", Some("true"), None, Some(cp(1, true, "in-progress")))), Decision::Observe);
    // Pausing a succeeded plan resumes into succeeded.
    let Decision::Record { transition, .. } = decide(&snap("succeeded", Some("true"), None, None)) else { panic!() };
    assert_eq!(transition.checkpoint.resume_state, Some(PlanState::Succeeded));
    assert_eq!(transition.checkpoint.completed_instructions, 3, "every instruction of a succeeded plan ran");
    // Canceling a succeeded plan records that all of it ran (not 0/3), and no partial cancel.
    let Decision::Record { transition, partial_cancel } = decide(&snap("succeeded", None, Some("true"), None)) else {
        panic!()
    };
    assert_eq!(
        (transition.state, transition.checkpoint.completed_instructions, partial_cancel),
        (PlanState::Canceled, 3, false)
    );
}

#[test]
fn resume_continues_from_the_checkpoint_and_unpauses_in_the_same_write() {
    for v in [None, Some("false")] {
        let d = decide(&snap("paused", v, None, Some(cp(2, true, "in-progress"))));
        let Decision::Run(r) = d else { panic!("{d:?}") };
        let RunPlan::Continue { resume_from: 2, resume: Some(t) } = r else { panic!("{r:?}") };
        assert_eq!(t.state, PlanState::InProgress);
        assert!(!t.checkpoint.paused && t.checkpoint.resume_state.is_none());
        assert_eq!(t.checkpoint.completed_instructions, 2);
    }
    // A paused pending plan resumes through the pending → in-progress write.
    let Decision::Run(r) = decide(&snap("paused", None, None, Some(cp(0, true, "pending")))) else { panic!() };
    assert!(matches!(r, RunPlan::Begin { resume: Some(_), .. }), "{r:?}");
    assert_eq!(r.commit().map(|c| c.state()), Some(PlanState::InProgress));
    // A paused succeeded plan resumes into succeeded (periodic only).
    let Decision::Run(r) = decide(&snap("paused", None, None, Some(cp(2, true, "succeeded")))) else { panic!() };
    assert!(!r.one_time());
    assert_eq!(r.effective(), PlanState::Succeeded);
    assert!(matches!(r.commit(), Some(Commit::Resume(_))));
    // resumeState "paused" is sanitised to in-progress; completed is clamped to the total.
    let Decision::Run(r) = decide(&snap("paused", None, None, Some(cp(9, true, "paused")))) else { panic!() };
    assert_eq!((r.effective(), r.resume_from()), (PlanState::InProgress, 3));
}

#[test]
fn cancel_carries_progress_and_warns_on_partial() {
    let Decision::Record { transition, partial_cancel } =
        decide(&snap("paused", Some("true"), Some("true"), Some(cp(1, true, "in-progress"))))
    else {
        panic!()
    };
    assert_eq!(transition.state, PlanState::Canceled);
    assert_eq!(transition.checkpoint.completed_instructions, 1);
    assert!(partial_cancel);
    let Decision::Record { partial_cancel, .. } = decide(&snap("pending", None, Some("true"), None)) else { panic!() };
    assert!(!partial_cancel);
}

fn run_plan(one_time: bool) -> RunPlan {
    if one_time { RunPlan::Continue { resume_from: 0, resume: None } } else { RunPlan::Periodic { resume: None } }
}

#[test]
fn record_table() {
    let s = snap("in-progress", None, None, None);
    let mut outputs = BTreeMap::new();
    outputs.insert("a".to_string(), b"out".to_vec());
    let base = Ran { one_time_output: outputs.clone(), ..Default::default() };

    let ok = Ran { one_time_succeeded: true, completed: 3, ..base.clone() };
    let r = record(&s, &run_plan(true), &ok);
    assert_eq!(
        (r.state, r.succeeded, r.checkpoint.clone()),
        (Some(PlanState::Succeeded), Some(true), CheckpointWrite::Clear)
    );

    let failed = Ran { completed: 1, ..base.clone() };
    let r = record(&s, &run_plan(true), &failed);
    assert_eq!((r.state, r.succeeded), (Some(PlanState::Failed), Some(false)));
    assert_eq!(r.one_time_output, Some(outputs.clone()));

    let paused = Ran { completed: 1, interruption: Some(Interruption::Paused), ..base.clone() };
    let r = record(&s, &run_plan(true), &paused);
    assert_eq!(r.state, Some(PlanState::Paused));
    assert_eq!(r.succeeded, None, "never the counters (R12)");
    assert_eq!(
        r.checkpoint,
        CheckpointWrite::Set(Checkpoint {
            checksum: "c".into(),
            completed_instructions: 1,
            total_instructions: 3,
            resume_state: Some(PlanState::InProgress),
            paused: true,
            termination_incomplete: false
        })
    );
    assert_eq!(r.one_time_output, Some(outputs.clone()), "saved outputs kept with the pause (R12)");

    let canceled =
        Ran { completed: 0, interruption: Some(Interruption::Canceled), termination_incomplete: true, ..base.clone() };
    let r = record(&s, &run_plan(true), &canceled);
    assert_eq!(r.state, Some(PlanState::Canceled));
    let CheckpointWrite::Set(c) = r.checkpoint.clone() else { panic!() };
    assert!(!c.paused && c.resume_state.is_none() && c.termination_incomplete);

    let before_spawn = Ran { interruption: Some(Interruption::Canceled), ..Default::default() };
    let r = record(&s, &run_plan(true), &before_spawn);
    assert_eq!(r.state, Some(PlanState::Canceled));
    let CheckpointWrite::Set(c) = r.checkpoint else { panic!() };
    assert_eq!((c.completed_instructions, c.total_instructions, c.paused), (0, 3, false));

    let periodic_paused = Ran { interruption: Some(Interruption::Paused), ..Default::default() };
    let r = record(&snap("succeeded", None, None, None), &run_plan(false), &periodic_paused);
    let CheckpointWrite::Set(c) = r.checkpoint else { panic!() };
    assert_eq!((c.resume_state, c.completed_instructions, c.total_instructions), (Some(PlanState::Succeeded), 3, 3));
    // A cancel landing while a succeeded plan's periodic instruction runs: every one-time
    // instruction had run (it once recorded 0/0, unlike a cancel landing between passes).
    let periodic_canceled = Ran { interruption: Some(Interruption::Canceled), ..Default::default() };
    let r = record(&snap("succeeded", None, None, None), &run_plan(false), &periodic_canceled);
    let CheckpointWrite::Set(c) = r.checkpoint else { panic!() };
    assert_eq!((r.state, c.completed_instructions, c.total_instructions), (Some(PlanState::Canceled), 3, 3));
    let Decision::Record { transition, .. } = decide(&snap("succeeded", None, Some("true"), None)) else { panic!() };
    assert_eq!((transition.checkpoint.completed_instructions, transition.checkpoint.total_instructions), (3, 3));

    let shutdown = Ran { interruption: Some(Interruption::Shutdown), ..base.clone() };
    assert_eq!(
        record(&s, &run_plan(true), &shutdown),
        Record::default(),
        "a shutdown leaves in-progress for the restart"
    );

    let periodic = Ran { one_time_succeeded: false, ..Default::default() };
    let r = record(&snap("succeeded", None, None, None), &run_plan(false), &periodic);
    assert_eq!((r.state, r.succeeded), (None, None), "a periodic-only pass never changes the plan state");

    // R23: a restart request after instruction 2 of 3 records progress, still in-progress, and
    // the restarted agent (deciding from scratch) goes on at instruction 3, committing the resume.
    let restart = Ran { completed: 2, restart: true, ..base.clone() };
    let r = record(&s, &run_plan(true), &restart);
    assert_eq!((r.state.clone(), r.succeeded), (Some(PlanState::InProgress), None), "never the counters");
    assert_eq!(r.one_time_output, Some(outputs.clone()), "saved outputs kept for the rest of the run");
    let CheckpointWrite::Set(c) = r.checkpoint else { panic!("a checkpoint") };
    let after = snap("in-progress", None, None, Some(c.clone()));
    let Decision::Run(RunPlan::Continue { resume_from, resume: Some(t) }) = decide(&after) else {
        panic!("the restarted agent continues: {:?}", decide(&after))
    };
    assert_eq!((resume_from, t.state, t.checkpoint.paused), (2, PlanState::InProgress, false));
    // A pause meanwhile is recorded there (the plan shows `paused`, not `in-progress`), and the
    // resume goes on at instruction 3; a cancel cancels it.
    let Decision::Record { transition: paused, .. } = decide(&snap("in-progress", Some("true"), None, Some(c.clone())))
    else {
        panic!("a pause at the restart point is recorded")
    };
    assert_eq!(paused.state, PlanState::Paused);
    assert_eq!(
        (paused.checkpoint.completed_instructions, paused.checkpoint.resume_state.clone(), paused.checkpoint.paused),
        (2, Some(PlanState::InProgress), true)
    );
    let held = snap("paused", Some("true"), None, Some(paused.checkpoint.clone()));
    assert_eq!(decide(&held), Decision::Observe, "recorded once");
    let Decision::Run(RunPlan::Continue { resume_from: 2, .. }) =
        decide(&snap("paused", None, None, Some(paused.checkpoint)))
    else {
        panic!("the resume goes on after the restart point")
    };
    assert!(matches!(
        decide(&snap("in-progress", None, Some("true"), Some(c))),
        Decision::Record { transition: Transition { state: PlanState::Canceled, .. }, .. }
    ));
    // After the last instruction it is simply the success.
    let last = Ran { one_time_succeeded: true, completed: 3, restart: true, ..base.clone() };
    assert_eq!(record(&s, &run_plan(true), &last).state, Some(PlanState::Succeeded));

    // R26: a run the Lease's fence stopped after instruction 1 of 3 is recorded as that restart
    // point (the next holder goes on at instruction 2); a periodic-only pass records nothing.
    let fenced = Ran { completed: 1, interruption: Some(Interruption::Fenced), ..base.clone() };
    let r = record(&s, &run_plan(true), &fenced);
    assert_eq!((r.state.clone(), r.succeeded), (Some(PlanState::InProgress), None));
    let CheckpointWrite::Set(c) = r.checkpoint else { panic!("a checkpoint") };
    assert_eq!((c.completed_instructions, c.total_instructions, c.paused), (1, 3, true));
    let Decision::Run(RunPlan::Continue { resume_from: 1, .. }) = decide(&snap("in-progress", None, None, Some(c)))
    else {
        panic!("the next holder goes on after the fenced boundary")
    };
    let fenced_periodic = Ran { interruption: Some(Interruption::Fenced), ..Default::default() };
    assert_eq!(record(&snap("succeeded", None, None, None), &run_plan(false), &fenced_periodic), Record::default());
}
