//! A node's NodePlans as a plan source of [`crate::reconcile`]: every NodePlan labelled for the
//! node is watched (one watch, relisted after errors); the loop looks at them in the documented
//! order (priority, then age, then name) and runs one at a time; status is written through the
//! status subresource with the object's resourceVersion as the precondition.
//!
//! As for the Secret, the base of a write is the object the agent's own last write returned
//! unless the watch has delivered an event since; an outcome that cannot be written is kept and
//! retried by the loop. A NodePlan deleted while it runs is canceled through the stop ladder (no
//! finalizer: a dead node must not leave objects stuck in Terminating).

use super::resource::{self, NodePlanSpec, NodePlanStatus};
pub use super::resource::{api_resource, node_label_value};
use super::runs::RunStore;
use super::wire::{self, Policy, Target};
use crate::apply::{ApplyError, Interrupt};
use crate::events::{EventSink, Reason, Regarding};
use crate::flow::{self, Commit, Decision, RunPlan};
use crate::k8s::base::WriteBase;
use crate::k8s::error_line as k8s_error_line;
use crate::k8s::write::{self, Prepared, WriteError};
use crate::metrics::{self, RetryReason, WriteTarget};
use crate::plan::{PlanState, ProbeStatus};
use crate::process::{Owner, Source};
use crate::reconcile::{Claim, Look, Observed, Outcome, PlanSource, Seen, Sent, View, Wait, Written};
use kube::api::{Api, DynamicObject, PostParams};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;
use tokio::sync::watch;

/// Every API call is bounded: kube has no read timeout of its own.
const API_TIMEOUT: Duration = Duration::from_secs(15);

/// The watch's latest objects, by name, numbered so the source can tell whether they arrived
/// after its own write.
type Latest = crate::k8s::watch::Latest<DynamicObject>;

impl NodePlanSource {
    /// `state_dir`: where runs in progress are kept ([`RunStore`]; `None`: not kept).
    pub fn new(
        client: kube::Client,
        namespace: &str,
        node: &str,
        probe_period: Duration,
        state_dir: Option<std::path::PathBuf>,
    ) -> NodePlanSource {
        let api = Api::namespaced_with(client, namespace, &api_resource());
        NodePlanSource {
            api,
            namespace: namespace.to_string(),
            node: node.to_string(),
            latest: None,
            own: HashMap::new(),
            probe_period,
            last_interrupt: HashMap::new(),
            store: RunStore::new(state_dir, namespace),
            runs: HashMap::new(),
            refusals: HashMap::new(),
            forbidden_told: HashMap::new(),
            events: None,
            pump: None,
            restored: Default::default(),
            unkept: HashMap::new(),
        }
    }
}

/// An outcome that did not land yet, as the loop keeps it: the status to write, for the plan it
/// belongs to.
pub struct Unwritten {
    checksum: String,
    status: NodePlanStatus,
    /// A run's outcome, kept on the node until it lands.
    on_node: bool,
    /// Read back from the node (a previous agent's): its first write is no retry.
    restored: bool,
}

pub struct NodePlanSource {
    api: Api<DynamicObject>,
    namespace: String,
    node: String,
    latest: Option<watch::Receiver<Latest>>,
    /// Per NodePlan, the base of the next write (see [`WriteBase`]).
    own: HashMap<String, WriteBase<DynamicObject>>,
    probe_period: Duration,
    /// The last pause/cancel values each running plan saw.
    last_interrupt: HashMap<String, Interrupt>,
    store: RunStore,
    /// Per NodePlan, the run last looked at: its policy, and whether it ran past its timeout.
    runs: HashMap<String, RunInfo>,
    /// Per NodePlan, why the last look found that this agent will not run it: written by
    /// [`PlanSource::show`] when the loop asks, never by the look itself.
    refusals: HashMap<String, Refusal>,
    /// Kubernetes Events about the NodePlans (started when the agent runs).
    events: Option<EventSink>,
    /// Per NodePlan, the 403s on the NodePlans told in a `Refused` Event.
    forbidden_told: HashMap<String, crate::k8s::refusals::Told>,
    /// The task that feeds `latest` from the watch (from [`PlanSource::start`]).
    pump: Option<crate::AbortOnDrop>,
    /// The NodePlans whose kept outcome was looked for since the agent started.
    restored: std::collections::HashSet<String>,
    /// Per NodePlan, why its run could not be kept on the node at its last start (said once in
    /// a `NotStarted` Event).
    unkept: HashMap<String, String>,
}

