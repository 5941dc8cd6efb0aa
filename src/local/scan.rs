//! Which files of the plan directory are plans: `*.plan`, recursively, sorted by full path; dot
//! files are skipped, and so is any plan whose basename has a `<basename>.skip` anywhere in the tree.
//!
//! Only directories root may speak for are walked (owned by root or the agent's user, not
//! writable by group or others: [`super::trust::dir`]); an untrusted one is reported and not
//! entered, so nothing in it (a plan, a skip file, more directories) counts or costs anything.
//! A skip file counts only when it passes the same rule. The walk is bounded: at most
//! [`MAX_ENTRIES`] entries and [`MAX_DEPTH`] levels; what lies beyond is reported and not seen.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The most directory entries one scan looks at.
pub const MAX_ENTRIES: usize = 100_000;
/// The deepest directory one scan enters, counted from the plan directory (0).
pub const MAX_DEPTH: usize = 32;

/// What a scan found.
#[derive(Debug, Default)]
pub struct Scan {
    pub plans: Vec<PathBuf>,
    /// Directories not walked, and why (each a line's worth: "PATH is owned by uid 1000").
    pub untrusted: Vec<String>,
    /// Set when a bound stopped the walk: what was left out.
    pub bounded: Option<String>,
}

pub fn scan(dir: &Path) -> Scan {
    scan_within(dir, MAX_ENTRIES, MAX_DEPTH)
}

/// [`scan`] with other bounds (tests).
fn scan_within(dir: &Path, max_entries: usize, max_depth: usize) -> Scan {
    let mut w = Walker { left: max_entries, max_entries, max_depth, all: Vec::new(), skips: HashSet::new() };
    let mut found = Scan::default();
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => match super::trust::dir(&m) {
            Ok(()) => w.walk(dir, 0, &mut found),
            Err(why) => found.untrusted.push(format!("{} {why}", dir.display())),
        },
        _ => return found,
    }
    let Walker { mut all, skips, .. } = w;
    all.sort();
    found.plans = all
        .into_iter()
        .filter(|p| {
            let Some(name) = p.file_name().and_then(|n| n.to_str()) else { return false };
            name.ends_with(".plan") && !name.starts_with('.') && !skips.contains(name)
        })
        .collect();
    found
}

struct Walker {
    /// Entries this scan may still look at.
    left: usize,
    max_entries: usize,
    max_depth: usize,
    all: Vec<PathBuf>,
    skips: HashSet<String>,
}

impl Walker {
    fn walk(&mut self, dir: &Path, depth: usize, found: &mut Scan) {
        let Ok(rd) = std::fs::read_dir(dir) else { return };
        for e in rd.flatten() {
            if self.left == 0 {
                found.bounded.get_or_insert_with(|| {
                    format!(
                        "stopped after {} entries; {} and what follows it are not seen",
                        self.max_entries,
                        e.path().display()
                    )
                });
                return;
            }
            self.left -= 1;
            let path = e.path();
            // DirEntry's metadata does not follow a link: a link is neither a directory nor a file here.
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                if e.file_name().as_encoded_bytes().starts_with(b".") {
                    continue;
                }
                if depth >= self.max_depth {
                    found.bounded.get_or_insert_with(|| {
                        format!("{} is more than {} levels deep; it is not walked", path.display(), self.max_depth)
                    });
                    continue;
                }
                match super::trust::dir(&m) {
                    Ok(()) => self.walk(&path, depth + 1, found),
                    Err(why) => found.untrusted.push(format!("{} {why}", path.display())),
                }
            } else if m.is_file() {
                let name = e.file_name();
                match name.to_str().and_then(|n| n.strip_suffix(".skip")) {
                    // A skip file counts only when it follows the plan file's owner and mode rule.
                    Some(skipped) if super::trust::owner_and_mode(m.uid(), m.mode()).is_ok() => {
                        self.skips.insert(skipped.to_string());
                    }
                    Some(_) => {}
                    None => self.all.push(path),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_plans_recursively_sorted_skipping_dot_files_and_skips() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        std::fs::create_dir_all(p.join("b/c")).unwrap();
        for f in [
            "z.plan",
            "a.plan",
            ".hidden.plan",
            "b/c/deep.plan",
            "b/skipme.plan",
            "b/c/skipme.plan.skip",
            "notes.txt",
            "a.pos",
        ] {
            std::fs::write(p.join(f), b"{}").unwrap();
        }
        let got: Vec<String> =
            scan(p).plans.iter().map(|x| x.strip_prefix(p).unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(got, ["a.plan", "b/c/deep.plan", "z.plan"]);
        assert!(scan(&p.join("missing")).plans.is_empty());
    }

    /// As root: another user's directory is not walked (its plans and skip files do not count),
    /// nor is a directory others can write; a skip file counts only when root's and not writable
    /// by others.
    #[test]
    fn untrusted_directories_and_skip_files_do_not_count() {
        use std::os::unix::fs::PermissionsExt;
        if !rustix::process::geteuid().is_root() {
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        std::fs::create_dir_all(p.join("theirs/deep")).unwrap();
        std::fs::create_dir_all(p.join("open")).unwrap();
        for f in
            ["a.plan", "b.plan", "c.plan", "theirs/a.plan.skip", "theirs/deep/x.plan", "open/y.plan", "b.plan.skip"]
        {
            std::fs::write(p.join(f), b"{}").unwrap();
        }
        std::fs::write(p.join("open/c.plan.skip"), b"").unwrap();
        std::os::unix::fs::chown(p.join("theirs"), Some(1000), None).unwrap();
        std::fs::set_permissions(p.join("open"), std::fs::Permissions::from_mode(0o1777)).unwrap();
        std::fs::set_permissions(p.join("b.plan.skip"), std::fs::Permissions::from_mode(0o666)).unwrap();
        let found = scan(p);
        let got: Vec<String> =
            found.plans.iter().map(|x| x.strip_prefix(p).unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(got, ["a.plan", "b.plan", "c.plan"]);
        let mut untrusted = found.untrusted.clone();
        untrusted.sort();
        assert_eq!(
            untrusted,
            [
                format!("{} is writable by group or others (mode 1777)", p.join("open").display()),
                format!("{} is owned by uid 1000", p.join("theirs").display()),
            ]
        );
        assert!(found.bounded.is_none());
    }

    /// A scan looks at a bounded number of entries and levels, and says what it left out.
    #[test]
    fn scans_are_bounded() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        std::fs::create_dir_all(p.join("a/b/c")).unwrap();
        std::fs::write(p.join("a/b/c/deep.plan"), b"{}").unwrap();
        std::fs::write(p.join("a/b/mid.plan"), b"{}").unwrap();
        let found = scan_within(p, 100, 2);
        assert_eq!(found.plans, [p.join("a/b/mid.plan")]);
        let why = found.bounded.unwrap();
        assert_eq!(why, format!("{} is more than 2 levels deep; it is not walked", p.join("a/b/c").display()));
        for i in 0..10 {
            std::fs::write(p.join(format!("{i}.plan")), b"{}").unwrap();
        }
        let found = scan_within(p, 5, 32);
        assert!(found.plans.len() <= 5, "12 plans, 5 entries looked at: {:?}", found.plans);
        assert!(found.bounded.unwrap().starts_with("stopped after 5 entries; "));
    }
}
