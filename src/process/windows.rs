//! The Windows backend of the process layer: the [`Supervisor`] over runs in Job Objects
//! ([`super::job`]), with the Linux backend's methods, outcomes and output capture.
//!
//! A run's tree is its job, so there is nothing to find by marker or group. A process that exits
//! by itself and leaves processes in its job started them on purpose (a daemon): as on Linux they
//! are left alone, so its job stops killing them when its handle closes. Not yet: PID records on
//! disk and the owner locks (`docs/windows.md`); a dead agent's runs end with it
//! (`KILL_ON_JOB_CLOSE`), so there is no leftover for a recovery to find, except a run that could
//! not join a job.

use super::capture::{self, Captures};
use super::job::{self, Identity, Run};
use super::owner_lock::{self, LockError, OwnerLock};
use super::{
    LineSink, MARKER_ENV, Outcome, Output, Owner, PidRecord, Recovered, RunClock, RunResult, SpawnSpec, StopReason,
    StopSignal, Stream, SupervisorConfig, drain, sleep_until_opt,
};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Spawns, supervises and stops processes. Cheap to clone.
#[derive(Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

struct Inner {
    config: SupervisorConfig,
    seq: AtomicU64,
}

impl Supervisor {
    pub fn new(config: SupervisorConfig) -> Supervisor {
        Supervisor { inner: Arc::new(Inner { config, seq: AtomicU64::new(0) }) }
    }

    pub fn config(&self) -> &SupervisorConfig {
        &self.inner.config
    }

    /// Take `owner`'s lock in the PID directory (see [`super::owner_lock`]) before running anything
    /// of it. `None` without a PID directory.
    pub fn lock_owner(&self, owner: &Owner) -> Result<Option<OwnerLock>, LockError> {
        match &self.inner.config.pid_dir {
            Some(dir) => owner_lock::lock(dir, owner).map(Some),
            None => Ok(None),
        }
    }

    /// What an earlier agent left running, to stop before anything of it runs again: nothing on
    /// Windows, which keeps no PID records yet. A dead agent's jobs ended every process in them
    /// (`KILL_ON_JOB_CLOSE`); only a run that could not join a job can outlive it, and that one is
    /// not found again (docs/windows.md).
    pub async fn recover(&self, filter: impl Fn(&PidRecord) -> bool) -> Vec<Recovered> {
        let _ = filter;
        Vec::new()
    }

    /// Runs have no cgroups on Windows.
    pub fn cgroup_root(&self) -> Option<&Path> {
        None
    }

    /// The agent's pid and creation time, then a sequence number: unique across agents and runs.
    fn new_marker(&self) -> String {
        let n = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        let me = std::process::id();
        let created = Identity::of(me).map_or(0, |i| i.created);
        format!("np{me}.{created:x}-{n}")
    }

    /// Run `spec` to completion: until it exits by itself, or until `stop` or its timeout runs the
    /// stop ladder on its job. Never hangs: every wait is bounded once a stop is requested.
    pub async fn run(&self, spec: SpawnSpec, stop: &mut StopSignal) -> RunResult {
        let clock = RunClock::start(self.new_marker());
        if let Some(r) = clock.stopped_before(stop) {
            return r;
        }
        let (marker, finish) = (&clock.marker, |o, out, pid| clock.finish(o, out, pid));
        let mut run = match job::spawn(&mut command(&spec, marker)) {
            Ok(r) => r,
            Err(e) => {
                let what = format!("{}: {e}", spec.program.to_string_lossy());
                return finish(Outcome::StartFailed(what), Output::default(), None);
            }
        };
        if let Some(why) = run.job_error() {
            tracing::warn!(
                "{} runs outside a Job Object ({why}): a stop ends it alone, not what it starts",
                spec.program.to_string_lossy()
            );
        }
        let pid = run.pid() as i32;
        let deadline = spec.timeout.map(|t| tokio::time::Instant::now() + t);
        let captures = Captures::new(self.inner.config.capture_limit);
        let mut readers = read_output(&mut run, &captures, &spec.sink);
        let reason = tokio::select! {
            biased;
            status = run.wait() => {
                let outcome = Outcome::of_exit(status);
                drain(&mut readers, self.inner.config.drain_timeout).await;
                leave_daemons(&spec, &mut run, &outcome);
                return finish(outcome, captures.take(), Some(pid));
            }
            r = stop.wait() => r,
            _ = sleep_until_opt(deadline) => StopReason::Timeout(spec.timeout.unwrap_or_default()),
        };
        let outcome = run
            .stop(reason, &self.inner.config.policy, || {
                for r in &readers {
                    r.abort();
                }
            })
            .await;
        drain(&mut readers, Duration::from_millis(100)).await;
        finish(outcome, captures.take(), Some(pid))
    }
}