/// What the source remembers of the run it last showed the loop.
struct RunInfo {
    checksum: String,
    policy: Policy,
    /// The spec that runs (saved when it begins).
    spec: NodePlanSpec,
    timed_out: bool,
}

/// An object's resourceVersion (compared for equality only).
fn rv(o: &DynamicObject) -> &str {
    o.metadata.resource_version.as_deref().unwrap_or_default()
}

/// Parse an object's spec and status (a status this agent cannot read counts as none).
fn parts(o: &DynamicObject) -> (Result<NodePlanSpec, String>, NodePlanStatus) {
    let spec = o.data.get("spec").cloned().unwrap_or_default();
    let spec = serde_json::from_value(spec).map_err(|e| format!("spec: {e}"));
    let status = o.data.get("status").cloned().and_then(|s| serde_json::from_value(s).ok()).unwrap_or_default();
    (spec, status)
}

/// Whether a status for run `checksum` may be written to this object: the spec asks for that run,
/// or the status belongs to it (a run that goes on while the spec changed records its outcome).
fn belongs(o: &DynamicObject, checksum: &str) -> bool {
    let (spec, status) = parts(o);
    spec.ok().and_then(|s| wire::plan_checksum(&s)).as_deref() == Some(checksum) || status.plan_checksum == checksum
}

/// Whether the object asks that a change of its plan stop the running one at once.
fn forced(o: &DynamicObject) -> bool {
    o.metadata.annotations.as_ref().and_then(|a| a.get(resource::FORCE_UPDATE)).map(String::as_str) == Some("true")
}

impl NodePlanSource {
    fn seq(&self) -> u64 {
        self.latest.as_ref().map_or(0, |l| l.borrow().0)
    }

    fn for_this_node(&self, o: &DynamicObject) -> bool {
        wire::is_for_node(o, &self.node)
    }

    /// The newest view of one NodePlan: our own last write's object, unless the watch delivered
    /// an event after it. `None`: it is gone.
    fn current(&self, name: &str) -> Option<DynamicObject> {
        let (seq, watched) = match &self.latest {
            Some(l) => {
                let b = l.borrow();
                (b.0, b.1.get(name).cloned())
            }
            None => (0, None),
        };
        // A NodePlan the watch no longer has is gone, whatever was written to it before.
        let watched = watched?;
        let base = match self.own.get(name) {
            Some(b) => b.current(seq, Some(watched), rv),
            None => Some(watched),
        };
        base.filter(|o| self.for_this_node(o))
    }

    /// `new` is the newest object of `name`: what a write (or read) sent when the watch's sequence
    /// number was `sent` returned, replacing `older` (its base).
    fn remember(&mut self, name: &str, new: DynamicObject, sent: u64, older: &DynamicObject) {
        self.own.entry(name.to_string()).or_default().remember(new, sent, rv(older), rv);
    }

    fn label(&self, name: &str) -> String {
        format!("nodeplan {}/{name}", self.namespace)
    }

    /// Replace the status of `name` (for the plan with `checksum`) on the current object through
    /// the one writer ([`crate::k8s::write`]): on a conflict an outcome (`reapply`) is written
    /// again on the fresh object while it carries the same plan; a transition is abandoned so the
    /// new spec is decided afresh.
    async fn write(&mut self, name: &str, checksum: &str, status: &NodePlanStatus, reapply: bool) -> Written {
        let Some(base) = self.current(name) else { return Written::Abandoned };
        let label = self.label(name);
        let mut target = StatusWrite {
            api: &self.api,
            name,
            label,
            checksum,
            status,
            latest: self.latest.as_ref(),
            own: self.own.entry(name.to_string()).or_default(),
        };
        let written = write::write(&mut target, base, reapply).await;
        if matches!(written, Written::Failed { .. }) {
            self.tell_forbidden(name);
        }
        written
    }

    /// A 403 on the NodePlans that began since it was last told: told once on `name` in a
    /// `Refused` Event.
    fn tell_forbidden(&mut self, name: &str) {
        let news = self.forbidden_told.entry(name.to_string()).or_default().news(&crate::k8s::liveness::forbidden());
        for line in news {
            self.event(&name.to_string(), Reason::Refused, &line);
        }
    }

