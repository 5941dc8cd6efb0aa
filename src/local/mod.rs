//! Local mode: plans are `*.plan` files in a directory (system-agent's format), their state is a
//! `.pos` file beside each, and pause/cancel are control files (`NAME.paused`, `NAME.canceled`)
//! with the same meaning and rules as remote mode's annotations (R16).
//!
//! This module owns the plan directory as a plan source of [`crate::reconcile`]: the scan and the
//! watch (inotify through the `inotify` crate, plus a periodic rescan), reading plans, `.pos` and
//! control files without following links or blocking, and writing `.pos` files. What a `.pos`
//! means is [`wire`] (pure functions); the loop (recovery, back-off, runs, interrupts, probes) is
//! [`crate::reconcile`]. It must not spawn processes (the applyinator does) or talk to Kubernetes.

mod dirwatch;
pub mod pos;
pub mod scan;
pub mod trust;
pub mod wire;

use crate::AbortOnDrop;
use crate::apply::{ApplyError, Interrupt};
use crate::flow::Commit;
use crate::plan::{self, Annotations, Hold, ProbeStatus};
use crate::process::{Owner, Source};
use crate::reconcile::{Claim, Look, Observed, Outcome, PlanSource, Seen, Sent, View, Written};
use pos::{PlanFiles, Pos};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc;
use wire::RetryPolicy;

#[derive(Debug, Clone)]
pub struct LocalConfig {
    pub plan_dir: PathBuf,
    /// Full rescan period (inotify events trigger one sooner).
    pub rescan: Duration,
    /// How often every plan's probes run.
    pub probe_period: Duration,
    /// A failed plan is retried after `retry_base` × 2^(failures−1), at most `retry_max`.
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// Watch the directory with inotify (false: rescans and the running plan's control-file poll
    /// only; the agent uses it when `NODEPLAN_NO_INOTIFY=1`, tests use it to exercise that path).
    pub inotify: bool,
}

impl LocalConfig {
    pub fn new(plan_dir: impl Into<PathBuf>) -> LocalConfig {
        LocalConfig {
            plan_dir: plan_dir.into(),
            rescan: Duration::from_secs(5),
            probe_period: Duration::from_secs(5),
            retry_base: Duration::from_secs(30),
            retry_max: Duration::from_secs(300),
            inotify: true,
        }
    }

    fn retry(&self) -> RetryPolicy {
        RetryPolicy { base: self.retry_base, max: self.retry_max }
    }
}

/// The plan directory as a plan source: one key per plan file.
pub struct DirSource {
    cfg: LocalConfig,
    events_tx: mpsc::UnboundedSender<PathBuf>,
    events: mpsc::UnboundedReceiver<PathBuf>,
    watcher: Option<AbortOnDrop>,
    /// Lines already logged about files and directories that do not count (each once).
    noted: HashSet<String>,
    /// Per plan file, the writes its last look found due (a `.pos` nobody can read moved aside,
    /// a reset applied): made by [`PlanSource::show`] when the loop asks, never by the look.
    shows: HashMap<PathBuf, Vec<LocalShow>>,
}

/// A write a look found due.
enum LocalShow {
    /// Move an unreadable `.pos` aside (`from` → `to`, `why` it is unreadable): the plan starts
    /// over.
    Aside { from: PathBuf, to: PathBuf, why: String },
    /// A reset was asked for (`reset` marker): the `.pos` as reset, then the marker removed.
    Reset { pos: PathBuf, reset: PathBuf, stored: Box<Pos> },
}

/// The most distinct "does not count" lines remembered (then they may repeat).
const NOTED_CAP: usize = 4096;

