//! What a release ships beside the binary: `--version` naming the commit, shell completions and
//! the man page, generated from the same clap definitions as the commands themselves.

mod common;

use common::NODEPLAN;
use std::process::Command;

fn run(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(NODEPLAN).args(args).output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn version_names_the_commit_and_its_date() {
    let (code, out) = run(&["--version"]);
    assert_eq!(code, Some(0));
    let line = out.trim_end();
    let rest = line
        .strip_prefix(&format!("nodeplan {} (commit ", env!("CARGO_PKG_VERSION")))
        .unwrap_or_else(|| panic!("{line}"));
    let (commit, date) = rest.trim_end_matches(')').split_once(", ").unwrap_or_else(|| panic!("{line}"));
    let head =
        Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).current_dir(env!("CARGO_MANIFEST_DIR")).output();
    match head {
        Ok(h) if h.status.success() => {
            let head = String::from_utf8_lossy(&h.stdout).trim().to_string();
            assert_eq!(commit.trim_end_matches("-dirty"), head, "{line}");
            assert!(date.len() == 10 && date.as_bytes()[4] == b'-' && date.as_bytes()[7] == b'-', "{line}");
        }
        // A source tarball: no git.
        _ => assert_eq!((commit, date), ("unknown", "unknown"), "{line}"),
    }
    // Subcommands carry the same version.
    assert_eq!(run(&["apply", "--version"]).1, out.replace("nodeplan ", "nodeplan-apply "));
}

#[test]
fn completions_are_valid_scripts_that_know_the_commands() {
    let (code, bash) = run(&["completions", "bash"]);
    assert_eq!(code, Some(0));
    for word in ["_nodeplan()", "apply", "supervise", "--dry-run", "--nodeplan"] {
        assert!(bash.contains(word), "no {word:?} in the bash completion");
    }
    let check = Command::new("bash").args(["-n", "-c", &bash]).output().unwrap();
    assert!(check.status.success(), "bash -n: {}", String::from_utf8_lossy(&check.stderr));
    assert!(run(&["completions", "zsh"]).1.starts_with("#compdef nodeplan"));
    assert!(run(&["completions", "fish"]).1.contains("complete -c nodeplan"));
    let (code, _) = run(&["completions", "tcsh"]);
    assert_eq!(code, Some(2), "an unknown shell is bad input");
}

#[test]
fn the_man_page_is_roff_for_section_1() {
    let (code, man) = run(&["man"]);
    assert_eq!(code, Some(0));
    assert!(man.contains(".TH nodeplan 1"), "{man}");
    for word in [".SH NAME", ".SH SYNOPSIS", "apply", "supervise", "agent"] {
        assert!(man.contains(word), "no {word:?} in the man page");
    }
}
