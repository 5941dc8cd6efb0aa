//! One agent per plan source: a Kubernetes Lease (`coordination.k8s.io/v1`) held while remote
//! mode (per plan Secret) or NodePlan mode (per node) runs, so two agents never act on one plan
//! source (a cloned machine image carrying the same connection info, a second agent started by
//! hand). A second agent waits, saying once who holds the Lease, and takes it when the holder lets
//! go (a clean stop releases it at once) or stops renewing it.
//!
//! This module owns the Lease object and nothing else: it does not know plans. [`decide`] is the
//! rule, a pure function of what the Lease shows and how long it has shown it; [`hold`] is the
//! I/O around it.
//!
//! - **Expiry by local observation, not by clocks.** A Lease is taken over when it has not changed
//!   for its `leaseDurationSeconds` *as this agent observed it* (client-go's leader election does
//!   the same), so clock skew between nodes never hands over a Lease early.
//! - **A restart on the same node takes over at once.** The holder identity is
//!   `<node>/<boot id>/<pid namespace>/<pid>/<start time>`: the same node in the same boot and PID
//!   namespace whose holder process (that pid, started then) no longer runs is the previous
//!   incarnation of this agent (a crash, a `systemctl restart`); a re-exec of the agent keeps all
//!   of it and so its identity. An agent in another PID namespace (a container beside the host's
//!   agent) is another holder, even at the same pid, and its Lease is taken only at its expiry.
//! - **An outage is not a loss.** While the API server cannot be reached, the holder keeps acting
//!   (and renewing is retried): nobody else can take the Lease without the API server either. The
//!   Lease is lost only on evidence: a renewal refused because another holder wrote the Lease.
//!   Limit: an agent cut off from the API server while another reaches it keeps running its
//!   current plan until it reconnects and finds the Lease gone; the Lease serialises agents, it
//!   cannot fence a partitioned one.
//! - **No permission, no Lease.** An account that may not read or write Leases (Rancher's
//!   per-machine role grants the plan Secret only) gets one warning and runs without one.
//! - **Cost.** One small write per quarter of the duration while a plan executes (with the
//!   default 40 s, one every 10 s or up to a second sooner, as the kubelet's own node Lease;
//!   spread out, so a fleet's agents do not renew in the same second). An idle holder states 24
//!   times the duration and renews at half of that (every 8 min by default); a plan that starts
//!   has the Lease renewed at once with the configured duration. A waiting agent watches the Lease
//!   (the one list/watch, `k8s::watch`, of the one object) and writes nothing.
//! - **The holder watches its own Lease.** A write that is not its own (emptied, another duration,
//!   another holder) is renewed over, or found lost, as soon as it is seen; until that renewal
//!   lands the holder acts only as long as a waiter counting from that write would wait.
//! - **Acting is counted from the last renewal, with the configured duration.** The idle duration
//!   holds a waiting agent off only while nobody else writes the Lease, so an idle holder does not
//!   act on it: a plan that starts pulls the fence in to the configured duration, and before a start
//!   or a write the agent asks for a renewal unless its last one leaves it margin (R26).

use crate::k8s::watch::Latest;
use crate::reconcile::gate::FreshRequest;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

pub use crate::config::{LEASE_MAX_DURATION as MAX_DURATION, LEASE_MIN_DURATION as MIN_DURATION};
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the holder's stop ladder is given beyond its stop and kill timeouts (R26).
const FENCE_GRACE: Duration = Duration::from_secs(2);
/// While no plan executes the Lease states this many times the configured duration, and so is
/// renewed at half of that (R24): a 40 s Lease states 16 min and is written every 8 min.
/// A waiting agent on another machine waits that long for a dead idle holder; a restart on the
/// same machine takes over at once.
const IDLE_FACTOR: u32 = 24;
/// After a failed renewal, the next attempt comes this soon (not a quarter of the duration later).
const RETRY_RENEWAL: Duration = Duration::from_secs(1);
/// Who gave the Lease up (set with the empty holder by a clean release): a restarted agent on the
/// same machine takes a Lease its own earlier incarnation released at once.
pub const RELEASED_BY: &str = "nodeplan.cattle.io/released-by";

/// What the holder's agent tells its renewer (R24, R26).
pub struct Activity {
    /// Whether a plan of the source executes.
    pub busy: watch::Receiver<bool>,
    /// Asked before the agent starts a plan or writes ([`crate::reconcile::gate::Gate::fresh`]).
    pub fresh: tokio::sync::mpsc::Receiver<FreshRequest>,
}

impl Activity {
    /// Always busy and never asked: a command's Lease.
    fn always_busy() -> Activity {
        Activity { busy: watch::channel(true).1, fresh: tokio::sync::mpsc::channel(1).1 }
    }
}

/// Where the Lease is and who this agent is.
#[derive(Debug, Clone)]
pub struct LeaseRef {
    pub namespace: String,
    pub name: String,
    /// `<node>/<boot id>/<pid namespace>/<pid>/<start time>` (see [`identity`]).
    pub identity: String,
    pub duration: Duration,
    /// The longest the holder's stop ladder takes (`stopTimeout` + `killTimeout`): the holder
    /// stops acting that long (and [`FENCE_GRACE`]) before another agent could take the Lease.
    pub stop_budget: Duration,
    /// What the Lease guards, for log lines (`secret ns/name`, `NodePlans of node n`).
    pub what: String,
}

impl LeaseRef {
    /// How long after the send time of its last successful renewal the holder may act (R26): the
    /// duration less the stop ladder and the grace.
    pub fn valid_for(&self) -> Duration {
        self.valid_for_stated(self.duration)
    }

    /// The same, after a renewal that left `stated` in the Lease (the idle duration, or the
    /// configured one).
    pub fn valid_for_stated(&self, stated: Duration) -> Duration {
        stated.saturating_sub(self.stop_budget + FENCE_GRACE)
    }

    /// The duration the Lease states while no plan executes (R24): [`IDLE_FACTOR`] times the
    /// configured one, within [`MAX_DURATION`] (and never shorter than the configured one).
    pub fn idle_duration(&self) -> Duration {
        (self.duration * IDLE_FACTOR).min(MAX_DURATION).max(self.duration)
    }

    /// The renewal period: a quarter of the duration.
    fn period(&self) -> Duration {
        self.duration / 4
    }

    /// How often a Lease stating `stated` is renewed: a quarter of it, as the kubelet's node Lease,
    /// or half of the idle duration (R24), when nothing the holder does depends on it.
    fn pace(&self, stated: Duration) -> Duration {
        if stated > self.duration { stated / 2 } else { stated / 4 }
    }
}

/// The shortest Lease duration that leaves a holder one renewal period to spare before it must
/// stop acting (R26): `(stop budget + grace) × 4/3`, at least [`MIN_DURATION`].
pub fn shortest_safe_duration(stop_budget: Duration) -> Duration {
    let secs = ((stop_budget + FENCE_GRACE).as_secs_f64() * 4.0 / 3.0).ceil();
    Duration::from_secs_f64(secs).max(MIN_DURATION)
}

/// A duration read from a Lease object (someone else may have written it), kept within what a
/// configuration may say.
pub fn clamped(d: Duration) -> Duration {
    d.clamp(MIN_DURATION, MAX_DURATION)
}

/// The Lease name for a plan source: `nodeplan-<source>`, cut with a hash to a valid name.
pub fn lease_name(source: &str) -> String {
    let name = format!("nodeplan-{source}");
    if name.len() <= 253 {
        return name;
    }
    let hash = crate::plan::checksum(source.as_bytes());
    let cut: String = name.chars().take(253 - 17).collect();
    format!("{}-{}", cut.trim_end_matches(['-', '.']), &hash[..16])
}

/// This agent's holder identity: `<node>/<boot id>/<pid namespace>/<pid>/<start time>`. Unique
/// per process on a machine in one boot: two agents in separate PID namespaces (a containerized
/// agent beside the host's) differ in the namespace even when both are pid 1, and a pid reused
/// after a crash differs in its start time. A re-exec of the agent keeps all three (R23).
pub fn identity(node: &str) -> String {
    let boot = crate::process::boot_id().unwrap_or_default();
    match crate::process::own_identity() {
        Ok((ns, pid, start)) => format!("{node}/{boot}/{ns}/{pid}/{start}"),
        // Without /proc nothing of this machine can be told apart: never taken for a previous
        // incarnation (`this_machines` needs all five fields).
        Err(_) => format!("{node}/{boot}/{}", std::process::id()),
    }
}

/// An agent process of this machine, as its identity names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incarnation {
    pub pid: i32,
    pub start: u64,
}

/// Whether `holder` is an earlier incarnation of this agent that is gone: the same node in the
/// same boot and PID namespace, whose process (that pid with that start time) no longer runs.
pub fn previous_incarnation_gone(holder: &str, me: &str, running: impl Fn(Incarnation) -> bool) -> bool {
    this_machines(holder, me).is_some_and(|p| !running(p))
}

/// `id` split into node, boot id, PID namespace, pid and start time (the last four fields: a
/// node name cannot confuse the split).
fn fields(id: &str) -> Option<(&str, &str, u64, Incarnation)> {
    let mut it = id.rsplitn(5, '/');
    let start = it.next()?.parse().ok()?;
    let pid = it.next()?.parse().ok()?;
    let ns = it.next()?.parse().ok()?;
    let boot = it.next()?;
    let node = it.next()?;
    Some((node, boot, ns, Incarnation { pid, start }))
}