/// Why a plan is held without anything being run or written (R3): an invalid control value, or a
/// control file that cannot be read (a directory, a FIFO, a link, too large): a value nobody can
/// read is as unknown as an invalid one.
fn hold_of(files: &PlanFiles, ignored: &mut Vec<String>) -> Result<Hold, HoldError> {
    let canceled = pos::read_control_trusted(&files.canceled(), ignored);
    // R2: a valid cancel wins, even over a paused file nobody can read.
    if let Ok(Some(v)) = &canceled
        && plan::parse_annotation_value(Some(v)) == Ok(true)
    {
        return Ok(Hold::Cancel);
    }
    let (p, c) = (
        pos::read_control_trusted(&files.paused(), ignored).map_err(HoldError::Unreadable)?,
        canceled.map_err(HoldError::Unreadable)?,
    );
    plan::resolve_annotations(&Annotations { paused: p.as_deref(), canceled: c.as_deref() })
        .map_err(|e| HoldError::Invalid(rename_keys(e, files)))
}

/// Why the control files do not give a pause/cancel value.
enum HoldError {
    /// A control file that cannot be read (a directory, a FIFO, a link, too large).
    Unreadable(String),
    /// An invalid value (R3).
    Invalid(plan::InvalidAnnotation),
}

/// Name the control files, not the annotations, in local-mode messages.
fn rename_keys(e: plan::InvalidAnnotation, files: &PlanFiles) -> plan::InvalidAnnotation {
    plan::InvalidAnnotation(
        e.0.into_iter()
            .map(|(k, v)| {
                let f = if k == plan::ANNOTATION_PAUSED { files.paused() } else { files.canceled() };
                (f.display().to_string(), v)
            })
            .collect(),
    )
}

/// The interrupt a running plan should see: only valid values count (an invalid value in flight is
/// logged and ignored, "never kill on a guess"); a valid cancel wins.
fn interrupt_of(files: &PlanFiles) -> Interrupt {
    // An unreadable control file counts as absent here; the next reconcile holds the plan for it.
    // A control file that fails the owner and mode rule does not count (the next look says so).
    let read = |p: &Path| pos::read_control_trusted(p, &mut Vec::new()).ok().flatten();
    let (p, c) = (read(&files.paused()), read(&files.canceled()));
    Interrupt {
        cancel: plan::parse_annotation_value(c.as_deref()) == Ok(true),
        // A plan whose file is removed while it runs stops at the next instruction boundary, as
        // a pause does (never a kill on a guess: an editor may remove and write the file back).
        pause: plan::parse_annotation_value(p.as_deref()) == Ok(true) || plan_removed(files),
        ..Interrupt::default()
    }
}

fn plan_removed(files: &PlanFiles) -> bool {
    std::fs::symlink_metadata(&files.plan).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
}

/// Write a `.pos` (it ends in an fsync: off the async threads); an error is logged.
async fn store(path: PathBuf, p: Pos) -> Written {
    let shown = path.display().to_string();
    match tokio::task::spawn_blocking(move || pos::write_pos(&path, &p)).await {
        Ok(Ok(_)) => Written::Done,
        Ok(Err(e)) => Written::failed(format!("cannot write {shown}: {e}")),
        Err(e) => Written::failed(format!("cannot write {shown}: {e}")),
    }
}

impl DirSource {
    pub fn new(cfg: LocalConfig) -> DirSource {
        if !cfg.plan_dir.is_dir() {
            tracing::warn!("local plan directory {} does not exist (yet); watching for it", cfg.plan_dir.display());
        }
        let (events_tx, events) = mpsc::unbounded_channel();
        DirSource { cfg, events_tx, events, watcher: None, noted: HashSet::new(), shows: HashMap::new() }
    }

    /// Log `line` at warn level, once (while fewer than [`NOTED_CAP`] lines are remembered).
    fn note_once(&mut self, line: String) {
        if self.noted.len() >= NOTED_CAP {
            self.noted.clear();
        }
        if self.noted.insert(line.clone()) {
            tracing::warn!("{line}");
        }
    }

    fn note_ignored(&mut self, ignored: Vec<String>) {
        for i in ignored {
            self.note_once(format!(
                "{i}: ignored (a file beside a plan counts only when owned by root and not writable by group or others)"
            ));
        }
    }

