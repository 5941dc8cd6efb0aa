//! The applyinator: carries out one plan. It writes the plan's files, runs the one-time
//! instructions in order (stopping at the first failure), runs due periodic instructions, and obeys
//! interrupts: a pause stops at the next instruction boundary, a cancel (or agent shutdown) runs the
//! stop ladder on the running instruction's whole tree and starts nothing more.
//!
//! It owns the execution directory layout, the instruction environment, the applied-plan archive,
//! the interlock directory and the result of a run. It must not talk to Kubernetes or read the plan
//! directory (its callers decide what to run and record what happened), and it never spawns or
//! signals a process itself: every process goes through [`crate::process`].

mod archive;
pub mod files;
pub mod periodic;
#[cfg(unix)]
pub mod preview;

pub use archive::InterlockError;
pub use files::FileError;

use crate::plan::failure::display_name;
use crate::plan::{OneTimeInstruction, PeriodicInstructionOutput, ValidPlan};
use crate::process::{
    LogSink, Outcome, Output, Owner, OwnerLock, Slot, Source, SpawnSpec, StopReason, StopSignal, Supervisor,
};
use chrono::{DateTime, Utc};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// What the applyinator needs from the agent's configuration.
#[derive(Debug, Clone)]
pub struct ApplyConfig {
    /// Per-apply execution directories live here; wiped at each apply unless preserved.
    pub work_dir: PathBuf,
    pub preserve_work_dir: bool,
    /// Archive of applied plans (newest 64 kept); `None` = no archive.
    pub applied_plan_dir: Option<PathBuf>,
    /// system-agent's upgrade interlock (`applyinator-active`, `restart-pending`).
    pub interlock_dir: Option<PathBuf>,
    /// The environment instructions start from (the agent's own).
    pub base_env: Vec<(OsString, OsString)>,
    /// Where `image` instructions get their images.
    pub images: crate::image::ImageConfig,
    /// Offer one-time instructions a restart request ([`RESTART_REQUEST_ENV`]): the agent sets
    /// this; `nodeplan apply` (which has nothing to restart) does not.
    pub restart_requests: bool,
    /// The level instruction output is logged at, line by line: debug for the agent (a fleet's
    /// logs stay small, and output may hold what should not be shipped; [`LogObserver`] logs the
    /// last lines of a failure), info for `nodeplan apply`, whose operator watches it.
    pub output_level: tracing::Level,
}

/// The variable naming the file a one-time instruction creates to have the agent restart (re-exec
/// its binary) once the instruction has succeeded and its progress is recorded: how a plan that
/// upgrades nodeplan itself finishes without running its upgrade again (R23).
pub const RESTART_REQUEST_ENV: &str = "NODEPLAN_RESTART_REQUEST";
const RESTART_REQUEST_FILE: &str = ".nodeplan-restart";

impl ApplyConfig {
    pub fn new(work_dir: impl Into<PathBuf>) -> ApplyConfig {
        ApplyConfig {
            work_dir: work_dir.into(),
            preserve_work_dir: false,
            applied_plan_dir: None,
            interlock_dir: None,
            base_env: std::env::vars_os().collect(),
            images: crate::image::ImageConfig::default(),
            restart_requests: false,
            output_level: tracing::Level::DEBUG,
        }
    }
}

/// The latest interrupt requests (a `watch` value: latest wins).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Interrupt {
    pub pause: bool,
    pub cancel: bool,
    /// The agent is stopping: treated like cancel for the running tree, recorded differently.
    pub shutdown: bool,
    /// The agent may not act on the plan source now (its Lease, R26): the running tree is stopped
    /// as for a shutdown, and the progress recorded as at a restart point.
    pub fenced: bool,
}

impl Interrupt {
    fn stop_reason(&self) -> Option<StopReason> {
        if self.cancel {
            Some(StopReason::Cancel)
        } else if self.shutdown || self.fenced {
            Some(StopReason::Shutdown)
        } else {
            None
        }
    }
    fn boundary(&self) -> Option<Interruption> {
        // A fenced stop is recorded even when the agent also shuts down (a lost Lease does both):
        // the next holder goes on at the boundary (R26).
        if self.cancel {
            Some(Interruption::Canceled)
        } else if self.fenced {
            Some(Interruption::Fenced)
        } else if self.shutdown {
            Some(Interruption::Shutdown)
        } else if self.pause {
            Some(Interruption::Paused)
        } else {
            None
        }
    }
}

/// How an agent driver (local or remote) ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentExit {
    /// Shut down cleanly.
    Clean,
    /// A process could not be stopped on the way out.
    Incomplete(String),
    /// Stopped so that another agent acts on the plan source alone (it took the Lease, or Rancher's
    /// own agent started on this node): why.
    Displaced(String),
    /// Stopped because an instruction asked for the agent to restart (R23), its progress recorded.
    Restart,
}

pub use crate::plan::Interruption;

/// What a stop of the running tree means: a shutdown stop is the agent's shutdown only while it
/// shuts down and is not fenced (see [`Interrupt::boundary`]); otherwise the fence asked for it,
/// though it may have opened again while the tree was on its way out (R26).
fn interruption_of_stop(r: StopReason, now: Interrupt) -> Option<Interruption> {
    match r {
        StopReason::Cancel => Some(Interruption::Canceled),
        StopReason::Shutdown if now.shutdown && !now.fenced => Some(Interruption::Shutdown),
        StopReason::Shutdown => Some(Interruption::Fenced),
        StopReason::Timeout(_) => None,
    }
}

/// A source of "now" (UTC), so schedules can be tested with a fixed clock.
pub trait Clock: Send + Sync {
    fn now(&self) -> DateTime<Utc>;
}

pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// Progress callbacks (the CLI's live display).
pub trait Observer: Send + Sync {
    fn instruction_started(&self, _index: usize, _total: usize, _name: &str, _periodic: bool) {}
    fn instruction_finished(&self, _report: &InstructionReport) {}
}

pub struct NoObserver;
impl Observer for NoObserver {}

/// The agent's observer: each one-time instruction's start and end at info (a failure at error),
/// periodic instructions at debug (a failure at info), so a fleet's logs stay small. Instructions
/// are numbered `i/n` from 1; durations are [`crate::duration::human`]s. Output is logged line by
/// line at debug only (`ApplyConfig::output_level`); a failure (not a cancel or a stop) is
/// followed by the last [`FAILURE_TAIL_LINES`] lines of its output, at the failure's level.
pub struct LogObserver;