    /// Send an outcome that must not be lost: handed to the loop to keep when the write fails
    /// ([`PlanSource::resend`]); a run's outcome kept on the node is forgotten there once it
    /// lands or no longer applies.
    async fn send(&mut self, name: &str, u: Unwritten) -> Sent<Unwritten> {
        let w = self.write(name, &u.checksum, &u.status, true).await;
        if matches!(w, Written::Failed { .. }) {
            return (w, Some(u));
        }
        if u.on_node {
            self.store.remove(name);
        }
        (w, None)
    }

    /// The outcome a previous agent kept on the node for the run the status shows in progress
    /// (it finished, its write did not land before that agent stopped): written instead of
    /// running the plan again (R17). Looked for once per NodePlan after the agent starts.
    async fn restore(&mut self, name: &str) -> Option<Unwritten> {
        if !self.restored.insert(name.to_string()) {
            return None;
        }
        let status = parts(&self.current(name)?).1;
        if status.state != Some(PlanState::InProgress) || status.plan_checksum.is_empty() {
            return None;
        }
        let run = status.plan_checksum;
        let outcome = self.store.outcome(name, &run).await?;
        tracing::info!(
            "{}: run {} finished before the agent stopped and its outcome was kept on the node; writing it instead of running the plan again",
            self.label(name),
            &run[..run.len().min(12)]
        );
        Some(Unwritten { checksum: run, status: outcome, on_node: true, restored: true })
    }

    /// The spec that runs: the live one, unless the status shows another run in progress (the
    /// spec changed while it ran, and the agent restarted or stopped meanwhile). That run goes on
    /// from what was saved when it began, with the live pause and cancel values, unless the
    /// object asks for a forced update.
    async fn running_spec(
        &self,
        name: &str,
        o: &DynamicObject,
        live: NodePlanSpec,
        status: &NodePlanStatus,
    ) -> NodePlanSpec {
        let running = status.plan_checksum.as_str();
        let live_run = wire::plan_checksum(&live);
        if status.state != Some(PlanState::InProgress)
            || running.is_empty()
            || live_run.as_deref() == Some(running)
            || forced(o)
        {
            return live;
        }
        let with_live = |saved: NodePlanSpec| NodePlanSpec { paused: live.paused, canceled: live.canceled, ..saved };
        if let Some(r) = self.runs.get(name).filter(|r| r.checksum == running) {
            return with_live(r.spec.clone());
        }
        match self.store.load(name, running).await {
            Some(saved) => {
                tracing::info!(
                    "{}: the spec changed while run {} was in progress; that run goes on first",
                    self.label(name),
                    &running[..running.len().min(12)]
                );
                with_live(saved)
            }
            None => {
                tracing::warn!(
                    "{}: run {} was in progress but is not kept on this node; the newest spec runs instead",
                    self.label(name),
                    &running[..running.len().min(12)]
                );
                live
            }
        }
    }

    fn status_of(&self, name: &str) -> NodePlanStatus {
        self.current(name).map(|o| parts(&o).1).unwrap_or_default()
    }

    fn generation(&self, name: &str) -> i64 {
        self.current(name).and_then(|o| o.metadata.generation).unwrap_or_default()
    }

    /// Mark a NodePlan this agent will not run `Failed` with the reason (once per generation).
    async fn refuse(&mut self, name: &str, o: &DynamicObject, reason: &str, message: &str) {
        let generation = o.metadata.generation.unwrap_or_default();
        let prev = parts(o).1;
        let already = prev.phase == "Failed"
            && prev.observed_generation == generation
            && prev.conditions.iter().any(|c| c.reason == reason && c.message == message);
        if already {
            return;
        }
        let next = wire::refused(&prev, generation, reason, message, chrono::Utc::now());
        let mut obj = o.clone();
        if let (Some(data), Ok(v)) = (obj.data.as_object_mut(), serde_json::to_value(&next)) {
            data.insert("status".into(), v);
        }
        let sent = self.seq();
        match tokio::time::timeout(API_TIMEOUT, self.api.replace_status(name, &PostParams::default(), &obj)).await {
            Ok(Ok(new)) => self.remember(name, new, sent, o),
            Ok(Err(e)) => {
                tracing::warn!("{}: cannot write its status: {}", self.label(name), crate::k8s::error_line(&e))
            }
            Err(_) => tracing::warn!("{}: cannot write its status: timed out", self.label(name)),
        }
    }
}