/// The process of `holder` when it is an agent of this machine that this agent can see: the same
/// node, boot and PID namespace. An identity of another form (an older agent's `node/boot/pid`,
/// whose namespace is unknown) never is: its Lease is taken at its expiry.
fn this_machines(holder: &str, me: &str) -> Option<Incarnation> {
    match (fields(holder), fields(me)) {
        (Some((hn, hb, hns, p)), Some((mn, mb, mns, _))) if hn == mn && hb == mb && hns == mns && !hb.is_empty() => {
            Some(p)
        }
        _ => None,
    }
}

/// Whether `id` names this very process: its identity, or the `node/boot/pid` an older build
/// gave it before it executed this one (R23: a release by the old program is this process's).
fn is_me(id: &str, me: &str) -> bool {
    id == me
        || fields(me)
            .is_some_and(|(node, boot, _, _)| !boot.is_empty() && id == format!("{node}/{boot}/{}", std::process::id()))
}

/// What the Lease shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub holder: Option<String>,
    pub resource_version: String,
    /// `leaseDurationSeconds`, clamped ([`clamped`]).
    pub duration: Option<Duration>,
    /// Who released it ([`RELEASED_BY`]), when the holder is empty.
    pub released_by: Option<String>,
}

/// What to do about the Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// No Lease: create it.
    Create,
    /// Take it over (free, expired, or held by a gone incarnation of this agent).
    Take,
    /// It is ours: renew it.
    Renew,
    /// Another holder, or an empty holder (`None`): look again; it may be taken after `remaining`
    /// more without a change.
    Wait { holder: Option<String>, remaining: Duration },
}

/// The rule (R24, R26). `unchanged_for` is how long this agent has seen the same
/// resourceVersion; `gone` says whether the holder (or, for a released Lease, the releaser) is a
/// gone incarnation of this agent; `own` is this agent's configured duration.
///
/// A Lease is taken over only once this agent has seen it unchanged for the longer of its own
/// duration and the one the Lease states, whoever holds it, and even when its holder is empty: a
/// holder that is still renewing changes it within that time (a holder whose Lease was cleared by
/// someone else takes it back), and one that is not renewing has stopped acting by then (R26). The
/// exceptions are this very process (released before it executed itself anew) and an earlier
/// incarnation of this agent on this machine whose process is gone.
pub fn decide(seen: Option<&Seen>, me: &str, unchanged_for: Duration, own: Duration, gone: bool) -> Step {
    let Some(seen) = seen else { return Step::Create };
    let holder = match seen.holder.as_deref() {
        // Released by this very process (it executes itself anew, R23: the same pid).
        None | Some("") if seen.released_by.as_deref().is_some_and(|r| is_me(r, me)) => return Step::Take,
        None | Some("") => None,
        Some(h) if h == me => return Step::Renew,
        Some(h) => Some(h.to_string()),
    };
    let expiry = seen.duration.unwrap_or(own).max(own);
    if gone || unchanged_for >= expiry {
        return Step::Take;
    }
    Step::Wait { holder, remaining: expiry - unchanged_for }
}

fn seen_of(l: &Lease) -> Seen {
    let spec = l.spec.as_ref();
    Seen {
        holder: spec.and_then(|s| s.holder_identity.clone()),
        resource_version: l.metadata.resource_version.clone().unwrap_or_default(),
        duration: spec
            .and_then(|s| s.lease_duration_seconds)
            .and_then(|d| u64::try_from(d).ok())
            .map(|d| clamped(Duration::from_secs(d))),
        released_by: l.metadata.annotations.as_ref().and_then(|a| a.get(RELEASED_BY)).cloned(),
    }
}

/// A holder identity someone else wrote, for a log line: quoted and escaped, cut when long.
fn shown_holder(h: &str) -> String {
    if h.len() <= 253 { format!("{h:?}") } else { crate::plan::shown_value(h) }
}

fn now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

/// A duration as `leaseDurationSeconds`.
fn seconds(d: Duration) -> i32 {
    i32::try_from(d.as_secs()).unwrap_or(i32::MAX)
}

/// The Lease as this agent writes it when taking it (from `old`, or new).
fn taken(r: &LeaseRef, old: Option<&Lease>) -> Lease {
    let mut l = old.cloned().unwrap_or_else(|| Lease {
        metadata: ObjectMeta {
            name: Some(r.name.clone()),
            namespace: Some(r.namespace.clone()),
            labels: Some([("app.kubernetes.io/managed-by".to_string(), "nodeplan".to_string())].into()),
            ..Default::default()
        },
        spec: None,
    });
    if let Some(a) = l.metadata.annotations.as_mut() {
        a.remove(RELEASED_BY);
    }
    let transitions = l.spec.as_ref().and_then(|s| s.lease_transitions).unwrap_or(0);
    let changed = old.is_some_and(|o| seen_of(o).holder.as_deref() != Some(r.identity.as_str()));
    l.spec = Some(LeaseSpec {
        holder_identity: Some(r.identity.clone()),
        lease_duration_seconds: Some(seconds(r.duration)),
        acquire_time: Some(now()),
        renew_time: Some(now()),
        lease_transitions: Some(transitions + i32::from(changed)),
        ..Default::default()
    });
    l
}

/// Why a request about the Lease did not succeed.
enum Refusal {
    /// The account may not use Leases here: run without one.
    Forbidden(String),
    /// Someone else wrote the Lease first (409).
    Conflict,
    Other(String),
}

fn refusal(e: kube::Error) -> Refusal {
    match &e {
        kube::Error::Api(s) if s.code == 403 => Refusal::Forbidden(crate::k8s::error_line(&e)),
        kube::Error::Api(s) if s.code == 409 => Refusal::Conflict,
        _ => Refusal::Other(crate::k8s::error_line(&e)),
    }
}

async fn bounded<T>(f: impl std::future::Future<Output = Result<T, kube::Error>>) -> Result<T, Refusal> {
    bounded_by(REQUEST_TIMEOUT, f).await
}

async fn bounded_by<T>(
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, Refusal> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r.map_err(refusal),
        Err(_) => Err(Refusal::Other("no answer".into())),
    }
}

/// A held Lease (or none, where the account may not use Leases): renewed in the background until
/// [`Held::release`]. `lost` turns true when another holder took it.
pub struct Held {
    renewer: Option<tokio::task::JoinHandle<()>>,
    lost: watch::Receiver<bool>,
    /// Whether the holder may act now (R26): renewed in time. Always true without a Lease.
    acting: watch::Receiver<bool>,
    release: Option<(Api<Lease>, LeaseRef)>,
    /// Released by a command (`take_now`), whose output is its own: the release is logged at
    /// debug, not info.
    quiet: bool,
}

impl Held {
    /// Turns true when the Lease was taken by another holder.
    pub fn lost(&self) -> watch::Receiver<bool> {
        self.lost.clone()
    }

    /// The fence (R26): true while this agent may act on the plan source (its last successful
    /// renewal is recent enough that nobody else can have taken the Lease over).
    pub fn acting(&self) -> watch::Receiver<bool> {
        self.acting.clone()
    }

    /// Stop renewing and (if it is still ours) give the Lease up, so another agent (or this one
    /// restarted) takes it at once.
    pub async fn release(mut self) {
        if let Some(t) = self.renewer.take() {
            t.abort();
        }
        let Some((api, r)) = self.release.take() else { return };
        if *self.lost.borrow() {
            return;
        }
        // One bound for the read and the write together: a release that cannot land (the network
        // is down) holds the agent's exit up no longer than one request would; the Lease then
        // expires by itself.
        let released = bounded(async {
            let mut l = api.get(&r.name).await?;
            if seen_of(&l).holder.as_deref() != Some(r.identity.as_str()) {
                return Ok(false);
            }
            if let Some(spec) = l.spec.as_mut() {
                spec.holder_identity = None;
                spec.renew_time = Some(now());
                // Stopped acting: a waiting agent need not wait out the idle duration.
                spec.lease_duration_seconds = Some(seconds(r.duration));
            }
            l.metadata.annotations.get_or_insert_default().insert(RELEASED_BY.to_string(), r.identity.clone());
            api.replace(&r.name, &PostParams::default(), &l).await.map(|_| true)
        })
        .await;
        match released {
            Ok(false) => {}
            Ok(true) if self.quiet => tracing::debug!("released the Lease {}/{} on {}", r.namespace, r.name, r.what),
            Ok(true) => tracing::info!("released the Lease {}/{} on {}", r.namespace, r.name, r.what),
            Err(_) => tracing::debug!("could not release the Lease {}/{}; it expires by itself", r.namespace, r.name),
        }
    }
}

