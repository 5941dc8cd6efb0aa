//! A thin cgroup layer: find the hierarchy, create one leaf per run, have the child enter it (born
//! in it on v2, joining it before exec on v1), ask whether it is populated, kill it, remove it.
//!
//! cgroup v2 first: the leaf is killed atomically with `cgroup.kill`, so nothing in it escapes. No
//! controllers are enabled. Where no cgroup v2 hierarchy is usable (cgroup v1 hosts such as RHEL
//! 8), the v1 `freezer` hierarchy: the leaf is frozen (`freezer.state` = `FROZEN`, waited for),
//! every process listed in it is sent SIGKILL while none of them can fork, then it is thawed, so
//! nothing escapes there either. Leaves live under `<hierarchy><own cgroup>/nodeplan` (or the
//! configured directory) and are named by the run's marker.

use super::CgroupMode;
use rustix::fd::OwnedFd;
use std::io;
use std::path::{Path, PathBuf};

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

/// The root and mount point of the cgroup v1 hierarchy that carries `controller`, from
/// `/proc/self/mountinfo` content.
pub fn find_v1_mount(mountinfo: &str, controller: &str) -> Option<(String, PathBuf)> {
    mountinfo.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        let mut post = post.split_whitespace();
        if post.next()? != "cgroup" || !post.nth(1)?.split(',').any(|o| o == controller) {
            return None;
        }
        let mut pre = pre.split_whitespace().skip(3);
        let root = unescape(pre.next()?);
        Some((root, PathBuf::from(unescape(pre.next()?))))
    })
}

/// This process's cgroup in the v1 hierarchy of `controller` (`N:a,b:<path>` line) from
/// `/proc/self/cgroup` content.
pub fn own_v1_cgroup(proc_cgroup: &str, controller: &str) -> Option<String> {
    proc_cgroup.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        ctrl.split(',').any(|c| c == controller).then(|| path.trim().to_string())
    })
}

/// The v2 path (`0::<path>` line) from `/proc/self/cgroup` content.
pub fn own_cgroup(proc_cgroup: &str) -> Option<String> {
    proc_cgroup.lines().find_map(|l| l.strip_prefix("0::").map(|p| p.trim().to_string()))
}

/// Which kind of hierarchy leaves are made in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// cgroup v2: `cgroup.events`, `cgroup.kill`, born in the leaf with clone3.
    V2,
    /// A cgroup v1 hierarchy with the freezer controller.
    V1Freezer,
}

impl Backend {
    fn magic(self) -> u64 {
        match self {
            Backend::V2 => CGROUP2_SUPER_MAGIC,
            Backend::V1Freezer => CGROUP_SUPER_MAGIC,
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::V2 => "cgroup v2",
            Backend::V1Freezer => "cgroup v1 freezer",
        })
    }
}

/// One run's cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leaf {
    pub dir: PathBuf,
    pub backend: Backend,
}

/// A writable directory under which one leaf cgroup per run is created.
#[derive(Debug, Clone)]
pub struct CgroupRoot {
    pub dir: PathBuf,
    pub backend: Backend,
}

impl CgroupRoot {
    /// Resolve and create the root; an error says why cgroups cannot be used.
    pub fn discover(mode: &CgroupMode) -> Result<Option<CgroupRoot>, String> {
        match mode {
            CgroupMode::Off => Ok(None),
            CgroupMode::Root(d) => CgroupRoot::at(d.clone()).map(Some),
            CgroupMode::V1 => CgroupRoot::discover_v1().map(Some),
            CgroupMode::Auto => match CgroupRoot::discover_v2() {
                Ok(r) => Ok(Some(r)),
                Err(v2) => match CgroupRoot::discover_v1() {
                    Ok(r) => {
                        tracing::info!(
                            "cgroup v2 unavailable ({v2}); using the cgroup v1 freezer hierarchy at {}",
                            r.dir.display()
                        );
                        Ok(Some(r))
                    }
                    Err(v1) => Err(format!("{v2}; {v1}")),
                },
            },
        }
    }

