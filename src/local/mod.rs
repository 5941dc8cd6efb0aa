//! Local mode: plans are `*.plan` files in a directory (system-agent's format), their state is a
//! `.pos` file beside each, and pause/cancel are control files (`NAME.paused`, `NAME.canceled`)
//! with the same meaning and rules as remote mode's annotations (R16).
//!
//! This module owns the directory scan and watch (inotify through `notify`, plus a periodic
//! rescan), the `.pos` and control files, local retries of failed plans, and the decide/record
//! wiring for local plans (the rules themselves live in [`crate::flow`]). It must not spawn
//! processes (the applyinator does) or talk to Kubernetes.

mod dirwatch;
pub mod pos;
pub mod scan;
pub mod trust;

use crate::apply::{
    AgentExit, ApplyError, ApplyInput, Applyinator, Interrupt, Interruption, LogObserver, update_interrupt,
};
use crate::flow::{self, Decision, RunPlan, Snapshot};
use crate::plan::{self, Annotations, Hold, PlanState, ValidPlan, format_unix_date, parse_unix_date};
use crate::probe::Prober;
use crate::process::{Owner, Source};
use pos::{PlanFiles, Pos};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};

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

    /// Delay before retrying a plan that failed `failures` times in a row.
    pub fn retry_delay(&self, failures: i64) -> Duration {
        let exp = failures.clamp(1, 16) as u32 - 1;
        self.retry_base.saturating_mul(1 << exp).min(self.retry_max)
    }
}

struct Running {
    files: PlanFiles,
    tx: watch::Sender<Interrupt>,
}

/// What the agent remembers about a plan between cycles (never persisted).
#[derive(Default)]
struct Memory {
    /// R3: the invalid values already logged (logged once per distinct value).
    warned_invalid: HashSet<String>,
    /// R3: exponential backoff before this plan is looked at again.
    hold_until: Option<Instant>,
    invalid_backoff: Option<Duration>,
    /// The checksum of an unparsable plan already reported.
    warned_bad_plan: Option<String>,
    /// Backoff after an apply that could not start.
    apply_backoff: Option<Duration>,
    /// When a failed plan is due for its retry: the loop wakes then (never skips a look).
    retry_at: Option<Instant>,
}

pub struct LocalAgent {
    cfg: LocalConfig,
    app: Arc<Applyinator>,
    prober: Arc<Prober>,
    pos_lock: Arc<tokio::sync::Mutex<()>>,
    current: Arc<Mutex<Option<Running>>>,
    memory: HashMap<PathBuf, Memory>,
    blocked: HashMap<PathBuf, String>,
    /// Set while the PID directory, or a record in it whose plan cannot be known, is refused:
    /// every plan is held, as any of them may still be running.
    blocked_all: Option<String>,
    incomplete: Option<String>,
    shutdown: watch::Receiver<bool>,
    /// Wakes the dispatcher when a run starts (it polls the running plan's control files).
    started: Arc<Notify>,
}

/// Why a plan is held without anything being run or written (R3): an invalid control value, or a
/// control file that cannot be read (a directory, a FIFO, a link, too large): a value nobody can
/// read is as unknown as an invalid one.
fn hold_of(files: &PlanFiles) -> Result<Hold, String> {
    let canceled = pos::read_control(&files.canceled());
    // R2: a valid cancel wins, even over a paused file nobody can read.
    if let Ok(Some(v)) = &canceled
        && plan::parse_annotation_value(Some(v)) == Ok(true)
    {
        return Ok(Hold::Cancel);
    }
    let (p, c) = (pos::read_control(&files.paused())?, canceled?);
    plan::resolve_annotations(&Annotations { paused: p.as_deref(), canceled: c.as_deref() })
        .map_err(|e| rename_keys(e, files).to_string())
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
    let read = |p: &Path| pos::read_control(p).ok().flatten();
    let (p, c) = (read(&files.paused()), read(&files.canceled()));
    Interrupt {
        cancel: plan::parse_annotation_value(c.as_deref()) == Ok(true),
        // A plan whose file is removed while it runs stops at the next instruction boundary, as
        // a pause does (never a kill on a guess: an editor may remove and write the file back).
        pause: plan::parse_annotation_value(p.as_deref()) == Ok(true) || plan_removed(files),
        shutdown: false,
    }
}

