//! A node's NodePlans as a plan source of [`crate::reconcile`]: every NodePlan labelled for the
//! node is watched (one watch, relisted after errors); the loop looks at them in the documented
//! order (priority, then age, then name) and runs one at a time; status is written through the
//! status subresource with the object's resourceVersion as the precondition.
//!
//! As for the Secret, the base of a write is the object the agent's own last write returned
//! unless the watch has delivered an event since; an outcome that cannot be written is kept and
//! retried by the loop. A NodePlan deleted while it runs is canceled through the stop ladder (no
//! finalizer: a dead node must not leave objects stuck in Terminating).

use super::resource::{self, NODE_LABEL, NodePlanSpec, NodePlanStatus};
use super::wire::{self, Target};
use crate::apply::{AgentExit, ApplyError, Applyinator, Interrupt};
use crate::flow::Commit;
use crate::plan::ProbeStatus;
use crate::probe::Prober;
use crate::process::{Owner, Source};
use crate::reconcile::{Claim, Look, Observed, Outcome, PlanSource, Reconciler, Seen, View, Written};
use crate::remote::base::WriteBase;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use kube::core::GroupVersionKind;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Every API call is bounded: kube has no read timeout of its own.
const API_TIMEOUT: Duration = Duration::from_secs(15);

/// The API resource of NodePlans.
pub fn api_resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk(resource::GROUP, resource::VERSION, resource::KIND);
    ApiResource::from_gvk_with_plural(&gvk, resource::PLURAL)
}

/// The value of the node label for a node name: the name itself, or for a name longer than a
/// label value may be (63 characters), `h-` and the first 40 hex digits of its SHA-256 (the
/// NodePlan then names the node in `spec.nodeName`).
pub fn node_label_value(node: &str) -> String {
    let valid = node.len() <= 63
        && node.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && node.starts_with(|c: char| c.is_ascii_alphanumeric())
        && node.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        node.to_string()
    } else {
        let hex = crate::plan::checksum(node.as_bytes());
        format!("h-{}", &hex[..40])
    }
}

/// The watch's latest objects, by name, numbered so the source can tell whether they arrived
/// after its own write.
type Latest = (u64, BTreeMap<String, DynamicObject>);

/// Runs the loop over a node's NodePlans.
pub struct NodePlanAgent {
    source: NodePlanSource,
    app: Arc<Applyinator>,
    prober: Arc<Prober>,
}

impl NodePlanAgent {
    pub fn new(
        client: kube::Client,
        namespace: &str,
        node: &str,
        app: Arc<Applyinator>,
        prober: Arc<Prober>,
        probe_period: Duration,
    ) -> NodePlanAgent {
        let api = Api::namespaced_with(client, namespace, &api_resource());
        NodePlanAgent { source: NodePlanSource::new(api, namespace, node, probe_period), app, prober }
    }

    pub async fn run(mut self, shutdown: watch::Receiver<bool>) -> AgentExit {
        let (tx, rx) = watch::channel::<Latest>((0, BTreeMap::new()));
        let selector = format!("{NODE_LABEL}={}", node_label_value(&self.source.node));
        let pump = tokio::spawn(super::watch::pump(self.source.api.clone(), selector.clone(), tx));
        self.source.latest = Some(rx);
        tracing::info!("NodePlan mode: watching NodePlans labelled {selector} in namespace {}", self.source.namespace);
        let (exit, _) = Reconciler::new(self.source, self.app, self.prober, shutdown).run().await;
        pump.abort();
        exit
    }
}

/// A write that could not land yet: the status to write, for the plan it belongs to.
struct Pending {
    checksum: String,
    status: NodePlanStatus,
}

pub struct NodePlanSource {
    api: Api<DynamicObject>,
    namespace: String,
    node: String,
    latest: Option<watch::Receiver<Latest>>,
    /// Per NodePlan, the base of the next write (see [`WriteBase`]).
    own: HashMap<String, WriteBase<DynamicObject>>,
    probe_period: Duration,
    pending: HashMap<String, Pending>,
    /// The last pause/cancel values each running plan saw.
    last_interrupt: HashMap<String, Interrupt>,
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

impl NodePlanSource {
    fn new(api: Api<DynamicObject>, namespace: &str, node: &str, probe_period: Duration) -> NodePlanSource {
        NodePlanSource {
            api,
            namespace: namespace.to_string(),
            node: node.to_string(),
            latest: None,
            own: HashMap::new(),
            probe_period,
            pending: HashMap::new(),
            last_interrupt: HashMap::new(),
        }
    }

