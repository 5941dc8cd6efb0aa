//! `nodeplan plan pause|resume|cancel|reset|status PLANFILE`: the orchestrator's side for local
//! plans. The commands only write control files beside the plan; the agent (the only writer of
//! `.pos`) acts on them.

use super::exit;
use crate::local::pos::{self, PlanFiles};
use crate::plan::{self, Annotations, Checkpoint};
use clap::{Args, Subcommand};
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(subcommand)]
    pub action: PlanAction,
}

#[derive(Subcommand, Debug)]
pub enum PlanAction {
    /// Pause at the next instruction boundary (writes NAME.paused).
    Pause { file: PathBuf },
    /// Resume a paused plan without re-running finished instructions (removes NAME.paused).
    Resume { file: PathBuf },
    /// Cancel: stop the running instruction's whole tree now; terminal until reset (writes NAME.canceled).
    Cancel { file: PathBuf },
    /// Run the plan again from its first instruction (removes NAME.canceled, writes NAME.reset).
    Reset { file: PathBuf },
    /// Show the plan's state, progress and probe health.
    Status { file: PathBuf },
}

fn files_of(file: &Path) -> Result<PlanFiles, String> {
    PlanFiles::new(file).ok_or_else(|| format!("{}: not a .plan file", file.display()))
}

fn write(path: &Path, content: &[u8]) -> Result<(), String> {
    crate::process::write_atomic(path, content, 0o600).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn remove(path: &Path) -> Result<(), String> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(format!("cannot remove {}: {e}", path.display())),
        _ => Ok(()),
    }
}

pub fn run(args: PlanArgs) -> u8 {
    let r = match &args.action {
        PlanAction::Pause { file } => files_of(file).and_then(|f| write(&f.paused(), b"true\n")),
        PlanAction::Resume { file } => files_of(file).and_then(|f| remove(&f.paused())),
        PlanAction::Cancel { file } => files_of(file).and_then(|f| write(&f.canceled(), b"true\n")),
        PlanAction::Reset { file } => files_of(file).and_then(|f| {
            remove(&f.canceled())?;
            write(&f.reset(), b"")
        }),
        PlanAction::Status { file } => files_of(file).and_then(|f| status(&f)),
    };
    match r {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("nodeplan: {e}");
            exit::FAILED
        }
    }
}

fn status(f: &PlanFiles) -> Result<(), String> {
    let raw = std::fs::read(&f.plan).map_err(|e| format!("cannot read {}: {e}", f.plan.display()))?;
    let checksum = plan::checksum(&raw);
    let parsed = plan::parse(&raw);
    let p = pos::read_pos(&f.pos()).map_err(|e| format!("{}: {e}", f.pos().display()))?;
    let current = p.plan_checksum == checksum;
    println!("plan:       {} (checksum {})", f.plan.display(), &checksum[..12]);
    if let Err(e) = &parsed {
        println!("            {e}");
    }
    let total = parsed.as_ref().map(|v| v.plan.instructions.len()).unwrap_or(0);
    let state = if current && !p.plan_state.is_empty() { p.plan_state.as_str() } else { "pending (not started)" };
    println!("state:      {state}");
    if let Some(Checkpoint {
        completed_instructions,
        total_instructions,
        resume_state,
        paused,
        termination_incomplete,
        ..
    }) = p.checkpoint.as_ref().filter(|c| current && c.checksum == checksum)
    {
        let resume =
            if *paused && !resume_state.is_empty() { format!(", resumes into {resume_state}") } else { String::new() };
        println!("progress:   {completed_instructions}/{total_instructions} instructions done{resume}");
        if *termination_incomplete {
            println!("warning:    a stopped process may have survived (terminationIncomplete)");
        }
    } else if current && p.plan_state == "succeeded" {
        println!("progress:   {total}/{total} instructions done");
    }
    let show = |v: Result<Option<String>, String>| match v {
        Ok(None) => "absent".to_string(),
        Ok(Some(s)) => format!("{s:?}"),
        Err(e) => e,
    };
    let (pv, cv) = (pos::read_control(&f.paused()), pos::read_control(&f.canceled()));
    let (pv2, cv2) = (pv.clone().ok().flatten(), cv.clone().ok().flatten());
    println!("control:    paused={} canceled={}", show(pv), show(cv));
    if let Err(e) = plan::resolve_annotations(&Annotations { paused: pv2.as_deref(), canceled: cv2.as_deref() }) {
        println!("            invalid: {e} (the plan is held; nothing is written)");
    }
    if f.reset().exists() {
        println!("            reset requested (the agent has not picked it up yet)");
    }
    if current {
        println!(
            "attempts:   {} failed in a row, {} succeeded; last {}",
            p.failure_count,
            p.success_count,
            if p.last_apply_time.is_empty() { "never" } else { &p.last_apply_time }
        );
    }
    if !p.blocked.is_empty() {
        println!("blocked:    {}", p.blocked);
    }
    for (name, s) in &p.probe_status {
        let h = if s.healthy { "healthy" } else { "unhealthy" };
        println!("probe:      {name}: {h} (successes {}, failures {})", s.success_count, s.failure_count);
    }
    Ok(())
}
