//! A plan source the agent may act on only while a gate is open: [`Gated`] wraps a source with a
//! [`Gate`], a task that decides (in remote and NodePlan modes: no rival agent on the node, and
//! the source's Lease held, see `crate::lease::guard`).
//!
//! Until the gate opens the source shows no plans and its storage is not watched; it starts the
//! moment the gate opens, and the loop then recovers the source's leftovers before any of its
//! plans runs (R17). While open, the gate's fence says whether the agent may act right now, and
//! before the agent starts a plan or writes one of its states, probe statuses or a kept outcome, the
//! gate's task is asked for a Lease recent enough to act on ([`Gate::fresh`], R26).
//! A gate that ends (another agent took the Lease, Rancher's agent started) ends the source, and
//! with it the loop: the agent stops as a whole and its exit says why ([`crate::apply::AgentExit::Displaced`]).
//! Closing the source stops the gate's task, which gives the Lease up.

use super::{Claim, Look, Observed, Outcome, PlanSource, Reason, Seen, Sent, Wait, Written};
use crate::apply::ApplyError;
use crate::flow::Commit;
use crate::plan::ProbeStatus;
use crate::process::Owner;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};

/// Where a gate stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateState {
    /// Not yet this agent's to act on (it waits, and has said why).
    Waiting,
    Open,
    /// Another agent must act on the source alone: why.
    Ended(String),
}

/// The gate's task, as the source sees it.
pub struct Gate {
    state: watch::Receiver<GateState>,
    fence: watch::Receiver<bool>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    state_alive: bool,
    fence_alive: bool,
    /// Told whether a plan of the source executes (the Lease's renewals follow it, R24).
    busy: Option<watch::Sender<bool>>,
    /// Asked before the agent starts a plan or writes ([`Gate::fresh`]).
    fresh: Option<mpsc::Sender<FreshRequest>>,
    /// The agent's shutdown: an ask still waiting then is given up at once.
    shutdown: Option<watch::Receiver<bool>>,
}

/// A request for the Lease to leave the agent margin to act (R26), answered once it does (`Err`:
/// it was lost).
pub type FreshRequest = oneshot::Sender<Result<(), String>>;

/// How long a start or a write waits for the Lease to be renewed ([`Gate::fresh`]).
pub const FRESH_WAIT: Duration = Duration::from_secs(15);

impl Gate {
    /// A gate driven by `task`, which publishes `state` and `fence` and, once `stop` fires (or its
    /// sender is dropped), gives up what it holds and ends.
    pub fn new(
        state: watch::Receiver<GateState>,
        fence: watch::Receiver<bool>,
        stop: oneshot::Sender<()>,
        task: tokio::task::JoinHandle<()>,
    ) -> Gate {
        Gate {
            state,
            fence,
            stop: Some(stop),
            task: Some(task),
            state_alive: true,
            fence_alive: true,
            busy: None,
            fresh: None,
            shutdown: None,
        }
    }

    /// The gate's task is told through `busy` whether a plan of the source executes, and asked
    /// through `fresh` before the agent starts a plan or writes; an ask gives up at `shutdown`.
    pub fn telling(
        self,
        busy: watch::Sender<bool>,
        fresh: mpsc::Sender<FreshRequest>,
        shutdown: watch::Receiver<bool>,
    ) -> Gate {
        Gate { busy: Some(busy), fresh: Some(fresh), shutdown: Some(shutdown), ..self }
    }

    /// Before the agent starts a plan or writes (R26): at once when the Lease's last renewal leaves
    /// it margin to act, else once a renewal sent for the asking has landed (at most
    /// [`FRESH_WAIT`], and no longer than until the agent shuts down: a shutdown is not held up
    /// by a renewal that cannot land). An `Err` says why it may not act now. Without a Lease, at
    /// once.
    pub async fn fresh(&self) -> Result<(), String> {
        let Some(ask) = &self.fresh else { return Ok(()) };
        let asked = async {
            let (tx, answer) = oneshot::channel();
            if ask.send(tx).await.is_err() {
                // Nobody renews: no Lease is used (the account may not), or it is gone and the
                // fence says so.
                return if *self.fence.borrow() { Ok(()) } else { Err("this agent's Lease is not held".into()) };
            }
            answer.await.unwrap_or_else(|_| Err("this agent's Lease is no longer renewed".into()))
        };
        let shutdown = async {
            let mut s = self.shutdown.clone()?;
            s.wait_for(|s| *s).await.ok().map(|_| ())
        };
        tokio::select! {
            r = tokio::time::timeout(FRESH_WAIT, asked) => r.unwrap_or_else(|_| {
                Err(format!("this agent's Lease could not be renewed within {}", crate::duration::human(FRESH_WAIT)))
            }),
            Some(()) = shutdown => Err("the agent shuts down".into()),
        }
    }

    fn state(&self) -> GateState {
        self.state.borrow().clone()
    }
}

/// A source behind a [`Gate`].
pub struct Gated<S> {
    inner: S,
    gate: Gate,
    started: bool,
    /// The gate opened since the loop last asked ([`PlanSource::opened`]).
    opened: bool,
}

