//! Rancher's own agent on this node. Rancher's `system-agent-upgrader` reinstalls and starts
//! `rancher-system-agent` on every Rancher upgrade; it takes no Lease, so only the node itself can
//! tell that it runs. Remote mode does not act on Secrets while it does (never two agents running
//! one plan): it waits before starting, and stops if one appears while it runs.
//!
//! Before acting, the agent looks at every process ([`running`]); while it acts, every few
//! seconds, only at the cgroup systemd gives the program's unit ([`in_unit`]): Rancher's installer
//! and upgrader start it as that unit, and a look at every process of the node every few seconds
//! costs what the node runs (a fleet of agents on one host paid for each other's processes).
//!
//! This module only reads `/proc` and the cgroup trees (bounded: the process names, the first
//! argument, a unit's `cgroup.procs`); it never signals anything.

use std::path::{Path, PathBuf};

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

/// The pid of a running `program` under `proc_root` (normally `/proc`), if any: a root process
/// whose name (`comm`, cut to 15 bytes by the kernel) is the program's and whose first argument
/// names it. Zombies do not count, nor does a process of another user (any user can start a
/// program of that name; only root's agent acts on the node).
pub fn running(proc_root: &Path, program: &str) -> Option<i32> {
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
        if Path::new(argv0).file_name().and_then(|n| n.to_str()) == Some(program) && !is_zombie(&dir) {
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
pub fn in_unit(proc_root: &Path, cgroups: &[PathBuf]) -> Option<i32> {
    cgroups
        .iter()
        .filter(|d| {
            std::fs::symlink_metadata(d).is_ok_and(|m| m.is_dir() && std::os::unix::fs::MetadataExt::uid(&m) == 0)
        })
        .flat_map(|d| crate::process::cgroup::procs(d))
        .find(|pid| !is_zombie(&proc_root.join(pid.to_string())))
}

fn is_zombie(dir: &Path) -> bool {
    // The state follows the last ')' of /proc/<pid>/stat.
    read_small(&dir.join("stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('Z')))
        .unwrap_or(true)
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

    fn fake_proc(entries: &[(&str, &str, &str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for (pid, comm, cmdline, state) in entries {
            let p = d.path().join(pid);
            std::fs::create_dir(&p).unwrap();
            std::fs::write(p.join("comm"), format!("{comm}\n")).unwrap();
            std::fs::write(p.join("cmdline"), cmdline).unwrap();
            std::fs::write(p.join("stat"), format!("{pid} ({comm}) {state} 1 2 3")).unwrap();
        }
        std::fs::create_dir(d.path().join("self")).unwrap();
        d
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

        let proc_root = fake_proc(&[("7", "rancher-system-", "/x\0", "S"), ("8", "rancher-system-", "/x\0", "Z")]);
        let cg = tempfile::tempdir().unwrap();
        let (a, b) = (cg.path().join("a"), cg.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        std::fs::write(a.join("cgroup.procs"), "").unwrap();
        let dirs = [a.clone(), b.clone(), cg.path().join("missing")];
        assert_eq!(in_unit(proc_root.path(), &dirs), None, "an empty unit");
        std::fs::write(b.join("cgroup.procs"), "8\n").unwrap();
        assert_eq!(in_unit(proc_root.path(), &dirs), None, "a zombie");
        std::fs::write(b.join("cgroup.procs"), "8\n7\n").unwrap();
        assert_eq!(in_unit(proc_root.path(), &dirs), Some(7));
        std::os::unix::fs::chown(&b, Some(1000), Some(1000)).unwrap();
        assert_eq!(in_unit(proc_root.path(), &dirs), None, "a directory another user made");
    }

    #[test]
    fn finds_only_a_live_rancher_system_agent() {
        let cases = [
            ("none", vec![("1", "systemd", "/sbin/init\0", "S")], None),
            (
                "running",
                vec![("7", "rancher-system-", "/usr/local/bin/rancher-system-agent\0sentinel\0", "S")],
                Some(7),
            ),
            ("a zombie", vec![("8", "rancher-system-", "/usr/local/bin/rancher-system-agent\0", "Z")], None),
            ("a look-alike name", vec![("9", "rancher-system-", "/usr/bin/rancher-system-other\0", "S")], None),
            ("another program named so", vec![("10", "bash", "rancher-system-agent\0", "S")], None),
        ];
        for (what, entries, want) in cases {
            assert_eq!(running(fake_proc(&entries).path(), PROGRAM), want, "{what}");
        }
        assert_eq!(running(Path::new("/nonexistent/proc"), PROGRAM), None);
        let short = fake_proc(&[("11", "rsa", "/x/rsa\0", "S")]);
        assert_eq!(running(short.path(), "rsa"), Some(11), "a name shorter than 15 bytes");
        // Another user's process of that name is no agent of the node's.
        let theirs = fake_proc(&[("12", "rsa", "/home/u/rsa\0", "S")]);
        std::os::unix::fs::chown(theirs.path().join("12"), Some(1000), Some(1000)).unwrap();
        assert_eq!(running(theirs.path(), "rsa"), None);
    }
}
