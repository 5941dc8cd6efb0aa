//! Several plan sources as one, so one loop serves the whole node: [`Both`] joins two sources
//! (nest it for more), and `Option<S>` is a source that may be switched off by configuration.
//!
//! A key names its side ([`Side`]); every call goes to the source that owns the key. The joined
//! source changes when either side does, ends when either ends (the agent stops as a whole, as it
//! does for a lost Lease), polls for a value that changed, and its period is the shorter one. A
//! PID record belongs to the first side that claims it.

use super::{Claim, Look, Observed, Outcome, PlanSource, Reason, Seen, Sent, Wait, Written};
use crate::apply::ApplyError;
use crate::flow::Commit;
use crate::plan::ProbeStatus;
use crate::process::Owner;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::watch;

/// Two sources as one.
pub struct Both<A, B> {
    pub a: A,
    pub b: B,
}

impl<A, B> Both<A, B> {
    pub fn new(a: A, b: B) -> Both<A, B> {
        Both { a, b }
    }
}

/// A key of [`Both`]: which side's, and its key there.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Side<A, B> {
    A(A),
    B(B),
}

/// Call `$call` on the side that owns `$key` (bound as `$k` there) and wrap nothing.
macro_rules! route {
    ($self:ident, $key:expr, |$s:ident, $k:ident| $call:expr) => {
        match $key {
            Side::A($k) => {
                let $s = &mut $self.a;
                $call
            }
            Side::B($k) => {
                let $s = &mut $self.b;
                $call
            }
        }
    };
}

/// A side's answer to a write that must not be lost, with what it keeps named by that side.
fn kept_by<K, J>((written, kept): Sent<K>, side: impl FnOnce(K) -> J) -> Sent<J> {
    (written, kept.map(side))
}

/// The same, through a shared borrow.
macro_rules! route_ref {
    ($self:ident, $key:expr, |$s:ident, $k:ident| $call:expr) => {
        match $key {
            Side::A($k) => {
                let $s = &$self.a;
                $call
            }
            Side::B($k) => {
                let $s = &$self.b;
                $call
            }
        }
    };
}

impl<A: PlanSource, B: PlanSource> PlanSource for Both<A, B> {
    type Key = Side<A::Key, B::Key>;
    type Kept = Side<A::Kept, B::Kept>;

    async fn changed(&mut self) -> bool {
        tokio::select! {
            a = self.a.changed() => a,
            b = self.b.changed() => b,
        }
    }

    async fn keys(&mut self) -> Vec<Self::Key> {
        let mut keys: Vec<Self::Key> = self.a.keys().await.into_iter().map(Side::A).collect();
        keys.extend(self.b.keys().await.into_iter().map(Side::B));
        keys
    }

    async fn look(&mut self, key: &Self::Key) -> Seen {
        route!(self, key, |s, k| s.look(k).await)
    }

    async fn show(&mut self, key: &Self::Key) {
        route!(self, key, |s, k| s.show(k).await)
    }

    async fn wait(&mut self, key: &Self::Key, look: &Look, why: Wait<'_>) {
        route!(self, key, |s, k| s.wait(k, look, why).await)
    }

    async fn commit(&mut self, key: &Self::Key, look: &Look, commit: &Commit) -> Written {
        route!(self, key, |s, k| s.commit(k, look, commit).await)
    }

    async fn record(&mut self, key: &Self::Key, look: &Look, outcome: Outcome<'_>) -> Sent<Self::Kept> {
        match key {
            Side::A(k) => kept_by(self.a.record(k, look, outcome).await, Side::A),
            Side::B(k) => kept_by(self.b.record(k, look, outcome).await, Side::B),
        }
    }

    async fn not_started(&mut self, key: &Self::Key, look: &Look, err: &ApplyError) -> Option<Written> {
        route!(self, key, |s, k| s.not_started(k, look, err).await)
    }

