//! The process layer: the only place in nodeplan that spawns, waits for or signals a process.
//!
//! It owns spawning (argv, env, cwd, stdin from /dev/null, its own process group, its own cgroup
//! leaf when a hierarchy is usable: cgroup v2, born in it with clone3 or joining it before exec,
//! else a cgroup v1 freezer leaf joined before exec; see [`cgroup`]), concurrent capture of stdout
//! and stderr, the stop ladder (SIGTERM+SIGCONT to the tree, grace, SIGKILL: `cgroup.kill` on v2,
//! freeze, kill and thaw on v1; kill timeout), typed outcomes, PID records, the owner locks of
//! `apply` and `supervise`, crash recovery, and the respawn loop of `nodeplan supervise`. It knows
//! nothing about plans beyond whose a process is (an [`Owner`]: source, plan id, instruction slot,
//! kept in its PID record so that recovery can tell callers whose leftover it found): callers hand
//! it a [`SpawnSpec`] and a [`StopSignal`] and get a [`RunResult`] back. Nothing here ever waits on
//! pipe EOF alone, so an escaped grandchild that holds a pipe cannot hang a run.
//!
//! One interface, two backends: this file holds what callers see on every target (the spec, the
//! stop signal, results and recovery results), [`ladder`] the stop ladder over any tree, and the
//! [`Supervisor`] is `linux.rs` (cgroups, process groups, `/proc`) or `windows.rs` (a Job Object
//! per run, over `job.rs`), with the same methods.

mod capture;
mod ladder;
mod outcome;
mod owner;

#[cfg(unix)]
pub mod cgroup;
#[cfg(unix)]
mod linux;
pub mod owner_lock;
#[cfg(unix)]
mod procfs;
mod record;
#[cfg(unix)]
mod spawn;
#[cfg(unix)]
pub mod supervise;
#[cfg(unix)]
mod tree;

#[cfg(windows)]
mod job;
#[cfg(windows)]
mod windows;

pub use capture::{Capture, LineSink, LogSink, NullSink, Output, Stream};
pub use outcome::{ExitKind, Outcome, Rung, StopPolicy, StopReason, signal_name};
pub use owner::{Owner, Slot, Source};

#[cfg(unix)]
pub use linux::{Supervisor, start_time_of};
pub use owner_lock::{LockError, OwnerLock};
#[cfg(unix)]
pub(crate) use procfs::{boot_id, own_identity, running};
pub use record::PidRecord;
#[cfg(unix)]
pub use record::RecordFile;

#[cfg(windows)]
pub use job::{INTERRUPT_MODE, Identity, Job, Run, TERMINATED, interrupt_console, set_interrupter, spawn, spawn_in};
#[cfg(windows)]
pub use windows::{Supervisor, start_time_of};
#[cfg(windows)]
pub(crate) use windows::{boot_id, own_identity, running};

use std::ffi::OsString;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The environment variable that marks every process of a run (its value: the run's marker).
pub const MARKER_ENV: &str = "NODEPLAN_RUN";

/// Where runs' cgroups go (Linux; on Windows the job is the tree and this is not used).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CgroupMode {
    /// `<cgroup2 mount><own cgroup>/nodeplan`, discovered from /proc/self/{mountinfo,cgroup}; where
    /// cgroup v2 is unusable, as [`CgroupMode::V1`].
    #[default]
    Auto,
    /// `<v1 freezer mount><own freezer cgroup>/nodeplan`, discovered the same way.
    V1,
    /// This directory, which must be inside a cgroup2 mount or a v1 freezer hierarchy.
    Root(PathBuf),
    /// Process groups only.
    Off,
}

#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    pub policy: StopPolicy,
    /// Bytes kept per stream (and for the interleaved capture), head and tail.
    pub capture_limit: usize,
    pub cgroup: CgroupMode,
    /// Where PID records go; `None` = no records.
    pub pid_dir: Option<PathBuf>,
    /// After the process exits by itself, how long to keep reading pipes that a leftover process
    /// still holds open.
    pub drain_timeout: Duration,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        SupervisorConfig {
            policy: StopPolicy::default(),
            capture_limit: 64 * 1024,
            cgroup: CgroupMode::Auto,
            pid_dir: None,
            drain_timeout: Duration::from_secs(1),
        }
    }
}