/// Take the Lease, waiting while another agent holds it (saying so once per holder), until taken
/// or `shutdown`. `None`: shut down while waiting.
pub async fn hold(
    client: kube::Client,
    r: LeaseRef,
    mut shutdown: watch::Receiver<bool>,
    activity: Activity,
) -> Option<Held> {
    let api: Api<Lease> = Api::namespaced(client, &r.namespace);
    let pace = r.duration / 4;
    let mut observed: Option<(String, Instant)> = None;
    let mut told: Option<String> = None;
    let mut failing = false;
    // Once it waits, the agent watches the Lease through the one list/watch (`k8s::watch`): a
    // release, or a holder that stops renewing, is seen as it happens. The first read, and a
    // read after a conflict or an error, asks the API server itself (the watch may lag behind
    // the write that won, and a refusal must be heard).
    let (tx, mut watched) = watch::channel::<Latest<Lease>>((0, Default::default()));
    let (mut tx, mut _pump) = (Some(tx), None);
    let mut fresh = true;
    // The duration of the Lease last seen, once one was seen.
    let mut seen_before: Option<Option<Duration>> = None;
    loop {
        if *shutdown.borrow() {
            return None;
        }
        let current = if std::mem::take(&mut fresh) || watched.borrow().0 == 0 {
            match bounded(api.get_opt(&r.name)).await {
                Ok(l) => l,
                Err(Refusal::Forbidden(e)) => return Some(without_lease(&r, &e)),
                Err(Refusal::Conflict) => continue,
                Err(Refusal::Other(e)) => {
                    if !failing {
                        tracing::warn!("cannot read the Lease {}/{} ({e}); trying again", r.namespace, r.name);
                    }
                    (failing, fresh) = (true, true);
                    wait(&mut shutdown, pace).await;
                    continue;
                }
            }
        } else {
            watched.borrow_and_update().1.get(&r.name).cloned()
        };
        failing = false;
        let mut seen = current.as_ref().map(seen_of);
        // A Lease that was there and is gone was deleted by someone else, maybe while its holder
        // still acts (R26): as an emptied one, it is taken only once it has stayed away for the
        // duration.
        match &seen {
            Some(s) => seen_before = Some(s.duration),
            None => {
                if let Some(duration) = seen_before {
                    seen = Some(Seen { holder: None, resource_version: String::new(), duration, released_by: None });
                }
            }
        }
        let rv = seen.as_ref().map(|s| s.resource_version.clone()).unwrap_or_default();
        let since = match &observed {
            Some((o, at)) if *o == rv => *at,
            _ => {
                observed = Some((rv, Instant::now()));
                Instant::now()
            }
        };
        // The last holder (or who released it), when it is an agent of this machine: gone, its
        // Lease is taken at once; alive, it may be on its way out (a release is seen before the
        // releasing process has exited), so its pid is looked at every second.
        let local = seen
            .as_ref()
            .and_then(|s| s.holder.as_deref().filter(|h| !h.is_empty()).or(s.released_by.as_deref()))
            .and_then(|h| this_machines(h, &r.identity));
        let gone = local.is_some_and(|p| !crate::process::running(p.pid, p.start));
        let step = decide(seen.as_ref(), &r.identity, since.elapsed(), r.duration, gone);
        let sent = Instant::now();
        let attempt = match step {
            Step::Wait { holder, remaining } => {
                let who = holder.clone().unwrap_or_default();
                if told.as_deref() != Some(who.as_str()) {
                    match &holder {
                        Some(h) => tracing::warn!(
                            "waiting for the Lease {}/{}: another agent ({}) acts on {}; taking over if it stops renewing for {}",
                            r.namespace,
                            r.name,
                            shown_holder(h),
                            r.what,
                            crate::duration::human(remaining)
                        ),
                        None => tracing::warn!(
                            "waiting for the Lease {}/{} on {}: it has no holder, but a holder may still be stopping; taking it if it stays unchanged for {}",
                            r.namespace,
                            r.name,
                            r.what,
                            crate::duration::human(remaining)
                        ),
                    }
                    told = Some(who);
                    let why = match holder.as_deref() {
                        Some(h) => format!("held by {}", shown_holder(h)),
                        None => "no holder, but the last one may still be stopping".to_string(),
                    };
                    shown(&r.what, &format!("waiting ({why})"), false);
                }
                if let Some(tx) = tx.take() {
                    let lw = crate::k8s::watch::KubeListWatch::named(api.clone(), &r.name);
                    let what = format!("the Lease {}/{}", r.namespace, r.name);
                    _pump = Some(crate::AbortOnDrop(tokio::spawn(crate::k8s::watch::pump(lw, what, tx))));
                }
                // Until the Lease changes (or the watch lists it again), or it may be taken.
                let nap = if local.is_some() { remaining.min(Duration::from_secs(1)) } else { remaining };
                tokio::select! {
                    () = wait(&mut shutdown, nap) => {}
                    Ok(()) = watched.changed() => {}
                }
                continue;
            }
            Step::Create => bounded(api.create(&PostParams::default(), &taken(&r, None))).await,
            Step::Take | Step::Renew => match &current {
                Some(c) => bounded(api.replace(&r.name, &PostParams::default(), &taken(&r, Some(c)))).await,
                None => bounded(api.create(&PostParams::default(), &taken(&r, None))).await,
            },
        };
        match attempt {
            Ok(l) => {
                tracing::info!("holding the Lease {}/{} on {} as {}", r.namespace, r.name, r.what, r.identity);
                shown(&r.what, &format!("held as {}", r.identity), true);
                return Some(renewing(api, r, l, sent, activity));
            }
            Err(Refusal::Forbidden(e)) => return Some(without_lease(&r, &e)),
            // Another agent wrote it first: read it again.
            Err(Refusal::Conflict) => fresh = true,
            Err(Refusal::Other(e)) => {
                if !failing {
                    tracing::warn!("cannot take the Lease {}/{} ({e}); trying again", r.namespace, r.name);
                }
                (failing, fresh) = (true, true);
                wait(&mut shutdown, pace).await;
            }
        }
    }
}

/// Whether a Lease seen now is held by someone: a holder that renewed it within its duration by
/// `now` (comparing the Lease's `renewTime` with this machine's clock: for a command run once,
/// which cannot watch the Lease for a duration first; skew between the clocks shifts the expiry).
fn fresh_holder(l: &Lease, now: k8s_openapi::jiff::Timestamp) -> Option<String> {
    let spec = l.spec.as_ref()?;
    let holder = spec.holder_identity.clone().filter(|h| !h.is_empty())?;
    let renewed = spec.renew_time.as_ref().map(|t| t.0)?;
    let stated = u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0);
    let duration = i64::try_from(clamped(Duration::from_secs(stated)).as_millis()).unwrap_or(i64::MAX);
    (renewed.as_millisecond() + duration > now.as_millisecond()).then_some(holder)
}

/// The holder of the Lease `name` in `namespace` if someone holds it now (see [`fresh_holder`]);
/// `None` when it is free, stale, absent or cannot be read.
pub async fn active_holder(client: kube::Client, namespace: &str, name: &str) -> Option<String> {
    let api: Api<Lease> = Api::namespaced(client, namespace);
    let l = bounded(api.get_opt(name)).await.ok()??;
    fresh_holder(&l, k8s_openapi::jiff::Timestamp::now())
}

/// Take the Lease now or say who holds it (for a command, which refuses instead of waiting):
/// `Ok(Some)` held (renewed until released), `Ok(None)` the account may not use Leases (one
/// warning; go on without), `Err` the holder, or why it could not be taken.
pub async fn take_now(client: kube::Client, r: LeaseRef) -> Result<Option<Held>, String> {
    let api: Api<Lease> = Api::namespaced(client, &r.namespace);
    for _ in 0..3 {
        let current = match bounded(api.get_opt(&r.name)).await {
            Ok(l) => l,
            Err(Refusal::Forbidden(e)) => {
                without_lease(&r, &e);
                return Ok(None);
            }
            Err(Refusal::Conflict) => continue,
            Err(Refusal::Other(e)) => return Err(format!("cannot read the Lease {}/{}: {e}", r.namespace, r.name)),
        };
        if let Some(holder) = current.as_ref().and_then(|l| fresh_holder(l, k8s_openapi::jiff::Timestamp::now()))
            && holder != r.identity
            && !previous_incarnation_gone(&holder, &r.identity, |p| crate::process::running(p.pid, p.start))
        {
            return Err(format!("held by {holder}"));
        }
        let sent = Instant::now();
        let attempt = match &current {
            None => bounded(api.create(&PostParams::default(), &taken(&r, None))).await,
            Some(_) => bounded(api.replace(&r.name, &PostParams::default(), &taken(&r, current.as_ref()))).await,
        };
        match attempt {
            // A command's Lease is renewed as a busy agent's.
            Ok(l) => return Ok(Some(Held { quiet: true, ..renewing(api, r, l, sent, Activity::always_busy()) })),
            Err(Refusal::Forbidden(e)) => {
                without_lease(&r, &e);
                return Ok(None);
            }
            Err(Refusal::Conflict) => continue,
            Err(Refusal::Other(e)) => return Err(format!("cannot take the Lease {}/{}: {e}", r.namespace, r.name)),
        }
    }
    Err(format!("the Lease {}/{} keeps changing", r.namespace, r.name))
}

/// The Lease just taken (`l`, as written by a request sent at `sent`), renewed in the background
/// from now on.
fn renewing(api: Api<Lease>, r: LeaseRef, l: Lease, sent: Instant, activity: Activity) -> Held {
    let (tx, lost) = watch::channel(false);
    let (acting_tx, acting) = watch::channel(true);
    // The holder watches its own Lease (the one list/watch): a write by someone else is seen as
    // it happens, not at the next renewal.
    let (changes_tx, changes) = watch::channel::<Latest<Lease>>((0, Default::default()));
    let lw = crate::k8s::watch::KubeListWatch::named(api.clone(), &r.name);
    let what = format!("the Lease {}/{}", r.namespace, r.name);
    let pump = crate::AbortOnDrop(tokio::spawn(crate::k8s::watch::pump(lw, what, changes_tx)));
    let task = renew(api.clone(), r.clone(), l, tx, acting_tx, sent, activity, changes);
    let renewer = tokio::spawn(async move {
        let _pump = pump;
        task.await
    });
    Held { renewer: Some(renewer), lost, acting, release: Some((api, r)), quiet: false }
}