    fn watch_directory(&mut self) {
        if !self.cfg.inotify || self.watcher.as_ref().is_some_and(|w| !w.0.is_finished()) {
            return;
        }
        // An untrusted plan directory is not watched either (the scan says why).
        if !std::fs::metadata(&self.cfg.plan_dir).is_ok_and(|m| m.is_dir() && trust::dir(&m).is_ok()) {
            return;
        }
        self.watcher = match dirwatch::start(&self.cfg.plan_dir, self.events_tx.clone()) {
            Ok(task) => {
                tracing::info!("watching {} for changes", self.cfg.plan_dir.display());
                Some(AbortOnDrop(task))
            }
            Err(e) => {
                tracing::warn!("cannot watch {} ({e}); relying on the periodic rescan", self.cfg.plan_dir.display());
                None
            }
        };
    }

    /// Change a plan's `.pos` in place (read, change, write). A `.pos` that cannot be read is
    /// left alone (the next look holds the plan or sets it aside).
    async fn update(&self, files: &PlanFiles, f: impl FnOnce(&mut Pos)) -> Written {
        let path = files.pos();
        let mut p = match pos::read_pos_trusted(&path, &mut Vec::new()) {
            Ok(p) => p,
            Err(e) => return Written::failed(format!("{}: {e}", path.display())),
        };
        let before = p.clone();
        f(&mut p);
        if p == before {
            return Written::Done;
        }
        store(path, p).await
    }
}

impl PlanSource for DirSource {
    type Key = PathBuf;
    /// Nothing is kept: a `.pos` that cannot be written is read again at the next look.
    type Kept = std::convert::Infallible;

    async fn changed(&mut self) -> bool {
        // The sender lives in the source: the channel never closes.
        let first = self.events.recv().await;
        // A burst of events (an editor's save) is one change.
        while self.events.try_recv().is_ok() {}
        first.is_some()
    }

    async fn keys(&mut self) -> Vec<PathBuf> {
        self.watch_directory();
        let dir = self.cfg.plan_dir.clone();
        let found = tokio::task::spawn_blocking(move || scan::scan(&dir)).await.unwrap_or_default();
        for u in found.untrusted {
            self.note_once(format!(
                "{u}: not walked or watched; plans and skip files in it do not count (only directories owned by \
                 root and not writable by group or others are)"
            ));
        }
        if let Some(b) = found.bounded {
            self.note_once(format!("scanning {}: {b}", self.cfg.plan_dir.display()));
        }
        found.plans
    }

    async fn show(&mut self, path: &PathBuf) {
        for show in self.shows.remove(path).unwrap_or_default() {
            match show {
                LocalShow::Aside { from, to, why } => match std::fs::rename(&from, &to) {
                    Ok(()) => tracing::error!("{}: {why}; moved to {} and starting over", from.display(), to.display()),
                    Err(e) => tracing::error!("{}: {why}; cannot move it to {}: {e}", from.display(), to.display()),
                },
                LocalShow::Reset { pos, reset, stored } => {
                    if let Written::Failed { error, .. } = store(pos, *stored).await {
                        tracing::error!("{error}");
                    }
                    let _ = std::fs::remove_file(reset);
                }
            }
        }
    }

