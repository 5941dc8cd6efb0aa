//! Layer extraction: one layer (a tar, gzip-compressed or not) unpacked over what the lower layers
//! left, with OCI whiteouts (`.wh.NAME` deletes NAME, `.wh..wh..opq` empties its directory)
//! applied to the lower layers first. A first pass counts the layer's bytes and entries against
//! the image's caps before anything is written. Paths stay inside the destination: an entry with a
//! `..` component is skipped, a leading `/` is dropped, nothing is written or removed below a
//! symlink or file a lower layer left, and device and FIFO entries are skipped.

use std::fs::File;
use std::io::{self, BufReader, Read, Seek};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

/// The layer from its start, decompressed when it is gzip.
fn open(layer: &File) -> io::Result<Box<dyn Read + '_>> {
    let mut f = layer;
    f.rewind()?;
    let mut magic = [0u8; 2];
    let n = f.read(&mut magic)?;
    f.rewind()?;
    let f = BufReader::new(f);
    Ok(if n == 2 && magic == [0x1f, 0x8b] { Box::new(flate2::read::GzDecoder::new(f)) } else { Box::new(f) })
}

/// A relative path without `.`, `..` or a root, or None.
fn clean(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// Remove everything in `dir` (a missing directory is empty), never following a symlink in it.
/// Every entry is tried; the first error is returned.
pub fn empty_dir(dir: &Path) -> io::Result<()> {
    let mut first = Ok(());
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if let Err(err) = remove_any(&e.path())
                && first.is_ok()
            {
                first = Err(err);
            }
        }
    }
    first
}

fn remove_any(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Whether every existing component of `rel` below `dest` is a real directory (never a symlink
/// or a file): only then may something under it be removed. A missing component means there is
/// nothing to remove below it.
fn real_dirs(dest: &Path, rel: &Path) -> bool {
    let mut at = dest.to_path_buf();
    for c in rel.components() {
        at.push(c);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return false,
            Err(_) => return true,
        }
    }
    true
}

/// Counts what passes through and refuses to go past `left` bytes.
struct Capped<'a, R> {
    inner: R,
    left: u64,
    read: u64,
    limits: &'a super::Limits,
}

impl<R: Read> Read for Capped<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        if self.read > self.left {
            return Err(io::Error::other(format!("the image decompresses to {}", self.limits.bytes_breach())));
        }
        Ok(n)
    }
}

/// Stop extracting once the instruction is canceled.
fn check(cancel: &AtomicBool) -> io::Result<()> {
    if cancel.load(Ordering::Relaxed) { Err(io::Error::new(io::ErrorKind::Interrupted, "canceled")) } else { Ok(()) }
}

