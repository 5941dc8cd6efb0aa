//! Kubernetes Events (`events.k8s.io/v1`) about a plan's object: what the reconcile loop did
//! (started, resumed, paused, canceled, succeeded, failed, held by an invalid value, leftovers
//! stopped after a restart), for `kubectl get events` and `kubectl describe`.
//!
//! Events never slow the loop or fail it: [`EventSink::emit`] only queues (a full queue drops the
//! event and counts it), and one background task publishes, each request bounded. They never
//! flood the API server: an event's name is derived from its object's uid, reason and note, so
//! the same event again (in this process or after a restart, a crash loop included) updates one
//! object's `series.count` instead of creating another; and a token bucket (a burst of
//! [`BURST`], then one every [`REFILL`]) drops what exceeds it, with a warning saying how many.

use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Events published at once before the rate applies.
pub const BURST: u32 = 10;
/// Then one more per this long.
pub const REFILL: Duration = Duration::from_secs(6);
const QUEUE: usize = 64;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// `reportingController` of every event.
pub const CONTROLLER: &str = "agent.cattle.io/nodeplan";

/// What happened to a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Started,
    Resumed,
    Paused,
    Canceled,
    /// A canceled or stopped tree may have survivors.
    CanceledWithSurvivors,
    Succeeded,
    Failed,
    /// A pause/cancel value that is neither "true" nor "false" holds the plan (R3).
    InvalidValue,
    /// A previous agent's processes of this plan were stopped before it ran again (R17).
    LeftoversStopped,
    /// Leftovers could not be stopped: the plan is blocked (R17).
    Blocked,
    /// An apply could not start (the interlock, the work directory: a full or read-only disk);
    /// it is tried again with back-off.
    NotStarted,
    /// The API server forbids the agent a verb on its plan objects (a 403): nothing it records
    /// lands until that is granted.
    Refused,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Started => "Started",
            Reason::Resumed => "Resumed",
            Reason::Paused => "Paused",
            Reason::Canceled => "Canceled",
            Reason::CanceledWithSurvivors => "CanceledWithSurvivors",
            Reason::Succeeded => "Succeeded",
            Reason::Failed => "Failed",
            Reason::InvalidValue => "InvalidValue",
            Reason::LeftoversStopped => "LeftoversStopped",
            Reason::Blocked => "Blocked",
            Reason::NotStarted => "NotStarted",
            Reason::Refused => "Refused",
        }
    }

    fn warning(self) -> bool {
        matches!(
            self,
            Reason::CanceledWithSurvivors
                | Reason::Failed
                | Reason::InvalidValue
                | Reason::Blocked
                | Reason::NotStarted
                | Reason::Refused
        )
    }
}

/// The object an event is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Regarding {
    pub api_version: String,
    pub kind: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// One event to publish.
#[derive(Debug, Clone)]
struct Pending {
    regarding: Regarding,
    reason: Reason,
    note: String,
}

/// The name of an event: its object's name, then a hash of what makes it the same event.
pub fn event_name(r: &Regarding, reason: Reason, note: &str) -> String {
    let key = format!("{}\n{}\n{}\n{}", r.uid, r.name, reason.as_str(), note);
    let hash = crate::plan::checksum(key.as_bytes());
    // A name is at most 253 characters; the object's is cut to leave room for the hash.
    let base: String = r.name.chars().take(200).collect();
    format!("{base}.{}", &hash[..16])
}

/// The Event object for a first occurrence.
fn event_object(p: &Pending, instance: &str, now: &str) -> Value {
    let r = &p.regarding;
    json!({
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": event_name(r, p.reason, &p.note), "namespace": r.namespace},
        "eventTime": now,
        "reportingController": CONTROLLER,
        "reportingInstance": instance,
        "action": "Reconcile",
        "reason": p.reason.as_str(),
        "note": p.note.chars().take(1000).collect::<String>(),
        "type": if p.reason.warning() { "Warning" } else { "Normal" },
        "regarding": {"apiVersion": r.api_version, "kind": r.kind, "namespace": r.namespace, "name": r.name, "uid": r.uid},
    })
}

/// A token bucket: `take` says whether one more event may go now.
#[derive(Debug)]
pub struct Bucket {
    tokens: u32,
    last: Instant,
}

impl Bucket {
    pub fn new(now: Instant) -> Bucket {
        Bucket { tokens: BURST, last: now }
    }

    pub fn take(&mut self, now: Instant) -> bool {
        let earned = (now.saturating_duration_since(self.last).as_millis() / REFILL.as_millis()) as u32;
        if earned > 0 {
            self.tokens = (self.tokens + earned).min(BURST);
            self.last += REFILL * earned;
        }
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }
}

/// Queues events for one background publisher.
#[derive(Clone)]
pub struct EventSink {
    tx: mpsc::Sender<Pending>,
}

impl EventSink {
    /// Start the publisher: events go to `client` as `reportingInstance` `instance` (the node).
    pub fn start(client: kube::Client, instance: &str) -> EventSink {
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(publish_all(client, instance.to_string(), rx));
        EventSink { tx }
    }

    /// Queue an event (dropped when the queue is full: the loop never waits for events).
    pub fn emit(&self, regarding: Regarding, reason: Reason, note: impl Into<String>) {
        let _ = self.tx.try_send(Pending { regarding, reason, note: note.into() });
    }
}