/// The Lease's state on `nodeplan status` and whether it is held in the metrics, together.
fn shown(what: &str, state: &str, held: bool) {
    crate::board::lease(what, state);
    crate::metrics::lease_held(what, held);
}

fn without_lease(r: &LeaseRef, e: &str) -> Held {
    tracing::warn!(
        "running without the Lease {}/{} on {}: this account may not use Leases there ({e}); nothing keeps a second agent or rollout off it (grant get, list, watch, create and update on coordination.k8s.io leases to turn it on)",
        r.namespace,
        r.name,
        r.what
    );
    crate::board::lease(&r.what, "off: this account may not use Leases");
    let (_, lost) = watch::channel(false);
    let (_, acting) = watch::channel(true);
    Held { renewer: None, lost, acting, release: None, quiet: false }
}

async fn wait(shutdown: &mut watch::Receiver<bool>, d: Duration) {
    let _ = tokio::time::timeout(d, shutdown.wait_for(|s| *s)).await;
}

/// What a renewal found.
enum Renewal {
    /// Ours, as written (or as read back: someone else touched it but left us holding it).
    Ours(Box<Lease>),
    /// Someone else holds it now.
    Lost(String),
    /// No answer, or a refusal: try again soon.
    Failed(String),
}

/// One renewal: a replace conditional on the version last seen. On a conflict the Lease is read
/// again: still ours (someone else wrote something else into it), it is renewed on top of what it
/// says, since a waiting agent counts its wait from the last write it saw, which is not ours; emptied
/// or deleted by someone else (nobody took it), it is taken back at once (conditionally too: a
/// taker that wrote first wins); held by another, it is lost.
async fn renew_once(api: &Api<Lease>, r: &LeaseRef, mine: &Lease, duration: Duration, limit: Duration) -> Renewal {
    let renewed = |l: &Lease| {
        let mut next = l.clone();
        if let Some(spec) = next.spec.as_mut() {
            spec.renew_time = Some(now());
            // What someone else wrote into it is put back: the duration is the holder's.
            spec.lease_duration_seconds = Some(seconds(duration));
        }
        next
    };
    match bounded_by(limit, api.replace(&r.name, &PostParams::default(), &renewed(mine))).await {
        Ok(l) => return Renewal::Ours(Box::new(l)),
        Err(Refusal::Conflict) => {}
        Err(Refusal::Forbidden(e) | Refusal::Other(e)) => return Renewal::Failed(e),
    }
    let back = match bounded_by(limit, api.get_opt(&r.name)).await {
        Ok(Some(l)) => match seen_of(&l).holder.filter(|h| !h.is_empty()) {
            Some(h) if h == r.identity => {
                return match bounded_by(limit, api.replace(&r.name, &PostParams::default(), &renewed(&l))).await {
                    Ok(l) => Renewal::Ours(Box::new(l)),
                    Err(Refusal::Conflict) => Renewal::Failed("the Lease changed while it was renewed".into()),
                    Err(Refusal::Forbidden(e) | Refusal::Other(e)) => Renewal::Failed(e),
                };
            }
            Some(h) => return Renewal::Lost(h),
            None => bounded_by(limit, api.replace(&r.name, &PostParams::default(), &taken(r, Some(&l)))).await,
        },
        Ok(None) => bounded_by(limit, api.create(&PostParams::default(), &taken(r, None))).await,
        Err(Refusal::Forbidden(e) | Refusal::Other(e)) => return Renewal::Failed(e),
        Err(Refusal::Conflict) => return Renewal::Failed("conflict".into()),
    };
    match back {
        Ok(l) => {
            tracing::warn!(
                "the Lease {}/{} was emptied or deleted by someone else; taken back (this agent never stopped holding it)",
                r.namespace,
                r.name
            );
            Renewal::Ours(Box::new(l))
        }
        // Someone wrote first: the next attempt reads who.
        Err(Refusal::Conflict) => Renewal::Failed("the Lease changed while it was taken back".into()),
        Err(Refusal::Forbidden(e) | Refusal::Other(e)) => Renewal::Failed(e),
    }
}

/// Renew every [`LeaseRef::pace`] of the duration in force (up to a tenth early; the first renewal, the first
/// after failures and the first after the duration in force changed, at a random point of the
/// quarter's second half, so that a fleet whose agents took their Leases together, after a rollout
/// or an outage, or went idle together, does not renew them all in the same second) until another
/// holder shows up; after a failure, again within a second or so.
///
/// The duration in force is the configured one while a plan executes (`busy`) and for one
/// duration after; otherwise the idle one ([`LeaseRef::idle_duration`]), so an idle agent writes
/// its Lease a 48th as often. A plan that starts while the Lease states the idle duration has it
/// renewed at once with the configured one.
///
/// `acting` (the fence, R26) is true only until `valid_until`: the send time of the last renewal
/// that succeeded plus what the duration it left in force allows ([`LeaseRef::valid_for_stated`]).
/// A renewal that shortens the duration counts as landed from its sending (its answer may be
/// lost while a waiting agent already sees it): a holder that cannot renew stops acting before
/// anybody could take the Lease over.
///
/// The idle duration holds off waiting agents only while nobody else writes the Lease: one that
/// rewrites it (emptied, or stating a shorter duration) starts a waiting agent's count of the
/// configured duration. So the agent acts only within [`LeaseRef::valid_for`] of the last renewal
/// that succeeded, idle or not: a plan that starts pulls the fence in to that at once, and before a
/// start or a write the agent asks (`fresh`) and is answered at once when that leaves it margin,
/// else after a renewal sent for the asking.
#[allow(clippy::too_many_arguments)]
async fn renew(
    api: Api<Lease>,
    r: LeaseRef,
    mut mine: Lease,
    lost: watch::Sender<bool>,
    acting: watch::Sender<bool>,
    taken_at: Instant,
    activity: Activity,
    mut changes: watch::Receiver<Latest<Lease>>,
) {
    let Activity { mut busy, fresh: mut asks } = activity;
    let (mut busy_alive, mut asks_alive, mut changes_alive) = (true, true, true);
    // The versions this holder wrote (the watch delivers their echoes, late ones included).
    let mut written: std::collections::VecDeque<String> = mine.metadata.resource_version.iter().cloned().collect();
    // The duration the Lease states as this agent last wrote it (the taking wrote the configured
    // one), and since when no plan executes (`None`: one does).
    let mut stated = r.duration;
    let mut quiet_since = (!*busy.borrow_and_update()).then(Instant::now);
    let mut failing = false;
    // The send time of the last renewal that succeeded, and the fence it leaves.
    let mut renewed = taken_at;
    let mut valid_until = taken_at + r.valid_for();
    // Askers waiting for a renewal sent after they asked.
    let mut asking: Vec<FreshRequest> = Vec::new();
    let margin = r.period().min(r.valid_for() / 2);
    let mut next = Instant::now() + crate::backoff::earlier(r.pace(stated), 0.5);
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = tokio::time::sleep_until(valid_until), if *acting.borrow() => {
                expired(&acting, &r, stated);
                continue;
            }
            changed = busy.changed(), if busy_alive => {
                busy_alive = changed.is_ok();
                let now_busy = *busy.borrow_and_update();
                match (now_busy, quiet_since) {
                    (true, _) => quiet_since = None,
                    (false, None) => quiet_since = Some(Instant::now()),
                    (false, Some(_)) => {}
                }
                if now_busy && valid_until > renewed + r.valid_for() {
                    // A plan executes: the fence is the configured duration's again.
                    valid_until = renewed + r.valid_for();
                    if Instant::now() >= valid_until && *acting.borrow() {
                        expired(&acting, &r, stated);
                    }
                }
                // A plan starts while the Lease states the idle duration: renewed at once.
                if !(now_busy && stated > r.duration && !failing) {
                    continue;
                }
            }
            changed = changes.changed(), if changes_alive => {
                changes_alive = changed.is_ok();
                let seen = changes.borrow_and_update().1.get(&r.name).cloned();
                let rv = seen.as_ref().and_then(|l| l.metadata.resource_version.clone());
                if !changes_alive || rv.as_ref().is_some_and(|v| written.contains(v)) {
                    continue;
                }
                if seen.is_none() && changes.borrow().0 == 0 {
                    continue;
                }
                // Someone else wrote the Lease (issue 41): a waiting agent may take it over once it
                // has stayed so for what it states now, whatever this holder's own duration. Acting
                // stops by then unless a renewal on top of it lands first, sent now.
                let states = seen.as_ref().map(seen_of).and_then(|s| s.duration).unwrap_or(MIN_DURATION);
                valid_until = valid_until.min(Instant::now() + r.valid_for_stated(states.min(stated)));
                if Instant::now() >= valid_until && *acting.borrow() {
                    expired(&acting, &r, states);
                }
                tracing::info!(
                    "the Lease {}/{} was written by someone else (it states {}); renewing it now",
                    r.namespace,
                    r.name,
                    crate::duration::show(states)
                );
                if failing {
                    continue;
                }
            }
            ask = asks.recv(), if asks_alive => {
                let Some(ask) = ask else {
                    asks_alive = false;
                    continue;
                };
                if *acting.borrow() && Instant::now() + margin < valid_until.min(renewed + r.valid_for()) {
                    let _ = ask.send(Ok(()));
                    continue;
                }
                // Asked for: a renewal now, with the configured duration (the agent acts).
                asking.push(ask);
                if let Some(q) = quiet_since.as_mut() {
                    *q = Instant::now();
                }
                if failing {
                    // The next attempt of the failing renewals answers it.
                    continue;
                }
            }
        }
        // The askers this renewal answers (it is sent after they asked).
        let answers = std::mem::take(&mut asking);
        let idle = quiet_since.is_some_and(|t| t.elapsed() >= r.duration);
        let want = if idle { r.idle_duration() } else { r.duration };
        let sent = Instant::now();
        if want < stated {
            valid_until = valid_until.min(sent + r.valid_for_stated(want));
        }
        let limit = (want / 8).clamp(Duration::from_secs(1), REQUEST_TIMEOUT);
        // The fence closes on time even while the renewal waits for its answer.
        let renewal = {
            let mut renewal = std::pin::pin!(renew_once(&api, &r, &mine, want, limit));
            loop {
                tokio::select! {
                    done = &mut renewal => break done,
                    _ = tokio::time::sleep_until(valid_until), if *acting.borrow() => expired(&acting, &r, stated),
                }
            }
        };
        match renewal {
            Renewal::Ours(l) => {
                if failing {
                    tracing::info!("renewed the Lease {}/{} again", r.namespace, r.name);
                }
                // What the Lease states now, as this agent wrote it (taken back after someone
                // emptied it, the configured duration): never more is counted on.
                let before = std::mem::replace(
                    &mut stated,
                    seen_of(&l).duration.unwrap_or(r.duration).max(r.duration).min(want),
                );
                // Spread again when the duration in force changed: a fleet that went idle together
                // (one cancel for all) does not renew in the same second every minute.
                let first = std::mem::replace(&mut failing, false) || stated != before;
                mine = *l;
                if let Some(v) = mine.metadata.resource_version.clone() {
                    if written.len() == 16 {
                        written.pop_front();
                    }
                    written.push_back(v);
                }
                renewed = sent;
                valid_until = sent + r.valid_for_stated(stated);
                acting.send_if_modified(|a| !std::mem::replace(a, true));
                for ask in answers {
                    let _ = ask.send(Ok(()));
                }
                next = sent + crate::backoff::earlier(r.pace(stated), if first { 0.5 } else { 0.1 });
            }
            Renewal::Lost(holder) => {
                let _ = acting.send(false);
                tracing::error!(
                    "lost the Lease {}/{} on {} to {}: stopping, so two agents never act on it",
                    r.namespace,
                    r.name,
                    r.what,
                    shown_holder(&holder)
                );
                for ask in answers {
                    let _ = ask.send(Err(format!("another agent ({}) took the Lease", shown_holder(&holder))));
                }
                let _ = lost.send(true);
                return;
            }
            Renewal::Failed(e) => {
                if !failing {
                    tracing::warn!(
                        "cannot renew the Lease {}/{} ({e}); still acting for at most {}, trying again",
                        r.namespace,
                        r.name,
                        crate::duration::human(valid_until.saturating_duration_since(Instant::now()))
                    );
                }
                // They wait for the next attempt (their own wait is bounded).
                asking = answers;
                failing = true;
                next = Instant::now() + crate::backoff::jittered(RETRY_RENEWAL.min(r.period()));
            }
        }
    }
}

