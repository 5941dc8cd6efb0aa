//! One owner, one run: a lock file per [`Owner`] (`apply:<checksum>`, `supervise:<name>`) in the PID
//! directory, held with a POSIX record lock (`fcntl(F_SETLK)`) for as long as the owner runs.
//!
//! The kernel drops the lock when its process dies, however it dies, so there is never a stale
//! lock to clean up; and a POSIX lock is not inherited across `fork`, so a leftover child of a
//! killed owner does not keep it. A second instance that finds the lock held learns the holder's
//! pid from the kernel (`F_GETLK`) and refuses to start; one that gets it knows that whatever PID
//! records the owner left belong to a process that is gone, so recovery may stop them.
//!
//! The file is removed by its holder on the way out, while still locked; an instance that locked
//! the file just before it was removed sees that its name now leads elsewhere (or nowhere) and
//! tries again, so two instances never hold two different files of one name.

//!
//! On Windows (`owner_lock_windows.rs`) the file is opened without sharing write or delete access
//! and deleted when its last handle closes: the system closes it when its process dies, so there
//! too a dead holder leaves no lock behind. A second instance cannot open it and learns no pid.

use super::Owner;
#[cfg(unix)]
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
#[cfg(unix)]
use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use sha2::{Digest, Sha256};
#[cfg(unix)]
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};

#[cfg(windows)]
#[path = "owner_lock_windows.rs"]
mod windows;
#[cfg(windows)]
pub use windows::{OwnerLock, lock_file};

/// A held owner lock; released (and its file removed) when dropped.
#[cfg(unix)]
#[derive(Debug)]
pub struct OwnerLock {
    dir: OwnedFd,
    name: OsString,
    // Declared last: the file is removed while the lock is still held.
    fd: OwnedFd,
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another live process holds the owner's lock (its pid when the kernel can tell it).
    #[error("already running as pid {}", .pid.map_or("(unknown)".to_string(), |p| p.to_string()))]
    Held { pid: Option<i32>, path: PathBuf },
    /// The lock file or its directory could not be made, opened, examined or locked.
    #[error("owner lock {}: {what}: {source}", .path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    /// Something other than the agent's own lock file is at its name.
    #[error("owner lock {} is not a regular file owned by uid {euid}; refused (remove it by hand)", .path.display())]
    Foreign { path: PathBuf, euid: u32 },
    /// The file kept being replaced while it was being locked.
    #[error("owner lock {}: it keeps being replaced; refused", .path.display())]
    Replaced { path: PathBuf },
}

#[cfg(unix)]
impl Drop for OwnerLock {
    fn drop(&mut self) {
        // Only if the name still leads to this file (someone may have removed it by hand and
        // another instance made a new one).
        let mine = rustix::fs::fstat(&self.fd).ok();
        let now = rustix::fs::statat(&self.dir, self.name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW).ok();
        if let (Some(a), Some(b)) = (mine, now)
            && (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)
        {
            let _ = rustix::fs::unlinkat(&self.dir, self.name.as_os_str(), AtFlags::empty());
        }
    }
}

/// The lock file's name for `owner`: readable, and unique through a hash of the whole owner (its
/// text form, so the names of earlier builds' locks are kept).
pub fn file_name(owner: &Owner) -> String {
    let owner = owner.to_string();
    let readable: String =
        owner.chars().take(48).map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    let hash = Sha256::digest(owner.as_bytes());
    let short: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!(".{readable}.{short}.lock")
}

/// Take `owner`'s lock in `dir` (made if missing) without waiting.
pub fn lock(dir: &Path, owner: &Owner) -> Result<OwnerLock, LockError> {
    lock_file(dir, &file_name(owner), "")
}

