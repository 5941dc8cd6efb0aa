//! Remote mode as a plan source of [`crate::reconcile`]: the Secret's watch stream feeds a
//! `watch` of the latest snapshot, from which the source shows the plan (through the plan-state
//! flow, or the legacy checksum flow of a Secret without `plan-state`) and the pause/cancel values
//! of the running plan (R15); transitions and outcomes are written with resourceVersion-conditional
//! updates (R13). The source owns the Secret and nothing else; the loop owns the rest.
//!
//! The base of a write is the object the agent's own last write returned, unless the watch has
//! delivered a newer event since that write was sent: its own writes never conflict with each
//! other. The watch may deliver the echo of an earlier write of ours after a later one returned
//! (it lags behind the write's answer); such an event carries a resourceVersion the agent has
//! already moved past and is not newer, so it never replaces the newer object (acting on it would
//! see `in-progress` again after `succeeded` was written). An outcome that fails is kept by the
//! loop (its outbox holds the keys computed from its base, [`Unwritten`], so a retry is idempotent)
//! and sent again until it lands or the Secret carries another plan. resourceVersions are compared
//! for equality only (Kubernetes treats them as opaque).

use super::client::{SecretClient, SecretSnapshot};
use super::kept::KeptStore;
use super::wire::{self, Keys};
use crate::apply::{ApplyError, Interrupt};
use crate::events::{EventSink, Reason, Regarding};
use crate::flow::Commit;
use crate::k8s::base::WriteBase;
use crate::k8s::write::{self, Prepared, WriteError};
use crate::metrics::{self, RetryReason, WriteTarget};
use crate::plan::{self, ProbeStatus};
use crate::process::{Owner, Source};
use crate::reconcile::{Claim, Look, Observed, Outcome, PlanSource, Seen, Sent, View, Written};
use futures::StreamExt as _;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::watch;

/// An outcome that did not land yet, as the loop keeps it until it does (or the plan changes).
#[derive(Debug, Clone)]
pub struct Unwritten {
    checksum: String,
    keys: Keys,
    /// The Secret's uid, when read back from the node at start-up (a previous agent's outcome,
    /// R17): written only onto the run it finished, on the Secret it was for.
    restored: Option<String>,
}

/// The watch's latest snapshot, numbered so the source can tell whether it arrived after a write.
type Latest = (u64, Option<SecretSnapshot>);

/// The plan Secret as a plan source. It has one key: the Secret.
pub struct SecretSource {
    client: SecretClient,
    latest: Option<watch::Receiver<Latest>>,
    /// The base of the next write: what our own last write returned, until the watch delivers
    /// something newer.
    base: WriteBase<SecretSnapshot>,
    probe_period: Duration,
    uid: Option<String>,
    /// resourceVersion of our own last write (the legacy flow does not re-apply on its echo).
    last_written_rv: Option<String>,
    has_run_once: bool,
    /// The legacy flow's decision at the last look (its outcome is written from it).
    legacy: Option<wire::LegacyDecision>,
    /// The plan whose ignored annotations were reported.
    noted_legacy: Option<String>,
    /// The id of the plan last looked at, by its checksum (computed once per plan, not per look).
    id: Option<(String, String)>,
    /// The checksum of the plan in the Secret, by resourceVersion ([`SecretSource::checksum_of`]).
    checksum_at: Option<(String, Option<String>)>,
    /// An outcome a previous agent kept on the node, read at the start, for the loop to send once
    /// the watch has listed the Secret.
    restored: Option<Unwritten>,
    /// Where an outcome is kept on the node until it is written (R17).
    kept: KeptStore,
    /// Since when (RFC 3339) and as of when last said, the watch lists no plan Secret.
    absent: Option<(String, std::time::Instant)>,
    /// The last pause/cancel values the running plan saw (kept while the Secret carries another
    /// plan or none: never a change on a guess).
    last_interrupt: Interrupt,
    /// Kubernetes Events regarding the Secret (off in tests that do not ask for them).
    events: Option<EventSink>,
    /// The 403s on the Secret told in a `Refused` Event.
    forbidden_told: crate::k8s::refusals::Told,
    /// The task that feeds `latest` from the watch (from [`PlanSource::start`]).
    pump: Option<crate::AbortOnDrop>,
}

