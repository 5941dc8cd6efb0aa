//! Local mode: plans are `*.plan` files in a directory (system-agent's format), their state is a
//! `.pos` file beside each, and pause/cancel are control files (`NAME.paused`, `NAME.canceled`)
//! with the same meaning and rules as remote mode's annotations (R16).
//!
//! This module owns the plan directory as a plan source of [`crate::reconcile`]: the scan and the
//! watch (inotify through the `inotify` crate, plus a periodic rescan), reading plans, `.pos` and
//! control files without following links or blocking, and writing `.pos` files (off the agent's
//! threads, waited for 5 s: a plan whose write has not landed is held until it has, R31). What a `.pos`
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

    /// The first retry's delay (`localRetrySeconds`). One later than the usual cap is what was
    /// asked for: the cap moves up to it rather than cutting it short unsaid.
    pub fn set_retry_base(&mut self, base: Duration) {
        self.retry_base = base;
        self.retry_max = self.retry_max.max(base);
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
    /// Per plan file, a write the disk did not finish in time (R31).
    unsettled: HashMap<PathBuf, Unsettled>,
    /// The plan directory, locked (`flock`) for as long as this agent runs: one agent per plan
    /// directory. `None` until taken.
    fence: Fence,
}

/// One agent per plan directory (R32): an exclusive `flock` on the directory itself, taken before
/// any plan of it is looked at and held until the process ends (the kernel drops it then, so a
/// crashed agent leaves no stale holder; instructions do not inherit it).
#[derive(Debug, Default)]
enum Fence {
    #[default]
    Untried,
    /// Another process holds it: nothing of the directory is looked at.
    Waiting,
    Held(rustix::fd::OwnedFd),
    /// Cannot be taken here (no such directory yet, a file system without locks): plans go on.
    Unavailable,
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

/// A write beside a plan (its `.pos`, an unreadable `.pos` moved aside) that the disk did not
/// finish in [`crate::disk::PATIENCE`] (R31): it still runs, and until it has, nothing else of
/// the plan is read, decided or written (a look sees the plan held): a `.pos` read before the
/// write lands would be the state before it, and a decision on it could run the plan again.
struct Unsettled {
    write: tokio::task::JoinHandle<()>,
    /// What the look says while it waits (the same text each time: a held plan's line is logged
    /// once per distinct text).
    why: String,
}

/// The text of a write (`what`: "write PATH") that did not land in time.
fn not_answered(what: &str) -> String {
    format!(
        "cannot {what}: the disk did not answer in {}; nothing else of the plan is decided until that write lands",
        crate::duration::human(crate::disk::PATIENCE)
    )
}

impl DirSource {
    pub fn new(cfg: LocalConfig) -> DirSource {
        if !cfg.plan_dir.is_dir() {
            tracing::warn!("local plan directory {} does not exist (yet); watching for it", cfg.plan_dir.display());
        }
        let (events_tx, events) = mpsc::unbounded_channel();
        DirSource {
            cfg,
            events_tx,
            events,
            watcher: None,
            noted: HashSet::new(),
            shows: HashMap::new(),
            unsettled: HashMap::new(),
            fence: Fence::Untried,
        }
    }

    /// Whether this agent may look at the plan directory's plans: it holds the directory's lock,
    /// or the lock cannot be taken here. Tried again at every pass while another agent holds it.
    fn fenced(&mut self) -> bool {
        use rustix::fs::{FlockOperation, Mode, OFlags};
        if let Fence::Held(fd) = &self.fence {
            // The directory removed (and maybe made again): the lock held on the old one is let go,
            // since holding it open would also keep its watch from hearing of the removal.
            let same = |a: &rustix::fs::Stat, b: &rustix::fs::Stat| a.st_dev == b.st_dev && a.st_ino == b.st_ino;
            match (rustix::fs::fstat(fd), rustix::fs::stat(&self.cfg.plan_dir)) {
                (Ok(held), Ok(now)) if same(&held, &now) => return true,
                _ => self.fence = Fence::Untried,
            }
        }
        if matches!(self.fence, Fence::Unavailable) {
            return true;
        }
        let dir = self.cfg.plan_dir.display().to_string();
        let target = format!("directory {dir}");
        let opened = rustix::fs::open(
            &self.cfg.plan_dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
            Mode::empty(),
        );
        let fd = match opened {
            Ok(fd) => fd,
            // Not there yet: nothing to look at; tried again when it is.
            Err(rustix::io::Errno::NOENT) => return true,
            Err(e) => {
                tracing::warn!("{dir}: cannot lock it ({e}); a second agent on it would not be kept off");
                self.fence = Fence::Unavailable;
                return true;
            }
        };
        match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {
                if matches!(self.fence, Fence::Waiting) {
                    tracing::info!("holding the plan directory {dir}: the agent that held it is gone");
                }
                crate::board::lease(&target, "held (one agent per plan directory)");
                self.fence = Fence::Held(fd);
                true
            }
            Err(rustix::io::Errno::WOULDBLOCK) => {
                if !matches!(self.fence, Fence::Waiting) {
                    tracing::warn!(
                        "waiting for the plan directory {dir}: another agent holds it; none of its plans is looked at until that agent stops"
                    );
                    crate::board::lease(&target, "waiting (another agent holds the plan directory)");
                }
                self.fence = Fence::Waiting;
                false
            }
            Err(e) => {
                tracing::warn!("{dir}: cannot lock it ({e}); a second agent on it would not be kept off");
                self.fence = Fence::Unavailable;
                true
            }
        }
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
    async fn update(&mut self, files: &PlanFiles, f: impl FnOnce(&mut Pos)) -> Written {
        if let Some(why) = self.waiting(&files.plan) {
            return Written::failed(why);
        }
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
        let what = format!("write {}", path.display());
        self.write(&files.plan, &what, move || pos::write_pos(&path, &p).map(drop)).await
    }