    fn seq(&self) -> u64 {
        self.latest.as_ref().map_or(0, |l| l.borrow().0)
    }

    /// Whether a watched object is for this node (the label may be a hash: then `spec.nodeName`
    /// must name the node).
    fn for_this_node(&self, o: &DynamicObject) -> bool {
        let label = o.metadata.labels.as_ref().and_then(|l| l.get(NODE_LABEL));
        match label {
            Some(v) if *v == self.node => true,
            Some(v) if v.starts_with("h-") => {
                o.data.pointer("/spec/nodeName").and_then(|n| n.as_str()) == Some(self.node.as_str())
            }
            _ => false,
        }
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

    /// Replace the status of `name` (for the plan with `checksum`) on the current object. On a
    /// conflict read again: an outcome (`reapply`) is written again on the fresh object if the plan
    /// is unchanged; a transition is abandoned so the new spec is decided afresh.
    async fn write(&mut self, name: &str, checksum: &str, status: &NodePlanStatus, reapply: bool) -> Written {
        let Some(mut base) = self.current(name) else { return Written::Abandoned };
        let Ok(status_value) = serde_json::to_value(status) else { return Written::failed("cannot encode the status") };
        for _ in 0..8 {
            let same_plan = parts(&base).0.ok().and_then(|s| wire::plan_checksum(&s));
            if same_plan.as_deref() != Some(checksum) {
                return Written::Abandoned;
            }
            let mut next = base.clone();
            if let Some(obj) = next.data.as_object_mut() {
                obj.insert("status".into(), status_value.clone());
            }
            // An event the watch delivers while the write is on its way counts as newer.
            let sent = self.seq();
            match tokio::time::timeout(API_TIMEOUT, self.api.replace_status(name, &PostParams::default(), &next)).await
            {
                Ok(Ok(new)) => {
                    self.remember(name, new, sent, &base);
                    return Written::Done;
                }
                Ok(Err(kube::Error::Api(s))) if s.code == 409 => {
                    tracing::info!("{}: status write conflicted (409); reading it again", self.label(name));
                    match tokio::time::timeout(API_TIMEOUT, self.api.get_opt(name)).await {
                        Ok(Ok(Some(fresh))) => {
                            self.remember(name, fresh.clone(), sent, &base);
                            if !reapply {
                                return Written::Abandoned;
                            }
                            base = fresh;
                        }
                        Ok(Ok(None)) => return Written::Abandoned,
                        Ok(Err(e)) => return Written::failed(crate::error_line(&e)),
                        Err(_) => return Written::failed("timed out reading the NodePlan"),
                    }
                }
                Ok(Err(kube::Error::Api(s))) if s.code == 404 => return Written::Abandoned,
                Ok(Err(kube::Error::Api(s))) if s.code == 429 => {
                    let retry_after = s
                        .details
                        .as_ref()
                        .map(|d| d.retry_after_seconds)
                        .filter(|s| *s > 0)
                        .map(|s| Duration::from_secs(u64::from(s)));
                    return Written::Failed { error: "the API server asked to slow down (429)".into(), retry_after };
                }
                Ok(Err(e)) => return Written::failed(crate::error_line(&e)),
                Err(_) => return Written::failed("timed out writing the NodePlan status"),
            }
        }
        Written::failed("the NodePlan kept changing under every write")
    }

    /// Write an outcome that must not be lost: kept when it fails, retried through `flush`.
    async fn write_outcome(&mut self, name: &str, checksum: &str, status: NodePlanStatus) -> Written {
        let w = self.write(name, checksum, &status, true).await;
        if matches!(w, Written::Failed { .. }) {
            self.pending.insert(name.to_string(), Pending { checksum: checksum.to_string(), status });
        }
        w
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
            Ok(Err(e)) => tracing::warn!("{}: cannot write its status: {}", self.label(name), crate::error_line(&e)),
            Err(_) => tracing::warn!("{}: cannot write its status: timed out", self.label(name)),
        }
    }
}

impl PlanSource for NodePlanSource {
    type Key = String;

    async fn changed(&mut self) -> bool {
        match self.latest.as_mut() {
            Some(l) => l.changed().await.is_ok(),
            None => std::future::pending().await,
        }
    }

