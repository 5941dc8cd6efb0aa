//! Image staging for `image` instructions, as system-agent's `pkg/image` does it: the image is
//! found in a tarball under `imagesDirectory` (air-gapped nodes) or pulled from its registry
//! (mirrors, credentials and TLS from the registries file), every layer is verified against its
//! digest, and the layers are extracted in order into the instruction's execution directory,
//! whose `run.sh` is then the default command.
//!
//! Owns image references, the registries file, the registry protocol and layer extraction. It
//! must not spawn processes or know what a plan is; the applyinator decides when to stage and
//! what a failure means.

mod archive;
mod layers;
mod reference;
mod registries;
mod registry;

pub use reference::ImageRef;
pub use registries::Registries;

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
    /// came from, for the log. The error is one line naming the image and every source tried.
    pub async fn stage(&self, image: &str, dest: &Path) -> Result<String, String> {
        let r = ImageRef::parse(image)?;
        let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        // Dropping this future (a cancel) stops any extraction still running on the blocking
        // pool at its next entry, and removes the scratch file.
        let guard = Abandon {
            cancel: Arc::new(AtomicBool::new(false)),
            scratch: dest.with_file_name(format!(".{name}.layer")),
        };
        let (cancel, scratch) = (guard.cancel.clone(), guard.scratch.clone());
        // A tarball only has tags: a reference pinned to a digest is always pulled and verified.
        if let Some(dir) = self.cfg.images_dir.clone().filter(|d| d.is_dir() && r.digest.is_none()) {
            let (want, to, tmp, stop) = (r.clone(), dest.to_path_buf(), scratch.clone(), cancel.clone());
            let found = tokio::task::spawn_blocking(move || {
                archive::find(&dir, &want).map(|(tarball, layers)| {
                    let done = archive::extract(&tarball, &layers, &to, &tmp, &stop);
                    (tarball, done)
                })
            })
            .await
            .map_err(|e| e.to_string())?;
            if let Some((tarball, done)) = found {
                done.map_err(|e| format!("image {r}: {e}"))?;
                return Ok(format!("from {}", tarball.display()));
            }
        }
        let regs = match &self.cfg.registries_file {
            Some(p) => Registries::load(p).map_err(|e| format!("image {r}: {e}"))?,
            None => Registries::default(),
        };
        let mut tried = Vec::new();
        for ep in regs.endpoints(&r.registry) {
            // What a failed endpoint left half-extracted must not mix with the next attempt.
            let _ = layers::empty_dir(dest);
            match registry::pull(&ep, &r, dest, &scratch, &cancel).await {
                Ok(()) => return Ok(format!("pulled from {}", ep.base)),
                Err(e) => tried.push(format!("{}: {e}", ep.base)),
            }
        }
        let _ = layers::empty_dir(dest);
        Err(format!("cannot stage image {r}: {}", tried.join("; ")))
    }
}

struct Abandon {
    cancel: Arc<AtomicBool>,
    scratch: PathBuf,
}

impl Drop for Abandon {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        let _ = std::fs::remove_file(&self.scratch);
    }
}