/// A NodePlan the agent will not run, as a look found it: written `Failed`, with the reason, when
/// the loop asks ([`PlanSource::show`]).
struct Refusal {
    object: Box<DynamicObject>,
    reason: String,
    message: String,
}

impl Refusal {
    fn of(o: &DynamicObject, reason: &str, message: &str) -> Refusal {
        Refusal { object: Box::new(o.clone()), reason: reason.to_string(), message: message.to_string() }
    }
}

/// One status write of one NodePlan, for [`crate::k8s::write`].
struct StatusWrite<'a> {
    api: &'a Api<DynamicObject>,
    name: &'a str,
    label: String,
    checksum: &'a str,
    status: &'a NodePlanStatus,
    latest: Option<&'a watch::Receiver<Latest>>,
    own: &'a mut WriteBase<DynamicObject>,
}

impl write::Target for StatusWrite<'_> {
    type Object = DynamicObject;
    type Payload = DynamicObject;
    const METRIC: WriteTarget = WriteTarget::NodePlan;

    fn what(&self) -> String {
        self.label.clone()
    }

    fn belongs(&self, o: &DynamicObject) -> bool {
        belongs(o, self.checksum)
    }

    /// The object with this status, shortened to fit beside what the object already holds (its
    /// spec may be large).
    fn prepare(&self, base: &DynamicObject) -> Prepared<DynamicObject> {
        let mut without = base.clone();
        if let Some(obj) = without.data.as_object_mut() {
            obj.remove("status");
        }
        let held = serde_json::to_vec(&without).map_or(wire::OBJECT_BUDGET, |v| v.len());
        let (status, cut) = wire::fit(self.status.clone(), wire::OBJECT_BUDGET.saturating_sub(held));
        if cut {
            tracing::warn!(
                "{}: the status is shortened to fit beside its spec (outputs, then per-instruction results dropped)",
                self.label
            );
        }
        let Ok(status_value) = serde_json::to_value(&status) else {
            return Prepared::Fail("cannot encode the status".into());
        };
        let mut next = base.clone();
        if let Some(obj) = next.data.as_object_mut() {
            obj.insert("status".into(), status_value);
        }
        Prepared::Send(next)
    }

    async fn send(&self, _: &DynamicObject, next: DynamicObject) -> Result<DynamicObject, WriteError> {
        Ok(self.api.replace_status(self.name, &PostParams::default(), &next).await?)
    }

    async fn read(&self) -> Result<Option<DynamicObject>, String> {
        self.api.get_opt(self.name).await.map_err(|e| format!("{}: {}", self.label, k8s_error_line(&e)))
    }

    fn seq(&self) -> u64 {
        self.latest.map_or(0, |l| l.borrow().0)
    }

    fn remember(&mut self, new: DynamicObject, sent: u64, older: &DynamicObject, _: bool) {
        self.own.remember(new, sent, rv(older), rv);
    }
}

impl PlanSource for NodePlanSource {
    type Key = String;
    type Kept = Unwritten;

    async fn changed(&mut self) -> bool {
        match self.latest.as_mut() {
            Some(l) => l.changed().await.is_ok(),
            None => std::future::pending().await,
        }
    }

    /// Watch the node's NodePlans, and publish Events about them.
    async fn start(&mut self) {
        self.events = Some(EventSink::start(self.api.clone().into_client(), &self.node));
        let (tx, rx) = watch::channel::<Latest>((0, BTreeMap::new()));
        let (lw, what) = resource::node_watch(self.api.clone(), &self.node, &self.namespace);
        self.pump = Some(crate::AbortOnDrop(tokio::spawn(crate::k8s::watch::pump(lw, what, tx))));
        self.latest = Some(rx);
    }

    async fn keys(&mut self) -> Vec<String> {
        let Some(l) = &self.latest else { return Vec::new() };
        let objects: Vec<DynamicObject> = l.borrow().1.values().cloned().collect();
        let mut ranked: Vec<(i32, String, String)> =
            objects.iter().filter(|o| self.for_this_node(o)).map(wire::order_key).collect();
        ranked.sort_by(|a, b| wire::order((a.0, &a.1, &a.2), (b.0, &b.1, &b.2)));
        // What is kept per NodePlan goes with it (keys are listed between runs, never during one).
        let listed = |name: &String| ranked.iter().any(|r| r.2 == *name);
        self.own.retain(|name, _| listed(name));
        self.runs.retain(|name, _| listed(name));
        self.last_interrupt.retain(|name, _| listed(name));
        self.restored.retain(|name| listed(name));
        self.unkept.retain(|name, _| listed(name));
        ranked.into_iter().map(|r| r.2).collect()
    }

