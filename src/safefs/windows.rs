//! The Windows backend of [`super`]. A path is walked from its drive's root one component at a
//! time, each directory opened with a handle that does not follow a reparse point and does not
//! share delete access: while the walk ([`Pinned`]) holds those handles, no directory on the path
//! can be renamed, removed or replaced by a link, so what is then done by path happens where the
//! walk looked. A reparse point on the way (a symbolic link, a junction, a volume mount point) is
//! refused with an error naming it: unlike on Unix, none is followed, since Windows lets any user
//! make a junction in a directory they may write.

use super::{Owner, err, split};
use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::windows::fs::{MetadataExt, OpenOptionsExt};
use std::os::windows::io::AsRawHandle;
use std::path::{Component, Path, PathBuf};
use windows_sys::Win32::Foundation::STATUS_SUCCESS;
use windows_sys::Win32::Security::Cryptography::{BCRYPT_USE_SYSTEM_PREFERRED_RNG, BCryptGenRandom};
use windows_sys::Win32::Storage::FileSystem::{
    FILE_ATTRIBUTE_DIRECTORY, FILE_ATTRIBUTE_REPARSE_POINT, FILE_FLAG_BACKUP_SEMANTICS, FILE_FLAG_OPEN_REPARSE_POINT,
    FILE_READ_ATTRIBUTES, FILE_SHARE_READ, FILE_SHARE_WRITE, FILE_TYPE_DISK, GetFileType, SYNCHRONIZE,
};

/// A walked directory: the handles of every directory from the root down to it, held open so that
/// none of them can be renamed or removed meanwhile, and its path.
#[derive(Debug)]
pub struct Pinned {
    path: PathBuf,
    _held: Vec<File>,
}

