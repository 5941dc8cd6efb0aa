//! A thin cgroup v2 layer: find the cgroup2 mount, create one leaf per run, join it before exec,
//! ask whether it is populated, kill it, remove it. No controllers are enabled.

use rustix::fd::OwnedFd;
use std::io;
use std::path::{Path, PathBuf};

/// Where runs' cgroups go.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CgroupMode {
    /// `<cgroup2 mount><own cgroup>/nodeplan`, discovered from /proc/self/{mountinfo,cgroup}.
    #[default]
    Auto,
    /// This directory, which must be inside a cgroup2 mount.
    Root(PathBuf),
    /// Process groups only.
    Off,
}

/// The cgroup2 mount point from `/proc/self/mountinfo` content.
pub fn find_cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        if post.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        Some(PathBuf::from(unescape(pre.split_whitespace().nth(4)?)))
    })
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The v2 path (`0::<path>` line) from `/proc/self/cgroup` content.
pub fn own_cgroup(proc_cgroup: &str) -> Option<String> {
    proc_cgroup.lines().find_map(|l| l.strip_prefix("0::").map(|p| p.trim().to_string()))
}

/// A writable directory under which one leaf cgroup per run is created.
#[derive(Debug, Clone)]
pub struct CgroupRoot {
    pub dir: PathBuf,
}

impl CgroupRoot {
    /// Resolve and create the root; an error says why cgroups cannot be used.
    pub fn discover(mode: &CgroupMode) -> Result<Option<CgroupRoot>, String> {
        let dir = match mode {
            CgroupMode::Off => return Ok(None),
            CgroupMode::Root(d) => d.clone(),
            CgroupMode::Auto => {
                let mi =
                    std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("reading mountinfo: {e}"))?;
                let mount = find_cgroup2_mount(&mi).ok_or("no cgroup2 filesystem is mounted")?;
                let own = std::fs::read_to_string("/proc/self/cgroup")
                    .ok()
                    .and_then(|c| own_cgroup(&c))
                    .unwrap_or_else(|| "/".into());
                mount.join(own.trim_start_matches('/')).join("nodeplan")
            }
        };
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create cgroup root {}: {e}", dir.display()))?;
        if fs_magic(&dir).ok() != Some(CGROUP2_SUPER_MAGIC) || !dir.join("cgroup.procs").exists() {
            return Err(format!("{} is not a cgroup2 directory", dir.display()));
        }
        Ok(Some(CgroupRoot { dir }))
    }

    /// Check the cgroup a PID record names before anything in it is signalled: it must be exactly
    /// this root's leaf for `marker` (canonical paths compared) on a cgroup filesystem of this
    /// root's kind. `Ok(Some(leaf))` is the verified leaf, `Ok(None)` means the record's own leaf
    /// no longer exists; `Err` says why the record is refused.
    pub fn verify_leaf(&self, claimed: &Path, marker: &str) -> Result<Option<PathBuf>, String> {
        let refuse = |why: String| Err(format!("names cgroup {}, {why}", claimed.display()));
        let root = std::fs::canonicalize(&self.dir)
            .map_err(|e| format!("cannot resolve the cgroup root {}: {e}", self.dir.display()))?;
        let expected = root.join(marker);
        if marker.contains('/') || marker.starts_with('.') || expected.parent() != Some(root.as_path()) {
            return refuse(format!("but its marker {marker:?} is not a plain name"));
        }
        let leaf = match std::fs::canonicalize(claimed) {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Gone already: fine for the record's own leaf, which the sweep may have removed.
                let own = claimed.parent().and_then(|p| std::fs::canonicalize(p).ok()).as_deref() == Some(&root)
                    && claimed.file_name() == expected.file_name();
                return if own { Ok(None) } else { refuse(format!("not {}", expected.display())) };
            }
            Err(e) => return refuse(format!("which cannot be resolved: {e}")),
        };
        if leaf != expected {
            return refuse(format!("not this agent's leaf {}", expected.display()));
        }
        match fs_magic(&leaf) {
            Ok(m) if m == CGROUP2_SUPER_MAGIC => Ok(Some(leaf)),
            Ok(m) => refuse(format!("which is not on a cgroup2 filesystem (statfs type {m:#x})")),
            Err(e) => refuse(format!("which cannot be examined: {e}")),
        }
    }

    /// Create the leaf `name`.
    pub fn create_leaf(&self, name: &str) -> io::Result<PathBuf> {
        let dir = self.dir.join(name);
        std::fs::create_dir(&dir)?;
        Ok(dir)
    }
}

/// `f_type` of a cgroup v2 filesystem (`statfs`).
pub const CGROUP2_SUPER_MAGIC: u64 = 0x6367_7270;

