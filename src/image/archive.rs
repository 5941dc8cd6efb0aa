//! Image tarballs in `imagesDirectory` (air-gapped nodes): `docker save` archives (`.tar`, or
//! gzip-compressed `.tar.gz`/`.tgz`) whose `manifest.json` lists the image's tags and its layers.

use super::reference::ImageRef;
use super::{Budget, Limits};
use serde::Deserialize;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Debug, Deserialize)]
struct ManifestEntry {
    #[serde(rename = "RepoTags", default)]
    repo_tags: Option<Vec<String>>,
    #[serde(rename = "Layers", default)]
    layers: Vec<String>,
}

fn open(path: &Path) -> io::Result<Box<dyn Read>> {
    let f = BufReader::new(File::open(path)?);
    let name = path.to_string_lossy();
    Ok(if name.ends_with(".gz") || name.ends_with(".tgz") {
        Box::new(flate2::read::GzDecoder::new(f))
    } else {
        Box::new(f)
    })
}

/// A `manifest.json` larger than this is not a docker image manifest.
const MAX_MANIFEST: u64 = 4 << 20;

/// Why a member could not be copied.
enum Copy {
    Missing,
    /// The member's size (more than the cap).
    TooLarge(u64),
}

/// Copy the member `member` of the archive at `path` into `out`, if it is at most `cap` bytes.
fn copy_member(
    path: &Path,
    member: &str,
    out: &mut dyn io::Write,
    cap: u64,
    cancel: &AtomicBool,
) -> io::Result<Result<(), Copy>> {
    let mut archive = tar::Archive::new(open(path)?);
    let want = member.trim_start_matches("./");
    for entry in archive.entries()? {
        if cancel.load(Ordering::Relaxed) {
            return Err(io::Error::new(io::ErrorKind::Interrupted, "canceled"));
        }
        let entry = entry?;
        if entry.path()?.to_string_lossy().trim_start_matches("./") == want {
            let size = entry.size();
            if size > cap {
                return Ok(Err(Copy::TooLarge(size)));
            }
            // The header's size is what tar reads, but never trust it twice.
            io::copy(&mut entry.take(cap), out)?;
            return Ok(Ok(()));
        }
    }
    Ok(Err(Copy::Missing))
}

/// The tarball in `dir` holding `image`, and its layers (member names, lowest first).
pub fn find(dir: &Path, image: &ImageRef, limits: &Limits, cancel: &AtomicBool) -> Option<(PathBuf, Vec<String>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir).ok()?.flatten().map(|e| e.path()).collect();
    files.sort();
    for path in files {
        let name = path.to_string_lossy();
        if !(name.ends_with(".tar") || name.ends_with(".tar.gz") || name.ends_with(".tgz")) || !path.is_file() {
            continue;
        }
        let mut raw = Vec::new();
        match copy_member(&path, "manifest.json", &mut raw, MAX_MANIFEST.min(limits.max_bytes), cancel) {
            Ok(Ok(())) => {}
            Ok(Err(Copy::Missing)) => continue,
            Ok(Err(Copy::TooLarge(n))) => {
                tracing::warn!("{}: manifest.json is {n} bytes, more than {MAX_MANIFEST}; skipped", path.display());
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return None,
            Err(e) => {
                tracing::warn!("cannot read image tarball {}: {e}", path.display());
                continue;
            }
        }
        let Ok(entries) = serde_json::from_slice::<Vec<ManifestEntry>>(&raw) else {
            tracing::warn!("{}: manifest.json is not a docker image manifest; skipped", path.display());
            continue;
        };
        for e in entries {
            let tags = e.repo_tags.unwrap_or_default();
            if tags.iter().filter_map(|t| ImageRef::parse(t).ok()).any(|t| t.same_image(image)) {
                return Some((path, e.layers));
            }
        }
    }
    None
}

/// Extract `layers` of the tarball `path` into `dest`, one at a time through a scratch file in
/// `scratch_dir` (see [`super::scratch_file`]).
pub fn extract(
    path: &Path,
    layers: &[String],
    dest: &Path,
    scratch_dir: &Path,
    cancel: &AtomicBool,
    limits: Limits,
) -> Result<(), String> {
    let mut budget = Budget::new(limits);
    for layer in layers {
        let mut f = super::scratch_file(scratch_dir)
            .map_err(|e| format!("cannot create a scratch file in {}: {e}", scratch_dir.display()))?;
        match copy_member(path, layer, &mut f, limits.max_bytes, cancel) {
            Ok(Ok(())) => {}
            Ok(Err(Copy::Missing)) => {
                return Err(format!("{}: layer {layer} listed in manifest.json is missing", path.display()));
            }
            Ok(Err(Copy::TooLarge(n))) => {
                return Err(format!("{}: layer {layer} is {n} bytes, {}", path.display(), limits.bytes_breach()));
            }
            Err(e) => return Err(format!("{}: reading layer {layer}: {e}", path.display())),
        }
        super::layers::extract(&f, dest, cancel, &mut budget)
            .map_err(|e| format!("{}: extracting layer {layer}: {}", path.display(), crate::error_line(&e)))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `manifest.json` of valid JSON padded past 4 MiB is not read whole: the tarball is skipped.
    #[test]
    fn a_huge_manifest_json_is_skipped_not_read_whole() {
        let d = tempfile::tempdir().unwrap();
        let mut m = br#"[{"RepoTags":["example.invalid/a/b:v1"],"Layers":[]}]"#.to_vec();
        m.resize(5 << 20, b' ');
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(m.len() as u64);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, "manifest.json", &m[..]).unwrap();
        std::fs::write(d.path().join("big.tar"), b.into_inner().unwrap()).unwrap();
        let image = ImageRef::parse("example.invalid/a/b:v1").unwrap();
        assert!(find(d.path(), &image, &Limits::default(), &AtomicBool::new(false)).is_none());
    }
}
