//! Rancher's own agent on this node. Rancher's `system-agent-upgrader` reinstalls and starts
//! `rancher-system-agent` on every Rancher upgrade; it takes no Lease, so only the node itself can
//! tell that it runs. Remote mode does not act on Secrets while it does (never two agents running
//! one plan): it waits before starting, and stops if one appears while it runs.
//!
//! This module only looks at `/proc` (read-only, bounded: the process names and the first
//! argument); it never signals anything.

use std::path::Path;

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
