//! The filesystem the installer works on: this machine (`/`) or a directory tree given as
//! `--root`. Paths are given as the agent will see them (`/etc/rancher/agent/config.yaml`) and
//! resolved beneath the root here.
//!
//! On this machine directories are walked with [`crate::safefs`]'s rule (only root's links are
//! followed). Inside a tree no symlink is followed at all ([`crate::safefs::open_dir_beneath`]),
//! so a link planted in the tree can never send a write outside it. The last component of a path
//! is never followed either way: files are replaced by rename, links are read as links.
//!
//! Owns only file access; it must not decide what to write.

use crate::safefs;
use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;
use std::ffi::OsStr;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// What is at a path before the installer writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Existing {
    Absent,
    /// A regular file with this SHA-256 (lowercase hex).
    File {
        sha256: String,
    },
    /// Something else, named for people ("a symlink", "a directory", "a FIFO").
    Other(&'static str),
}

pub struct Tree {
    root: PathBuf,
    fd: Option<OwnedFd>,
}

/// The largest file the installer reads back (the binary is the largest it writes).
pub const READ_CAP: u64 = 1 << 30;

impl Tree {
    /// `root` is the tree (`/` is this machine); with `create` a missing one is made (0755).
    pub fn open(root: &Path, create: bool) -> io::Result<Tree> {
        if root == Path::new("/") {
            return Ok(Tree { root: root.into(), fd: None });
        }
        let fd = safefs::open_dir(root, create.then_some(0o755)).map_err(|e| with_path(e, root))?;
        Ok(Tree { root: root.into(), fd: Some(fd) })
    }

    /// Why another user could change the tree's root directory as it was opened (its owner is not
    /// one of `owners`, or group or others may write it), if they could; `None` on this machine.
    pub fn root_changeable_by_others(&self, owners: &[u32]) -> io::Result<Option<String>> {
        let Some(fd) = &self.fd else { return Ok(None) };
        let st = rustix::fs::fstat(fd)?;
        let mode = st.st_mode & 0o7777;
        Ok(if !owners.contains(&st.st_uid) {
            Some(format!("it is owned by uid {}", st.st_uid))
        } else if mode & 0o022 != 0 {
            Some(format!("it is writable by group or others (mode {mode:04o})"))
        } else {
            None
        })
    }

    pub fn is_host(&self) -> bool {
        self.fd.is_none()
    }

    /// `p` as it is on this machine (under the root), for messages.
    pub fn shown(&self, p: &Path) -> PathBuf {
        match &self.fd {
            None => p.into(),
            Some(_) => self.root.join(p.strip_prefix("/").unwrap_or(p)),
        }
    }

    /// The directory `p`, made (with `mode`) where missing when `create`.
    fn dir(&self, p: &Path, create: Option<u32>) -> io::Result<OwnedFd> {
        let shown = self.shown(p);
        let r = match &self.fd {
            None => safefs::open_dir(p, create),
            Some(root) => safefs::open_dir_beneath(root.as_fd(), p, create, &shown),
        };
        r.map_err(|e| with_path(e, &shown))
    }

