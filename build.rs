//! Stamps the binary with the commit it was built from and that commit's date (not the build
//! time, so the same commit builds the same binary), for `nodeplan --version`. Outside a git
//! checkout (a source tarball) both say `unknown`.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}

fn main() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some();
    let date = git(&["log", "-1", "--format=%cs"]).unwrap_or_else(|| "unknown".into());
    let commit = if dirty && commit != "unknown" { format!("{commit}-dirty") } else { commit };
    println!("cargo:rustc-env=NODEPLAN_COMMIT={commit}");
    println!("cargo:rustc-env=NODEPLAN_COMMIT_DATE={date}");
    // Again when HEAD moves (a commit, a checkout) or the index changes (dirty or not). Paths
    // come from git, so a linked worktree (whose `.git` is a file) is followed too.
    let git_path = |p: &str| git(&["rev-parse", "--git-path", p]).filter(|f| std::path::Path::new(f).exists());
    let head = git_path("HEAD");
    for f in [head.clone(), git_path("index"), git_path("packed-refs")].into_iter().flatten() {
        println!("cargo:rerun-if-changed={f}");
    }
    let branch = head
        .and_then(|h| std::fs::read_to_string(h).ok())
        .and_then(|h| h.strip_prefix("ref: ").map(|r| r.trim().to_string()));
    if let Some(f) = branch.and_then(|b| git_path(&b)) {
        println!("cargo:rerun-if-changed={f}");
    }
}