/// Lines of a failed instruction's output that [`LogObserver`] logs with the failure.
pub const FAILURE_TAIL_LINES: usize = crate::plan::failure::LINES;

impl Observer for LogObserver {
    fn instruction_started(&self, index: usize, total: usize, name: &str, periodic: bool) {
        let what = instruction_label(index, total, name, periodic);
        if periodic {
            tracing::debug!("{what}: started");
        } else {
            crate::board::instruction(Some(&what));
            tracing::info!("{what}: started");
        }
    }
    fn instruction_finished(&self, r: &InstructionReport) {
        let what = instruction_label(r.index, r.total, &r.name, r.periodic);
        if !r.periodic {
            crate::board::instruction(None);
        }
        let word = result_word(&r.outcome);
        let line = format!("{what}: {word} ({}, {})", r.outcome, crate::duration::human(r.elapsed));
        let tail = if word == "FAILED" { r.mask.tail(&r.output.combined, FAILURE_TAIL_LINES) } else { Vec::new() };
        let tail = tail.iter().map(|l| format!("{what}: | {l}"));
        match (word, r.periodic) {
            ("ok", false) => tracing::info!("{line}"),
            ("ok", true) => tracing::debug!("{line}"),
            ("FAILED", false) => {
                tracing::error!("{line}");
                tail.for_each(|l| tracing::error!("{l}"));
            }
            ("FAILED", true) => {
                tracing::info!("{line}");
                tail.for_each(|l| tracing::info!("{l}"));
            }
            (_, true) => tracing::info!("{line}"),
            (_, false) => tracing::warn!("{line}"),
        }
    }
}

/// How an instruction ended, in one word: `ok`, `canceled` or `stopped` (the agent shutting down)
/// when the stop came from outside, `FAILED` otherwise (a timeout included).
pub fn result_word(o: &Outcome) -> &'static str {
    match o.stop_reason() {
        _ if o.success() => "ok",
        Some(StopReason::Cancel) => "canceled",
        Some(StopReason::Shutdown) => "stopped",
        _ => "FAILED",
    }
}

/// What the instruction metric says of an outcome: [`result_word`] as a label.
pub fn instruction_metric(o: &Outcome) -> crate::metrics::InstructionResult {
    use crate::metrics::InstructionResult;
    match result_word(o) {
        "ok" => InstructionResult::Ok,
        "canceled" => InstructionResult::Canceled,
        "stopped" => InstructionResult::Stopped,
        _ => InstructionResult::Failed,
    }
}

/// `instruction 2/3 install` or `periodic instruction 1/1 check`: numbered from 1.
pub fn instruction_label(index: usize, total: usize, name: &str, periodic: bool) -> String {
    let kind = if periodic { "periodic instruction" } else { "instruction" };
    format!("{kind} {}/{total} {}", index + 1, display_name(name))
}

/// What to apply and from where.
pub struct ApplyInput<'a> {
    pub plan: &'a ValidPlan,
    pub reconcile_files: bool,
    pub run_one_time: bool,
    /// `CATTLE_AGENT_ATTEMPT_NUMBER` for one-time instructions.
    pub attempt: i64,
    /// Absolute index of the first one-time instruction to run (a checkpoint's completed count).
    pub resume_from: usize,
    /// Saved outputs of earlier attempts (kept for instructions that are not re-run).
    pub one_time_output: BTreeMap<String, Vec<u8>>,
    pub periodic_output: BTreeMap<String, PeriodicInstructionOutput>,
    pub run_periodic: bool,
    pub interrupts: watch::Receiver<Interrupt>,
    /// Whose plan this is (its source and id, without a slot): each instruction's process gets it
    /// with the instruction's [`Slot`] as the owner in its PID record.
    pub owner: Owner,
    pub observer: Arc<dyn Observer>,
}

impl ApplyInput<'_> {
    /// The latest interrupt requests.
    fn interrupt(&self) -> Interrupt {
        *self.interrupts.borrow()
    }
}

/// One instruction's outcome.
#[derive(Debug, Clone)]
pub struct InstructionReport {
    /// From 0, as in the execution directory's name; people see `index + 1` of `total`.
    pub index: usize,
    /// One-time or periodic instructions in the plan.
    pub total: usize,
    pub name: String,
    pub periodic: bool,
    pub outcome: Outcome,
    pub elapsed: Duration,
    /// What the instruction wrote (each stream and the interleaved capture, capped).
    pub output: Output,
    /// What must not be shown of it (its `env`'s values).
    pub mask: crate::plan::failure::Mask,
}

#[derive(Debug, Clone, Default)]
pub struct ApplyResult {
    /// All one-time instructions ran and succeeded (false when they were not run).
    pub one_time_succeeded: bool,
    /// Absolute index: one past the last completed one-time instruction.
    pub completed: usize,
    pub total: usize,
    pub interruption: Option<Interruption>,
    /// A stopped tree may have survivors (see the outcomes).
    pub termination_incomplete: bool,
    pub one_time_output: BTreeMap<String, Vec<u8>>,
    pub periodic_output: BTreeMap<String, PeriodicInstructionOutput>,
    pub reports: Vec<InstructionReport>,
    /// The last instruction run (one-time, succeeded) asked for the agent to restart (R23); the
    /// pass stopped after it.
    pub restart_requested: bool,
}

impl ApplyResult {
    /// What the plan-state rules need to know of this run.
    pub fn ran(&self) -> crate::flow::Ran {
        crate::flow::Ran {
            one_time_succeeded: self.one_time_succeeded,
            completed: self.completed,
            interruption: self.interruption,
            termination_incomplete: self.termination_incomplete,
            one_time_output: self.one_time_output.clone(),
            periodic_output: self.periodic_output.clone(),
            restart: self.restart_requested,
        }
    }

    pub fn failed_reports(&self) -> impl Iterator<Item = &InstructionReport> {
        self.reports.iter().filter(|r| !r.outcome.success())
    }

