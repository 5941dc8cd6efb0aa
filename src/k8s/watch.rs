//! The watch of a node's NodePlans: a list with the node's label selector, then a watch from the
//! list's resourceVersion, and a list again whenever the watch ends (as `SecretClient::watch`
//! does for the Secret).
//!
//! kube-runtime's `watcher` resumes a broken watch from the last resourceVersion and says nothing
//! until the next change, so a status write kept through an outage would wait for its own
//! back-off step. Here every successful list publishes the objects under a new sequence number,
//! changed or not: the first thing the reconcile loop hears after an outage is "the API server is
//! back", and it flushes the kept write at once.
//!
//! Owns: the list/watch cycle, its back-off (jittered, reset after a watch that ran a while) and
//! the map of objects by name it publishes. It decides nothing about what the objects mean.

use crate::process::supervise::Backoff;
use crate::reconcile::jittered;
use futures::{Stream, StreamExt as _};
use kube::api::{Api, DynamicObject, ListParams, WatchEvent, WatchParams};
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// The objects by name, numbered: every publish has a new number.
pub type Latest = (u64, BTreeMap<String, DynamicObject>);

/// A list's answer: the objects and the resourceVersion to watch from.
pub struct Listed {
    pub resource_version: String,
    pub items: Vec<DynamicObject>,
}

/// A watch's events (an `Err` is the error's line).
pub type Events = Pin<Box<dyn Stream<Item = Result<WatchEvent<DynamicObject>, WatchError>> + Send>>;

/// Why a list or a watch failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchError {
    /// 410 Gone: the resourceVersion is too old; list again.
    Gone,
    Other(String),
}

/// What the pump needs of the API server (a trait so the relist logic can be tested without one).
pub trait ListWatch: Send + Sync {
    fn list(&self) -> impl Future<Output = Result<Listed, WatchError>> + Send;
    fn watch(&self, resource_version: &str) -> impl Future<Output = Result<Events, WatchError>> + Send;
}

/// How long a list may take.
const LIST_TIMEOUT: Duration = Duration::from_secs(60);
/// The watch's server-side timeout (the API server ends it then, and the pump lists again).
const WATCH_TIMEOUT_SECS: u32 = 290;
/// A watch the server has not ended this long after its timeout is stuck (a connection gone
/// silent): the pump gives up on it and lists again.
const WATCH_GUARD: Duration = Duration::from_secs(WATCH_TIMEOUT_SECS as u64 + 30);
/// The back-off between the end of a watch (or a failed list) and the next list: 0.8 s doubling
/// to 30 s (kube's default), jittered; back to the start after a watch that ran this long.
const BACKOFF_INITIAL: Duration = Duration::from_millis(800);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
const HEALTHY_AFTER: Duration = Duration::from_secs(1);

/// The NodePlans of `api` matching `selector` (a label selector), through kube.
pub struct KubeListWatch {
    api: Api<DynamicObject>,
    selector: String,
}

fn kube_error(e: kube::Error) -> WatchError {
    match &e {
        kube::Error::Api(s) if s.code == 410 => WatchError::Gone,
        kube::Error::Api(s) => {
            let reason = if s.reason.is_empty() { "Unknown" } else { s.reason.as_str() };
            WatchError::Other(
                format!("apiserver answered {} {reason}: {}", s.code, s.message).replace(['\n', '\r'], " "),
            )
        }
        _ => WatchError::Other(crate::error_line(&e)),
    }
}

impl ListWatch for KubeListWatch {
    async fn list(&self) -> Result<Listed, WatchError> {
        let list = self.api.list(&ListParams::default().labels(&self.selector)).await.map_err(kube_error)?;
        Ok(Listed { resource_version: list.metadata.resource_version.unwrap_or_default(), items: list.items })
    }

    async fn watch(&self, resource_version: &str) -> Result<Events, WatchError> {
        let wp = WatchParams::default().labels(&self.selector).timeout(WATCH_TIMEOUT_SECS);
        let events = self.api.watch(&wp, resource_version).await.map_err(kube_error)?;
        Ok(Box::pin(events.map(|e| e.map_err(kube_error))))
    }
}

/// Keep `tx` holding the NodePlans of `api` that match `selector` (a label selector) until every
/// receiver is gone. Never ends otherwise: errors are logged and the pump lists again after a
/// back-off.
pub async fn pump(api: Api<DynamicObject>, selector: String, tx: watch::Sender<Latest>) {
    let what = format!("NodePlans labelled {selector}{}", api_namespace(&api));
    run(&KubeListWatch { api, selector }, &what, tx).await;
}

fn api_namespace(api: &Api<DynamicObject>) -> String {
    match api.namespace() {
        Some(ns) => format!(" in namespace {ns}"),
        None => String::new(),
    }
}