/// Take the lock file `name` in `dir` (made if missing) without waiting. The file says the
/// holder's pid and, on the next line, `note` (who holds it, for people and for [`note_of`]).
#[cfg(unix)]
pub fn lock_file(dir: &Path, name: &str, note: &str) -> Result<OwnerLock, LockError> {
    let path = dir.join(name);
    let io_err = |what: &'static str, source: io::Error| LockError::Io { path: path.clone(), what, source };
    std::fs::create_dir_all(dir).map_err(|e| io_err("cannot make its directory", e))?;
    let dfd = rustix::fs::open(dir, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| io_err("cannot open its directory", e.into()))?;
    for _ in 0..16 {
        let flags = OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&dfd, name, flags, Mode::from_raw_mode(0o600))
            .map_err(|e| io_err("cannot open it", e.into()))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| io_err("cannot examine it", e.into()))?;
        let euid = rustix::process::geteuid().as_raw();
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile || st.st_uid != euid {
            return Err(LockError::Foreign { path, euid });
        }
        if !set_lock(fd.as_fd()).map_err(|e| io_err("cannot lock it", e))? {
            return Err(LockError::Held { pid: holder(fd.as_fd()), path });
        }
        // Still the file of that name? Its last holder may have removed it meanwhile.
        match rustix::fs::statat(&dfd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(now) if now.st_ino == st.st_ino && now.st_dev == st.st_dev => {
                let lock = OwnerLock { dir: dfd, name: OsString::from(name), fd };
                // For people looking at the directory; the kernel's lock is what counts.
                let _ = rustix::fs::ftruncate(&lock.fd, 0);
                let text = match note {
                    "" => format!("{}\n", std::process::id()),
                    n => format!("{}\n{n}\n", std::process::id()),
                };
                let _ = rustix::io::pwrite(&lock.fd, text.as_bytes(), 0);
                return Ok(lock);
            }
            Ok(_) | Err(rustix::io::Errno::NOENT) => continue,
            Err(e) => return Err(io_err("cannot examine it", e.into())),
        }
    }
    Err(LockError::Replaced { path })
}

/// The note of a lock file held by another process (read without following a link; a file
/// planted there by someone else only changes what a log line says). Never call it for a lock
/// this process holds: closing any descriptor of a file drops the process's POSIX locks on it.
pub fn note_of(path: &Path) -> Option<String> {
    let bytes = crate::safefs::read_small(path, 4096).ok()??;
    let text = String::from_utf8_lossy(&bytes);
    let note = text.lines().nth(1)?.trim();
    // Control characters never reach a log line; a long note is cut.
    let shown: String = note.chars().filter(|c| !c.is_control()).take(200).collect();
    (!shown.is_empty()).then_some(shown)
}

#[cfg(unix)]
fn whole_file(kind: libc::c_int) -> libc::flock {
    // SAFETY: flock is plain old data; zero is a valid value of every field.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl
}

#[cfg(unix)]
/// `F_SETLK` a write lock on the whole file: `Ok(false)` when another process holds one.
fn set_lock(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let fl = whole_file(libc::F_WRLCK);
    // SAFETY: F_SETLK reads the flock structure, which outlives the call.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLK, &fl) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN | libc::EACCES) => Ok(false),
        _ => Err(e),
    }
}

#[cfg(unix)]
/// The pid holding a lock on the file, as the kernel reports it (`F_GETLK`).
fn holder(fd: BorrowedFd<'_>) -> Option<i32> {
    let mut fl = whole_file(libc::F_WRLCK);
    // SAFETY: F_GETLK writes into the flock structure, which outlives the call.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETLK, &mut fl) } != 0 {
        return None;
    }
    (fl.l_type != libc::F_UNLCK as libc::c_short && fl.l_pid > 0).then_some(fl.l_pid)
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain_unique_and_hidden_from_the_record_scan() {
        let a = file_name(&Owner::supervise("web/../x"));
        assert!(a.starts_with(".supervise_web____x.") && a.ends_with(".lock"), "{a}");
        assert_ne!(file_name(&Owner::supervise("a/b")), file_name(&Owner::supervise("a_b")));
        assert!(!a.ends_with(".json"));
    }

    #[test]
    fn the_lock_file_is_removed_on_release_and_can_be_taken_again() {
        let d = tempfile::tempdir().unwrap();
        let owner = Owner::apply("x");
        let l = lock(d.path(), &owner).unwrap();
        let path = d.path().join(file_name(&owner));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{}\n", std::process::id()));
        drop(l);
        assert!(!path.exists());
        let again = lock(d.path(), &owner).unwrap();
        drop(again);
        // A planted link is never followed.
        std::os::unix::fs::symlink("/etc/passwd", &path).unwrap();
        let e = lock(d.path(), &owner).unwrap_err();
        assert!(matches!(e, LockError::Io { what: "cannot open it", .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            format!(
                "owner lock {}: cannot open it: {}",
                path.display(),
                std::io::Error::from_raw_os_error(libc::ELOOP)
            )
        );
    }
}
