//! The remote-mode reconcile loop: the Secret's watch stream feeds a `watch` of the latest
//! snapshot; each reconcile decides from it (through [`crate::flow`] or the legacy checksum flow),
//! runs the applyinator with interrupts mapped from the same stream (R15), and writes outcomes with
//! resourceVersion-conditional merge patches (R13). A write that fails is kept and retried with
//! backoff until it lands; the agent never exits because the API server is slow, down or
//! conflicting.

use super::client::{SecretClient, SecretSnapshot, WriteError};
use super::wire::{self, Keys};
use crate::apply::{
    AgentExit, ApplyInput, ApplyResult, Applyinator, Interrupt, Interruption, LogObserver, update_interrupt,
};
use crate::flow::{self, Decision, RunPlan};
use crate::plan::{self, Hold, ValidPlan};
use crate::probe::Prober;
use crate::process::{Owner, Source};
use futures::StreamExt as _;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Every API call is bounded: kube has no read timeout of its own.
const API_TIMEOUT: Duration = Duration::from_secs(15);
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// A write that could not land yet; kept until it does (or the plan changes).
#[derive(Debug, Clone)]
struct Pending {
    checksum: String,
    keys: Keys,
}

enum Written {
    Done(SecretSnapshot),
    /// The Secret carries another plan now (or is gone): the write no longer applies.
    Abandoned,
    Failed(String),
}

/// What the loop does after a reconcile.
enum Next {
    /// Wait for a change or the probe period.
    Wait,
    After(Duration),
    Stop,
}

pub struct RemoteAgent {
    client: SecretClient,
    app: Arc<Applyinator>,
    prober: Arc<Prober>,
    probe_period: Duration,
    uid: Option<String>,
    last_applied_rv: Option<u64>,
    /// The newest resourceVersion read directly (after a conflict).
    seen_rv: Option<u64>,
    has_run_once: bool,
    warned: HashSet<String>,
    invalid_backoff: Option<Duration>,
    write_backoff: Option<Duration>,
    apply_backoff: Option<Duration>,
    pending: Option<Pending>,
    blocked: Option<String>,
    incomplete: Option<String>,
}

fn doubled(b: Option<Duration>) -> Duration {
    b.map_or(Duration::from_secs(1), |b| (b * 2).min(MAX_BACKOFF))
}

/// The interrupt a running plan sees from the annotations: only valid values count (an invalid
/// value in flight is ignored: never kill on a guess).
fn interrupt_of(s: &SecretSnapshot) -> (Interrupt, Option<String>) {
    let a = wire::annotations(s);
    let cancel = plan::parse_annotation_value(a.canceled) == Ok(true);
    let pause = plan::parse_annotation_value(a.paused) == Ok(true);
    let invalid = plan::resolve_annotations(&a).err().map(|e| e.to_string());
    (Interrupt { pause, cancel, shutdown: false }, if cancel { None } else { invalid })
}

impl RemoteAgent {
    pub fn new(
        client: SecretClient,
        app: Arc<Applyinator>,
        prober: Arc<Prober>,
        probe_period: Duration,
    ) -> RemoteAgent {
        RemoteAgent {
            client,
            app,
            prober,
            probe_period,
            uid: None,
            last_applied_rv: None,
            seen_rv: None,
            has_run_once: false,
            warned: HashSet::new(),
            invalid_backoff: None,
            write_backoff: None,
            apply_backoff: None,
            pending: None,
            blocked: None,
            incomplete: None,
        }
    }

