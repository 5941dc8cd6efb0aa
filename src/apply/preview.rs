//! What applying a plan's files would change on this node, without changing anything
//! (`nodeplan apply --dry-run`).
//!
//! This module reads the node (`lstat`, and a file's content through [`crate::safefs::read_small`],
//! never following a link at the path) and compares it with each [`FileOp`]; it writes nothing
//! and prints nothing (the CLI shows the [`FilePreview`]s). Content that is secret is never put
//! into a preview unless asked: a file is secret when the plan's mode or the file's current mode
//! lacks `o+r` (join tokens, keys); it is then described by size and SHA-256 only.

use crate::plan::FileOp;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

/// The largest current file read to compare (bigger ones are compared by size only).
const READ_CAP: u64 = 16 << 20;

/// What would happen to one path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Nothing: content, mode and owner already match (or a delete of something absent).
    Unchanged,
    /// A file or directory that does not exist yet.
    Create,
    /// The content differs (and perhaps mode or owner).
    Modify,
    /// Only the mode or owner differ.
    Attributes,
    Delete,
    /// What is at the path is of another kind (a directory where a file goes, a link): the apply
    /// replaces it or fails there.
    Replace(String),
}

/// One file operation's preview.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilePreview {
    pub path: String,
    pub change: Change,
    /// Lines describing it: mode and owner changes, sizes and digests, or a unified diff.
    pub details: Vec<String>,
}

impl FilePreview {
    pub fn pending(&self) -> bool {
        self.change != Change::Unchanged
    }
}

/// What is at a path now.
struct Current {
    kind: Option<std::fs::FileType>,
    mode: u32,
    uid: u32,
    gid: u32,
}

fn current(path: &Path) -> Result<Current, String> {
    match std::fs::symlink_metadata(path) {
        Ok(m) => Ok(Current { kind: Some(m.file_type()), mode: m.mode() & 0o7777, uid: m.uid(), gid: m.gid() }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Current { kind: None, mode: 0, uid: 0, gid: 0 }),
        Err(e) => Err(e.to_string()),
    }
}

fn kind_name(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symlink (it is replaced, never followed)"
    } else if t.is_file() {
        "a file"
    } else {
        "a special file"
    }
}

/// `mode 0644 → 0600`, `owner 0:0 → 1000:1000` lines for what differs.
fn attribute_lines(cur: &Current, mode: u32, uid: u32, gid: u32) -> Vec<String> {
    let mut out = Vec::new();
    if cur.mode != mode {
        out.push(format!("mode {:04o} → {mode:04o}", cur.mode));
    }
    if (cur.uid, cur.gid) != (uid, gid) {
        out.push(format!("owner {}:{} → {uid}:{gid}", cur.uid, cur.gid));
    }
    out
}

fn digest(b: &[u8]) -> String {
    let hex = crate::plan::checksum(b);
    format!("{} bytes, sha256 {}", b.len(), &hex[..16])
}

/// The lines that show how `old` (absent: a new file) becomes `new`.
fn content_lines(path: &str, old: Option<&[u8]>, new: &[u8], secret: bool) -> Vec<String> {
    let text = |b: &[u8]| std::str::from_utf8(b).ok().filter(|s| !s.contains('\0')).map(str::to_string);
    if secret {
        let was = old.map_or("absent".to_string(), digest);
        return vec![format!(
            "content not shown (not world-readable; --show-secrets shows it): {was} → {}",
            digest(new)
        )];
    }
    match (old.map(text), text(new)) {
        (Some(Some(o)), Some(n)) => similar::TextDiff::from_lines(&o, &n)
            .unified_diff()
            .context_radius(3)
            .header(path, path)
            .to_string()
            .lines()
            .map(str::to_string)
            .collect(),
        (None, Some(n)) => similar::TextDiff::from_lines("", &n)
            .unified_diff()
            .header("/dev/null", path)
            .to_string()
            .lines()
            .map(str::to_string)
            .collect(),
        _ => vec![format!("binary content: {} → {}", old.map_or("absent".to_string(), digest), digest(new))],
    }
}