    /// What made this run fail: its first one-time instruction that failed (not one canceled or
    /// stopped), with its outcome and last output lines masked with the instruction's env, for the
    /// plan (or run) the source knows as `checksum`.
    pub fn failure(&self, plan: &ValidPlan, checksum: &str) -> Option<crate::plan::Failure> {
        let r = self.reports.iter().find(|r| !r.periodic && result_word(&r.outcome) == "FAILED")?;
        let env = plan.plan.instructions.get(r.index).map_or(&[][..], |i| &i.common.env[..]);
        Some(crate::plan::Failure::instruction(
            checksum,
            r.index,
            r.total,
            &r.name,
            r.outcome.to_string(),
            &r.output.combined,
            env,
        ))
    }

    /// When a stopped tree may have survivors: which instruction, and its outcome.
    pub fn incomplete_reason(&self) -> Option<String> {
        if !self.termination_incomplete {
            return None;
        }
        Some(
            self.reports
                .iter()
                .find(|r| r.outcome.termination_incomplete())
                .map(|r| format!("{}: {}", instruction_label(r.index, r.total, &r.name, r.periodic), r.outcome))
                .unwrap_or_else(|| "termination incomplete".into()),
        )
    }
}

/// Feed a new observation of the pause/cancel values into a running plan's interrupts: a cancel
/// stays requested for the rest of the run, a pause follows the latest value. Logs each change,
/// naming `plan`. Returns whether anything changed.
pub fn update_interrupt(tx: &watch::Sender<Interrupt>, next: Interrupt, plan: &str) -> bool {
    let changed = tx.send_if_modified(|i| {
        let before = *i;
        i.cancel |= next.cancel;
        i.pause = next.pause;
        *i != before
    });
    if changed {
        let i = *tx.borrow();
        let what = if i.cancel {
            "cancel requested: stopping the running instruction"
        } else if i.pause {
            "pause requested: stopping at the next instruction boundary"
        } else {
            "pause withdrawn: continuing"
        };
        tracing::info!("{plan}: {what}");
    }
    changed
}

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("files: {0}")]
    Files(#[source] FileError),
    #[error("interlock: {0}")]
    Interlock(#[source] InterlockError),
    #[error("work directory: {0}")]
    WorkDir(#[source] WorkDirError),
    /// The work directory holds what nodeplan did not put there (or cannot be listed to tell):
    /// nothing was touched.
    #[error("work directory: {0}")]
    ForeignWorkDir(#[source] WorkDirError),
    /// The work directory's lock could not be taken (not: it is held; then the apply waits).
    #[error("work directory lock: {0}")]
    Lock(#[source] crate::process::LockError),
}

/// What went wrong with the work directory or an execution directory in it.
#[derive(Debug, thiserror::Error)]
pub enum WorkDirError {
    /// The disk lane's task preparing the apply failed (it panicked).
    #[error("preparing the apply: {0}")]
    Prepare(#[source] std::io::Error),
    #[error("reading {}: {source}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Entries nodeplan did not create (sorted names).
    #[error("{}", foreign_entries(.dir, .entries))]
    Foreign { dir: PathBuf, entries: Vec<String> },
    #[error("wiping {}: {source}", .path.display())]
    Wipe {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A parent of the work directory could not be made.
    #[error("creating {}: {source}", .path.display())]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The work directory could not be made or made private to the agent.
    #[error("{}: {source}", .path.display())]
    Private {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn foreign_entries(dir: &Path, entries: &[String]) -> String {
    let more = if entries.len() > 3 { format!(" and {} more", entries.len() - 3) } else { String::new() };
    format!(
        "{} holds entries nodeplan did not create ({}{more}); refusing to use it as the work directory \
         (give an empty directory or one only nodeplan uses)",
        dir.display(),
        entries.iter().take(3).map(|n| crate::plan::shown_value(n)).collect::<Vec<_>>().join(", ")
    )
}

/// Executes plans, one at a time.
pub struct Applyinator {
    config: ApplyConfig,
    sup: Supervisor,
    clock: Arc<dyn Clock>,
    lock: tokio::sync::Mutex<()>,
}

/// The work directory's lock ([`Applyinator::work_dir_lock`]).
enum WorkLock {
    /// Held until dropped, and let go on the disk lane after the apply's own disk work (`None`: a
    /// work directory without a parent has no lock).
    Held(Option<crate::disk::Later<OwnerLock>>),
    /// A pause, cancel or shutdown came while another process held it.
    Interrupted,
}

impl Applyinator {
    pub fn new(config: ApplyConfig, sup: Supervisor) -> Applyinator {
        Applyinator::with_clock(config, sup, Arc::new(SystemClock))
    }

    pub fn with_clock(config: ApplyConfig, sup: Supervisor, clock: Arc<dyn Clock>) -> Applyinator {
        Applyinator { config, sup, clock, lock: tokio::sync::Mutex::new(()) }
    }

    pub fn supervisor(&self) -> &Supervisor {
        &self.sup
    }

    /// Apply one plan. Interruptions are not errors: they are reported in the result.
    pub async fn apply(&self, input: ApplyInput<'_>) -> Result<ApplyResult, ApplyError> {
        use tracing::Instrument as _;
        // `remote:<checksum>` and `apply:<checksum>` show as the mode; a local plan by its path.
        let source = match (input.owner.source(), input.owner.id()) {
            (Some(Source::Local), Some(path)) => path.to_string(),
            (Some(mode), _) => mode.to_string(),
            (None, _) => input.owner.to_string(),
        };
        // The span's fields are the plan's id (`plan::id`, as everywhere a person reads it) and where it came from; `--log-format json` shows them as `span.plan`.
        let span = tracing::info_span!("plan", id = %input.plan.id(), source = %source);
        self.apply_inner(input).instrument(span).await
    }

    async fn apply_inner(&self, input: ApplyInput<'_>) -> Result<ApplyResult, ApplyError> {
        let total = input.plan.plan.instructions.len();
        let resume_from = input.resume_from.min(total);
        let mut result = ApplyResult {
            completed: resume_from,
            total,
            one_time_output: input.one_time_output.clone(),
            periodic_output: input.periodic_output.clone(),
            ..Default::default()
        };
        if let Some(i) = input.interrupt().boundary() {
            result.interruption = Some(i);
            return Ok(result);
        }
        if !self.has_work(&input) {
            return Ok(result);
        }
        let _guard = self.lock.lock().await;
        let WorkLock::Held(_work_lock) = self.work_dir_lock(&input).await? else {
            result.interruption = input.interrupt().boundary();
            return Ok(result);
        };
        if let Some(i) = input.interrupt().boundary() {
            result.interruption = Some(i);
            return Ok(result);
        }
        let exec_dir = self.execution_dir();
        let Some(_interlock) = self.prepare(&input).await? else {
            result.interruption = input.interrupt().boundary();
            return Ok(result);
        };

        if input.run_one_time {
            if let Some(i) = self.one_time_pass(&input, &exec_dir, resume_from, &mut result).await {
                result.interruption = Some(i);
                return Ok(result);
            }
            result.one_time_succeeded = result.completed == total;
            if result.restart_requested {
                // The periodic instructions run after the restart.
                return Ok(result);
            }
        }

        // After a genuine one-time failure nothing may turn the result into an interruption: the
        // failure is what gets recorded (R5). A pause or cancel then only ends the periodic pass.
        let one_time_failed = input.run_one_time && !result.one_time_succeeded;
        if input.run_periodic
            && let ControlFlow::Break(interruption) = self.periodic_pass(&input, &exec_dir, &mut result).await
        {
            if !one_time_failed {
                result.interruption = interruption;
            }
            return Ok(result);
        }
        // A pause or cancel that arrived during the periodic pass is reported, unless the one-time
        // pass genuinely failed (the failure is what gets recorded).
        if !one_time_failed {
            result.interruption = input.interrupt().boundary().and_then(|i| completed_pass_kept(i, &input, &result));
        }
        // Disk stays bounded: a successful apply's execution directory (staged image filesystems
        // included) goes at once; a failed one is kept to look at until the next apply.
        let succeeded = result.interruption.is_none() && result.reports.iter().all(|r| r.outcome.success());
        // On the disk lane, not waited for (R31): the next apply's work comes after it there.
        if succeeded && !one_time_failed && !self.config.preserve_work_dir {
            crate::disk::queue(move || {
                if std::fs::symlink_metadata(&exec_dir).is_ok()
                    && let Err(e) = crate::safefs::remove(&exec_dir, true)
                {
                    tracing::warn!("cannot remove the execution directory {}: {e}", exec_dir.display());
                }
            });
        }
        Ok(result)
    }

    /// The work directory's lock, held by every process applying in that work directory (the
    /// agent, `nodeplan apply`, another agent), so two of them never wipe each other's execution
    /// directories nor run their plans at once. A POSIX record lock: the kernel drops it when its
    /// holder dies, so a crashed holder never leaves it stale. While another process holds it the
    /// apply waits, saying once who holds it, and stops waiting for a pause, cancel or shutdown
    /// ([`WorkLock::Interrupted`]).
    async fn work_dir_lock(&self, input: &ApplyInput<'_>) -> Result<WorkLock, ApplyError> {
        let work = &self.config.work_dir;
        let (Some(dir), Some(name)) = (work.parent().filter(|p| !p.as_os_str().is_empty()), work.file_name()) else {
            return Ok(WorkLock::Held(None));
        };
        let name = format!(".{}.lock", name.to_string_lossy());
        let note = input.owner.short();
        let mut interrupts = input.interrupts.clone();
        let (mut said, mut alive) = (false, true);
        loop {
            let (d, n, o) = (dir.to_path_buf(), name.clone(), note.clone());
            let take = crate::disk::run(move || Ok(crate::process::owner_lock::lock_file(&d, &n, &o)));
            let Some(taken) = unless_interrupted(input, "the work directory's lock", take).await else {
                return Ok(WorkLock::Interrupted);
            };
            match taken.map_err(|e| ApplyError::WorkDir(WorkDirError::Prepare(e)))? {
                // A lock taken after its taker stopped waiting is let go in its turn.
                Ok(l) => return Ok(WorkLock::Held(Some(crate::disk::Later::new(l)))),
                Err(crate::process::LockError::Held { pid, path }) => {
                    if !said {
                        let who =
                            crate::process::owner_lock::note_of(&path).unwrap_or_else(|| "another process".into());
                        let pid = pid.map_or(String::new(), |p| format!(" (pid {p})"));
                        tracing::info!("waiting for the work directory's lock {}, held by {who}{pid}", path.display());
                        said = true;
                    }
                }
                Err(e) => return Err(ApplyError::Lock(e)),
            }
            if input.interrupt().boundary().is_some() {
                return Ok(WorkLock::Interrupted);
            }
            // Polled: the kernel offers no wake-up for a record lock released in another process.
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                r = interrupts.changed(), if alive => alive = r.is_ok(),
            }
        }
    }

    /// Whether the pass has anything to do: one-time instructions or files to apply, or a due
    /// periodic instruction. One with nothing touches nothing (no interlock, archive or
    /// work-directory wipe).
    fn has_work(&self, input: &ApplyInput<'_>) -> bool {
        let any_due = input.run_periodic
            && self
                .periodic_due_in(&input.plan.plan, &input.periodic_output)
                .is_some_and(|d| input.run_one_time || d.is_zero());
        input.run_one_time || input.reconcile_files || any_due
    }

    /// How long until the first of `plan`'s periodic instructions is due, by their saved outputs
    /// (zero: one is due now); `None` when it has none that can run (none, or none with a name).
    /// A pass of periodic instructions alone does nothing before then.
    pub fn periodic_due_in(
        &self,
        plan: &crate::plan::Plan,
        outputs: &BTreeMap<String, PeriodicInstructionOutput>,
    ) -> Option<Duration> {
        let now = self.clock.now();
        plan.periodic_instructions
            .iter()
            .filter(|p| !p.common.name.is_empty())
            .map(|p| periodic::due_in(outputs.get(&p.common.name), p.period(), now))
            .min()
    }

    /// Everything before the first instruction ([`Prepare`]). The interlock, the archive (both
    /// synced to disk), the files and the wipe of the work directory (possibly large, e.g.
    /// extracted images) all go to the disk lane: the runtime keeps delivering interrupts and
    /// probes meanwhile. The interlock is held until the returned value is dropped. `None`: a
    /// pause, cancel or shutdown came while the disk did not answer; the preparation is abandoned
    /// at its next step (R31: no file of the plan is written after that).
    async fn prepare(
        &self,
        input: &ApplyInput<'_>,
    ) -> Result<Option<Option<crate::disk::Later<archive::Interlock>>>, ApplyError> {
        let abandoned = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let prep = Prepare {
            interlock_dir: self.config.interlock_dir.clone(),
            applied_plan_dir: self.config.applied_plan_dir.clone(),
            plan: input.plan.plan.clone(),
            checksum: input.plan.checksum.clone(),
            now: self.clock.now(),
            files: if input.reconcile_files { input.plan.files.clone() } else { Vec::new() },
            work_dir: self.config.work_dir.clone(),
            wipe: !self.config.preserve_work_dir,
            abandoned: abandoned.clone(),
        };
        let job = crate::disk::run(move || Ok(prep.run()));
        let Some(done) = unless_interrupted(input, "preparing the plan", job).await else {
            abandoned.store(true, std::sync::atomic::Ordering::SeqCst);
            return Ok(None);
        };
        let interlock = done.map_err(|e| ApplyError::WorkDir(WorkDirError::Prepare(e)))??;
        Ok(Some(interlock.map(crate::disk::Later::new)))
    }

    /// The one-time instructions from `resume_from`, in order, until the first failure. Each
    /// report goes into `result` (and its saved output, and `completed` past each success).
    /// Returns the interruption that stopped the pass, if one did.
    async fn one_time_pass(
        &self,
        input: &ApplyInput<'_>,
        exec_dir: &Path,
        resume_from: usize,
        result: &mut ApplyResult,
    ) -> Option<Interruption> {
        let instructions = &input.plan.plan.instructions;
        let total = instructions.len();
        let dir_of = |index: usize| exec_dir.join(format!("{}_{index}", input.plan.checksum));
        let mut next_dir = NextDir::default();
        let mut stopped_by = None;
        for (index, ins) in instructions.iter().enumerate().skip(resume_from) {
            if let Some(i) = input.interrupt().boundary() {
                stopped_by = Some(i);
                break;
            }
            let dir = dir_of(index);
            // Made while the previous instruction ran, or now; then the next one's, on the lane.
            let made = next_dir.take(&dir).unwrap_or_else(|| make_exec_dir(&dir));
            if index + 1 < total {
                next_dir.prepare(dir_of(index + 1));
            }
            let report = self.run_one(input, &dir, made, index, total, &ins.common, input.attempt, false).await;
            result.termination_incomplete |= report.outcome.termination_incomplete();
            save_output(&mut result.one_time_output, ins, &report);
            let outcome = report.outcome.clone();
            input.observer.instruction_finished(&report);
            crate::metrics::instruction_finished(report.periodic, instruction_metric(&report.outcome), report.elapsed);
            result.reports.push(report);
            if outcome.success() {
                result.completed = index + 1;
                if self.config.restart_requests && restart_requested(&dir).await {
                    tracing::info!(
                        "{} asked for the agent to restart: stopping after it",
                        instruction_label(index, total, &ins.common.name, false)
                    );
                    result.restart_requested = true;
                    break;
                }
                continue;
            }
            // R9: a failure while a cancel is in effect is the cancel, not a failure. A pending
            // pause never masks a failure (R5).
            let stopped = outcome.stop_reason().and_then(|r| interruption_of_stop(r, input.interrupt()));
            if let Some(i) = stopped
                .or_else(|| input.interrupt().stop_reason().and_then(|r| interruption_of_stop(r, input.interrupt())))
            {
                if !matches!(outcome, Outcome::NotStarted(_)) && i == Interruption::Canceled {
                    warn_partial(&instruction_label(index, total, &ins.common.name, false));
                }
                stopped_by = Some(i);
                break;
            }
            // The failure itself is reported once, by the observer, with its outcome.
            break;
        }
        next_dir.discard();
        stopped_by
    }

    /// The due periodic instructions, in order, until the first failure; each run is recorded in
    /// `result` (its report and its periodic output). `Break` when a pause, cancel or stop ended
    /// the pass, with the interruption to report (see [`completed_pass_kept`]).
    async fn periodic_pass(
        &self,
        input: &ApplyInput<'_>,
        exec_dir: &Path,
        result: &mut ApplyResult,
    ) -> ControlFlow<Option<Interruption>> {
        let periodic = &input.plan.plan.periodic_instructions;
        let forced = input.run_one_time;
        for (index, p) in periodic.iter().enumerate() {
            if p.common.name.is_empty() {
                tracing::warn!("periodicInstructions[{index}] has no name; skipped");
                continue;
            }
            let prev = result.periodic_output.get(&p.common.name).cloned();
            if !periodic::is_due(prev.as_ref(), p.period(), self.clock.now(), forced) {
                continue;
            }
            if let Some(i) = input.interrupt().boundary() {
                return ControlFlow::Break(completed_pass_kept(i, input, result));
            }
            let attempt = prev.as_ref().map_or(0, |o| o.failures) + 1;
            let dir = exec_dir.join(format!("{}_p{index}", input.plan.checksum));
            let made = make_exec_dir(&dir);
            let report = self.run_one(input, &dir, made, index, periodic.len(), &p.common, attempt, true).await;
            input.observer.instruction_finished(&report);
            crate::metrics::instruction_finished(report.periodic, instruction_metric(&report.outcome), report.elapsed);
            result.termination_incomplete |= report.outcome.termination_incomplete();
            let outcome = report.outcome.clone();
            let stopped = outcome.stop_reason().and_then(|r| interruption_of_stop(r, input.interrupt()));
            if let Some(i) = stopped {
                if !matches!(outcome, Outcome::NotStarted(_)) && i == Interruption::Canceled {
                    warn_partial(&instruction_label(index, periodic.len(), &p.common.name, true));
                }
                result.reports.push(report);
                return ControlFlow::Break(Some(i));
            }
            let out = periodic::record_run(
                prev.as_ref(),
                &p.common.name,
                report.output.stdout.clone(),
                p.save_stderr_output.then(|| report.output.stderr.clone()),
                outcome.exit_code() as i64,
                self.clock.now(),
            );
            result.periodic_output.insert(p.common.name.clone(), out);
            result.reports.push(report);
            if !outcome.success() {
                break;
            }
        }
        ControlFlow::Continue(())
    }

    fn execution_dir(&self) -> PathBuf {
        let stamp = chrono::Local::now().format("%Y%m%d-%H%M%S").to_string();
        let mut dir = self.config.work_dir.join(&stamp);
        let mut n = 1;
        while dir.exists() && self.config.preserve_work_dir {
            dir = self.config.work_dir.join(format!("{stamp}-{n}"));
            n += 1;
        }
        dir
    }

    #[allow(clippy::too_many_arguments)]
    /// Run one instruction in `dir`, which `made` makes ([`make_exec_dir`]).
    async fn run_one(
        &self,
        input: &ApplyInput<'_>,
        dir: &Path,
        made: crate::disk::Pending<()>,
        index: usize,
        total: usize,
        ins: &crate::plan::CommonInstruction,
        attempt: i64,
        periodic: bool,
    ) -> InstructionReport {
        input.observer.instruction_started(index, total, &ins.name, periodic);
        let started = Instant::now();
        // Output lines are logged inside the instruction's span (plan id, i/n, name): the prefix
        // only says which stream.
        let prefix = display_name(&ins.name).to_string();
        let mask = crate::plan::failure::Mask::of_env(&ins.env);
        let report = |outcome: Outcome, output: Output| InstructionReport {
            index,
            total,
            name: ins.name.clone(),
            periodic,
            outcome,
            elapsed: started.elapsed(),
            output,
            mask: mask.clone(),
        };
        let mut stop = StopSignal::from_watch(input.interrupts.clone(), |i: &Interrupt| i.stop_reason());
        // R31: a cancel or shutdown while the disk does not answer ends the wait for the
        // directory (nothing started).
        let made = tokio::select! {
            biased;
            r = made => r.map_err(|e| Outcome::StartFailed(format!("creating {}: {e}", dir.display()))),
            r = stop.wait() => Err(Outcome::NotStarted(r)),
        };
        if let Err(o) = made {
            return report(o, Output::default());
        }
        let timeout = (ins.timeout_seconds > 0).then(|| Duration::from_secs(ins.timeout_seconds as u64));
        // What the process may still use of `timeoutSeconds` (all of it, unless an image was staged).
        let mut remaining = timeout;
        if !ins.image.is_empty() {
            // The image's filesystem goes into the execution directory (its run.sh is the default
            // command). A cancel or shutdown meanwhile abandons the pull: nothing starts (R7).
            // Staging counts toward the instruction's timeout: a registry or tarball that is slow
            // (or endless) fails the instruction as timed out, and the process gets what is left.
            let stager = crate::image::Stager::new(self.config.images.clone());
            let staging = Instant::now();
            let expired = async {
                match timeout {
                    Some(t) => tokio::time::sleep(t).await,
                    None => std::future::pending().await,
                }
            };
            let staged = tokio::select! {
                biased;
                r = stop.wait() => Err(Outcome::NotStarted(r)),
                () = expired => Err(Outcome::NotStarted(StopReason::Timeout(timeout.unwrap_or_default()))),
                r = stager.stage(&ins.image, dir) => r.map_err(|e| Outcome::StartFailed(e.to_string())),
            };
            match staged {
                Ok(from) => tracing::info!("[{prefix}] staged image {} {from}", ins.image),
                Err(o) => {
                    if o.timed_out() {
                        tracing::error!("[{prefix}] staging image {} used up the instruction's timeout", ins.image);
                    }
                    return report(o, Output::default());
                }
            }
            remaining = timeout.map(|t| t.saturating_sub(staging.elapsed()));
            if remaining.is_some_and(|r| r.is_zero()) {
                let o = Outcome::NotStarted(StopReason::Timeout(timeout.unwrap_or_default()));
                return report(o, Output::default());
            }
        }
        let program: OsString =
            if ins.command.is_empty() { dir.join("run.sh").into_os_string() } else { OsString::from(&ins.command) };
        let mut env = instruction_env(&self.config.base_env, &ins.env, dir, attempt);
        env.retain(|(k, _)| k != RESTART_REQUEST_ENV);
        if self.config.restart_requests && !periodic {
            env.push((RESTART_REQUEST_ENV.into(), dir.join(RESTART_REQUEST_FILE).into_os_string()));
        }
        let spec = SpawnSpec {
            program,
            args: ins.args.iter().map(OsString::from).collect(),
            env,
            cwd: Some(dir.to_path_buf()),
            owner: input.owner.with_slot(Slot::new(index, periodic)),
            timeout: remaining,
            sink: Arc::new(LogSink { prefix, level: self.config.output_level, mask: mask.clone() }),
        };
        let (i, name) = (index + 1, display_name(&ins.name));
        let span = if periodic {
            tracing::info_span!("periodic", i, n = total, name = %name)
        } else {
            tracing::info_span!("instruction", i, n = total, name = %name)
        };
        let run = tracing::Instrument::instrument(self.sup.run(spec, &mut stop), span).await;
        // A timeout is reported as the instruction's own, not what was left after staging.
        let outcome = match timeout {
            Some(t) if remaining != timeout => full_timeout(run.outcome, t),
            _ => run.outcome,
        };
        let mut r = report(outcome, run.output);
        r.elapsed = run.elapsed;
        r
    }
}

/// Disk work the apply cannot go on without, waited for unless a pause, cancel or shutdown comes
/// first (`None`: the work still runs in its turn on the disk lane, R31). A wait longer than
/// [`crate::disk::PATIENCE`] is said once.
async fn unless_interrupted<T: Send + 'static>(
    input: &ApplyInput<'_>,
    what: &str,
    work: crate::disk::Pending<T>,
) -> Option<std::io::Result<T>> {
    let mut interrupts = input.interrupts.clone();
    let mut alive = true;
    let patience = tokio::time::sleep(crate::disk::PATIENCE);
    tokio::pin!(work, patience);
    let mut said = false;
    loop {
        tokio::select! {
            biased;
            r = &mut work => return Some(r),
            r = interrupts.changed(), if alive => {
                alive = r.is_ok();
                if input.interrupt().boundary().is_some() {
                    return None;
                }
            }
            () = &mut patience, if !said => {
                said = true;
                tracing::warn!(
                    "{what}: the disk has not answered for {}; waiting for it (a pause, cancel or shutdown ends the wait)",
                    crate::duration::human(crate::disk::PATIENCE)
                );
            }
        }
    }
}

/// Whether the instruction that ran in `dir` (its own execution directory, made by the agent)
/// left a restart request; the request is consumed. Anything at the name counts (it is removed,
/// never followed).
async fn restart_requested(dir: &Path) -> bool {
    let path = dir.join(RESTART_REQUEST_FILE);
    crate::disk::run(move || {
        let found = std::fs::symlink_metadata(&path).is_ok();
        if found && let Err(e) = std::fs::remove_file(&path) {
            tracing::warn!("cannot remove the restart request {}: {e}", path.display());
        }
        Ok(found)
    })
    .await
    .unwrap_or(false)
}

/// A pause that arrives once every one-time instruction has succeeded interrupts nothing of the
/// one-time pass: it is recorded as succeeded (nothing was left to run), and the pause then only
/// holds the plan's periodic instructions. Any other interruption stands.
fn completed_pass_kept(i: Interruption, input: &ApplyInput<'_>, result: &ApplyResult) -> Option<Interruption> {
    let completed_pass = input.run_one_time && result.one_time_succeeded;
    if i == Interruption::Paused && completed_pass { None } else { Some(i) }
}

/// `o` with a timeout reason of `full` (the instruction's `timeoutSeconds`).
fn full_timeout(o: Outcome, full: Duration) -> Outcome {
    let t = |r: StopReason| if matches!(r, StopReason::Timeout(_)) { StopReason::Timeout(full) } else { r };
    match o {
        Outcome::NotStarted(r) => Outcome::NotStarted(t(r)),
        Outcome::ExitedAfterStop { reason, status } => Outcome::ExitedAfterStop { reason: t(reason), status },
        Outcome::Killed { reason, grace } => Outcome::Killed { reason: t(reason), grace },
        Outcome::GaveUp { reason, grace, survivors } => Outcome::GaveUp { reason: t(reason), grace, survivors },
        Outcome::Incomplete { reason, survivors } => Outcome::Incomplete { reason: t(reason), survivors },
        Outcome::SignalFailed { reason, error } => Outcome::SignalFailed { reason: t(reason), error },
        other => other,
    }
}

/// An execution directory (and the per-apply directory above it), private to the agent: mode 0700,
/// owned by its effective user. The work directory above them is already private
/// ([`private_dir`] in [`Prepare`]), so no other user can reach, plant or rewrite anything in
/// them; one that exists already (a preserved work directory) is checked and fixed the same way.
#[cfg(unix)]
fn make_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => make_private(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(parent) = dir.parent() {
                make_dir(parent)?;
            }
            match std::fs::DirBuilder::new().mode(0o700).create(dir) {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => make_private(dir),
                r => r,
            }
        }
        Err(e) => Err(e),
    }
}

/// On Windows the directory is made and not yet made private: its ACL is what its parent passes
/// on (docs/windows.md).
#[cfg(windows)]
fn make_dir(dir: &Path) -> std::io::Result<()> {
    crate::safefs::make_dir(dir, 0o700, None)
}

/// The work directory: its parents as usual, the directory itself as [`make_dir`] makes
/// execution directories.
fn private_dir(dir: &Path) -> Result<(), WorkDirError> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .map_err(|source| WorkDirError::Create { path: parent.to_path_buf(), source })?;
    }
    make_dir(dir).map_err(|source| WorkDirError::Private { path: dir.to_path_buf(), source })
}

/// Make an existing directory private to the agent (owner: its effective uid and gid, mode 0700).
///
/// Policy: a directory with another owner or a wider mode is *fixed*, with a warning, rather than
/// refused: the usual cause is a work directory an earlier version (or system-agent) made 0755,
/// and refusing would stop every plan on an upgraded node. Fixing is safe because it happens
/// through a descriptor opened with O_NOFOLLOW before anything is put in the directory: once the
/// mode is 0700 and the owner is the agent, no other user can create, open or rename anything
/// in it. A symlink or a non-directory at the path is refused (one error line).
#[cfg(unix)]
fn make_private(dir: &Path) -> std::io::Result<()> {
    use rustix::fs::{Mode, OFlags};
    let fd =
        rustix::fs::open(dir, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| match e {
            rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => std::io::Error::other(
                "not a directory (a symlink or a file is never used as a work or execution directory)",
            ),
            e => e.into(),
        })?;
    let st = rustix::fs::fstat(&fd)?;
    let (uid, gid) = (rustix::process::geteuid(), rustix::process::getegid());
    let mode = st.st_mode & 0o7777;
    if st.st_uid == uid.as_raw() && st.st_gid == gid.as_raw() && mode == 0o700 {
        return Ok(());
    }
    // Mode first: the other user loses access at once, before the owner changes.
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o700))?;
    rustix::fs::fchown(&fd, Some(uid), Some(gid))?;
    tracing::warn!(
        "{} was owned by uid {} gid {} with mode {mode:04o}; made private to the agent (uid {}, gid {}, mode 0700)",
        dir.display(),
        st.st_uid,
        st.st_gid,
        uid.as_raw(),
        gid.as_raw()
    );
    Ok(())
}

