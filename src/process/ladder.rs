//! The stop ladder, over any process tree behind [`TreeOps`] and any leader behind [`Leader`]:
//! the graceful step, the grace period, the kill, the kill timeout, each look at the tree bounded
//! in time. Both backends run it (a cgroup or process group on Linux, a Job Object on Windows), and
//! its rungs are tested over trees scripted to misbehave.

use super::{ExitKind, Outcome, StopPolicy, StopReason};
use std::time::Duration;

/// How often the ladder looks at the tree while waiting for it to empty.
pub(crate) const POLL: Duration = Duration::from_millis(5);

/// What the stop ladder needs from a process tree (a seam, so the ladder's rungs can be tested
/// with trees that misbehave in ways real processes cannot be made to on demand).
pub(crate) trait TreeOps: Clone + Send + Sync + 'static {
    /// The graceful step (SIGTERM then SIGCONT to every member; Ctrl-C on Windows). `Ok(false)`
    /// when no graceful step could be delivered but the tree can still be killed: the ladder then
    /// skips the grace period.
    fn request_stop(&self) -> std::io::Result<bool>;
    /// Kill every member.
    fn kill(&self) -> std::io::Result<()>;
    fn is_empty(&self) -> bool;
    fn survivors(&self) -> usize;
    /// The leader has been reaped: its pid (the group id) may be recycled from now on.
    fn leader_reaped(&self) {}
}

/// The run's own process, which the ladder reaps and kills alongside its tree.
pub(crate) trait Leader: Send {
    /// Wait for the process to end and reap it (cancel-safe).
    fn wait(&mut self) -> impl Future<Output = std::io::Result<std::process::ExitStatus>> + Send;
    fn start_kill(&mut self) -> std::io::Result<()>;
}

impl Leader for tokio::process::Child {
    async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        tokio::process::Child::wait(self).await
    }
    fn start_kill(&mut self) -> std::io::Result<()> {
        tokio::process::Child::start_kill(self)
    }
}

/// No leader (recovery stops trees whose leader is not ours to reap).
#[cfg_attr(windows, allow(dead_code))]
pub(crate) enum NoLeader {}

impl Leader for NoLeader {
    async fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        match *self {}
    }
    fn start_kill(&mut self) -> std::io::Result<()> {
        match *self {}
    }
}

/// Run work that may block (/proc, cgroups, the system's process calls) off the async threads.
pub(crate) async fn blocking<T: Send + 'static, R: Send + 'static>(v: T, f: impl FnOnce(T) -> R + Send + 'static) -> R {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let handle = tokio::task::spawn_blocking(move || {
        let _ = tx.send(f(v));
    });
    drop(handle);
    match rx.await {
        Ok(r) => r,
        // Only if the blocking pool is shutting down; there is nothing sensible left to do.
        Err(_) => std::future::pending().await,
    }
}

/// How long one look at the tree may take: a /proc read can block on a process stuck in the
/// kernel, and the ladder must never hang on it. On Windows the graceful step starts a copy of the
/// agent that is given 5 s (`job::INTERRUPT_TIMEOUT`).
const TREE_OP_LIMIT: Duration = Duration::from_secs(if cfg!(windows) { 6 } else { 2 });

pub(crate) fn stuck() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, "the process tree did not answer (a /proc read is stuck)")
}

/// [`blocking`], bounded by [`TREE_OP_LIMIT`]; `fallback` when it takes longer.
pub(crate) async fn bounded<T: Send + 'static, R: Send + 'static>(
    v: T,
    fallback: R,
    f: impl FnOnce(T) -> R + Send + 'static,
) -> R {
    tokio::time::timeout(TREE_OP_LIMIT, blocking(v, f)).await.unwrap_or(fallback)
}