    /// Run `op` (`what`: "write PATH", a write beside the plan `plan`; `.pos` writes end in an
    /// fsync) off the agent's threads, waiting for it at most [`crate::disk::PATIENCE`] (R31).
    /// One that takes longer still runs; the plan is then held ([`DirSource::waiting`]) until it
    /// has, and the loop hears of it when it lands (a change of the directory).
    async fn write(
        &mut self,
        plan: &Path,
        what: &str,
        op: impl FnOnce() -> std::io::Result<()> + Send + 'static,
    ) -> Written {
        let gave_up = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (late, wake, key) = (gave_up.clone(), self.events_tx.clone(), plan.to_path_buf());
        let (tx, rx) = tokio::sync::oneshot::channel();
        let write = tokio::task::spawn_blocking(move || {
            let _ = tx.send(op());
            if late.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = wake.send(key);
            }
        });
        match tokio::time::timeout(crate::disk::PATIENCE, rx).await {
            Ok(Ok(Ok(()))) => Written::Done,
            Ok(Ok(Err(e))) => Written::failed(format!("cannot {what}: {e}")),
            Ok(Err(_)) => Written::failed(format!("cannot {what}: it did not finish (it panicked)")),
            Err(_) => {
                gave_up.store(true, std::sync::atomic::Ordering::SeqCst);
                let why = not_answered(what);
                self.unsettled.insert(plan.to_path_buf(), Unsettled { write, why: why.clone() });
                Written::failed(why)
            }
        }
    }

    /// Why nothing of `plan` may be read or written now: a write beside it has not landed.
    fn waiting(&mut self, plan: &Path) -> Option<String> {
        let u = self.unsettled.get(plan)?;
        if !u.write.is_finished() {
            return Some(u.why.clone());
        }
        self.unsettled.remove(plan);
        None
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
        if !self.fenced() {
            return Vec::new();
        }
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
        // A late write of a plan that is gone is forgotten once it has landed.
        self.unsettled.retain(|plan, u| !u.write.is_finished() || found.plans.contains(plan));
        found.plans
    }

    async fn show(&mut self, path: &PathBuf) {
        for show in self.shows.remove(path).unwrap_or_default() {
            match show {
                LocalShow::Aside { from, to, why } => {
                    let (shown, what) = (from.display().to_string(), format!("move it to {}", to.display()));
                    let moved = format!("{shown}: {why}; moved to {} and starting over", to.display());
                    match self.write(path, &what, move || std::fs::rename(&from, &to)).await {
                        Written::Done => tracing::error!("{moved}"),
                        Written::Failed { error, .. } => tracing::error!("{shown}: {why}; {error}"),
                        Written::Abandoned => {}
                    }
                }
                LocalShow::Reset { pos, reset, stored } => {
                    let what = format!("write {}", pos.display());
                    let op = move || {
                        pos::write_pos(&pos, &stored)?;
                        let _ = std::fs::remove_file(reset);
                        Ok(())
                    };
                    if let Written::Failed { error, .. } = self.write(path, &what, op).await {
                        tracing::error!("{error}");
                    }
                }
            }
        }
    }

    async fn look(&mut self, path: &PathBuf) -> Seen {
        self.shows.remove(path);
        if let Some(why) = self.waiting(path) {
            return Seen::Held(why);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_first_retry_later_than_the_usual_cap_is_kept() {
        let mut c = LocalConfig::new("/plans");
        c.set_retry_base(Duration::from_secs(3600));
        assert_eq!(c.retry().delay(1), Duration::from_secs(3600), "not cut to 5 minutes");
        assert_eq!(c.retry().delay(4), Duration::from_secs(3600));
        let mut c = LocalConfig::new("/plans");
        c.set_retry_base(Duration::from_secs(30));
        assert_eq!(c.retry().delay(2), Duration::from_secs(60));
        assert_eq!(c.retry().delay(9), Duration::from_secs(300), "the usual cap");
    }
}
