//! Rancher's own agent on this node. Rancher's `system-agent-upgrader` reinstalls and starts
//! `rancher-system-agent` on every Rancher upgrade; it takes no Lease, so only the node itself can
//! tell that it runs. Remote mode does not act on Secrets while it does (never two agents running
//! one plan): it waits before starting, and stops if one appears while it runs.
//!
//! Before acting, the agent looks at every process ([`running`]); while it acts, only at the
//! cgroup systemd gives the program's unit ([`in_unit`]), and only when that cgroup may have
//! changed ([`started`]): Rancher's installer and upgrader start it as that unit, and a look at
//! every process of the node every few seconds costs what the node runs (a fleet of agents on one
//! host paid for each other's processes).
//!
//! This module only reads `/proc` and the cgroup trees (bounded: the process names, the first
//! argument, a unit's `cgroup.procs`) and watches two directories of each tree for new entries; it
//! never signals anything.

use futures::StreamExt;
use inotify::{EventMask, WatchMask};
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The program system-agent's installer installs.
pub const PROGRAM: &str = "rancher-system-agent";

/// The program looked for: `NODEPLAN_RIVAL_PROGRAM` (where system-agent was installed under
/// another name; the tests use a name of their own), else [`PROGRAM`].
pub fn program() -> String {
    std::env::var("NODEPLAN_RIVAL_PROGRAM")
        .ok()
        .filter(|p| !p.is_empty() && !p.contains('/'))
        .unwrap_or_else(|| PROGRAM.into())
}

/// The pid of a running `program` under `proc_root` (normally `/proc`), if any. Its name
/// (`comm`, cut to 15 bytes by the kernel) and first argument must name the program, it is no
/// zombie, and (since any user can give a process that name and, through a setuid-root program,
/// an effective uid of 0) it must show what only root can arrange ([`root_arranged`]): it runs in
/// the cgroup of the systemd unit `<program>.service` under `system.slice`, or its executable is
/// root's in directories only root can change and its real uid is 0.
pub fn running(proc_root: &Path, program: &str, acts: impl Fn(i32) -> bool) -> Option<i32> {
    let comm_prefix = program.get(..15).unwrap_or(program);
    let entries = std::fs::read_dir(proc_root).ok()?;
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let dir = e.path();
        // /proc/<pid> belongs to the process's effective user.
        let Ok(meta) = std::fs::metadata(&dir) else { continue };
        if std::os::unix::fs::MetadataExt::uid(&meta) != 0 {
            continue;
        }
        let Ok(comm) = read_small(&dir.join("comm")) else { continue };
        if comm.trim_end() != comm_prefix {
            continue;
        }
        let Ok(cmdline) = read_small(&dir.join("cmdline")) else { continue };
        let argv0 = cmdline.split('\0').next().unwrap_or_default();
        if Path::new(argv0).file_name().and_then(|n| n.to_str()) == Some(program)
            && !is_zombie(&dir)
            && root_arranged(&dir, program)
            && acts(pid)
        {
            return Some(pid);
        }
    }
    None
}

/// Where systemd keeps the processes of `program`'s unit (`system.slice/<program>.service`) in
/// each hierarchy it tracks units in (the cgroup2 mount, and v1's `name=systemd` on a hybrid
/// host), from `/proc/self/mountinfo` content. Found once: the mounts do not move.
pub fn unit_cgroups(mountinfo: &str, program: &str) -> Vec<PathBuf> {
    let unit = Path::new("system.slice").join(format!("{program}.service"));
    [
        crate::process::cgroup::find_cgroup2_mount(mountinfo),
        crate::process::cgroup::find_v1_mount(mountinfo, "name=systemd").map(|(_, m)| m),
    ]
    .into_iter()
    .flatten()
    .map(|m| m.join(&unit))
    .collect()
}