/// The fence closes (R26): the last renewal that landed covers acting no longer.
fn expired(acting: &watch::Sender<bool>, r: &LeaseRef, stated: Duration) {
    let _ = acting.send(false);
    tracing::warn!(
        "the Lease {}/{} on {} was not renewed for {}: not acting until it is (another agent could take it over soon)",
        r.namespace,
        r.name,
        r.what,
        crate::duration::show(r.valid_for_stated(stated))
    );
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(40);

    fn seen(holder: Option<&str>) -> Seen {
        Seen { holder: holder.map(str::to_string), resource_version: "1".into(), duration: Some(D), released_by: None }
    }

    #[test]
    fn decide_table() {
        let me = "n1/boot/10";
        let s = Duration::from_secs;
        let wait = |holder: Option<&str>, remaining| Step::Wait { holder: holder.map(str::to_string), remaining };
        for (what, seen, unchanged, gone, want) in [
            ("no lease", None, s(0), false, Step::Create),
            ("ours", Some(seen(Some(me))), s(0), false, Step::Renew),
            ("ours, long unchanged", Some(seen(Some(me))), s(100), false, Step::Renew),
            ("held", Some(seen(Some("n2/b/3"))), s(10), false, wait(Some("n2/b/3"), s(30))),
            ("held, expired", Some(seen(Some("n2/b/3"))), s(40), false, Step::Take),
            ("held by our gone self", Some(seen(Some("n1/boot/9"))), s(0), true, Step::Take),
            // R26: an empty holder is no proof that the holder stopped (someone else may have
            // emptied it while the holder runs): taken only once unchanged for the duration.
            ("emptied", Some(seen(None)), s(0), false, wait(None, s(40))),
            ("emptied to \"\"", Some(seen(Some(""))), s(39), false, wait(None, s(1))),
            ("emptied, then quiet", Some(seen(None)), s(40), false, Step::Take),
            ("released by our gone self", Some(seen(None)), s(0), true, Step::Take),
            (
                "released by ourselves (a re-exec)",
                Some(Seen { released_by: Some(me.into()), ..seen(None) }),
                s(0),
                false,
                Step::Take,
            ),
            (
                "released by another",
                Some(Seen { released_by: Some("n2/b/3".into()), ..seen(None) }),
                s(0),
                false,
                wait(None, s(40)),
            ),
        ] {
            assert_eq!(decide(seen.as_ref(), me, unchanged, D, gone), want, "{what}");
        }
        // The longer of the Lease's stated duration and our own: a shorter one written into the
        // Lease by someone else cannot bring a takeover forward.
        let no_duration = Seen { duration: None, ..seen(Some("x/y/1")) };
        assert_eq!(decide(Some(&no_duration), me, s(5), s(10), false), wait(Some("x/y/1"), s(5)));
        let short = Seen { duration: Some(MIN_DURATION), ..seen(Some("x/y/1")) };
        assert_eq!(decide(Some(&short), me, s(5), D, false), wait(Some("x/y/1"), s(35)));
        let long = Seen { duration: Some(s(600)), ..seen(Some("x/y/1")) };
        assert_eq!(decide(Some(&long), me, s(40), D, false), wait(Some("x/y/1"), s(560)));
    }

    /// What the Lease object says is clamped: 2147483647 s is an hour, 0 s the shortest.
    #[test]
    fn stated_durations_are_clamped() {
        let lease = |secs: i32| Lease {
            metadata: ObjectMeta { resource_version: Some("1".into()), ..Default::default() },
            spec: Some(LeaseSpec {
                holder_identity: Some("x/y/1".into()),
                lease_duration_seconds: Some(secs),
                ..Default::default()
            }),
        };
        assert_eq!(seen_of(&lease(i32::MAX)).duration, Some(MAX_DURATION));
        assert_eq!(seen_of(&lease(0)).duration, Some(MIN_DURATION));
        assert_eq!(seen_of(&lease(-5)).duration, None);
        assert_eq!(seen_of(&lease(40)).duration, Some(D));
        let mut renewed = lease(i32::MAX);
        let at = k8s_openapi::jiff::Timestamp::now();
        renewed.spec.as_mut().unwrap().renew_time = Some(MicroTime(at));
        let later = at + k8s_openapi::jiff::SignedDuration::from_secs(3601);
        assert_eq!(fresh_holder(&renewed, later), None, "an hour at most, not 68 years");
    }

    /// The fence's arithmetic (R26): the holder acts for the duration less its stop budget and the
    /// grace after its last renewal, which leaves at least one renewal period at the shortest
    /// safe duration.
    #[test]
    fn the_fence_leaves_a_renewal_period() {
        let r = |duration, stop_budget| LeaseRef {
            namespace: "n".into(),
            name: "l".into(),
            identity: "a/b/1".into(),
            duration,
            stop_budget,
            what: "w".into(),
        };
        assert_eq!(r(D, Duration::from_secs(15)).valid_for(), Duration::from_secs(23));
        for budget in [0, 1, 6, 15, 100] {
            let budget = Duration::from_secs(budget);
            let safe = shortest_safe_duration(budget);
            let l = r(safe, budget);
            assert!(l.valid_for() >= l.period(), "{budget:?}: {safe:?} leaves {:?}", l.valid_for());
        }
        assert_eq!(shortest_safe_duration(Duration::from_secs(6)), Duration::from_secs(11));
    }

    #[test]
    fn previous_incarnations() {
        let me = "node-a/boot-1/4026531836/100/5000";
        let gone = |_| false;
        assert!(previous_incarnation_gone("node-a/boot-1/4026531836/99/4000", me, gone));
        let running = |p: Incarnation| p == Incarnation { pid: 99, start: 4000 };
        assert!(!previous_incarnation_gone("node-a/boot-1/4026531836/99/4000", me, running), "still running");
        assert!(
            previous_incarnation_gone("node-a/boot-1/4026531836/99/3999", me, running),
            "its pid reused by another process: gone"
        );
        assert!(!previous_incarnation_gone("node-b/boot-1/4026531836/99/4000", me, gone), "another node");
        assert!(!previous_incarnation_gone("node-a/boot-0/4026531836/99/4000", me, gone), "another boot");
        // Issue 41: an agent in another PID namespace (a container beside the host's agent) cannot
        // be seen from here, even at the same pid: its Lease is taken at its expiry only.
        assert!(!previous_incarnation_gone("node-a/boot-1/4026532999/100/5000", me, gone), "another namespace");
        assert_ne!(
            identity_in("node-a", "boot-1", 4026532999, 1, 7),
            identity_in("node-a", "boot-1", 4026531836, 1, 7)
        );
        // An older build's `node/boot/pid`: its namespace is unknown, so never taken for gone.
        assert!(!previous_incarnation_gone("node-a/boot-1/99", me, gone));
        assert!(!previous_incarnation_gone("garbage", me, gone));
        assert!(!previous_incarnation_gone("node-a//1/99/4000", "node-a//1/100/5000", gone), "no boot id known");
        // A node name with slashes cannot confuse the split: the last four fields are taken.
        assert!(previous_incarnation_gone("a/b/boot-1/1/99/4000", "a/b/boot-1/1/100/5000", gone));
        // This very process, as an older build of it named itself before executing this one (R23).
        assert!(is_me(&format!("node-a/boot-1/{}", std::process::id()), me));
        assert!(!is_me("node-a/boot-1/1", me) || std::process::id() == 1);
        assert!(is_me(me, me));
    }

    fn identity_in(node: &str, boot: &str, ns: u64, pid: i32, start: u64) -> String {
        format!("{node}/{boot}/{ns}/{pid}/{start}")
    }

    #[test]
    fn this_agents_identity_names_its_namespace_pid_and_start() {
        let me = identity("node-a");
        let (node, boot, _, p) = fields(&me).expect("five fields");
        assert_eq!((node, boot.is_empty()), ("node-a", false));
        assert!(crate::process::running(p.pid, p.start), "{me} is this process");
        assert!(!crate::process::running(p.pid, p.start + 1), "another start time is another process");
    }

    /// The Lease of a test holder: 40 s, a stop budget of 6 s.
    fn a_lease() -> LeaseRef {
        LeaseRef {
            namespace: "ns".into(),
            name: "nodeplan-a".into(),
            identity: "node/boot/1".into(),
            duration: D,
            stop_budget: Duration::from_secs(6),
            what: "secret ns/a".into(),
        }
    }

    /// Agents that took their Leases at the same instant (a fleet's rollout, an outage's end) do not
    /// renew them in the same second: the first renewal comes at a random point of the period's
    /// second half, and each later one up to a tenth early, never late. Eight renewers on a paused
    /// clock against a scripted API server that accepts every renewal.
    #[tokio::test(start_paused = true)]
    async fn a_fleet_that_took_its_leases_together_renews_them_spread_out() {
        use http::{Request, Response};
        use kube::client::Body;
        let r = a_lease();
        let start = Instant::now();
        let mut renewers = Vec::new();
        for _ in 0..8 {
            let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
            let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "ns"), "ns");
            let mine = taken(&r, None);
            let answer = serde_json::to_vec(&Lease {
                metadata: ObjectMeta { resource_version: Some("1".into()), ..mine.metadata.clone() },
                ..mine.clone()
            })
            .unwrap();
            let (lost, _lost) = watch::channel(false);
            let (acting, _acting) = watch::channel(true);
            let (_changes_tx, changes) = watch::channel((0, Default::default()));
            let task = tokio::spawn(renew(api, r.clone(), mine, lost, acting, start, Activity::always_busy(), changes));
            let server = tokio::spawn(async move {
                let mut handle = std::pin::pin!(handle);
                let mut at = Vec::new();
                while let Some((req, send)) = handle.as_mut().next_request().await {
                    assert_eq!(req.method(), http::Method::PUT, "only renewals");
                    at.push(Instant::now() - start);
                    send.send_response(Response::builder().body(Body::from(answer.clone())).unwrap());
                }
                at
            });
            renewers.push((task, server));
        }
        tokio::time::sleep(Duration::from_secs(35)).await;
        let period = D / 4;
        let mut firsts = Vec::new();
        for (task, server) in renewers {
            task.abort();
            let _ = task.await;
            let at = server.await.unwrap();
            assert!(at.len() >= 3, "{at:?}");
            assert!(at[0] >= period / 2 && at[0] <= period, "the first in the period's second half: {at:?}");
            for w in at.windows(2) {
                let gap = w[1] - w[0];
                assert!(gap >= period.mul_f64(0.9) && gap <= period, "then up to a tenth early, never late: {at:?}");
            }
            firsts.push(at[0]);
        }
        firsts.sort();
        firsts.dedup();
        assert!(firsts.len() > 4, "eight agents, (nearly) as many first renewal times: {firsts:?}");
    }

    /// The Lease API of [`renewals_answered`], what it saw, its `hang` switch and its task.
    type Renewals = (
        Api<Lease>,
        tokio::sync::mpsc::UnboundedReceiver<(Duration, Duration)>,
        std::sync::Arc<std::sync::atomic::AtomicBool>,
        crate::AbortOnDrop,
    );

    /// A scripted API server on a paused clock that answers every renewal (a PUT) as written, or
    /// never while `hang` is set; each renewal's send time (from `start`) and stated duration
    /// come through the receiver.
    fn renewals_answered(start: Instant) -> Renewals {
        use http::{Request, Response};
        use kube::client::Body;
        use std::sync::atomic::Ordering;
        let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "ns"), "ns");
        let (seen_tx, seen) = tokio::sync::mpsc::unbounded_channel();
        let hang = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let silent = hang.clone();
        let server = crate::AbortOnDrop(tokio::spawn(async move {
            let mut handle = std::pin::pin!(handle);
            let (mut held, mut rv) = (Vec::new(), 1);
            while let Some((req, send)) = handle.as_mut().next_request().await {
                assert_eq!(req.method(), http::Method::PUT, "only renewals");
                let mut l: Lease = serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap();
                let stated = l.spec.as_ref().and_then(|s| s.lease_duration_seconds).unwrap();
                let _ = seen_tx.send((Instant::now() - start, Duration::from_secs(stated as u64)));
                if silent.load(Ordering::SeqCst) {
                    held.push(send);
                    continue;
                }
                rv += 1;
                l.metadata.resource_version = Some(rv.to_string());
                send.send_response(Response::builder().body(Body::from(serde_json::to_vec(&l).unwrap())).unwrap());
            }
        }));
        (api, seen, hang, server)
    }

    /// A renewer of the Lease `r` taken at `start`, no plan executing: its fence, its busy switch,
    /// where it is asked before acting, and its task.
    fn idle_renewer(
        api: Api<Lease>,
        r: &LeaseRef,
        start: Instant,
    ) -> (watch::Receiver<bool>, watch::Sender<bool>, tokio::sync::mpsc::Sender<FreshRequest>, crate::AbortOnDrop) {
        let (lost, _) = watch::channel(false);
        let (acting_tx, acting) = watch::channel(true);
        let (busy_tx, busy) = watch::channel(false);
        let (ask_tx, fresh) = tokio::sync::mpsc::channel(1);
        let activity = Activity { busy, fresh };
        let (_changes_tx, changes) = watch::channel((0, Default::default()));
        let task = tokio::spawn(renew(api, r.clone(), taken(r, None), lost, acting_tx, start, activity, changes));
        (acting, busy_tx, ask_tx, crate::AbortOnDrop(task))
    }

    /// R24: an idle holder states the idle duration and renews a 48th as often; a plan that starts
    /// has the Lease renewed at once with the configured duration, kept while it executes and for
    /// one duration after. A plan that starts pulls the fence in to the configured duration from
    /// the last renewal that landed, and a shortening renewal whose answer never comes does not
    /// push it out (R26). A scripted API server on a paused clock.
    #[tokio::test(start_paused = true)]
    async fn an_idle_holder_renews_rarely_and_a_plan_that_starts_renews_at_once() {
        use std::sync::atomic::Ordering;
        let r = a_lease();
        let (idle, s) = (r.idle_duration(), Duration::from_secs);
        assert_eq!(idle, s(960));
        let start = Instant::now();
        let (api, mut seen, hang, _server) = renewals_answered(start);
        let (mut acting, busy_tx, _ask, _renewer) = idle_renewer(api, &r, start);
        let mut drain = |until: Duration| {
            let mut got = Vec::new();
            while let Ok(x) = seen.try_recv() {
                got.push(x);
            }
            assert!(got.iter().all(|(at, _)| *at <= until), "{got:?}");
            got
        };
        // Idle from the start: the configured duration for one duration, then the idle one.
        tokio::time::sleep(s(2000)).await;
        let got = drain(s(2000));
        let (busy_part, idle_part): (Vec<_>, Vec<_>) = got.iter().partition(|(at, _)| *at < D);
        assert!(busy_part.len() >= 4 && busy_part.iter().all(|(_, d)| *d == D), "{got:?}");
        assert!(idle_part.len() >= 4 && idle_part.iter().all(|(_, d)| *d == idle), "{got:?}");
        assert!(idle_part[0].0 <= D + s(10), "idle at the first renewal after a quiet duration: {got:?}");
        // The first idle renewal spread over the second half of its pace (half the idle duration).
        let first_gap = idle_part[1].0 - idle_part[0].0;
        assert!(first_gap >= s(240) && first_gap <= s(480), "{got:?}");
        for w in idle_part[1..].windows(2) {
            let gap = w[1].0 - w[0].0;
            assert!(gap >= s(432) && gap <= s(480), "a 48th as often: {got:?}");
        }
        // A plan starts: renewed at once with the configured duration, then every quarter of it.
        busy_tx.send_replace(true);
        tokio::time::sleep(s(30)).await;
        busy_tx.send_replace(false);
        tokio::time::sleep(s(45)).await;
        let got = drain(s(2075));
        assert_eq!(got[0], (s(2000), D), "renewed as the plan starts: {got:?}");
        let normal: Vec<_> = got.iter().take_while(|(_, d)| *d == D).collect();
        assert!(normal.len() >= 7, "while it runs and a duration after: {got:?}");
        for w in normal.windows(2) {
            assert!(w[1].0 - w[0].0 <= s(10), "{got:?}");
        }
        assert!(got.iter().skip(normal.len()).all(|(at, d)| *d == idle && *at >= s(2070)), "then idle again: {got:?}");
        // Idle again; a plan starts 5 s after an idle renewal and the shortening renewal is never
        // answered: the fence closes by the configured duration from the idle renewal, the last
        // that landed (a waiting agent may count that much from a rewrite by someone else), not by
        // the idle duration it stated.
        tokio::time::sleep(s(100)).await;
        drain(s(2175));
        let (last, stated) = seen.recv().await.unwrap();
        assert_eq!(stated, idle);
        tokio::time::sleep(s(5)).await;
        hang.store(true, Ordering::SeqCst);
        busy_tx.send_replace(true);
        acting.wait_for(|a| !*a).await.unwrap();
        assert_eq!(Instant::now() - start, last + r.valid_for(), "the fence closed by the configured duration");
        assert_eq!(seen.try_recv().unwrap(), (last + s(5), D));
    }

    /// R26: before it starts a plan or writes, an idle holder asks; it is answered at once while
    /// its last renewal leaves it margin, else only once a renewal sent for the asking (with the
    /// configured duration) has landed; a renewal that fails keeps the asker waiting. A scripted
    /// API server on a paused clock.
    #[tokio::test(start_paused = true)]
    async fn an_idle_holder_asked_to_act_renews_first_unless_its_last_renewal_leaves_margin() {
        use std::sync::atomic::Ordering;
        let r = a_lease();
        let (idle, s) = (r.idle_duration(), Duration::from_secs);
        let start = Instant::now();
        let (api, mut seen, hang, _server) = renewals_answered(start);
        let (acting, _busy_tx, ask_tx, _renewer) = idle_renewer(api, &r, start);
        let ask = || {
            let ask_tx = ask_tx.clone();
            async move {
                let (tx, rx) = tokio::sync::oneshot::channel();
                ask_tx.send(tx).await.unwrap();
                rx.await.unwrap()
            }
        };
        // Idle: the idle duration stated, the fence open for the idle duration.
        tokio::time::sleep(s(200)).await;
        while seen.try_recv().is_ok() {}
        let (last, stated) = seen.recv().await.unwrap();
        assert_eq!(stated, idle);
        // Right after a renewal: answered at once, nothing written.
        assert_eq!(ask().await, Ok(()));
        assert_eq!(Instant::now() - start, last);
        // Past the configured duration's fence less the margin (a quarter of the duration), the
        // fence still open for the idle one: a renewal first, with the configured duration.
        tokio::time::sleep_until(start + last + r.valid_for() - r.period()).await;
        assert!(*acting.borrow());
        let asked = Instant::now();
        assert_eq!(ask().await, Ok(()));
        assert_eq!(seen.try_recv().unwrap(), (asked - start, D), "renewed for the asking");
        // Renewals that are never answered keep an asker waiting once the last that landed (the
        // one for the asking) leaves no margin, the fence still open.
        hang.store(true, Ordering::SeqCst);
        tokio::time::sleep_until(asked + r.valid_for() - r.period() + s(1)).await;
        assert!(*acting.borrow());
        while seen.try_recv().is_ok() {}
        let waiting = tokio::time::timeout(s(20), ask()).await;
        assert!(waiting.is_err(), "answered without a renewal: {waiting:?}");
        assert!(seen.try_recv().is_ok(), "renewals were sent meanwhile");
    }

    /// Issue 41, item 5: a holder that sees its Lease written by someone else (stating a shorter
    /// duration) renews on top of it at once, and until that lands acts no longer than a waiting
    /// agent would wait from that write: the stated duration less its stop ladder, not its own
    /// duration from its last renewal. The echo of its own write is no reason to renew.
    #[tokio::test(start_paused = true)]
    async fn a_write_by_someone_else_is_renewed_over_at_once_and_pulls_the_fence_in() {
        use std::sync::atomic::Ordering;
        let r = a_lease();
        let start = Instant::now();
        let (api, mut seen, hang, _server) = renewals_answered(start);
        let (lost, _lost) = watch::channel(false);
        let (acting_tx, mut acting) = watch::channel(true);
        let (changes_tx, changes) = watch::channel::<Latest<Lease>>((0, Default::default()));
        let task = renew(api, r.clone(), taken(&r, None), lost, acting_tx, start, Activity::always_busy(), changes);
        let _renewer = crate::AbortOnDrop(tokio::spawn(task));
        let lease = |rv: &str, seconds: i32| {
            let mut l = taken(&r, None);
            l.metadata.resource_version = Some(rv.into());
            l.spec.as_mut().unwrap().lease_duration_seconds = Some(seconds);
            l
        };
        let deliver = |l: Lease| {
            changes_tx.send_modify(|(n, m)| {
                *n += 1;
                m.insert(r.name.clone(), l);
            })
        };
        // The first renewal lands as version 2; its echo comes: nothing is written.
        seen.recv().await.unwrap();
        deliver(lease("2", 40));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(seen.try_recv().is_err(), "renewed for its own write's echo");
        // Renewals hang from now on; someone else states 20 s.
        hang.store(true, Ordering::SeqCst);
        let wrote = Instant::now();
        deliver(lease("99", 20));
        let (at, stated) = seen.recv().await.unwrap();
        assert_eq!((start + at, stated), (wrote, D), "renewed at once, stating its own duration");
        acting.wait_for(|a| !*a).await.unwrap();
        assert_eq!(Instant::now() - wrote, r.valid_for_stated(Duration::from_secs(20)), "the fence from the write");
    }

    /// The handle of a scripted API server.
    type Script = tower_test::mock::Handle<http::Request<kube::client::Body>, http::Response<kube::client::Body>>;

    /// [`a_lease`], a Lease API answered by a script, and the Lease as this agent took it (version 1).
    fn a_scripted_lease() -> (LeaseRef, Api<Lease>, Script, Lease) {
        use http::{Request, Response};
        use kube::client::Body;
        let r = a_lease();
        let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let api: Api<Lease> = Api::namespaced(kube::Client::new(svc, "ns"), "ns");
        let mine = Lease {
            metadata: ObjectMeta { resource_version: Some("1".into()), ..taken(&r, None).metadata },
            ..taken(&r, None)
        };
        (r, api, handle, mine)
    }

    /// R26: a renewal that finds the Lease rewritten by someone else but still naming this agent
    /// writes it again on top of what it read (conditionally on that version), since a waiting agent
    /// counts its wait from the last write it saw: keeping the Lease as read would leave the
    /// fence open for a wait that began at the other writer's write. A scripted API server.
    #[tokio::test(start_paused = true)]
    async fn a_lease_someone_else_rewrote_is_renewed_on_top_of_it() {
        use http::{Method, Response};
        use kube::client::Body;
        let (r, api, handle, mine) = a_scripted_lease();
        let theirs = {
            let mut l = mine.clone();
            l.metadata.resource_version = Some("7".into());
            l.spec.as_mut().unwrap().lease_duration_seconds = Some(1);
            l
        };
        let server = tokio::spawn(async move {
            let mut handle = std::pin::pin!(handle);
            let mut seen = Vec::new();
            while let Some((req, send)) = handle.as_mut().next_request().await {
                let method = req.method().clone();
                let body = req.into_body().collect_bytes().await.unwrap();
                let rv = serde_json::from_slice::<Lease>(&body).ok().and_then(|l| l.metadata.resource_version);
                seen.push((method.clone(), rv.clone()));
                let answer = match (method, rv.as_deref()) {
                    (Method::PUT, Some("1")) => Response::builder().status(409).body(Body::from(
                        serde_json::to_vec(&serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409, "message": "changed"})).unwrap(),
                    )),
                    (Method::GET, _) => Response::builder().body(Body::from(serde_json::to_vec(&theirs).unwrap())),
                    (_, _) => Response::builder().body(Body::from(body)),
                };
                send.send_response(answer.unwrap());
                if seen.len() == 3 {
                    return seen;
                }
            }
            seen
        });
        let got = renew_once(&api, &r, &mine, D, Duration::from_secs(5)).await;
        let Renewal::Ours(l) = got else { panic!("not kept") };
        assert_eq!(l.spec.and_then(|s| s.lease_duration_seconds), Some(40), "the holder's duration put back");
        let seen = tokio::time::timeout(Duration::from_secs(1), server).await.expect("a write on top").unwrap();
        assert_eq!(
            seen,
            [(http::Method::PUT, Some("1".into())), (http::Method::GET, None), (http::Method::PUT, Some("7".into()))]
        );
    }

    /// A release that cannot land (the network is down) holds the agent's exit up no longer than
    /// one request's bound in all: the read is answered slowly and the write never. A scripted API
    /// server on a paused clock.
    #[tokio::test(start_paused = true)]
    async fn a_release_that_cannot_land_holds_the_exit_up_one_bound_at_most() {
        use http::{Method, Response};
        use kube::client::Body;
        let (r, api, handle, mine) = a_scripted_lease();
        let server = tokio::spawn(async move {
            let mut handle = std::pin::pin!(handle);
            let mut held = Vec::new();
            while let Some((req, send)) = handle.as_mut().next_request().await {
                if req.method() == Method::GET {
                    tokio::time::sleep(REQUEST_TIMEOUT.mul_f64(0.8)).await;
                    send.send_response(
                        Response::builder().body(Body::from(serde_json::to_vec(&mine).unwrap())).unwrap(),
                    );
                } else {
                    held.push(send); // never answered
                }
            }
        });
        let (_lost_tx, lost) = watch::channel(false);
        let held = Held { renewer: None, lost, acting: watch::channel(true).1, release: Some((api, r)), quiet: false };
        let started = Instant::now();
        held.release().await;
        assert_eq!(started.elapsed(), REQUEST_TIMEOUT, "the read and the write share one bound");
        server.abort();
    }

    /// R26: a lost Lease ends the gate with its fence closed, so the running plan stops at a
    /// recorded boundary (not as at a shutdown), whichever of the renewer's two signals (fence
    /// closed, then Lease lost) the gate's task takes first: `select!` picks among ready branches
    /// at random, hence the repeats. A rival that starts ends the gate with the fence as it was.
    #[tokio::test]
    async fn a_lost_lease_ends_the_gate_with_its_fence_closed() {
        for _ in 0..64 {
            let (acting_tx, acting) = watch::channel(true);
            let (lost_tx, lost) = watch::channel(false);
            let (fence_tx, fence) = watch::channel(true);
            let (_stop, mut stopped) = tokio::sync::oneshot::channel();
            acting_tx.send_replace(false);
            lost_tx.send_replace(true);
            let ended = fence_until_ended(acting, Some(lost), std::future::pending(), &mut stopped, &fence_tx).await;
            assert_eq!(ended.as_deref(), Some("another agent took the plan source's Lease"));
            assert!(!*fence.borrow(), "the fence closed with the Lease");
        }
        let (_acting_tx, acting) = watch::channel(true);
        let (fence_tx, fence) = watch::channel(true);
        let (_stop, mut stopped) = tokio::sync::oneshot::channel();
        let rival = async { "rancher-system-agent (pid 7) started on this node".to_string() };
        let ended = fence_until_ended(acting, None, rival, &mut stopped, &fence_tx).await;
        assert_eq!(ended.as_deref(), Some("rancher-system-agent (pid 7) started on this node"));
        assert!(*fence.borrow(), "a rival leaves the Lease's fence as it was");
    }

    #[test]
    fn lease_names_are_valid() {
        assert_eq!(lease_name("machine-plan"), "nodeplan-machine-plan");
        let long = lease_name(&"x".repeat(300));
        assert!(long.len() <= 253 && long.starts_with("nodeplan-xxx"), "{long}");
        assert_ne!(long, lease_name(&"x".repeat(301)));
    }
}