    async fn look(&mut self, path: &PathBuf) -> Seen {
        self.shows.remove(path);
        let Some(files) = PlanFiles::new(path) else { return Seen::Nothing };
        // Anyone who can write the plan can run commands as root; a file that is not what it
        // should be (a FIFO, a link, too large) is refused without blocking. Both hold the plan.
        let raw = match trust::check(&self.cfg.plan_dir, path)
            .map_err(PlanFileError::from)
            .and_then(|()| read_plan(path))
        {
            Ok(r) => r,
            Err(e) => {
                return Seen::Held(format!("{}: refused: {e}; the plan is held and nothing is run", path.display()));
            }
        };
        let checksum = plan::checksum(&raw);
        let vp = match plan::parse(&raw) {
            Ok(v) => v,
            Err(e) => return Seen::Bad { error: format!("{}: {e}", path.display()), checksum },
        };
        // The .pos file: unusable → the plan is held; unreadable → kept aside, the plan starts over.
        let mut ignored = Vec::new();
        let mut stored = match pos::read_pos_trusted(&files.pos(), &mut ignored) {
            Ok(p) => p,
            Err(e @ pos::PosError::Unusable(_)) => {
                return Seen::Held(format!("{}: {e}; the plan is held until it is removed", files.pos().display()));
            }
            Err(e) => {
                let (from, to) = (files.pos(), files.pos().with_extension("pos.invalid"));
                let aside = LocalShow::Aside { from, to, why: e.to_string() };
                self.shows.entry(path.clone()).or_default().push(aside);
                Pos::default()
            }
        };
        // R3: an invalid or unreadable control value holds the plan: nothing is written or run.
        // (A control file nobody can read is as unknown as an invalid value.)
        let hold = match hold_of(&files, &mut ignored) {
            Ok(h) => Ok(h),
            Err(HoldError::Unreadable(e)) => {
                return Seen::Held(format!("{}: {e}; the plan is held and nothing is written", path.display()));
            }
            Err(HoldError::Invalid(e)) => Err(e),
        };
        // A reset is an orchestrator's write: not while an invalid control value holds the plan (R3).
        let reset = pos::marker_trusted(&files.reset(), &mut ignored);
        self.note_ignored(ignored);
        if hold.is_ok() && reset {
            tracing::info!("{}: reset requested; the plan runs again from its first instruction", path.display());
            wire::reset(&mut stored);
            let show = LocalShow::Reset { pos: files.pos(), reset: files.reset(), stored: Box::new(stored.clone()) };
            self.shows.entry(path.clone()).or_default().push(show);
        }
        let total = vp.plan.instructions.len();
        let (snap, retry_in) = wire::snapshot(&stored, &checksum, hold, total, chrono::Utc::now(), self.cfg.retry());
        if snap.state == plan::PlanState::Pending
            && stored.plan_state == Some(plan::PlanState::Failed)
            && wire::same_plan(&stored, &checksum)
        {
            tracing::info!("{}: retrying after failure {}", path.display(), stored.failure_count);
        }
        // An unreadable (or oversized) output in the .pos is treated as empty, with a warning.
        let pos_name = files.pos().display().to_string();
        let warn = |field: &str, e: plan::CodecError| tracing::warn!("{pos_name}: {field}: {e}; treated as empty");
        let one_time_output = if wire::same_plan(&stored, &checksum) {
            plan::decode_one_time_output(&stored.output).unwrap_or_else(|e| {
                warn("output", e);
                BTreeMap::new()
            })
        } else {
            BTreeMap::new()
        };
        let periodic_output = plan::decode_periodic_output(&stored.periodic_output).unwrap_or_else(|e| {
            warn("periodicOutput", e);
            BTreeMap::new()
        });
        let attempt = wire::attempt(&stored, &checksum);
        Seen::Plan(Box::new(Look {
            label: path.display().to_string(),
            place: path.display().to_string(),
            plan: vp,
            checksum,
            view: View::Flow(snap),
            attempt,
            begin_attempt: attempt,
            one_time_output,
            periodic_output,
            probe_statuses: stored.probe_status,
            retry_in,
            stop_after: None,
            preflight: Vec::new(),
            checked: None,
        }))
    }

    async fn commit(&mut self, path: &PathBuf, look: &Look, commit: &Commit) -> Written {
        let Some(files) = PlanFiles::new(path) else { return Written::Abandoned };
        self.update(&files, |p| wire::commit(p, &look.checksum, commit)).await
    }

