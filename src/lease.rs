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
//!   `<node>/<boot id>/<pid>`: the same node in the same boot whose holder pid is gone is the
//!   previous incarnation of this agent (a crash, a `systemctl restart`); a re-exec of the agent
//!   keeps its pid and so its identity.
//! - **An outage is not a loss.** While the API server cannot be reached, the holder keeps acting
//!   (and renewing is retried): nobody else can take the Lease without the API server either. The
//!   Lease is lost only on evidence: a renewal refused because another holder wrote the Lease.
//!   Limit: an agent cut off from the API server while another reaches it keeps running its
//!   current plan until it reconnects and finds the Lease gone; the Lease serialises agents, it
//!   cannot fence a partitioned one.
//! - **No permission, no Lease.** An account that may not read or write Leases (Rancher's
//!   per-machine role grants the plan Secret only) gets one warning and runs without one.
//! - **Cost.** One small write per quarter of the duration (with the default 40 s, one every 10 s,
//!   as the kubelet's own node Lease); a waiting agent reads at the same pace and writes nothing.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// The shortest `leaseDuration` (renewal every quarter of it).
pub const MIN_DURATION: Duration = Duration::from_secs(4);
/// The longest `leaseDuration`.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the Lease is and who this agent is.
#[derive(Debug, Clone)]
pub struct LeaseRef {
    pub namespace: String,
    pub name: String,
    /// `<node>/<boot id>/<pid>` (see [`identity`]).
    pub identity: String,
    pub duration: Duration,
    /// What the Lease guards, for log lines (`secret ns/name`, `NodePlans of node n`).
    pub what: String,
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

/// This agent's holder identity: `<node>/<boot id>/<pid>`.
pub fn identity(node: &str) -> String {
    let boot = crate::process::boot_id().unwrap_or_default();
    format!("{node}/{boot}/{}", std::process::id())
}

/// Whether `holder` is an earlier incarnation of this agent that is gone: the same node in the
/// same boot, with its pid no longer alive (a live pid is taken as still holding: a pid reused by
/// another process only delays the take-over to the Lease's expiry).
pub fn previous_incarnation_gone(holder: &str, me: &str, alive: impl Fn(i32) -> bool) -> bool {
    let split = |s: &str| {
        let mut it = s.rsplitn(3, '/');
        let pid = it.next()?.parse::<i32>().ok()?;
        let boot = it.next()?.to_string();
        let node = it.next()?.to_string();
        Some((node, boot, pid))
    };
    match (split(holder), split(me)) {
        (Some((hn, hb, hp)), Some((mn, mb, _))) => hn == mn && hb == mb && !hb.is_empty() && !alive(hp),
        _ => false,
    }
}

/// What the Lease shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub holder: Option<String>,
    pub resource_version: String,
    pub duration: Option<Duration>,
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
    /// Another holder: look again; it expires after `remaining` more without a change.
    Wait { holder: String, remaining: Duration },
}

/// The rule. `unchanged_for` is how long this agent has seen the same resourceVersion; `gone`
/// says whether the holder is a gone incarnation of this agent.
pub fn decide(seen: Option<&Seen>, me: &str, unchanged_for: Duration, default: Duration, gone: bool) -> Step {
    let Some(seen) = seen else { return Step::Create };
    let holder = match seen.holder.as_deref() {
        None | Some("") => return Step::Take,
        Some(h) if h == me => return Step::Renew,
        Some(h) => h,
    };
    let duration = seen.duration.unwrap_or(default);
    if gone || unchanged_for >= duration {
        return Step::Take;
    }
    Step::Wait { holder: holder.to_string(), remaining: duration - unchanged_for }
}

fn seen_of(l: &Lease) -> Seen {
    let spec = l.spec.as_ref();
    Seen {
        holder: spec.and_then(|s| s.holder_identity.clone()),
        resource_version: l.metadata.resource_version.clone().unwrap_or_default(),
        duration: spec
            .and_then(|s| s.lease_duration_seconds)
            .and_then(|d| u64::try_from(d).ok())
            .map(Duration::from_secs),
    }
}