    async fn show(&mut self, name: &String) {
        if let Some(r) = self.refusals.remove(name) {
            self.refuse(name, &r.object, &r.reason, &r.message).await;
        }
    }

    /// The plan shows `Pending` (or keeps its state, for a run that goes on) with a condition
    /// that says why it waits: written once, not at every look.
    async fn wait(&mut self, name: &String, look: &Look, why: Wait<'_>) {
        let Some(o) = self.current(name) else { return };
        let generation = o.metadata.generation.unwrap_or_default();
        let prev = parts(&o).1;
        let begins = match &look.view {
            View::Flow(snap) => matches!(flow::decide(snap), Decision::Run(RunPlan::Begin { .. })),
            View::Legacy { .. } => false,
        };
        let now = chrono::Utc::now();
        let target = Target { generation, checksum: &look.checksum, total: look.plan.plan.instructions.len() };
        let mut next = wire::waiting(&prev, target, begins, now);
        match why {
            Wait::Turn(holder) => wire::set_lock_holder(&mut next, Some(holder), generation, now),
            Wait::Preflight(result) => {
                wire::set_lock_holder(&mut next, None, generation, now);
                wire::set_preflight(&mut next, result, generation, now);
            }
        }
        if prev == next {
            return;
        }
        if let Written::Failed { error, .. } = self.write(name, &look.checksum, &next, false).await {
            tracing::warn!("{}: cannot write why it waits: {error}", self.label(name));
        }
    }

    async fn look(&mut self, name: &String) -> Seen {
        let Some(o) = self.current(name) else {
            self.forbidden_told.remove(name);
            return Seen::Nothing;
        };
        self.tell_forbidden(name);
        let generation = o.metadata.generation.unwrap_or_default();
        let label = self.label(name);
        let bad =
            |e: String| Seen::Bad { checksum: format!("generation {generation}"), error: format!("{label}: {e}") };
        self.refusals.remove(name);
        let spec_value = o.data.get("spec").cloned().unwrap_or_default();
        if let Err(e) = resource::check_spec(&spec_value) {
            self.refusals.insert(name.clone(), Refusal::of(&o, e.reason(), &e.to_string()));
            return bad(e.to_string());
        }
        let (spec, status) = parts(&o);
        let spec = match spec {
            Ok(s) => s,
            Err(e) => {
                self.refusals.insert(name.clone(), Refusal::of(&o, "InvalidSpec", &e));
                return bad(e);
            }
        };
        let spec = self.running_spec(name, &o, spec, &status).await;
        let checked = wire::valid_plan(&spec).and_then(|(vp, c)| Ok((vp, c, wire::policy(&spec)?)));
        let (vp, checksum, policy) = match checked {
            Ok(v) => v,
            Err(e) => {
                self.refusals.insert(name.clone(), Refusal::of(&o, "InvalidPlan", &e));
                return bad(e);
            }
        };
        // A refusal of an earlier spec is undone once this one is taken (the run may have nothing
        // left to write: a fixed spec of a plan that had succeeded).
        let status = match wire::unrefused(&status, generation, chrono::Utc::now()) {
            Some(next) => match self.write(name, &checksum, &next, false).await {
                Written::Done => next,
                Written::Failed { error, .. } => {
                    tracing::warn!("{label}: cannot write that its spec is taken again: {error}");
                    status
                }
                Written::Abandoned => status,
            },
            None => status,
        };
        let total = vp.plan.instructions.len();
        let (snap, retry_in) = wire::snapshot(&spec, &status, &checksum, total, &policy, chrono::Utc::now());
        let attempt = wire::attempt(&status, &checksum);
        let stop_after = wire::time_left(&status, &policy, chrono::Utc::now());
        let preflight = policy.preflight.clone();
        self.runs.insert(name.clone(), RunInfo { checksum: checksum.clone(), policy, spec, timed_out: false });
        Seen::Plan(Box::new(Look {
            place: label.clone(),
            label,
            view: View::Flow(snap),
            attempt,
            begin_attempt: attempt,
            one_time_output: BTreeMap::new(),
            periodic_output: if status.plan_checksum == checksum {
                status.periodic_outputs.clone()
            } else {
                BTreeMap::new()
            },
            // A probe's history belongs to its run (a new run probes from scratch).
            probe_statuses: if status.plan_checksum == checksum {
                status.probe_statuses.clone()
            } else {
                BTreeMap::new()
            },
            retry_in,
            stop_after,
            preflight,
            checked: None,
            checksum,
            plan: vp,
        }))
    }