    /// The parent directory's fd (`None` when it does not exist) and the last component.
    fn parent<'p>(&self, p: &'p Path, create: bool) -> io::Result<(Option<OwnedFd>, &'p OsStr)> {
        let (Some(parent), Some(Component::Normal(name))) = (p.parent(), p.components().next_back()) else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} does not name a file", p.display())));
        };
        match self.dir(parent, create.then_some(0o755)) {
            Ok(fd) => Ok((Some(fd), name)),
            Err(e) if e.kind() == io::ErrorKind::NotFound && !create => Ok((None, name)),
            Err(e) => Err(e),
        }
    }

    /// What is at `p` now, without following a link there.
    pub fn existing(&self, p: &Path) -> io::Result<Existing> {
        let (Some(dir), name) = self.parent(p, false)? else { return Ok(Existing::Absent) };
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
        let fd = match rustix::fs::openat(&dir, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Ok(Existing::Absent),
            Err(Errno::LOOP) => return Ok(Existing::Other("a symlink")),
            Err(Errno::NXIO) => return Ok(Existing::Other("a socket")),
            Err(e) => return Err(with_path(e.into(), &self.shown(p))),
        };
        let st = rustix::fs::fstat(&fd)?;
        let kind = FileType::from_raw_mode(st.st_mode);
        if kind != FileType::RegularFile {
            return Ok(Existing::Other(safefs::kind_name(kind)));
        }
        use sha2::Digest as _;
        let mut h = sha2::Sha256::new();
        let mut f = std::fs::File::from(fd).take(READ_CAP);
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = f.read(&mut buf).map_err(|e| with_path(e, &self.shown(p)))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        Ok(Existing::File { sha256: h.finalize().iter().map(|b| format!("{b:02x}")).collect() })
    }

    /// The content of the regular file `p` (at most `cap` bytes); `None` when absent.
    pub fn read(&self, p: &Path, cap: u64) -> io::Result<Option<Vec<u8>>> {
        let (Some(dir), name) = self.parent(p, false)? else { return Ok(None) };
        safefs::read_small_in(dir.as_fd(), name, cap).map_err(|e| with_path(e, &self.shown(p)))
    }

    /// Replace `p` with `data` (atomically, mode `mode`, owned by the installer's user: root);
    /// missing parents are made 0755. A file that already holds `data` gets that owner and mode
    /// (a file another user planted with the right content becomes root's, or is replaced when
    /// it has other links). Returns whether the content changed.
    pub fn write(&self, p: &Path, data: &[u8], mode: u32) -> io::Result<bool> {
        let (dir, name) = self.parent(p, true)?;
        let dir = dir.ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let owner =
            safefs::Owner { uid: rustix::process::geteuid().as_raw(), gid: rustix::process::getegid().as_raw() };
        safefs::write_file_in(dir.as_fd(), name, data, mode, Some(owner)).map_err(|e| with_path(e, &self.shown(p)))
    }

    /// Make the directories of `p` that are missing: `p` itself with `mode`, missing parents 0755
    /// (as a distribution's `/var` and `/var/lib`); returns those it made, outermost first.
    pub fn ensure_dir(&self, p: &Path, mode: u32) -> io::Result<Vec<PathBuf>> {
        let mut made = Vec::new();
        let mut cur = PathBuf::from("/");
        let mut rest = p.components().filter(|c| matches!(c, Component::Normal(_))).count();
        for comp in p.components() {
            let Component::Normal(name) = comp else { continue };
            rest -= 1;
            let mode = if rest == 0 { mode } else { 0o755 };
            let parent = self.dir(&cur, None)?;
            cur.push(name);
            match rustix::fs::mkdirat(&parent, name, Mode::from_raw_mode(mode)) {
                Ok(()) => {
                    // mkdir is subject to the umask: set the mode asked for on the new directory.
                    let fd = self.dir(&cur, None)?;
                    rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))?;
                    made.push(cur.clone());
                }
                Err(Errno::EXIST) => {}
                Err(e) => return Err(with_path(e.into(), &self.shown(&cur))),
            }
        }
        // Walk it once more: whatever was there must be a directory reached without a refused link.
        self.dir(p, None)?;
        Ok(made)
    }

    /// Whether the filesystem holding the directory `p` is mounted read-only (`p` must exist).
    pub fn read_only(&self, p: &Path) -> io::Result<bool> {
        let fd = self.dir(p, None)?;
        let st = rustix::fs::fstatvfs(&fd).map_err(|e| with_path(e.into(), &self.shown(p)))?;
        Ok(st.f_flag.contains(rustix::fs::StatVfsMountFlags::RDONLY))
    }

    /// The owner (uid) and permission bits of what is at `p`, not following a link; `None` when
    /// absent.
    pub fn owner_mode(&self, p: &Path) -> io::Result<Option<(u32, u32)>> {
        let (Some(dir), name) = self.parent(p, false)? else { return Ok(None) };
        match rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some((st.st_uid, st.st_mode & 0o7777))),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(with_path(e.into(), &self.shown(p))),
        }
    }

    /// The target of the symlink `p`; `None` when `p` is absent or not a link.
    pub fn link_target(&self, p: &Path) -> io::Result<Option<PathBuf>> {
        let (Some(dir), name) = self.parent(p, false)? else { return Ok(None) };
        match rustix::fs::readlinkat(&dir, name, Vec::new()) {
            Ok(t) => Ok(Some(PathBuf::from(OsStr::from_bytes(t.as_bytes())))),
            Err(Errno::NOENT | Errno::INVAL) => Ok(None),
            Err(e) => Err(with_path(e.into(), &self.shown(p))),
        }
    }

    /// Make `p` a symlink to `target`, replacing a link already there (never anything else).
    pub fn symlink(&self, p: &Path, target: &Path) -> io::Result<()> {
        let (dir, name) = self.parent(p, true)?;
        let dir = dir.ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let tmp = safefs::temp_name(name)?;
        rustix::fs::symlinkat(target, &dir, tmp.as_slice()).map_err(|e| with_path(e.into(), &self.shown(p)))?;
        let r = rustix::fs::renameat(&dir, tmp.as_slice(), &dir, name);
        if r.is_err() {
            let _ = rustix::fs::unlinkat(&dir, tmp.as_slice(), AtFlags::empty());
        }
        r.map_err(|e| with_path(e.into(), &self.shown(p)))
    }

    /// Remove the file or link `p` (never a directory); absent is fine.
    pub fn remove_file(&self, p: &Path) -> io::Result<()> {
        let (Some(dir), name) = self.parent(p, false)? else { return Ok(()) };
        match rustix::fs::unlinkat(&dir, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(with_path(e.into(), &self.shown(p))),
        }
    }

    /// Remove the directory `p` if it is empty; returns whether it was removed (absent: true).
    pub fn remove_empty_dir(&self, p: &Path) -> io::Result<bool> {
        let (Some(dir), name) = self.parent(p, false)? else { return Ok(true) };
        match rustix::fs::unlinkat(&dir, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => Ok(true),
            Err(Errno::NOTEMPTY | Errno::EXIST | Errno::BUSY | Errno::NOTDIR) => Ok(false),
            Err(e) => Err(with_path(e.into(), &self.shown(p))),
        }
    }
}

