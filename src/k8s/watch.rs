//! One list/watch for every object nodeplan follows (the plan Secret, a node's NodePlans, a Lease,
//! and a fleet's plan objects for `plan status --watch` and `rollout`): a list with the caller's
//! label or field selector, then a watch from the list's resourceVersion, and a list again
//! whenever the watch ends. What it sees goes to a [`Sink`]: the whole map after every change
//! ([`pump`], for an agent's source that looks when it likes) or each change in order ([`follow`],
//! for a command that follows a fleet). A field selector the API server may not support (a
//! custom resource's selectable field) is tried first and dropped for good when refused.
//!
//! kube-runtime's `watcher` resumes a broken watch from the last resourceVersion and says nothing
//! until the next change, so a write kept through an outage would wait for its own back-off step.
//! Here every successful list publishes the objects under a new sequence number, changed or not:
//! the first thing the reconcile loop hears after an outage is "the API server is back", and it
//! flushes the kept write at once.
//!
//! **A watch is known to be alive.** A connection can die without a FIN or an RST (a NAT entry
//! timed out, a load balancer failed over): a watch on it would wait for ever. So:
//! - on a connection that PINGs itself (HTTP/2, `k8s::connection`) a dead connection is closed
//!   within 20 s and the watch on it ends with an error: the API server is asked to end the watch
//!   after at most [`PINGED_WATCH_TIMEOUT_SECS`] ([`Bounds::for_connection`]);
//! - elsewhere (HTTP/1.1) the API server is asked to end every watch after [`WATCH_TIMEOUT_SECS`]
//!   and to send bookmarks, so a healthy watch is never quiet for longer than that, and a watch
//!   quiet for [`WATCH_GAP`] (no event, no bookmark, no end) is given up ([`Bounds::UNPINGED`]);
//! - either way, a watch given up or broken lists again;
//! - when any request of the process is answered after failures (`k8s::liveness`: in remote mode
//!   the Lease renewal notices first), a watch opened before those failures is given up at once and
//!   the pump lists again on a fresh request.
//!
//! Cost: one watch request per object kind every 15–30 min ([`PINGED_WATCH_TIMEOUT_SECS`]) on
//! HTTP/2, every [`WATCH_TIMEOUT_SECS`] on HTTP/1.1 (resumed from the last resourceVersion it
//! delivered, bookmarks included, served from the API server's watch cache; nothing is published
//! and the reconcile loop is not woken); a list only after an error, an expired resourceVersion
//! (410), a watch that ended at once, or a comeback.
//!
//! Owns: the list/watch cycle, its liveness bounds, its back-off (jittered, reset after a watch
//! that ran a while) and the map of objects by name it publishes. It decides nothing about what
//! the objects mean.

use crate::backoff::{Backoff, jittered};
use futures::{Stream, StreamExt as _};
use kube::Resource as _;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// The objects by name, numbered: every publish has a new number.
pub type Latest<K> = (u64, BTreeMap<String, K>);

/// One change the pump saw, for a follower of every change ([`follow`]).
#[derive(Debug)]
pub enum Event<K> {
    /// A list begins (at the start, and after a watch broke, went quiet or outlived an outage):
    /// what it does not list is gone.
    Relisting,
    /// An object as it is now (listed, or changed), by key.
    Is(String, K),
    /// It was deleted (or no longer matches).
    Gone(String),
    /// The list is complete.
    Listed,
}

/// Where the pump puts what it sees. `false` from either call: nobody listens any more.
pub trait Sink<K>: Send {
    /// A list answered: `objects` is every object now.
    fn listed(&mut self, objects: &BTreeMap<String, K>) -> bool;
    /// The object `key` is now `now` (`None`: gone); `objects` is every object after it.
    fn changed(&mut self, key: &str, now: Option<&K>, objects: &BTreeMap<String, K>) -> bool;
    /// Returns once nobody listens any more.
    fn closed(&self) -> impl Future<Output = ()> + Send;
}

/// The whole map under a new number after every list and every change.
struct Snapshots<K> {
    tx: watch::Sender<Latest<K>>,
    seq: u64,
}

impl<K> Snapshots<K> {
    fn new(tx: watch::Sender<Latest<K>>) -> Self {
        let seq = tx.borrow().0;
        Snapshots { tx, seq }
    }

    fn publish(&mut self, objects: &BTreeMap<String, K>) -> bool
    where
        K: Clone,
    {
        self.seq += 1;
        self.tx.send((self.seq, objects.clone())).is_ok()
    }
}

impl<K: Clone + Send + Sync> Sink<K> for Snapshots<K> {
    fn listed(&mut self, objects: &BTreeMap<String, K>) -> bool {
        self.publish(objects)
    }
    fn changed(&mut self, _: &str, _: Option<&K>, objects: &BTreeMap<String, K>) -> bool {
        self.publish(objects)
    }
    async fn closed(&self) {
        self.tx.closed().await
    }
}

/// Each change in order: a list as [`Event::Relisting`], every object, [`Event::Listed`].
impl<K: Clone + Send + Sync> Sink<K> for mpsc::UnboundedSender<Event<K>> {
    fn listed(&mut self, objects: &BTreeMap<String, K>) -> bool {
        let all = objects.iter().map(|(k, o)| Event::Is(k.clone(), o.clone()));
        std::iter::once(Event::Relisting).chain(all).chain([Event::Listed]).all(|e| self.send(e).is_ok())
    }
    fn changed(&mut self, key: &str, now: Option<&K>, _: &BTreeMap<String, K>) -> bool {
        let e = match now {
            Some(o) => Event::Is(key.to_string(), o.clone()),
            None => Event::Gone(key.to_string()),
        };
        self.send(e).is_ok()
    }
    async fn closed(&self) {
        mpsc::UnboundedSender::closed(self).await
    }
}

