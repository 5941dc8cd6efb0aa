//! File operations of a plan: atomic writes only when the content differs, permissions and
//! ownership always re-applied, directories, deletes. Every path is walked with
//! [`crate::safefs`], so a link another user planted never redirects root's writes.

use crate::plan::FileOp;
use crate::safefs::{self, Owner};
use std::io;
use std::path::{Path, PathBuf};

/// A file operation that failed: `writing /etc/x: Permission denied (os error 13)`.
#[derive(Debug, thiserror::Error)]
#[error("{action} {}: {source}", .path.display())]
pub struct FileError {
    /// `writing`, `creating directory` or `deleting`.
    pub action: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Carry out one file operation. Errors name the path.
pub fn apply_file(op: &FileOp) -> Result<(), FileError> {
    let path = Path::new(op.path());
    let ctx = |action: &'static str| move |source| FileError { action, path: path.to_path_buf(), source };
    match op {
        FileOp::Delete { directory, .. } => safefs::remove(path, *directory).map_err(ctx("deleting")),
        FileOp::Directory { mode, uid, gid, .. } => {
            safefs::make_dir(path, *mode, Some(Owner { uid: *uid, gid: *gid })).map_err(ctx("creating directory"))
        }
        FileOp::Write { content, mode, uid, gid, .. } => {
            safefs::write_file(path, content, *mode, Some(Owner { uid: *uid, gid: *gid }))
                .map(drop)
                .map_err(ctx("writing"))
        }
    }
}