    async fn keys(&mut self) -> Vec<String> {
        let Some(l) = &self.latest else { return Vec::new() };
        let objects: Vec<DynamicObject> = l.borrow().1.values().cloned().collect();
        let mut ranked: Vec<(i32, String, String)> = objects
            .iter()
            .filter(|o| self.for_this_node(o))
            .map(|o| {
                let priority = o.data.pointer("/spec/priority").and_then(|p| p.as_i64()).unwrap_or(0);
                let created = o.metadata.creation_timestamp.as_ref().map(|t| t.0.to_string()).unwrap_or_default();
                (
                    priority.clamp(i32::MIN.into(), i32::MAX.into()) as i32,
                    created,
                    o.metadata.name.clone().unwrap_or_default(),
                )
            })
            .collect();
        ranked.sort_by(|a, b| wire::order((a.0, &a.1, &a.2), (b.0, &b.1, &b.2)));
        self.own.retain(|name, _| ranked.iter().any(|r| r.2 == *name));
        ranked.into_iter().map(|r| r.2).collect()
    }

    async fn look(&mut self, name: &String) -> Seen {
        let Some(o) = self.current(name) else { return Seen::Nothing };
        let generation = o.metadata.generation.unwrap_or_default();
        let label = self.label(name);
        let spec_value = o.data.get("spec").cloned().unwrap_or_default();
        if let Err(e) = resource::check_spec(&spec_value) {
            self.refuse(name, &o, e.reason(), &e.to_string()).await;
            return Seen::Bad { checksum: format!("generation {generation}"), error: format!("{label}: {e}") };
        }
        let (spec, status) = parts(&o);
        let spec = match spec {
            Ok(s) => s,
            Err(e) => {
                self.refuse(name, &o, "InvalidSpec", &e).await;
                return Seen::Bad { checksum: format!("generation {generation}"), error: format!("{label}: {e}") };
            }
        };
        let (vp, checksum) = match wire::valid_plan(&spec) {
            Ok(v) => v,
            Err(e) => {
                self.refuse(name, &o, "InvalidPlan", &e).await;
                return Seen::Bad { checksum: format!("generation {generation}"), error: format!("{label}: {e}") };
            }
        };
        let total = vp.plan.instructions.len();
        let snap = wire::snapshot(&spec, &status, &checksum, total);
        let attempt = wire::attempt(&status, &checksum);
        Seen::Plan(Box::new(Look {
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
            probe_statuses: status.probe_statuses.clone(),
            retry_in: None,
            checksum,
            plan: vp,
        }))
    }

    async fn commit(&mut self, name: &String, look: &Look, commit: &Commit) -> Written {
        let t = Target {
            generation: self.generation(name),
            checksum: &look.checksum,
            total: look.plan.plan.instructions.len(),
        };
        let next = wire::commit(&self.status_of(name), t, commit, chrono::Utc::now());
        self.write(name, &look.checksum, &next, false).await
    }

    async fn record(&mut self, name: &String, look: &Look, outcome: Outcome<'_>) -> Written {
        let Some(rec) = &outcome.record else { return Written::Done };
        let t = Target {
            generation: self.generation(name),
            checksum: &look.checksum,
            total: look.plan.plan.instructions.len(),
        };
        let mut next =
            wire::record(&self.status_of(name), t, rec, outcome.result, outcome.probes.as_ref(), chrono::Utc::now());
        if next.state.is_none() && next.plan_checksum.is_empty() {
            next.plan_checksum = look.checksum.clone();
        }
        self.write_outcome(name, &look.checksum, next).await
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
        self.write_outcome(name, checksum, next).await
    }

    async fn flush(&mut self, name: &String) -> Written {
        let Some(p) = self.pending.remove(name) else { return Written::Done };
        self.write_outcome(name, &p.checksum, p.status).await
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
        if let Ok(spec) = parts(&o).0 {
            let same = wire::plan_checksum(&spec).as_deref() == Some(look.checksum.as_str());
            let forced =
                o.metadata.annotations.as_ref().and_then(|a| a.get(resource::FORCE_UPDATE)).map(String::as_str)
                    == Some("true");
            if same {
                *last = Interrupt { pause: spec.paused, cancel: spec.canceled, shutdown: false };
            } else if forced {
                last.cancel = true;
            }
        }
        Observed { interrupt: *last, note: None }
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

    fn period(&self) -> Duration {
        self.probe_period
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
