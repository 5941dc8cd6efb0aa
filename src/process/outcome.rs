//! The typed outcome of a supervised run, printed the way people read it.

use crate::duration::human;
use std::fmt;
use std::time::Duration;

/// Why a stop was requested.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// An operator canceled the work (R7).
    Cancel,
    /// The agent is shutting down.
    Shutdown,
    /// The run exceeded its timeout.
    Timeout(Duration),
}

/// Settings of the stop ladder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopPolicy {
    /// How long the tree gets after the graceful step (SIGTERM; CTRL_BREAK on Windows).
    pub grace: Duration,
    /// How long the tree gets after the kill (SIGKILL; `TerminateJobObject` on Windows).
    pub kill_timeout: Duration,
    /// false = k0s's policy: give up after the grace period and leave the processes.
    pub kill: bool,
}

impl Default for StopPolicy {
    fn default() -> Self {
        StopPolicy { grace: Duration::from_secs(10), kill_timeout: Duration::from_secs(5), kill: true }
    }
}

/// How a process ended by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitKind {
    Code(i32),
    Signal(i32),
    /// The process was not our child (found again after a crash), so its status is unknowable.
    Unknown,
}

impl ExitKind {
    #[cfg(unix)]
    pub fn from_status(s: std::process::ExitStatus) -> ExitKind {
        use std::os::unix::process::ExitStatusExt;
        match (s.code(), s.signal()) {
            (Some(c), _) => ExitKind::Code(c),
            (None, Some(sig)) => ExitKind::Signal(sig),
            (None, None) => ExitKind::Code(-1),
        }
    }

    /// On Windows every exit has a code (a process ended by `TerminateProcess` or its job has
    /// the code it was given).
    #[cfg(windows)]
    pub fn from_status(s: std::process::ExitStatus) -> ExitKind {
        ExitKind::Code(s.code().unwrap_or(-1))
    }
}

impl fmt::Display for ExitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitKind::Code(c) => write!(f, "exit status {c}"),
            ExitKind::Signal(s) => write!(f, "signal: {}", signal_name(*s)),
            ExitKind::Unknown => f.write_str("status unknown (not a child of this agent)"),
        }
    }
}

/// Go-style signal descriptions (`signal: terminated`, `signal: killed`).
#[cfg(unix)]
pub fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGHUP => "hangup".into(),
        libc::SIGINT => "interrupt".into(),
        libc::SIGQUIT => "quit".into(),
        libc::SIGILL => "illegal instruction".into(),
        libc::SIGABRT => "aborted".into(),
        libc::SIGBUS => "bus error".into(),
        libc::SIGFPE => "floating point exception".into(),
        libc::SIGKILL => "killed".into(),
        libc::SIGSEGV => "segmentation fault".into(),
        libc::SIGPIPE => "broken pipe".into(),
        libc::SIGALRM => "alarm clock".into(),
        libc::SIGTERM => "terminated".into(),
        libc::SIGUSR1 => "user defined signal 1".into(),
        libc::SIGUSR2 => "user defined signal 2".into(),
        other => format!("signal {other}"),
    }
}

/// Windows has no signals; an [`ExitKind::Signal`] is never made there.
#[cfg(windows)]
pub fn signal_name(sig: i32) -> String {
    format!("signal {sig}")
}

/// Which rung of the stop ladder ended a stopped run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rung {
    /// The tree emptied within the grace period after SIGTERM.
    Term,
    /// SIGKILL was needed.
    Kill,
    /// The policy forbids SIGKILL and the tree outlived the grace period.
    GaveUp,
}

/// What happened to one supervised run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The process ended by itself; no stop was requested.
    Exited(ExitKind),
    /// A stop was already requested before the process could start; it was never spawned.
    NotStarted(StopReason),
    /// The process could not be started.
    StartFailed(String),
    /// A stop was requested and the whole tree was gone within the grace period.
    ExitedAfterStop { reason: StopReason, status: ExitKind },
    /// The tree outlived the grace period and SIGKILL ended it.
    Killed { reason: StopReason, grace: Duration },
    /// The no-kill policy gave up after the grace period; processes are left running.
    GaveUp { reason: StopReason, grace: Duration, survivors: usize },
    /// Processes survived SIGKILL and the kill timeout.
    Incomplete { reason: StopReason, survivors: usize },
    /// Signalling the tree failed.
    SignalFailed { reason: StopReason, error: String },
    /// Waiting for the process failed.
    WaitFailed(String),
}