/// The pause/cancel values from the annotations: only valid values count (an invalid value in
/// flight is ignored: never kill on a guess).
fn interrupt_of(s: &SecretSnapshot) -> (Interrupt, Option<String>) {
    let a = wire::annotations(s);
    let cancel = plan::parse_annotation_value(a.canceled) == Ok(true);
    let pause = plan::parse_annotation_value(a.paused) == Ok(true);
    let invalid = plan::resolve_annotations(&a).err().map(|e| e.to_string());
    (Interrupt { pause, cancel, ..Interrupt::default() }, if cancel { None } else { invalid })
}

impl SecretSource {
    pub fn new(client: SecretClient, probe_period: Duration) -> SecretSource {
        let kept = KeptStore::new(None, client.secret_ref());
        SecretSource {
            client,
            latest: None,
            base: WriteBase::default(),
            probe_period,
            uid: None,
            last_written_rv: None,
            has_run_once: false,
            legacy: None,
            noted_legacy: None,
            id: None,
            checksum_at: None,
            restored: None,
            kept,
            last_interrupt: Interrupt::default(),
            events: None,
            forbidden_told: Default::default(),
            pump: None,
            absent: None,
        }
    }

    /// Say when the watch lists no plan Secret (not created yet, or the connection info names
    /// another): when it starts, every minute while it lasts (at the loop's looks), and when the
    /// Secret appears; `nodeplan status` shows it meanwhile.
    fn note_presence(&mut self) {
        let absent = self.latest.as_ref().is_some_and(|l| matches!(&*l.borrow(), (seq, None) if *seq > 0));
        let what = || format!("secret {}", self.client.describe());
        let now = std::time::Instant::now();
        match (absent, &mut self.absent) {
            (true, None) => {
                tracing::warn!(
                    "the plan Secret {} does not exist: nothing to apply until it is created (Rancher creates it when the machine registers; check namespace and secretName in the connection info)",
                    self.client.describe()
                );
                let what = what();
                crate::board::source_problem(&what, "the Secret does not exist");
                crate::metrics::source_problem(&what, "missing", true);
                self.absent = Some((crate::now_rfc3339(), now));
            }
            (true, Some((since, told))) if now.duration_since(*told) >= crate::k8s::refusals::RETELL => {
                tracing::warn!("the plan Secret {} still does not exist (since {since})", self.client.describe());
                *told = now;
            }
            (false, Some((since, _))) => {
                tracing::info!("the plan Secret {} exists now (it did not since {since})", self.client.describe());
                let what = what();
                crate::board::source_problem(&what, "");
                crate::metrics::source_problem(&what, "missing", false);
                self.absent = None;
            }
            _ => {}
        }
    }

    /// Keep an outcome on the node (in `dir`) until it is written, so a restart writes it instead of
    /// running the plan again (R17).
    pub fn with_kept_outcomes(mut self, dir: Option<&std::path::Path>) -> SecretSource {
        self.kept = KeptStore::new(dir, self.client.secret_ref());
        self
    }

    /// Publish Kubernetes Events regarding the Secret, reported as coming from `node`.
    pub fn with_events(mut self, node: &str) -> SecretSource {
        self.events = Some(EventSink::start(self.client.kube_client(), node));
        self
    }

    /// The newest view of the Secret: our own last write's object, unless the watch delivered
    /// an event after that write was sent that is not one the agent has already moved past.
    /// The checksum of the plan `s` carries, computed once per resourceVersion: the watch events
    /// of a running plan (a cancel, the agent's own writes) are no reason to hash it again.
    fn checksum_of(&mut self, s: &SecretSnapshot) -> Option<String> {
        match &self.checksum_at {
            Some((rv, checksum)) if *rv == s.resource_version => checksum.clone(),
            _ => {
                let checksum = wire::plan_checksum(s);
                self.checksum_at = Some((s.resource_version.clone(), checksum.clone()));
                checksum
            }
        }
    }

    fn current(&self) -> Option<SecretSnapshot> {
        let (seq, watched) = self.latest.as_ref().map(|l| l.borrow().clone()).unwrap_or_default();
        self.base.current(seq, watched, |s| &s.resource_version)
    }

    /// `snap` is the newest object (tests: what a write sent at `sent` returned, replacing `older`).
    #[cfg(all(test, unix))]
    fn remember(&mut self, snap: SecretSnapshot, sent: u64, older: &str) {
        self.uid = Some(snap.uid.clone());
        self.base.remember(snap, sent, older, |s| &s.resource_version);
    }