/// Wait until the leader (if any) has been reaped and the tree is empty, or until `deadline`.
/// Returns the leader's status if it was reaped, and whether everything is gone.
async fn wait_gone<T: TreeOps, C: Leader>(
    tree: &T,
    leader: &mut Option<&mut C>,
    status: &mut Option<ExitKind>,
    wait_err: &mut Option<String>,
    deadline: tokio::time::Instant,
) -> bool {
    loop {
        if status.is_none() && wait_err.is_none() {
            if let Some(child) = leader.as_deref_mut() {
                tokio::select! {
                    r = child.wait() => {
                        match r {
                            Ok(s) => *status = Some(ExitKind::from_status(s)),
                            Err(e) => *wait_err = Some(e.to_string()),
                        }
                        tree.leader_reaped();
                    }
                    _ = tokio::time::sleep(POLL) => {}
                }
            } else {
                tokio::time::sleep(POLL).await;
            }
        } else {
            tokio::time::sleep(POLL).await;
        }
        let leader_done = leader.is_none() || status.is_some() || wait_err.is_some();
        if leader_done && bounded(tree.clone(), false, |t| t.is_empty()).await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
    }
}

/// The stop ladder: SIGTERM+SIGCONT to the tree, wait up to the grace period for it to empty,
/// then (unless the policy forbids it) SIGKILL the tree, close the pipes (`close_pipes`) and wait
/// up to the kill timeout. Every run of it is counted in the stop-ladder metric.
pub(crate) async fn ladder<T: TreeOps, C: Leader>(
    tree: &T,
    leader: Option<&mut C>,
    policy: &StopPolicy,
    reason: StopReason,
    close_pipes: impl FnOnce(),
) -> Outcome {
    let outcome = rungs(tree, leader, policy, reason, close_pipes).await;
    if let Some(m) = outcome.ladder_metric() {
        crate::metrics::stop_ladder(m);
    }
    outcome
}

async fn rungs<T: TreeOps, C: Leader>(
    tree: &T,
    mut leader: Option<&mut C>,
    policy: &StopPolicy,
    reason: StopReason,
    close_pipes: impl FnOnce(),
) -> Outcome {
    let mut status = None;
    let mut wait_err = None;
    let sent = match bounded(tree.clone(), Err(stuck()), |t| t.request_stop()).await {
        Ok(sent) => sent,
        Err(e) => return Outcome::SignalFailed { reason, error: e.to_string() },
    };
    let grace_deadline = tokio::time::Instant::now() + if sent { policy.grace } else { Duration::ZERO };
    if wait_gone(tree, &mut leader, &mut status, &mut wait_err, grace_deadline).await {
        return match (wait_err, status) {
            (Some(e), _) => Outcome::WaitFailed(e),
            (None, Some(s)) => Outcome::ExitedAfterStop { reason, status: s },
            (None, None) => Outcome::ExitedAfterStop { reason, status: ExitKind::Unknown },
        };
    }
    if !policy.kill {
        close_pipes();
        let survivors = bounded(tree.clone(), 1, |t| t.survivors()).await.max(1);
        return Outcome::GaveUp { reason, grace: policy.grace, survivors };
    }
    let killed = bounded(tree.clone(), Err(stuck()), |t| t.kill()).await;
    if let Some(child) = leader.as_deref_mut()
        && status.is_none()
    {
        let _ = child.start_kill();
    }
    close_pipes();
    if let Err(e) = killed {
        return Outcome::SignalFailed { reason, error: e.to_string() };
    }
    let kill_deadline = tokio::time::Instant::now() + policy.kill_timeout;
    if wait_gone(tree, &mut leader, &mut status, &mut wait_err, kill_deadline).await {
        return match wait_err {
            Some(e) => Outcome::WaitFailed(e),
            None => Outcome::Killed { reason, grace: policy.grace },
        };
    }
    let survivors = bounded(tree.clone(), 1, |t| t.survivors()).await.max(1);
    Outcome::Incomplete { reason, survivors }
}

