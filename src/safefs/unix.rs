//! The Unix backend of [`super`]: paths walked with directory fds (`openat` with `O_NOFOLLOW`),
//! links followed only under the module's rule, files replaced through `renameat`, trees removed
//! through `unlinkat`, never across a mount.

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;
use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use super::{Owner, err, split};

/// How many symlinks one walk follows before giving up (the kernel's limit is 40 too).
const MAX_LINKS: u32 = 40;

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// How a file someone else may have planted is opened: read-only, never through a link in its
/// last component, never blocking (a FIFO), never becoming a controlling terminal.
fn planted_flags() -> OFlags {
    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY
}

/// The walker's state: the path shown in errors and the links left to follow.
struct Walk<'a> {
    shown: &'a Path,
    links_left: u32,
    /// Whether a symlink met on the way may be followed at all (under the rule above); false
    /// inside an install tree ([`open_dir_beneath`]), where any link is refused.
    follow: bool,
}

impl Walk<'_> {
    /// Walk `rel` from `start` (or from `/` for an absolute path), creating missing directories
    /// with `create` when given. Returns the final directory's fd.
    fn dir(&mut self, start: OwnedFd, rel: &Path, create: Option<Mode>) -> io::Result<OwnedFd> {
        let mut cur = start;
        for comp in rel.components() {
            match comp {
                Component::RootDir => cur = rustix::fs::open("/", dir_flags(), Mode::empty())?,
                Component::CurDir | Component::Prefix(_) => {}
                Component::ParentDir => cur = rustix::fs::openat(&cur, "..", dir_flags(), Mode::empty())?,
                Component::Normal(name) => cur = self.step(&cur, name, create)?,
            }
        }
        Ok(cur)
    }

    /// One component: a directory is entered; a symlink is followed under the module's rule; a
    /// missing one is made when `create`.
    fn step(&mut self, cur: &OwnedFd, name: &OsStr, create: Option<Mode>) -> io::Result<OwnedFd> {
        loop {
            match rustix::fs::openat(cur, name, dir_flags(), Mode::empty()) {
                Ok(fd) => return Ok(fd),
                Err(Errno::NOENT) if create.is_some() => {
                    match rustix::fs::mkdirat(cur, name, create.unwrap_or(Mode::empty())) {
                        Ok(()) | Err(Errno::EXIST) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(e @ (Errno::LOOP | Errno::NOTDIR)) => {
                    let st = rustix::fs::statat(cur, name, AtFlags::SYMLINK_NOFOLLOW)?;
                    if FileType::from_raw_mode(st.st_mode) != FileType::Symlink {
                        return Err(e.into());
                    }
                    if !self.follow {
                        return Err(err(
                            io::ErrorKind::PermissionDenied,
                            format!(
                                "refusing to follow the symlink {:?} in {} (no link is followed inside this tree)",
                                name,
                                self.shown.display()
                            ),
                        ));
                    }
                    return self.follow(cur, name, st.st_uid);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn follow(&mut self, cur: &OwnedFd, name: &OsStr, link_uid: u32) -> io::Result<OwnedFd> {
        if self.links_left == 0 {
            return Err(err(io::ErrorKind::InvalidInput, format!("too many symlinks in {}", self.shown.display())));
        }
        self.links_left -= 1;
        let target = rustix::fs::readlinkat(cur, name, Vec::new())?;
        let target = PathBuf::from(OsStr::from_bytes(target.as_bytes()));
        let here = rustix::io::dup(cur)?;
        // A link's target is never created: a refused link must not leave directories behind.
        let resolved = self.dir(here, &target, None)?;
        let me = rustix::process::geteuid().as_raw();
        if link_uid != 0 && link_uid != me {
            let target_uid = rustix::fs::fstat(&resolved)?.st_uid;
            if target_uid != link_uid {
                return Err(err(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "refusing to follow the symlink {:?} in {} owned by uid {link_uid}: it points into a \
                         directory owned by uid {target_uid} (only root's links, or links into their owner's \
                         own directories, are followed)",
                        name,
                        self.shown.display()
                    ),
                ));
            }
        }
        Ok(resolved)
    }
}

fn start_fd(path: &Path) -> io::Result<OwnedFd> {
    let from = if path.is_absolute() { "/" } else { "." };
    Ok(rustix::fs::open(from, dir_flags(), Mode::empty())?)
}

/// Open the directory `path`, walking it under the module's rules; with `create`, missing
/// directories are made with that mode (as `mkdir -p` would, less the umask).
pub fn open_dir(path: &Path, create: Option<u32>) -> io::Result<OwnedFd> {
    let mut walk = Walk { shown: path, links_left: MAX_LINKS, follow: true };
    // The walk begins at `/` already: its root component is not opened a second time.
    let rel = path.strip_prefix("/").unwrap_or(path);
    walk.dir(start_fd(path)?, rel, create.map(Mode::from_raw_mode))
}

/// Open the directory `rel` beneath the directory `start` (an install tree given as `--root`),
/// one component at a time, following no symlink at all (a link anywhere on the way is an error
/// naming it) and never leaving `start`: `rel` may be written absolute (`/etc/x` means
/// `<start>/etc/x`) but must not hold `..`. With `create`, missing directories are made with that
/// mode. `shown` is the path errors name.
pub fn open_dir_beneath(start: BorrowedFd<'_>, rel: &Path, create: Option<u32>, shown: &Path) -> io::Result<OwnedFd> {
    let mut clean = PathBuf::new();
    for comp in rel.components() {
        match comp {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => clean.push(n),
            Component::ParentDir | Component::Prefix(_) => {
                return Err(err(io::ErrorKind::InvalidInput, format!("{}: \"..\" is not allowed", shown.display())));
            }
        }
    }
    let mut walk = Walk { shown, links_left: 0, follow: false };
    walk.dir(rustix::io::dup(start)?, &clean, create.map(Mode::from_raw_mode))
}

fn set_owner_mode(fd: BorrowedFd<'_>, mode: u32, owner: Option<Owner>) -> io::Result<()> {
    if let Some(o) = owner {
        let (uid, gid) = (rustix::fs::Uid::from_raw(o.uid), rustix::fs::Gid::from_raw(o.gid));
        rustix::fs::fchown(fd, Some(uid), Some(gid))?;
    }
    // After the owner: chown clears setuid and setgid bits.
    rustix::fs::fchmod(fd, Mode::from_raw_mode(mode))?;
    Ok(())
}

/// 64 unguessable bits (`getrandom`), for names nobody may predict.
pub(crate) fn random_u64() -> io::Result<u64> {
    let mut rnd = [0u8; 8];
    let mut filled = 0;
    while filled < rnd.len() {
        filled += rustix::rand::getrandom(&mut rnd[filled..], rustix::rand::GetRandomFlags::empty())?;
    }
    Ok(u64::from_ne_bytes(rnd))
}

/// An unguessable name for a temporary file beside `name` (kept well under NAME_MAX).
pub(crate) fn temp_name(name: &OsStr) -> io::Result<Vec<u8>> {
    let base = name.as_bytes();
    let mut out = b".".to_vec();
    out.extend_from_slice(&base[..base.len().min(200)]);
    out.extend_from_slice(format!(".{:016x}.tmp", random_u64()?).as_bytes());
    Ok(out)
}

/// Open an existing regular file `name` in `dir` for reading, without following a link and
/// without blocking; `Ok(None)` when absent or not a regular file.
fn open_regular(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<(OwnedFd, rustix::fs::Stat)>> {
    let fd = match rustix::fs::openat(dir, name, planted_flags(), Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::NOENT | Errno::LOOP | Errno::NXIO) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let st = rustix::fs::fstat(&fd)?;
    Ok((FileType::from_raw_mode(st.st_mode) == FileType::RegularFile).then_some((fd, st)))
}

/// Whether the regular file `fd` holds exactly `data`.
fn same_content(fd: &OwnedFd, st: &rustix::fs::Stat, data: &[u8]) -> io::Result<bool> {
    if st.st_size as u64 != data.len() as u64 {
        return Ok(false);
    }
    let mut f = std::fs::File::from(rustix::io::dup(fd)?);
    let mut old = Vec::with_capacity(data.len());
    (&mut f).take(data.len() as u64 + 1).read_to_end(&mut old)?;
    Ok(old == data)
}

/// Write `data` to `path` atomically with `mode` (and `owner` when given), under the module's
/// rules. Missing parent directories are made 0755. When the file already holds `data`, only
/// its owner and mode are set (on its fd). Returns whether the content was replaced.
pub fn write_file(path: &Path, data: &[u8], mode: u32, owner: Option<Owner>) -> io::Result<bool> {
    write_path(path, data, mode, owner, true)
}

/// [`write_file`], synced to disk or not (`durable`).
fn write_path(path: &Path, data: &[u8], mode: u32, owner: Option<Owner>, durable: bool) -> io::Result<bool> {
    let (parent, name) = split(path)?;
    let dir = open_dir(parent, Some(0o755))?;
    write_in(dir.as_fd(), name, data, mode, owner, durable)
}

/// [`write_file`] of the plain name `name` in the open directory `dir` (which the caller walked
/// under this module's rules). What is at `name` is replaced by the rename, never followed.
pub fn write_file_in(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    data: &[u8],
    mode: u32,
    owner: Option<Owner>,
) -> io::Result<bool> {
    write_in(dir, name, data, mode, owner, true)
}

/// The write of [`write_file_in`]; `durable`: the file and the directory's entry are synced
/// before it returns.
fn write_in(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    data: &[u8],
    mode: u32,
    owner: Option<Owner>,
    durable: bool,
) -> io::Result<bool> {
    if let Some((fd, st)) = open_regular(dir, name)? {
        // A file with other hard links is replaced, never chmod-ed in place: the other name may
        // be a file somebody linked here to have root change it.
        if st.st_nlink == 1 && same_content(&fd, &st, data)? {
            set_owner_mode(fd.as_fd(), mode, owner)?;
            return Ok(false);
        }
    }
    let tmp = temp_name(name)?;
    let fd = rustix::fs::openat(
        dir,
        tmp.as_slice(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    let result = (|| {
        let mut f = std::fs::File::from(fd);
        f.write_all(data)?;
        set_owner_mode(f.as_fd(), mode, owner)?;
        if durable {
            f.sync_all()?;
            rustix::fs::renameat(dir, tmp.as_slice(), dir, name)?;
            rustix::fs::fsync(dir)?;
        } else {
            replace_unsynced(dir, tmp.as_slice(), name)?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = rustix::fs::unlinkat(dir, tmp.as_slice(), AtFlags::empty());
    }
    result.map(|()| true)
}

/// Put the unsynced file `tmp` in place of `name` (both in `dir`), atomically for a reader of
/// `name`. A rename over an existing file makes ext4 write the new file's data to disk at once
/// (its `auto_da_alloc`, for programs that rename without syncing), which is what an unsynced
/// write means to avoid: swapping the two names (`RENAME_EXCHANGE`) and removing the old file does
/// not ([`write_shown`] says what it saves). Where the swap is refused (no `name` yet, or a
/// filesystem without it), a plain rename. A crash between the swap and the removal leaves the old
/// content under the temporary name.
fn replace_unsynced(dir: BorrowedFd<'_>, tmp: &[u8], name: &OsStr) -> io::Result<()> {
    let exchange = rustix::fs::RenameFlags::EXCHANGE;
    if rustix::fs::renameat_with(dir, tmp, dir, name, exchange).is_err() {
        return Ok(rustix::fs::renameat(dir, tmp, dir, name)?);
    }
    // `tmp` now names what was at `name` (never followed). A directory goes back where it was, as
    // a rename over it would have failed.
    match rustix::fs::unlinkat(dir, tmp, AtFlags::empty()) {
        Err(Errno::ISDIR) => {
            rustix::fs::renameat_with(dir, tmp, dir, name, exchange)?;
            Err(Errno::ISDIR.into())
        }
        _ => Ok(()),
    }
}

/// [`write_file`] without an owner, for the files nodeplan keeps for itself (the applied-plan
/// archive, the interlock files, control files).
pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    write_file(path, data, mode, None).map(drop)
}

/// [`write_atomic`] of a record that only shows state (the agent's status board): a reader sees
/// the old content or the new, but nothing is synced to disk, so a crash may leave the old one or
/// none. No fsync, and no data written out by the filesystem either ([`replace_unsynced`]; `cargo
/// bench --bench shown` measures it).
pub fn write_shown(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    write_path(path, data, mode, None, false).map(drop)
}

/// Make the directory `path` (and missing parents, with the same mode) and set its owner and
/// mode on its fd.
pub fn make_dir(path: &Path, mode: u32, owner: Option<Owner>) -> io::Result<()> {
    let fd = open_dir(path, Some(mode))?;
    set_owner_mode(fd.as_fd(), mode, owner)
}

/// Remove the file (or, with `directory`, the directory tree) `path`. The parent is walked under
/// the module's rules; nothing below it is ever followed: the last component and every entry of
/// the tree are handled through directory fds (`openat` with `O_NOFOLLOW`, `unlinkat`), so a link
/// is removed itself. A delete never crosses into another mount: when the tree holds a mount point
/// (a mounted filesystem or a bind mount, told by `statx`'s mount id and mount-root attribute and
/// by the device number), or `path` is one, nothing is deleted and the error names the mount
/// point; one that appears while the tree is being removed is left alone, with everything that
/// holds it, and named the same way. Absent is not an error.
pub fn remove(path: &Path, directory: bool) -> io::Result<()> {
    let (parent, name) = split(path)?;
    let dir = match open_dir(parent, None) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let r = if directory {
        remove_tree(&dir, name, path)
    } else {
        match rustix::fs::unlinkat(&dir, name, AtFlags::empty()) {
            Err(Errno::ISDIR) => Err(err(
                io::ErrorKind::InvalidInput,
                "is a directory (a directory tree is deleted only with \"directory\": true)".into(),
            )),
            Err(Errno::BUSY) => Err(mount_error(path, path, false)),
            r => r.map_err(io::Error::from),
        }
    };
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Where a file is: its device and, where the kernel says (`statx`, Linux 5.8), its mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MountPos {
    dev: u64,
    mnt_id: Option<u64>,
    mount_root: bool,
}

impl MountPos {
    /// Whether a file at `self` found in a directory at `parent` is on another mount.
    fn crosses_from(&self, parent: &MountPos) -> bool {
        self.mount_root
            || self.dev != parent.dev
            || matches!((self.mnt_id, parent.mnt_id), (Some(a), Some(b)) if a != b)
    }
}

/// The type and mount position of `name` in `dir` (not followed), or of `dir` itself for `None`.
fn examine(dir: BorrowedFd<'_>, name: Option<&OsStr>) -> io::Result<(FileType, MountPos)> {
    use rustix::fs::{StatxAttributes, StatxFlags};
    let (at, flags) = match name {
        Some(n) => (n, AtFlags::SYMLINK_NOFOLLOW),
        None => (OsStr::new(""), AtFlags::EMPTY_PATH | AtFlags::SYMLINK_NOFOLLOW),
    };
    match rustix::fs::statx(dir, at, flags, StatxFlags::TYPE | StatxFlags::MNT_ID) {
        Ok(x) => {
            let mnt_id = (x.stx_mask & StatxFlags::MNT_ID.bits() != 0).then_some(x.stx_mnt_id);
            let root = StatxAttributes::MOUNT_ROOT;
            let mount_root = x.stx_attributes_mask.contains(root) && x.stx_attributes.contains(root);
            let pos = MountPos { dev: rustix::fs::makedev(x.stx_dev_major, x.stx_dev_minor), mnt_id, mount_root };
            Ok((FileType::from_raw_mode(u32::from(x.stx_mode)), pos))
        }
        // Kernels before 4.11: the device number is all there is.
        Err(Errno::NOSYS) => {
            let st = rustix::fs::statat(dir, at, flags)?;
            Ok((FileType::from_raw_mode(st.st_mode), MountPos { dev: st.st_dev, mnt_id: None, mount_root: false }))
        }
        Err(e) => Err(e.into()),
    }
}

fn mount_error(mount: &Path, tree: &Path, rest_deleted: bool) -> io::Error {
    let what = if rest_deleted {
        format!("it was left alone (it appeared while {} was being deleted; the rest was deleted)", tree.display())
    } else if mount == tree {
        "nothing was deleted".to_string()
    } else {
        format!("nothing under {} was deleted", tree.display())
    };
    err(
        io::ErrorKind::ResourceBusy,
        format!(
            "{} is a mount point (a mounted filesystem or a bind mount) and a delete never crosses into one: {what}; \
             unmount it first",
            mount.display()
        ),
    )
}

/// Open the directory `name` in `dir` without following it; `None` when it is not a directory
/// (any more) or is gone.
fn open_subdir(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Option<OwnedFd>> {
    match rustix::fs::openat(dir, name, dir_flags() | OFlags::NONBLOCK, Mode::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::NOTDIR | Errno::LOOP | Errno::NOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The names in the directory `fd` (`.` and `..` left out).
fn list(fd: &OwnedFd) -> io::Result<Vec<std::ffi::OsString>> {
    let mut names = Vec::new();
    for e in rustix::fs::Dir::read_from(fd)? {
        let e = e?;
        let name = e.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(OsStr::from_bytes(name).to_os_string());
        }
    }
    Ok(names)
}

/// Remove the directory tree `name` in `parent` (or `name` itself when it is not a directory).
/// First a walk that changes nothing looks for a mount point in the tree, then a second walk
/// removes it, checking every directory again before entering it.
fn remove_tree(parent: &OwnedFd, name: &OsStr, shown: &Path) -> io::Result<()> {
    let Some(top) = open_subdir(parent.as_fd(), name)? else {
        // A file or a link: removed itself, never followed.
        return match rustix::fs::unlinkat(parent, name, AtFlags::empty()) {
            Err(Errno::BUSY) => Err(mount_error(shown, shown, false)),
            r => r.map_err(io::Error::from),
        };
    };
    let (_, parent_pos) = examine(parent.as_fd(), None)?;
    let (_, top_pos) = examine(top.as_fd(), None)?;
    if top_pos.crosses_from(&parent_pos) {
        return Err(mount_error(shown, shown, false));
    }
    if let Some(mount) = walk_tree(rustix::io::dup(&top)?, top_pos, shown, false)? {
        return Err(mount_error(&mount, shown, false));
    }
    if let Some(mount) = walk_tree(top, top_pos, shown, true)? {
        return Err(mount_error(&mount, shown, true));
    }
    rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR).map_err(|e| with_path(e, shown))
}

fn with_path(e: Errno, path: &Path) -> io::Error {
    err(io::Error::from(e).kind(), format!("{}: {}", path.display(), io::Error::from(e)))
}

/// One directory being walked: its fd, its path for messages, the names left to handle and its
/// name in its parent (none for the top).
struct Frame {
    fd: OwnedFd,
    path: PathBuf,
    names: Vec<std::ffi::OsString>,
    name: Option<std::ffi::OsString>,
}

/// Walk the tree under `top` (which is on the mount `pos`) without recursion and without
/// following anything. Without `delete`, stop at the first mount point and return it. With
/// `delete`, remove every entry (the top itself is left to the caller); a mount point found is
/// left alone, with the directories that hold it, and the first one is returned.
fn walk_tree(top: OwnedFd, pos: MountPos, shown: &Path, delete: bool) -> io::Result<Option<PathBuf>> {
    let names = list(&top).map_err(|e| err(e.kind(), format!("{}: {e}", shown.display())))?;
    let mut stack = vec![Frame { fd: top, path: shown.to_path_buf(), names, name: None }];
    let mut mount: Option<PathBuf> = None;
    while let Some(frame) = stack.last_mut() {
        let Some(name) = frame.names.pop() else {
            let Some(done) = stack.pop() else { break };
            if let (true, Some(up), Some(name)) = (delete, stack.last(), done.name) {
                drop(done.fd);
                match rustix::fs::unlinkat(&up.fd, name.as_os_str(), AtFlags::REMOVEDIR) {
                    Ok(()) | Err(Errno::NOENT) => {}
                    // It holds the mount point that was left alone.
                    Err(Errno::NOTEMPTY | Errno::BUSY) if mount.is_some() => {}
                    Err(e) => return Err(with_path(e, &done.path)),
                }
            }
            continue;
        };
        let path = frame.path.join(&name);
        let (kind, entry_pos) = match examine(frame.fd.as_fd(), Some(&name)) {
            Ok(x) => x,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(err(e.kind(), format!("{}: {e}", path.display()))),
        };
        if entry_pos.crosses_from(&pos) {
            if !delete {
                return Ok(Some(path));
            }
            mount.get_or_insert(path);
            continue;
        }
        if kind != FileType::Directory {
            if delete {
                match rustix::fs::unlinkat(&frame.fd, name.as_os_str(), AtFlags::empty()) {
                    Ok(()) | Err(Errno::NOENT) => {}
                    // A file bind-mounted over this one.
                    Err(Errno::BUSY) => {
                        mount.get_or_insert(path);
                    }
                    Err(e) => return Err(with_path(e, &path)),
                }
            }
            continue;
        }
        let Some(fd) = open_subdir(frame.fd.as_fd(), &name)? else {
            // Replaced by something else since: handle the name again.
            if delete {
                match rustix::fs::unlinkat(&frame.fd, name.as_os_str(), AtFlags::empty()) {
                    Ok(()) | Err(Errno::NOENT) => {}
                    Err(e) => return Err(with_path(e, &path)),
                }
            }
            continue;
        };
        // What was opened is what counts: a mount made after the look above is seen here.
        let (_, opened) = examine(fd.as_fd(), None)?;
        if opened.crosses_from(&pos) {
            if !delete {
                return Ok(Some(path));
            }
            mount.get_or_insert(path);
            continue;
        }
        let names = list(&fd).map_err(|e| err(e.kind(), format!("{}: {e}", path.display())))?;
        stack.push(Frame { fd, path, names, name: Some(name) });
    }
    Ok(mount)
}

/// Read a small file that someone other than root may have planted: the parent is walked under
/// the module's rules, the file itself is opened without following a link and without blocking
/// and must be a regular file of at most `cap` bytes. `Ok(None)` when it does not exist.
pub fn read_small(path: &Path, cap: u64) -> io::Result<Option<Vec<u8>>> {
    let (parent, name) = split(path)?;
    let dir = match open_dir(parent, None) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    read_small_in(dir.as_fd(), name, cap)
}

/// [`read_small`] of the plain name `name` in the open directory `dir`.
pub fn read_small_in(dir: BorrowedFd<'_>, name: &OsStr, cap: u64) -> io::Result<Option<Vec<u8>>> {
    let fd = match rustix::fs::openat(dir, name, planted_flags(), Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(None),
        Err(Errno::LOOP) => return Err(err(io::ErrorKind::InvalidInput, "is a symlink (not followed)".into())),
        Err(e) => return Err(e.into()),
    };
    read_regular(fd, cap).map(Some)
}

/// Whether a file or directory with owner `uid` and mode `mode` can only have been written by this
/// process's user: owned by the effective uid, not writable by group or others. The error is the
/// reason, worded to follow a path ("is owned by uid 1000").
pub fn own_only(uid: u32, mode: u32) -> Result<(), String> {
    let euid = rustix::process::geteuid().as_raw();
    if uid != euid {
        return Err(format!("is owned by uid {uid}"));
    }
    if mode & 0o022 != 0 {
        return Err(format!("is writable by group or others (mode {:04o})", mode & 0o7777));
    }
    Ok(())
}

/// [`read_small`], where the file also has to pass `check` (its owner and mode, from the open
/// descriptor, before a byte is read): `Ok(Some(Err(why)))` when it does not.
pub fn read_small_checked(
    path: &Path,
    cap: u64,
    check: impl FnOnce(u32, u32) -> Result<(), String>,
) -> io::Result<Option<Result<Vec<u8>, String>>> {
    let (parent, name) = split(path)?;
    let dir = match open_dir(parent, None) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let fd = match rustix::fs::openat(dir.as_fd(), name, planted_flags(), Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(None),
        Err(Errno::LOOP) => return Err(err(io::ErrorKind::InvalidInput, "is a symlink (not followed)".into())),
        Err(e) => return Err(e.into()),
    };
    let st = rustix::fs::fstat(&fd)?;
    if let Err(why) = check(st.st_uid, st.st_mode) {
        return Ok(Some(Err(why)));
    }
    read_regular(fd, cap).map(|b| Some(Ok(b)))
}

/// Read a file named on the command line (a plan given to `nodeplan apply`): a link is followed,
/// as for any path the operator typed, but the file is opened without blocking and must be a
/// regular file of at most `cap` bytes, so a FIFO, a device or a directory gives one clear error at
/// once instead of a hang or a huge read.
pub fn read_named(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    // A typed path may end in a link: everything but NOFOLLOW.
    read_regular(rustix::fs::open(path, planted_flags() - OFlags::NOFOLLOW, Mode::empty())?, cap)
}

/// The content of the open file `fd`, which must be a regular file of at most `cap` bytes.
fn read_regular(fd: OwnedFd, cap: u64) -> io::Result<Vec<u8>> {
    let st = rustix::fs::fstat(&fd)?;
    let kind = FileType::from_raw_mode(st.st_mode);
    if kind != FileType::RegularFile {
        return Err(err(io::ErrorKind::InvalidInput, format!("is not a regular file ({})", kind_name(kind))));
    }
    if st.st_size as u64 > cap {
        return Err(err(io::ErrorKind::InvalidInput, format!("is {} bytes, more than the {cap} allowed", st.st_size)));
    }
    let mut out = Vec::with_capacity(st.st_size as usize);
    std::fs::File::from(fd).take(cap + 1).read_to_end(&mut out)?;
    if out.len() as u64 > cap {
        return Err(err(io::ErrorKind::InvalidInput, format!("grew past the {cap} bytes allowed")));
    }
    Ok(out)
}

/// Whether a user other than `owners` could change what is at `path`: `Some(why)` names the
/// first file or directory from `/` down to it (links resolved) that another user owns, or that
/// group or others may write. A directory with the sticky bit (`/tmp`) is accepted on the way: no
/// one else can replace its owner's entries there. The check is on names, once: use it where what
/// it guards is read right after (a binary to install) or cannot change (a running executable).
pub fn changeable_by_others(path: &Path, owners: &[u32]) -> io::Result<Option<String>> {
    changeable(path, owners, true)
}

/// [`changeable_by_others`] for a directory to create something in: it may be sticky as well (a
/// name made in `/tmp` is then judged as opened, by its caller).
pub fn changeable_by_others_beneath(dir: &Path, owners: &[u32]) -> io::Result<Option<String>> {
    changeable(dir, owners, false)
}

fn changeable(path: &Path, owners: &[u32], whole: bool) -> io::Result<Option<String>> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let real = std::fs::canonicalize(path)?;
    let mut chain: Vec<&Path> = real.ancestors().collect();
    chain.reverse();
    for (i, p) in chain.iter().enumerate() {
        let m = std::fs::symlink_metadata(p)?;
        let mode = m.permissions().mode();
        let last = whole && i + 1 == chain.len();
        if !owners.contains(&m.uid()) {
            return Ok(Some(format!("{} is owned by uid {}", p.display(), m.uid())));
        }
        if mode & 0o022 != 0 && (last || !m.is_dir() || mode & 0o1000 == 0) {
            return Ok(Some(format!("{} is writable by group or others (mode {:04o})", p.display(), mode & 0o7777)));
        }
    }
    Ok(None)
}

/// A file type as a person names it.
pub fn kind_name(kind: FileType) -> &'static str {
    match kind {
        FileType::RegularFile => "a regular file",
        FileType::Directory => "a directory",
        FileType::Symlink => "a symlink",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Unknown => "of an unknown type",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    const NOBODY: u32 = 65534;

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        type Write = fn(&Path, &[u8], u32) -> io::Result<()>;
        for (what, write) in [("write_atomic", write_atomic as Write), ("write_shown", write_shown)] {
            let d = tempfile::tempdir().unwrap();
            let p = d.path().join("r.json");
            // A link planted at the name is replaced, never followed.
            let target = d.path().join("target");
            std::fs::write(&target, b"keep").unwrap();
            std::os::unix::fs::symlink(&target, &p).unwrap();
            write(&p, b"one", 0o600).unwrap();
            write(&p, b"two", 0o600).unwrap();
            assert_eq!(std::fs::read(&p).unwrap(), b"two", "{what}");
            assert_eq!(std::fs::read(&target).unwrap(), b"keep", "{what}");
            assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o7777, 0o600, "{what}");
            assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 2, "{what}: no temp file left");
        }
    }

    #[test]
    fn a_shown_record_is_made_replaced_and_never_swapped_with_a_directory() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("agent-status");
        write_shown(&p, b"one", 0o600).unwrap();
        write_shown(&p, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1, "the old record and no temp file left");
        // A directory at the name stays there with what it holds, as a rename over it would fail.
        let dir = d.path().join("taken");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("keep"), b"k").unwrap();
        let e = write_shown(&dir, b"x", 0o600).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EISDIR), "{e}");
        assert_eq!(std::fs::read(dir.join("keep")).unwrap(), b"k");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 2, "no temp file left");
    }

    fn lchown(p: &Path, uid: u32) {
        std::os::unix::fs::lchown(p, Some(uid), Some(uid)).unwrap();
    }

    #[test]
    fn writes_replace_atomically_and_keep_setuid_bits() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a/b/f");
        assert!(write_file(&p, b"one", 0o4755, Some(Owner { uid: NOBODY, gid: NOBODY })).unwrap());
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!((m.mode() & 0o7777, m.uid(), m.gid()), (0o4755, NOBODY, NOBODY), "chown first, then chmod");
        assert!(!write_file(&p, b"one", 0o4750, None).unwrap(), "same content: not replaced");
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o7777, 0o4750);
        assert!(write_file(&p, b"two", 0o600, None).unwrap());
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(d.path().join("a/b")).unwrap().count(), 1, "no temp file left");
    }

    #[test]
    fn a_hard_link_to_another_file_is_replaced_not_chmod_ed() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"same").unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::hard_link(&victim, d.path().join("f")).unwrap();
        write_file(&d.path().join("f"), b"same", 0o666, Some(Owner { uid: NOBODY, gid: NOBODY })).unwrap();
        let m = std::fs::metadata(&victim).unwrap();
        assert_eq!((m.mode() & 0o777, m.uid()), (0o600, 0));
    }

    #[test]
    fn links_owned_by_others_are_refused_unless_they_point_into_their_own_directory() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("etc");
        std::fs::create_dir(&victim).unwrap();
        let user = d.path().join("home");
        std::fs::create_dir(&user).unwrap();
        lchown(&user, NOBODY);
        let link = user.join("cfg");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        lchown(&link, NOBODY);
        let e = write_file(&link.join("passwd"), b"x", 0o644, None).unwrap_err();
        assert!(e.to_string().contains("refusing to follow the symlink \"cfg\""), "{e}");
        assert!(e.to_string().contains("owned by uid 65534"), "{e}");
        assert!(!victim.join("passwd").exists());
        assert!(make_dir(&link.join("sub"), 0o755, None).is_err());
        assert!(!victim.join("sub").exists(), "a refused link leaves nothing behind");
        assert!(remove(&link.join("keep"), false).is_err());

        // The same link owned by root is followed; a user's link into the user's own directory too.
        std::fs::write(victim.join("keep"), b"k").unwrap();
        lchown(&link, 0);
        write_file(&link.join("ok"), b"x", 0o644, None).unwrap();
        assert_eq!(std::fs::read(victim.join("ok")).unwrap(), b"x");
        let own = user.join("real");
        std::fs::create_dir(&own).unwrap();
        lchown(&own, NOBODY);
        let own_link = user.join("mine");
        std::os::unix::fs::symlink("real", &own_link).unwrap();
        lchown(&own_link, NOBODY);
        write_file(&own_link.join("f"), b"y", 0o644, None).unwrap();
        assert_eq!(std::fs::read(own.join("f")).unwrap(), b"y");
        assert_eq!(std::fs::read(victim.join("keep")).unwrap(), b"k");
    }

    #[test]
    fn a_planted_temp_name_or_final_link_is_never_followed() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("shadow");
        std::fs::write(&victim, b"secret").unwrap();
        // The predictable names of earlier versions, and the file itself, as links to the victim.
        for name in [format!(".f.tmp{}", std::process::id()), "f".into()] {
            std::os::unix::fs::symlink(&victim, d.path().join(name)).unwrap();
        }
        write_file(&d.path().join("f"), b"pwned", 0o777, Some(Owner { uid: NOBODY, gid: NOBODY })).unwrap();
        let m = std::fs::metadata(&victim).unwrap();
        assert_eq!((std::fs::read(&victim).unwrap(), m.mode() & 0o777, m.uid()), (b"secret".to_vec(), 0o644, 0));
        assert!(!std::fs::symlink_metadata(d.path().join("f")).unwrap().file_type().is_symlink());
    }

    /// A local user swaps a directory component for a link to a root-owned directory, as fast as
    /// they can, while root writes: no write, chmod or chown ever lands in the victim directory.
    #[test]
    fn a_component_swapped_for_a_link_during_writes_never_redirects_them() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("etc");
        std::fs::create_dir(&victim).unwrap();
        std::fs::write(victim.join("f"), b"secret").unwrap();
        let user = d.path().join("home");
        std::fs::create_dir(&user).unwrap();
        std::fs::create_dir(user.join("sub")).unwrap();
        let link = user.join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        lchown(&link, NOBODY);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swaps = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let swapper = {
            let (stop, swaps, user) = (stop.clone(), swaps.clone(), user.clone());
            std::thread::spawn(move || {
                let dir = std::fs::File::open(&user).unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    rustix::fs::renameat_with(&dir, "sub", &dir, "link", rustix::fs::RenameFlags::EXCHANGE).unwrap();
                    swaps.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            })
        };
        let (mut ok, mut refused) = (0, 0);
        for _ in 0..3000 {
            match write_file(&user.join("sub/f"), b"pwned", 0o777, Some(Owner { uid: NOBODY, gid: NOBODY })) {
                Ok(_) => ok += 1,
                Err(_) => refused += 1,
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        swapper.join().unwrap();
        let m = std::fs::metadata(victim.join("f")).unwrap();
        assert_eq!(std::fs::read(victim.join("f")).unwrap(), b"secret");
        assert_eq!((m.mode() & 0o777, m.uid()), (0o644, 0));
        assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 1, "no temp file in the victim directory");
        assert!(swaps.load(std::sync::atomic::Ordering::Relaxed) > 100, "the swapper ran");
        assert!(ok > 0 && refused > 0, "both sides of the race were taken: {ok} written, {refused} refused");
    }

    #[test]
    fn a_tree_is_removed_without_following_links_or_blocking_on_fifos() {
        let d = tempfile::tempdir().unwrap();
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"k").unwrap();
        let tree = d.path().join("tree");
        let mut deep = tree.clone();
        for i in 0..300 {
            deep.push(format!("d{i}"));
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::os::unix::fs::symlink(&outside, deep.join("link")).unwrap();
        rustix::fs::mknodat(rustix::fs::CWD, tree.join("fifo"), FileType::Fifo, Mode::from_raw_mode(0o644), 0).unwrap();
        std::fs::write(tree.join("f"), b"x").unwrap();
        remove(&tree, true).unwrap();
        assert!(!tree.exists());
        assert_eq!(std::fs::read(outside.join("keep")).unwrap(), b"k");
        remove(&tree, true).unwrap();
        // A link given as the tree itself is removed, not followed; a directory needs `directory`.
        std::os::unix::fs::symlink(&outside, &tree).unwrap();
        remove(&tree, true).unwrap();
        assert!(outside.join("keep").exists() && std::fs::symlink_metadata(&tree).is_err());
        let e = remove(&outside, false).unwrap_err();
        assert!(e.to_string().contains("is a directory"), "{e}");
    }

    #[test]
    fn small_reads_refuse_fifos_links_and_large_files_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("x.paused");
        rustix::fs::mknodat(rustix::fs::CWD, &fifo, FileType::Fifo, Mode::from_raw_mode(0o644), 0).unwrap();
        let e = read_small(&fifo, 100).unwrap_err();
        assert!(e.to_string().contains("not a regular file (a FIFO)"), "{e}");
        std::fs::write(d.path().join("big"), vec![b'a'; 101]).unwrap();
        assert!(read_small(&d.path().join("big"), 100).unwrap_err().to_string().contains("more than the 100"));
        std::os::unix::fs::symlink(d.path().join("big"), d.path().join("l")).unwrap();
        assert!(read_small(&d.path().join("l"), 1000).unwrap_err().to_string().contains("symlink"));
        assert_eq!(read_small(&d.path().join("absent"), 10).unwrap(), None);
        std::fs::write(d.path().join("ok"), b"true\n").unwrap();
        assert_eq!(read_small(&d.path().join("ok"), 10).unwrap().unwrap(), b"true\n");
    }
}