impl<S> Gated<S> {
    pub fn new(inner: S, gate: Gate) -> Gated<S> {
        Gated { inner, gate, started: false, opened: false }
    }

    fn open(&self) -> bool {
        self.gate.state() == GateState::Open
    }
}

impl<S: PlanSource> PlanSource for Gated<S> {
    type Key = S::Key;
    type Kept = S::Kept;

    async fn changed(&mut self) -> bool {
        loop {
            tokio::select! {
                alive = self.inner.changed(), if self.started => return alive,
                r = self.gate.state.changed(), if self.gate.state_alive => {
                    // A task that ended while waiting (a shutdown) changes nothing any more.
                    self.gate.state_alive = r.is_ok();
                    if r.is_ok() {
                        return !matches!(self.gate.state(), GateState::Ended(_));
                    }
                }
                r = self.gate.fence.changed(), if self.gate.fence_alive => {
                    // A fence that can no longer change is no change.
                    self.gate.fence_alive = r.is_ok();
                    if r.is_ok() {
                        return true;
                    }
                }
                // Nothing can change any more (an open gate for good, a source not started).
                () = std::future::pending(), if !self.started && !self.gate.state_alive && !self.gate.fence_alive => {}
            }
        }
    }

    async fn keys(&mut self) -> Vec<S::Key> {
        if !self.open() {
            return Vec::new();
        }
        if !self.started {
            self.inner.start().await;
            self.started = true;
            self.opened = true;
        }
        self.inner.keys().await
    }

    fn opened(&mut self) -> bool {
        std::mem::take(&mut self.opened)
    }

    async fn look(&mut self, key: &S::Key) -> Seen {
        self.inner.look(key).await
    }

    async fn show(&mut self, key: &S::Key) {
        self.inner.show(key).await
    }

    async fn wait(&mut self, key: &S::Key, look: &Look, why: Wait<'_>) {
        self.inner.wait(key, look, why).await
    }

    async fn commit(&mut self, key: &S::Key, look: &Look, commit: &Commit) -> Written {
        if let Err(e) = self.gate.fresh().await {
            return Written::failed(e);
        }
        self.inner.commit(key, look, commit).await
    }

    async fn record(&mut self, key: &S::Key, look: &Look, outcome: Outcome<'_>) -> Sent<S::Kept> {
        self.inner.record(key, look, outcome).await
    }

    async fn not_started(&mut self, key: &S::Key, look: &Look, err: &ApplyError) -> Option<Written> {
        self.inner.not_started(key, look, err).await
    }

    async fn write_probes(&mut self, key: &S::Key, checksum: &str, statuses: BTreeMap<String, ProbeStatus>) -> Written {
        if let Err(e) = self.gate.fresh().await {
            return Written::failed(e);
        }
        self.inner.write_probes(key, checksum, statuses).await
    }

    async fn resend(&mut self, key: &S::Key, kept: S::Kept) -> Sent<S::Kept> {
        if let Err(e) = self.gate.fresh().await {
            return (Written::failed(e), Some(kept));
        }
        self.inner.resend(key, kept).await
    }

    async fn fresh(&mut self, key: &S::Key) -> Result<(), String> {
        self.gate.fresh().await?;
        self.inner.fresh(key).await
    }

    async fn restored(&mut self, key: &S::Key) -> Option<S::Kept> {
        self.inner.restored(key).await
    }

    async fn set_blocked(&mut self, key: &S::Key, why: Option<&str>) {
        self.inner.set_blocked(key, why).await;
    }

    fn interrupt(&mut self, key: &S::Key, look: &Look) -> Observed {
        self.inner.interrupt(key, look)
    }

    fn owner(&self, key: &S::Key, look: &Look) -> Owner {
        self.inner.owner(key, look)
    }

    /// Nothing is claimed before the gate opens: another agent on this machine may hold the
    /// source, and its processes are its own (the loop recovers once the gate opens).
    fn claim(&self, owner: &Owner) -> Claim<S::Key> {
        if self.started { self.inner.claim(owner) } else { Claim::NotMine }
    }

    fn period(&self) -> Duration {
        self.inner.period()
    }

    fn probe_period(&self, key: &S::Key) -> Duration {
        self.inner.probe_period(key)
    }

    fn fence(&self, _key: &S::Key) -> watch::Receiver<bool> {
        self.gate.fence.clone()
    }

    fn polled(&self, key: &S::Key) -> bool {
        self.inner.polled(key)
    }

    fn applying(&self, key: &S::Key, on: bool) {
        if let Some(b) = &self.gate.busy {
            b.send_replace(on);
        }
        self.inner.applying(key, on);
    }

    async fn close(&mut self) -> Option<String> {
        let inner = self.inner.close().await;
        if let Some(stop) = self.gate.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.gate.task.take() {
            let _ = task.await;
        }
        match self.gate.state() {
            GateState::Ended(why) => Some(why),
            _ => inner,
        }
    }

    fn event(&mut self, key: &S::Key, reason: Reason, note: &str) {
        self.inner.event(key, reason, note);
    }
}
