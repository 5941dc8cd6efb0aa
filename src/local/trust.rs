//! Who may put a plan in front of the agent. Anyone who can write a plan file, or a directory on
//! the way to it, can run commands as root, so when the agent runs as root a plan is refused
//! unless the plan file and every directory from `/` down to it are owned by root (or the agent's
//! user) and not writable by group or others. Above the plan directory a world-writable directory
//! with the sticky bit (`/tmp`) is accepted on the way: others cannot rename or remove root's
//! entries there. From the plan directory down it is not, sticky or not: others could create the
//! files beside a plan (`NAME.pos`, `NAME.paused`, ...) or plans of their own there.
//! A symlink on the way must be owned by root too.
//!
//! The files beside a plan (its `.pos`, control, reset and skip files) count only when they pass
//! the plan file's owner and mode rule ([`owner_and_mode`]); a directory below the plan directory is walked
//! and watched only when it passes it too ([`dir`]).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Why a plan must not be trusted.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("cannot check {}: {source}", path.display())]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is a symlink owned by uid {uid}", path.display())]
    ForeignLink { path: PathBuf, uid: u32 },
    #[error("{} is owned by uid {uid}", path.display())]
    Foreign { path: PathBuf, uid: u32 },
    #[error("{} is writable by group or others (mode {mode:04o})", path.display())]
    Writable { path: PathBuf, mode: u32 },
}

/// Whether the file or directory with owner `uid` and mode `mode` may speak for root: owned by
/// root (or the agent's user) and not writable by group or others. Always, for an unprivileged
/// agent (it runs commands as its own user: nothing to escalate to). The error is the reason,
/// worded to follow a path ("is owned by uid 1000").
pub fn owner_and_mode(uid: u32, mode: u32) -> Result<(), String> {
    if rustix::process::geteuid().as_raw() != 0 {
        return Ok(());
    }
    crate::safefs::own_only(uid, mode)
}

/// Whether a directory at or below the plan directory may be walked and watched (see
/// [`owner_and_mode`]; a sticky bit does not help).
pub fn dir(m: &std::fs::Metadata) -> Result<(), String> {
    owner_and_mode(m.uid(), m.mode())
}

/// Why `plan`, under the plan directory `plan_dir`, must not be trusted, or `Ok` when it may be.
pub fn check(plan_dir: &Path, plan: &Path) -> Result<(), TrustError> {
    let me = rustix::process::geteuid().as_raw();
    if me != 0 {
        // An unprivileged agent runs commands as its own user: nothing to escalate to.
        return Ok(());
    }
    let mut prefix = std::path::PathBuf::new();
    for comp in plan.components() {
        prefix.push(comp);
        let unreadable = |source| TrustError::Unreadable { path: prefix.clone(), source };
        let lm = std::fs::symlink_metadata(&prefix).map_err(unreadable)?;
        if lm.file_type().is_symlink() && lm.uid() != 0 && lm.uid() != me {
            return Err(TrustError::ForeignLink { path: prefix, uid: lm.uid() });
        }
        let m = std::fs::metadata(&prefix).map_err(unreadable)?;
        if m.uid() != 0 && m.uid() != me {
            return Err(TrustError::Foreign { path: prefix, uid: m.uid() });
        }
        // Above the plan directory a sticky directory (`/tmp`) is fine; at or below it, not.
        let sticky_dir = m.is_dir() && m.mode() & 0o1000 != 0 && !prefix.starts_with(plan_dir);
        if m.mode() & 0o022 != 0 && !sticky_dir {
            return Err(TrustError::Writable { path: prefix, mode: m.mode() & 0o7777 });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn plans_others_can_write_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("plans");
        std::fs::create_dir(&dir).unwrap();
        let plan = dir.join("a.plan");
        std::fs::write(&plan, b"{}").unwrap();
        std::fs::set_permissions(&plan, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(check(&dir, &plan).is_ok(), "under /tmp (sticky) is fine");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = check(&dir, &plan).unwrap_err().to_string();
        assert!(e.contains("plans is writable by group or others (mode 1777)"), "the plan directory, sticky: {e}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&plan, std::fs::Permissions::from_mode(0o664)).unwrap();
        assert!(
            check(&dir, &plan).unwrap_err().to_string().contains("a.plan is writable by group or others (mode 0664)")
        );
        std::fs::set_permissions(&plan, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(
            check(&dir, &plan).unwrap_err().to_string().contains("plans is writable by group or others (mode 0777)")
        );
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::chown(&plan, Some(1000), None).unwrap();
        assert!(check(&dir, &plan).unwrap_err().to_string().contains("a.plan is owned by uid 1000"));
        std::os::unix::fs::chown(&plan, Some(0), None).unwrap();
        std::os::unix::fs::chown(&dir, Some(1000), None).unwrap();
        assert!(check(&dir, &plan).unwrap_err().to_string().contains("plans is owned by uid 1000"));
    }
}
