//! `nodeplan supervise`: run one long-lived command, respawn it with exponential backoff, stop it
//! through the ladder on request, and refuse to start a second copy of a previous instance that
//! could not be stopped.

pub use crate::backoff::Backoff;

use super::{LockError, Outcome, RecoveryResult, RunResult, SpawnSpec, StopSignal, Supervisor};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    #[error("already running as nodeplan {}; not starting a second instance", .pid.map_or("(pid unknown)".to_string(), |p| format!("pid {p}")))]
    AlreadyRunning { pid: Option<i32> },
    #[error("a previous instance (pid {pid}) could not be stopped: {outcome}; not starting a second copy")]
    PreviousInstance { pid: i32, outcome: Outcome },
    #[error("could not be stopped: {0}")]
    NotStopped(Outcome),
    /// A PID record (or the PID directory) of the owner was refused.
    #[error("{0}; not starting it")]
    Refused(String),
    /// The owner's lock cannot be taken (other than being held).
    #[error("{0}; not starting it")]
    Lock(#[source] LockError),
    /// The first start failed: the command or its set-up is wrong (no such program, not
    /// executable, an unusable PID directory), which retrying cannot mend.
    #[error("cannot start: {0}; not retrying (a first start that fails cannot succeed by retrying)")]
    CannotStart(String),
}

/// Observations of the respawn loop, for logs and tests.
pub trait SuperviseObserver: Send {
    fn started(&mut self, _attempt: u64) {}
    fn exited(&mut self, _result: &RunResult, _delay: Duration) {}
}

impl SuperviseObserver for () {}

/// Supervise `spec` until `stop` fires. While another live instance with the same owner runs
/// (it holds the owner's lock, or a record of the owner names it), nothing is started or stopped:
/// [`SuperviseError::AlreadyRunning`]. Otherwise the PID records of a previous instance with the
/// same owner are verified and stopped first. Returns the final outcome of the stop.
pub async fn supervise(
    sup: &Supervisor,
    spec: SpawnSpec,
    mut stop: StopSignal,
    mut backoff: Backoff,
    observer: &mut dyn SuperviseObserver,
) -> Result<Outcome, SuperviseError> {
    let owner = spec.owner.clone();
    // Held until this function returns; the kernel drops it if the process dies.
    let _lock = match sup.lock_owner(&owner) {
        Ok(l) => l,
        Err(LockError::Held { pid, .. }) => return Err(SuperviseError::AlreadyRunning { pid }),
        Err(e) => return Err(SuperviseError::Lock(e)),
    };
    for r in sup.recover(|rec| rec.owner == owner).await {
        match r.result {
            RecoveryResult::OwnerAlive(pid) => return Err(SuperviseError::AlreadyRunning { pid: Some(pid) }),
            RecoveryResult::NotStopped(outcome) => {
                let pid = r.record.map(|r| r.pid).unwrap_or(0);
                return Err(SuperviseError::PreviousInstance { pid, outcome });
            }
            RecoveryResult::Refused(why) => return Err(SuperviseError::Refused(why)),
            _ => {}
        }
    }
    let mut attempt = 0u64;
    loop {
        attempt += 1;
        observer.started(attempt);
        let result = sup.run(spec.clone(), &mut stop).await;
        // Only the first start: once the command has run, a failed start may be passing (its
        // binary being replaced by an upgrade) and is retried with the backoff.
        if let (1, Outcome::StartFailed(why)) = (attempt, &result.outcome) {
            return Err(SuperviseError::CannotStart(why.clone()));
        }
        if let Some(_reason) = result.outcome.stop_reason() {
            if result.outcome.termination_incomplete() {
                return Err(SuperviseError::NotStopped(result.outcome));
            }
            return Ok(result.outcome);
        }
        let delay = backoff.after_run(result.elapsed);
        tracing::warn!(
            "{} ({}) exited after {}: {}; restarting in {}",
            spec.owner,
            spec.program.to_string_lossy(),
            crate::duration::human(result.elapsed),
            result.outcome,
            crate::duration::human(delay)
        );
        observer.exited(&result, delay);
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            r = stop.wait() => return Ok(Outcome::NotStarted(r)),
        }
    }
}