/// What to run.
#[derive(Clone)]
pub struct SpawnSpec {
    pub program: OsString,
    pub args: Vec<OsString>,
    /// The complete environment of the process (nothing is inherited implicitly).
    pub env: Vec<(OsString, OsString)>,
    pub cwd: Option<PathBuf>,
    /// What the process belongs to; stored in its PID record.
    pub owner: Owner,
    /// Run the stop ladder after this long.
    pub timeout: Option<Duration>,
    pub sink: Arc<dyn LineSink>,
}

impl SpawnSpec {
    /// `program args…` with the agent's own environment and no sink.
    pub fn new(program: impl Into<OsString>, args: impl IntoIterator<Item = impl Into<OsString>>) -> SpawnSpec {
        SpawnSpec {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            env: std::env::vars_os().collect(),
            cwd: None,
            owner: Owner::default(),
            timeout: None,
            sink: Arc::new(NullSink),
        }
    }
}

/// The result of one run.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub outcome: Outcome,
    pub output: Output,
    pub pid: Option<i32>,
    pub marker: String,
    pub elapsed: Duration,
}

/// A run's clock and marker, from which its [`RunResult`] is made (both backends).
struct RunClock {
    started: std::time::Instant,
    marker: String,
}

impl RunClock {
    fn start(marker: String) -> RunClock {
        RunClock { started: std::time::Instant::now(), marker }
    }

    fn finish(&self, outcome: Outcome, output: Output, pid: Option<i32>) -> RunResult {
        RunResult { outcome, output, pid, marker: self.marker.clone(), elapsed: self.started.elapsed() }
    }

    /// The result of a run whose stop came before its spawn (R7), if it did.
    fn stopped_before(&self, stop: &StopSignal) -> Option<RunResult> {
        stop.requested().map(|r| self.finish(Outcome::NotStarted(r), Output::default(), None))
    }
}

type Changed<'a> = Pin<Box<dyn Future<Output = bool> + Send + 'a>>;

trait StopSource: Send + Sync {
    fn requested(&self) -> Option<StopReason>;
    /// Resolves when the value may have changed; false when it never will again.
    fn changed(&mut self) -> Changed<'_>;
    fn boxed_clone(&self) -> Box<dyn StopSource>;
}

struct Mapped<T> {
    rx: watch::Receiver<T>,
    f: fn(&T) -> Option<StopReason>,
}

impl<T: Send + Sync + 'static> StopSource for Mapped<T> {
    fn requested(&self) -> Option<StopReason> {
        (self.f)(&self.rx.borrow())
    }
    fn changed(&mut self) -> Changed<'_> {
        Box::pin(async move { self.rx.changed().await.is_ok() })
    }
    fn boxed_clone(&self) -> Box<dyn StopSource> {
        Box::new(Mapped { rx: self.rx.clone(), f: self.f })
    }
}

/// How a run learns that it must stop: a view of some `watch` channel. A stop that is already
/// requested prevents the spawn.
pub struct StopSignal {
    src: Box<dyn StopSource>,
}

impl Clone for StopSignal {
    fn clone(&self) -> Self {
        StopSignal { src: self.src.boxed_clone() }
    }
}

impl StopSignal {
    /// A signal and the sender that triggers it.
    pub fn channel() -> (watch::Sender<Option<StopReason>>, StopSignal) {
        let (tx, rx) = watch::channel(None);
        (tx, StopSignal::from_watch(rx, |v| *v))
    }

    /// Never requests a stop (timeouts still apply).
    pub fn never() -> StopSignal {
        let (tx, s) = StopSignal::channel();
        // Keep the sender alive forever so `changed` never reports "closed" in a busy loop.
        std::mem::forget(tx);
        s
    }

