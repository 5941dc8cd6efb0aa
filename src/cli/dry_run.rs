//! `nodeplan apply --dry-run`: what the plan would do on this node, touching nothing (no work
//! directory, no PID records, no locks, no processes). Files are compared by
//! [`crate::apply::preview`]; instructions are listed with their environment, values masked
//! unless `--show-secrets` (an env value is as likely a token as a file is).

use super::exit;
use crate::apply::preview::{self, Change, FilePreview};
use crate::image::redact_userinfo;
use crate::plan::{CommonInstruction, FileOp, ValidPlan};

/// One line per instruction field that matters: what runs, with what.
fn instruction_lines(c: &CommonInstruction, show_secrets: bool) -> Vec<String> {
    let mut out = Vec::new();
    if !c.image.is_empty() {
        // Masked as the agent's own errors mask it (`user:password@` → `***@`), --show-secrets
        // or not: a registry password is no preview's business.
        out.push(format!("image {}", redact_userinfo(&c.image)));
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

/// Show what `plan` would do (instructions from `resume_from`); the exit code:
/// [`exit::CHANGES_PENDING`] when a file differs from the plan (drift), 0 when every file matches.
pub fn show(plan: &ValidPlan, resume_from: usize, run_periodic: bool, show_secrets: bool) -> u8 {
    let files: Vec<FilePreview> = plan.files.iter().map(|op| preview::preview(op, show_secrets)).collect();
    let changed = files.iter().filter(|f| f.pending()).count();
    crate::cli::out!("dry run of plan {}: nothing on this node is touched", plan.id());
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
                None => format!("GET {}", redact_userinfo(&p.http_get.url)),
            };
            crate::cli::out!("  {name}: {what}");
        }
    }
    // Files say what the node should hold, so a difference is drift; instructions run at every
    // apply whatever the node holds, so they cannot tell drift and do not count.
    if changed > 0 { exit::CHANGES_PENDING } else { exit::OK }
}

fn file_word(op: &FileOp) -> String {
    match op {
        FileOp::Delete { directory: true, .. } => "delete directory tree".into(),
        FileOp::Delete { .. } => "delete".into(),
        FileOp::Directory { mode, uid, gid, .. } => format!("directory, mode {mode:04o}, owner {uid}:{gid}"),
        FileOp::Write { content, mode, uid, gid, .. } => {
            let sum = crate::plan::checksum(content);
            format!("file, mode {mode:04o}, owner {uid}:{gid}, {} bytes, sha256 {}", content.len(), &sum[..16])
        }
    }
}

/// `+ name`, `- name`, `~ name` lines for two keyed lists, with `describe` of the new entry.
fn keyed<T: PartialEq>(
    out: &mut Vec<String>,
    what: &str,
    old: &[(String, T)],
    new: &[(String, T)],
    describe: impl Fn(&T) -> Vec<String>,
) {
    let mut lines = Vec::new();
    for (k, v) in new {
        match old.iter().find(|(o, _)| o == k) {
            None => lines.push((format!("  + {k}"), describe(v))),
            Some((_, ov)) if ov != v => lines.push((format!("  ~ {k}"), describe(v))),
            Some(_) => {}
        }
    }
    for (k, _) in old.iter().filter(|(k, _)| !new.iter().any(|(n, _)| n == k)) {
        lines.push((format!("  - {k}"), Vec::new()));
    }
    out.push(format!("{what}: {} changed", lines.len()));
    for (head, details) in lines {
        out.push(head);
        out.extend(details.into_iter().map(|d| format!("      {d}")));
    }
}