    async fn commit(&mut self, name: &String, look: &Look, commit: &Commit) -> Written {
        let generation = self.generation(name);
        let t = Target { generation, checksum: &look.checksum, total: look.plan.plan.instructions.len() };
        let now = chrono::Utc::now();
        let mut next = wire::commit(&self.status_of(name), t, commit, now);
        if matches!(commit, Commit::Begin { .. }) {
            if let Some(r) = &look.checked {
                wire::set_preflight(&mut next, r, generation, now);
            }
            // Kept on the node before it runs, so a restarted agent goes on with this run.
            if let Some(run) = self.runs.get(name).filter(|r| r.checksum == look.checksum) {
                if let Err(e) = self.store.save(name, &look.checksum, &run.spec).await {
                    // A save that lands after this gave up (R31) is removed in its turn: the
                    // start was not committed, and the plan may never begin (a cancel, a new spec).
                    self.store.remove(name);
                    let why = format!("cannot keep the run on this node: {e}");
                    // Whoever watches the NodePlan sees why it does not begin (a full disk): once
                    // per reason, not at every try.
                    if self.unkept.get(name) != Some(&why) {
                        self.unkept.insert(name.clone(), why.clone());
                        let note = format!("plan {}: cannot start: {why}; retrying with back-off", look.plan.id());
                        self.event(name, Reason::NotStarted, &note);
                    }
                    return Written::failed(why);
                }
                self.unkept.remove(name);
            }
        }
        self.write(name, &look.checksum, &next, false).await
    }

    async fn record(&mut self, name: &String, look: &Look, outcome: Outcome<'_>) -> Sent<Unwritten> {
        let Some(rec) = &outcome.record else { return (Written::Done, None) };
        let generation = self.generation(name);
        let t = Target { generation, checksum: &look.checksum, total: look.plan.plan.instructions.len() };
        let now = chrono::Utc::now();
        let run = self.runs.get(name).filter(|r| r.checksum == look.checksum);
        let policy = run.map(|r| r.policy.clone()).unwrap_or_default();
        let timeout = policy.timeout.filter(|_| run.is_some_and(|r| r.timed_out));
        let rec = if timeout.is_some() { wire::as_timeout(rec) } else { rec.clone() };
        let mut next = wire::record(&self.status_of(name), t, &rec, outcome.result, outcome.probes.as_ref(), now);
        if next.state.is_none() && next.plan_checksum.is_empty() {
            next.plan_checksum = look.checksum.clone();
        }
        wire::set_failure(&mut next, outcome.failure.as_ref(), generation, now);
        if let Some(d) = timeout {
            wire::mark_timeout(&mut next, d, generation, now);
        }
        wire::mark_retry(&mut next, &policy);
        // A run that went on without a commit (a recovery) may still show that it waited.
        wire::set_lock_holder(&mut next, None, generation, now);
        // A run that ended is recorded on the node before its status is written (R17).
        let ended = rec.state.as_ref().is_some_and(|s| *s != PlanState::InProgress);
        if ended
            && let Some(run) = self.runs.get(name).filter(|r| r.checksum == look.checksum)
            && let Err(e) = self.store.keep_outcome(name, &look.checksum, &run.spec, &next).await
        {
            tracing::warn!("{}: cannot keep the outcome on this node ({e}); writing it", look.label);
        }
        let u = Unwritten { checksum: look.checksum.clone(), status: next, on_node: ended, restored: false };
        self.send(name, u).await
    }

    async fn not_started(&mut self, _: &String, _: &Look, _: &ApplyError) -> Option<Written> {
        None
    }

    async fn write_probes(
        &mut self,
        name: &String,
        checksum: &str,
        statuses: BTreeMap<String, ProbeStatus>,
    ) -> Written {
        let mut next = self.status_of(name);
        next.probe_statuses = statuses;
        self.write(name, checksum, &next, true).await
    }

