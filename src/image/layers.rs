//! Layer extraction: one layer (a tar, gzip-compressed or not) unpacked over what the lower layers
//! left, with OCI whiteouts (`.wh.NAME` deletes NAME, `.wh..wh..opq` empties its directory)
//! applied to the lower layers first. Paths stay inside the destination (`..` and absolute paths
//! are refused by `tar`'s `unpack_in`).

use std::fs::File;
use std::io::{self, BufReader, Read, Seek};
use std::path::{Component, Path, PathBuf};

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

fn open(layer: &Path) -> io::Result<Box<dyn Read>> {
    let mut f = File::open(layer)?;
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

fn remove_any(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Unpack the layer file `layer` into `dest`.
pub fn extract(layer: &Path, dest: &Path) -> io::Result<()> {
    // Pass 1: the whiteouts, which only concern the lower layers.
    let mut archive = tar::Archive::new(open(layer)?);
    for entry in archive.entries()? {
        let entry = entry?;
        let Some(path) = clean(&entry.path()?) else { continue };
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        let parent = path.parent().unwrap_or(Path::new(""));
        // Never through a symlink a lower layer planted: whiteouts only touch real directories.
        let target_dir = dest.join(parent);
        if target_dir.strip_prefix(dest).is_err()
            || std::fs::symlink_metadata(&target_dir).is_ok_and(|m| m.file_type().is_symlink())
        {
            continue;
        }
        if name == OPAQUE {
            if let Ok(rd) = std::fs::read_dir(&target_dir) {
                for e in rd.flatten() {
                    remove_any(&e.path())?;
                }
            }
        } else if let Some(hidden) = name.strip_prefix(WHITEOUT)
            && !hidden.is_empty()
            && hidden != "."
            && hidden != ".."
        {
            remove_any(&target_dir.join(hidden))?;
        }
    }
    // Pass 2: everything else.
    let mut archive = tar::Archive::new(open(layer)?);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    archive.set_preserve_ownerships(rustix::process::geteuid().is_root());
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        if path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(WHITEOUT)) {
            continue;
        }
        if matches!(entry.header().entry_type(), tar::EntryType::Block | tar::EntryType::Char | tar::EntryType::Fifo) {
            continue;
        }
        // An existing directory in the way of a file (or the reverse) is replaced, as a later
        // layer means.
        if let Some(p) = clean(&path) {
            let target = dest.join(&p);
            let is_dir_entry = entry.header().entry_type().is_dir();
            if let Ok(m) = std::fs::symlink_metadata(&target)
                && (m.is_dir() != is_dir_entry || m.file_type().is_symlink())
            {
                remove_any(&target)?;
            }
        }
        entry.unpack_in(dest)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
            extract(&f, &dest).unwrap();
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
        let _ = extract(&f, &dest);
        assert_eq!(std::fs::read_to_string(d.path().join("victim")).unwrap(), "keep");
    }
}