/// What pushing `new` over `old` (the plan the target holds now, if any) changes, by file path
/// and by instruction and probe name (file contents as size and SHA-256; env values masked
/// unless `show_secrets`). Empty when the plans are the same plan (one id, however formatted).
pub fn plan_changes(old: Option<&ValidPlan>, new: &ValidPlan, show_secrets: bool) -> Vec<String> {
    let new_id = new.id();
    let mut out = vec![match old.map(ValidPlan::id) {
        Some(o) if o == new_id => return Vec::new(),
        Some(o) => format!("plan {o} → {new_id}"),
        None => format!("new plan {new_id} (nothing there yet)"),
    }];
    let files = |p: Option<&ValidPlan>| -> Vec<(String, FileOp)> {
        p.map(|p| p.files.iter().map(|f| (f.path().to_string(), f.clone())).collect()).unwrap_or_default()
    };
    keyed(&mut out, "files", &files(old), &files(Some(new)), |f| vec![file_word(f)]);
    let one_time = |p: Option<&ValidPlan>| -> Vec<(String, CommonInstruction)> {
        p.map(|p| p.plan.instructions.iter().map(|i| (i.common.name.clone(), i.common.clone())).collect())
            .unwrap_or_default()
    };
    keyed(&mut out, "instructions", &one_time(old), &one_time(Some(new)), |c| instruction_lines(c, show_secrets));
    let periodic = |p: Option<&ValidPlan>| -> Vec<(String, (CommonInstruction, i64))> {
        p.map(|p| {
            p.plan
                .periodic_instructions
                .iter()
                .map(|i| (i.common.name.clone(), (i.common.clone(), i.period_seconds)))
                .collect()
        })
        .unwrap_or_default()
    };
    keyed(&mut out, "periodic instructions", &periodic(old), &periodic(Some(new)), |(c, _)| {
        instruction_lines(c, show_secrets)
    });
    let probes = |p: Option<&ValidPlan>| -> Vec<(String, crate::plan::Probe)> {
        p.map(|p| p.plan.probes.iter().map(|(k, v)| (k.clone(), v.clone())).collect()).unwrap_or_default()
    };
    keyed(&mut out, "probes", &probes(old), &probes(Some(new)), |_| Vec::new());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(v: serde_json::Value) -> ValidPlan {
        crate::plan::parse(&serde_json::to_vec(&v).unwrap()).unwrap()
    }

    #[test]
    fn a_push_shows_what_it_changes_by_path_and_name() {
        let old = parsed(serde_json::json!({
            "files": [{"path": "/a", "content": "eA=="}, {"path": "/gone", "content": ""}],
            "instructions": [{"name": "keep", "command": "true"}, {"name": "edit", "command": "true"}],
        }));
        let new = parsed(serde_json::json!({
            "files": [{"path": "/a", "content": "eQ=="}, {"path": "/b", "directory": true}],
            "instructions": [{"name": "keep", "command": "true"}, {"name": "edit", "command": "false", "env": ["K=secret"]}],
        }));
        let lines = plan_changes(Some(&old), &new, false);
        let text = lines.join("\n");
        assert!(text.starts_with(&format!("plan {} → {}", old.id(), new.id())), "{text}");
        for want in [
            "files: 3 changed",
            "  ~ /a",
            "  + /b",
            "  - /gone",
            "instructions: 1 changed",
            "  ~ edit",
            "env K=(masked)",
        ] {
            assert!(lines.iter().any(|l| l.contains(want)), "no {want:?} in:\n{text}");
        }
        assert!(!text.contains("keep") && !text.contains("secret"), "{text}");
        assert!(plan_changes(Some(&new), &new, false).is_empty(), "the same plan changes nothing");
        assert!(plan_changes(None, &new, false)[0].starts_with("new plan "));
    }

    #[test]
    fn env_values_are_masked_unless_asked_and_words_are_quoted() {
        let c = CommonInstruction {
            command: "sh".into(),
            args: vec!["-c".into(), "echo it's $TOKEN".into()],
            env: vec!["TOKEN=abc123".into(), "PLAIN".into()],
            timeout_seconds: 30,
            ..Default::default()
        };
        let image = CommonInstruction { image: "u:hunter2@reg.io/a/b:1".into(), ..Default::default() };
        for show in [false, true] {
            assert_eq!(instruction_lines(&image, show), ["image ***@reg.io/a/b:1"]);
        }
        let masked = instruction_lines(&c, false);
        assert_eq!(masked, ["runs sh -c 'echo it'\\''s $TOKEN'", "env TOKEN=(masked)", "env PLAIN", "timeout 30s"]);
        assert!(instruction_lines(&c, true).contains(&"env TOKEN=abc123".to_string()));
    }
}
