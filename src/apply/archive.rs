//! The applied-plan archive and system-agent's upgrade interlock.

use crate::plan::{Plan, format_unix_date, parse_unix_date};
use chrono::{DateTime, Utc};
use std::path::{Path, PathBuf};

/// How many archived plans are kept.
pub const ARCHIVE_KEEP: usize = 64;
const RESTART_PENDING_WAIT: i64 = 5 * 60;

/// Write `<seq>-<YYYYMMDD-HHMMSS>Z-applied.plan` (`{"Plan":…,"Checksum":…}`, Go's untagged field
/// names) unless it equals the newest archived one; keep the newest 64. Errors are only logged.
///
/// The sequence number, one more than the highest in the directory, orders the archive: two plans
/// applied within one second get two entries, and pruning never depends on the wall clock (after
/// the clock steps back, the newest plan is still the newest). The time is UTC. Names of
/// system-agent's format (`<local time>-applied.plan`, no sequence) count as older than any
/// numbered one, and are pruned first.
pub fn archive_plan(dir: &Path, plan: &Plan, checksum: &str, now: DateTime<Utc>) {
    if let Err(e) = try_archive(dir, plan, checksum, now) {
        tracing::warn!("archiving the applied plan in {}: {e}", dir.display());
    }
}

fn try_archive(dir: &Path, plan: &Plan, checksum: &str, now: DateTime<Utc>) -> std::io::Result<()> {
    crate::safefs::open_dir(dir, Some(0o700))?;
    let body = serde_json::to_vec(&serde_json::json!({ "Plan": plan, "Checksum": checksum }))
        .map_err(std::io::Error::other)?;
    let mut existing = archived(dir);
    if let Some((_, newest)) = existing.last()
        && crate::safefs::read_small(&dir.join(newest), 64 << 20).is_ok_and(|b| b.is_some_and(|b| b == body))
    {
        return Ok(());
    }
    let seq = existing.last().map_or(1, |(seq, _)| seq + 1);
    let name = format!("{seq:06}-{}Z-applied.plan", now.format("%Y%m%d-%H%M%S"));
    crate::safefs::write_atomic(&dir.join(&name), &body, 0o600)?;
    existing.push((seq, name));
    for (_, old) in &existing[..existing.len().saturating_sub(ARCHIVE_KEEP)] {
        let _ = std::fs::remove_file(dir.join(old));
    }
    Ok(())
}

/// The archive's entries, oldest first.
fn archived(dir: &Path) -> Vec<(u64, String)> {
    let names = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default();
    archive_order(names)
}

/// Archive entries by age, oldest first: by their sequence number; system-agent's names (no
/// sequence: 0) before every numbered one, in name order. Other files are not entries.
fn archive_order(names: Vec<String>) -> Vec<(u64, String)> {
    let mut v: Vec<(u64, String)> = names
        .into_iter()
        .filter(|n| n.ends_with("-applied.plan"))
        .map(|n| {
            // `<seq>-<YYYYMMDD>-<HHMMSS>Z-applied.plan`; system-agent's names have no `Z` and no
            // sequence.
            let seq = n
                .strip_suffix("Z-applied.plan")
                .and_then(|stem| stem.split_once('-'))
                .and_then(|(seq, _)| seq.parse::<u64>().ok())
                .unwrap_or(0);
            (seq, n)
        })
        .collect();
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
    pub fn enter(dir: &Path, now: DateTime<Utc>) -> Result<Interlock, InterlockError> {
        // Walked and written through crate::safefs, read without following links or blocking.
        crate::safefs::open_dir(dir, Some(0o700)).map_err(|source| InterlockError::Io { path: dir.into(), source })?;
        let active = dir.join("applyinator-active");
        let _ = crate::safefs::remove(&active, false);
        let pending = dir.join("restart-pending");
        if let Ok(Some(raw)) = crate::safefs::read_small(&pending, 4096) {
            match parse_unix_date(String::from_utf8_lossy(&raw).trim()) {
                None => {
                    let _ = crate::safefs::write_atomic(&pending, format_unix_date(now).as_bytes(), 0o600);
                    return Err(InterlockError::RestartPending { left: None });
                }
                Some(t) if now < t + chrono::Duration::seconds(RESTART_PENDING_WAIT) => {
                    let left = (t + chrono::Duration::seconds(RESTART_PENDING_WAIT) - now).num_seconds();
                    return Err(InterlockError::RestartPending { left: Some(left) });
                }
                Some(_) => {
                    let _ = crate::safefs::remove(&pending, false);
                }
            }
        }
        crate::safefs::write_atomic(&active, format_unix_date(now).as_bytes(), 0o600)
            .map_err(|source| InterlockError::Io { path: active.clone(), source })?;
        Ok(Interlock { active })
    }
}

