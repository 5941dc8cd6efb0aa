//! The applied-plan archive and system-agent's upgrade interlock.

use crate::plan::{Plan, format_unix_date, parse_unix_date};
use chrono::{DateTime, Utc};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// How many archived plans are kept.
pub const ARCHIVE_KEEP: usize = 64;
const RESTART_PENDING_WAIT: i64 = 5 * 60;

/// Write `<YYYYMMDD-HHMMSS>-applied.plan` (`{"Plan":…,"Checksum":…}`, Go's untagged field names)
/// unless it equals the newest archived one; keep the newest 64. Errors are only logged.
pub fn archive_plan(dir: &Path, plan: &Plan, checksum: &str, now: DateTime<Utc>) {
    if let Err(e) = try_archive(dir, plan, checksum, now) {
        tracing::warn!("archiving the applied plan in {}: {e}", dir.display());
    }
}

fn try_archive(dir: &Path, plan: &Plan, checksum: &str, now: DateTime<Utc>) -> std::io::Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let body = serde_json::to_vec(&serde_json::json!({ "Plan": plan, "Checksum": checksum }))
        .map_err(std::io::Error::other)?;
    let mut existing = archived(dir);
    if let Some(newest) = existing.last()
        && std::fs::read(newest).is_ok_and(|b| b == body)
    {
        return Ok(());
    }
    let stamp = now.with_timezone(&chrono::Local).format("%Y%m%d-%H%M%S");
    let path = dir.join(format!("{stamp}-applied.plan"));
    crate::process::write_atomic(&path, &body, 0o600)?;
    if !existing.contains(&path) {
        existing.push(path);
        existing.sort();
    }
    let excess = existing.len().saturating_sub(ARCHIVE_KEEP);
    for old in &existing[..excess] {
        let _ = std::fs::remove_file(old);
    }
    Ok(())
}

fn archived(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().ends_with("-applied.plan")))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Held while an apply runs: `applyinator-active` exists; removed on drop.
pub struct Interlock {
    active: PathBuf,
}

impl Interlock {
    /// system-agent's protocol: a stale `applyinator-active` is removed; a `restart-pending`
    /// younger than 5 minutes (or unparsable, which starts the 5 minutes now) blocks the apply.
    pub fn enter(dir: &Path, now: DateTime<Utc>) -> Result<Interlock, String> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        let active = dir.join("applyinator-active");
        let _ = std::fs::remove_file(&active);
        let pending = dir.join("restart-pending");
        if let Ok(raw) = std::fs::read_to_string(&pending) {
            match parse_unix_date(raw.trim()) {
                None => {
                    let _ = std::fs::write(&pending, format_unix_date(now));
                    return Err("restart is pending; waiting 5m0s".into());
                }
                Some(t) if now < t + chrono::Duration::seconds(RESTART_PENDING_WAIT) => {
                    let left = (t + chrono::Duration::seconds(RESTART_PENDING_WAIT) - now).num_seconds();
                    return Err(format!("restart is pending; waiting {left}s more"));
                }
                Some(_) => {
                    let _ = std::fs::remove_file(&pending);
                }
            }
        }
        crate::process::write_atomic(&active, format_unix_date(now).as_bytes(), 0o600)
            .map_err(|e| format!("{}: {e}", active.display()))?;
        Ok(Interlock { active })
    }
}

impl Drop for Interlock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.active);
    }
}