/// Another program that acts on the same plan source when it runs on the node (Rancher's own
/// agent, for the plan Secret): while it runs, this agent does not act.
#[derive(Clone)]
pub struct Rival {
    /// Its name, as log lines and the advice to stop it show it.
    pub program: String,
    /// The pid of a running one, if any (looked for before acting: a thorough look).
    pub running: RivalCheck,
    /// While the agent acts: the pid of one that started, once there is one (pending until then).
    pub started: RivalStarted,
}

/// A look for a rival: the pid of a running one, if any.
pub type RivalCheck = std::sync::Arc<dyn Fn() -> futures::future::BoxFuture<'static, Option<i32>> + Send + Sync>;

/// A wait for a rival to start: the pid of one once it runs.
pub type RivalStarted = std::sync::Arc<dyn Fn() -> futures::future::BoxFuture<'static, i32> + Send + Sync>;

/// How often the gate looks for a running rival before it opens.
const RIVAL_PERIOD: Duration = Duration::from_secs(5);

/// The gate of a plan source (see [`crate::reconcile::gate`]): with `rival`, not while it runs
/// (waiting for it to go, saying so once); then holding the source's Lease (waiting for it first;
/// a shutdown meanwhile ends the task). Open, the fence follows the Lease's renewals (R26). If
/// another agent takes the Lease, or the rival starts, the gate ends with the reason (its fence
/// closes), and the loop stops the agent: its exit code makes systemd restart it, and it then waits
/// again. The Lease is given up when the gate is stopped.
pub fn guard(
    lease: Option<(kube::Client, LeaseRef)>,
    rival: Option<Rival>,
    mut shutdown: watch::Receiver<bool>,
) -> crate::reconcile::gate::Gate {
    use crate::reconcile::gate::{Gate, GateState};
    let (state_tx, state) = watch::channel(GateState::Waiting);
    let (fence_tx, fence) = watch::channel(false);
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let (busy_tx, busy) = watch::channel(false);
    let (fresh_tx, fresh) = tokio::sync::mpsc::channel(8);
    let shutdown_rx = shutdown.clone();
    let task = tokio::spawn(async move {
        let what = lease.as_ref().map(|(_, r)| r.what.clone());
        let mut told = false;
        while let Some(r) = &rival
            && let Some(pid) = (r.running)().await
        {
            if !told {
                tracing::warn!(
                    "waiting: {p} (pid {pid}) runs on this node and may act on this plan Secret; stop and disable it (systemctl disable --now {p}) to let nodeplan act, or set rivalCheck: false in the config if it serves another Secret",
                    p = r.program
                );
                if let Some(w) = &what {
                    shown(w, &format!("waiting: {} (pid {pid}) runs on this node", r.program), false);
                }
                told = true;
            }
            if tokio::time::timeout(RIVAL_PERIOD, shutdown.wait_for(|s| *s)).await.is_ok() {
                return;
            }
        }
        // Without a Lease nobody is told or asked: the channels close, and an ask is answered at once.
        let activity = Activity { busy, fresh };
        let held = match lease {
            Some((client, r)) => match hold(client, r, shutdown.clone(), activity).await {
                Some(h) => Some(h),
                None => return,
            },
            None => {
                drop(activity);
                None
            }
        };
        let acting = held.as_ref().map_or_else(|| watch::channel(true).1, Held::acting);
        // Only a Lease that was held can be lost (a closed channel is no loss).
        let lost = held.as_ref().map(Held::lost);
        fence_tx.send_replace(*acting.borrow());
        state_tx.send_replace(GateState::Open);
        let rival_started = async {
            let Some(r) = &rival else { return std::future::pending().await };
            let pid = (r.started)().await;
            let what = format!("{} (pid {pid}) started on this node", r.program);
            tracing::error!(
                "{what}: stopping, since it may act on this plan Secret (rivalCheck: false in the config if it serves another)"
            );
            what
        };
        let ended = fence_until_ended(acting, lost, rival_started, &mut stopped, &fence_tx).await;
        if let Some(why) = ended {
            if let Some(w) = &what {
                shown(w, &format!("ended: {why}"), false);
            }
            state_tx.send_replace(GateState::Ended(why));
            let _ = stopped.await;
        }
        if let Some(h) = held {
            h.release().await;
        }
    });
    Gate::new(state, fence, stop, task).telling(busy_tx, fresh_tx, shutdown_rx)
}

