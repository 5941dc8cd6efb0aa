//! The owner lock on Windows (see [`super`]): the lock file is held open without sharing write or
//! delete access, and deleted when its last handle closes.

use super::LockError;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::windows::fs::OpenOptionsExt;
use std::path::Path;
use windows_sys::Win32::Foundation::{ERROR_SHARING_VIOLATION, GENERIC_READ, GENERIC_WRITE};
use windows_sys::Win32::Storage::FileSystem::{DELETE, FILE_FLAG_DELETE_ON_CLOSE, FILE_SHARE_READ};

/// A held owner lock; released (and its file deleted) when dropped or when its process dies.
#[derive(Debug)]
pub struct OwnerLock {
    _file: File,
}

/// Take the lock file `name` in `dir` (made if missing) without waiting. The file says the
/// holder's pid and, on the next line, `note`; it cannot be read while held (Windows lets no
/// other handle in), so a second instance learns no pid.
pub fn lock_file(dir: &Path, name: &str, note: &str) -> Result<OwnerLock, LockError> {
    let path = dir.join(name);
    let io_err = |what: &'static str, source: std::io::Error| LockError::Io { path: path.clone(), what, source };
    crate::safefs::open_dir(dir, Some(0o700)).map_err(|e| io_err("cannot make its directory", e))?;
    // `write`: what the standard library asks before it creates; `access_mode` is what is asked for.
    let mut file = match OpenOptions::new()
        .write(true)
        .access_mode(GENERIC_READ | GENERIC_WRITE | DELETE)
        .share_mode(FILE_SHARE_READ)
        .create(true)
        .truncate(true)
        .custom_flags(FILE_FLAG_DELETE_ON_CLOSE)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(ERROR_SHARING_VIOLATION as i32) => {
            return Err(LockError::Held { pid: None, path });
        }
        Err(e) => return Err(io_err("cannot open it", e)),
    };
    let text = match note {
        "" => format!("{}\n", std::process::id()),
        n => format!("{}\n{n}\n", std::process::id()),
    };
    // For people looking at the directory; the open handle is what counts.
    let _ = file.write_all(text.as_bytes());
    Ok(OwnerLock { _file: file })
}
