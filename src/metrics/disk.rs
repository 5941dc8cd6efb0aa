//! The disk space used under the agent's directories (the applied-plan archive, the images
//! directory, the work directory), for `nodeplan_directory_size_bytes`. This module only reads
//! metadata: it never opens a file; the measured directory is opened by [`crate::safefs::open_dir`]
//! (a link on its path is followed only under the project's symlink rule), and below it nothing
//! is followed (every entry is looked at with `AT_SYMLINK_NOFOLLOW`, every directory opened with
//! `O_NOFOLLOW` relative to its parent's descriptor); it never leaves the filesystem the directory
//! is on, and stops at [`MAX_ENTRIES`]
//! entries and [`MAX_DEPTH`] levels, so a hostile tree (millions of files, a link loop, a mount)
//! costs a bounded amount of work. A measurement is reused for [`MIN_INTERVAL`], so scrapes in a
//! burst walk nothing.

use super::{DirLabel, Directories};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use rustix::fs::{AtFlags, Mode, OFlags};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Entries looked at per directory and measurement, at most.
pub const MAX_ENTRIES: u64 = 200_000;
/// Directory levels below the measured directory, at most.
pub const MAX_DEPTH: usize = 32;
/// A measurement younger than this is reused.
pub const MIN_INTERVAL: Duration = Duration::from_secs(10);

/// What one measurement found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Bytes allocated on disk (`st_blocks` × 512), each hard-linked file counted at every link.
    pub bytes: u64,
    /// Entries looked at (the directory itself included).
    pub entries: u64,
    /// The whole tree was seen; `false`: a bound was reached (or part of it could not be read),
    /// and `bytes` is a lower bound.
    pub complete: bool,
}

/// The space used under `dir`, within the bounds. A directory that does not exist uses nothing.
pub fn measure(dir: &Path, max_entries: u64) -> Usage {
    let fd = match crate::safefs::open_dir(dir, None) {
        Ok(fd) => fd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Usage { complete: true, ..Usage::default() },
        Err(_) => return Usage::default(),
    };
    let Ok(st) = rustix::fs::fstat(&fd) else { return Usage::default() };
    let mut walk = Walk { dev: st.st_dev, max_entries, usage: Usage { bytes: 0, entries: 0, complete: true } };
    walk.add(&st);
    walk.dir(fd, 0);
    walk.usage
}

struct Walk {
    dev: u64,
    max_entries: u64,
    usage: Usage,
}

impl Walk {
    fn add(&mut self, st: &rustix::fs::Stat) {
        self.usage.entries += 1;
        self.usage.bytes = self.usage.bytes.saturating_add((st.st_blocks as u64).saturating_mul(512));
    }

    fn dir(&mut self, fd: OwnedFd, depth: usize) {
        let Ok(entries) = rustix::fs::Dir::read_from(&fd) else {
            self.usage.complete = false;
            return;
        };
        for entry in entries {
            let Ok(entry) = entry else {
                self.usage.complete = false;
                return;
            };
            let name = entry.file_name();
            if name.to_bytes() == b"." || name.to_bytes() == b".." {
                continue;
            }
            if self.usage.entries >= self.max_entries {
                self.usage.complete = false;
                return;
            }
            let Ok(st) = rustix::fs::statat(fd.as_fd(), name, AtFlags::SYMLINK_NOFOLLOW) else {
                // Removed meanwhile (the agent prunes while a scrape measures): nothing to count.
                continue;
            };
            self.add(&st);
            let is_dir = rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory;
            if !is_dir || st.st_dev != self.dev {
                continue;
            }
            if depth + 1 > MAX_DEPTH {
                self.usage.complete = false;
                continue;
            }
            let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
            match rustix::fs::openat(fd.as_fd(), name, flags, Mode::empty()) {
                Ok(sub) => self.dir(sub, depth + 1),
                Err(rustix::io::Errno::NOENT) => {}
                Err(_) => self.usage.complete = false,
            }
        }
    }
}