fn now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
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
    let transitions = l.spec.as_ref().and_then(|s| s.lease_transitions).unwrap_or(0);
    let changed = old.is_some_and(|o| seen_of(o).holder.as_deref() != Some(r.identity.as_str()));
    l.spec = Some(LeaseSpec {
        holder_identity: Some(r.identity.clone()),
        lease_duration_seconds: Some(i32::try_from(r.duration.as_secs()).unwrap_or(i32::MAX)),
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
        kube::Error::Api(s) if s.code == 403 => Refusal::Forbidden(crate::error_line(&e)),
        kube::Error::Api(s) if s.code == 409 => Refusal::Conflict,
        _ => Refusal::Other(crate::error_line(&e)),
    }
}

async fn bounded<T>(f: impl std::future::Future<Output = Result<T, kube::Error>>) -> Result<T, Refusal> {
    match tokio::time::timeout(REQUEST_TIMEOUT, f).await {
        Ok(r) => r.map_err(refusal),
        Err(_) => Err(Refusal::Other("no answer".into())),
    }
}

/// A held Lease (or none, where the account may not use Leases): renewed in the background until
/// [`Held::release`]. `lost` turns true when another holder took it.
pub struct Held {
    renewer: Option<tokio::task::JoinHandle<()>>,
    lost: watch::Receiver<bool>,
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
        let Ok(mut l) = bounded(api.get(&r.name)).await else { return };
        if seen_of(&l).holder.as_deref() != Some(r.identity.as_str()) {
            return;
        }
        if let Some(spec) = l.spec.as_mut() {
            spec.holder_identity = None;
            spec.renew_time = Some(now());
        }
        match bounded(api.replace(&r.name, &PostParams::default(), &l)).await {
            Ok(_) if self.quiet => tracing::debug!("released the Lease {}/{} on {}", r.namespace, r.name, r.what),
            Ok(_) => tracing::info!("released the Lease {}/{} on {}", r.namespace, r.name, r.what),
            Err(_) => tracing::debug!("could not release the Lease {}/{}; it expires by itself", r.namespace, r.name),
        }
    }
}

/// Take the Lease, waiting while another agent holds it (saying so once per holder), until taken
/// or `shutdown`. `None`: shut down while waiting.
pub async fn hold(client: kube::Client, r: LeaseRef, mut shutdown: watch::Receiver<bool>) -> Option<Held> {
    let api: Api<Lease> = Api::namespaced(client, &r.namespace);
    let pace = r.duration / 4;
    let mut observed: Option<(String, Instant)> = None;
    let mut told: Option<String> = None;
    let mut failing = false;
    loop {
        if *shutdown.borrow() {
            return None;
        }
        let current = match bounded(api.get_opt(&r.name)).await {
            Ok(l) => l,
            Err(Refusal::Forbidden(e)) => return Some(without_lease(&r, &e)),
            Err(Refusal::Conflict) => continue,
            Err(Refusal::Other(e)) => {
                if !failing {
                    tracing::warn!("cannot read the Lease {}/{} ({e}); trying again", r.namespace, r.name);
                }
                failing = true;
                wait(&mut shutdown, pace).await;
                continue;
            }
        };
        failing = false;
        let seen = current.as_ref().map(seen_of);
        let rv = seen.as_ref().map(|s| s.resource_version.clone()).unwrap_or_default();
        let since = match &observed {
            Some((o, at)) if *o == rv => *at,
            _ => {
                observed = Some((rv, Instant::now()));
                Instant::now()
            }
        };
        let gone = seen
            .as_ref()
            .and_then(|s| s.holder.as_deref())
            .is_some_and(|h| previous_incarnation_gone(h, &r.identity, pid_exists));
        let step = decide(seen.as_ref(), &r.identity, since.elapsed(), r.duration, gone);
        let attempt = match step {
            Step::Wait { holder, remaining } => {
                if told.as_deref() != Some(holder.as_str()) {
                    tracing::warn!(
                        "waiting for the Lease {}/{}: another agent ({holder}) acts on {}; taking over if it stops renewing for {}",
                        r.namespace,
                        r.name,
                        r.what,
                        crate::duration::show(remaining)
                    );
                    told = Some(holder);
                }
                wait(&mut shutdown, pace.min(remaining)).await;
                continue;
            }
            Step::Create => bounded(api.create(&PostParams::default(), &taken(&r, None))).await,
            Step::Take | Step::Renew => {
                bounded(api.replace(&r.name, &PostParams::default(), &taken(&r, current.as_ref()))).await
            }
        };
        match attempt {
            Ok(l) => {
                tracing::info!("holding the Lease {}/{} on {} as {}", r.namespace, r.name, r.what, r.identity);
                return Some(renewing(api, r, l));
            }
            Err(Refusal::Forbidden(e)) => return Some(without_lease(&r, &e)),
            // Another agent wrote it first: look again.
            Err(Refusal::Conflict) => continue,
            Err(Refusal::Other(e)) => {
                if !failing {
                    tracing::warn!("cannot take the Lease {}/{} ({e}); trying again", r.namespace, r.name);
                }
                failing = true;
                wait(&mut shutdown, pace).await;
            }
        }
    }
}

