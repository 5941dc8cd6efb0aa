//! The agent's status board: what the running agent is doing, kept in one small JSON record
//! (`agent-status` in the PID directory, format [`FORMAT`]) for `nodeplan status` to read.
//!
//! A leaf: the loop, the sources' gates and the applyinator's observer report through the free
//! functions below (plain labels, as for `metrics`); they do nothing until [`install`] has been
//! called (only `nodeplan agent` does). The record is written by one task, after each change,
//! atomically (a reader never sees half of it) but not synced (a crash may lose it; it is a
//! display, not a record anything is decided from), never more often than every [`SETTLE`].
//! Owns: the record's file. Must not touch: anything else in the PID directory (the PID
//! records are `*.json`; this file's name has no extension).

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// The record's name in the PID directory.
pub const FILE: &str = "agent-status";
/// `nodeplanFormat` of the record (R25).
pub const FORMAT: u64 = 1;
/// The longest a change waits before it is written (changes within it are written together).
const SETTLE: Duration = Duration::from_millis(100);
/// The most a reader reads of the record.
pub const CAP: u64 = 256 << 10;

/// What the agent is doing, as `nodeplan status` shows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct AgentStatus {
    #[serde(rename = "nodeplanFormat")]
    pub format: u64,
    pub pid: u32,
    /// The process's start time (clock ticks since boot): a record whose pid now names another
    /// process is not this agent's.
    pub pid_start: u64,
    pub version: String,
    /// RFC 3339, as every time here.
    pub started: String,
    pub config: String,
    pub node: String,
    pub sources: Vec<SourceStatus>,
    /// The API server, once the agent's client has talked to it (remote and NodePlan modes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api: Option<ApiStatus>,
    /// The plan applying now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub current: Option<Current>,
    /// The last plan outcome recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last: Option<Last>,
    /// Plans waiting for a retry: the plan and when.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub retries: Vec<Retry>,
    pub updated: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SourceStatus {
    /// `local`, `secret` or `nodeplans`.
    pub kind: String,
    /// The directory, the Secret, the node's NodePlans.
    pub target: String,
    /// The Lease: `held`, `waiting: …`, or empty without one.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub lease: String,
    /// Why the source gives the agent nothing to do (its object does not exist), and since when.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub problem: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub problem_since: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ApiStatus {
    pub server: String,
    /// How the last answer came: `HTTP/2, PINGed every 10s` or `HTTP/1.1`.
    pub over: String,
    /// Since when its requests fail (no answer, or no connection); empty while it answers.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub failing_since: String,
    /// Refusals in force (401, 403: answers that no retry cures), each with since when.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<Refused>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Refused {
    pub what: String,
    pub since: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Current {
    pub plan: String,
    pub since: String,
    /// `instruction 2/3 install`, while one runs.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub instruction: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub instruction_since: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Last {
    pub plan: String,
    /// `succeeded`, `failed: instruction 2/3 install: exit status 3`, `canceled`, …
    pub result: String,
    pub at: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Retry {
    pub plan: String,
    pub at: String,
}

struct Board {
    status: Mutex<AgentStatus>,
    changed: tokio::sync::Notify,
}

static BOARD: OnceLock<Arc<Board>> = OnceLock::new();

use crate::now_rfc3339 as now;

/// Start the board with the agent's identity and sources: its record is written to
/// `dir/agent-status` after every change until `shutdown`, then removed (a stopped agent leaves
/// none). A second call does nothing.
pub fn install(dir: &Path, mut status: AgentStatus, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    status.format = FORMAT;
    status.started = now();
    let board = Arc::new(Board { status: Mutex::new(status), changed: tokio::sync::Notify::new() });
    if BOARD.set(board.clone()).is_err() {
        return;
    }
    let path: PathBuf = dir.join(FILE);
    board.changed.notify_one();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = board.changed.notified() => {}
                r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { break },
            }
            tokio::time::sleep(SETTLE).await;
            let bytes = {
                let mut s = board.status.lock().unwrap_or_else(|e| e.into_inner());
                s.updated = now();
                serde_json::to_vec_pretty(&*s).unwrap_or_default()
            };
            let p = path.clone();
            // The PID directory is made on first use, as the PID records make it.
            // Not synced: the record only shows what the agent does, and one a crash left behind
            // names a pid that is no longer this agent's (`pid_start`).
            let written = tokio::task::spawn_blocking(move || match crate::safefs::write_shown(&p, &bytes, 0o600) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    std::fs::create_dir_all(p.parent().unwrap_or(Path::new("/")))?;
                    crate::safefs::write_shown(&p, &bytes, 0o600)
                }
                r => r,
            })
            .await;
            if let Ok(Err(e)) = written {
                tracing::debug!("cannot write {}: {e}", path.display());
            }
        }
        let _ = std::fs::remove_file(&path);
    });
}

fn update(f: impl FnOnce(&mut AgentStatus)) {
    if let Some(b) = BOARD.get() {
        f(&mut b.status.lock().unwrap_or_else(|e| e.into_inner()));
        b.changed.notify_one();
    }
}