    /// Write `keys` conditionally on the current base through the one writer ([`crate::k8s::write`]):
    /// on a conflict an outcome (`reapply`) is written again while the Secret carries the same
    /// plan; a state transition decided from the old snapshot is abandoned (R13).
    async fn write(&mut self, checksum: &str, keys: Keys, reapply: bool) -> Written {
        let Some(base) = self.current() else { return Written::Abandoned };
        let mut target = SecretWrite {
            client: &self.client,
            checksum,
            keys,
            latest: self.latest.as_ref(),
            base: &mut self.base,
            uid: &mut self.uid,
            last_written_rv: &mut self.last_written_rv,
        };
        let written = write::write(&mut target, base, reapply).await;
        if matches!(written, Written::Failed { .. }) {
            self.tell_forbidden();
        }
        written
    }

    /// A 403 on the Secret that began since the last look: told once in a `Refused` Event.
    fn tell_forbidden(&mut self) {
        for line in self.forbidden_told.news(&crate::k8s::liveness::forbidden()) {
            self.event(&(), Reason::Refused, &line);
        }
    }

    /// Write a run's outcome, which must not be lost: recorded on the node (R17) while it is sent,
    /// and handed to the loop to keep when the write fails ([`PlanSource::resend`]). Not one after
    /// the other: a restart runs the plan again only when neither landed, and the record's clear
    /// follows its save on the disk lane.
    async fn write_outcome(&mut self, checksum: &str, keys: Keys) -> Sent<Unwritten> {
        let (kept, uid) = (self.kept.clone(), self.current().map(|s| s.uid));
        let save = async {
            if let Some(uid) = uid {
                kept.save(&uid, checksum, &keys).await;
            }
        };
        let unwritten = Unwritten { checksum: checksum.to_string(), keys: keys.clone(), restored: None };
        // `save` first: its first step hands the record to the lane before the write starts.
        tokio::join!(save, self.send(unwritten)).1
    }

    /// Send an outcome; its record on the node is forgotten once it lands or no longer applies
    /// (a retry is not recorded again: the record is there already).
    async fn send(&mut self, u: Unwritten) -> Sent<Unwritten> {
        let w = self.write(&u.checksum, u.keys.clone(), true).await;
        if matches!(w, Written::Failed { .. }) {
            return (w, Some(u));
        }
        self.kept.clear();
        (w, None)
    }
}

/// One write of data keys to the plan Secret, for [`crate::k8s::write`].
struct SecretWrite<'a> {
    client: &'a SecretClient,
    checksum: &'a str,
    keys: Keys,
    latest: Option<&'a watch::Receiver<Latest>>,
    base: &'a mut WriteBase<SecretSnapshot>,
    uid: &'a mut Option<String>,
    last_written_rv: &'a mut Option<String>,
}

impl write::Target for SecretWrite<'_> {
    type Object = SecretSnapshot;
    type Payload = Keys;
    const METRIC: WriteTarget = WriteTarget::Secret;

    fn what(&self) -> String {
        format!("secret {}", self.client.describe())
    }

    fn belongs(&self, o: &SecretSnapshot) -> bool {
        wire::plan_checksum(o).as_deref() == Some(self.checksum)
    }

    fn prepare(&self, base: &SecretSnapshot) -> Prepared<Keys> {
        let keys = wire::changed_only(base, wire::spelled_for(base, self.keys.clone()));
        if keys.is_empty() { Prepared::Nothing } else { Prepared::Send(keys) }
    }

    async fn send(&self, base: &SecretSnapshot, keys: Keys) -> Result<SecretSnapshot, WriteError> {
        self.client.update_data(base, &keys).await
    }

    async fn read(&self) -> Result<Option<SecretSnapshot>, String> {
        self.client.get().await
    }

    fn seq(&self) -> u64 {
        self.latest.map_or(0, |l| l.borrow().0)
    }

    fn remember(&mut self, new: SecretSnapshot, sent: u64, older: &SecretSnapshot, written: bool) {
        if written {
            *self.last_written_rv = Some(new.resource_version.clone());
        }
        *self.uid = Some(new.uid.clone());
        self.base.remember(new, sent, &older.resource_version, |s| &s.resource_version);
    }
}

impl PlanSource for SecretSource {
    type Key = ();
    type Kept = Unwritten;

    async fn changed(&mut self) -> bool {
        match self.latest.as_mut() {
            Some(l) => l.changed().await.is_ok(),
            None => std::future::pending().await,
        }
    }

    async fn keys(&mut self) -> Vec<()> {
        vec![()]
    }