/// The pid of a live process in the unit's cgroup, if any: what only root can arrange (systemd,
/// as root, makes the unit's cgroup under `system.slice`; a directory there that root does not own
/// does not count). One read per hierarchy, however many processes the node runs: it is what the
/// agent checks every few seconds while it acts.
pub fn in_unit(proc_root: &Path, cgroups: &[PathBuf], acts: impl Fn(i32) -> bool) -> Option<i32> {
    cgroups
        .iter()
        .filter(|d| {
            std::fs::symlink_metadata(d).is_ok_and(|m| m.is_dir() && std::os::unix::fs::MetadataExt::uid(&m) == 0)
        })
        .flat_map(|d| crate::process::cgroup::procs(d))
        .find(|pid| !is_zombie(&proc_root.join(pid.to_string())) && acts(*pid))
}

/// How often the unit's cgroup is looked at when no notification can say that it changed: while
/// it is there with no live process in it yet (systemd makes it, then moves the process in), and
/// where inotify cannot be had (none left under `fs.inotify.max_user_instances`, or a hierarchy
/// that cannot be watched).
pub const LOOK_PERIOD: Duration = Duration::from_secs(5);

/// The pid of a live process in the unit's cgroup (one of `cgroups`, see [`in_unit`]) once there
/// is one; pending for as long as there is none. An idle agent does not wake for it: the look is
/// made once, then again only when inotify says a directory on the way to a unit's cgroup was made
/// or moved in (the hierarchy's `system.slice`, the unit's own), or events were lost, or a watched
/// directory went away; and every [`LOOK_PERIOD`] while a unit's cgroup is there but empty, or where
/// inotify cannot be had. (A timer every few seconds was most of what an idle agent cost: each
/// wake-up of a process is dear in a virtual machine.)
pub async fn started(proc_root: PathBuf, cgroups: Vec<PathBuf>, acts: impl Fn(i32) -> bool) -> i32 {
    started_with(&cgroups, || in_unit(&proc_root, &cgroups, &acts)).await
}

async fn started_with(cgroups: &[PathBuf], mut look: impl FnMut() -> Option<i32>) -> i32 {
    if cgroups.is_empty() {
        // No hierarchy tracks units here: there is nothing to look at, and no inotify to spend.
        return std::future::pending().await;
    }
    let mut watch = UnitWatch::new(cgroups);
    loop {
        // The watches first, then the look: a cgroup made between the two is seen either way.
        let watching = watch.as_mut().is_some_and(UnitWatch::arm);
        if let Some(pid) = look() {
            return pid;
        }
        let poll = !watching || cgroups.iter().any(|c| c.exists());
        match watch.as_mut() {
            Some(w) if !poll => {
                if !w.changed().await {
                    watch = None;
                }
            }
            Some(w) => {
                if let Ok(false) = tokio::time::timeout(LOOK_PERIOD, w.changed()).await {
                    watch = None;
                }
            }
            None => tokio::time::sleep(LOOK_PERIOD).await,
        }
    }
}

/// Notification of new entries in the directories on the way to each unit's cgroup: inotify for
/// entries made or moved in, on the deepest one that is there (`system.slice`, else the root of the
/// hierarchy). Nothing else is watched: opens, reads and the cgroups' own files wake nothing.
struct UnitWatch {
    events: inotify::EventStream<[u8; 1024]>,
    watches: inotify::Watches,
    /// Each unit cgroup's parent (`system.slice`) and its hierarchy's root.
    ways: Vec<(PathBuf, PathBuf)>,
    /// The names whose making is news: each unit's and each parent's.
    names: Vec<OsString>,
}

impl UnitWatch {
    fn new(cgroups: &[PathBuf]) -> Option<UnitWatch> {
        let mut ways = Vec::new();
        let mut names = Vec::new();
        for c in cgroups {
            let parent = c.parent()?;
            let root = parent.parent()?;
            names.extend([c.file_name()?.to_os_string(), parent.file_name()?.to_os_string()]);
            ways.push((parent.to_path_buf(), root.to_path_buf()));
        }
        let inotify = match inotify::Inotify::init() {
            Ok(i) => i,
            Err(e) => {
                tracing::debug!("no inotify for the rival's unit ({e}): looking every {LOOK_PERIOD:?}");
                return None;
            }
        };
        let watches = inotify.watches();
        let events = inotify.into_event_stream([0u8; 1024]).ok()?;
        Some(UnitWatch { events, watches, ways, names })
    }

