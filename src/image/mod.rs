//! Image staging for `image` instructions, as system-agent's `pkg/image` does it: the image is
//! found in a tarball under `imagesDirectory` (air-gapped nodes; matched by tag, so never for a
//! reference pinned to a digest) or pulled from its registry (mirrors, credentials and TLS from the
//! registries file; every pulled layer is verified against its sha256 digest, and against its size
//! when the manifest gives one), and the layers are extracted in order into the instruction's
//! execution directory, whose `run.sh` is then the default command. A tarball's layers are not
//! checked against digests; the caps and the extraction rules apply to them all the same.
//!
//! Owns image references, the registries file, image tarballs, the registry protocol and layer
//! extraction. It must not spawn processes or know what a plan is; the applyinator decides when to
//! stage and what a failure means.

mod archive;
mod layers;
mod reference;
mod registries;
mod registry;

pub use reference::{ImageRef, redact_userinfo};
pub use registries::Registries;

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Where images come from.
#[derive(Debug, Clone, Default)]
pub struct ImageConfig {
    /// Tarballs searched before any pull (`imagesDirectory`).
    pub images_dir: Option<PathBuf>,
    /// The registries file (`agentRegistriesFile`); read at every pull, so edits apply at once.
    pub registries_file: Option<PathBuf>,
    /// What one image may cost.
    pub limits: Limits,
}

/// Caps on the work an image (outside input) can cause. The defaults are far above real
/// installer images (rke2/k3s installers are a few hundred MB uncompressed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes all layers of one image may decompress to together (`imageMaxBytes`); also the
    /// largest layer download.
    pub max_bytes: u64,
    /// Tar entries all layers of one image may hold together (`imageMaxEntries`).
    pub max_entries: u64,
}

pub use crate::config::{
    DEFAULT_IMAGE_MAX_BYTES as DEFAULT_MAX_BYTES, DEFAULT_IMAGE_MAX_ENTRIES as DEFAULT_MAX_ENTRIES,
};

impl Default for Limits {
    fn default() -> Limits {
        Limits { max_bytes: DEFAULT_MAX_BYTES, max_entries: DEFAULT_MAX_ENTRIES }
    }
}

impl Limits {
    fn bytes_breach(&self) -> String {
        format!(
            "more than {} bytes, the cap (raise imageMaxBytes in the agent's config, or --image-max-bytes for nodeplan apply)",
            self.max_bytes
        )
    }
    fn entries_breach(&self) -> String {
        format!(
            "more than {} entries, the cap (raise imageMaxEntries in the agent's config, or --image-max-entries for nodeplan apply)",
            self.max_entries
        )
    }
}

/// What one image has used of its [`Limits`] so far, across its layers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    pub limits: Limits,
    pub bytes: u64,
    pub entries: u64,
}

impl Budget {
    pub fn new(limits: Limits) -> Budget {
        Budget { limits, bytes: 0, entries: 0 }
    }
}

/// Why an image could not be staged: one line that names the image (and, for a pull, every
/// source tried).
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The reference does not parse.
    #[error("{0}")]
    Reference(String),
    /// The task searching and extracting tarballs on the blocking pool failed.
    #[error("{0}")]
    Task(#[source] tokio::task::JoinError),
    /// The image is in a tarball under the images directory, and extracting it failed.
    #[error("image {image}: {message}")]
    Tarball { image: String, message: String },
    /// The registries file cannot be used.
    #[error("image {image}: {message}")]
    Registries { image: String, message: String },
    /// No endpoint gave the image: what each one said.
    #[error("cannot stage image {image}: {}", .tried.join("; "))]
    Pull { image: String, tried: Vec<String> },
}

/// Stages images into execution directories.
#[derive(Debug, Clone, Default)]
pub struct Stager {
    cfg: ImageConfig,
}

impl Stager {
    pub fn new(cfg: ImageConfig) -> Stager {
        Stager { cfg }
    }

    /// Put the filesystem of `image` into `dest` (an existing, empty directory). Returns where it
    /// came from, for the log. Scratch files (one layer at a time) go to `dest`'s parent, the
    /// per-apply directory.
    pub async fn stage(&self, image: &str, dest: &Path) -> Result<String, StageError> {
        let r = ImageRef::parse(image).map_err(StageError::Reference)?;
        let scratch = dest.parent().unwrap_or(Path::new(".")).to_path_buf();
        // Dropping this future (a cancel) stops any extraction still running on the blocking
        // pool at its next entry; scratch files have no name, so nothing is left behind.
        let guard = Abandon { cancel: Arc::new(AtomicBool::new(false)) };
        let cancel = guard.cancel.clone();
        // A tarball only has tags: a reference pinned to a digest is always pulled and verified.
        if let Some(dir) = self.cfg.images_dir.clone().filter(|d| d.is_dir() && r.digest.is_none()) {
            let (want, to, tmp, stop) = (r.clone(), dest.to_path_buf(), scratch.clone(), cancel.clone());
            let limits = self.cfg.limits;
            let found = tokio::task::spawn_blocking(move || {
                archive::find(&dir, &want, &limits, &stop).map(|(tarball, layers)| {
                    let done = archive::extract(&tarball, &layers, &to, &tmp, &stop, limits);
                    (tarball, done)
                })
            })
            .await
            .map_err(StageError::Task)?;
            if let Some((tarball, done)) = found {
                done.map_err(|message| StageError::Tarball { image: r.to_string(), message })?;
                return Ok(format!("from {}", tarball.display()));
            }
        }
        let regs = match &self.cfg.registries_file {
            Some(p) => {
                Registries::load(p).map_err(|message| StageError::Registries { image: r.to_string(), message })?
            }
            None => Registries::default(),
        };
        let mut tried = Vec::new();
        let pulling = std::time::Instant::now();
        for ep in regs.endpoints(&r.registry) {
            // What a failed endpoint left half-extracted must not mix with the next attempt.
            let _ = layers::empty_dir(dest);
            match registry::pull(&ep, &r, dest, &scratch, &cancel, self.cfg.limits).await {
                Ok(()) => {
                    crate::metrics::image_pulled(true, pulling.elapsed());
                    return Ok(format!("pulled from {}", ep.shown()));
                }
                Err(e) => tried.push(format!("{}: {e}", ep.shown())),
            }
        }
        crate::metrics::image_pulled(false, pulling.elapsed());
        let _ = layers::empty_dir(dest);
        Err(StageError::Pull { image: r.to_string(), tried })
    }
}