#[cfg(test)]
mod ladder_tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A tree scripted to misbehave: it may refuse signals, or never empty.
    #[derive(Clone)]
    struct Scripted {
        stop_error: bool,
        kill_error: bool,
        /// The graceful step cannot be delivered (`Ok(false)`).
        not_sent: bool,
        empties_on_term: bool,
        empties_on_kill: bool,
        state: Arc<(AtomicBool, AtomicBool, AtomicUsize)>,
    }

    impl Scripted {
        fn new(empties_on_term: bool, empties_on_kill: bool) -> Scripted {
            Scripted {
                stop_error: false,
                kill_error: false,
                not_sent: false,
                empties_on_term,
                empties_on_kill,
                state: Arc::new((AtomicBool::new(false), AtomicBool::new(false), AtomicUsize::new(3))),
            }
        }
        fn killed(&self) -> bool {
            self.state.1.load(Ordering::SeqCst)
        }
    }

    impl TreeOps for Scripted {
        fn request_stop(&self) -> std::io::Result<bool> {
            if self.stop_error {
                return Err(refused());
            }
            if self.not_sent {
                return Ok(false);
            }
            self.state.0.store(true, Ordering::SeqCst);
            Ok(true)
        }
        fn kill(&self) -> std::io::Result<()> {
            if self.kill_error {
                return Err(refused());
            }
            self.state.1.store(true, Ordering::SeqCst);
            Ok(())
        }
        fn is_empty(&self) -> bool {
            (self.empties_on_term && self.state.0.load(Ordering::SeqCst))
                || (self.empties_on_kill && self.state.1.load(Ordering::SeqCst))
        }
        fn survivors(&self) -> usize {
            if self.is_empty() { 0 } else { self.state.2.load(Ordering::SeqCst) }
        }
    }

    fn refused() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, "refused")
    }

    const POLICY: StopPolicy =
        StopPolicy { grace: Duration::from_secs(10), kill_timeout: Duration::from_secs(5), kill: true };

    async fn run(tree: &Scripted, policy: StopPolicy) -> (Outcome, bool) {
        let mut pipes_closed = false;
        let o = ladder(tree, None::<&mut NoLeader>, &policy, StopReason::Cancel, || pipes_closed = true).await;
        (o, pipes_closed)
    }

    #[tokio::test(start_paused = true)]
    async fn every_rung_of_the_ladder() {
        let c = StopReason::Cancel;
        // Empties on SIGTERM: no SIGKILL, pipes left to reach EOF.
        let t = Scripted::new(true, true);
        let (o, closed) = run(&t, POLICY).await;
        assert_eq!(o, Outcome::ExitedAfterStop { reason: c, status: ExitKind::Unknown });
        assert!(!t.killed() && !closed);
        // Needs SIGKILL: killed after the grace, pipes closed.
        let t = Scripted::new(false, true);
        let (o, closed) = run(&t, POLICY).await;
        assert_eq!(o, Outcome::Killed { reason: c, grace: Duration::from_secs(10) });
        assert!(t.killed() && closed);
        // Survives SIGKILL: incomplete after the kill timeout, never a hang.
        let t = Scripted::new(false, false);
        let started = tokio::time::Instant::now();
        let (o, closed) = run(&t, POLICY).await;
        assert_eq!(o, Outcome::Incomplete { reason: c, survivors: 3 });
        assert!(o.to_string().starts_with("termination incomplete: 3 processes survived "), "{o}");
        assert!(closed && o.termination_incomplete());
        assert!(started.elapsed() >= Duration::from_secs(15) && started.elapsed() < Duration::from_secs(16));
        // The no-kill policy gives up after the grace and never sends SIGKILL.
        let t = Scripted::new(false, true);
        let (o, closed) = run(&t, StopPolicy { kill: false, ..POLICY }).await;
        assert_eq!(o, Outcome::GaveUp { reason: c, grace: Duration::from_secs(10), survivors: 3 });
        assert!(!t.killed() && closed);
        // Signalling fails: reported, record kept (termination incomplete).
        let t = Scripted { stop_error: true, ..Scripted::new(true, true) };
        let (o, _) = run(&t, POLICY).await;
        assert!(matches!(&o, Outcome::SignalFailed { error, .. } if error == "refused"), "{o:?}");
        assert!(o.to_string().starts_with("failed to signal: ") && o.termination_incomplete());
        let t = Scripted { kill_error: true, ..Scripted::new(false, true) };
        let (o, closed) = run(&t, POLICY).await;
        assert!(matches!(o, Outcome::SignalFailed { .. }) && closed, "{o:?}");
        // No graceful step could be delivered: no grace period, the kill at once.
        let t = Scripted { not_sent: true, ..Scripted::new(true, true) };
        let started = tokio::time::Instant::now();
        let (o, closed) = run(&t, POLICY).await;
        assert_eq!(o, Outcome::Killed { reason: c, grace: Duration::from_secs(10) });
        assert!(t.killed() && closed && started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
    }
}