    /// Watch the deepest directory that is there on the way to each unit's cgroup; false where
    /// neither can be watched.
    fn arm(&mut self) -> bool {
        let mask = WatchMask::CREATE | WatchMask::MOVED_TO | WatchMask::ONLYDIR;
        let watches = &mut self.watches;
        self.ways.iter().all(|(parent, root)| watches.add(parent, mask).is_ok() || watches.add(root, mask).is_ok())
    }

    /// Until a look is due: a directory of a watched name was made or moved in, events were lost,
    /// or a watched directory went away (the watches must be set again). False once the
    /// notification fails: from then on, only looking every [`LOOK_PERIOD`] tells.
    async fn changed(&mut self) -> bool {
        while let Some(ev) = self.events.next().await {
            let Ok(ev) = ev else { return false };
            let named = ev.name.as_ref().is_some_and(|n| self.names.contains(n));
            if named || ev.mask.intersects(EventMask::Q_OVERFLOW | EventMask::IGNORED) {
                return true;
            }
        }
        false
    }
}

/// What only root can arrange for the process at `dir` (`/proc/<pid>`): it is in the cgroup of
/// the unit `<program>.service` under `system.slice` ([`in_unit_cgroup`]), or its real uid is 0
/// and its executable is trusted ([`trusted_executable`]).
fn root_arranged(dir: &Path, program: &str) -> bool {
    in_unit_cgroup(dir, program) || (real_uid(dir) == Some(0) && trusted_executable(dir))
}

/// Whether `/proc/<pid>/cgroup` puts the process in `/system.slice/<program>.service` (or a
/// cgroup below it): on the cgroup v2 line (`0::PATH`) or the v1 `name=systemd` line. Only root
/// (systemd) makes cgroups there; a user's own unit of that name lives under `user.slice`.
fn in_unit_cgroup(dir: &Path, program: &str) -> bool {
    let Ok(text) = read_small(&dir.join("cgroup")) else { return false };
    let unit = format!("/system.slice/{program}.service");
    text.lines().any(|line| {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            return false;
        };
        let systemd = controllers.is_empty() || controllers.split(',').any(|c| c == "name=systemd");
        systemd && path.strip_prefix(unit.as_str()).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    })
}

/// The real uid of the process: the first field of `Uid:` in `/proc/<pid>/status`.
fn real_uid(dir: &Path) -> Option<u32> {
    let status = read_small(&dir.join("status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Uid:")?.split_whitespace().next()?.parse().ok())
}

/// Whether the process's executable is root's: the file it runs (`/proc/<pid>/exe`, the inode
/// itself) is a regular file owned by root and not writable by group or others, and every
/// directory from `/` down to it (the link's target) is owned by root and not writable by group
/// or others, unless it has the sticky bit (`/tmp`: no one else can replace root's entry there).
/// Links on the way are resolved (the real directories are checked); a target that is no longer
/// there (a replaced binary) is not trusted.
fn trusted_executable(dir: &Path) -> bool {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let exe = dir.join("exe");
    let Ok(file) = std::fs::metadata(&exe) else { return false };
    if !file.is_file() || file.uid() != 0 || file.permissions().mode() & 0o022 != 0 {
        return false;
    }
    let Ok(target) = std::fs::read_link(&exe) else { return false };
    target.is_absolute() && matches!(crate::safefs::changeable_by_others(&target, &[0]), Ok(None))
}