    /// A view of any watch channel through a projection.
    pub fn from_watch<T: Send + Sync + 'static>(rx: watch::Receiver<T>, f: fn(&T) -> Option<StopReason>) -> StopSignal {
        StopSignal { src: Box::new(Mapped { rx, f }) }
    }

    pub fn requested(&self) -> Option<StopReason> {
        self.src.requested()
    }

    /// Resolves with the reason once a stop is requested; never resolves otherwise.
    pub async fn wait(&mut self) -> StopReason {
        loop {
            if let Some(r) = self.src.requested() {
                return r;
            }
            if !self.src.changed().await {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// One PID record found by [`Supervisor::recover`] (none on Windows yet: docs/windows.md).
#[derive(Debug)]
pub struct Recovered {
    pub path: PathBuf,
    pub record: Option<PidRecord>,
    pub result: RecoveryResult,
}

impl Recovered {
    /// Why what this record belongs to must not run now (a leftover that could not be stopped, or
    /// a record that was refused); `None` when recovery is done with it.
    pub fn hold_reason(&self) -> Option<String> {
        match &self.result {
            RecoveryResult::NotStopped(o) => Some(format!(
                "a leftover process ({}) could not be stopped: {o}",
                self.record.as_ref().map(PidRecord::describe).unwrap_or_default()
            )),
            RecoveryResult::Refused(why) => Some(why.clone()),
            RecoveryResult::OwnerAlive(pid) => Some(format!(
                "{} belongs to nodeplan pid {pid}, which is still running",
                self.record.as_ref().map(PidRecord::describe).unwrap_or_default()
            )),
            _ => None,
        }
    }
}

#[derive(Debug)]
pub enum RecoveryResult {
    /// The record could not be parsed; it was renamed to `*.invalid` and nothing was signalled.
    Invalid(String),
    /// Nothing of the run is left.
    Gone,
    /// The pid is someone else's now; it was not signalled.
    Mismatch(String),
    /// Leftovers were found and stopped through the ladder.
    Stopped(Outcome),
    /// Leftovers could not be stopped; the record is kept.
    NotStopped(Outcome),
    /// The record (or the whole PID directory) cannot be trusted: a symbolic link, not a regular
    /// file, the wrong owner or mode, or a cgroup that is not this agent's leaf for its marker.
    /// Nothing was signalled or removed; the record is kept and what it belongs to must be held.
    Refused(String),
    /// The run belongs to another nodeplan process (this pid) that is still running: not a
    /// leftover. Nothing was signalled; the record is kept and what it belongs to must be held.
    OwnerAlive(i32),
}

impl RecoveryResult {
    /// What the recovery metric says of this result.
    pub fn metric(&self) -> crate::metrics::Recovery {
        use crate::metrics::Recovery;
        match self {
            RecoveryResult::Invalid(_) => Recovery::Invalid,
            RecoveryResult::Gone => Recovery::Gone,
            RecoveryResult::Mismatch(_) => Recovery::Mismatch,
            RecoveryResult::Stopped(_) => Recovery::Stopped,
            RecoveryResult::NotStopped(_) => Recovery::NotStopped,
            RecoveryResult::Refused(_) => Recovery::Refused,
            RecoveryResult::OwnerAlive(_) => Recovery::OwnerAlive,
        }
    }
}

#[cfg(unix)]
fn remove_record(path: Option<&std::path::Path>) {
    if let Some(p) = path
        && let Err(e) = std::fs::remove_file(p)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!("cannot remove PID record {}: {e}", p.display());
    }
}

/// Read what the output pipes still hold for at most `limit`: a process left running may hold
/// them open.
async fn drain(readers: &mut Vec<tokio::task::JoinHandle<()>>, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    for r in readers.iter_mut() {
        if tokio::time::timeout_at(deadline, &mut *r).await.is_err() {
            tracing::warn!("an output pipe is still held open by a leftover process; stopped reading it");
            r.abort();
        }
    }
    readers.clear();
}

async fn sleep_until_opt(d: Option<tokio::time::Instant>) {
    match d {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod recovery_metric_tests {
    use super::*;
    use crate::metrics::Recovery;

    #[test]
    fn recovery_results_and_their_metric() {
        let o = || Outcome::Killed { reason: StopReason::Shutdown, grace: Duration::from_secs(1) };
        let table = [
            (RecoveryResult::Invalid("x".into()), Recovery::Invalid),
            (RecoveryResult::Gone, Recovery::Gone),
            (RecoveryResult::Mismatch("x".into()), Recovery::Mismatch),
            (RecoveryResult::Stopped(o()), Recovery::Stopped),
            (RecoveryResult::NotStopped(o()), Recovery::NotStopped),
            (RecoveryResult::Refused("x".into()), Recovery::Refused),
            (RecoveryResult::OwnerAlive(1), Recovery::OwnerAlive),
        ];
        for (r, want) in table {
            assert_eq!(r.metric(), want, "{r:?}");
        }
    }
}