/// A list's answer: the objects and the resourceVersion to watch from.
pub struct Listed<K> {
    pub resource_version: String,
    pub items: Vec<K>,
}

/// A watch's events.
pub type Events<K> = Pin<Box<dyn Stream<Item = Result<WatchEvent<K>, WatchError>> + Send>>;

/// Why a list or a watch failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchError {
    /// 410 Gone: the resourceVersion is too old; list again.
    Gone,
    Other(String),
}

/// What the pump needs of the API server (a trait so the relist logic can be tested without one).
pub trait ListWatch: Send + Sync {
    type Object: kube::Resource + Clone + Send + Sync + 'static;
    fn list(&self) -> impl Future<Output = Result<Listed<Self::Object>, WatchError>> + Send;
    /// A watch from `resource_version` that the API server ends after `timeout_secs`.
    fn watch(
        &self,
        resource_version: &str,
        timeout_secs: u32,
    ) -> impl Future<Output = Result<Events<Self::Object>, WatchError>> + Send;
    /// The bounds of the next watch (the connection it goes on may PING itself).
    fn bounds(&self) -> Bounds {
        Bounds::UNPINGED
    }
    /// Moves each time the API server answers again after failures ([`super::liveness`]).
    fn reconnected(&self) -> watch::Receiver<u64>;
    /// The key of an object in the map (its name, by default); `None`: it is left out.
    fn key(&self, o: &Self::Object) -> Option<String> {
        o.meta().name.clone()
    }
}

/// How long a list may take.
const LIST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a watch may take to start (the API server answers a watch at once; a watch opened
/// on a connection that died would otherwise wait for the client's header bound).
const WATCH_START_TIMEOUT: Duration = Duration::from_secs(10);
/// The watch's server-side timeout (the API server ends it then, and the pump watches again) on
/// a connection that is not PINGed (HTTP/1.1).
pub const WATCH_TIMEOUT_SECS: u32 = 20;
/// A watch quiet this long (no event, no bookmark, no end: the API server sends a bookmark just
/// before it ends a watch) sits on a dead connection: the pump gives up on it and lists again.
pub const WATCH_GAP: Duration = Duration::from_secs(WATCH_TIMEOUT_SECS as u64 + 5);
/// The longest server-side timeout of a watch on an HTTP/2 connection, which PINGs itself
/// (`k8s::connection`): a dead one is closed within 20 s, and the watch on it ends with it. Each
/// watch asks for 50–100 % of this, drawn, so a fleet's watches do not end together. An agent
/// holds two watches (its plan object and its Lease) where system-agent holds one for 5–10 min
/// (client-go's reflector), and each renewal of a watch is a request to the API server.
pub const PINGED_WATCH_TIMEOUT_SECS: u32 = 1800;

/// How long the API server is asked to keep a watch, and how long it may be quiet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub timeout_secs: u32,
    pub gap: Duration,
}

impl Bounds {
    /// On HTTP/1.1 the watch's own end is the liveness signal: [`WATCH_TIMEOUT_SECS`],
    /// [`WATCH_GAP`].
    pub const UNPINGED: Bounds = Bounds { timeout_secs: WATCH_TIMEOUT_SECS, gap: WATCH_GAP };

    /// The bounds of the next watch on a connection that is PINGed (`true`: a timeout drawn from
    /// the last half of [`PINGED_WATCH_TIMEOUT_SECS`], and a gap bound that only catches a
    /// server that forgot to end it) or is not.
    pub fn for_connection(pinged: bool) -> Bounds {
        if !pinged {
            return Bounds::UNPINGED;
        }
        let longest = Duration::from_secs(PINGED_WATCH_TIMEOUT_SECS as u64);
        let timeout = crate::backoff::earlier(longest, 0.5).as_secs().max(1);
        Bounds { timeout_secs: timeout as u32, gap: Duration::from_secs(timeout + 30) }
    }
}
/// The back-off between the end of a watch (or a failed list) and the next list: 0.8 s doubling
/// to 10 s, jittered; back to the start after a watch that ran this long. (kube's default caps at
/// 30 s: after a long outage without a Lease, nothing else would notice the comeback sooner; a
/// failed list against a server that is down costs it nothing.)
const BACKOFF_INITIAL: Duration = Duration::from_millis(800);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
const HEALTHY_AFTER: Duration = Duration::from_secs(1);

/// The objects of `api` that a label or field selector picks, through kube.
pub struct KubeListWatch<K> {
    api: Api<K>,
    labels: Option<String>,
    fields: Option<String>,
    /// A field selector to add where the API server supports it ([`KubeListWatch::preferring`]).
    preferred: Option<Preferred>,
    /// Objects of every namespace: keyed `NAMESPACE/NAME` ([`KubeListWatch::across_namespaces`]).
    across: bool,
}

/// What [`KubeListWatch::preferring`] is told once it knows whether the API server selects by
/// the preferred field selector: `Ok(())` it does, `Err(why)` it refused it (the watch goes on
/// by the label selector alone).
pub type Decided = Box<dyn Fn(Result<(), &str>) + Send + Sync>;

/// A field selector the API server may not support (a custom resource's `selectableFields` need
/// Kubernetes 1.31, and the definition installed must declare them).
struct Preferred {
    fields: String,
    /// [`UNDECIDED`], [`BY_FIELDS`] or [`BY_LABELS`].
    mode: AtomicU8,
    decided: Decided,
}

const UNDECIDED: u8 = 0;
const BY_FIELDS: u8 = 1;
const BY_LABELS: u8 = 2;

impl<K> KubeListWatch<K> {
    /// The objects whose labels match `selector`.
    pub fn labelled(api: Api<K>, selector: &str) -> Self {
        KubeListWatch { api, labels: Some(selector.to_string()), fields: None, preferred: None, across: false }
    }