fn plan_removed(files: &PlanFiles) -> bool {
    std::fs::symlink_metadata(&files.plan).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
}

impl LocalAgent {
    pub fn new(cfg: LocalConfig, app: Arc<Applyinator>, prober: Arc<Prober>) -> LocalAgent {
        LocalAgent {
            cfg,
            app,
            prober,
            pos_lock: Arc::new(tokio::sync::Mutex::new(())),
            current: Arc::new(Mutex::new(None)),
            memory: HashMap::new(),
            blocked: HashMap::new(),
            blocked_all: None,
            incomplete: None,
            shutdown: watch::channel(false).1,
            started: Arc::new(Notify::new()),
        }
    }

    /// Run until `shutdown` becomes true.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) -> AgentExit {
        if !self.cfg.plan_dir.is_dir() {
            tracing::warn!(
                "local plan directory {} does not exist (yet); watching for it",
                self.cfg.plan_dir.display()
            );
        }
        // R17: whatever a previous agent left running is found and stopped before any plan runs.
        self.recover_leftovers(None).await;

        let wake = Arc::new(Notify::new());
        let (ev_tx, mut ev_rx) = tokio::sync::mpsc::unbounded_channel::<PathBuf>();
        let mut watcher = self.watch_directory(ev_tx.clone());
        // Dispatcher: file events → interrupts of the running plan (R15/R16) and a new cycle. The
        // running plan's control files are also re-read every second, so pause, cancel and
        // shutdown reach it even when inotify is unavailable.
        let current = self.current.clone();
        let wake2 = wake.clone();
        let mut sd = shutdown.clone();
        let stopping = shutdown.clone();
        let started = self.started.clone();
        let running = |c: &Arc<Mutex<Option<Running>>>| c.lock().map(|c| c.is_some()).unwrap_or(false);
        let dispatcher = tokio::spawn(async move {
            let mut events_open = true;
            let deliver = |path: Option<&Path>| {
                if let Ok(cur) = current.lock()
                    && let Some(run) = cur.as_ref()
                {
                    if path.is_none_or(|p| p == run.files.paused() || p == run.files.canceled() || p == run.files.plan)
                    {
                        let next = interrupt_of(&run.files);
                        if !run.tx.borrow().pause && plan_removed(&run.files) {
                            tracing::warn!(
                                "{}: the plan file was removed while the plan runs: the running instruction \
                                 finishes and nothing new starts (it is recorded as paused, and continues if \
                                 the same plan comes back)",
                                run.files.plan.display()
                            );
                        }
                        update_interrupt(&run.tx, next, &run.files.plan.display().to_string());
                    }
                    if *stopping.borrow() {
                        run.tx.send_if_modified(|i| !std::mem::replace(&mut i.shutdown, true));
                    }
                }
            };
            loop {
                tokio::select! {
                    ev = ev_rx.recv(), if events_open => match ev {
                        Some(path) => {
                            deliver(Some(&path));
                            wake2.notify_one();
                        }
                        None => events_open = false,
                    },
                    r = sd.changed() => {
                        if r.is_err() {
                            return;
                        }
                        deliver(Some(Path::new("")));
                        wake2.notify_one();
                    }
                    // Only while a plan runs (started runs wake this loop through `started`).
                    _ = tokio::time::sleep(Duration::from_secs(1)), if running(&current) => deliver(None),
                    _ = started.notified() => {}
                }
            }
        });
        let probes =
            tokio::spawn(probe_loop(self.cfg.clone(), self.prober.clone(), self.pos_lock.clone(), shutdown.clone()));