/// How a watch ended.
enum End {
    /// The server ended it (its timeout, a connection closed).
    Closed,
    /// 410 Gone.
    Gone,
    Error(String),
}

/// The list-then-watch cycle over `lw`, publishing into `tx` (`what` names it in log lines).
pub async fn run<L: ListWatch>(lw: &L, what: &str, tx: watch::Sender<Latest>) {
    let mut backoff = Backoff::new(BACKOFF_INITIAL, BACKOFF_MAX, HEALTHY_AFTER);
    let mut seq = tx.borrow().0;
    // Errors since the last list that answered.
    let mut failing = false;
    loop {
        let listed = tokio::select! {
            r = tokio::time::timeout(LIST_TIMEOUT, lw.list()) => r,
            _ = tx.closed() => return,
        };
        let (end, ran) = match listed {
            Ok(Ok(listed)) => {
                let mut objects: BTreeMap<String, DynamicObject> =
                    listed.items.into_iter().filter_map(|o| Some((o.metadata.name.clone()?, o))).collect();
                if !publish(&tx, &mut seq, &objects) {
                    return;
                }
                if std::mem::take(&mut failing) {
                    tracing::info!("the watch of {what} is back");
                }
                let started = Instant::now();
                let end = tokio::select! {
                    end = watch_from(lw, &listed.resource_version, &mut objects, &tx, &mut seq) => end,
                    _ = tx.closed() => return,
                };
                (end, started.elapsed())
            }
            Ok(Err(WatchError::Gone)) => (End::Error("failed to list: 410 Gone".into()), Duration::ZERO),
            Ok(Err(WatchError::Other(e))) => (End::Error(format!("failed to list: {e}")), Duration::ZERO),
            Err(_) => (End::Error("failed to list: no answer".into()), Duration::ZERO),
        };
        let pause = jittered(backoff.after_run(ran));
        match end {
            End::Closed => tracing::debug!("the watch of {what} ended; listing again"),
            End::Gone => tracing::debug!("the watch of {what} expired (410 Gone); listing again"),
            End::Error(e) => {
                failing = true;
                tracing::warn!(
                    error = %e.replace(['\n', '\r'], " "),
                    "NodePlan watch error; listing again in {}",
                    crate::duration::human(pause)
                );
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = tx.closed() => return,
        }
    }
}

/// Publish the objects under the next number; `false` when nobody listens any more.
fn publish(tx: &watch::Sender<Latest>, seq: &mut u64, objects: &BTreeMap<String, DynamicObject>) -> bool {
    *seq += 1;
    tx.send((*seq, objects.clone())).is_ok()
}

/// Watch from `rv`, applying every event to `objects` and publishing it, until the watch ends.
async fn watch_from<L: ListWatch>(
    lw: &L,
    rv: &str,
    objects: &mut BTreeMap<String, DynamicObject>,
    tx: &watch::Sender<Latest>,
    seq: &mut u64,
) -> End {
    let mut events = match tokio::time::timeout(LIST_TIMEOUT, lw.watch(rv)).await {
        Ok(Ok(events)) => events,
        Ok(Err(WatchError::Gone)) => return End::Gone,
        Ok(Err(WatchError::Other(e))) => return End::Error(format!("failed to start watching: {e}")),
        Err(_) => return End::Error("failed to start watching: no answer".into()),
    };
    let deadline = Instant::now() + WATCH_GUARD;
    loop {
        let event = match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(event)) => event,
            Ok(None) => return End::Closed,
            Err(_) => return End::Error("the watch outlived its timeout without an answer".into()),
        };
        match event {
            Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)) => {
                let Some(name) = o.metadata.name.clone() else { continue };
                objects.insert(name, o);
            }
            Ok(WatchEvent::Deleted(o)) => {
                let Some(name) = o.metadata.name.as_deref() else { continue };
                objects.remove(name);
            }
            Ok(WatchEvent::Bookmark(_)) => continue,
            Ok(WatchEvent::Error(s)) if s.code == 410 => return End::Gone,
            Ok(WatchEvent::Error(s)) => {
                return End::Error(format!("watch error {} {}: {}", s.code, s.reason, s.message));
            }
            Err(WatchError::Gone) => return End::Gone,
            Err(WatchError::Other(e)) => return End::Error(format!("watch failed: {e}")),
        }
        if !publish(tx, seq, objects) {
            // Nobody listens: the pump's caller sees the channel closed and stops.
            return End::Closed;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    type Event = Result<WatchEvent<DynamicObject>, WatchError>;

    /// One answer of the fake API server, in order.
    enum Step {
        List(Result<Listed, WatchError>),
        /// A watch: its events, each after a delay, then its end after `end_after` more.
        Watch(Result<Vec<(Duration, Event)>, WatchError>, Duration),
    }

    #[derive(Default)]
    struct Fake {
        steps: Mutex<VecDeque<Step>>,
        /// Every call: when, and which (`list` or `watch <rv>`).
        calls: Mutex<Vec<(Instant, String)>>,
    }

    impl Fake {
        fn new(steps: Vec<Step>) -> Arc<Fake> {
            Arc::new(Fake { steps: Mutex::new(steps.into()), calls: Mutex::default() })
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
        async fn list(&self) -> Result<Listed, WatchError> {
            match self.next("list".into()) {
                Some(Step::List(r)) => r,
                Some(Step::Watch(..)) => panic!("a list where the script has a watch"),
                None => std::future::pending().await,
            }
        }
        async fn watch(&self, rv: &str) -> Result<Events, WatchError> {
            match self.next(format!("watch {rv}")) {
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
        let mut o = DynamicObject::new(name, &super::super::source::api_resource());
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

    /// Start the pump over `fake` and collect the first `n` publishes (each one seen: the fake
    /// spaces them out in virtual time).
    async fn publishes(fake: &Arc<Fake>, n: usize) -> (Vec<Seen>, watch::Receiver<Latest>) {
        let (tx, mut rx) = watch::channel::<Latest>((0, BTreeMap::new()));
        let f = fake.clone();
        tokio::spawn(async move { run(&*f, "test NodePlans", tx).await });
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

    /// Events apply to the listed objects; when the watch ends the pump lists again after the
    /// back-off's first (jittered) step and publishes a new number although nothing changed.
    #[tokio::test(start_paused = true)]
    async fn events_apply_and_every_list_publishes_even_unchanged() {
        let s = Duration::from_secs(1);
        let fake = Fake::new(vec![
            listed("10", &[("a", "5")]),
            Step::Watch(
                Ok(vec![
                    (s, Ok(WatchEvent::Added(obj("b", "11")))),
                    (s, Ok(WatchEvent::Modified(obj("a", "12")))),
                    (s, Ok(WatchEvent::Bookmark(serde_json::from_value(serde_json::json!({"apiVersion": "agent.cattle.io/v1alpha1", "kind": "NodePlan", "metadata": {"resourceVersion": "13"}})).unwrap()))),
                    (s, Ok(WatchEvent::Deleted(obj("b", "14")))),
                ]),
                Duration::from_secs(60),
            ),
            listed("20", &[("a", "12")]),
            Step::Watch(Ok(vec![]), Duration::from_secs(3600)),
        ]);
        let (seen, _rx) = publishes(&fake, 5).await;
        let want: Vec<Seen> = vec![
            (1, vec!["a@5".into()]),
            (2, vec!["a@5".into(), "b@11".into()]),
            (3, vec!["a@12".into(), "b@11".into()]),
            (4, vec!["a@12".into()]),
            (5, vec!["a@12".into()]),
        ];
        assert_eq!(seen, want, "the bookmark publishes nothing; the relist publishes the same objects anew");
        let calls = fake.calls();
        let names: Vec<&str> = calls.iter().map(|c| c.1.as_str()).collect();
        assert_eq!(names, ["list", "watch 10", "list", "watch 20"]);
        let g = gaps(&calls);
        assert!(within(g[1], 64_000 + 800), "relisted after the watch ended and one short step: {g:?}");
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
            Step::Watch(Ok(vec![(Duration::from_secs(30), Err(other("connection reset")))]), Duration::ZERO),
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
        assert!(within(g[4], 30_000 + 800), "after a healthy watch: the first step again: {g:?}");
        assert!(within(g[5], 1600), "then doubling again: {g:?}");
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

    /// A watch that neither delivers nor ends (a connection gone silent) is given up after its
    /// guard, and the pump lists again.
    #[tokio::test(start_paused = true)]
    async fn a_silent_watch_is_given_up() {
        let fake = Fake::new(vec![
            listed("1", &[]),
            Step::Watch(Ok(vec![]), Duration::from_secs(24 * 3600)),
            listed("2", &[]),
            Step::Watch(Ok(vec![]), Duration::from_secs(24 * 3600)),
        ]);
        let (seen, _rx) = publishes(&fake, 2).await;
        assert_eq!(seen.len(), 2);
        let g = gaps(&fake.calls());
        assert!(within(g[1], WATCH_GUARD.as_millis() as u64 + 800), "{g:?}");
    }

    /// The pump ends once nobody listens, even while it waits for the API server.
    #[tokio::test(start_paused = true)]
    async fn the_pump_stops_when_nobody_listens() {
        let fake = Fake::new(vec![listed("1", &[]), Step::Watch(Ok(vec![]), Duration::from_secs(3600))]);
        let (tx, rx) = watch::channel::<Latest>((0, BTreeMap::new()));
        let f = fake.clone();
        let pump = tokio::spawn(async move { run(&*f, "test NodePlans", tx).await });
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(rx);
        tokio::time::timeout(Duration::from_secs(1), pump).await.expect("the pump ended").expect("no panic");
    }
}