    /// The objects whose labels match `labels` and, where the API server supports the field
    /// selector `fields`, whose fields match it too. Each list asks with both until the API server
    /// refuses the field selector (400 Bad Request): from then on, labels alone (until the process
    /// starts again). `decided` hears the outcome of the first list that answers, and of a later
    /// refusal.
    pub fn preferring(api: Api<K>, labels: &str, fields: &str, decided: Decided) -> Self {
        let preferred = Preferred { fields: fields.to_string(), mode: AtomicU8::new(UNDECIDED), decided };
        KubeListWatch { api, labels: Some(labels.to_string()), fields: None, preferred: Some(preferred), across: false }
    }

    /// The one object named `name`.
    pub fn named(api: Api<K>, name: &str) -> Self {
        KubeListWatch {
            api,
            labels: None,
            fields: Some(format!("metadata.name={name}")),
            preferred: None,
            across: false,
        }
    }

    /// For an `api` of every namespace: objects are keyed `NAMESPACE/NAME` (names repeat across
    /// namespaces).
    pub fn across_namespaces(self) -> Self {
        KubeListWatch { across: true, ..self }
    }

    /// The field selector a request carries now.
    fn fields_now(&self) -> Option<&str> {
        match &self.preferred {
            Some(p) if p.mode.load(Ordering::Relaxed) != BY_LABELS => Some(&p.fields),
            _ => self.fields.as_deref(),
        }
    }

    fn list_params(&self) -> ListParams {
        let lp = ListParams::default();
        let lp = match &self.labels {
            Some(l) => lp.labels(l),
            None => lp,
        };
        match self.fields_now() {
            Some(f) => lp.fields(f),
            None => lp,
        }
    }

    fn watch_params(&self, timeout_secs: u32) -> WatchParams {
        let wp = WatchParams::default().timeout(timeout_secs);
        let wp = match &self.labels {
            Some(l) => wp.labels(l),
            None => wp,
        };
        match self.fields_now() {
            Some(f) => wp.fields(f),
            None => wp,
        }
    }
}

fn kube_error(e: kube::Error) -> WatchError {
    match &e {
        kube::Error::Api(s) if s.code == 410 => WatchError::Gone,
        _ => WatchError::Other(super::error_line(&e)),
    }
}

impl<K> ListWatch for KubeListWatch<K>
where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    type Object = K;

    async fn list(&self) -> Result<Listed<K>, WatchError> {
        let answer = self.api.list(&self.list_params()).await;
        let list = match (&self.preferred, answer) {
            (Some(p), Err(kube::Error::Api(s))) if s.code == 400 && p.mode.load(Ordering::Relaxed) != BY_LABELS => {
                p.mode.store(BY_LABELS, Ordering::Relaxed);
                let why = super::error_line(&kube::Error::Api(s));
                (p.decided)(Err(&why));
                self.api.list(&self.list_params()).await
            }
            (Some(p), Ok(list)) if p.mode.load(Ordering::Relaxed) == UNDECIDED => {
                p.mode.store(BY_FIELDS, Ordering::Relaxed);
                (p.decided)(Ok(()));
                Ok(list)
            }
            (_, answer) => answer,
        };
        let list = list.map_err(kube_error)?;
        Ok(Listed { resource_version: list.metadata.resource_version.unwrap_or_default(), items: list.items })
    }

    async fn watch(&self, resource_version: &str, timeout_secs: u32) -> Result<Events<K>, WatchError> {
        let events = self.api.watch(&self.watch_params(timeout_secs), resource_version).await.map_err(kube_error)?;
        Ok(Box::pin(events.map(|e| e.map_err(kube_error))))
    }

    fn bounds(&self) -> Bounds {
        Bounds::for_connection(super::liveness::on_http2())
    }

    fn reconnected(&self) -> watch::Receiver<u64> {
        super::liveness::reconnected()
    }

    fn key(&self, o: &K) -> Option<String> {
        let name = o.meta().name.clone()?;
        match (self.across, o.meta().namespace.as_deref()) {
            (true, Some(ns)) => Some(format!("{ns}/{name}")),
            _ => Some(name),
        }
    }
}

/// Keep `tx` holding the objects `lw` picks until every receiver is gone (`what` names them in
/// log lines). Never ends otherwise: errors are logged and the pump lists again after a back-off.
pub async fn pump<L: ListWatch>(lw: L, what: String, tx: watch::Sender<Latest<L::Object>>) {
    run(&lw, &what, Snapshots::new(tx)).await;
}

/// Every change of the objects `lw` picks, in order, for as long as the stream is kept (`what`
/// names them in log lines): the same list/watch and bounds as [`pump`], whose task ends with
/// the stream.
pub fn follow<L: ListWatch + 'static>(lw: L, what: String) -> impl Stream<Item = Event<L::Object>> + Send + 'static {
    let (tx, rx) = mpsc::unbounded_channel();
    let task = crate::AbortOnDrop(tokio::spawn(async move { run(&lw, &what, tx).await }));
    futures::stream::unfold((rx, task), |(mut rx, task)| async move { Some((rx.recv().await?, (rx, task))) })
}

/// How a watch ended.
enum End {
    /// The server ended it (its timeout, a connection closed).
    Closed,
    /// 410 Gone.
    Gone,
    Error(String),
    /// The API server answered again after failures: this watch may sit on a dead connection.
    Reconnected,
    /// Nobody listens any more.
    Unheard,
}