fn with_path(e: io::Error, p: &Path) -> io::Error {
    let text = e.to_string();
    let shown = p.display().to_string();
    if text.contains(&shown) { e } else { io::Error::new(e.kind(), format!("{shown}: {text}")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_follows_no_link_and_never_leaves_the_root() {
        let outside = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let t = Tree::open(dir.path(), false).unwrap();
        assert!(!t.is_host());
        assert_eq!(t.shown(Path::new("/etc/x")), dir.path().join("etc/x"));

        // Directories made are reported outermost first: the last with the mode asked for, the
        // parents 0755.
        let made = t.ensure_dir(Path::new("/a/b/c"), 0o700).unwrap();
        assert_eq!(made, vec![PathBuf::from("/a"), PathBuf::from("/a/b"), PathBuf::from("/a/b/c")]);
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &str| std::fs::metadata(dir.path().join(p)).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode("a"), mode("a/b"), mode("a/b/c")), (0o755, 0o755, 0o700));
        assert!(t.ensure_dir(Path::new("/a/b/c"), 0o700).unwrap().is_empty());

        // A link on the way (absolute, pointing out of the tree) is refused, never followed.
        std::os::unix::fs::symlink(outside.path(), dir.path().join("etc")).unwrap();
        let e = t.write(Path::new("/etc/rancher/config.yaml"), b"x", 0o600).unwrap_err();
        assert!(e.to_string().contains("symlink"), "{e}");
        assert!(t.ensure_dir(Path::new("/etc/rancher"), 0o755).is_err());
        assert_eq!(
            t.existing(Path::new("/etc/rancher/config.yaml")).map_err(|e| e.kind()),
            Err(io::ErrorKind::PermissionDenied)
        );
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
        assert!(t.write(Path::new("/a/../etc/x"), b"x", 0o600).is_err(), "no ..");

        // The last component: a link is seen as a link, replaced by a write, removed as a link.
        let victim = outside.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("a/f")).unwrap();
        assert_eq!(t.existing(Path::new("/a/f")).unwrap(), Existing::Other("a symlink"));
        assert_eq!(t.link_target(Path::new("/a/f")).unwrap(), Some(victim.clone()));
        assert!(t.write(Path::new("/a/f"), b"mine", 0o644).unwrap());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        assert_eq!(
            t.existing(Path::new("/a/f")).unwrap(),
            Existing::File { sha256: crate::install::sha256_hex(b"mine") }
        );
        assert_eq!(t.read(Path::new("/a/f"), 100).unwrap().as_deref(), Some(&b"mine"[..]));
        assert_eq!(t.link_target(Path::new("/a/f")).unwrap(), None);

        // Symlinks made, replaced and removed; directories removed only when empty.
        t.symlink(Path::new("/a/l"), Path::new("/x")).unwrap();
        t.symlink(Path::new("/a/l"), Path::new("/y")).unwrap();
        assert_eq!(t.link_target(Path::new("/a/l")).unwrap(), Some(PathBuf::from("/y")));
        t.remove_file(Path::new("/a/l")).unwrap();
        t.remove_file(Path::new("/a/l")).unwrap();
        assert!(!t.remove_empty_dir(Path::new("/a")).unwrap());
        assert!(t.remove_empty_dir(Path::new("/a/b/c")).unwrap());
        assert!(t.remove_empty_dir(Path::new("/a/b/c")).unwrap(), "absent is fine");
        assert_eq!(t.existing(Path::new("/nope/x")).unwrap(), Existing::Absent);
        assert!(!t.read_only(Path::new("/a")).unwrap());
    }
}