        self.shutdown = shutdown.clone();
        loop {
            if *shutdown.borrow() {
                break;
            }
            if watcher.as_ref().is_none_or(|w| w.0.is_finished()) && self.cfg.plan_dir.is_dir() {
                watcher = self.watch_directory(ev_tx.clone());
            }
            if self.cycle().await {
                break;
            }
            // The next rescan, or sooner when a held or failed plan is due again (so a backoff of
            // 1 s is 1 s, not the rescan period).
            let next = self.next_due().map_or(self.cfg.rescan, |d| d.min(self.cfg.rescan));
            tokio::select! {
                _ = wake.notified() => {}
                _ = tokio::time::sleep(next) => {}
                _ = shutdown.changed() => {}
            }
        }
        dispatcher.abort();
        probes.abort();
        match self.incomplete.take() {
            Some(e) => AgentExit::Incomplete(e),
            None => AgentExit::Clean,
        }
    }

    fn watch_directory(&self, tx: tokio::sync::mpsc::UnboundedSender<PathBuf>) -> Option<AbortOnDrop> {
        if !self.cfg.inotify {
            return None;
        }
        match dirwatch::start(&self.cfg.plan_dir, tx) {
            Ok(task) => {
                tracing::info!("watching {} for changes", self.cfg.plan_dir.display());
                Some(AbortOnDrop(task))
            }
            Err(e) => {
                tracing::warn!("cannot watch {} ({e}); relying on the periodic rescan", self.cfg.plan_dir.display());
                None
            }
        }
    }

    /// Stop verified leftovers of local plans (all of them, or those of one plan). Plans whose
    /// leftovers cannot be stopped, or whose records are refused, are blocked; a refused record
    /// whose plan cannot be known (or a refused PID directory) blocks every plan.
    async fn recover_leftovers(&mut self, only: Option<&Path>) {
        let plan = only.map(Owner::local);
        let mut held: HashMap<PathBuf, String> = HashMap::new();
        let mut held_all = None;
        let recovered = match &plan {
            Some(p) => self.app.supervisor().recover(|rec| rec.owner.belongs_to_plan(p)).await,
            None => self.app.supervisor().recover(|rec| rec.owner.belongs_to(Source::Local)).await,
        };
        for r in recovered {
            let Some(why) = r.hold_reason() else { continue };
            let plan = r.record.as_ref().and_then(|rec| rec.owner.local_plan());
            match plan {
                Some(plan) => {
                    tracing::error!("{}: {why}; the plan is blocked until this is resolved", plan.display());
                    held.insert(plan, why);
                }
                None => {
                    tracing::error!("{why}; every local plan is blocked until this is resolved");
                    held_all = Some(why);
                }
            }
        }
        match only {
            Some(p) => {
                // Kept records (not stopped, refused) are exactly what this recovery reported.
                match held.remove(p).or_else(|| held_all.clone()) {
                    Some(why) => self.blocked.insert(p.to_path_buf(), why),
                    None => self.blocked.remove(p),
                };
            }
            None => self.blocked.extend(held),
        }
        self.blocked_all = held_all;
    }

    /// One pass over every plan. Returns true when the agent must stop (shutdown).
    async fn cycle(&mut self) -> bool {
        for path in scan::scan(&self.cfg.plan_dir) {
            if *self.shutdown.borrow() || self.reconcile(&path).await {
                return true;
            }
        }
        false
    }

    async fn update_pos(&self, files: &PlanFiles, f: impl FnOnce(&mut Pos)) {
        let _g = self.pos_lock.lock().await;
        let path = files.pos();
        let mut p = pos::read_pos(&path).unwrap_or_default();
        f(&mut p);
        // The write ends in an fsync: off the async threads.
        let written = tokio::task::spawn_blocking(move || {
            pos::write_pos(&path, &p).map_err(|e| format!("cannot write {}: {e}", path.display()))
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r);
        if let Err(e) = written {
            tracing::error!("{e}");
        }
    }

    /// How long until the earliest held or failed plan is due again.
    fn next_due(&self) -> Option<Duration> {
        let now = Instant::now();
        self.memory
            .values()
            .flat_map(|m| [m.hold_until, m.retry_at])
            .flatten()
            // One already past was looked at by the cycle that just ran (or its plan is gone).
            .filter(|t| *t > now)
            .min()
            .map(|t| t.saturating_duration_since(now))
    }

    /// R3-style hold: nothing is run or written for `path`; `why` is logged once per distinct
    /// text and the plan is looked at again with exponential backoff (1 s doubling to 5 min).
    fn hold_once(&mut self, path: &Path, why: String) {
        let mem = self.memory.entry(path.to_path_buf()).or_default();
        if mem.warned_invalid.insert(why.clone()) {
            tracing::warn!("{why}");
        }
        let b = mem.invalid_backoff.map_or(Duration::from_secs(1), |b| (b * 2).min(Duration::from_secs(300)));
        mem.invalid_backoff = Some(b);
        mem.hold_until = Some(Instant::now() + b);
    }

    /// Reconcile one plan. Returns true on shutdown.
    async fn reconcile(&mut self, path: &Path) -> bool {
        let Some(files) = PlanFiles::new(path) else { return false };
        let mem = self.memory.entry(path.to_path_buf()).or_default();
        if mem.hold_until.is_some_and(|t| Instant::now() < t) {
            return false;
        }
        if self.blocked.contains_key(path) || self.blocked_all.is_some() {
            self.recover_leftovers(Some(path)).await;
            if let Some(why) = self.blocked.get(path).cloned() {
                self.update_pos(&files, |p| p.blocked = why).await;
                // Each look runs the stop ladder again: back off so other plans are not held up.
                let mem = self.memory.entry(path.to_path_buf()).or_default();
                let b = mem.apply_backoff.map_or(Duration::from_secs(5), |b| (b * 2).min(Duration::from_secs(300)));
                mem.apply_backoff = Some(b);
                mem.hold_until = Some(Instant::now() + b);
                return false;
            }
            self.update_pos(&files, |p| p.blocked.clear()).await;
        }
        // Anyone who can write the plan can run commands as root; a file that is not what it
        // should be (a FIFO, a link, too large) is refused without blocking. Both hold the plan.
        let raw = match trust::check(path).and_then(|()| read_plan(path)) {
            Ok(r) => r,
            Err(e) => {
                self.hold_once(path, format!("{}: refused: {e}; the plan is held and nothing is run", path.display()));
                return false;
            }
        };
        let checksum = plan::checksum(&raw);
        let vp = match plan::parse(&raw) {
            Ok(v) => v,
            Err(e) => {
                let mem = self.memory.entry(path.to_path_buf()).or_default();
                if mem.warned_bad_plan.as_deref() != Some(checksum.as_str()) {
                    tracing::error!("{}: {e}", path.display());
                    mem.warned_bad_plan = Some(checksum);
                }
                return false;
            }
        };

        // The .pos file: unreadable → kept aside, the plan starts over.
        let mut stored = {
            let _g = self.pos_lock.lock().await;
            match pos::read_pos(&files.pos()) {
                Ok(p) => p,
                Err(e @ pos::PosError::Unusable(_)) => {
                    drop(_g);
                    self.hold_once(
                        path,
                        format!("{}: {e}; the plan is held until it is removed", files.pos().display()),
                    );
                    return false;
                }
                Err(e) => {
                    let aside = files.pos().with_extension("pos.invalid");
                    tracing::error!("{}: {e}; moved to {} and starting over", files.pos().display(), aside.display());
                    let _ = std::fs::rename(files.pos(), &aside);
                    Pos::default()
                }
            }
        };
        // R3: an invalid or unreadable control value holds the plan: nothing is written or run.
        let hold = match hold_of(&files) {
            Ok(h) => h,
            Err(e) => {
                self.hold_once(path, format!("{}: {e}; the plan is held and nothing is written", path.display()));
                return false;
            }
        };
        // A reset is an orchestrator's write: not while an invalid control value holds the plan (R3).
        if files.reset().exists() {
            tracing::info!("{}: reset requested; the plan runs again from its first instruction", path.display());
            stored.plan_state = PlanState::Pending.as_str().into();
            stored.checkpoint = None;
            stored.failure_count = 0;
            let s = stored.clone();
            self.update_pos(&files, |p| {
                p.plan_state = s.plan_state;
                p.checkpoint = None;
                p.failure_count = 0;
            })
            .await;
            let _ = std::fs::remove_file(files.reset());
        }
        // A .pos written by system-agent has no plan state: a plan it applied counts as succeeded
        // (it is not run again after a migration).
        if stored.plan_checksum.is_empty() && stored.applied_checksum == checksum {
            stored.plan_checksum = checksum.clone();
            stored.plan_state = PlanState::Succeeded.as_str().into();
        }
        let same_plan = stored.plan_checksum == checksum;
        let mut state = if same_plan && !stored.plan_state.is_empty() {
            PlanState::parse(&stored.plan_state)
        } else {
            PlanState::Pending
        };
        // Local mode is its own orchestrator: a failed plan is retried after a backoff.
        if state == PlanState::Failed && hold == Hold::None {
            let last = parse_unix_date(&stored.last_apply_time);
            let delay = self.cfg.retry_delay(stored.failure_count);
            let due =
                last.is_none_or(|t| chrono::Utc::now() >= t + chrono::Duration::from_std(delay).unwrap_or_default());
            let mem = self.memory.entry(path.to_path_buf()).or_default();
            if due {
                tracing::info!("{}: retrying after failure {}", path.display(), stored.failure_count);
                state = PlanState::Pending;
                mem.retry_at = None;
            } else if mem.retry_at.is_none()
                && let Some(t) = last
            {
                // Due later (a failure recorded by an earlier run of the agent): wake then.
                let left = (t + chrono::Duration::from_std(delay).unwrap_or_default() - chrono::Utc::now())
                    .to_std()
                    .unwrap_or_default();
                mem.retry_at = Some(Instant::now() + left);
            }
        }
        let snap = Snapshot {
            checksum: checksum.clone(),
            state,
            hold: Ok(hold),
            checkpoint: stored.checkpoint.clone().filter(|c| same_plan && c.checksum == checksum),
            total: vp.plan.instructions.len(),
        };

        let mem = self.memory.entry(path.to_path_buf()).or_default();
        mem.invalid_backoff = None;
        mem.hold_until = None;
        mem.warned_invalid.clear();

        match flow::decide(&snap) {
            Decision::Invalid(_) | Decision::Observe => false,
            Decision::Record { transition, partial_cancel } => {
                if partial_cancel {
                    tracing::warn!(
                        "{}: canceled after {}/{} instructions; the node may be left partly changed",
                        path.display(),
                        transition.checkpoint.completed_instructions,
                        transition.checkpoint.total_instructions
                    );
                }
                tracing::info!("{}: {}", path.display(), transition.state);
                self.update_pos(&files, |p| {
                    p.plan_state = transition.state.as_str().into();
                    p.plan_checksum = checksum.clone();
                    p.checkpoint = Some(transition.checkpoint);
                })
                .await;
                false
            }
            Decision::Run(run) => self.run_plan(&files, &vp, &snap, &stored, run).await,
        }
    }

    async fn run_plan(
        &mut self,
        files: &PlanFiles,
        vp: &ValidPlan,
        snap: &Snapshot,
        stored: &Pos,
        run: RunPlan,
    ) -> bool {
        let path = &files.plan;
        let same_plan = stored.plan_checksum == snap.checksum;
        let failures = if same_plan { stored.failure_count } else { 0 };
        if run.begin || run.resume.is_some() {
            let (state, cp) = match (&run.resume, run.begin) {
                (_, true) => (PlanState::InProgress, run.resume.as_ref().map(|t| t.checkpoint.clone())),
                (Some(t), false) => (t.state.clone(), Some(t.checkpoint.clone())),
                (None, false) => (snap.state.clone(), snap.checkpoint.clone()),
            };
            let cs = snap.checksum.clone();
            self.update_pos(files, |p| {
                p.plan_state = state.as_str().into();
                p.plan_checksum = cs;
                p.checkpoint = cp;
                if !same_plan {
                    p.failure_count = 0;
                }
            })
            .await;
        }
        // An unreadable (or oversized) output in the .pos is treated as empty, with a warning.
        let pos_name = files.pos().display().to_string();
        let warn = |field: &str, e: plan::CodecError| tracing::warn!("{pos_name}: {field}: {e}; treated as empty");
        let decode = |b: &[u8]| {
            plan::decode_one_time_output(b).unwrap_or_else(|e| {
                warn("output", e);
                BTreeMap::new()
            })
        };
        let one_time_output = if same_plan && run.resume_from > 0 { decode(&stored.output) } else { BTreeMap::new() };
        let periodic_output = plan::decode_periodic_output(&stored.periodic_output).unwrap_or_else(|e| {
            warn("periodicOutput", e);
            BTreeMap::new()
        });
        let (tx, rx) = watch::channel(Interrupt { shutdown: *self.shutdown.borrow(), ..interrupt_of(files) });
        if let Ok(mut cur) = self.current.lock() {
            *cur = Some(Running { files: files.clone(), tx });
        }
        self.started.notify_one();
        // The files were read before the registration: look again so a change in between is seen.
        if let Ok(cur) = self.current.lock()
            && let Some(r) = cur.as_ref()
        {
            let now = interrupt_of(files);
            r.tx.send_modify(|i| {
                i.cancel |= now.cancel;
                i.pause |= now.pause;
            });
        }
        if run.one_time {
            if run.resume_from == 0 {
                tracing::info!("{}: applying ({} instructions)", path.display(), snap.total);
            } else {
                tracing::info!(
                    "{}: resuming at instruction {}/{}",
                    path.display(),
                    (run.resume_from + 1).min(snap.total),
                    snap.total
                );
            }
        }
        let result = self
            .app
            .apply(ApplyInput {
                plan: vp,
                reconcile_files: run.one_time,
                run_one_time: run.one_time,
                attempt: failures + 1,
                resume_from: run.resume_from,
                one_time_output,
                periodic_output,
                run_periodic: true,
                interrupts: rx,
                owner: Owner::local(path),
                observer: Arc::new(LogObserver),
            })
            .await;
        if let Ok(mut cur) = self.current.lock() {
            *cur = None;
        }
        let result = match result {
            Ok(r) => r,
            Err(ApplyError::Files(e)) => {
                // Files that cannot be written fail the apply, as a failing instruction does: it
                // is recorded (state, counters, time) and retried on the local schedule.
                let failures = failures + 1;
                let delay = self.cfg.retry_delay(failures);
                tracing::error!(
                    "{}: files: {e}; the apply failed (failure {failures}); retrying in {}",
                    path.display(),
                    crate::process::human_duration(delay)
                );
                let (cs, now) = (snap.checksum.clone(), format_unix_date(chrono::Utc::now()));
                self.update_pos(files, |p| {
                    p.plan_state = PlanState::Failed.as_str().into();
                    p.plan_checksum = cs.clone();
                    p.failed_checksum = cs;
                    p.failure_count = failures;
                    p.success_count = 0;
                    p.last_apply_time = now;
                })
                .await;
                let mem = self.memory.entry(path.to_path_buf()).or_default();
                mem.retry_at = Some(Instant::now() + delay);
                return false;
            }
            Err(e) => {
                // An apply that could not start (interlock, files) records nothing and is retried
                // with backoff; the plan keeps its state.
                let mem = self.memory.entry(path.to_path_buf()).or_default();
                let b = mem.apply_backoff.map_or(Duration::from_secs(1), |b| (b * 2).min(Duration::from_secs(300)));
                mem.apply_backoff = Some(b);
                mem.hold_until = Some(Instant::now() + b);
                tracing::error!("{}: {e}; retrying in {}", path.display(), crate::process::human_duration(b));
                return false;
            }
        };
        if let Some(mem) = self.memory.get_mut(path) {
            mem.apply_backoff = None;
        }
        if let Some(why) = result.incomplete_reason() {
            tracing::error!("{}: {why}", path.display());
            self.blocked.insert(path.to_path_buf(), why.clone());
            self.incomplete = Some(why);
        }
        // R11: the applyinator logs the warning for an interrupted instruction.
        let rec = flow::record(snap, &run, &result);
        let now = format_unix_date(chrono::Utc::now());
        let cs = snap.checksum.clone();
        self.update_pos(files, |p| {
            if let Some(s) = &rec.state {
                p.plan_state = s.as_str().into();
                p.plan_checksum = cs.clone();
            }
            if let Some(cp) = rec.checkpoint.clone() {
                p.checkpoint = cp;
            }
            match rec.succeeded {
                Some(true) => {
                    p.applied_checksum = cs.clone();
                    p.output = plan::encode_one_time_output(rec.one_time_output.as_ref().unwrap_or(&BTreeMap::new()));
                    p.failure_count = 0;
                    p.failed_checksum.clear();
                    p.failed_output.clear();
                    p.success_count += 1;
                    p.last_apply_time = now.clone();
                }
                Some(false) => {
                    p.failed_checksum = cs.clone();
                    p.failed_output =
                        plan::encode_one_time_output(rec.one_time_output.as_ref().unwrap_or(&BTreeMap::new()));
                    p.failure_count = failures + 1;
                    p.success_count = 0;
                    p.last_apply_time = now.clone();
                }
                None => {
                    if let Some(o) = &rec.one_time_output {
                        p.output = plan::encode_one_time_output(o);
                    }
                }
            }
            if let Some(o) = &rec.periodic_output {
                p.periodic_output = plan::encode_periodic_output(o);
            }
        })
        .await;
        match (rec.state.as_ref(), result.interruption) {
            (_, Some(Interruption::Shutdown)) => {
                tracing::info!(
                    "{}: stopped for shutdown; it runs again from its first instruction at the next start",
                    path.display()
                );
                return true;
            }
            (Some(s), _) => {
                tracing::info!("{}: {s} ({}/{} instructions)", path.display(), result.completed, snap.total)
            }
            (None, _) => {}
        }
        if run.one_time && result.interruption.is_none() {
            let statuses = self.prober.probe_all(&vp.plan.probes, &stored.probe_status, true).await;
            self.update_pos(files, |p| p.probe_status = statuses).await;
        }
        false
    }
}