impl Pinned {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Open `path` itself (never what a reparse point there names), sharing read and write but not
/// delete; directories need backup semantics to be opened at all.
fn open_nofollow(path: &Path, access: u32) -> io::Result<File> {
    OpenOptions::new()
        .access_mode(access)
        .share_mode(FILE_SHARE_READ | FILE_SHARE_WRITE)
        .custom_flags(FILE_FLAG_BACKUP_SEMANTICS | FILE_FLAG_OPEN_REPARSE_POINT)
        .open(path)
}

fn is_reparse(attrs: u32) -> bool {
    attrs & FILE_ATTRIBUTE_REPARSE_POINT != 0
}

fn refused_link(name: &Path, shown: &Path) -> io::Error {
    err(
        io::ErrorKind::PermissionDenied,
        format!(
            "refusing to follow {} in {}: it is a symbolic link, junction or mount point (none is followed on Windows)",
            name.display(),
            shown.display()
        ),
    )
}

/// Walk to the directory `path` under the module's rules; with `create`, missing directories are
/// made. A relative path is taken from the current directory.
fn walk(path: &Path, create: bool) -> io::Result<Pinned> {
    let abs = std::path::absolute(path)?;
    let mut cur = PathBuf::new();
    let mut held = Vec::new();
    for comp in abs.components() {
        match comp {
            Component::Prefix(p) => cur.push(p.as_os_str()),
            Component::RootDir => {
                cur.push(Component::RootDir.as_os_str());
                held.push(open_nofollow(&cur, FILE_READ_ATTRIBUTES | SYNCHRONIZE)?);
            }
            Component::CurDir => {}
            Component::ParentDir => {
                return Err(err(io::ErrorKind::InvalidInput, format!("{}: \"..\" is not allowed", path.display())));
            }
            Component::Normal(name) => {
                cur.push(name);
                held.push(enter(&cur, name, create, path)?);
            }
        }
    }
    Ok(Pinned { path: cur, _held: held })
}

/// Open the directory `cur` (the component `name` of `shown`), making it first when `create`.
fn enter(cur: &Path, name: &OsStr, create: bool, shown: &Path) -> io::Result<File> {
    loop {
        match open_nofollow(cur, FILE_READ_ATTRIBUTES | SYNCHRONIZE) {
            Ok(f) => {
                let attrs = f.metadata()?.file_attributes();
                if is_reparse(attrs) {
                    return Err(refused_link(Path::new(name), shown));
                }
                if attrs & FILE_ATTRIBUTE_DIRECTORY == 0 {
                    return Err(err(io::ErrorKind::NotADirectory, format!("{} is not a directory", cur.display())));
                }
                return Ok(f);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound && create => match std::fs::create_dir(cur) {
                Ok(()) => continue,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            },
            Err(e) => return Err(e),
        }
    }
}

/// Open the directory `path`, walking it under the module's rules; with `create`, missing
/// directories are made (`create`'s mode is not applied on Windows).
pub fn open_dir(path: &Path, create: Option<u32>) -> io::Result<Pinned> {
    walk(path, create.is_some())
}

/// 64 unguessable bits (the system's preferred generator), for names nobody may predict.
pub(crate) fn random_u64() -> io::Result<u64> {
    let mut rnd = [0u8; 8];
    // SAFETY: a buffer of the length given; no algorithm handle with the system's generator.
    let status = unsafe {
        BCryptGenRandom(std::ptr::null_mut(), rnd.as_mut_ptr(), rnd.len() as u32, BCRYPT_USE_SYSTEM_PREFERRED_RNG)
    };
    if status != STATUS_SUCCESS {
        return Err(io::Error::other(format!("BCryptGenRandom failed ({status:#x})")));
    }
    Ok(u64::from_ne_bytes(rnd))
}

/// An unguessable name for a temporary file beside `name`.
pub(crate) fn temp_name(name: &OsStr) -> io::Result<OsString> {
    let base = name.to_string_lossy();
    let base: String = base.chars().take(100).collect();
    Ok(format!(".{base}.{:016x}.tmp", random_u64()?).into())
}

/// The regular file at `path` (never through a reparse point), open for reading, with its size;
/// `Ok(None)` when absent.
fn open_regular(path: &Path) -> io::Result<Option<(File, u64)>> {
    let f = match OpenOptions::new()
        .read(true)
        .share_mode(FILE_SHARE_READ)
        .custom_flags(FILE_FLAG_BACKUP_SEMANTICS | FILE_FLAG_OPEN_REPARSE_POINT)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let m = regular(&f)?;
    if is_reparse(m.file_attributes()) {
        return Err(err(io::ErrorKind::InvalidInput, "is a symbolic link or junction (not followed)".into()));
    }
    Ok(Some((f, m.len())))
}

/// `f`'s metadata; `Err` unless it is a file on a disk (not a device such as `NUL` or `CON`, a
/// pipe, or a directory).
fn regular(f: &File) -> io::Result<std::fs::Metadata> {
    // SAFETY: a valid open handle.
    if unsafe { GetFileType(f.as_raw_handle()) } != FILE_TYPE_DISK {
        return Err(err(io::ErrorKind::InvalidInput, "is not a regular file (a device or pipe)".into()));
    }
    let m = f.metadata()?;
    if m.is_dir() {
        return Err(err(io::ErrorKind::InvalidInput, "is not a regular file (a directory)".into()));
    }
    Ok(m)
}

/// Write `data` to `path` atomically, under the module's rules. Missing parent directories are
/// made. When the file already holds `data` nothing is written. Returns whether the content was
/// replaced. `mode` and `owner` are not applied on Windows.
pub fn write_file(path: &Path, data: &[u8], mode: u32, owner: Option<Owner>) -> io::Result<bool> {
    let _ = (mode, owner);
    write_path(path, data, true)
}

fn write_path(path: &Path, data: &[u8], durable: bool) -> io::Result<bool> {
    let (parent, name) = split(path)?;
    let dir = walk(parent, true)?;
    let target = dir.path().join(name);
    if let Ok(Some((mut f, len))) = open_regular(&target)
        && len == data.len() as u64
    {
        let mut old = Vec::with_capacity(data.len());
        (&mut f).take(len + 1).read_to_end(&mut old)?;
        if old == data {
            return Ok(false);
        }
    }
    let tmp = dir.path().join(temp_name(name)?);
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(data)?;
        if durable {
            f.sync_all()?;
        }
        drop(f);
        // MoveFileExW with MOVEFILE_REPLACE_EXISTING: what is at the name (a link among them) is
        // replaced, never followed; a directory there makes it fail.
        std::fs::rename(&tmp, &target)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map(|()| true)
}

/// [`write_file`] without an owner, for the files nodeplan keeps for itself.
pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    write_file(path, data, mode, None).map(drop)
}

/// [`write_atomic`] of a record that only shows state: not synced to disk.
pub fn write_shown(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let _ = mode;
    write_path(path, data, false).map(drop)
}

/// Make the directory `path` and missing parents (`mode` and `owner` are not applied on Windows).
pub fn make_dir(path: &Path, mode: u32, owner: Option<Owner>) -> io::Result<()> {
    let _ = (mode, owner);
    walk(path, true).map(drop)
}

/// Remove the file (or, with `directory`, the directory tree) `path`. The parent is walked under
/// the module's rules; a reparse point at `path` is removed itself, and inside the tree none is
/// followed (the standard library's removal works through handles and never follows one). Absent
/// is not an error.
pub fn remove(path: &Path, directory: bool) -> io::Result<()> {
    let (parent, name) = split(path)?;
    let dir = match walk(parent, false) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let target = dir.path().join(name);
    let meta = match std::fs::symlink_metadata(&target) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let result = match (meta.is_dir(), is_reparse(meta.file_attributes())) {
        // A link or junction to a directory: the link goes, never what it names.
        (true, true) => std::fs::remove_dir(&target),
        (true, false) if directory => std::fs::remove_dir_all(&target),
        (true, false) => Err(err(io::ErrorKind::IsADirectory, format!("{} is a directory", target.display()))),
        (false, _) => std::fs::remove_file(&target),
    };
    match result {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Read a small file someone else may have planted: the parent is walked under the module's
/// rules, the file itself is opened without following a reparse point and must be a regular file
/// of at most `cap` bytes. `Ok(None)` when it does not exist.
pub fn read_small(path: &Path, cap: u64) -> io::Result<Option<Vec<u8>>> {
    let (parent, name) = split(path)?;
    let dir = match walk(parent, false) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    match open_regular(&dir.path().join(name))? {
        Some((f, len)) => read_capped(f, len, cap).map(Some),
        None => Ok(None),
    }
}

/// Read a file named on the command line: a link is followed, as for any path the operator typed,
/// but it must be a regular file of at most `cap` bytes.
pub fn read_named(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    // A directory opens only with backup semantics, and is then named as one.
    let f = OpenOptions::new().read(true).custom_flags(FILE_FLAG_BACKUP_SEMANTICS).open(path)?;
    let m = regular(&f)?;
    read_capped(f, m.len(), cap)
}

fn read_capped(f: File, len: u64, cap: u64) -> io::Result<Vec<u8>> {
    if len > cap {
        return Err(err(io::ErrorKind::InvalidInput, format!("is {len} bytes, more than the {cap} allowed")));
    }
    let mut out = Vec::with_capacity(len as usize);
    f.take(cap + 1).read_to_end(&mut out)?;
    if out.len() as u64 > cap {
        return Err(err(io::ErrorKind::InvalidInput, format!("grew past the {cap} bytes allowed")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_replaces_the_file_and_leaves_no_temporary_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a").join("b").join("f.txt");
        assert!(write_file(&p, b"one", 0o600, None).unwrap());
        assert!(!write_file(&p, b"one", 0o600, None).unwrap(), "the same content is not written again");
        write_shown(&p, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(p.parent().unwrap()).unwrap().count(), 1, "no temporary file left");
        assert_eq!(read_small(&p, 3).unwrap().unwrap(), b"two");
        assert!(read_small(&p, 2).unwrap_err().to_string().contains("more than the 2 allowed"));
        assert_eq!(read_small(&d.path().join("absent"), 9).unwrap(), None);
        assert_eq!(read_small(&d.path().join("no").join("dir"), 9).unwrap(), None);
    }

    #[test]
    fn removal_takes_files_and_trees_and_absent_is_no_error() {
        let d = tempfile::tempdir().unwrap();
        let t = d.path().join("t");
        write_file(&t.join("x").join("f"), b"1", 0o644, None).unwrap();
        assert_eq!(remove(&t, false).unwrap_err().kind(), io::ErrorKind::IsADirectory);
        remove(&t.join("x").join("f"), false).unwrap();
        remove(&t, true).unwrap();
        assert!(!t.exists());
        remove(&t, true).unwrap();
        remove(&d.path().join("no").join("such"), false).unwrap();
    }

    #[test]
    fn devices_and_directories_are_not_read_as_files() {
        let d = tempfile::tempdir().unwrap();
        let e = read_named(d.path(), 10).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        let e = read_named(Path::new("NUL"), 10).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
}