    fn warn_once(&mut self, msg: String) {
        if self.warned.insert(msg.clone()) {
            tracing::warn!("{msg}");
        }
    }

    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) -> AgentExit {
        // R17: leftovers of a previous agent are stopped before any plan runs.
        self.recover().await;
        let (snap_tx, mut snap_rx) = watch::channel::<Option<SecretSnapshot>>(None);
        let stream = self.client.watch();
        let pump = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(s) = stream.next().await {
                let _ = snap_tx.send(s);
            }
        });
        let mut delay: Option<Duration> = None;
        loop {
            if *shutdown.borrow() {
                break;
            }
            tokio::select! {
                r = snap_rx.changed() => if r.is_err() { break },
                _ = tokio::time::sleep(delay.unwrap_or(self.probe_period)) => {}
                _ = shutdown.changed() => continue,
            }
            let Some(snap) = snap_rx.borrow_and_update().clone() else {
                delay = None;
                continue;
            };
            match self.reconcile(snap, &snap_rx, &shutdown).await {
                Next::Wait => delay = None,
                Next::After(d) => delay = Some(d),
                Next::Stop => break,
            }
        }
        pump.abort();
        match self.incomplete.take() {
            Some(e) => AgentExit::Incomplete(e),
            None => AgentExit::Clean,
        }
    }

    async fn recover(&mut self) {
        for r in self.app.supervisor().recover(|rec| rec.owner.belongs_to(Source::Remote)).await {
            if let Some(why) = r.hold_reason() {
                tracing::error!("{why}; no remote plan runs until this is resolved");
                self.blocked = Some(why);
                return;
            }
        }
        self.blocked = None;
    }

    /// Write `keys` conditionally on `base`'s resourceVersion. On a conflict read again: an
    /// outcome (`reapply`) is re-applied if the plan is unchanged, a state transition decided from
    /// the old snapshot is abandoned so the new one is decided afresh (R13: a resume never
    /// overwrites an update made meanwhile).
    async fn write(&mut self, base: &SecretSnapshot, checksum: &str, keys: Keys, reapply: bool) -> Written {
        let mut base = base.clone();
        for _ in 0..8 {
            let keys = wire::changed_only(&base, keys.clone());
            if keys.is_empty() {
                return Written::Done(base);
            }
            match tokio::time::timeout(API_TIMEOUT, self.client.patch_data(&base.resource_version, &keys)).await {
                Ok(Ok(new)) => {
                    self.last_applied_rv = new.resource_version.parse().ok();
                    self.uid = Some(new.uid.clone());
                    return Written::Done(new);
                }
                Ok(Err(WriteError::Conflict)) => match tokio::time::timeout(API_TIMEOUT, self.client.get()).await {
                    Ok(Ok(Some(fresh))) => {
                        // Never act on anything older than what was just read.
                        self.seen_rv = fresh.resource_version.parse().ok().max(self.seen_rv);
                        if !reapply || wire::plan_checksum(&fresh).as_deref() != Some(checksum) {
                            return Written::Abandoned;
                        }
                        base = fresh;
                    }
                    Ok(Ok(None)) => return Written::Abandoned,
                    Ok(Err(e)) => return Written::Failed(e),
                    Err(_) => return Written::Failed("timed out reading the secret".into()),
                },
                Ok(Err(WriteError::NotFound)) => return Written::Abandoned,
                Ok(Err(e)) => return Written::Failed(e.to_string()),
                Err(_) => return Written::Failed("timed out writing the secret".into()),
            }
        }
        Written::Failed("the secret kept changing under every write".into())
    }

    /// Write an outcome that must not be lost: kept and retried until it lands.
    async fn write_outcome(&mut self, base: &SecretSnapshot, checksum: &str, keys: Keys) -> Next {
        match self.write(base, checksum, keys.clone(), true).await {
            Written::Done(_) => {
                self.write_backoff = None;
                Next::Wait
            }
            Written::Abandoned => {
                tracing::info!("the plan changed before its outcome could be written; reconciling the new plan");
                Next::After(Duration::ZERO)
            }
            Written::Failed(e) => {
                let b = doubled(self.write_backoff);
                self.write_backoff = Some(b);
                tracing::warn!(
                    "cannot write the outcome ({e}); keeping it and retrying in {}",
                    crate::process::human_duration(b)
                );
                self.pending = Some(Pending { checksum: checksum.to_string(), keys });
                Next::After(b)
            }
        }
    }

    async fn probe_keys(&self, vp: &ValidPlan, snap: &SecretSnapshot, initial: bool) -> Keys {
        if vp.plan.probes.is_empty() {
            return Keys::new();
        }
        let statuses = self.prober.probe_all(&vp.plan.probes, &wire::probe_statuses(snap), initial).await;
        wire::probe_keys(&statuses)
    }

    async fn reconcile(
        &mut self,
        snap: SecretSnapshot,
        snap_rx: &watch::Receiver<Option<SecretSnapshot>>,
        shutdown: &watch::Receiver<bool>,
    ) -> Next {
        // UID guard: a recreated Secret starts over.
        if self.uid.as_deref() != Some(snap.uid.as_str()) {
            if self.uid.is_some() {
                tracing::info!("the plan secret was recreated (uid {}); starting over", snap.uid);
            }
            self.uid = Some(snap.uid.clone());
            self.last_applied_rv = None;
            self.seen_rv = None;
            self.has_run_once = false;
        }
        // resourceVersion guard: never act on a snapshot older than our own last write or the
        // newest version we have read.
        if let (Some(last), Ok(rv)) = (self.last_applied_rv.max(self.seen_rv), snap.resource_version.parse::<u64>())
            && last > rv
        {
            tracing::debug!("skipping a snapshot older than our last write ({rv} < {last})");
            return Next::Wait;
        }
        if let Some(p) = wire::probe_period(&snap) {
            self.probe_period = p;
        }
        if let Some(p) = self.pending.take() {
            if wire::plan_checksum(&snap).as_deref() != Some(p.checksum.as_str()) {
                tracing::warn!("dropping an unwritten outcome: the secret now carries another plan");
            } else {
                match self.write_outcome(&snap, &p.checksum, p.keys).await {
                    Next::Wait => return Next::After(Duration::ZERO),
                    other => return other,
                }
            }
        }
        if self.blocked.is_some() {
            self.recover().await;
        }
        let Some(raw) = snap.data.get(wire::PLAN) else { return Next::Wait };
        let checksum = plan::checksum(raw);
        let vp = match plan::parse(raw) {
            Ok(v) => v,
            Err(e) => {
                self.warn_once(format!("plan {}: {e}", &checksum[..12]));
                return Next::Wait;
            }
        };
        if let Some(why) = self.blocked.clone() {
            self.warn_once(format!("not running plan {}: {why}", &checksum[..12]));
            if plan::resolve_annotations(&wire::annotations(&snap)).is_err() {
                return Next::Wait; // R3: nothing is written while a value is invalid
            }
            let keys = self.probe_keys(&vp, &snap, false).await;
            return self.write_outcome(&snap, &checksum, keys).await;
        }
        match wire::plan_state(&snap) {
            Some(state) => self.plan_state_flow(snap, vp, checksum, state, snap_rx, shutdown).await,
            None => self.legacy_flow(snap, vp, checksum, snap_rx, shutdown).await,
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn plan_state_flow(
        &mut self,
        mut snap: SecretSnapshot,
        vp: ValidPlan,
        checksum: String,
        state: plan::PlanState,
        snap_rx: &watch::Receiver<Option<SecretSnapshot>>,
        shutdown: &watch::Receiver<bool>,
    ) -> Next {
        self.has_run_once = true;
        let total = vp.plan.instructions.len();
        let fs = wire::flow_snapshot(&snap, &checksum, state, total);
        let run = match flow::decide(&fs) {
            Decision::Invalid(e) => {
                // R3: nothing written, nothing run, no probes; retried with backoff.
                self.warn_once(format!("plan {}: {e}; the plan is held and nothing is written", &checksum[..12]));
                let b = doubled(self.invalid_backoff);
                self.invalid_backoff = Some(b);
                return Next::After(b);
            }
            Decision::Observe => {
                self.invalid_backoff = None;
                let keys = self.probe_keys(&vp, &snap, false).await;
                return self.write_outcome(&snap, &checksum, keys).await;
            }
            Decision::Record { transition, partial_cancel } => {
                self.invalid_backoff = None;
                if partial_cancel {
                    tracing::warn!(
                        "plan {} canceled after {}/{} instructions; the node may be left in an inconsistent state",
                        &checksum[..12],
                        transition.checkpoint.completed_instructions,
                        transition.checkpoint.total_instructions
                    );
                }
                tracing::info!("plan {}: {}", &checksum[..12], transition.state);
                let mut keys = wire::transition_keys(&transition);
                keys.extend(self.probe_keys(&vp, &snap, false).await);
                return match self.write(&snap, &checksum, keys, false).await {
                    Written::Done(_) => Next::Wait,
                    Written::Abandoned => Next::After(Duration::ZERO),
                    Written::Failed(e) => {
                        let b = doubled(self.write_backoff);
                        self.write_backoff = Some(b);
                        tracing::warn!(
                            "cannot record {} ({e}); retrying in {}",
                            transition.state,
                            crate::process::human_duration(b)
                        );
                        Next::After(b)
                    }
                };
            }
            Decision::Run(run) => run,
        };
        self.invalid_backoff = None;
        // Commit the start (pending → in-progress) or the resume before anything runs.
        let pre = if run.begin {
            Some(wire::begin_keys(&snap, run.resume.as_ref()))
        } else {
            run.resume.as_ref().map(wire::transition_keys)
        };
        if let Some(keys) = pre {
            match self.write(&snap, &checksum, keys, false).await {
                Written::Done(new) => snap = new,
                Written::Abandoned => return Next::After(Duration::ZERO),
                Written::Failed(e) => {
                    let b = doubled(self.write_backoff);
                    self.write_backoff = Some(b);
                    tracing::warn!(
                        "cannot record the start of plan {} ({e}); retrying in {}",
                        &checksum[..12],
                        crate::process::human_duration(b)
                    );
                    return Next::After(b);
                }
            }
            // A pause or cancel that landed meanwhile takes effect before anything runs.
            if plan::resolve_annotations(&wire::annotations(&snap)) != Ok(Hold::None) {
                return Next::After(Duration::ZERO);
            }
            if run.begin {
                tracing::info!(
                    "plan {}: in-progress (revision {})",
                    &checksum[..12],
                    String::from_utf8_lossy(snap.data.get(wire::PLAN_REVISION).map(Vec::as_slice).unwrap_or_default())
                );
            }
        }
        let attempt = if run.begin { 1 } else { wire::attempt(&snap) };
        let result =
            match self.apply(&vp, &snap, &checksum, &run, attempt, wire::APPLIED_OUTPUT, snap_rx, shutdown).await {
                Ok(r) => r,
                Err(retry) => return Next::After(retry),
            };
        if result.interruption == Some(Interruption::Shutdown) {
            tracing::info!(
                "plan {} stopped for shutdown; it stays in-progress and runs again at the next start",
                &checksum[..12]
            );
            return Next::Stop;
        }
        // R11: the applyinator logs the warning for an interrupted instruction.
        let rec = flow::record(&fs, &run, &result);
        if let Some(s) = &rec.state {
            tracing::info!("plan {}: {s} ({}/{} instructions)", &checksum[..12], result.completed, total);
        }
        let base = self.latest(snap_rx, &checksum).unwrap_or(snap);
        let mut keys = wire::record_keys(&base, &checksum, &rec, chrono::Utc::now());
        keys.extend(self.probe_keys(&vp, &base, run.one_time && result.interruption.is_none()).await);
        self.write_outcome(&base, &checksum, keys).await
    }

    async fn legacy_flow(
        &mut self,
        snap: SecretSnapshot,
        vp: ValidPlan,
        checksum: String,
        snap_rx: &watch::Receiver<Option<SecretSnapshot>>,
        shutdown: &watch::Receiver<bool>,
    ) -> Next {
        let a = wire::annotations(&snap);
        if a.paused.is_some() || a.canceled.is_some() {
            self.warn_once(format!(
                "plan {}: pause/cancel annotations are ignored without plan-state (checksum flow)",
                &checksum[..12]
            ));
        }
        let own_echo = self.last_applied_rv.is_some() && self.last_applied_rv == snap.resource_version.parse().ok();
        let d = wire::legacy_decide(&snap, &checksum, self.has_run_once, own_echo, chrono::Utc::now());
        self.has_run_once = true;
        let run = RunPlan {
            effective: plan::PlanState::InProgress,
            one_time: d.needs_apply,
            resume_from: 0,
            begin: false,
            resume: None,
        };
        let existing = if d.was_failed_plan { wire::FAILED_OUTPUT } else { wire::APPLIED_OUTPUT };
        let result =
            match self.apply(&vp, &snap, &checksum, &run, wire::attempt(&snap), existing, snap_rx, shutdown).await {
                Ok(r) => r,
                Err(retry) => return Next::After(retry),
            };
        if result.interruption == Some(Interruption::Shutdown) {
            return Next::Stop;
        }
        let base = self.latest(snap_rx, &checksum).unwrap_or(snap);
        let output = if d.needs_apply {
            result.one_time_output.clone()
        } else {
            wire::one_time_output(&base, wire::APPLIED_OUTPUT)
        };
        let mut keys = wire::legacy_keys(
            &base,
            &checksum,
            d,
            result.one_time_succeeded,
            &output,
            &result.periodic_output,
            chrono::Utc::now(),
        );
        keys.extend(self.probe_keys(&vp, &base, d.needs_apply).await);
        self.write_outcome(&base, &checksum, keys).await
    }

    /// The newest snapshot if it still carries the same plan.
    fn latest(&self, snap_rx: &watch::Receiver<Option<SecretSnapshot>>, checksum: &str) -> Option<SecretSnapshot> {
        snap_rx.borrow().clone().filter(|s| wire::plan_checksum(s).as_deref() == Some(checksum))
    }

    /// Run the applyinator with interrupts mapped from the watch stream as it delivers them (R15).
    #[allow(clippy::too_many_arguments)]
    async fn apply(
        &mut self,
        vp: &ValidPlan,
        snap: &SecretSnapshot,
        checksum: &str,
        run: &RunPlan,
        attempt: i64,
        existing_output: &str,
        snap_rx: &watch::Receiver<Option<SecretSnapshot>>,
        shutdown: &watch::Receiver<bool>,
    ) -> Result<ApplyResult, Duration> {
        let plan_state_flow = wire::plan_state(snap).is_some();
        let (first, _) = interrupt_of(snap);
        let first = if plan_state_flow { first } else { Interrupt::default() };
        let (tx, rx) = watch::channel(first);
        let mut srx = snap_rx.clone();
        let mut sd = shutdown.clone();
        let cs = checksum.to_string();
        let mapper = tokio::spawn(async move {
            let mut warned: HashSet<String> = HashSet::new();
            loop {
                if plan_state_flow
                    && let Some(s) = srx.borrow_and_update().clone()
                    && wire::plan_checksum(&s).as_deref() == Some(cs.as_str())
                {
                    let (next, invalid) = interrupt_of(&s);
                    if let Some(msg) = invalid
                        && warned.insert(msg.clone())
                    {
                        tracing::warn!("{msg}; ignored while the plan runs (a valid value takes effect)");
                    }
                    update_interrupt(&tx, next, &format!("plan {}", &cs[..12]));
                }
                if *sd.borrow() {
                    tx.send_modify(|i| i.shutdown = true);
                }
                tokio::select! {
                    r = srx.changed() => if r.is_err() { std::future::pending::<()>().await },
                    r = sd.changed() => if r.is_err() { std::future::pending::<()>().await },
                }
            }
        });
        let existing = wire::one_time_output(snap, existing_output);
        let result = self
            .app
            .apply(ApplyInput {
                plan: vp,
                reconcile_files: run.one_time,
                run_one_time: run.one_time,
                attempt,
                resume_from: run.resume_from,
                one_time_output: existing,
                periodic_output: wire::periodic_output(snap),
                run_periodic: true,
                interrupts: rx,
                owner: Owner::remote(checksum),
                observer: Arc::new(LogObserver),
            })
            .await;
        mapper.abort();
        let result = match result {
            Ok(r) => {
                self.apply_backoff = None;
                r
            }
            Err(e) => {
                // As system-agent: an apply that could not start (interlock, files) writes
                // nothing and is retried with backoff; an in-progress plan stays in-progress.
                let b = doubled(self.apply_backoff);
                self.apply_backoff = Some(b);
                tracing::error!("plan {}: {e}; retrying in {}", &checksum[..12], crate::process::human_duration(b));
                return Err(b);
            }
        };
        if let Some(why) = result.incomplete_reason() {
            tracing::error!("plan {}: {why}", &checksum[..12]);
            self.blocked = Some(why.clone());
            self.incomplete = Some(why);
        }
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::ApplyConfig;
    use crate::process::{Supervisor, SupervisorConfig};
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
        let dir = tempfile::tempdir().unwrap();
        for reapply in [false, true] {
            let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let client = SecretClient::new(
                kube::Client::new(svc, "n"),
                super::super::client::SecretRef { namespace: "n".into(), name: "p".into() },
            );
            let sup = Supervisor::new(SupervisorConfig { pid_dir: None, ..Default::default() });
            let app = Arc::new(Applyinator::new(ApplyConfig::new(dir.path().join("work")), sup));
            let mut agent = RemoteAgent::new(client, app, Arc::new(Prober::new()), Duration::from_secs(5));
            let base = SecretSnapshot {
                uid: "u".into(),
                resource_version: "5".into(),
                data: BTreeMap::from([
                    ("plan".to_string(), PLAN.to_vec()),
                    ("plan-state".to_string(), b"paused".to_vec()),
                ]),
                annotations: BTreeMap::new(),
            };
            let mut keys = Keys::new();
            keys.insert("plan-state".into(), Some(b"in-progress".to_vec()));
            let checksum = plan::checksum(PLAN);
            let server = async move {
                let mut handle = std::pin::pin!(handle);
                let mut patches = Vec::new();
                let (req, send) = handle.as_mut().next_request().await.expect("a first PATCH");
                assert_eq!(req.method(), http::Method::PATCH);
                patches.push(req);
                send.send_response(respond(409, &conflict()));
                let (req, send) = handle.as_mut().next_request().await.expect("a GET after the conflict");
                assert_eq!(req.method(), http::Method::GET);
                // The orchestrator reset the (same) plan to pending meanwhile.
                send.send_response(respond(200, &secret_json("7", "pending")));
                if reapply {
                    let (req, send) = handle.as_mut().next_request().await.expect("the re-applied PATCH");
                    let body = http_body_util::BodyExt::collect(req.into_body()).await.unwrap().to_bytes();
                    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    assert_eq!(body["metadata"]["resourceVersion"], "7", "re-applied on the fresh version");
                    send.send_response(respond(200, &secret_json("8", "in-progress")));
                }
                patches.len()
            };
            let (written, _) = tokio::join!(agent.write(&base, &checksum, keys, reapply), server);
            match (reapply, written) {
                (false, Written::Abandoned) => {}
                (true, Written::Done(s)) => assert_eq!(s.resource_version, "8"),
                (r, Written::Done(_)) => panic!("reapply={r}: written"),
                (r, Written::Abandoned) => panic!("reapply={r}: abandoned"),
                (r, Written::Failed(e)) => panic!("reapply={r}: {e}"),
            }
            assert_eq!(agent.seen_rv, Some(7), "nothing older than the fresh read is acted on");
        }
    }
}
