//! SECURITY.md end to end: the attacks and hostile environments it names, against the real
//! binary. Everything destructive happens under a temporary directory.

mod common;

use common::*;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

fn sh(name: &str, script: &str) -> serde_json::Value {
    serde_json::json!({"name": name, "command": "sh", "args": ["-c", script]})
}

fn write_plan(dir: &Path, json: serde_json::Value) -> String {
    let path = dir.join("test.plan");
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    path.to_string_lossy().into_owned()
}

fn apply(dir: &Path, plan: &str, extra: &[&str]) -> Command {
    let mut c = Command::new(NODEPLAN);
    c.args(["apply", plan, "--work-dir"])
        .arg(dir.join("work"))
        .arg("--pid-dir")
        .arg(dir.join("pids"))
        .args(extra)
        .env("NODEPLAN_LOG", "warn");
    c
}

/// A plan file written under a directory a local user owns: the user swaps a component for a
/// link to a root-only directory. The write is refused and nothing in that directory changes.
#[test]
fn plan_files_never_follow_a_link_another_user_planted() {
    let d = tempfile::tempdir().unwrap();
    let victim = d.path().join("etc");
    std::fs::create_dir(&victim).unwrap();
    std::fs::write(victim.join("passwd"), b"root:x:0:0").unwrap();
    let home = d.path().join("home");
    std::fs::create_dir(&home).unwrap();
    std::os::unix::fs::lchown(&home, Some(1000), Some(1000)).unwrap();
    let link = home.join("app");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    std::os::unix::fs::lchown(&link, Some(1000), Some(1000)).unwrap();
    let plan = write_plan(
        d.path(),
        serde_json::json!({"files": [
            {"path": link.join("passwd"), "content": "cHduZWQ=", "permissions": "0666", "uid": 1000, "gid": 1000}
        ]}),
    );
    let out = apply(d.path(), &plan, &[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("refusing to follow the symlink \"app\""), "{err}");
    let m = std::fs::metadata(victim.join("passwd")).unwrap();
    assert_eq!(std::fs::read(victim.join("passwd")).unwrap(), b"root:x:0:0");
    assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o644));
}

/// The agent is started with an open descriptor and ignored signals (as `nohup` or a shell's
/// background job leaves them): its instructions get neither.
#[test]
fn instructions_inherit_no_descriptor_and_no_ignored_signal_from_the_agents_parent() {
    let d = tempfile::tempdir().unwrap();
    let out_file = d.path().join("seen");
    let plan = write_plan(
        d.path(),
        serde_json::json!({"instructions": [sh("look", &format!(
            "if [ -e /proc/$$/fd/7 ]; then echo leaked fd 7; fi > {o}; grep SigIgn /proc/$$/status >> {o}",
            o = out_file.display()
        ))]}),
    );
    let secret = d.path().join("secret");
    std::fs::write(&secret, b"s").unwrap();
    let inner = apply(d.path(), &plan, &[]);
    let args: Vec<String> = std::iter::once(inner.get_program())
        .chain(inner.get_args())
        .map(|a| format!("'{}'", a.to_string_lossy()))
        .collect();
    let script = format!("trap '' HUP INT USR1; exec 7<'{}'; exec {}", secret.display(), args.join(" "));
    let out = Command::new("sh").args(["-c", &script]).env("NODEPLAN_LOG", "warn").output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let seen = std::fs::read_to_string(&out_file).unwrap();
    assert_eq!(seen, "SigIgn:\t0000000000000000\n", "no descriptor leaked, no signal ignored");
}