/// The directory gauges and the last time they were measured.
pub(super) struct DiskGauges {
    dirs: Vec<(&'static str, PathBuf)>,
    bytes: Family<DirLabel, Gauge>,
    complete: Family<DirLabel, Gauge>,
    measured: Mutex<Option<Instant>>,
}

impl DiskGauges {
    pub(super) fn new(d: Directories) -> DiskGauges {
        let dirs = [("applied", d.applied), ("images", d.images), ("work", d.work)]
            .into_iter()
            .filter_map(|(label, p)| p.map(|p| (label, p)))
            .collect();
        DiskGauges { dirs, bytes: Family::default(), complete: Family::default(), measured: Mutex::new(None) }
    }

    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "nodeplan_directory_size_bytes",
            "Disk space used under one of the agent's directories",
            self.bytes.clone(),
        );
        registry.register(
            "nodeplan_directory_size_complete",
            "1 when the last measurement of the directory saw all of it, 0 when it stopped at its bound",
            self.complete.clone(),
        );
    }

    /// Measure the directories unless they were measured in the last [`MIN_INTERVAL`], or another
    /// scrape is measuring them right now (that one's values are served). Blocking.
    pub(super) fn refresh(&self) {
        let Ok(mut last) = self.measured.try_lock() else { return };
        if last.is_some_and(|t| t.elapsed() < MIN_INTERVAL) {
            return;
        }
        for (label, dir) in &self.dirs {
            let u = measure(dir, MAX_ENTRIES);
            let l = DirLabel { directory: label };
            self.bytes.get_or_create(&l).set(i64::try_from(u.bytes).unwrap_or(i64::MAX));
            self.complete.get_or_create(&l).set(i64::from(u.complete));
            if !u.complete {
                tracing::debug!(
                    "{}: measured {} entries and stopped; its size is a lower bound",
                    dir.display(),
                    u.entries
                );
            }
        }
        *last = Some(Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn counts_files_and_directories_but_never_follows_links() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("work");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/f"), vec![1u8; 64 * 1024]).unwrap();
        let outside = t.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("big"), vec![1u8; 1024 * 1024]).unwrap();
        symlink(&outside, root.join("link")).unwrap();
        symlink(&root, root.join("a/loop")).unwrap();
        let u = measure(&root, MAX_ENTRIES);
        assert!(u.complete, "{u:?}");
        // root, a, a/b, a/b/f, link, a/loop
        assert_eq!(u.entries, 6, "{u:?}");
        assert!(u.bytes >= 64 * 1024, "{u:?}");
        assert!(u.bytes < 1024 * 1024, "the link's target was counted: {u:?}");
    }

    /// The directory itself is opened under safefs's rule: a link its owner may follow anyway is
    /// followed (an administrator's `/var/lib/rancher` → `/data`), one another user planted to
    /// point elsewhere is not.
    #[test]
    fn the_directory_named_through_a_link_follows_the_symlink_rule() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("real")).unwrap();
        std::fs::write(t.path().join("real/f"), vec![1u8; 64 * 1024]).unwrap();
        symlink(t.path().join("real"), t.path().join("work")).unwrap();
        let u = measure(&t.path().join("work"), MAX_ENTRIES);
        assert!(u.complete && u.entries == 2 && u.bytes >= 64 * 1024, "{u:?}");
        if !rustix::process::geteuid().is_root() {
            eprintln!("not root: the planted link's owner cannot be changed; that half is skipped");
            return;
        }
        // A link owned by nobody, pointing into root's directory: refused, nothing measured.
        let planted = t.path().join("planted");
        symlink(t.path().join("real"), &planted).unwrap();
        let nobody = Some(rustix::fs::Uid::from_raw(65534));
        rustix::fs::chownat(rustix::fs::CWD, &planted, nobody, None, AtFlags::SYMLINK_NOFOLLOW).unwrap();
        let u = measure(&planted, MAX_ENTRIES);
        assert_eq!((u.bytes, u.entries, u.complete), (0, 0, false));
    }

    #[test]
    fn a_missing_directory_uses_nothing_and_a_large_tree_stops_at_the_bound() {
        let t = tempfile::tempdir().unwrap();
        let u = measure(&t.path().join("nope"), MAX_ENTRIES);
        assert_eq!(u, Usage { bytes: 0, entries: 0, complete: true });
        for i in 0..50 {
            std::fs::write(t.path().join(format!("f{i}")), b"x").unwrap();
        }
        let u = measure(t.path(), 10);
        assert_eq!((u.entries, u.complete), (10, false));
        let all = measure(t.path(), MAX_ENTRIES);
        assert_eq!((all.entries, all.complete), (51, true));
    }

    #[test]
    fn depth_is_bounded() {
        let t = tempfile::tempdir().unwrap();
        let mut p = t.path().to_path_buf();
        for _ in 0..(MAX_DEPTH + 3) {
            p.push("d");
        }
        std::fs::create_dir_all(&p).unwrap();
        let u = measure(t.path(), MAX_ENTRIES);
        assert!(!u.complete);
        // The root and one directory at each level from 1 to MAX_DEPTH + 1 (the last is counted, not entered).
        assert_eq!(u.entries, MAX_DEPTH as u64 + 2, "{u:?}");
    }
}
