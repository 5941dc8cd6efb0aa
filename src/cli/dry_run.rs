//! `nodeplan apply --dry-run`: what the plan would do on this node, touching nothing (no work
//! directory, no PID records, no locks, no processes). Files are compared by
//! [`crate::apply::preview`]; instructions are listed with their environment, values masked
//! unless `--show-secrets` (an env value is as likely a token as a file is).

use super::exit;
use crate::apply::preview::{self, Change, FilePreview};
use crate::plan::{CommonInstruction, ValidPlan};

/// One line per instruction field that matters: what runs, with what.
fn instruction_lines(c: &CommonInstruction, show_secrets: bool) -> Vec<String> {
    let mut out = Vec::new();
    if !c.image.is_empty() {
        out.push(format!("image {}", c.image));
    }
    if !c.command.is_empty() || !c.args.is_empty() {
        let words: Vec<String> = std::iter::once(&c.command).chain(&c.args).map(|w| shell_word(w)).collect();
        out.push(format!("runs {}", words.join(" ").trim_start()));
    }
    for e in &c.env {
        let shown = match e.split_once('=') {
            Some((k, _)) if !show_secrets => format!("{k}=(masked)"),
            _ => e.clone(),
        };
        out.push(format!("env {}", shown.escape_debug()));
    }
    if c.timeout_seconds > 0 {
        out.push(format!("timeout {}s", c.timeout_seconds));
    }
    out
}

/// A word as a shell would need it quoted (for reading, not for pasting blindly).
fn shell_word(w: &str) -> String {
    let plain = !w.is_empty() && w.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b));
    if plain {
        return w.to_string();
    }
    // Control characters (a newline in a script) are shown escaped: one instruction, one line.
    let visible: String =
        w.chars().map(|c| if c.is_control() { c.escape_debug().to_string() } else { c.into() }).collect();
    format!("'{}'", visible.replace('\'', "'\\''"))
}

fn change_word(c: &Change) -> String {
    match c {
        Change::Unchanged => "unchanged".into(),
        Change::Create => "create".into(),
        Change::Modify => "modify".into(),
        Change::Attributes => "mode/owner".into(),
        Change::Delete => "delete".into(),
        Change::Replace(why) => format!("replace ({why})"),
    }
}

/// Show what `plan` would do (instructions from `resume_from`); the exit code: 0 when nothing
/// would change, [`exit::CHANGES_PENDING`] otherwise.
pub fn show(plan: &ValidPlan, resume_from: usize, run_periodic: bool, show_secrets: bool) -> u8 {
    let files: Vec<FilePreview> = plan.files.iter().map(|op| preview::preview(op, show_secrets)).collect();
    let changed = files.iter().filter(|f| f.pending()).count();
    crate::cli::out!("dry run of plan {}: nothing on this node is touched", &plan.checksum[..12]);
    crate::cli::out!("files: {changed} of {} would change", files.len());
    for f in &files {
        crate::cli::out!("  {} {}", change_word(&f.change), f.path);
        if f.pending() {
            for l in &f.details {
                crate::cli::out!("      {l}");
            }
        }
    }
    let one_time = &plan.plan.instructions;
    let run: Vec<_> = one_time.iter().enumerate().skip(resume_from).collect();
    crate::cli::out!("instructions: {} of {} would run", run.len(), one_time.len());
    for (i, ins) in &run {
        crate::cli::out!("  [{}/{}] {}", i + 1, one_time.len(), ins.common.name);
        for l in instruction_lines(&ins.common, show_secrets) {
            crate::cli::out!("      {l}");
        }
    }
    let periodic = if run_periodic { plan.plan.periodic_instructions.as_slice() } else { &[] };
    if !periodic.is_empty() {
        crate::cli::out!("periodic instructions: {}", periodic.len());
        for p in periodic {
            crate::cli::out!("  {} every {}s", p.common.name, p.period().as_secs());
            for l in instruction_lines(&p.common, show_secrets) {
                crate::cli::out!("      {l}");
            }
        }
    }
    if !plan.plan.probes.is_empty() {
        crate::cli::out!("probes: {}", plan.plan.probes.len());
        for (name, p) in &plan.plan.probes {
            let what = match &p.file_exists {
                Some(f) => format!("file exists {}", f.path),
                None => format!("GET {}", p.http_get.url),
            };
            crate::cli::out!("  {name}: {what}");
        }
    }
    if changed > 0 || !run.is_empty() || !periodic.is_empty() { exit::CHANGES_PENDING } else { exit::OK }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_values_are_masked_unless_asked_and_words_are_quoted() {
        let c = CommonInstruction {
            command: "sh".into(),
            args: vec!["-c".into(), "echo it's $TOKEN".into()],
            env: vec!["TOKEN=abc123".into(), "PLAIN".into()],
            timeout_seconds: 30,
            ..Default::default()
        };
        let masked = instruction_lines(&c, false);
        assert_eq!(masked, ["runs sh -c 'echo it'\\''s $TOKEN'", "env TOKEN=(masked)", "env PLAIN", "timeout 30s"]);
        assert!(instruction_lines(&c, true).contains(&"env TOKEN=abc123".to_string()));
    }
}