/// An open gate's fence, following `acting` (the Lease's renewals) until the gate is stopped
/// (`None`) or ends: the Lease `lost`, or `rival_started` (why). The fence is published before
/// the end: the loop then stops a running plan at a recorded boundary when the fence closed with
/// the Lease (R26), and as at a shutdown when it did not (a rival).
async fn fence_until_ended(
    mut acting: watch::Receiver<bool>,
    mut lost: Option<watch::Receiver<bool>>,
    rival_started: impl std::future::Future<Output = String>,
    stopped: &mut tokio::sync::oneshot::Receiver<()>,
    fence: &watch::Sender<bool>,
) -> Option<String> {
    let lease_lost = async {
        let held = match lost.as_mut() {
            Some(l) => l.wait_for(|l| *l).await.is_ok(),
            None => false,
        };
        if !held {
            std::future::pending::<()>().await;
        }
    };
    let mut rival_started = std::pin::pin!(rival_started);
    let mut lease_lost = std::pin::pin!(lease_lost);
    let mut acting_alive = true;
    let ended = loop {
        tokio::select! {
            _ = &mut *stopped => break None,
            r = acting.changed(), if acting_alive => {
                acting_alive = r.is_ok();
                fence.send_replace(*acting.borrow());
            }
            () = &mut lease_lost => break Some("another agent took the plan source's Lease".to_string()),
            what = &mut rival_started => break Some(what),
        }
    };
    // A loss closes the fence before it is told (the renewer does both), but the select may
    // have taken the loss first.
    fence.send_replace(*acting.borrow());
    ended
}