/// Unpack the layer file `layer` (read from its start) into `dest`. The files are an installer's
/// payload that root will run, not a system to boot: they belong to the agent's effective user
/// (never to the image's uids, which may be a local user's), and setuid, setgid and the group and
/// other write bits are dropped, so no one but the agent can change them once written.
///
/// The first pass reads the whole decompressed layer before anything is written: it counts its
/// bytes and entries against what `budget` has left (all layers of one image together), so a
/// decompression bomb or a flood of entries is refused, one error line naming the cap, before
/// it reaches the disk.
pub(crate) fn extract(layer: &File, dest: &Path, cancel: &AtomicBool, budget: &mut super::Budget) -> io::Result<()> {
    // Pass 1: the caps, and the whiteouts, which only concern the lower layers. Whiteouts are
    // applied only once the whole layer is known to fit.
    let limits = budget.limits;
    let left = limits.max_bytes.saturating_sub(budget.bytes);
    let mut archive = tar::Archive::new(Capped { inner: open(layer)?, left, read: 0, limits: &limits });
    let mut whiteouts = Vec::new();
    for entry in archive.entries()? {
        check(cancel)?;
        budget.entries += 1;
        if budget.entries > limits.max_entries {
            return Err(io::Error::other(format!("the image has {}", limits.entries_breach())));
        }
        let entry = entry?;
        let Some(path) = clean(&entry.path()?) else { continue };
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        let parent = path.parent().unwrap_or(Path::new(""));
        if name == OPAQUE || name.starts_with(WHITEOUT) {
            whiteouts.push((parent.to_path_buf(), name.to_string()));
        }
    }
    // The rest of the stream (tar's end blocks, anything after them) counts too.
    let mut rest = archive.into_inner();
    io::copy(&mut rest, &mut io::sink())?;
    budget.bytes += rest.read;
    for (parent, name) in whiteouts {
        check(cancel)?;
        // Never through a symlink (or anything but directories) a lower layer planted.
        if !real_dirs(dest, &parent) {
            continue;
        }
        let target_dir = dest.join(&parent);
        if name == OPAQUE {
            empty_dir(&target_dir)?;
        } else if let Some(hidden) = name.strip_prefix(WHITEOUT)
            && !hidden.is_empty()
            && hidden != "."
            && hidden != ".."
            && !hidden.contains('/')
        {
            remove_any(&target_dir.join(hidden))?;
        }
    }
    // Pass 2: everything else.
    let mut archive = tar::Archive::new(open(layer)?);
    archive.set_preserve_permissions(true);
    archive.set_mask(0o6022);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    archive.set_preserve_ownerships(false);
    for entry in archive.entries()? {
        check(cancel)?;
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        if path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(WHITEOUT)) {
            continue;
        }
        let kind = entry.header().entry_type();
        if matches!(kind, tar::EntryType::Block | tar::EntryType::Char | tar::EntryType::Fifo) {
            continue;
        }
        let Some(p) = clean(&path) else { continue };
        // Whatever a lower layer has at this path is replaced (a directory stays for a directory
        // entry), but only below real directories: tar refuses to write through a symlink only
        // after this removal would have happened.
        if !real_dirs(dest, p.parent().unwrap_or(Path::new(""))) {
            continue;
        }
        let target = dest.join(&p);
        if let Ok(m) = std::fs::symlink_metadata(&target)
            && !(m.is_dir() && kind.is_dir())
        {
            remove_any(&target)?;
        }
        entry.unpack_in(dest)?;
    }
    Ok(())
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    fn budget() -> crate::image::Budget {
        crate::image::Budget::new(crate::image::Limits::default())
    }

    /// A tar with (path, content) files; a content of None makes a directory.
    fn tar_of(entries: &[(&str, Option<&[u8]>, u32)], gzip: bool) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, content, mode) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_mode(*mode);
            h.set_mtime(1_700_000_000);
            h.set_uid(0);
            h.set_gid(0);
            match content {
                Some(c) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(c.len() as u64);
                    b.append_data(&mut h, path, *c).unwrap();
                }
                None => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    b.append_data(&mut h, path, &[][..]).unwrap();
                }
            }
        }
        let raw = b.into_inner().unwrap();
        if !gzip {
            return raw;
        }
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &raw).unwrap();
        gz.finish().unwrap()
    }

    #[test]
    fn layers_stack_with_whiteouts_and_keep_modes() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("root");
        std::fs::create_dir(&dest).unwrap();
        let lower = tar_of(
            &[
                ("run.sh", Some(b"#!/bin/sh\necho one\n"), 0o755),
                ("old.txt", Some(b"old"), 0o644),
                ("dir", None, 0o755),
                ("dir/a", Some(b"a"), 0o600),
                ("gone", None, 0o755),
                ("gone/deep", Some(b"x"), 0o644),
            ],
            true,
        );
        let upper = tar_of(
            &[
                (".wh.old.txt", Some(b""), 0o644),
                (".wh.gone", Some(b""), 0o644),
                ("dir/.wh..wh..opq", Some(b""), 0o644),
                ("dir/b", Some(b"b"), 0o644),
                ("run.sh", Some(b"#!/bin/sh\necho two\n"), 0o750),
            ],
            false,
        );
        for (i, layer) in [lower, upper].iter().enumerate() {
            let f = d.path().join(format!("layer{i}"));
            std::fs::write(&f, layer).unwrap();
            extract(&File::open(&f).unwrap(), &dest, &AtomicBool::new(false), &mut budget()).unwrap();
        }
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &str| std::fs::metadata(dest.join(p)).unwrap().permissions().mode() & 0o777;
        assert_eq!(std::fs::read_to_string(dest.join("run.sh")).unwrap(), "#!/bin/sh\necho two\n");
        assert_eq!(mode("run.sh"), 0o750);
        assert!(!dest.join("old.txt").exists(), "a whiteout deletes the lower file");
        assert!(!dest.join("gone").exists(), "a whiteout deletes a lower directory");
        assert!(!dest.join("dir/a").exists(), "an opaque whiteout empties the lower directory");
        assert_eq!(std::fs::read_to_string(dest.join("dir/b")).unwrap(), "b", "but keeps the layer's own entries");
        assert!(!dest.join(".wh.old.txt").exists() && !dest.join("dir/.wh..wh..opq").exists());
    }

    /// A layer with symlinks and hard links: (path, kind, target or content).
    fn links_layer(entries: &[(&str, tar::EntryType, &str)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, arg) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o755);
            h.set_uid(0);
            h.set_gid(0);
            h.set_entry_type(*kind);
            match *kind {
                tar::EntryType::Symlink | tar::EntryType::Link => {
                    h.set_size(0);
                    b.append_link(&mut h, path, arg).unwrap();
                }
                tar::EntryType::Directory => {
                    h.set_size(0);
                    b.append_data(&mut h, path, &[][..]).unwrap();
                }
                _ => {
                    h.set_size(arg.len() as u64);
                    b.append_data(&mut h, path, arg.as_bytes()).unwrap();
                }
            }
        }
        b.into_inner().unwrap()
    }

    /// A lower layer's symlink to a host directory must not let a whiteout, or an entry that
    /// replaces what is in its way, remove anything there.
    #[test]
    fn no_removal_through_a_planted_symlink() {
        use tar::EntryType::{Directory, Regular, Symlink};
        let d = tempfile::tempdir().unwrap();
        let host = d.path().join("host");
        std::fs::create_dir_all(host.join("sub")).unwrap();
        std::fs::write(host.join("sub/keep"), "k").unwrap();
        std::fs::write(host.join("file"), "f").unwrap();
        let h = host.to_str().unwrap();
        let dest = d.path().join("root");
        std::fs::create_dir(&dest).unwrap();
        let layers = [
            links_layer(&[("a", Symlink, h)]),
            links_layer(&[
                ("a/.wh..wh..opq", Regular, ""),
                ("a/.wh.file", Regular, ""),
                ("a/sub/.wh.keep", Regular, ""),
            ]),
            links_layer(&[("b", Symlink, h), ("b/sub", Regular, "x"), ("b/file", Directory, "")]),
        ];
        for (i, l) in layers.iter().enumerate() {
            let f = d.path().join(format!("l{i}"));
            std::fs::write(&f, l).unwrap();
            let _ = extract(&File::open(&f).unwrap(), &dest, &AtomicBool::new(false), &mut budget());
        }
        assert_eq!(std::fs::read_to_string(host.join("sub/keep")).unwrap(), "k");
        assert_eq!(std::fs::read_to_string(host.join("file")).unwrap(), "f");
    }

    #[test]
    fn an_upper_layer_replaces_files_with_hard_links_and_drops_setuid() {
        use tar::EntryType::{Link, Regular};
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("root");
        std::fs::create_dir(&dest).unwrap();
        let mut lower = links_layer(&[("bin/x", Regular, "old")]);
        let f = d.path().join("l0");
        std::fs::write(&f, &lower).unwrap();
        extract(&File::open(&f).unwrap(), &dest, &AtomicBool::new(false), &mut budget()).unwrap();
        lower = links_layer(&[("bin/y", Regular, "new"), ("bin/x", Link, "bin/y")]);
        std::fs::write(&f, &lower).unwrap();
        extract(&File::open(&f).unwrap(), &dest, &AtomicBool::new(false), &mut budget()).unwrap();
        assert_eq!(std::fs::read_to_string(dest.join("bin/x")).unwrap(), "new");
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o4755);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(1);
        h.set_entry_type(Regular);
        b.append_data(&mut h, "suid", &b"x"[..]).unwrap();
        std::fs::write(&f, b.into_inner().unwrap()).unwrap();
        extract(&File::open(&f).unwrap(), &dest, &AtomicBool::new(false), &mut budget()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(dest.join("suid")).unwrap().permissions().mode() & 0o7777, 0o755);
        let canceled = AtomicBool::new(true);
        assert_eq!(
            extract(&File::open(&f).unwrap(), &dest, &canceled, &mut budget()).unwrap_err().kind(),
            io::ErrorKind::Interrupted
        );
    }

    /// An image's file owned by a local user's uid and writable by everyone is extracted owned by
    /// the agent, without group or other write bits (directories too).
    #[test]
    fn extracted_files_belong_to_the_agent_and_are_not_group_or_world_writable() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("root");
        std::fs::create_dir(&dest).unwrap();
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, mode) in
            [("bin", tar::EntryType::Directory, 0o777), ("bin/run.sh", tar::EntryType::Regular, 0o777)]
        {
            let mut h = tar::Header::new_gnu();
            h.set_mode(mode);
            h.set_uid(1000);
            h.set_gid(1000);
            h.set_entry_type(kind);
            let data: &[u8] = if kind.is_dir() { b"" } else { b"#!/bin/sh\n" };
            h.set_size(data.len() as u64);
            b.append_data(&mut h, path, data).unwrap();
        }
        let f = d.path().join("l");
        std::fs::write(&f, b.into_inner().unwrap()).unwrap();
        extract(&File::open(&f).unwrap(), &dest, &AtomicBool::new(false), &mut budget()).unwrap();
        let euid = rustix::process::geteuid().as_raw();
        for p in ["bin", "bin/run.sh"] {
            let m = std::fs::symlink_metadata(dest.join(p)).unwrap();
            assert_eq!((m.uid(), m.mode() & 0o7777), (euid, 0o755), "{p}");
        }
    }

    #[test]
    fn nothing_is_written_outside_the_destination() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("root");
        std::fs::create_dir(&dest).unwrap();
        std::fs::write(d.path().join("victim"), "keep").unwrap();
        // tar's Builder refuses `..` paths, so write the header name by hand.
        let mut h = tar::Header::new_gnu();
        h.as_gnu_mut().unwrap().name[..9].copy_from_slice(b"../victim");
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(3);
        h.set_mode(0o644);
        h.set_cksum();
        let mut b = tar::Builder::new(Vec::new());
        b.append(&h, &b"bad"[..]).unwrap();
        let mut wh = tar::Header::new_gnu();
        wh.as_gnu_mut().unwrap().name[..12].copy_from_slice(b"../.wh.victi");
        wh.set_entry_type(tar::EntryType::Regular);
        wh.set_size(0);
        wh.set_cksum();
        b.append(&wh, &[][..]).unwrap();
        let f = d.path().join("evil");
        std::fs::write(&f, b.into_inner().unwrap()).unwrap();
        let _ = extract(&File::open(&f).unwrap(), &dest, &AtomicBool::new(false), &mut budget());
        assert_eq!(std::fs::read_to_string(d.path().join("victim")).unwrap(), "keep");
    }
}