    fn discover_v2() -> Result<CgroupRoot, String> {
        let mi = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("reading mountinfo: {e}"))?;
        let mount = find_cgroup2_mount(&mi).ok_or("no cgroup2 filesystem is mounted")?;
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .ok()
            .and_then(|c| own_cgroup(&c))
            .unwrap_or_else(|| "/".into());
        let root = CgroupRoot::at(mount.join(own.trim_start_matches('/')).join("nodeplan"))?;
        if root.backend != Backend::V2 {
            return Err(format!("{} is not a cgroup2 directory", root.dir.display()));
        }
        Ok(root)
    }

    fn discover_v1() -> Result<CgroupRoot, String> {
        let mi = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("reading mountinfo: {e}"))?;
        let (mount_root, mount) = find_v1_mount(&mi, "freezer").ok_or("no cgroup v1 freezer hierarchy is mounted")?;
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .ok()
            .and_then(|c| own_v1_cgroup(&c, "freezer"))
            .unwrap_or_else(|| "/".into());
        // A mount of a sub-cgroup (containers) shows the cgroups below its root.
        let rel = match own.strip_prefix(mount_root.trim_end_matches('/')) {
            Some(r) if r.is_empty() || r.starts_with('/') => r,
            _ => own.as_str(),
        };
        let root = CgroupRoot::at(mount.join(rel.trim_start_matches('/')).join("nodeplan"))?;
        if root.backend != Backend::V1Freezer {
            return Err(format!("{} is not in a cgroup v1 freezer hierarchy", root.dir.display()));
        }
        Ok(root)
    }

    /// `dir` (created if needed) as a root: inside a cgroup2 mount or a v1 freezer hierarchy,
    /// told apart by the filesystem type.
    fn at(dir: PathBuf) -> Result<CgroupRoot, String> {
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create cgroup root {}: {e}", dir.display()))?;
        let backend = match fs_magic(&dir) {
            Ok(CGROUP2_SUPER_MAGIC) if dir.join("cgroup.procs").exists() => Backend::V2,
            Ok(CGROUP_SUPER_MAGIC) if dir.join("freezer.state").exists() => Backend::V1Freezer,
            Ok(CGROUP_SUPER_MAGIC) => {
                return Err(format!("{} is in a cgroup v1 hierarchy without the freezer controller", dir.display()));
            }
            _ => {
                return Err(format!(
                    "{} is not a cgroup2 directory or in a cgroup v1 freezer hierarchy",
                    dir.display()
                ));
            }
        };
        Ok(CgroupRoot { dir, backend })
    }

    /// The leaf at `dir`, of this root's kind.
    pub fn leaf(&self, dir: PathBuf) -> Leaf {
        Leaf { dir, backend: self.backend }
    }

    /// Check the cgroup a PID record names before anything in it is signalled: it must be exactly
    /// this root's leaf for `marker` (canonical paths compared) on a cgroup filesystem of this
    /// root's kind (cgroup2, or cgroup v1 for a v1 root). `Ok(Some(leaf))` is the verified leaf, `Ok(None)` means the record's own leaf
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
            Ok(m) if m == self.backend.magic() => Ok(Some(leaf)),
            Ok(m) => refuse(format!("which is not on a {} filesystem (statfs type {m:#x})", self.backend)),
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
/// `f_type` of a cgroup v1 filesystem.
pub const CGROUP_SUPER_MAGIC: u64 = 0x0027_e0eb;

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

/// Whether processes are left in the leaf: `populated` from `cgroup.events` (v2), or a non-empty
/// `cgroup.procs` (v1, which lists no zombies). A cgroup that no longer exists is not populated.
pub fn populated(leaf: &Leaf) -> bool {
    match leaf.backend {
        Backend::V2 => match std::fs::read_to_string(leaf.dir.join("cgroup.events")) {
            Ok(s) => s.lines().any(|l| l == "populated 1"),
            Err(_) => false,
        },
        Backend::V1Freezer => !procs(&leaf.dir).is_empty(),
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

/// How long [`freeze`] waits for a v1 leaf to reach `FROZEN` (a task stuck in the kernel can hold
/// it in `FREEZING`); the kill goes ahead regardless, and the ladder checks what is left.
const FREEZE_LIMIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Freeze a v1 freezer leaf and wait until the kernel reports it `FROZEN` (true), or give up after
/// [`FREEZE_LIMIT`] (false). A leaf that is gone is frozen as far as anyone can tell.
pub fn freeze(dir: &Path) -> io::Result<bool> {
    let state = dir.join("freezer.state");
    match std::fs::write(&state, "FROZEN") {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(true),
        r => r?,
    }
    // freezer.state has no change notification: look again every millisecond, briefly.
    let deadline = std::time::Instant::now() + FREEZE_LIMIT;
    loop {
        match std::fs::read_to_string(&state) {
            Ok(s) if s.trim() == "FROZEN" => return Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(true),
            _ => {}
        }
        if std::time::Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Thaw a v1 freezer leaf (a SIGKILL sent while frozen takes effect now).
pub fn thaw(dir: &Path) -> io::Result<()> {
    match std::fs::write(dir.join("freezer.state"), "THAWED") {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
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
        let Some((pid, start)) = super::record::marker_owner(&name) else { continue };
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
    fn finds_the_v1_freezer_hierarchy_and_our_place_in_it() {
        let mi = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
                  32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n\
                  37 31 0:34 /lxc/c1 /sys/fs/cgroup/free\\040zer rw,relatime - cgroup cgroup rw,freezer\n\
                  41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        assert_eq!(find_v1_mount(mi, "freezer"), Some(("/lxc/c1".into(), PathBuf::from("/sys/fs/cgroup/free zer"))));
        assert_eq!(find_v1_mount(mi, "cpuacct").map(|m| m.1), Some(PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")));
        assert_eq!(find_v1_mount(mi, "pids"), None);
        assert_eq!(find_v1_mount(mi, "cgroup2"), None, "the v2 mount is not a v1 hierarchy");
        let pc = "9:name=systemd:/\n6:freezer:/lxc/c1/app\n2:cpu,cpuacct:/x\n0::/\n";
        assert_eq!(own_v1_cgroup(pc, "freezer").as_deref(), Some("/lxc/c1/app"));
        assert_eq!(own_v1_cgroup(pc, "cpuacct").as_deref(), Some("/x"));
        assert_eq!(own_v1_cgroup(pc, "pids"), None);
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