/// The most a plan file may hold (file contents travel inside it, base64-encoded).
pub const PLAN_CAP: u64 = 64 << 20;

/// Read a plan file without following a link or blocking; regular files of at most [`PLAN_CAP`].
fn read_plan(path: &Path) -> Result<Vec<u8>, String> {
    match crate::safefs::read_small(path, PLAN_CAP) {
        Ok(Some(raw)) => Ok(raw),
        Ok(None) => Err("it no longer exists".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Aborts the task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Every `probe_period`, run every plan's probes and record their statuses (R10: also while a plan
/// is paused or canceled; not while it is held by an invalid control-file value, R3).
async fn probe_loop(
    cfg: LocalConfig,
    prober: Arc<Prober>,
    pos_lock: Arc<tokio::sync::Mutex<()>>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        for path in scan::scan(&cfg.plan_dir) {
            let Some(files) = PlanFiles::new(&path) else { continue };
            if hold_of(&files).is_err() {
                continue;
            }
            let Ok(vp) = trust::check(&path)
                .and_then(|()| read_plan(&path))
                .and_then(|raw| plan::parse(&raw).map_err(|e| e.to_string()))
            else {
                continue;
            };
            if vp.plan.probes.is_empty() {
                continue;
            }
            let previous = pos::read_pos(&files.pos()).map(|p| p.probe_status).unwrap_or_default();
            let statuses = prober.probe_all(&vp.plan.probes, &previous, false).await;
            let _g = pos_lock.lock().await;
            if let Ok(mut p) = pos::read_pos(&files.pos())
                && p.probe_status != statuses
            {
                p.probe_status = statuses;
                let path = files.pos();
                let written = tokio::task::spawn_blocking(move || pos::write_pos(&path, &p).map(|_| ())).await;
                if let Ok(Err(e)) | Err(e) = written.map_err(std::io::Error::other) {
                    tracing::error!("cannot write {}: {e}", files.pos().display());
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(cfg.probe_period) => {}
            r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { return },
        }
    }
}