/// An instruction's execution directory, made on the disk lane (R31).
fn make_exec_dir(dir: &Path) -> crate::disk::Pending<()> {
    let target = dir.to_path_buf();
    crate::disk::run(move || make_dir(&target))
}

/// The next one-time instruction's execution directory, made on the disk lane while the current
/// instruction runs: on a busy filesystem a mkdir can cost as much as a short instruction (ext4
/// without a journal walks its recently freed inodes on every allocation), and waiting for the
/// lane when its turn comes would cost two thread hand-offs. Its result is that instruction's.
#[derive(Default)]
struct NextDir(Option<(PathBuf, crate::disk::Pending<()>)>);

impl NextDir {
    fn prepare(&mut self, dir: PathBuf) {
        self.discard();
        self.0 = Some((dir.clone(), make_exec_dir(&dir)));
    }

    /// The directory prepared for `dir`, if it was; one prepared for another goes.
    fn take(&mut self, dir: &Path) -> Option<crate::disk::Pending<()>> {
        match self.0.take() {
            Some((prepared, made)) if prepared == dir => Some(made),
            other => {
                self.0 = other;
                self.discard();
                None
            }
        }
    }

    /// Remove a directory prepared for an instruction that did not run (empty, so nothing is
    /// lost), in its turn on the disk lane.
    fn discard(&mut self) {
        if let Some((prepared, _)) = self.0.take() {
            crate::disk::queue(move || {
                let _ = std::fs::remove_dir(&prepared);
            });
        }
    }
}