fn is_zombie(dir: &Path) -> bool {
    // The state follows the last ')' of /proc/<pid>/stat.
    read_small(&dir.join("stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('Z')))
        .unwrap_or(true)
}

/// Which plan Secret a running system-agent acts on, as far as the node can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Serves {
    /// The Secret its connection info names (namespace, name).
    Secret(String, String),
    /// Its config turns remote mode off: it acts on no Secret.
    NoSecret,
    /// Its files cannot be read or trusted (the reason): it may act on any.
    Unknown(String),
}

/// What the system-agent of `pid` acts on, from its config (`CATTLE_AGENT_CONFIG` in its
/// environment, else `/etc/rancher/agent/config.yaml`, as system-agent reads it) and the
/// connection info that names. Both must be root's and writable by no one else: a file another
/// user could write would let that user make this agent act beside system-agent.
pub fn serves(proc_root: &Path, pid: i32) -> Serves {
    use serde_yaml_ng::Value;
    const CAP: u64 = 1 << 20;
    let environ = {
        use std::io::Read as _;
        let mut buf = Vec::new();
        let read = std::fs::File::open(proc_root.join(pid.to_string()).join("environ"))
            .and_then(|f| f.take(CAP).read_to_end(&mut buf));
        if let Err(e) = read {
            return Serves::Unknown(format!("its environment cannot be read: {e}"));
        }
        buf
    };
    let config = environ
        .split(|b| *b == 0)
        .find_map(|v| v.strip_prefix(b"CATTLE_AGENT_CONFIG="))
        .filter(|v| !v.is_empty())
        .map_or_else(
            || PathBuf::from(crate::config::DEFAULT_CONFIG_PATH),
            |v| PathBuf::from(OsString::from_vec(v.to_vec())),
        );
    let read = |path: &Path| -> Result<Value, String> {
        let shown = path.display();
        match crate::safefs::read_small_checked(path, CAP, crate::safefs::own_only) {
            Ok(Some(Ok(b))) => serde_yaml_ng::from_slice(&b).map_err(|_| format!("{shown} does not parse")),
            Ok(Some(Err(why))) => Err(format!("{shown} {why}")),
            Ok(None) => Err(format!("{shown} does not exist")),
            Err(e) => Err(format!("{shown}: {e}")),
        }
    };
    let text = |v: &Value, key: &str| v.get(key).and_then(Value::as_str).unwrap_or_default().to_string();
    let config = match read(&config) {
        Ok(c) => c,
        Err(why) => return Serves::Unknown(why),
    };
    if config.get("remoteEnabled").and_then(Value::as_bool) != Some(true) {
        return Serves::NoSecret;
    }
    let info = match read(Path::new(&text(&config, "connectionInfoFile"))) {
        Ok(i) => i,
        Err(why) => return Serves::Unknown(why),
    };
    match (text(&info, "namespace"), text(&info, "secretName")) {
        (ns, name) if !ns.is_empty() && !name.is_empty() => Serves::Secret(ns, name),
        _ => Serves::Unknown("its connection info names no namespace and secretName".into()),
    }
}

/// The first 4 KiB of a /proc file (names and command lines; lossy).
fn read_small(path: &Path) -> std::io::Result<String> {
    use std::io::Read as _;
    let mut buf = Vec::with_capacity(256);
    std::fs::File::open(path)?.take(4096).read_to_end(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

    const AGENT: &str = "/usr/local/bin/rancher-system-agent\0sentinel\0";
    const V2_UNIT: &str = "0::/system.slice/rancher-system-agent.service\n";

    /// One fake `/proc/<pid>`: its name, command line, state, `cgroup` text, real uid and the
    /// target of its `exe` link.
    struct Fake<'a> {
        pid: &'a str,
        comm: &'a str,
        cmdline: &'a str,
        state: &'a str,
        cgroup: &'a str,
        real_uid: u32,
        exe: PathBuf,
    }

    fn fake<'a>(pid: &'a str, cgroup: &'a str, real_uid: u32, exe: &Path) -> Fake<'a> {
        Fake { pid, comm: "rancher-system-", cmdline: AGENT, state: "S", cgroup, real_uid, exe: exe.to_path_buf() }
    }

    fn fake_proc(entries: &[Fake<'_>]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for f in entries {
            let p = d.path().join(f.pid);
            std::fs::create_dir(&p).unwrap();
            std::fs::write(p.join("comm"), format!("{}\n", f.comm)).unwrap();
            std::fs::write(p.join("cmdline"), f.cmdline).unwrap();
            std::fs::write(p.join("stat"), format!("{} ({}) {} 1 2 3", f.pid, f.comm, f.state)).unwrap();
            std::fs::write(p.join("cgroup"), f.cgroup).unwrap();
            let uid = f.real_uid;
            std::fs::write(p.join("status"), format!("Name:\t{}\nUid:\t{uid}\t0\t0\t0\nGid:\t0\t0\t0\t0\n", f.comm))
                .unwrap();
            std::os::unix::fs::symlink(&f.exe, p.join("exe")).unwrap();
        }
        std::fs::create_dir(d.path().join("self")).unwrap();
        d
    }

    /// Which Secret a system-agent serves comes from its own config and connection info, read
    /// only when root's and writable by no one else; anything else cannot be told.
    #[test]
    fn a_system_agent_serves_the_secret_its_files_name() {
        let d = tempfile::tempdir().unwrap();
        let at = |n: &str| d.path().join(n);
        std::fs::write(at("info.json"), r#"{"kubeConfig": "x", "namespace": "fleet", "secretName": "m-1"}"#).unwrap();
        std::fs::write(at("nameless.json"), r#"{"kubeConfig": "x"}"#).unwrap();
        let config = |name: &str, body: String| {
            std::fs::write(at(name), body).unwrap();
            at(name)
        };
        let remote = |info: &str| format!("remoteEnabled: true\nconnectionInfoFile: {}\n", at(info).display());
        let good = config("good.yaml", remote("info.json"));
        let off =
            config("off.yaml", format!("remoteEnabled: false\nconnectionInfoFile: {}\n", at("info.json").display()));
        let nameless = config("nameless.yaml", remote("nameless.json"));
        let missing = config("missing.yaml", remote("absent.json"));
        let theirs = config("theirs.yaml", remote("info.json"));
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o664)).unwrap();
        let bad = config("bad.yaml", "remoteEnabled: [".into());
        let serving = |config: Option<&Path>| {
            let proc_root = tempfile::tempdir().unwrap();
            std::fs::create_dir(proc_root.path().join("9")).unwrap();
            let env = config.map_or(String::new(), |c| format!("PATH=/bin\0CATTLE_AGENT_CONFIG={}\0", c.display()));
            std::fs::write(proc_root.path().join("9/environ"), env).unwrap();
            serves(proc_root.path(), 9)
        };
        assert_eq!(serving(Some(&good)), Serves::Secret("fleet".into(), "m-1".into()));
        assert_eq!(serving(Some(&off)), Serves::NoSecret);
        let unknown = |s: Serves| match s {
            Serves::Unknown(why) => why,
            other => panic!("{other:?}"),
        };
        assert!(unknown(serving(Some(&nameless))).contains("names no namespace"));
        assert!(unknown(serving(Some(&missing))).contains("absent.json does not exist"));
        assert!(unknown(serving(Some(&theirs))).contains("writable by group or others"));
        assert!(unknown(serving(Some(&bad))).contains("bad.yaml does not parse"));
        assert!(unknown(serves(Path::new("/nonexistent/proc"), 9)).contains("its environment cannot be read"));
        // Without CATTLE_AGENT_CONFIG, system-agent's default path (whatever this host has there).
        let default = serving(None);
        if !Path::new(crate::config::DEFAULT_CONFIG_PATH).exists() {
            assert!(unknown(default).contains(crate::config::DEFAULT_CONFIG_PATH));
        }
    }

    /// The unit's cgroup in each hierarchy systemd tracks units in; a live process listed there
    /// is the unit's (zombies, and a directory root does not own, are not).
    #[test]
    fn finds_the_unit_by_its_cgroup() {
        let mi = "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n\
                  40 31 0:37 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,name=systemd\n\
                  41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n\
                  42 31 0:39 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        assert_eq!(
            unit_cgroups(mi, PROGRAM),
            [
                PathBuf::from("/sys/fs/cgroup/unified/system.slice/rancher-system-agent.service"),
                PathBuf::from("/sys/fs/cgroup/systemd/system.slice/rancher-system-agent.service"),
            ]
        );
        let v2 = "30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(unit_cgroups(v2, "rsa"), [PathBuf::from("/sys/fs/cgroup/system.slice/rsa.service")]);
        assert!(unit_cgroups("", PROGRAM).is_empty(), "no cgroups: nothing to look at");

        let none = Path::new("/nonexistent");
        let proc_root = fake_proc(&[fake("7", "", 0, none), Fake { state: "Z", ..fake("8", "", 0, none) }]);
        let cg = tempfile::tempdir().unwrap();
        let (a, b) = (cg.path().join("a"), cg.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        std::fs::write(a.join("cgroup.procs"), "").unwrap();
        let dirs = [a.clone(), b.clone(), cg.path().join("missing")];
        assert_eq!(in_unit(proc_root.path(), &dirs, |_| true), None, "an empty unit");
        std::fs::write(b.join("cgroup.procs"), "8\n").unwrap();
        assert_eq!(in_unit(proc_root.path(), &dirs, |_| true), None, "a zombie");
        std::fs::write(b.join("cgroup.procs"), "8\n7\n").unwrap();
        assert_eq!(in_unit(proc_root.path(), &dirs, |_| true), Some(7));
        std::os::unix::fs::chown(&b, Some(1000), Some(1000)).unwrap();
        assert_eq!(in_unit(proc_root.path(), &dirs, |_| true), None, "a directory another user made");
    }

    /// While the agent acts it looks at the unit's cgroup once, then only when inotify says a
    /// directory on the way was made (or moved in), and every few seconds only while the unit's
    /// cgroup is there but empty: 60 s of an idle node wake it for nothing. Paused clock; the
    /// directories are a stand-in hierarchy in a temporary directory.
    #[tokio::test(start_paused = true)]
    async fn a_unit_is_looked_at_only_when_its_cgroup_may_have_changed() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let none = Path::new("/nonexistent");
        let proc_root = fake_proc(&[fake("7", "", 0, none)]);
        let root = tempfile::tempdir().unwrap();
        let slice = root.path().join("system.slice");
        let unit = slice.join("rsa.service");
        let looks = Arc::new(AtomicUsize::new(0));
        let (l, p, u) = (looks.clone(), proc_root.path().to_path_buf(), unit.clone());
        let task = tokio::spawn(async move {
            let cgroups = [u];
            started_with(&cgroups, || {
                l.fetch_add(1, Ordering::SeqCst);
                in_unit(&p, &cgroups, |_| true)
            })
            .await
        });
        let minute = || tokio::time::sleep(Duration::from_secs(60));
        let count = || looks.load(Ordering::SeqCst);
        minute().await;
        assert_eq!(count(), 1, "no system.slice yet: one look, then nothing to wake for");
        std::fs::create_dir(&slice).unwrap();
        minute().await;
        assert_eq!(count(), 2, "system.slice made: one look");
        std::fs::create_dir(&unit).unwrap();
        minute().await;
        let polled = count();
        assert!(polled >= 12, "the unit's cgroup, empty: a look every {LOOK_PERIOD:?} ({polled})");
        std::fs::remove_dir(&unit).unwrap();
        minute().await;
        let after = count();
        minute().await;
        assert_eq!(count(), after, "the unit's cgroup gone: nothing to wake for again");
        assert!(!task.is_finished());
        let made = root.path().join("rsa.service");
        std::fs::create_dir(&made).unwrap();
        std::fs::write(made.join("cgroup.procs"), "7\n").unwrap();
        std::fs::rename(&made, &unit).unwrap();
        let pid = tokio::time::timeout(Duration::from_secs(1), task).await.expect("seen when it is moved in");
        assert_eq!(pid.unwrap(), 7);

        let mut nothing = 0;
        let never = started_with(&[], || {
            nothing += 1;
            None
        });
        assert!(tokio::time::timeout(Duration::from_secs(60), never).await.is_err());
        assert_eq!(nothing, 0, "no hierarchy tracks units: nothing to look at, ever");
    }

    /// Executables in directories of every kind: (directory mode, directory owner, file mode,
    /// file owner) → the file's path.
    fn executable(root: &Path, name: &str, dir_mode: u32, dir_uid: u32, mode: u32, uid: u32) -> PathBuf {
        let dir = root.join(format!("{name}-dir"));
        std::fs::create_dir(&dir).unwrap();
        let file = dir.join("rancher-system-agent");
        std::fs::write(&file, b"#!/bin/true\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        std::os::unix::fs::chown(&file, Some(uid), None).unwrap();
        std::os::unix::fs::chown(&dir, Some(dir_uid), None).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(dir_mode)).unwrap();
        file
    }

    #[test]
    fn finds_only_a_live_rancher_system_agent() {
        let bins = tempfile::tempdir().unwrap();
        let b = bins.path();
        let roots = executable(b, "root", 0o755, 0, 0o755, 0);
        let sticky = executable(b, "sticky", 0o1777, 0, 0o755, 0);
        let theirs_dir = executable(b, "their-dir", 0o755, 1000, 0o755, 0);
        let open_dir = executable(b, "open-dir", 0o777, 0, 0o755, 0);
        let theirs_file = executable(b, "their-file", 0o755, 0, 0o755, 1000);
        let group_writable = executable(b, "group-writable", 0o755, 0, 0o775, 0);
        let gone = b.join("gone/rancher-system-agent");
        let v1 = "12:pids:/system.slice/rancher-system-agent.service\n1:name=systemd:/system.slice/rancher-system-agent.service\n0::/\n";
        let user_unit = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/rancher-system-agent.service\n";
        let session = "0::/user.slice/user-1000.slice/session-3.scope\n";
        let cases: Vec<(&str, Vec<Fake<'_>>, Option<i32>)> = vec![
            ("none", vec![Fake { comm: "systemd", cmdline: "/sbin/init\0", ..fake("1", V2_UNIT, 0, &roots) }], None),
            ("in its unit's cgroup (v2)", vec![fake("7", V2_UNIT, 1000, &gone)], Some(7)),
            ("in its unit's cgroup (v1 name=systemd)", vec![fake("7", v1, 1000, &gone)], Some(7)),
            (
                "below its unit's cgroup",
                vec![fake("7", "0::/system.slice/rancher-system-agent.service/sub\n", 1000, &gone)],
                Some(7),
            ),
            ("a user's unit of that name", vec![fake("7", user_unit, 1000, &gone)], None),
            (
                "a look-alike unit",
                vec![fake("7", "0::/system.slice/rancher-system-agent.service-x\n", 1000, &gone)],
                None,
            ),
            (
                "the unit on a v1 controller only",
                vec![fake("7", "12:pids:/system.slice/rancher-system-agent.service\n", 1000, &gone)],
                None,
            ),
            ("root's executable, real uid 0", vec![fake("8", session, 0, &roots)], Some(8)),
            ("root's executable below a sticky directory", vec![fake("8", session, 0, &sticky)], Some(8)),
            ("a setuid-root program run by a user (real uid 1000)", vec![fake("9", session, 1000, &roots)], None),
            ("an executable in another user's directory", vec![fake("9", session, 0, &theirs_dir)], None),
            ("an executable in a directory others can write", vec![fake("9", session, 0, &open_dir)], None),
            ("another user's executable", vec![fake("9", session, 0, &theirs_file)], None),
            ("a group-writable executable", vec![fake("9", session, 0, &group_writable)], None),
            ("an executable that is gone", vec![fake("9", session, 0, &gone)], None),
            ("a zombie", vec![Fake { state: "Z", ..fake("8", V2_UNIT, 0, &roots) }], None),
            (
                "a look-alike name",
                vec![Fake { cmdline: "/usr/bin/rancher-system-other\0", ..fake("9", V2_UNIT, 0, &roots) }],
                None,
            ),
            (
                "another program named so",
                vec![Fake { comm: "bash", cmdline: "rancher-system-agent\0", ..fake("10", V2_UNIT, 0, &roots) }],
                None,
            ),
        ];
        for (what, entries, want) in cases {
            assert_eq!(running(fake_proc(&entries).path(), PROGRAM, |_| true), want, "{what}");
        }
        assert_eq!(running(Path::new("/nonexistent/proc"), PROGRAM, |_| true), None);
        let short = fake_proc(&[Fake {
            comm: "rsa",
            cmdline: "/x/rsa\0",
            ..fake("11", "0::/system.slice/rsa.service\n", 0, &gone)
        }]);
        assert_eq!(running(short.path(), "rsa", |_| true), Some(11), "a name shorter than 15 bytes");
        // A process whose effective user is another is no agent of the node's.
        let theirs = fake_proc(&[fake("12", V2_UNIT, 0, &roots)]);
        std::os::unix::fs::chown(theirs.path().join("12"), Some(1000), Some(1000)).unwrap();
        assert_eq!(running(theirs.path(), PROGRAM, |_| true), None);
    }
}
