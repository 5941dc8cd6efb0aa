//! File operations of a plan: atomic writes only when the content differs, permissions and
//! ownership always re-applied, directories, deletes.

use crate::plan::FileOp;
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;

/// Carry out one file operation. Errors name the path.
pub fn apply_file(op: &FileOp) -> Result<(), String> {
    let path = Path::new(op.path());
    let ctx = |what: &str, e: io::Error| format!("{what} {}: {e}", path.display());
    match op {
        FileOp::Delete { directory, .. } => {
            let r = if *directory { std::fs::remove_dir_all(path) } else { std::fs::remove_file(path) };
            match r {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(ctx("deleting", e)),
                _ => Ok(()),
            }
        }
        FileOp::Directory { mode, uid, gid, .. } => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(*mode)
                .create(path)
                .map_err(|e| ctx("creating directory", e))?;
            set_mode_owner(path, *mode, *uid, *gid).map_err(|e| ctx("setting mode/owner of", e))
        }
        FileOp::Write { content, mode, uid, gid, .. } => {
            if let Some(parent) = path.parent() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o755)
                    .create(parent)
                    .map_err(|e| ctx("creating the parent of", e))?;
            }
            let same = std::fs::read(path).is_ok_and(|old| old == *content);
            if !same {
                crate::process::write_atomic(path, content, *mode).map_err(|e| ctx("writing", e))?;
            }
            set_mode_owner(path, *mode, *uid, *gid).map_err(|e| ctx("setting mode/owner of", e))
        }
    }
}

fn set_mode_owner(path: &Path, mode: u32, uid: u32, gid: u32) -> io::Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    std::os::unix::fs::chown(path, Some(uid), Some(gid))
}
