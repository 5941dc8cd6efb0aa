//! Who may put a plan in front of the agent. Anyone who can write a plan file, or a directory on
//! the way to it, can run commands as root, so when the agent runs as root a plan is refused
//! unless the plan file and every directory from `/` down to it are owned by root (or the agent's
//! user) and not writable by group or others. A world-writable directory with the sticky bit
//! (`/tmp`) is accepted on the way: others cannot rename or remove root's entries there.
//! A symlink on the way must be owned by root too.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Why `plan` must not be trusted, or `Ok` when it may be.
pub fn check(plan: &Path) -> Result<(), String> {
    let me = rustix::process::geteuid().as_raw();
    if me != 0 {
        // An unprivileged agent runs commands as its own user: nothing to escalate to.
        return Ok(());
    }
    let mut prefix = std::path::PathBuf::new();
    for comp in plan.components() {
        prefix.push(comp);
        let lm = std::fs::symlink_metadata(&prefix).map_err(|e| format!("cannot check {}: {e}", prefix.display()))?;
        if lm.file_type().is_symlink() && lm.uid() != 0 && lm.uid() != me {
            return Err(format!("{} is a symlink owned by uid {}", prefix.display(), lm.uid()));
        }
        let m = std::fs::metadata(&prefix).map_err(|e| format!("cannot check {}: {e}", prefix.display()))?;
        if m.uid() != 0 && m.uid() != me {
            return Err(format!("{} is owned by uid {}", prefix.display(), m.uid()));
        }
        let sticky_dir = m.is_dir() && m.mode() & 0o1000 != 0;
        if m.mode() & 0o022 != 0 && !sticky_dir {
            return Err(format!(
                "{} is writable by group or others (mode {:04o})",
                prefix.display(),
                m.mode() & 0o7777
            ));
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
        assert_eq!(check(&plan), Ok(()), "under /tmp (sticky) is fine");
        std::fs::set_permissions(&plan, std::fs::Permissions::from_mode(0o664)).unwrap();
        assert!(check(&plan).unwrap_err().contains("a.plan is writable by group or others (mode 0664)"));
        std::fs::set_permissions(&plan, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(check(&plan).unwrap_err().contains("plans is writable by group or others (mode 0777)"));
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::chown(&plan, Some(1000), None).unwrap();
        assert!(check(&plan).unwrap_err().contains("a.plan is owned by uid 1000"));
        std::os::unix::fs::chown(&plan, Some(0), None).unwrap();
        std::os::unix::fs::chown(&dir, Some(1000), None).unwrap();
        assert!(check(&plan).unwrap_err().contains("plans is owned by uid 1000"));
    }
}