struct Abandon {
    cancel: Arc<AtomicBool>,
}

impl Drop for Abandon {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

/// A scratch file in `dir` for one layer, readable and writable by the agent only: anonymous
/// (`O_TMPFILE`, mode 0600), so there is no path another user could pre-plant (a symlink to a
/// file root would then overwrite) or open. Where the filesystem has no `O_TMPFILE`, a random
/// name is created with `O_EXCL|O_NOFOLLOW`, mode 0600, and unlinked at once.
#[cfg(unix)]
pub(crate) fn scratch_file(dir: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let anon = OpenOptions::new().read(true).write(true).mode(0o600).custom_flags(libc::O_TMPFILE).open(dir);
    match anon {
        Ok(f) => return Ok(f),
        Err(e) if !matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EISDIR | libc::ENOENT)) => return Err(e),
        Err(_) => {}
    }
    let (f, path) = new_random_file(dir, |o| o.mode(0o600).custom_flags(libc::O_NOFOLLOW))?;
    std::fs::remove_file(&path)?;
    Ok(f)
}

/// On Windows: a new file of a random name, shared with no other handle and deleted when closed.
#[cfg(windows)]
pub(crate) fn scratch_file(dir: &Path) -> std::io::Result<File> {
    use std::os::windows::fs::OpenOptionsExt;
    use windows_sys::Win32::Storage::FileSystem::FILE_FLAG_DELETE_ON_CLOSE;
    new_random_file(dir, |o| o.share_mode(0).custom_flags(FILE_FLAG_DELETE_ON_CLOSE)).map(|(f, _)| f)
}

/// A new file of an unguessable name in `dir`, opened for reading and writing with the options
/// `how` adds, and its path.
fn new_random_file(dir: &Path, how: impl Fn(&mut OpenOptions) -> &mut OpenOptions) -> std::io::Result<(File, PathBuf)> {
    for _ in 0..16 {
        let path = dir.join(format!(".nodeplan-layer-{:016x}", crate::safefs::random_u64()?));
        match how(OpenOptions::new().read(true).write(true).create_new(true)).open(&path) {
            Ok(f) => return Ok((f, path)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other(format!("no free scratch file name in {}", dir.display())))
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    /// The old scratch path `.<name>.layer` beside the execution directory, pre-planted as a
    /// symlink to a file root must not write: staging never follows it, nor leaves a file.
    #[tokio::test]
    async fn staging_never_writes_through_a_planted_scratch_path() {
        let d = tempfile::tempdir().unwrap();
        let images = d.path().join("images");
        std::fs::create_dir(&images).unwrap();
        let mut layer = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o755);
        h.set_size(3);
        h.set_entry_type(tar::EntryType::Regular);
        layer.append_data(&mut h, "run.sh", &b"#!x"[..]).unwrap();
        let layer = layer.into_inner().unwrap();
        let manifest = br#"[{"RepoTags":["example.invalid/a/b:v1"],"Layers":["l/layer.tar"]}]"#;
        let mut tarball = tar::Builder::new(Vec::new());
        for (name, data) in [("manifest.json", &manifest[..]), ("l/layer.tar", &layer[..])] {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o644);
            h.set_size(data.len() as u64);
            h.set_entry_type(tar::EntryType::Regular);
            tarball.append_data(&mut h, name, data).unwrap();
        }
        std::fs::write(images.join("b.tar"), tarball.into_inner().unwrap()).unwrap();
        let stamp = d.path().join("stamp");
        let dest = stamp.join("sum_0");
        std::fs::create_dir_all(&dest).unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, stamp.join(".sum_0.layer")).unwrap();
        let stager = Stager::new(ImageConfig { images_dir: Some(images), ..Default::default() });
        stager.stage("example.invalid/a/b:v1", &dest).await.unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        assert_eq!(std::fs::read(dest.join("run.sh")).unwrap(), b"#!x");
        let left: Vec<_> = std::fs::read_dir(&stamp).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 2, "only the execution directory and the planted link: {left:?}");
    }

    #[test]
    fn scratch_files_have_no_name_and_mode_0600() {
        let d = tempfile::tempdir().unwrap();
        let mut f = scratch_file(d.path()).unwrap();
        f.write_all(b"layer").unwrap();
        f.rewind().unwrap();
        let mut back = String::new();
        f.read_to_string(&mut back).unwrap();
        assert_eq!(back, "layer");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(f.metadata().unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }
}