    /// Watch the Secret, and take up an outcome a previous agent kept on the node.
    async fn start(&mut self) {
        let (tx, rx) = watch::channel::<Latest>((0, None));
        let stream = self.client.watch();
        self.pump = Some(crate::AbortOnDrop(tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            let mut seq = 0;
            while let Some(s) = stream.next().await {
                seq += 1;
                let _ = tx.send((seq, s));
            }
        })));
        self.latest = Some(rx);
        if let Some(k) = self.kept.load().await {
            tracing::info!(
                "an outcome of plan {} was kept on the node by a previous agent; writing it before anything runs",
                plan::short(&k.checksum)
            );
            self.restored = Some(Unwritten { checksum: k.checksum, keys: k.keys, restored: Some(k.uid) });
        }
    }

    async fn look(&mut self, _: &()) -> Seen {
        self.note_presence();
        let Some(snap) = self.current() else { return Seen::Nothing };
        // UID guard: a recreated Secret starts over.
        if self.uid.as_deref() != Some(snap.uid.as_str()) {
            if self.uid.is_some() {
                tracing::info!("the plan secret was recreated (uid {}); starting over", snap.uid);
                self.base = WriteBase::default();
                self.last_written_rv = None;
                self.has_run_once = false;
            }
            self.uid = Some(snap.uid.clone());
        }
        self.tell_forbidden();
        if let Some(p) = wire::probe_period(&snap) {
            self.probe_period = p;
        }
        let (Some(raw), Some(checksum)) = (snap.data.get(wire::PLAN), self.checksum_of(&snap)) else {
            return Seen::Nothing;
        };
        let vp = match plan::parse(raw) {
            Ok(v) => v,
            Err(e) => return Seen::Bad { error: format!("plan {}: {e}", plan::short(&checksum)), checksum },
        };
        let total = vp.plan.instructions.len();
        let id = match &self.id {
            Some((c, id)) if *c == checksum => id.clone(),
            _ => {
                let id = vp.id();
                self.id = Some((checksum.clone(), id.clone()));
                id
            }
        };
        let mut retry_in = None;
        let (view, saved_key) = match wire::plan_state(&snap) {
            Some(state) => (View::Flow(wire::flow_snapshot(&snap, &checksum, state, total)), wire::APPLIED_OUTPUT),
            None => {
                let a = wire::annotations(&snap);
                let annotated = a.paused.is_some() || a.canceled.is_some();
                let own_echo = self.last_written_rv.as_deref() == Some(snap.resource_version.as_str());
                let d = wire::legacy_decide(&snap, &checksum, self.has_run_once, own_echo, chrono::Utc::now());
                if annotated && self.noted_legacy.as_deref() != Some(checksum.as_str()) {
                    tracing::warn!(
                        "plan {id}: pause/cancel annotations are ignored without plan-state (checksum flow)"
                    );
                    self.noted_legacy = Some(checksum.clone());
                }
                let saved = if d.was_failed_plan { wire::FAILED_OUTPUT } else { wire::APPLIED_OUTPUT };
                self.legacy = Some(d);
                retry_in = d.retry_in;
                (View::Legacy { one_time: d.needs_apply }, saved)
            }
        };
        Seen::Plan(Box::new(Look {
            label: format!("plan {id}"),
            place: {
                let r = self.client.secret_ref();
                format!("secret {}/{}", r.namespace, r.name)
            },
            checksum,
            view,
            attempt: wire::attempt(&snap),
            begin_attempt: 1,
            one_time_output: wire::one_time_output(&snap, saved_key),
            periodic_output: wire::periodic_output(&snap),
            probe_statuses: wire::probe_statuses(&snap),
            retry_in,
            stop_after: None,
            preflight: Vec::new(),
            checked: None,
            plan: vp,
        }))
    }

    async fn commit(&mut self, _: &(), look: &Look, commit: &Commit) -> Written {
        let Some(base) = self.current() else { return Written::Abandoned };
        let keys = match commit {
            Commit::Begin { resume } => wire::begin_keys(&base, resume.as_ref()),
            Commit::Resume(t) | Commit::Record(t) => wire::transition_keys(t),
        };
        let w = self.write(&look.checksum, keys, false).await;
        if w == Written::Done
            && matches!(commit, Commit::Begin { .. })
            && let Some(s) = self.current()
        {
            tracing::info!(
                "{}: in-progress (revision {})",
                look.label,
                String::from_utf8_lossy(s.data.get(wire::PLAN_REVISION).map(Vec::as_slice).unwrap_or_default())
            );
        }
        w
    }

    async fn record(&mut self, _: &(), look: &Look, outcome: Outcome<'_>) -> Sent<Unwritten> {
        // Set by a run, not by a look: the loop looks at the Secret while another source's plan
        // runs, and the legacy flow's first run after a start must still happen.
        self.has_run_once = true;
        let Some(base) = self.current() else { return (Written::Abandoned, None) };
        let now = chrono::Utc::now();
        let mut keys = match (&outcome.record, &look.view) {
            (Some(rec), _) => wire::record_keys(&base, &look.checksum, rec, now),
            (None, View::Legacy { one_time }) => {
                let d = self.legacy.unwrap_or(wire::LegacyDecision {
                    needs_apply: *one_time,
                    was_failed_plan: false,
                    retry_in: None,
                });
                let output = if *one_time {
                    outcome.result.one_time_output.clone()
                } else {
                    wire::one_time_output(&base, wire::APPLIED_OUTPUT)
                };
                wire::legacy_keys(
                    &base,
                    &look.checksum,
                    d,
                    outcome.result.one_time_succeeded,
                    &output,
                    &outcome.result.periodic_output,
                    now,
                )
            }
            (None, View::Flow(_)) => Keys::new(),
        };
        match &outcome.probes {
            Some(p) => keys.extend(wire::probe_keys(p)),
            // Rancher's store deletes `probe-statuses` at every assignment and counts a plan's
            // probes as passed only once the key is back: a plan without probes says `{}`, as
            // system-agent does.
            None if look.plan.plan.probes.is_empty() && !wire::says_no_probes(&base) => {
                keys.extend(wire::probe_keys(&BTreeMap::new()))
            }
            None => {}
        }
        wire::failure_key(&mut keys, outcome.failure.as_ref());
        self.write_outcome(&look.checksum, keys).await
    }

    async fn not_started(&mut self, _: &(), _: &Look, _: &ApplyError) -> Option<Written> {
        // As system-agent: an apply that could not start writes nothing (an in-progress plan
        // stays in-progress) and is retried with back-off.
        None
    }

    async fn write_probes(&mut self, _: &(), checksum: &str, statuses: BTreeMap<String, ProbeStatus>) -> Written {
        self.write(checksum, wire::probe_keys(&statuses), true).await
    }

    async fn restored(&mut self, _: &()) -> Option<Unwritten> {
        // Read back from the node: judged once the watch has listed the Secret, not before.
        if self.latest.as_ref().is_none_or(|l| l.borrow().0 == 0) {
            return None;
        }
        self.restored.take()
    }

    async fn resend(&mut self, _: &(), p: Unwritten) -> Sent<Unwritten> {
        let current = self.current();
        if current.as_ref().and_then(wire::plan_checksum).as_deref() != Some(p.checksum.as_str()) {
            tracing::warn!("dropping an unwritten outcome: the secret now carries another plan");
            self.kept.clear();
            return (Written::Abandoned, None);
        }
        if let (Some(uid), Some(s)) = (&p.restored, &current) {
            // A previous agent's outcome lands only on the run it finished: the same Secret, still
            // in progress (a Secret without plan-state: still carrying that plan).
            let same_run = *uid == s.uid && wire::plan_state(s).is_none_or(|st| st == plan::PlanState::InProgress);
            if !same_run {
                tracing::info!(
                    "dropping the outcome kept on the node for plan {}: the secret was reassigned or recreated since",
                    plan::short(&p.checksum)
                );
                self.kept.clear();
                return (Written::Abandoned, None);
            }
        }
        metrics::write_retried(WriteTarget::Secret, RetryReason::Error);
        self.send(p).await
    }

    async fn set_blocked(&mut self, _: &(), _: Option<&str>) {}

    fn interrupt(&mut self, _: &(), look: &Look) -> Observed {
        if matches!(look.view, View::Legacy { .. }) {
            return Observed::default();
        }
        let mut note = None;
        if let Some(s) = self.current()
            && self.checksum_of(&s).as_deref() == Some(look.checksum.as_str())
        {
            let (i, invalid) = interrupt_of(&s);
            self.last_interrupt = i;
            note = invalid.map(|m| format!("{m}; ignored while the plan runs (a valid value takes effect)"));
        }
        Observed { interrupt: self.last_interrupt, note }
    }

    fn owner(&self, _: &(), look: &Look) -> Owner {
        Owner::remote(&look.checksum)
    }

    fn claim(&self, owner: &Owner) -> Claim<()> {
        if owner.belongs_to(Source::Remote) { Claim::Plan(()) } else { Claim::NotMine }
    }

    fn event(&mut self, _: &(), reason: Reason, note: &str) {
        let (Some(sink), Some(uid)) = (&self.events, &self.uid) else { return };
        let secret = self.client.secret_ref();
        let regarding = Regarding {
            api_version: "v1".into(),
            kind: "Secret".into(),
            namespace: secret.namespace.clone(),
            name: secret.name.clone(),
            uid: uid.clone(),
        };
        sink.emit(regarding, reason, note);
    }

    /// The watch delivers every change: the loop looks again without one only this rarely
    /// (probes and periodic instructions keep their own timers).
    fn period(&self) -> Duration {
        crate::reconcile::WATCHED_PERIOD
    }

    fn probe_period(&self, _: &Self::Key) -> Duration {
        self.probe_period
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use base64::Engine as _;
    use http::{Request, Response};
    use kube::client::Body;
    use std::collections::BTreeMap;

    const PLAN: &[u8] = br#"{"instructions":[{"name":"a","command":"true"}]}"#;

    fn secret_json(rv: &str, state: &str) -> serde_json::Value {
        let b64 = |v: &[u8]| base64::engine::general_purpose::STANDARD.encode(v);
        serde_json::json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "p", "namespace": "n", "uid": "u", "resourceVersion": rv},
            "data": {"plan": b64(PLAN), "plan-state": b64(state.as_bytes())},
        })
    }

    fn respond(code: u16, v: &serde_json::Value) -> Response<Body> {
        Response::builder().status(code).body(Body::from(serde_json::to_vec(v).unwrap_or_default())).unwrap()
    }

    fn conflict() -> serde_json::Value {
        serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Conflict", "code": 409, "message": "conflict"})
    }

    /// R13: a state transition decided from a snapshot that is no longer current is abandoned on a
    /// conflict (the orchestrator reset the plan meanwhile: the resume must not overwrite that),
    /// while an outcome is re-applied, on the fresh resourceVersion, when the plan is unchanged.
    #[tokio::test]
    async fn a_conflicting_transition_is_abandoned_and_an_outcome_is_reapplied() {
        for reapply in [false, true] {
            let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let client = SecretClient::new(
                kube::Client::new(svc, "n"),
                super::super::client::SecretRef { namespace: "n".into(), name: "p".into() },
            );
            let mut source = SecretSource::new(client, Duration::from_secs(5));
            let base = SecretSnapshot {
                uid: "u".into(),
                resource_version: "5".into(),
                data: BTreeMap::from([
                    ("plan".to_string(), PLAN.to_vec()),
                    ("plan-state".to_string(), b"paused".to_vec()),
                ]),
                ..SecretSnapshot::default()
            };
            let mut keys = Keys::new();
            keys.insert("plan-state".into(), Some(b"in-progress".to_vec()));
            let checksum = plan::checksum(PLAN);
            let server = async move {
                let mut handle = std::pin::pin!(handle);
                let mut writes = Vec::new();
                let (req, send) = handle.as_mut().next_request().await.expect("a first update");
                assert_eq!(req.method(), http::Method::PUT);
                writes.push(req);
                send.send_response(respond(409, &conflict()));
                let (req, send) = handle.as_mut().next_request().await.expect("a GET after the conflict");
                assert_eq!(req.method(), http::Method::GET);
                // The orchestrator reset the (same) plan to pending meanwhile.
                send.send_response(respond(200, &secret_json("7", "pending")));
                if reapply {
                    let (req, send) = handle.as_mut().next_request().await.expect("the re-applied update");
                    let body = http_body_util::BodyExt::collect(req.into_body()).await.unwrap().to_bytes();
                    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    assert_eq!(body["metadata"]["resourceVersion"], "7", "re-applied on the fresh version");
                    send.send_response(respond(200, &secret_json("8", "in-progress")));
                }
                writes.len()
            };
            source.remember(base, 0, "4");
            let conflicts = "nodeplan_write_retries_total{target=\"secret\",reason=\"conflict\"}";
            let before = crate::metrics::sample(conflicts);
            let (written, _) = tokio::join!(source.write(&checksum, keys, reapply), server);
            if reapply {
                assert!(crate::metrics::sample(conflicts) > before, "the write on the fresh object is counted");
            }
            match (reapply, written) {
                (false, Written::Abandoned) => {
                    let rv = source.current().map(|s| s.resource_version);
                    assert_eq!(rv.as_deref(), Some("7"), "nothing older than the fresh read is acted on");
                }
                (true, Written::Done) => {
                    let rv = source.current().map(|s| s.resource_version);
                    assert_eq!(rv.as_deref(), Some("8"), "the next write's base is what this one returned");
                }
                (r, w) => panic!("reapply={r}: {w:?}"),
            }
        }
    }

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    fn mock_source() -> (SecretSource, Handle) {
        let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = SecretClient::new(
            kube::Client::new(svc, "n"),
            super::super::client::SecretRef { namespace: "n".into(), name: "p".into() },
        );
        (SecretSource::new(client, Duration::from_secs(5)), handle)
    }

    fn snap(rv: &str, state: &str) -> SecretSnapshot {
        SecretSnapshot {
            uid: "u".into(),
            resource_version: rv.into(),
            data: BTreeMap::from([
                ("plan".to_string(), PLAN.to_vec()),
                ("plan-state".to_string(), state.as_bytes().to_vec()),
            ]),
            ..SecretSnapshot::default()
        }
    }

    fn state_keys(state: &str) -> Keys {
        Keys::from([("plan-state".to_string(), Some(state.as_bytes().to_vec()))])
    }

    /// The next request, which must be an update (PUT): its resourceVersion precondition, and the
    /// responder.
    async fn next_write(
        handle: &mut std::pin::Pin<&mut Handle>,
    ) -> (String, tower_test::mock::SendResponse<Response<Body>>) {
        let (req, send) = handle.as_mut().next_request().await.expect("an update");
        assert_eq!(req.method(), http::Method::PUT);
        let body = http_body_util::BodyExt::collect(req.into_body()).await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        (body["metadata"]["resourceVersion"].as_str().unwrap_or_default().to_string(), send)
    }

    fn rv(source: &SecretSource) -> Option<String> {
        source.current().map(|s| s.resource_version)
    }

    /// The fleet's 409s: the agent's own writes never conflict with each other. Two successive
    /// writes (in-progress, then succeeded) while the watch delivers nothing: the second one's
    /// precondition is what the first one returned, not the watch's (older) snapshot. When the
    /// watch then delivers the first write's echo late, the newer object stays the base; the echo
    /// of the second write, and anything newer, are taken as they come.
    #[tokio::test]
    async fn a_second_write_is_based_on_what_the_first_returned() {
        let (mut source, handle) = mock_source();
        let (tx, rx) = watch::channel::<Latest>((1, Some(snap("5", "pending"))));
        source.latest = Some(rx);
        let checksum = plan::checksum(PLAN);
        let server = async move {
            let mut handle = std::pin::pin!(handle);
            let (first, send) = next_write(&mut handle).await;
            send.send_response(respond(200, &secret_json("6", "in-progress")));
            let (second, send) = next_write(&mut handle).await;
            send.send_response(respond(200, &secret_json("7", "succeeded")));
            (first, second)
        };
        let writes = async {
            let w1 = source.write(&checksum, state_keys("in-progress"), false).await;
            let w2 = source.write(&checksum, state_keys("succeeded"), true).await;
            (w1, w2)
        };
        let ((w1, w2), (first, second)) = tokio::join!(writes, server);
        assert_eq!((w1, w2), (Written::Done, Written::Done));
        assert_eq!(first, "5", "the first write is based on the watch's snapshot");
        assert_eq!(second, "6", "the second write is based on the first one's answer");
        assert_eq!(rv(&source).as_deref(), Some("7"));
        // The watch lags: the echo of the first write arrives after the second one returned. It is
        // not newer (the agent based a write on it already): `succeeded` stays the view.
        tx.send((2, Some(snap("6", "in-progress")))).unwrap();
        assert_eq!(rv(&source).as_deref(), Some("7"), "a late echo of an earlier write is not newer");
        assert_eq!(source.current().map(|s| s.data["plan-state"].clone()), Some(b"succeeded".to_vec()));
        tx.send((3, Some(snap("7", "succeeded")))).unwrap();
        assert_eq!(rv(&source).as_deref(), Some("7"));
        // Someone else's write is taken as soon as the watch delivers it.
        tx.send((4, Some(snap("9", "pending")))).unwrap();
        assert_eq!(rv(&source).as_deref(), Some("9"));
    }

    /// An event the watch delivers while a write is in flight (another writer's, landing right
    /// after ours) is newer than the write's answer: a cancel set then is seen at once, not at the
    /// watch's next event.
    #[tokio::test]
    async fn an_event_delivered_during_a_write_is_newer_than_its_answer() {
        let (mut source, handle) = mock_source();
        let (tx, rx) = watch::channel::<Latest>((1, Some(snap("5", "pending"))));
        source.latest = Some(rx);
        let checksum = plan::checksum(PLAN);
        let server = async move {
            let mut handle = std::pin::pin!(handle);
            let (base, send) = next_write(&mut handle).await;
            let mut canceled = snap("8", "in-progress");
            canceled.annotations.insert(plan::ANNOTATION_CANCELED.into(), "true".into());
            tx.send((2, Some(canceled))).unwrap();
            send.send_response(respond(200, &secret_json("7", "in-progress")));
            (base, tx)
        };
        let (w, (base, _tx)) = tokio::join!(source.write(&checksum, state_keys("in-progress"), false), server);
        assert_eq!((w, base.as_str()), (Written::Done, "5"));
        assert_eq!(rv(&source).as_deref(), Some("8"));
        assert!(interrupt_of(&source.current().unwrap()).0.cancel);
    }

    /// HTTP 429 with the server's hint in its Status body (`details.retryAfterSeconds`): the write
    /// fails with that hint for the loop (which waits it out instead of its own back-off), and an
    /// outcome is kept for the retry.
    #[tokio::test]
    async fn a_429_hands_the_servers_retry_after_to_the_loop() {
        let (mut source, handle) = mock_source();
        source.remember(snap("5", "in-progress"), 0, "4");
        let server = async move {
            let mut handle = std::pin::pin!(handle);
            let (base, send) = next_write(&mut handle).await;
            let status = serde_json::json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "reason": "TooManyRequests", "code": 429, "message": "slow down",
                "details": {"retryAfterSeconds": 7}
            });
            send.send_response(respond(429, &status));
            base
        };
        let checksum = plan::checksum(PLAN);
        let ((w, kept), base) = tokio::join!(source.write_outcome(&checksum, state_keys("succeeded")), server);
        assert_eq!(base, "5");
        match w {
            Written::Failed { retry_after, .. } => assert_eq!(retry_after, Some(Duration::from_secs(7))),
            other => panic!("{other:?}"),
        }
        assert!(kept.is_some(), "the outcome is handed to the loop to keep for the retry");
    }

    /// A kept outcome sent again (by the loop, from its outbox) counts as a retry after an error.
    #[tokio::test]
    async fn a_kept_outcome_written_again_is_counted_as_a_retry() {
        let (mut source, handle) = mock_source();
        source.remember(snap("5", "in-progress"), 0, "4");
        let errors = "nodeplan_write_retries_total{target=\"secret\",reason=\"error\"}";
        let before = crate::metrics::sample(errors);
        let server = async move {
            let mut handle = std::pin::pin!(handle);
            let (_, send) = next_write(&mut handle).await;
            send.send_response(respond(500, &serde_json::json!({"kind": "Status", "code": 500, "message": "down"})));
            let (_, send) = next_write(&mut handle).await;
            send.send_response(respond(200, &secret_json("6", "succeeded")));
        };
        let checksum = plan::checksum(PLAN);
        let client = async {
            let (first, kept) = source.write_outcome(&checksum, state_keys("succeeded")).await;
            assert!(matches!(first, Written::Failed { .. }), "{first:?}");
            assert_eq!(crate::metrics::sample(errors), before, "a first attempt is no retry");
            source.resend(&(), kept.expect("kept for the retry")).await
        };
        let ((w, kept), ()) = tokio::join!(client, server);
        assert!(kept.is_none(), "nothing is kept once it landed");
        assert_eq!(w, Written::Done);
        assert!(crate::metrics::sample(errors) > before);
    }

    /// The API server's own throttling (max-in-flight, priority and fairness) answers 429 with a
    /// `Retry-After` header and a plain-text body. kube keeps only the body of an error answer, so
    /// that hint is not seen: the write fails without one and the loop's own back-off applies.
    #[tokio::test]
    async fn a_429_with_the_hint_only_in_a_header_falls_back_to_the_back_off() {
        let (mut source, handle) = mock_source();
        source.remember(snap("5", "in-progress"), 0, "4");
        let server = async move {
            let mut handle = std::pin::pin!(handle);
            let (_, send) = next_write(&mut handle).await;
            let r = Response::builder()
                .status(429)
                .header("Retry-After", "7")
                .header("Content-Type", "text/plain; charset=utf-8")
                .body(Body::from(b"Too many requests, please try again later.\n".to_vec()))
                .unwrap();
            send.send_response(r);
        };
        let checksum = plan::checksum(PLAN);
        let ((w, _), ()) = tokio::join!(source.write_outcome(&checksum, state_keys("succeeded")), server);
        match w {
            Written::Failed { retry_after, .. } => assert_eq!(retry_after, None),
            other => panic!("{other:?}"),
        }
    }
}