/// Unmounts and stops the hung FUSE server whatever happens, which frees any process stuck on it.
struct Fuse {
    server: std::process::Child,
    mnt: std::path::PathBuf,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Fuse {
    fn start(mnt: &Path) -> Option<Fuse> {
        std::fs::create_dir_all(mnt).unwrap();
        let mut server = Command::new(HELPER)
            .arg("fuse-hang")
            .arg(mnt)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .ok()?;
        let lines = lines_of(server.stdout.take()?);
        let f = Fuse { server, mnt: mnt.to_path_buf(), lines };
        match f.lines.recv_timeout(GUARD) {
            Ok(l) if l.starts_with("ready") => Some(f),
            _ => None,
        }
    }
}

impl Drop for Fuse {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let c = std::ffi::CString::new(self.mnt.to_string_lossy().as_bytes()).unwrap();
        // SAFETY: umount2 of the test's own mount point.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

/// An instruction whose program lives on a mount that never answers holds its spawn in execve,
/// and the spawning thread with it (vfork). The agent still takes SIGTERM and cancels, with
/// and without a cgroup to kill through, and says what it could not stop.
#[test]
fn a_spawn_stuck_in_execve_never_freezes_the_agent() {
    for cgroup in ["auto", "off"] {
        let d = tempfile::tempdir().unwrap();
        let Some(fuse) = Fuse::start(&d.path().join("mnt")) else {
            assert!(require(false, "a FUSE mount (/dev/fuse)"));
            return;
        };
        let plan = write_plan(
            d.path(),
            serde_json::json!({"instructions": [{"name": "stuck", "command": d.path().join("mnt/x")}]}),
        );
        let mut agent = apply(d.path(), &plan, &["--cgroup", cgroup, "--kill-timeout", "1s"])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The handshake: the FUSE server saw the lookup, so the spawn is stuck in execve.
        let l = fuse.lines.recv_timeout(GUARD).expect("the execve reached the FUSE mount");
        assert!(l.starts_with("request"), "{l}");
        // SAFETY: signalling the test's own child.
        unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + GUARD;
        let status = loop {
            if let Some(s) = agent.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = agent.kill();
                panic!("cgroup {cgroup}: the agent ignored SIGTERM while a spawn was stuck");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut agent.stderr.take().unwrap(), &mut err).unwrap();
        assert_eq!(status.code(), Some(4), "cgroup {cgroup}: canceled: {err}");
        // A request the FUSE server has read waits uninterruptibly in the kernel: SIGKILL cannot
        // free the child, which is said, and its PID record is kept for a later recovery.
        assert!(err.contains("stuck before exec and survived SIGKILL"), "{err}");
        assert_eq!(std::fs::read_dir(d.path().join("pids")).unwrap().count(), 1, "{err}");
        drop(fuse);
    }
}

/// A mount made by a test under its temp directory, detached when dropped (also on a panic).
struct Mounted(std::path::PathBuf);

impl Mounted {
    fn new(source: &Path, at: &Path, fstype: Option<&str>, flags: libc::c_ulong) -> Mounted {
        use std::ffi::CString;
        use std::os::unix::ffi::OsStrExt;
        let src = CString::new(source.as_os_str().as_bytes()).unwrap();
        let dst = CString::new(at.as_os_str().as_bytes()).unwrap();
        let fs = fstype.map(|f| CString::new(f).unwrap());
        let r = unsafe {
            libc::mount(
                src.as_ptr(),
                dst.as_ptr(),
                fs.as_ref().map_or(std::ptr::null(), |f| f.as_ptr()),
                flags,
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "mount {} on {}: {}", source.display(), at.display(), std::io::Error::last_os_error());
        Mounted(at.to_path_buf())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        use std::os::unix::ffi::OsStrExt;
        let p = std::ffi::CString::new(self.0.as_os_str().as_bytes()).unwrap();
        unsafe { libc::umount2(p.as_ptr(), libc::MNT_DETACH) };
    }
}

/// A directory delete never crosses into another mount: a tree holding a tmpfs or a bind mount
/// (of a directory or of a file) is not deleted at all, and the error names the mount point; a
/// directory that is itself a mount point is not emptied. Links inside the tree are removed, not
/// followed. Every path here is under the test's temp directory.
#[test]
fn a_directory_delete_never_crosses_into_a_mount_or_follows_a_link() {
    let d = tempfile::tempdir().unwrap();
    let outside = d.path().join("outside");
    std::fs::create_dir_all(outside.join("sub")).unwrap();
    std::fs::write(outside.join("sub/precious"), b"p").unwrap();
    std::fs::write(outside.join("file"), b"f").unwrap();

    // Links only: removed themselves, what they point to stays.
    let links = d.path().join("links");
    std::fs::create_dir_all(links.join("a/b")).unwrap();
    std::fs::write(links.join("a/b/f"), b"x").unwrap();
    std::os::unix::fs::symlink(outside.join("sub"), links.join("a/to-dir")).unwrap();
    std::os::unix::fs::symlink(outside.join("file"), links.join("a/b/to-file")).unwrap();

    type MountIn<'a> = Box<dyn Fn(&Path) -> Vec<Mounted> + 'a>;
    let cases: Vec<(&str, MountIn, &str)> = vec![
        (
            "tmpfs",
            Box::new(|t: &Path| vec![Mounted::new(Path::new("tmpfs"), &t.join("a/mnt"), Some("tmpfs"), 0)]),
            "a/mnt",
        ),
        (
            "bind",
            Box::new(|t: &Path| vec![Mounted::new(&outside.join("sub"), &t.join("a/b/bind"), None, libc::MS_BIND)]),
            "a/b/bind",
        ),
        (
            "file bind",
            Box::new(|t: &Path| vec![Mounted::new(&outside.join("file"), &t.join("a/b/f"), None, libc::MS_BIND)]),
            "a/b/f",
        ),
        ("top", Box::new(|t: &Path| vec![Mounted::new(Path::new("tmpfs"), t, Some("tmpfs"), 0)]), ""),
    ];
    for (what, mount, point) in cases {
        let tree = d.path().join(format!("tree-{}", what.replace(' ', "-")));
        std::fs::create_dir_all(tree.join("a/b/bind")).unwrap();
        std::fs::create_dir_all(tree.join("a/mnt")).unwrap();
        std::fs::write(tree.join("a/b/f"), b"x").unwrap();
        let _mounts = mount(&tree);
        // Content on the mount (for the tmpfs ones) and beside it.
        std::fs::create_dir_all(tree.join("a/mnt")).unwrap();
        std::fs::write(tree.join("a/mnt/on-the-mount"), b"m").unwrap();
        std::fs::write(tree.join("a/beside"), b"b").unwrap();
        let plan =
            write_plan(d.path(), serde_json::json!({"files": [{"path": tree, "directory": true, "action": "delete"}]}));
        let out = apply(d.path(), &plan, &[]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what}: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("nodeplan: ")).collect();
        assert_eq!(lines.len(), 1, "{what}: {err}");
        let named = tree.join(point);
        let named = named.to_string_lossy();
        let named = named.trim_end_matches('/');
        assert!(lines[0].contains(&format!("{named} is a mount point")), "{what}: {err}");
        assert!(tree.join("a/mnt/on-the-mount").exists(), "{what}: the mount's content was deleted");
        assert!(tree.join("a/beside").exists(), "{what}: the tree was deleted although it holds a mount");
        assert_eq!(std::fs::read(outside.join("sub/precious")).unwrap(), b"p", "{what}");
        assert_eq!(std::fs::read(outside.join("file")).unwrap(), b"f", "{what}");
    }

    let plan =
        write_plan(d.path(), serde_json::json!({"files": [{"path": links, "directory": true, "action": "delete"}]}));
    let out = apply(d.path(), &plan, &[]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!links.exists());
    assert_eq!(std::fs::read(outside.join("sub/precious")).unwrap(), b"p");
    assert_eq!(std::fs::read(outside.join("file")).unwrap(), b"f");
}