    async fn record(&mut self, path: &PathBuf, look: &Look, outcome: Outcome<'_>) -> Sent<Self::Kept> {
        let Some(files) = PlanFiles::new(path) else { return (Written::Abandoned, None) };
        let now = chrono::Utc::now();
        let w = self
            .update(&files, |p| {
                if let Some(r) = &outcome.record {
                    wire::record(p, &look.checksum, r, outcome.failure.as_ref(), now);
                }
                if let Some(statuses) = outcome.probes {
                    p.probe_status = statuses;
                }
            })
            .await;
        (w, None)
    }

    async fn not_started(&mut self, path: &PathBuf, look: &Look, err: &ApplyError) -> Option<Written> {
        // Files that cannot be written fail the apply, as a failing instruction does: it is
        // recorded (state, counters, time) and retried on the local schedule.
        let ApplyError::Files(e) = err else { return None };
        let files = PlanFiles::new(path)?;
        let mut failures = 0;
        let w = self
            .update(&files, |p| {
                let why =
                    crate::plan::Failure::files(&look.checksum, look.plan.plan.instructions.len(), &e.to_string());
                wire::failed(p, &look.checksum, Vec::new(), Some(&why), chrono::Utc::now());
                failures = p.failure_count;
            })
            .await;
        tracing::error!(
            "{}: files: {e}; the apply failed (failure {failures}); retrying in {}",
            path.display(),
            crate::duration::human(self.cfg.retry().delay(failures))
        );
        Some(w)
    }

    async fn write_probes(&mut self, path: &PathBuf, _: &str, statuses: BTreeMap<String, ProbeStatus>) -> Written {
        let Some(files) = PlanFiles::new(path) else { return Written::Abandoned };
        self.update(&files, |p| p.probe_status = statuses).await
    }

    async fn resend(&mut self, _: &PathBuf, kept: Self::Kept) -> Sent<Self::Kept> {
        match kept {}
    }

    async fn set_blocked(&mut self, path: &PathBuf, why: Option<&str>) {
        let Some(files) = PlanFiles::new(path) else { return };
        if let Written::Failed { error, .. } =
            self.update(&files, |p| p.blocked = why.unwrap_or_default().to_string()).await
        {
            tracing::error!("{error}");
        }
    }

    fn interrupt(&mut self, path: &PathBuf, _: &Look) -> Observed {
        let Some(files) = PlanFiles::new(path) else { return Observed::default() };
        let interrupt = interrupt_of(&files);
        let note = plan_removed(&files).then(|| {
            format!(
                "{}: the plan file was removed while the plan runs: the running instruction finishes and \
                 nothing new starts (it is recorded as paused, and continues if the same plan comes back)",
                path.display()
            )
        });
        Observed { interrupt, note }
    }

    fn owner(&self, path: &PathBuf, _: &Look) -> Owner {
        Owner::local(path)
    }

    fn claim(&self, owner: &Owner) -> Claim<PathBuf> {
        if !owner.belongs_to(Source::Local) {
            return Claim::NotMine;
        }
        owner.local_plan().map_or(Claim::Unknown, Claim::Plan)
    }

    fn period(&self) -> Duration {
        self.cfg.rescan.min(self.cfg.probe_period)
    }

    /// Without a watch on the directory (inotify off, or it could not start), a running plan's
    /// control files are read every second.
    fn polled(&self, _: &PathBuf) -> bool {
        self.watcher.as_ref().is_none_or(|w| w.0.is_finished())
    }
}

/// The most a plan file may hold (file contents travel inside it, base64-encoded).
pub const PLAN_CAP: u64 = 64 << 20;

/// Why a plan file is not read.
#[derive(Debug, thiserror::Error)]
pub enum PlanFileError {
    #[error(transparent)]
    Untrusted(#[from] trust::TrustError),
    #[error("it no longer exists")]
    Gone,
    #[error(transparent)]
    Unreadable(#[from] std::io::Error),
}

/// Read a plan file without following a link or blocking; regular files of at most [`PLAN_CAP`].
fn read_plan(path: &Path) -> Result<Vec<u8>, PlanFileError> {
    crate::safefs::read_small(path, PLAN_CAP)?.ok_or(PlanFileError::Gone)
}