    async fn restored(&mut self, name: &String) -> Option<Unwritten> {
        self.restore(name).await
    }

    async fn resend(&mut self, name: &String, u: Unwritten) -> Sent<Unwritten> {
        if !u.restored {
            metrics::write_retried(WriteTarget::NodePlan, RetryReason::Error);
        }
        self.send(name, Unwritten { restored: false, ..u }).await
    }

    async fn set_blocked(&mut self, name: &String, why: Option<&str>) {
        let Some(o) = self.current(name) else { return };
        let Some(checksum) = parts(&o).0.ok().and_then(|s| wire::plan_checksum(&s)) else { return };
        let mut next = parts(&o).1;
        next.blocked = why.unwrap_or_default().to_string();
        if let Written::Failed { error, .. } = self.write(name, &checksum, &next, true).await {
            tracing::warn!("{}: cannot write that it is blocked: {error}", self.label(name));
        }
    }

    fn interrupt(&mut self, name: &String, look: &Look) -> Observed {
        let current = self.current(name);
        let last = self.last_interrupt.entry(name.clone()).or_default();
        let Some(o) = current else {
            // Deleted while it runs: canceled through the stop ladder.
            last.cancel = true;
            return Observed { interrupt: *last, note: Some(format!("nodeplan {name} was deleted: canceling it")) };
        };
        let mut note = None;
        let (spec, status) = parts(&o);
        if let Ok(spec) = spec {
            // Pause and cancel act on the running plan even when the spec's plan changed
            // meanwhile (the new plan runs after it); a forced update stops it.
            // (The plan is hashed only when a forced update could stop it: not at every event.)
            let replaced = forced(&o) && wire::plan_checksum(&spec).as_deref() != Some(look.checksum.as_str());
            *last = Interrupt { pause: spec.paused, cancel: spec.canceled || replaced, ..Interrupt::default() };
            if replaced {
                note = Some(format!(
                    "{}: the plan changed with {}: stopping the running one",
                    look.label,
                    resource::FORCE_UPDATE
                ));
            }
        }
        if let Some(run) = self.runs.get_mut(name).filter(|r| r.checksum == look.checksum)
            && (run.timed_out || wire::timed_out(&status, &run.policy, chrono::Utc::now()))
        {
            run.timed_out = true;
            last.cancel = true;
            let limit = run.policy.timeout.map(crate::duration::show).unwrap_or_default();
            note = Some(format!("{}: the run exceeded its timeout of {limit}: stopping it", look.label));
        }
        Observed { interrupt: *last, note }
    }

    fn owner(&self, name: &String, _: &Look) -> Owner {
        Owner::new(Source::NodePlan, format!("{}/{name}", self.namespace))
    }

    fn claim(&self, owner: &Owner) -> Claim<String> {
        if !owner.belongs_to(Source::NodePlan) {
            return Claim::NotMine;
        }
        match owner.id().and_then(|id| id.split_once('/')) {
            Some((ns, name)) if ns == self.namespace => Claim::Plan(name.to_string()),
            Some(_) => Claim::NotMine,
            None => Claim::Unknown,
        }
    }

    /// The watch delivers every change: the loop looks again without one only this rarely
    /// (probes and periodic instructions keep their own timers).
    fn period(&self) -> Duration {
        crate::reconcile::WATCHED_PERIOD
    }

    fn probe_period(&self, _: &Self::Key) -> Duration {
        self.probe_period
    }