/// Why the interlock does not let an apply start.
#[derive(Debug, thiserror::Error)]
pub enum InterlockError {
    /// A restart is pending (the seconds it still has, or `None` when its date could not be read
    /// and the wait starts now).
    #[error("restart is pending; waiting {}", .left.map_or("5m0s".to_string(), |s| format!("{s}s more")))]
    RestartPending { left: Option<i64> },
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Drop for Interlock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.active);
    }
}

#[cfg(all(test, unix))]
mod order_tests {
    use super::*;

    #[test]
    fn the_archive_is_ordered_by_sequence_not_by_clock_or_name() {
        let names = [
            "000010-20261130-120000Z-applied.plan",
            // The clock stepped back a year: still newer (higher sequence).
            "000011-20251130-120000Z-applied.plan",
            "000002-20261130-120000Z-applied.plan",
            "1000000-20261130-120001Z-applied.plan",
            // system-agent's own names: older than every numbered one.
            "20270101-000000-applied.plan",
            "20260101-000000-applied.plan",
            "notes.txt",
        ];
        let got: Vec<(u64, String)> = archive_order(names.iter().map(|n| n.to_string()).collect());
        let got: Vec<&str> = got.iter().map(|(_, n)| n.as_str()).collect();
        assert_eq!(
            got,
            [
                "20260101-000000-applied.plan",
                "20270101-000000-applied.plan",
                "000002-20261130-120000Z-applied.plan",
                "000010-20261130-120000Z-applied.plan",
                "000011-20251130-120000Z-applied.plan",
                "1000000-20261130-120001Z-applied.plan",
            ]
        );
    }

    #[test]
    fn plans_applied_within_one_second_are_all_kept_and_pruning_keeps_the_newest() {
        let d = tempfile::tempdir().unwrap();
        let now = chrono::DateTime::parse_from_rfc3339("2026-11-30T12:00:00Z").unwrap().with_timezone(&Utc);
        let plan = |i: usize| {
            serde_json::from_value::<Plan>(serde_json::json!({"files": [{"path": format!("/p{i}"), "content": ""}]}))
                .unwrap()
        };
        for i in 0..ARCHIVE_KEEP + 3 {
            // Same second for all; the clock even goes back a minute halfway.
            let at = if i > ARCHIVE_KEEP / 2 { now - chrono::Duration::minutes(1) } else { now };
            archive_plan(d.path(), &plan(i), &format!("c{i}"), at);
        }
        let kept = archived(d.path());
        assert_eq!(kept.len(), ARCHIVE_KEEP);
        let newest = std::fs::read(d.path().join(&kept[ARCHIVE_KEEP - 1].1)).unwrap();
        assert!(String::from_utf8_lossy(&newest).contains(&format!("\"c{}\"", ARCHIVE_KEEP + 2)));
        assert_eq!(kept[0].0, 4, "the three oldest were pruned");
    }
}

#[cfg(all(test, unix))]
mod interlock_tests {
    use super::*;

    /// A `restart-pending` planted as a link (or a FIFO) is neither followed nor waited on.
    #[test]
    fn a_pending_restart_says_how_long_it_waits() {
        assert_eq!(InterlockError::RestartPending { left: None }.to_string(), "restart is pending; waiting 5m0s");
        assert_eq!(
            InterlockError::RestartPending { left: Some(42) }.to_string(),
            "restart is pending; waiting 42s more"
        );
    }

    #[test]
    fn planted_interlock_files_are_never_followed() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("interlock");
        std::fs::create_dir(&dir).unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"not a date").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("restart-pending")).unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("applyinator-active")).unwrap();
        let now = Utc::now();
        let held = Interlock::enter(&dir, now).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"not a date", "the link was not written through");
        assert!(!std::fs::symlink_metadata(dir.join("applyinator-active")).unwrap().file_type().is_symlink());
        drop(held);
        std::fs::remove_file(dir.join("restart-pending")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            dir.join("restart-pending"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert!(Interlock::enter(&dir, now).is_ok(), "a FIFO is not read (it would block)");
    }
}
