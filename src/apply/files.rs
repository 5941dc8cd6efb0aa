//! File operations of a plan: atomic writes only when the content differs, permissions and
//! ownership always re-applied, directories, deletes. Every path is walked with
//! [`crate::safefs`], so a link another user planted never redirects root's writes.

use crate::plan::FileOp;
use crate::safefs::{self, Owner};
use std::io;
use std::path::Path;

/// Carry out one file operation. Errors name the path.
pub fn apply_file(op: &FileOp) -> Result<(), String> {
    let path = Path::new(op.path());
    let ctx = |what: &str, e: io::Error| format!("{what} {}: {e}", path.display());
    match op {
        FileOp::Delete { directory, .. } => safefs::remove(path, *directory).map_err(|e| ctx("deleting", e)),
        FileOp::Directory { mode, uid, gid, .. } => safefs::make_dir(path, *mode, Some(Owner { uid: *uid, gid: *gid }))
            .map_err(|e| ctx("creating directory", e)),
        FileOp::Write { content, mode, uid, gid, .. } => {
            safefs::write_file(path, content, *mode, Some(Owner { uid: *uid, gid: *gid }))
                .map(drop)
                .map_err(|e| ctx("writing", e))
        }
    }
}