    fn event(&mut self, name: &String, reason: Reason, note: &str) {
        let (Some(sink), Some(o)) = (&self.events, self.current(name)) else { return };
        let regarding = Regarding {
            api_version: format!("{}/{}", resource::GROUP, resource::VERSION),
            kind: resource::KIND.to_string(),
            namespace: self.namespace.clone(),
            name: name.clone(),
            uid: o.metadata.uid.clone().unwrap_or_default(),
        };
        // A run stopped at its timeout is recorded as failed (R21), not canceled.
        let timed_out = self.runs.get(name).filter(|r| r.timed_out).and_then(|r| r.policy.timeout);
        match (reason, timed_out) {
            (Reason::Canceled | Reason::CanceledWithSurvivors, Some(t)) => sink.emit(
                regarding,
                Reason::Failed,
                format!("the run exceeded its timeout of {}: {note}", crate::duration::show(t)),
            ),
            _ => sink.emit(regarding, reason, note),
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::resource::NODE_LABEL;
    use super::*;
    use http::{Request, Response};
    use kube::client::Body;

    /// A NodePlan of node `node-a` whose status belongs to the run `abc`, at `rv`.
    fn nodeplan_json(rv: &str) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "agent.cattle.io/v1alpha1", "kind": "NodePlan",
            "metadata": {"name": "np", "namespace": "ns", "resourceVersion": rv, "labels": {NODE_LABEL: "node-a"}},
            "spec": {"plan": {"instructions": []}},
            "status": {"planChecksum": "abc"}
        })
    }

    fn respond(code: u16, v: &serde_json::Value) -> Response<Body> {
        Response::builder().status(code).body(Body::from(serde_json::to_vec(v).unwrap_or_default())).unwrap()
    }

    /// A status write that conflicts is written again on the fresh object (counted as a conflict
    /// retry); one that fails is handed to the loop to keep and sent again by `resend` (counted as
    /// an error retry).
    #[tokio::test]
    async fn status_writes_tried_again_are_counted() {
        let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let mut source =
            NodePlanSource::new(kube::Client::new(svc, "ns"), "ns", "node-a", Duration::from_secs(5), None);
        let object: DynamicObject = serde_json::from_value(nodeplan_json("5")).unwrap();
        let (_tx, rx) = watch::channel::<Latest>((1, BTreeMap::from([("np".to_string(), object)])));
        source.latest = Some(rx);
        let series = |reason: &str| format!("nodeplan_write_retries_total{{target=\"nodeplan\",reason=\"{reason}\"}}");
        let (conflicts, errors) =
            (crate::metrics::sample(&series("conflict")), crate::metrics::sample(&series("error")));
        let server = async move {
            let mut handle = std::pin::pin!(handle);
            let conflict = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409, "message": "conflict"});
            let (req, send) = handle.as_mut().next_request().await.expect("a first PUT");
            assert_eq!(req.method(), http::Method::PUT);
            send.send_response(respond(409, &conflict));
            let (req, send) = handle.as_mut().next_request().await.expect("a GET after the conflict");
            assert_eq!(req.method(), http::Method::GET);
            send.send_response(respond(200, &nodeplan_json("7")));
            let (req, send) = handle.as_mut().next_request().await.expect("the PUT on the fresh object");
            assert_eq!(req.method(), http::Method::PUT);
            send.send_response(respond(200, &nodeplan_json("8")));
            // The next outcome fails, then lands when sent again.
            let (_, send) = handle.as_mut().next_request().await.expect("a PUT");
            send.send_response(respond(500, &serde_json::json!({"kind": "Status", "code": 500, "message": "down"})));
            let (_, send) = handle.as_mut().next_request().await.expect("the kept PUT");
            send.send_response(respond(200, &nodeplan_json("9")));
        };
        let status = NodePlanStatus { plan_checksum: "abc".into(), ..NodePlanStatus::default() };
        let unwritten =
            || Unwritten { checksum: "abc".into(), status: status.clone(), on_node: false, restored: false };
        let client = async {
            assert_eq!(source.send("np", unwritten()).await.0, Written::Done);
            assert!(crate::metrics::sample(&series("conflict")) > conflicts);
            let (failed, kept) = source.send("np", unwritten()).await;
            assert!(matches!(failed, Written::Failed { .. }), "{failed:?}");
            assert_eq!(crate::metrics::sample(&series("error")), errors, "a first attempt is no retry");
            let (w, kept) = source.resend(&"np".to_string(), kept.expect("kept for the retry")).await;
            assert_eq!(w, Written::Done);
            assert!(kept.is_none());
            assert!(crate::metrics::sample(&series("error")) > errors);
        };
        tokio::join!(client, server);
    }

    #[test]
    fn node_label_values() {
        assert_eq!(node_label_value("worker-1"), "worker-1");
        let long = "n".repeat(64);
        let v = node_label_value(&long);
        assert!(v.starts_with("h-") && v.len() == 42, "{v}");
        assert_eq!(v, node_label_value(&long), "stable");
        assert!(node_label_value("Node.With_Odd-Chars").eq("Node.With_Odd-Chars"));
        assert!(node_label_value("-bad").starts_with("h-"));
    }
}