    async fn fresh(&mut self, key: &Self::Key) -> Result<(), String> {
        route!(self, key, |s, k| s.fresh(k).await)
    }

    async fn write_probes(
        &mut self,
        key: &Self::Key,
        checksum: &str,
        statuses: BTreeMap<String, ProbeStatus>,
    ) -> Written {
        route!(self, key, |s, k| s.write_probes(k, checksum, statuses).await)
    }

    async fn resend(&mut self, key: &Self::Key, kept: Self::Kept) -> Sent<Self::Kept> {
        match (key, kept) {
            (Side::A(k), Side::A(kept)) => kept_by(self.a.resend(k, kept).await, Side::A),
            (Side::B(k), Side::B(kept)) => kept_by(self.b.resend(k, kept).await, Side::B),
            // The loop keeps a plan's outcome under its own key: never one side's under the other.
            _ => (Written::Abandoned, None),
        }
    }

    async fn restored(&mut self, key: &Self::Key) -> Option<Self::Kept> {
        match key {
            Side::A(k) => self.a.restored(k).await.map(Side::A),
            Side::B(k) => self.b.restored(k).await.map(Side::B),
        }
    }

    async fn set_blocked(&mut self, key: &Self::Key, why: Option<&str>) {
        route!(self, key, |s, k| s.set_blocked(k, why).await)
    }

    fn interrupt(&mut self, key: &Self::Key, look: &Look) -> Observed {
        route!(self, key, |s, k| s.interrupt(k, look))
    }

    fn owner(&self, key: &Self::Key, look: &Look) -> Owner {
        route_ref!(self, key, |s, k| s.owner(k, look))
    }

    fn claim(&self, owner: &Owner) -> Claim<Self::Key> {
        match self.a.claim(owner) {
            Claim::Plan(k) => Claim::Plan(Side::A(k)),
            Claim::Unknown => Claim::Unknown,
            Claim::NotMine => match self.b.claim(owner) {
                Claim::Plan(k) => Claim::Plan(Side::B(k)),
                Claim::Unknown => Claim::Unknown,
                Claim::NotMine => Claim::NotMine,
            },
        }
    }

    fn period(&self) -> Duration {
        self.a.period().min(self.b.period())
    }

    fn probe_period(&self, key: &Self::Key) -> Duration {
        route_ref!(self, key, |s, k| s.probe_period(k))
    }

    async fn start(&mut self) {
        self.a.start().await;
        self.b.start().await;
    }

    fn fence(&self, key: &Self::Key) -> watch::Receiver<bool> {
        route_ref!(self, key, |s, k| s.fence(k))
    }

    fn polled(&self, key: &Self::Key) -> bool {
        route_ref!(self, key, |s, k| s.polled(k))
    }

    fn applying(&self, key: &Self::Key, on: bool) {
        route_ref!(self, key, |s, k| s.applying(k, on))
    }

    fn opened(&mut self) -> bool {
        // Both are asked: each forgets that it opened once asked.
        let a = self.a.opened();
        let b = self.b.opened();
        a || b
    }

    async fn close(&mut self) -> Option<String> {
        let a = self.a.close().await;
        let b = self.b.close().await;
        a.or(b)
    }

    fn event(&mut self, key: &Self::Key, reason: Reason, note: &str) {
        route!(self, key, |s, k| s.event(k, reason, note))
    }
}

/// A source switched off by configuration: no plans, no changes, claims nothing. Its other calls
/// cannot happen (it names no key) and do nothing.
impl<S: PlanSource> PlanSource for Option<S> {
    type Key = S::Key;
    type Kept = S::Kept;

    async fn changed(&mut self) -> bool {
        match self {
            Some(s) => s.changed().await,
            None => std::future::pending().await,
        }
    }

    async fn keys(&mut self) -> Vec<S::Key> {
        match self {
            Some(s) => s.keys().await,
            None => Vec::new(),
        }
    }

    async fn look(&mut self, key: &S::Key) -> Seen {
        match self {
            Some(s) => s.look(key).await,
            None => Seen::Nothing,
        }
    }