/// The list-then-watch cycle over `lw`, putting what it sees into `sink` (`what` names it in log
/// lines), until nobody listens.
async fn run<L: ListWatch>(lw: &L, what: &str, mut sink: impl Sink<L::Object>) {
    let mut backoff = Backoff::new(BACKOFF_INITIAL, BACKOFF_MAX, HEALTHY_AFTER);
    // Errors since the last list that answered.
    let mut failing: Option<Failing> = None;
    loop {
        let listed = tokio::select! {
            r = tokio::time::timeout(LIST_TIMEOUT, lw.list()) => r,
            _ = sink.closed() => return,
        };
        let (end, ran) = match listed {
            Ok(Ok(listed)) => {
                let mut objects: BTreeMap<String, L::Object> =
                    listed.items.into_iter().filter_map(|o| Some((lw.key(&o)?, o))).collect();
                if !sink.listed(&objects) {
                    return;
                }
                if failing.take().is_some() {
                    tracing::info!("the watch of {what} is back");
                }
                let started = Instant::now();
                // Subscribed after the list answered: only failures after it count.
                let reconnected = lw.reconnected();
                let mut rv = listed.resource_version;
                let end = loop {
                    let began = Instant::now();
                    let end = watch_from(lw, &mut rv, &mut objects, &mut sink, reconnected.clone()).await;
                    if matches!(end, End::Unheard) {
                        return;
                    }
                    // A watch the server ended after a healthy while (its timeout) goes on from the
                    // last resourceVersion it delivered, without a list: nothing was missed.
                    if matches!(end, End::Closed) && began.elapsed() >= HEALTHY_AFTER {
                        tracing::trace!("the watch of {what} ended on time; watching on from {rv}");
                        continue;
                    }
                    break end;
                };
                (end, started.elapsed())
            }
            Ok(Err(WatchError::Gone)) => (End::Error("failed to list: 410 Gone".into()), Duration::ZERO),
            Ok(Err(WatchError::Other(e))) => (End::Error(format!("failed to list: {e}")), Duration::ZERO),
            Err(_) => (End::Error("failed to list: no answer".into()), Duration::ZERO),
        };
        if let End::Reconnected = end {
            // A fresh list at once: the requests that answered show the way is open again.
            tracing::info!("the API server answers again; listing {what} afresh");
            failing.get_or_insert_with(Failing::new);
            continue;
        }
        let pause = jittered(backoff.after_run(ran));
        match end {
            End::Reconnected | End::Unheard => {}
            End::Closed => tracing::debug!("the watch of {what} ended; listing again"),
            End::Gone => tracing::debug!("the watch of {what} expired (410 Gone); listing again"),
            End::Error(e) => {
                let e = e.replace(['\n', '\r'], " ");
                let pause = crate::duration::human(pause);
                let f = failing.get_or_insert_with(Failing::new);
                match f.warn(Instant::now()) {
                    Some(None) => tracing::warn!(error = %e, "watch of {what} failed; listing again in {pause}"),
                    Some(Some(since)) => tracing::warn!(
                        error = %e,
                        "watch of {what} still fails after {}; listing again in {pause}",
                        crate::duration::human(since)
                    ),
                    None => tracing::debug!(error = %e, "watch of {what} failed again; listing again in {pause}"),
                }
            }
        }
        // A comeback seen by another request (the Lease's renewal) ends the back-off at once:
        // after a long outage the back-off has grown to its cap.
        let mut back = lw.reconnected();
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            Ok(()) = back.changed() => {}
            _ = sink.closed() => return,
        }
    }
}

/// How often a watch that keeps failing says so again (an outage that lasts, an account that may
/// not list or watch): every failure goes to the debug log, one in this long is a warning.
const REMIND: Duration = Duration::from_secs(300);

/// A run of failures of one watch, so that it is one warning (repeated every [`REMIND`]) and not
/// a line per retry.
struct Failing {
    since: Instant,
    warned: Option<Instant>,
}

impl Failing {
    fn new() -> Failing {
        Failing { since: Instant::now(), warned: None }
    }

    /// Whether a failure now is worth a warning: `Some(None)` the first of the run, `Some(since)`
    /// a reminder (how long the run has lasted), `None` not (the debug log has it).
    fn warn(&mut self, now: Instant) -> Option<Option<Duration>> {
        let first = self.warned.is_none();
        if self.warned.is_some_and(|t| now < t + REMIND) {
            return None;
        }
        self.warned = Some(now);
        Some((!first).then(|| now - self.since))
    }
}