/// The filesystem type (`statfs` `f_type`) of `path`.
pub fn fs_magic(path: &Path) -> io::Result<u64> {
    Ok(rustix::fs::statfs(path)?.f_type as u64)
}

/// Open a leaf's `cgroup.procs` for a child to join before exec (where clone3 cannot start it
/// in the leaf).
pub fn open_procs(dir: &Path) -> io::Result<OwnedFd> {
    Ok(rustix::fs::open(
        dir.join("cgroup.procs"),
        rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?)
}

/// `populated` from `cgroup.events`; a cgroup that no longer exists is not populated.
pub fn populated(dir: &Path) -> bool {
    match std::fs::read_to_string(dir.join("cgroup.events")) {
        Ok(s) => s.lines().any(|l| l == "populated 1"),
        Err(_) => false,
    }
}

/// The pids listed in `cgroup.procs` (may include exiting tasks).
pub fn procs(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// SIGKILL every process in the cgroup atomically via `cgroup.kill` (Linux 5.14+). `Ok(false)`
/// when the kernel has no `cgroup.kill`.
pub fn kill(dir: &Path) -> io::Result<bool> {
    let f = dir.join("cgroup.kill");
    if !f.exists() {
        return Ok(false);
    }
    std::fs::write(f, "1")?;
    Ok(true)
}

/// Remove the empty leaves that agents no longer running left under `root` (`np<pid>.<start>-…`
/// where no process `<pid>` started at `<start>` exists; `np<pid>-…` of earlier versions where
/// `<pid>` is gone): the cgroups of daemons their runs started, once those ended. Leaves of this
/// process and of live agents are not touched (one may be about to receive its process), and a
/// populated leaf cannot be removed at all.
pub fn sweep_dead_agents(root: &Path) {
    let Ok(rd) = std::fs::read_dir(root) else { return };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(head) = name.strip_prefix("np").and_then(|r| r.split('-').next()) else { continue };
        let (pid, start) = match head.split_once('.') {
            Some((p, s)) => (p.parse::<i32>().ok(), u64::from_str_radix(s, 16).ok()),
            None => (head.parse::<i32>().ok(), None),
        };
        let Some(pid) = pid else { continue };
        let alive = pid as u32 == std::process::id()
            || match start {
                Some(st) => {
                    super::procfs::ProcHandle::open(pid).and_then(|h| h.stat()).is_ok_and(|s| s.start_time == st)
                }
                None => Path::new(&format!("/proc/{pid}")).exists(),
            };
        if !alive && e.path().is_dir() {
            let _ = std::fs::remove_dir(e.path());
        }
    }
}

/// Remove an empty leaf; a populated or missing one is left alone.
pub fn remove(dir: &Path) {
    let _ = std::fs::remove_dir(dir);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_cgroup2_mount_wherever_it_is() {
        let mi = "24 1 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        assert_eq!(find_cgroup2_mount(mi), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        let escaped = "41 31 0:38 / /mnt/my\\040cg rw shared:1 - cgroup2 none rw\n";
        assert_eq!(find_cgroup2_mount(escaped), Some(PathBuf::from("/mnt/my cg")));
        assert_eq!(find_cgroup2_mount("24 1 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"), None);
    }

    #[test]
    fn the_sweep_removes_only_empty_leaves_of_agents_that_are_gone() {
        let root = tempfile::tempdir().unwrap();
        let me = std::process::id();
        // pid 1 is alive, but not the agent that started at tick 1 (its own start time is not 1).
        let one = super::super::procfs::ProcHandle::open(1).unwrap().stat().unwrap().start_time;
        let names = [
            "np999999999-1-aa",
            "np999999998-2-bb",
            &format!("np{me}-3-cc"),
            "np1-4-dd",
            "other",
            &format!("np1.{:x}-5-ee", one + 1),
            &format!("np1.{one:x}-6-ff"),
        ];
        for n in names {
            std::fs::create_dir(root.path().join(n)).unwrap();
        }
        // A non-empty leaf cannot be removed (a populated cgroup refuses rmdir the same way).
        std::fs::write(root.path().join("np999999998-2-bb/x"), "").unwrap();
        sweep_dead_agents(root.path());
        let mut left: Vec<String> =
            std::fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
        left.sort();
        let mut want = vec![
            "np999999998-2-bb".to_string(),
            format!("np{me}-3-cc"),
            "np1-4-dd".into(),
            "other".into(),
            format!("np1.{one:x}-6-ff"),
        ];
        want.sort();
        assert_eq!(left, want);
    }

    #[test]
    fn own_cgroup_reads_the_v2_line() {
        assert_eq!(
            own_cgroup("9:name=systemd:/\n0::/system.slice/x.service\n").as_deref(),
            Some("/system.slice/x.service")
        );
        assert_eq!(own_cgroup("1:cpu:/\n"), None);
    }
}
