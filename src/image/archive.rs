//! Image tarballs in `imagesDirectory` (air-gapped nodes): `docker save` archives (`.tar`, or
//! gzip-compressed `.tar.gz`/`.tgz`) whose `manifest.json` lists the image's tags and its layers.

use super::reference::ImageRef;
use serde::Deserialize;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};

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

/// Copy the member `member` of the archive at `path` into `out`; false when there is none.
fn copy_member(path: &Path, member: &str, out: &mut dyn io::Write) -> io::Result<bool> {
    let mut archive = tar::Archive::new(open(path)?);
    let want = member.trim_start_matches("./");
    for entry in archive.entries()? {
        let mut entry = entry?;
        if entry.path()?.to_string_lossy().trim_start_matches("./") == want {
            io::copy(&mut entry, out)?;
            return Ok(true);
        }
    }
    Ok(false)
}

/// The tarball in `dir` holding `image`, and its layers (member names, lowest first).
pub fn find(dir: &Path, image: &ImageRef) -> Option<(PathBuf, Vec<String>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir).ok()?.flatten().map(|e| e.path()).collect();
    files.sort();
    for path in files {
        let name = path.to_string_lossy();
        if !(name.ends_with(".tar") || name.ends_with(".tar.gz") || name.ends_with(".tgz")) || !path.is_file() {
            continue;
        }
        let mut raw = Vec::new();
        match copy_member(&path, "manifest.json", &mut raw) {
            Ok(true) => {}
            Ok(false) => continue,
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
    cancel: &std::sync::atomic::AtomicBool,
) -> Result<(), String> {
    for layer in layers {
        let mut f = super::scratch_file(scratch_dir)
            .map_err(|e| format!("cannot create a scratch file in {}: {e}", scratch_dir.display()))?;
        match copy_member(path, layer, &mut f) {
            Ok(true) => {}
            Ok(false) => return Err(format!("{}: layer {layer} listed in manifest.json is missing", path.display())),
            Err(e) => return Err(format!("{}: reading layer {layer}: {e}", path.display())),
        }
        super::layers::extract(&f, dest, cancel)
            .map_err(|e| format!("{}: extracting layer {layer}: {}", path.display(), crate::error_line(&e)))?;
    }
    Ok(())
}