fn save_output(map: &mut BTreeMap<String, Vec<u8>>, ins: &OneTimeInstruction, report: &InstructionReport) {
    if !ins.save_output || matches!(report.outcome, Outcome::NotStarted(_)) {
        return;
    }
    if ins.common.name.is_empty() {
        tracing::error!(
            "{} has saveOutput but no name; output not saved",
            instruction_label(report.index, report.total, "", false)
        );
        return;
    }
    map.insert(ins.common.name.clone(), report.output.combined.clone());
}

/// R11: every cancel that interrupts a running instruction warns that the node may be partly changed.
fn warn_partial(instruction: &str) {
    tracing::warn!("plan canceled while {instruction} was running; the node may be left partly changed");
}

/// The agent's environment, then the instruction's `env`, then `CATTLE_AGENT_EXECUTION_PWD`,
/// `CATTLE_AGENT_ATTEMPT_NUMBER` and `PATH` extended with the execution directory. Later entries win.
pub fn instruction_env(
    base: &[(OsString, OsString)],
    env: &[String],
    dir: &Path,
    attempt: i64,
) -> Vec<(OsString, OsString)> {
    fn set(out: &mut Vec<(OsString, OsString)>, k: OsString, v: OsString) {
        out.retain(|(ek, _)| *ek != k);
        out.push((k, v));
    }
    let mut out: Vec<(OsString, OsString)> = base.to_vec();
    for e in env {
        if let Some((k, v)) = e.split_once('=') {
            set(&mut out, k.into(), v.into());
        }
    }
    set(&mut out, "CATTLE_AGENT_EXECUTION_PWD".into(), dir.as_os_str().to_owned());
    set(&mut out, "CATTLE_AGENT_ATTEMPT_NUMBER".into(), attempt.to_string().into());
    let path = out.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.clone()).unwrap_or_default();
    let mut new_path = path;
    if !new_path.is_empty() {
        new_path.push(":");
    }
    new_path.push(dir.as_os_str());
    set(&mut out, "PATH".into(), new_path);
    out
}