    async fn show(&mut self, key: &S::Key) {
        if let Some(s) = self {
            s.show(key).await
        }
    }

    async fn wait(&mut self, key: &S::Key, look: &Look, why: Wait<'_>) {
        if let Some(s) = self {
            s.wait(key, look, why).await
        }
    }

    async fn commit(&mut self, key: &S::Key, look: &Look, commit: &Commit) -> Written {
        match self {
            Some(s) => s.commit(key, look, commit).await,
            None => Written::Abandoned,
        }
    }

    async fn record(&mut self, key: &S::Key, look: &Look, outcome: Outcome<'_>) -> Sent<S::Kept> {
        match self {
            Some(s) => s.record(key, look, outcome).await,
            None => (Written::Abandoned, None),
        }
    }

    async fn not_started(&mut self, key: &S::Key, look: &Look, err: &ApplyError) -> Option<Written> {
        match self {
            Some(s) => s.not_started(key, look, err).await,
            None => None,
        }
    }

    async fn fresh(&mut self, key: &S::Key) -> Result<(), String> {
        match self {
            Some(s) => s.fresh(key).await,
            None => Ok(()),
        }
    }

    async fn write_probes(&mut self, key: &S::Key, checksum: &str, statuses: BTreeMap<String, ProbeStatus>) -> Written {
        match self {
            Some(s) => s.write_probes(key, checksum, statuses).await,
            None => Written::Abandoned,
        }
    }

    async fn resend(&mut self, key: &S::Key, kept: S::Kept) -> Sent<S::Kept> {
        match self {
            Some(s) => s.resend(key, kept).await,
            None => (Written::Abandoned, None),
        }
    }

    async fn restored(&mut self, key: &S::Key) -> Option<S::Kept> {
        match self {
            Some(s) => s.restored(key).await,
            None => None,
        }
    }

    async fn set_blocked(&mut self, key: &S::Key, why: Option<&str>) {
        if let Some(s) = self {
            s.set_blocked(key, why).await;
        }
    }

    fn interrupt(&mut self, key: &S::Key, look: &Look) -> Observed {
        match self {
            Some(s) => s.interrupt(key, look),
            None => Observed::default(),
        }
    }

    fn owner(&self, key: &S::Key, look: &Look) -> Owner {
        match self {
            Some(s) => s.owner(key, look),
            // No key of a switched-off source reaches here; an apply's owner names nothing then.
            None => Owner::new(crate::process::Source::Apply, String::new()),
        }
    }

    fn claim(&self, owner: &Owner) -> Claim<S::Key> {
        match self {
            Some(s) => s.claim(owner),
            None => Claim::NotMine,
        }
    }

    fn period(&self) -> Duration {
        self.as_ref().map_or(Duration::MAX, S::period)
    }

    fn probe_period(&self, key: &S::Key) -> Duration {
        self.as_ref().map_or(Duration::MAX, |s| s.probe_period(key))
    }

    async fn start(&mut self) {
        if let Some(s) = self {
            s.start().await;
        }
    }

    fn fence(&self, key: &S::Key) -> watch::Receiver<bool> {
        match self {
            Some(s) => s.fence(key),
            None => watch::channel(true).1,
        }
    }

    fn polled(&self, key: &S::Key) -> bool {
        self.as_ref().is_some_and(|s| s.polled(key))
    }

    fn applying(&self, key: &S::Key, on: bool) {
        if let Some(s) = self {
            s.applying(key, on);
        }
    }

    fn opened(&mut self) -> bool {
        self.as_mut().is_some_and(S::opened)
    }

    async fn close(&mut self) -> Option<String> {
        match self {
            Some(s) => s.close().await,
            None => None,
        }
    }

    fn event(&mut self, key: &S::Key, reason: Reason, note: &str) {
        if let Some(s) = self {
            s.event(key, reason, note);
        }
    }
}