impl Outcome {
    /// Only a process that exited by itself with status 0 succeeded.
    pub fn success(&self) -> bool {
        matches!(self, Outcome::Exited(ExitKind::Code(0)))
    }

    /// The exit code, or -1 when there is none (signals, start failures, stops).
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::Exited(ExitKind::Code(c)) | Outcome::ExitedAfterStop { status: ExitKind::Code(c), .. } => *c,
            _ => -1,
        }
    }

    /// Whether a stop was requested, and why.
    pub fn stop_reason(&self) -> Option<StopReason> {
        match self {
            Outcome::NotStarted(r) => Some(*r),
            Outcome::ExitedAfterStop { reason, .. }
            | Outcome::Killed { reason, .. }
            | Outcome::GaveUp { reason, .. }
            | Outcome::Incomplete { reason, .. }
            | Outcome::SignalFailed { reason, .. } => Some(*reason),
            _ => None,
        }
    }

    /// Which rung ended a stopped run (`None` when no ladder ran to completion).
    pub fn rung(&self) -> Option<Rung> {
        match self {
            Outcome::ExitedAfterStop { .. } => Some(Rung::Term),
            Outcome::Killed { .. } | Outcome::Incomplete { .. } => Some(Rung::Kill),
            Outcome::GaveUp { .. } => Some(Rung::GaveUp),
            _ => None,
        }
    }

    /// Processes may still be running: the PID record is kept and `terminationIncomplete` set.
    pub fn termination_incomplete(&self) -> bool {
        matches!(
            self,
            Outcome::GaveUp { .. } | Outcome::Incomplete { .. } | Outcome::SignalFailed { .. } | Outcome::WaitFailed(_)
        )
    }

    pub fn timed_out(&self) -> bool {
        matches!(self.stop_reason(), Some(StopReason::Timeout(_)))
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(StopReason::Timeout(d)) = self.stop_reason() {
            write!(f, "timed out after {}: ", human(d))?;
        }
        match self {
            Outcome::Exited(k) => write!(f, "{k}"),
            Outcome::NotStarted(StopReason::Cancel) => f.write_str("not started: canceled"),
            Outcome::NotStarted(StopReason::Shutdown) => f.write_str("not started: agent shutting down"),
            Outcome::NotStarted(StopReason::Timeout(_)) => f.write_str("not started"),
            Outcome::StartFailed(e) => write!(f, "failed to start: {e}"),
            Outcome::ExitedAfterStop { status, .. } => {
                write!(f, "exited after stop request: {status}")
            }
            Outcome::Killed { grace, .. } => {
                write!(f, "killed after {} grace", human(*grace))
            }
            Outcome::GaveUp { grace, survivors, .. } => write!(
                f,
                "termination incomplete: {survivors} {} still running after {} grace (not killed by policy)",
                processes(*survivors),
                human(*grace)
            ),
            Outcome::Incomplete { survivors, .. } => {
                write!(f, "termination incomplete: {survivors} {} survived {KILL}", processes(*survivors))
            }
            Outcome::SignalFailed { error, .. } => write!(f, "failed to signal: {error}"),
            Outcome::WaitFailed(e) => write!(f, "failed to wait: {e}"),
        }
    }
}

impl Outcome {
    /// The outcome of a process that exited by itself, from its wait.
    pub fn of_exit(status: std::io::Result<std::process::ExitStatus>) -> Outcome {
        match status {
            Ok(s) => Outcome::Exited(ExitKind::from_status(s)),
            Err(e) => Outcome::WaitFailed(e.to_string()),
        }
    }