async fn publish_all(client: kube::Client, instance: String, mut rx: mpsc::Receiver<Pending>) {
    let gvk = GroupVersionKind::gvk("events.k8s.io", "v1", "Event");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "events");
    let mut bucket = Bucket::new(Instant::now());
    let (mut dropped, mut warned_failure) = (0u64, false);
    let mut counts = Counts::default();
    while let Some(p) = rx.recv().await {
        if !bucket.take(Instant::now()) {
            dropped += 1;
            if dropped == 1 || dropped.is_power_of_two() {
                tracing::warn!("{dropped} Kubernetes events dropped: more than the rate allows");
            }
            continue;
        }
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &p.regarding.namespace, &resource);
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        match tokio::time::timeout(REQUEST_TIMEOUT, publish(&api, &p, &instance, &now, &mut counts)).await {
            Ok(Ok(())) => warned_failure = false,
            Ok(Err(Refused::Forbidden(e))) => {
                // The account may not publish events here (Rancher's per-machine role grants the
                // plan Secret only): say so once and stop asking.
                tracing::warn!(
                    "Kubernetes events are off: the agent may not create events in namespace {} ({e}); \
                     grant create/get/patch on events.k8s.io events to turn them on",
                    p.regarding.namespace
                );
                while rx.recv().await.is_some() {}
                return;
            }
            Ok(Err(Refused::Other(e))) if !warned_failure => {
                warned_failure = true;
                tracing::warn!("cannot publish a Kubernetes event ({e}); events are best effort");
            }
            Err(_) if !warned_failure => {
                warned_failure = true;
                tracing::warn!("cannot publish a Kubernetes event (no answer); events are best effort");
            }
            _ => {}
        }
    }
}

/// Why an event was not published.
enum Refused {
    /// 403: the account may not write events (no use asking again).
    Forbidden(String),
    Other(String),
}

fn refused(e: kube::Error) -> Refused {
    match &e {
        kube::Error::Api(s) if s.code == 403 => Refused::Forbidden(crate::k8s::error_line(&e)),
        _ => Refused::Other(crate::k8s::error_line(&e)),
    }
}

/// The series counts this process last wrote, by event name: the same event again is one PATCH,
/// not a create refused, a read and a PATCH. Bounded; forgotten entries cost the three again.
#[derive(Debug, Default)]
struct Counts(std::collections::HashMap<String, i64>);

impl Counts {
    const MAX: usize = 256;

    fn set(&mut self, name: String, count: i64) {
        if self.0.len() >= Counts::MAX && !self.0.contains_key(&name) {
            self.0.clear();
        }
        self.0.insert(name, count);
    }
}

/// Create the event, or (it exists: the same event again) count one more in its series.
async fn publish(
    api: &Api<DynamicObject>,
    p: &Pending,
    instance: &str,
    now: &str,
    counts: &mut Counts,
) -> Result<(), Refused> {
    let name = event_name(&p.regarding, p.reason, &p.note);
    let series = |count: i64| json!({"series": {"count": count, "lastObservedTime": now}});
    if let Some(count) = counts.0.remove(&name) {
        match api.patch(&name, &PatchParams::default(), &Patch::Merge(&series(count + 1))).await {
            Ok(_) => {
                counts.set(name, count + 1);
                return Ok(());
            }
            // Gone (events expire): created afresh below.
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(refused(e)),
        }
    }
    let obj: DynamicObject =
        serde_json::from_value(event_object(p, instance, now)).map_err(|e| Refused::Other(e.to_string()))?;
    match api.create(&PostParams::default(), &obj).await {
        Ok(_) => {
            counts.set(name, 1);
            return Ok(());
        }
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(refused(e)),
    }
    let old = api.get(&name).await.map_err(refused)?;
    let count = old.data.pointer("/series/count").and_then(Value::as_i64).unwrap_or(1) + 1;
    api.patch(&name, &PatchParams::default(), &Patch::Merge(&series(count))).await.map_err(refused)?;
    counts.set(name, count);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn regarding(uid: &str) -> Regarding {
        Regarding {
            api_version: "agent.cattle.io/v1alpha1".into(),
            kind: "NodePlan".into(),
            namespace: "ns".into(),
            name: "p".into(),
            uid: uid.into(),
        }
    }

    #[test]
    fn the_same_event_has_the_same_name_and_another_does_not() {
        let a = event_name(&regarding("u1"), Reason::Failed, "x");
        assert_eq!(a, event_name(&regarding("u1"), Reason::Failed, "x"));
        assert_ne!(a, event_name(&regarding("u2"), Reason::Failed, "x"), "a recreated object");
        assert_ne!(a, event_name(&regarding("u1"), Reason::Succeeded, "x"));
        assert_ne!(a, event_name(&regarding("u1"), Reason::Failed, "y"));
        let long = Regarding { name: "n".repeat(253), ..regarding("u") };
        assert!(event_name(&long, Reason::Started, "").len() <= 253);
        let p = Pending { regarding: regarding("u1"), reason: Reason::Failed, note: "n".repeat(5000) };
        let o = event_object(&p, "node-a", "2026-11-30T12:00:00.000000Z");
        assert_eq!((o["type"].as_str(), o["note"].as_str().map(str::len)), (Some("Warning"), Some(1000)));
    }

    #[test]
    fn the_bucket_allows_a_burst_then_one_per_refill() {
        let t0 = Instant::now();
        let mut b = Bucket::new(t0);
        assert_eq!((0..BURST + 5).filter(|_| b.take(t0)).count(), BURST as usize);
        assert!(!b.take(t0 + REFILL / 2));
        assert!(b.take(t0 + REFILL));
        assert!(!b.take(t0 + REFILL));
        let later = t0 + REFILL * 100;
        assert_eq!((0..BURST + 5).filter(|_| b.take(later)).count(), BURST as usize, "never more than the burst");
    }
}
