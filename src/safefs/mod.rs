//! Race-free file access for an agent that runs as root in directories other users may write.
//!
//! Every file nodeplan writes in a place another user may reach goes through here: a plan's files,
//! directories and deletes, `.pos` and control files, the applied-plan archive, the interlock files
//! and the removal of earlier execution directories. (PID records are the process layer's: each is
//! created exclusively, in a PID directory that recovery trusts only when it is the agent's and not
//! writable by others.) The rules, which SECURITY.md states for users:
//!
//! - **Paths are walked one component at a time with directory fds** (`openat` with
//!   `O_NOFOLLOW`), never resolved by the kernel in one go, so a component swapped for a link while
//!   the walk runs is seen as a link, not followed.
//! - **A symlink met on the way is followed only when root owns it, or when it points into a
//!   directory its own owner owns** (so following it gives the link's owner nothing they did not
//!   already have). Anything else is refused with an error naming the link and its owner: a local
//!   user must not be able to point root's writes at `/etc`. This is stricter than the kernel's
//!   `protected_symlinks`, which trusts a link owned by the directory's owner.
//! - **A file is replaced, never written in place**: an exclusively created temporary file with an
//!   unguessable name (mode 0600, `O_EXCL | O_NOFOLLOW`), owner then mode set on its fd (owner
//!   first, so setuid and setgid bits survive), fsync, `renameat` within the directory fd, fsync of
//!   the directory. Nothing is done by path afterwards.
//! - **A delete never follows a link and never crosses into another mount**: the tree is removed
//!   through directory fds (`openat` with `O_NOFOLLOW`, `unlinkat`), and a tree that holds a mount
//!   point (a mounted filesystem or a bind mount) is not deleted at all.
//! - **Reads of files others may plant** (plan, control and `.pos` files in the plan directory,
//!   [`read_small`]) open the last component without following links and without blocking, accept
//!   regular files only and stop at a size cap, so a FIFO, a device or a 2 GB file cannot hang or
//!   exhaust the agent. A file named on the command line ([`read_named`]) is read the same way,
//!   except that a link is followed.
//!
//! On Windows (`windows.rs`) the same functions keep the same promises in Windows's terms:
//! every directory on the way is opened (one component at a time) with a handle that refuses to
//! share delete access and does not follow a reparse point, so while the walk holds those handles
//! nothing on the path can be renamed, removed or swapped for a link; a reparse point met on the
//! way (a symbolic link, a junction, a mount point) is refused, naming it; files are replaced,
//! never written in place; trees are removed without following a reparse point. Modes and owners
//! are not applied there (a written file takes the ACL its directory passes on); `docs/windows.md`
//! says so.
//!
//! This module must not know what the files mean; callers give paths, bytes and modes.

#[cfg(unix)]
mod unix;
#[cfg(unix)]
pub use unix::*;
#[cfg(windows)]
mod windows;
#[cfg(windows)]
pub use windows::*;

use std::ffi::OsStr;
use std::io;
use std::path::{Component, Path};

/// The uid and gid a written file or directory gets (Unix; not applied on Windows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

fn err(kind: io::ErrorKind, msg: String) -> io::Error {
    io::Error::new(kind, msg)
}

/// Split `path` into its directory and last component; the last one must be a plain name.
fn split(path: &Path) -> io::Result<(&Path, &OsStr)> {
    match (path.parent(), path.components().next_back()) {
        (Some(parent), Some(Component::Normal(name))) => Ok((parent, name)),
        _ => Err(err(io::ErrorKind::InvalidInput, format!("{} does not name a file", path.display()))),
    }
}