/// What applying `op` would change, read from the node now. `show_secrets`: diff content that
/// is not world-readable too.
pub fn preview(op: &FileOp, show_secrets: bool) -> FilePreview {
    let path = op.path().to_string();
    let at = |change: Change, details: Vec<String>| FilePreview { path: path.clone(), change, details };
    let cur = match current(Path::new(&path)) {
        Ok(c) => c,
        Err(e) => return at(Change::Replace(format!("cannot examine it: {e}")), Vec::new()),
    };
    match op {
        FileOp::Delete { directory, .. } => match cur.kind {
            None => at(Change::Unchanged, vec!["absent already".into()]),
            Some(k) if *directory || !k.is_dir() => at(Change::Delete, vec![format!("removes {}", kind_name(k))]),
            Some(k) => at(Change::Replace(format!("is {}; a file delete refuses it", kind_name(k))), Vec::new()),
        },
        FileOp::Directory { mode, uid, gid, .. } => match cur.kind {
            None => at(Change::Create, vec![format!("directory, mode {mode:04o}, owner {uid}:{gid}")]),
            Some(k) if k.is_dir() => {
                let lines = attribute_lines(&cur, *mode, *uid, *gid);
                at(if lines.is_empty() { Change::Unchanged } else { Change::Attributes }, lines)
            }
            Some(k) => at(Change::Replace(format!("is {}", kind_name(k))), Vec::new()),
        },
        FileOp::Write { content, mode, uid, gid, .. } => {
            let new_secret = mode & 0o004 == 0 && !show_secrets;
            match cur.kind {
                None => {
                    let mut lines = vec![format!("file, mode {mode:04o}, owner {uid}:{gid}")];
                    lines.extend(content_lines(&path, None, content, new_secret));
                    at(Change::Create, lines)
                }
                Some(k) if k.is_file() => {
                    let secret = (new_secret || cur.mode & 0o004 == 0) && !show_secrets;
                    let mut lines = attribute_lines(&cur, *mode, *uid, *gid);
                    let old = match crate::safefs::read_small(Path::new(&path), READ_CAP) {
                        Ok(Some(b)) => b,
                        Ok(None) => return at(Change::Create, lines),
                        Err(e) => {
                            lines.push(format!("current content not compared: {e}"));
                            return at(Change::Modify, lines);
                        }
                    };
                    if old == *content {
                        return at(if lines.is_empty() { Change::Unchanged } else { Change::Attributes }, lines);
                    }
                    lines.extend(content_lines(&path, Some(&old), content, secret));
                    at(Change::Modify, lines)
                }
                Some(k) => {
                    let mut lines = vec![format!("file, mode {mode:04o}, owner {uid}:{gid}")];
                    lines.extend(content_lines(&path, None, content, new_secret));
                    at(Change::Replace(format!("is {}", kind_name(k))), lines)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> (u32, u32) {
        (rustix::process::geteuid().as_raw(), rustix::process::getegid().as_raw())
    }

    fn write(path: &str, content: &str, mode: u32) -> FileOp {
        let (uid, gid) = me();
        FileOp::Write { path: path.into(), content: content.as_bytes().to_vec(), mode, uid, gid }
    }

    #[test]
    fn each_kind_of_change_is_told_and_nothing_is_touched() {
        let d = tempfile::tempdir().unwrap();
        let p = |n: &str| d.path().join(n).to_string_lossy().into_owned();
        std::fs::write(p("same"), "a\n").unwrap();
        std::fs::write(p("edit"), "one\ntwo\nthree\n").unwrap();
        std::fs::write(p("chmod"), "x").unwrap();
        for f in ["same", "edit", "chmod"] {
            std::fs::set_permissions(p(f), std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        }
        std::os::unix::fs::symlink("/etc/passwd", p("link")).unwrap();
        std::fs::create_dir(p("dir")).unwrap();
        let (uid, gid) = me();
        let rows: Vec<(FileOp, Change)> = vec![
            (write(&p("same"), "a\n", 0o644), Change::Unchanged),
            (write(&p("new"), "hello\n", 0o644), Change::Create),
            (write(&p("edit"), "one\n2\nthree\n", 0o644), Change::Modify),
            (write(&p("chmod"), "x", 0o600), Change::Attributes),
            (write(&p("link"), "x", 0o644), Change::Replace("is a symlink (it is replaced, never followed)".into())),
            (FileOp::Delete { path: p("same"), directory: false }, Change::Delete),
            (FileOp::Delete { path: p("gone"), directory: false }, Change::Unchanged),
            (FileOp::Directory { path: p("dir"), mode: 0o755, uid, gid }, Change::Unchanged),
            (FileOp::Directory { path: p("newdir"), mode: 0o700, uid, gid }, Change::Create),
        ];
        for (op, want) in &rows {
            let got = preview(op, false);
            assert_eq!(&got.change, want, "{}: {:?}", op.path(), got.details);
        }
        let edit = preview(&rows[2].0, false);
        assert!(edit.details.iter().any(|l| l == "-two") && edit.details.iter().any(|l| l == "+2"), "{edit:?}");
        assert_eq!(preview(&rows[3].0, false).details, ["mode 0644 → 0600"]);
        // Read only: the node is as it was.
        assert_eq!(std::fs::read_to_string(p("edit")).unwrap(), "one\ntwo\nthree\n");
        assert!(!Path::new(&p("new")).exists() && !Path::new(&p("newdir")).exists());
        assert!(std::fs::symlink_metadata(p("link")).unwrap().file_type().is_symlink());
    }

    #[test]
    fn secrets_show_sizes_and_digests_never_content_unless_asked() {
        let d = tempfile::tempdir().unwrap();
        let token = d.path().join("token").to_string_lossy().into_owned();
        let new = preview(&write(&token, "s3cret-join-token\n", 0o600), false);
        let all = new.details.join("\n");
        assert!(!all.contains("s3cret"), "{all}");
        assert!(all.contains("18 bytes, sha256 "), "{all}");
        // An existing secret is not shown either, even when the plan makes it world-readable.
        std::fs::write(&token, "old-secret\n").unwrap();
        std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        let changed = preview(&write(&token, "public\n", 0o644), false).details.join("\n");
        assert!(!changed.contains("old-secret") && changed.contains("not world-readable"), "{changed}");
        let shown = preview(&write(&token, "public\n", 0o644), true).details.join("\n");
        assert!(shown.contains("-old-secret") && shown.contains("+public"), "{shown}");
    }

    #[test]
    fn binary_content_is_described_not_printed() {
        let d = tempfile::tempdir().unwrap();
        let bin = d.path().join("bin").to_string_lossy().into_owned();
        let (uid, gid) = me();
        let op = FileOp::Write { path: bin, content: vec![0, 159, 146, 150], mode: 0o644, uid, gid };
        let p = preview(&op, false);
        assert_eq!(p.change, Change::Create);
        assert!(p.details.iter().any(|l| l.starts_with("binary content: absent → 4 bytes")), "{p:?}");
    }
}