/// Watch from `rv`, applying every event to `objects` and publishing it, until the watch ends;
/// `rv` follows the events (bookmarks included), so a watch can go on where this one ended.
async fn watch_from<L: ListWatch>(
    lw: &L,
    rv: &mut String,
    objects: &mut BTreeMap<String, L::Object>,
    sink: &mut impl Sink<L::Object>,
    mut reconnected: watch::Receiver<u64>,
) -> End {
    let bounds = lw.bounds();
    let started = tokio::select! {
        r = tokio::time::timeout(WATCH_START_TIMEOUT, lw.watch(rv.as_str(), bounds.timeout_secs)) => r,
        Ok(()) = reconnected.changed() => return End::Reconnected,
        _ = sink.closed() => return End::Unheard,
    };
    let mut events = match started {
        Ok(Ok(events)) => events,
        Ok(Err(WatchError::Gone)) => return End::Gone,
        Ok(Err(WatchError::Other(e))) => return End::Error(format!("failed to start watching: {e}")),
        Err(_) => return End::Error("failed to start watching: no answer".into()),
    };
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout(bounds.gap, events.next()) => next,
            Ok(()) = reconnected.changed() => return End::Reconnected,
            _ = sink.closed() => return End::Unheard,
        };
        let event = match next {
            Ok(Some(event)) => event,
            Ok(None) => return End::Closed,
            Err(_) => {
                return End::Error(format!(
                    "the watch was quiet for {} (no event, no bookmark, no end): the connection is taken for dead",
                    crate::duration::human(bounds.gap)
                ));
            }
        };
        let seen_rv = match &event {
            Ok(WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o)) => {
                o.meta().resource_version.clone()
            }
            Ok(WatchEvent::Bookmark(b)) => Some(b.metadata.resource_version.clone()),
            _ => None,
        };
        if let Some(v) = seen_rv.filter(|v| !v.is_empty()) {
            *rv = v;
        }
        let heard = match event {
            Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)) => {
                let Some(key) = lw.key(&o) else { continue };
                objects.insert(key.clone(), o);
                sink.changed(&key, objects.get(&key), objects)
            }
            Ok(WatchEvent::Deleted(o)) => {
                let Some(key) = lw.key(&o) else { continue };
                objects.remove(&key);
                sink.changed(&key, None, objects)
            }
            Ok(WatchEvent::Bookmark(_)) => continue,
            Ok(WatchEvent::Error(s)) if s.code == 410 => return End::Gone,
            Ok(WatchEvent::Error(s)) => {
                return End::Error(format!("watch error {} {}: {}", s.code, s.reason, s.message));
            }
            Err(WatchError::Gone) => return End::Gone,
            Err(WatchError::Other(e)) => return End::Error(format!("watch failed: {e}")),
        };
        if !heard {
            return End::Unheard;
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use kube::api::{ApiResource, DynamicObject};
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    type Event = Result<WatchEvent<DynamicObject>, WatchError>;

    /// One answer of the fake API server, in order.
    enum Step {
        List(Result<Listed<DynamicObject>, WatchError>),
        /// A watch: its events, each after a delay, then its end after `end_after` more.
        Watch(Result<Vec<(Duration, Event)>, WatchError>, Duration),
    }

    #[derive(Default)]
    struct Fake {
        steps: Mutex<VecDeque<Step>>,
        /// Every call: when, and which (`list` or `watch <rv>`).
        calls: Mutex<Vec<(Instant, String)>>,
        /// What [`ListWatch::reconnected`] follows.
        epoch: watch::Sender<u64>,
        /// [`ListWatch::bounds`]: the connection PINGs itself.
        pinged: std::sync::atomic::AtomicBool,
    }

    impl Fake {
        fn new(steps: Vec<Step>) -> Arc<Fake> {
            Arc::new(Fake {
                steps: Mutex::new(steps.into()),
                calls: Mutex::default(),
                epoch: watch::Sender::new(0),
                pinged: Default::default(),
            })
        }
        fn next(&self, call: String) -> Option<Step> {
            self.calls.lock().unwrap().push((Instant::now(), call));
            self.steps.lock().unwrap().pop_front()
        }
        fn calls(&self) -> Vec<(Instant, String)> {
            self.calls.lock().unwrap().clone()
        }
    }

    impl ListWatch for Fake {
        type Object = DynamicObject;
        fn reconnected(&self) -> watch::Receiver<u64> {
            let mut rx = self.epoch.subscribe();
            rx.mark_unchanged();
            rx
        }
        async fn list(&self) -> Result<Listed<DynamicObject>, WatchError> {
            match self.next("list".into()) {
                Some(Step::List(r)) => r,
                Some(Step::Watch(..)) => panic!("a list where the script has a watch"),
                None => std::future::pending().await,
            }
        }
        fn bounds(&self) -> Bounds {
            Bounds::for_connection(self.pinged.load(Ordering::Relaxed))
        }
        async fn watch(&self, rv: &str, timeout_secs: u32) -> Result<Events<DynamicObject>, WatchError> {
            let call = if timeout_secs == WATCH_TIMEOUT_SECS {
                format!("watch {rv}")
            } else {
                format!("watch {rv} for {timeout_secs}s")
            };
            match self.next(call) {
                Some(Step::Watch(r, end_after)) => {
                    let events: VecDeque<(Duration, Event)> = r?.into();
                    let s = futures::stream::unfold((events, end_after), |(mut events, end_after)| async move {
                        match events.pop_front() {
                            Some((d, e)) => {
                                tokio::time::sleep(d).await;
                                Some((e, (events, end_after)))
                            }
                            None => {
                                tokio::time::sleep(end_after).await;
                                None
                            }
                        }
                    });
                    Ok(Box::pin(s))
                }
                Some(Step::List(_)) => panic!("a watch where the script has a list"),
                None => std::future::pending().await,
            }
        }
    }

    fn obj(name: &str, rv: &str) -> DynamicObject {
        let gvk = kube::core::GroupVersionKind::gvk("example.com", "v1", "Thing");
        let mut o = DynamicObject::new(name, &kube::api::ApiResource::from_gvk_with_plural(&gvk, "things"));
        o.metadata.resource_version = Some(rv.into());
        o
    }

    fn listed(rv: &str, items: &[(&str, &str)]) -> Step {
        Step::List(Ok(Listed { resource_version: rv.into(), items: items.iter().map(|(n, v)| obj(n, v)).collect() }))
    }

    fn other(e: &str) -> WatchError {
        WatchError::Other(e.into())
    }

    /// What one publish held: its number and `name@rv` of every object.
    type Seen = (u64, Vec<String>);

    /// Start the pump over `fake`: what it publishes, and its task.
    fn start(fake: &Arc<Fake>) -> (watch::Receiver<Latest<DynamicObject>>, tokio::task::JoinHandle<()>) {
        let (tx, rx) = watch::channel::<Latest<DynamicObject>>((0, BTreeMap::new()));
        let f = fake.clone();
        (rx, tokio::spawn(async move { run(&*f, "test NodePlans", Snapshots::new(tx)).await }))
    }

    /// Start the pump over `fake` and collect the first `n` publishes (each one seen: the fake
    /// spaces them out in virtual time).
    async fn publishes(fake: &Arc<Fake>, n: usize) -> (Vec<Seen>, watch::Receiver<Latest<DynamicObject>>) {
        let (mut rx, _) = start(fake);
        let mut out = Vec::new();
        while out.len() < n {
            rx.changed().await.expect("the pump runs");
            let b = rx.borrow_and_update();
            let names =
                b.1.iter().map(|(k, o)| format!("{k}@{}", o.metadata.resource_version.as_deref().unwrap_or("")));
            out.push((b.0, names.collect()));
        }
        (out, rx)
    }

    fn gaps(calls: &[(Instant, String)]) -> Vec<Duration> {
        calls.windows(2).map(|w| w[1].0 - w[0].0).collect()
    }

    fn within(d: Duration, base_ms: u64) -> bool {
        let base = Duration::from_millis(base_ms);
        d >= base && d <= base + (base / 10).min(Duration::from_secs(1))
    }

    /// Events apply to the listed objects; when the server ends a watch that ran a while (its
    /// timeout), the pump watches on at once from the last resourceVersion delivered (a bookmark's
    /// included), without a list and without publishing anything.
    #[tokio::test(start_paused = true)]
    async fn events_apply_and_a_watch_ended_on_time_goes_on_without_a_list() {
        let s = Duration::from_secs(1);
        let fake = Fake::new(vec![
            listed("10", &[("a", "5")]),
            Step::Watch(
                Ok(vec![
                    (s, Ok(WatchEvent::Added(obj("b", "11")))),
                    (s, Ok(WatchEvent::Modified(obj("a", "12")))),
                    (s, Ok(WatchEvent::Deleted(obj("b", "14")))),
                    (s, Ok(WatchEvent::Bookmark(serde_json::from_value(serde_json::json!({"apiVersion": "agent.cattle.io/v1alpha1", "kind": "NodePlan", "metadata": {"resourceVersion": "15"}})).unwrap()))),
                ]),
                Duration::from_secs(16),
            ),
            Step::Watch(Ok(vec![(s, Ok(WatchEvent::Modified(obj("a", "16"))))]), Duration::from_secs(3600)),
        ]);
        let (seen, _rx) = publishes(&fake, 5).await;
        let want: Vec<Seen> = vec![
            (1, vec!["a@5".into()]),
            (2, vec!["a@5".into(), "b@11".into()]),
            (3, vec!["a@12".into(), "b@11".into()]),
            (4, vec!["a@12".into()]),
            (5, vec!["a@16".into()]),
        ];
        assert_eq!(seen, want, "the bookmark and the watch's end publish nothing");
        let calls = fake.calls();
        let names: Vec<&str> = calls.iter().map(|c| c.1.as_str()).collect();
        assert_eq!(names, ["list", "watch 10", "watch 15"], "on from the bookmark's resourceVersion, no list");
        let g = gaps(&calls);
        assert_eq!(g[1], Duration::from_secs(20), "at once when the watch ended: {g:?}");
    }

    /// Failing lists back off 0.8 s doubling (jittered); the first list that answers is published
    /// at once, and a watch that ran a while sets the back-off back to its first step.
    #[tokio::test(start_paused = true)]
    async fn failures_back_off_and_a_healthy_watch_resets_it() {
        let fake = Fake::new(vec![
            Step::List(Err(other("connection refused"))),
            Step::List(Err(other("connection refused"))),
            Step::List(Err(other("connection refused"))),
            listed("7", &[("a", "7")]),
            // The connection breaks after a healthy while.
            Step::Watch(Ok(vec![(Duration::from_secs(20), Err(other("connection reset")))]), Duration::ZERO),
            Step::List(Err(other("connection refused"))),
            listed("9", &[("a", "7")]),
            Step::Watch(Ok(vec![]), Duration::from_secs(3600)),
        ]);
        let (seen, _rx) = publishes(&fake, 2).await;
        assert_eq!(seen, vec![(1, vec!["a@7".to_string()]), (2, vec!["a@7".to_string()])]);
        let calls = fake.calls();
        let names: Vec<&str> = calls.iter().map(|c| c.1.as_str()).collect();
        assert_eq!(names, ["list", "list", "list", "list", "watch 7", "list", "list", "watch 9"]);
        let g = gaps(&calls);
        assert!(within(g[0], 800) && within(g[1], 1600) && within(g[2], 3200), "doubling: {g:?}");
        assert_eq!(g[3], Duration::ZERO, "the watch starts right after the list");
        assert!(within(g[4], 20_000 + 800), "after a healthy watch: the first step again: {g:?}");
        assert!(within(g[5], 1600), "then doubling again: {g:?}");
    }

    /// A follower hears every change in order, and every list whole between `Relisting` and
    /// `Listed` (at the start and after the watch broke), keyed as the list/watch keys objects.
    #[tokio::test(start_paused = true)]
    async fn a_follower_hears_each_change_and_every_list_whole() {
        let s = Duration::from_secs(1);
        let fake = Fake::new(vec![
            listed("10", &[("a", "5"), ("b", "6")]),
            Step::Watch(
                Ok(vec![
                    (s, Ok(WatchEvent::Added(obj("c", "11")))),
                    (s, Ok(WatchEvent::Deleted(obj("a", "12")))),
                    (s, Err(other("connection reset"))),
                ]),
                Duration::ZERO,
            ),
            listed("13", &[("b", "6")]),
            Step::Watch(Ok(vec![]), Duration::from_secs(3600)),
        ]);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let f = fake.clone();
        let _pump = crate::AbortOnDrop(tokio::spawn(async move { run(&*f, "test NodePlans", tx).await }));
        let mut heard = Vec::new();
        while heard.len() < 9 {
            heard.push(match rx.recv().await.expect("the pump runs") {
                super::Event::Relisting => "relisting".to_string(),
                super::Event::Is(k, o) => format!("{k}@{}", o.metadata.resource_version.unwrap_or_default()),
                super::Event::Gone(k) => format!("{k} gone"),
                super::Event::Listed => "listed".to_string(),
            });
        }
        let want = ["relisting", "a@5", "b@6", "listed", "c@11", "a gone", "relisting", "b@6", "listed"];
        assert_eq!(heard, want);
    }

    /// A run of failures is one warning, then one every five minutes while it lasts (each
    /// reminder says for how long); the failures between go to the debug log. A new run (after a
    /// list answered) warns again at its first failure.
    #[tokio::test(start_paused = true)]
    async fn a_run_of_failures_warns_once_and_then_every_five_minutes() {
        let mut f = Failing::new();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(f.warn(at(0)), Some(None), "the first failure warns");
        assert_eq!(f.warn(at(10)), None);
        assert_eq!(f.warn(at(299)), None);
        assert_eq!(f.warn(at(300)), Some(Some(Duration::from_secs(300))), "a reminder after five minutes");
        assert_eq!(f.warn(at(310)), None);
        assert_eq!(f.warn(at(600)), Some(Some(Duration::from_secs(600))));
        assert_eq!(Failing::new().warn(at(601)), Some(None), "a new run starts over");
    }

    /// 410 Gone (at the watch's start or as an event) lists again; so does every other end of a
    /// watch, and a watch that ends at once keeps doubling the back-off so a broken server is not
    /// hammered.
    #[tokio::test(start_paused = true)]
    async fn gone_and_short_watches_list_again() {
        let gone = kube::core::Status::failure("too old", "Expired").with_code(410).boxed();
        let fake = Fake::new(vec![
            listed("1", &[]),
            Step::Watch(Err(WatchError::Gone), Duration::ZERO),
            listed("2", &[]),
            Step::Watch(Ok(vec![(Duration::ZERO, Ok(WatchEvent::Error(gone)))]), Duration::ZERO),
            listed("3", &[]),
            Step::Watch(Ok(vec![]), Duration::ZERO),
            listed("4", &[("a", "4")]),
            Step::Watch(Ok(vec![]), Duration::from_secs(3600)),
        ]);
        let (seen, _rx) = publishes(&fake, 4).await;
        assert_eq!(seen.last(), Some(&(4, vec!["a@4".to_string()])));
        let calls = fake.calls();
        let names: Vec<&str> = calls.iter().map(|c| c.1.as_str()).collect();
        assert_eq!(names, ["list", "watch 1", "list", "watch 2", "list", "watch 3", "list", "watch 4"]);
        let g = gaps(&calls);
        assert!(within(g[1], 800) && within(g[3], 1600) && within(g[5], 3200), "{g:?}");
    }

    /// A watch that neither delivers nor ends (a connection gone silent) is given up once it has
    /// been quiet for the gap bound, not at a deadline from its start: events keep it alive.
    #[tokio::test(start_paused = true)]
    async fn a_silent_watch_is_given_up() {
        let quiet = WATCH_GAP - Duration::from_secs(1);
        let fake = Fake::new(vec![
            listed("1", &[]),
            Step::Watch(
                Ok(vec![(quiet, Ok(WatchEvent::Added(obj("a", "2")))), (quiet, Ok(WatchEvent::Added(obj("a", "3"))))]),
                Duration::from_secs(24 * 3600),
            ),
            listed("4", &[]),
            Step::Watch(Ok(vec![]), Duration::from_secs(24 * 3600)),
        ]);
        let (seen, _rx) = publishes(&fake, 4).await;
        assert_eq!(seen.len(), 4);
        let g = gaps(&fake.calls());
        assert!(within(g[1], (2 * quiet + WATCH_GAP).as_millis() as u64 + 800), "{g:?}");
    }

    /// On a connection that PINGs itself (HTTP/2) a watch is long and its quiet is no sign of a
    /// dead connection (a dead one is closed, and the watch on it ends with an error); the gap
    /// bound still catches a watch the server never ends.
    #[tokio::test(start_paused = true)]
    async fn a_watch_on_a_pinged_connection_is_long_and_may_be_quiet() {
        let quiet = Duration::from_secs(200);
        let fake = Fake::new(vec![
            listed("1", &[]),
            Step::Watch(Ok(vec![(quiet, Ok(WatchEvent::Added(obj("a", "2"))))]), Duration::from_secs(24 * 3600)),
            listed("3", &[]),
            Step::Watch(Ok(vec![]), Duration::from_secs(24 * 3600)),
        ]);
        fake.pinged.store(true, Ordering::Relaxed);
        let (seen, _rx) = publishes(&fake, 3).await;
        assert_eq!(seen[1].1, ["a@2"], "a quiet of {quiet:?} is not given up");
        let calls = fake.calls();
        let names: Vec<&str> = calls.iter().map(|c| c.1.as_str()).collect();
        assert_eq!((names[0], names[2]), ("list", "list"), "{names:?}");
        let secs: u64 =
            names[1].strip_prefix("watch 1 for ").and_then(|n| n.strip_suffix('s')).unwrap().parse().unwrap();
        assert!((900..=1800).contains(&secs), "{names:?}");
        let gap = Duration::from_secs(secs + 30);
        assert!(within(gaps(&calls)[1], (quiet + gap).as_millis() as u64 + 800), "{:?}", gaps(&calls));
    }

    /// Watches on a PINGed connection ask for 15–30 min, spread, so a fleet that started
    /// together does not end its watches together; without PINGs they stay short.
    #[test]
    fn pinged_watches_ask_for_spread_timeouts() {
        let drawn: Vec<Bounds> = (0..200).map(|_| Bounds::for_connection(true)).collect();
        assert!(drawn.iter().all(|b| (900..=1800).contains(&b.timeout_secs)), "{drawn:?}");
        assert!(drawn.iter().all(|b| b.gap == Duration::from_secs(b.timeout_secs as u64 + 30)), "{drawn:?}");
        let (lo, hi) = (drawn.iter().map(|b| b.timeout_secs).min(), drawn.iter().map(|b| b.timeout_secs).max());
        assert!(hi.zip(lo).is_some_and(|(h, l)| h - l >= 300), "spread: {lo:?}..{hi:?}");
        assert_eq!(Bounds::for_connection(false), Bounds::UNPINGED);
    }

    /// When the API server answers again after failures (another request saw them), a watch
    /// opened before is given up at once and the pump lists afresh, without a back-off step.
    #[tokio::test(start_paused = true)]
    async fn a_comeback_relists_a_watch_opened_before_it() {
        let fake = Fake::new(vec![
            listed("1", &[("a", "1")]),
            Step::Watch(Ok(vec![]), Duration::from_secs(24 * 3600)),
            listed("5", &[("a", "5")]),
            Step::Watch(Ok(vec![]), Duration::from_secs(24 * 3600)),
        ]);
        let (mut rx, _) = start(&fake);
        rx.changed().await.unwrap();
        rx.borrow_and_update();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(fake.calls().len(), 2, "listed, then watching");
        let bumped = Instant::now();
        fake.epoch.send_modify(|e| *e += 1);
        rx.changed().await.unwrap();
        assert_eq!(rx.borrow().1["a"].metadata.resource_version.as_deref(), Some("5"));
        let calls = fake.calls();
        let names: Vec<&str> = calls.iter().map(|c| c.1.as_str()).collect();
        assert_eq!(names, ["list", "watch 1", "list", "watch 5"]);
        assert!(calls[2].0 - bumped < Duration::from_millis(10), "at once: {:?}", gaps(&calls));
    }

    /// A comeback seen by another request ends the back-off between failed lists at once.
    #[tokio::test(start_paused = true)]
    async fn a_comeback_ends_the_back_off() {
        let fake = Fake::new(vec![
            Step::List(Err(other("connection refused"))),
            Step::List(Err(other("connection refused"))),
            Step::List(Err(other("connection refused"))),
            listed("3", &[("a", "3")]),
            Step::Watch(Ok(vec![]), Duration::from_secs(24 * 3600)),
        ]);
        let (mut rx, _) = start(&fake);
        // Three failures: the back-off is at its third step (3.2 s) after the third.
        while fake.calls().len() < 3 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let bumped = Instant::now();
        fake.epoch.send_modify(|e| *e += 1);
        rx.changed().await.unwrap();
        let calls = fake.calls();
        assert!(calls[3].0 - bumped < Duration::from_millis(10), "listed at once: {:?}", gaps(&calls));
    }

    /// The pump ends once nobody listens, even while it waits for the API server.
    #[tokio::test(start_paused = true)]
    async fn the_pump_stops_when_nobody_listens() {
        let fake = Fake::new(vec![listed("1", &[]), Step::Watch(Ok(vec![]), Duration::from_secs(3600))]);
        let (rx, pump) = start(&fake);
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(rx);
        tokio::time::timeout(Duration::from_secs(1), pump).await.expect("the pump ended").expect("no panic");
    }

    /// A preferred field selector goes with the label selector on every request while the API
    /// server accepts it; refused (400), the same list is asked again at once by labels alone and
    /// so is everything after it. Each outcome is told once.
    #[tokio::test]
    async fn a_refused_field_selector_falls_back_to_the_labels() {
        use http::{Request, Response};
        use kube::client::Body;
        let list =
            serde_json::json!({"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": "5"}, "items": []});
        let refused = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "BadRequest",
            "code": 400, "message": "field label not supported: spec.nodeName"});
        let respond = |code: u16, v: &serde_json::Value| {
            Response::builder().status(code).body(Body::from(serde_json::to_vec(v).unwrap_or_default())).unwrap()
        };
        let query = |r: &Request<Body>| {
            let q = r.uri().query().unwrap_or_default().to_string();
            (q.contains("labelSelector=l%3Da"), q.contains("fieldSelector=spec.nodeName%3Da"), q.contains("watch=true"))
        };
        // (the first list's answer, whether the fields are kept, what `decided` hears)
        for (first, kept, told) in [
            (200, true, "fields"),
            (400, false, "labels: the API server answered 400 BadRequest: field label not supported: spec.nodeName"),
        ] {
            let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let heard = Arc::new(Mutex::new(Vec::new()));
            let h = heard.clone();
            let decided: Decided = Box::new(move |o| {
                h.lock().unwrap().push(o.map_or_else(|why| format!("labels: {why}"), |()| "fields".to_string()))
            });
            let api: Api<DynamicObject> = Api::namespaced_with(
                kube::Client::new(svc, "ns"),
                "ns",
                &ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&()),
            );
            let lw = KubeListWatch::preferring(api, "l=a", "spec.nodeName=a", decided);
            let (list, refused) = (list.clone(), refused.clone());
            let server = async move {
                let mut handle = std::pin::pin!(handle);
                let (req, send) = handle.as_mut().next_request().await.expect("a list");
                assert_eq!(query(&req), (true, true, false), "{:?}", req.uri());
                send.send_response(respond(first, if first == 200 { &list } else { &refused }));
                if first == 400 {
                    let (req, send) = handle.as_mut().next_request().await.expect("the list again");
                    assert_eq!(query(&req), (true, false, false), "by labels alone: {:?}", req.uri());
                    send.send_response(respond(200, &list));
                }
                let (req, send) = handle.as_mut().next_request().await.expect("a watch");
                assert_eq!(query(&req), (true, kept, true), "{:?}", req.uri());
                send.send_response(respond(200, &serde_json::json!({})));
                let (req, send) = handle.as_mut().next_request().await.expect("a second list");
                assert_eq!(query(&req), (true, kept, false), "{:?}", req.uri());
                send.send_response(respond(200, &list));
            };
            let client = async {
                assert_eq!(lw.list().await.map(|l| l.resource_version), Ok("5".to_string()));
                let _ = lw.watch("5", WATCH_TIMEOUT_SECS).await;
                assert!(lw.list().await.is_ok());
            };
            tokio::join!(client, server);
            assert_eq!(*heard.lock().unwrap(), [told], "told once");
        }
    }
}