/// What happens before the first instruction, in this order, off the runtime.
struct Prepare {
    interlock_dir: Option<PathBuf>,
    applied_plan_dir: Option<PathBuf>,
    plan: crate::plan::Plan,
    checksum: String,
    now: chrono::DateTime<chrono::Utc>,
    files: Vec<crate::plan::FileOp>,
    work_dir: PathBuf,
    /// Wipe `work_dir` first.
    wipe: bool,
    /// Set when the apply stopped waiting (a pause, cancel or shutdown while the disk did not
    /// answer): nothing more is done.
    abandoned: Arc<std::sync::atomic::AtomicBool>,
}

impl Prepare {
    /// Whether its apply stopped waiting for it (R31): it then stops at its next step, and what it
    /// returns is read by nobody.
    fn abandoned(&self) -> bool {
        self.abandoned.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn run(self) -> Result<Option<archive::Interlock>, ApplyError> {
        // Before anything is touched: a work directory nodeplan does not own stops the apply.
        let earlier = check_work_dir(&self.work_dir).map_err(ApplyError::ForeignWorkDir)?;
        if self.abandoned() {
            return Ok(None);
        }
        let interlock = match &self.interlock_dir {
            Some(d) => Some(archive::Interlock::enter(d, self.now).map_err(ApplyError::Interlock)?),
            None => None,
        };
        if self.abandoned() {
            return Ok(None);
        }
        if let Some(dir) = &self.applied_plan_dir {
            archive::archive_plan(dir, &self.plan, &self.checksum, self.now);
        }
        for file in &self.files {
            if self.abandoned() {
                return Ok(None);
            }
            files::apply_file(file).map_err(ApplyError::Files)?;
        }
        if self.wipe {
            for dir in earlier {
                if self.abandoned() {
                    return Ok(None);
                }
                crate::safefs::remove(&dir, true)
                    .map_err(|source| ApplyError::WorkDir(WorkDirError::Wipe { path: dir.clone(), source }))?;
            }
        }
        // Execution directories hold what instructions run (image files included): nobody but
        // the agent may reach them.
        private_dir(&self.work_dir).map_err(ApplyError::WorkDir)?;
        Ok(interlock)
    }
}

/// Whether `name` is one of nodeplan's (or system-agent's) per-apply directories in the work
/// directory: `YYYYMMDD-HHMMSS`, optionally `-N`.
fn is_apply_dir_name(name: &str) -> bool {
    let b = name.as_bytes();
    let digits = |r: std::ops::Range<usize>| b.get(r).is_some_and(|d| d.iter().all(u8::is_ascii_digit));
    b.len() >= 15
        && digits(0..8)
        && b[8] == b'-'
        && digits(9..15)
        && (b.len() == 15 || (b.len() > 16 && b[15] == b'-' && digits(16..b.len())))
}

/// The work directory must hold only per-apply directories: anything else means it was pointed
/// at a directory nodeplan does not own (a home, `/tmp`), which it must neither wipe nor make
/// private to root. Entries are looked at without following links. Returns the per-apply
/// directories of earlier applies: what a wipe removes, and nothing else.
fn check_work_dir(dir: &Path) -> Result<Vec<PathBuf>, WorkDirError> {
    let read = |source| WorkDirError::Read { path: dir.to_path_buf(), source };
    let entries = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(read(e)),
    };
    let (mut foreign, mut earlier) = (Vec::new(), Vec::new());
    for e in entries {
        let e = e.map_err(read)?;
        let name = e.file_name().to_string_lossy().into_owned();
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && is_apply_dir_name(&name) {
            earlier.push(e.path());
        } else {
            foreign.push(name);
        }
    }
    if foreign.is_empty() {
        return Ok(earlier);
    }
    foreign.sort();
    Err(WorkDirError::Foreign { dir: dir.to_path_buf(), entries: foreign })
}

#[cfg(all(test, unix))]
mod tests;