/// This process's identity as the Lease keeps it: no pid namespace (0), the pid, and its creation
/// time (100 ns units since 1601).
pub(crate) fn own_identity() -> std::io::Result<(u64, i32, u64)> {
    let me = std::process::id();
    let id = Identity::of(me).ok_or_else(|| std::io::Error::other("cannot read this process's creation time"))?;
    Ok((0, me as i32, id.created))
}

/// When the process `pid` was created (100 ns units since 1601), if it runs: with its pid, what
/// tells it from a later process given the same pid.
pub fn start_time_of(pid: i32) -> Option<u64> {
    Identity::of(u32::try_from(pid).ok()?).map(|i| i.created)
}

/// Whether the process `pid` created at `created` still runs.
pub(crate) fn running(pid: i32, created: u64) -> bool {
    u32::try_from(pid).is_ok_and(|pid| Identity { pid, created }.alive())
}

/// No boot id on Windows: a process's identity is its creation time since 1601, which no process
/// of another boot shares, so identities need no boot beside them.
pub(crate) fn boot_id() -> std::io::Result<String> {
    Ok(String::new())
}

/// The command for `spec`: its own environment plus the run marker, stdin from NUL, piped output.
fn command(spec: &SpawnSpec, marker: &str) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(&spec.program);
    cmd.args(&spec.args)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .env(MARKER_ENV, marker)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    if let Some(cwd) = &spec.cwd {
        cmd.current_dir(cwd);
    }
    cmd
}

/// Read the run's stdout and stderr, each on a task of its own, into `captures` and `sink`.
fn read_output(run: &mut Run, captures: &Arc<Captures>, sink: &Arc<dyn LineSink>) -> Vec<tokio::task::JoinHandle<()>> {
    let child = run.child_mut();
    let pipes: [(Stream, Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>>); 2] = [
        (Stream::Stdout, child.stdout.take().map(|p| Box::new(p) as _)),
        (Stream::Stderr, child.stderr.take().map(|p| Box::new(p) as _)),
    ];
    pipes
        .into_iter()
        .filter_map(|(stream, pipe)| {
            let read = capture::read_lines(pipe?, stream, captures.clone(), sink.clone());
            Some(tokio::spawn(tracing::Instrument::in_current_span(read)))
        })
        .collect()
}

/// The run exited by itself (`outcome`); what it left running in its job started on purpose, and
/// its job releases it rather than end it.
fn leave_daemons(spec: &SpawnSpec, run: &mut Run, outcome: &Outcome) {
    let Some(job) = run.job() else { return };
    match job.active_processes() {
        Ok(0) => {}
        Ok(n) => {
            tracing::warn!(
                "{} exited ({outcome}) and left {n} process(es) running; they are left alone",
                spec.program.to_string_lossy()
            );
            if let Err(e) = job.release() {
                tracing::warn!(
                    "cannot release the job of {}: {e}; its processes end with it",
                    spec.program.to_string_lossy()
                );
            }
        }
        Err(e) => tracing::warn!("cannot count what {} left running: {e}", spec.program.to_string_lossy()),
    }
}