/// Whether a Lease seen now is held by someone: a holder that renewed it within its duration by
/// `now` (comparing the Lease's `renewTime` with this machine's clock: for a command run once,
/// which cannot watch the Lease for a duration first; skew between the clocks shifts the expiry).
/// Whether a process with this pid exists on this machine.
fn pid_exists(pid: i32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

fn fresh_holder(l: &Lease, now: k8s_openapi::jiff::Timestamp) -> Option<String> {
    let spec = l.spec.as_ref()?;
    let holder = spec.holder_identity.clone().filter(|h| !h.is_empty())?;
    let renewed = spec.renew_time.as_ref().map(|t| t.0)?;
    let duration = i64::from(spec.lease_duration_seconds.unwrap_or(0)) * 1000;
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
            && !previous_incarnation_gone(&holder, &r.identity, pid_exists)
        {
            return Err(format!("held by {holder}"));
        }
        let attempt = match &current {
            None => bounded(api.create(&PostParams::default(), &taken(&r, None))).await,
            Some(_) => bounded(api.replace(&r.name, &PostParams::default(), &taken(&r, current.as_ref()))).await,
        };
        match attempt {
            Ok(l) => return Ok(Some(Held { quiet: true, ..renewing(api, r, l) })),
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

/// The Lease just taken (`l`, as written), renewed in the background from now on.
fn renewing(api: Api<Lease>, r: LeaseRef, l: Lease) -> Held {
    let (tx, lost) = watch::channel(false);
    let renewer = tokio::spawn(renew(api.clone(), r.clone(), l, tx));
    Held { renewer: Some(renewer), lost, release: Some((api, r)), quiet: false }
}

fn without_lease(r: &LeaseRef, e: &str) -> Held {
    tracing::warn!(
        "running without the Lease {}/{} on {}: this account may not use Leases there ({e}); nothing keeps a second agent or rollout off it (grant get, create and update on coordination.k8s.io leases to turn it on)",
        r.namespace,
        r.name,
        r.what
    );
    let (_, lost) = watch::channel(false);
    Held { renewer: None, lost, release: None, quiet: false }
}

async fn wait(shutdown: &mut watch::Receiver<bool>, d: Duration) {
    let _ = tokio::time::timeout(d, shutdown.wait_for(|s| *s)).await;
}

/// Renew every quarter of the duration until another holder shows up.
async fn renew(api: Api<Lease>, r: LeaseRef, mut mine: Lease, lost: watch::Sender<bool>) {
    let mut failing = false;
    loop {
        tokio::time::sleep(r.duration / 4).await;
        if let Some(spec) = mine.spec.as_mut() {
            spec.renew_time = Some(now());
        }
        match bounded(api.replace(&r.name, &PostParams::default(), &mine)).await {
            Ok(l) => {
                if failing {
                    tracing::info!("renewed the Lease {}/{} again", r.namespace, r.name);
                }
                failing = false;
                mine = l;
            }
            Err(Refusal::Conflict) => match bounded(api.get_opt(&r.name)).await {
                Ok(Some(l)) if seen_of(&l).holder.as_deref() == Some(r.identity.as_str()) => mine = l,
                Ok(other) => {
                    let holder = other.as_ref().and_then(|l| seen_of(l).holder).unwrap_or_else(|| "nobody".into());
                    tracing::error!(
                        "lost the Lease {}/{} on {} to {holder}: stopping, so two agents never act on it",
                        r.namespace,
                        r.name,
                        r.what
                    );
                    let _ = lost.send(true);
                    return;
                }
                Err(_) => failing = true,
            },
            Err(Refusal::Forbidden(e) | Refusal::Other(e)) => {
                if !failing {
                    tracing::warn!(
                        "cannot renew the Lease {}/{} ({e}); still acting, trying again",
                        r.namespace,
                        r.name
                    );
                }
                failing = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(40);

    fn seen(holder: Option<&str>) -> Seen {
        Seen { holder: holder.map(str::to_string), resource_version: "1".into(), duration: Some(D) }
    }

    #[test]
    fn decide_table() {
        let me = "n1/boot/10";
        let s = Duration::from_secs;
        for (what, seen, unchanged, gone, want) in [
            ("no lease", None, s(0), false, Step::Create),
            ("free", Some(seen(None)), s(0), false, Step::Take),
            ("released", Some(seen(Some(""))), s(0), false, Step::Take),
            ("ours", Some(seen(Some(me))), s(0), false, Step::Renew),
            ("ours, long unchanged", Some(seen(Some(me))), s(100), false, Step::Renew),
            (
                "held",
                Some(seen(Some("n2/b/3"))),
                s(10),
                false,
                Step::Wait { holder: "n2/b/3".into(), remaining: s(30) },
            ),
            ("held, expired", Some(seen(Some("n2/b/3"))), s(40), false, Step::Take),
            ("held by our gone self", Some(seen(Some("n1/boot/9"))), s(0), true, Step::Take),
        ] {
            assert_eq!(decide(seen.as_ref(), me, unchanged, D, gone), want, "{what}");
        }
        let no_duration = Seen { duration: None, ..seen(Some("x/y/1")) };
        assert_eq!(
            decide(Some(&no_duration), me, s(5), s(10), false),
            Step::Wait { holder: "x/y/1".into(), remaining: s(5) }
        );
    }

    #[test]
    fn previous_incarnations() {
        let me = "node-a/boot-1/100";
        let dead = |_| false;
        assert!(previous_incarnation_gone("node-a/boot-1/99", me, dead));
        assert!(!previous_incarnation_gone("node-a/boot-1/99", me, |_| true), "alive: still holding");
        assert!(!previous_incarnation_gone("node-b/boot-1/99", me, dead), "another node");
        assert!(!previous_incarnation_gone("node-a/boot-0/99", me, dead), "another boot: expiry decides");
        assert!(!previous_incarnation_gone("garbage", me, dead));
        assert!(!previous_incarnation_gone("node-a//99", "node-a//100", dead), "no boot id known");
        // A node name with slashes cannot confuse the split: the last two fields are taken.
        assert!(previous_incarnation_gone("a/b/boot-1/99", "a/b/boot-1/100", dead));
    }

    #[test]
    fn lease_names_are_valid() {
        assert_eq!(lease_name("machine-plan"), "nodeplan-machine-plan");
        let long = lease_name(&"x".repeat(300));
        assert!(long.len() <= 253 && long.starts_with("nodeplan-xxx"), "{long}");
        assert_ne!(long, lease_name(&"x".repeat(301)));
    }
}