/// A plan source the agent runs (`kind`: `local`, `secret`, `nodeplans`); `lease` as for
/// [`lease`] (empty without one).
pub fn source(kind: &str, target: &str, lease: &str) {
    update(|s| {
        s.sources.push(SourceStatus {
            kind: kind.into(),
            target: target.into(),
            lease: lease.into(),
            ..Default::default()
        })
    });
}

/// A source's problem began (`problem`, now) or ended (empty).
pub fn source_problem(target: &str, problem: &str) {
    update(|s| {
        if let Some(src) = s.sources.iter_mut().find(|x| x.target == target) {
            src.problem = problem.to_string();
            src.problem_since = if problem.is_empty() { String::new() } else { now() };
        }
    });
}

/// A source's Lease changed (`held`, `waiting: …`).
pub fn lease(target: &str, state: &str) {
    update(|s| {
        if let Some(src) = s.sources.iter_mut().find(|x| x.target == target) {
            src.lease = state.to_string();
        }
    });
}

/// The API server `server` answered, over `over` (`HTTP/2, PINGed every 10s`).
pub fn api_answered(server: &str, over: &str) {
    update(|s| {
        let refused = s.api.take().map(|a| a.refused).unwrap_or_default();
        s.api = Some(ApiStatus {
            server: server.to_string(),
            over: over.to_string(),
            failing_since: String::new(),
            refused,
        })
    });
}

/// The refusals of the API server `server` in force now: each one's line and since when.
pub fn api_refused(server: &str, now: Vec<(String, String)>) {
    update(|s| {
        let api = s.api.get_or_insert_with(ApiStatus::default);
        api.server = server.to_string();
        api.refused = now.into_iter().map(|(what, since)| Refused { what, since }).collect();
    });
}

/// A request to the API server `server` failed after it had answered (the first failure counts).
pub fn api_failing(server: &str) {
    update(|s| {
        let api = s.api.get_or_insert_with(ApiStatus::default);
        api.server = server.to_string();
        if api.failing_since.is_empty() {
            api.failing_since = now();
        }
    });
}

/// A plan started (or resumed) applying.
pub fn plan_started(plan: &str) {
    update(|s| {
        s.current = Some(Current { plan: plan.to_string(), since: now(), ..Current::default() });
        s.retries.retain(|r| r.plan != plan);
    });
}

/// The plan that was applying stopped (whatever the outcome).
pub fn plan_ended() {
    update(|s| s.current = None);
}

/// The outcome recorded for `plan`: `succeeded`, `failed: …`, `paused`, `canceled`.
pub fn outcome(plan: &str, result: &str) {
    update(|s| s.last = Some(Last { plan: plan.to_string(), result: result.to_string(), at: now() }));
}

/// A plan runs again after `after` (a retry, a back-off).
pub fn retry(plan: &str, after: Duration) {
    let at = chrono::Utc::now() + chrono::Duration::from_std(after).unwrap_or_default();
    update(|s| {
        s.retries.retain(|r| r.plan != plan);
        s.retries.push(Retry { plan: plan.to_string(), at: at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true) });
    });
}

/// An instruction of the applying plan started (`label`: `instruction 2/3 install`) or ended
/// (`None`).
pub fn instruction(label: Option<&str>) {
    update(|s| {
        if let Some(c) = s.current.as_mut() {
            c.instruction = label.unwrap_or_default().to_string();
            c.instruction_since = if label.is_some() { now() } else { String::new() };
        }
    });
}

/// Read a record as `nodeplan status` does (Unix: `nodeplan status` is not built for Windows yet): root's (the reader's) file, not writable by others,
/// of a format this build knows. `Ok(None)`: there is none (no agent runs, or it runs without a
/// PID directory).
#[cfg(unix)]
pub fn read(dir: &Path) -> Result<Option<AgentStatus>, String> {
    let path = dir.join(FILE);
    let shown = path.display();
    match crate::safefs::read_small_checked(&path, CAP, crate::safefs::own_only) {
        Ok(None) => Ok(None),
        Ok(Some(Err(why))) => Err(format!("{shown} {why}: not read")),
        Err(e) => Err(format!("{shown}: {e}")),
        Ok(Some(Ok(bytes))) => {
            let s: AgentStatus = serde_json::from_slice(&bytes).map_err(|e| format!("{shown}: {e}"))?;
            if s.format > FORMAT {
                return Err(format!("{shown} has nodeplanFormat {}, newer than this build's {FORMAT}", s.format));
            }
            Ok(Some(s))
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    /// A record is only believed when it is the reader's own file, not writable by others, of a
    /// format this build knows; a missing one is no agent.
    #[test]
    fn a_record_is_read_only_when_it_is_trusted() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(read(d.path()), Ok(None));
        let s = AgentStatus { format: FORMAT, pid: 7, node: "n".into(), ..AgentStatus::default() };
        let path = d.path().join(FILE);
        std::fs::write(&path, serde_json::to_vec(&s).unwrap()).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read(d.path()), Ok(Some(s.clone())));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = read(d.path()).unwrap_err();
        assert!(e.contains("writable by group or others"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let newer = AgentStatus { format: FORMAT + 1, ..s };
        std::fs::write(&path, serde_json::to_vec(&newer).unwrap()).unwrap();
        assert!(read(d.path()).unwrap_err().contains("newer than this build"));
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", &path).unwrap();
        assert!(read(d.path()).unwrap_err().contains("symlink"));
    }
}