    /// What the stop ladder's metric says of this outcome; `None` for outcomes the ladder does not
    /// produce.
    pub fn ladder_metric(&self) -> Option<crate::metrics::Ladder> {
        use crate::metrics::Ladder;
        match self {
            Outcome::ExitedAfterStop { .. } => Some(Ladder::ExitedOnTerm),
            Outcome::Killed { .. } => Some(Ladder::Killed),
            Outcome::GaveUp { survivors, .. } | Outcome::Incomplete { survivors, .. } => {
                Some(Ladder::Survivors(*survivors))
            }
            Outcome::SignalFailed { .. } | Outcome::WaitFailed(_) => Some(Ladder::Error),
            Outcome::Exited(_) | Outcome::NotStarted(_) | Outcome::StartFailed(_) => None,
        }
    }
}

/// The stop ladder's last rung, as the outcome names it.
const KILL: &str = if cfg!(windows) { "TerminateJobObject" } else { "SIGKILL" };

fn processes(n: usize) -> &'static str {
    if n == 1 { "process" } else { "processes" }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use crate::metrics::Ladder;

    #[test]
    fn ladder_outcomes_and_their_metric() {
        let r = StopReason::Cancel;
        let g = Duration::from_secs(1);
        let table = [
            (Outcome::ExitedAfterStop { reason: r, status: ExitKind::Signal(15) }, Some(Ladder::ExitedOnTerm)),
            (Outcome::Killed { reason: r, grace: g }, Some(Ladder::Killed)),
            (Outcome::GaveUp { reason: r, grace: g, survivors: 2 }, Some(Ladder::Survivors(2))),
            (Outcome::Incomplete { reason: r, survivors: 1 }, Some(Ladder::Survivors(1))),
            (Outcome::SignalFailed { reason: r, error: "EPERM".into() }, Some(Ladder::Error)),
            (Outcome::WaitFailed("x".into()), Some(Ladder::Error)),
            (Outcome::Exited(ExitKind::Code(0)), None),
            (Outcome::NotStarted(r), None),
            (Outcome::StartFailed("no such file".into()), None),
        ];
        for (o, want) in table {
            assert_eq!(o.ladder_metric(), want, "{o:?}");
        }
    }

    #[test]
    fn displays_like_people_read_them() {
        let c = StopReason::Cancel;
        let ten = Duration::from_secs(10);
        let cases = [
            (Outcome::Exited(ExitKind::Code(1)), "exit status 1"),
            (Outcome::Exited(ExitKind::Signal(libc::SIGTERM)), "signal: terminated"),
            (
                Outcome::ExitedAfterStop { reason: c, status: ExitKind::Code(0) },
                "exited after stop request: exit status 0",
            ),
            (Outcome::Killed { reason: c, grace: ten }, "killed after 10s grace"),
            (Outcome::Incomplete { reason: c, survivors: 2 }, "termination incomplete: 2 processes survived SIGKILL"),
            (Outcome::SignalFailed { reason: c, error: "EPERM".into() }, "failed to signal: EPERM"),
            (Outcome::WaitFailed("ECHILD".into()), "failed to wait: ECHILD"),
            (Outcome::StartFailed("No such file".into()), "failed to start: No such file"),
            (
                Outcome::Killed { reason: StopReason::Timeout(Duration::from_millis(1500)), grace: ten },
                "timed out after 1.5s: killed after 10s grace",
            ),
        ];
        for (o, want) in cases {
            assert_eq!(o.to_string(), want);
        }
    }

    #[test]
    fn classification() {
        let c = StopReason::Cancel;
        assert!(Outcome::Exited(ExitKind::Code(0)).success());
        assert!(!Outcome::ExitedAfterStop { reason: c, status: ExitKind::Code(0) }.success());
        assert_eq!(Outcome::Killed { reason: c, grace: Duration::ZERO }.rung(), Some(Rung::Kill));
        assert_eq!(Outcome::GaveUp { reason: c, grace: Duration::ZERO, survivors: 1 }.rung(), Some(Rung::GaveUp));
        assert!(Outcome::Incomplete { reason: c, survivors: 1 }.termination_incomplete());
        assert!(!Outcome::Killed { reason: c, grace: Duration::ZERO }.termination_incomplete());
        assert_eq!(Outcome::Exited(ExitKind::Code(3)).exit_code(), 3);
        assert_eq!(Outcome::Exited(ExitKind::Signal(9)).exit_code(), -1);
        assert_eq!(Outcome::Exited(ExitKind::Code(1)).stop_reason(), None);
    }
}
