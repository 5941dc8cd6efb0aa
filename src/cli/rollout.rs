//! `nodeplan rollout PLAN --selector S`: push one plan to every node's plan Secret the selector
//! picks, `--max-concurrent` at a time, stopping when more than `--max-errors` fail. The rules
//! are [`crate::rollout`]'s; this is the loop around them: a watch on the selected Secrets (every
//! change decides again at once), a tick for the per-node timeout, the writes, and a line per node
//! transition with the overall counts.

use super::exit;
use super::plan_cmd::RemoteTarget;
use crate::remote::client::{self, SecretClient, SecretRef, Selected};
use crate::rollout::{self, Amount, Finish, Limits, Place};
use clap::Args;
use futures::StreamExt as _;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct RolloutArgs {
    #[command(subcommand)]
    pub control: Option<Control>,
    /// The plan file (validated before anything is written).
    #[arg(required = true)]
    pub plan: Option<PathBuf>,
    #[command(flatten)]
    pub nodes: Nodes,
    /// Nodes in flight at once: a count or a percentage of the selected nodes (rounded up).
    #[arg(long, value_name = "N|P%", default_value = "1", value_parser = Amount::parse)]
    pub max_concurrent: Amount,
    /// Failures tolerated: one more and no new node starts (those in flight finish). A count or a
    /// percentage of the selected nodes (rounded down).
    #[arg(long, value_name = "N|P%", default_value = "0", value_parser = Amount::parse)]
    pub max_errors: Amount,
    /// Count a node done only once every probe of the plan passes there.
    #[arg(long)]
    pub wait_healthy: bool,
    /// Give up on a node in flight this long (its plan is canceled and it counts as failed).
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_positive)]
    pub timeout: Option<Duration>,
}

/// Which nodes (and how to reach their API server).
#[derive(Args, Debug)]
pub struct Nodes {
    /// The nodes: every plan Secret this label selector picks (kubectl's syntax).
    #[arg(long, short = 'l', value_name = "SELECTOR", required = true)]
    pub selector: Option<String>,
    /// The namespace of the plan Secrets [default: the kubeconfig context's namespace, else
    /// default].
    #[arg(long, short = 'n', value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// Kubeconfig [default: KUBECONFIG, else ~/.kube/config].
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The longest one request to the API server may take (`500ms`, `10s`, `1m`).
    #[arg(long, value_name = "DURATION", default_value = "15s", value_parser = crate::duration::parse_positive)]
    pub request_timeout: Duration,
}

impl Nodes {
    fn target(&self) -> RemoteTarget {
        RemoteTarget {
            secret: None,
            nodeplan: None,
            kubeconfig: self.kubeconfig.clone(),
            request_timeout: self.request_timeout,
        }
    }
    fn selector(&self) -> &str {
        self.selector.as_deref().unwrap_or_default()
    }
}

/// `rollout pause|resume|cancel`: act on the running (or stopped) rollout over a selection.
#[derive(clap::Subcommand, Debug)]
pub enum Control {
    /// Start no new node, and pause the nodes in flight at their next instruction boundary.
    Pause(ControlArgs),
    /// Undo a pause: the nodes in flight go on, and the rollout starts nodes again.
    Resume(ControlArgs),
    /// Start no new node and cancel the nodes in flight; the rollout ends (exit 4) once they have.
    Cancel(ControlArgs),
}

#[derive(Args, Debug)]
pub struct ControlArgs {
    #[command(flatten)]
    pub nodes: Nodes,
}

/// `rollout --help`'s exit codes.
pub const EXIT_CODES: &str = "Exit codes:
  0  every selected node succeeded (nodes already at the plan and succeeded count, untouched)
  1  every node was tried and some failed, within --max-errors; or the API server could not be
     read or written
  2  bad arguments or plan file (pause|resume|cancel: no rollout over the selection)
  4  canceled (nodeplan rollout cancel): no new node started, the nodes in flight canceled
  5  another rollout is running over these nodes (its Lease is held); nothing was written
  7  stopped by the error budget: more than --max-errors failed, no new node was started
  8  interrupted (Ctrl-C, SIGTERM): nodes in flight go on; the same command continues";

/// How long a rollout's Lease lasts without renewal (renewed every quarter of it).
const LEASE_DURATION: Duration = Duration::from_secs(30);

pub async fn run(args: RolloutArgs) -> u8 {
    let r = match &args.control {
        Some(c) => control(c).await,
        None => rollout(&args).await,
    };
    match r {
        Ok(code) => code,
        Err((code, e)) => {
            super::say(&format!("nodeplan: {e}"));
            code
        }
    }
}

/// The annotation on a rollout's Lease that pauses or cancels it (`paused`, `canceled`).
const ANNOTATION_CONTROL: &str = "rollout.nodeplan.cattle.io/control";

/// `rollout pause|resume|cancel`: the control on the rollout's Lease (the running rollout watches
/// it), and the same on every node of the rollout in flight, in one pass.
async fn control(c: &Control) -> Result<u8, (u8, String)> {
    use crate::plan::{ANNOTATION_CANCELED, ANNOTATION_PAUSED};
    let (args, value, node_patch, done) = match c {
        Control::Pause(a) => {
            (a, Some("paused"), crate::remote::wire::annotation_patch(ANNOTATION_PAUSED, Some("true")), "paused")
        }
        Control::Resume(a) => (a, None, crate::remote::wire::annotation_patch(ANNOTATION_PAUSED, None), "resumed"),
        Control::Cancel(a) => {
            (a, Some("canceled"), crate::remote::wire::annotation_patch(ANNOTATION_CANCELED, Some("true")), "canceled")
        }
    };
    let t = args.nodes.target();
    let kube = super::plan_cmd::kube_client(&t).await.map_err(|e| (exit::FAILED, e))?;
    let ns = args.nodes.namespace.clone().unwrap_or_else(|| kube.default_namespace().to_string());
    let selector = args.nodes.selector();
    let name = rollout::lease_name(&ns, selector);
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = kube::Api::namespaced(kube.clone(), &ns);
    let patch = serde_json::json!({"metadata": {"annotations": {ANNOTATION_CONTROL: value}}});
    let pp = kube::api::PatchParams::default();
    match super::plan_cmd::bounded(&t, "write the rollout's Lease", async {
        leases.patch(&name, &pp, &kube::api::Patch::Merge(&patch)).await.map_err(|e| crate::error_line(&e))
    })
    .await
    {
        Ok(_) => {}
        Err(e) if e.contains("not found") || e.contains("NotFound") => {
            return Err((exit::BAD_INPUT, format!("no rollout over {selector:?} in namespace {ns} (no Lease {name})")));
        }
        Err(e) => return Err((exit::FAILED, e)),
    }
    let found =
        super::plan_cmd::bounded(&t, "list the plan Secrets", client::list_selected(kube.clone(), &ns, selector))
            .await
            .map_err(|e| (exit::FAILED, e))?;
    let mut n = 0;
    for (node, s) in &found {
        let ours = s.annotations.get(rollout::ANNOTATION_LEASE) == Some(&name);
        let flying = matches!(
            crate::remote::wire::plan_state(s),
            Some(crate::plan::PlanState::Pending | crate::plan::PlanState::InProgress | crate::plan::PlanState::Paused)
        );
        // A resume takes the pause off every node of the rollout (one that finished while paused
        // keeps the annotation otherwise, and would hold its next plan).
        let resume = matches!(c, Control::Resume(_));
        if ours && if resume { s.annotations.contains_key(ANNOTATION_PAUSED) } else { flying } {
            write(&kube, &ns, node, node_patch.clone(), &t).await.map_err(|e| (exit::FAILED, e))?;
            crate::cli::out!("{done} {ns}/{node}");
            n += 1;
        }
    }
    crate::cli::out!("{done} the rollout over {selector:?} in namespace {ns} ({n} of its nodes {done})");
    Ok(exit::OK)
}

async fn rollout(args: &RolloutArgs) -> Result<u8, (u8, String)> {
    let plan = args.plan.clone().unwrap_or_default();
    let raw = crate::safefs::read_named(&plan, 16 << 20)
        .map_err(|e| (exit::BAD_INPUT, format!("cannot read {}: {e}", plan.display())))?;
    crate::plan::parse(&raw).map_err(|e| (exit::BAD_INPUT, format!("{}: {e}", plan.display())))?;
    let checksum = crate::plan::checksum(&raw);
    let t = args.nodes.target();
    let kube = super::plan_cmd::kube_client(&t).await.map_err(|e| (exit::FAILED, e))?;
    let ns = args.nodes.namespace.clone().unwrap_or_else(|| kube.default_namespace().to_string());
    let mut held: Option<crate::lease::Held> = None;
    let r = drive(args, &raw, &checksum, &kube, &ns, &mut held).await;
    if let Some(h) = held {
        h.release().await;
    }
    r
}

/// Take the rollout's Lease and claim its nodes, refusing when another running rollout holds
/// them (exit 5, nothing written).
async fn take_nodes(
    kube: &kube::Client,
    ns: &str,
    selector: &str,
    snaps: &BTreeMap<String, client::SecretSnapshot>,
    t: &RemoteTarget,
    held: &mut Option<crate::lease::Held>,
    written: &mut BTreeMap<String, client::SecretSnapshot>,
) -> Result<String, (u8, String)> {
    let name = rollout::lease_name(ns, selector);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    let r = crate::lease::LeaseRef {
        namespace: ns.to_string(),
        name: name.clone(),
        identity: crate::lease::identity(&host),
        duration: LEASE_DURATION,
        what: format!("the rollout over {selector:?}"),
    };
    *held = crate::lease::take_now(kube.clone(), r).await.map_err(|e| {
        (exit::ALREADY_RUNNING, format!("this rollout is running already: its Lease {ns}/{name} is {e}"))
    })?;
    // A canceled rollout run again starts again; a paused one stays paused until resumed.
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = kube::Api::namespaced(kube.clone(), ns);
    let canceled = super::plan_cmd::bounded(t, "read the rollout's Lease", async {
        leases.get_opt(&name).await.map_err(|e| crate::error_line(&e))
    })
    .await
    .map_err(|e| (exit::FAILED, e))?
    .and_then(|l| l.metadata.annotations)
    .is_some_and(|a| a.get(ANNOTATION_CONTROL).is_some_and(|v| v == "canceled"));
    if canceled {
        let patch = serde_json::json!({"metadata": {"annotations": {ANNOTATION_CONTROL: null}}});
        super::plan_cmd::bounded(t, "write the rollout's Lease", async {
            leases
                .patch(&name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch))
                .await
                .map_err(|e| crate::error_line(&e))
        })
        .await
        .map_err(|e| (exit::FAILED, e))?;
        crate::cli::out!("the rollout was canceled: starting it again");
    }
    for (node, s) in snaps {
        let Some(other) = s.annotations.get(rollout::ANNOTATION_LEASE).filter(|o| **o != name) else { continue };
        if let Some(holder) = crate::lease::active_holder(kube.clone(), ns, other).await {
            return Err((
                exit::ALREADY_RUNNING,
                format!(
                    "{node} belongs to another running rollout (Lease {ns}/{other}, held by {holder}); nothing written"
                ),
            ));
        }
    }
    for (node, s) in snaps {
        if s.annotations.get(rollout::ANNOTATION_LEASE) != Some(&name) {
            let w = write(kube, ns, node, rollout::claim_patch(&name), t).await.map_err(|e| (exit::FAILED, e))?;
            written.insert(node.clone(), w);
        }
    }
    Ok(name)
}

async fn drive(
    args: &RolloutArgs,
    raw: &[u8],
    checksum: &str,
    kube: &kube::Client,
    ns: &str,
    held: &mut Option<crate::lease::Held>,
) -> Result<u8, (u8, String)> {
    let t = &args.nodes.target();
    let selector = args.nodes.selector();
    let ns = ns.to_string();
    let mut claimed: Option<String> = None;
    let mut stream = std::pin::pin!(client::watch_selected(kube.clone(), &ns, selector));
    let lease = rollout::lease_name(&ns, selector);
    let mut controls = std::pin::pin!(control_of(kube.clone(), &ns, &lease));
    let mut control: Option<String> = None;
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut told: Option<String> = None;
    let mut stop = std::pin::pin!(super::interrupted());
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut snaps: BTreeMap<String, client::SecretSnapshot> = BTreeMap::new();
    let mut shown: BTreeMap<String, Place> = BTreeMap::new();
    let (mut listed, mut failing) = (false, false);
    // Written by this run and not seen back from the watch yet: the write's answer stands in for
    // it (a decision from the older snapshot would start or give up on the node again).
    let mut written: BTreeMap<String, client::SecretSnapshot> = BTreeMap::new();
    crate::cli::out!(
        "rollout of plan {} to the plan Secrets matching {:?} in namespace {ns}",
        &checksum[..12],
        selector
    );
    loop {
        tokio::select! {
            () = &mut stop => {
                crate::cli::out!("interrupted: the nodes in flight go on; run the same command to continue");
                return Ok(exit::INTERRUPTED);
            }
            _ = tick.tick() => {}
            c = controls.next() => if let Some(c) = c {
                control = c;
            },
            e = stream.next() => match e {
                Some(Selected::Is(name, s)) => {
                    failing = false;
                    if written.get(&name).is_some_and(|w| caught_up(&s.resource_version, &w.resource_version)) {
                        written.remove(&name);
                    }
                    snaps.insert(name, s);
                }
                Some(Selected::Gone(name)) => {
                    snaps.remove(&name);
                }
                Some(Selected::Listed) => listed = true,
                Some(Selected::Failed(e)) => {
                    if !failing {
                        super::say(&format!("nodeplan: watching the plan Secrets: {e}; trying again"));
                    }
                    failing = true;
                }
                None => return Err((exit::FAILED, "the watch ended".into())),
            },
        }
        if !listed {
            continue;
        }
        if claimed.is_none() {
            claimed = Some(take_nodes(kube, &ns, selector, &snaps, t, held, &mut written).await?);
        }
        if held.as_ref().is_some_and(|h| *h.lost().borrow()) {
            return Err((exit::FAILED, "another rollout took this rollout's Lease; stopped".into()));
        }
        let places: BTreeMap<String, Place> = snaps
            .iter()
            .map(|(n, s)| (n.clone(), rollout::classify(written.get(n).unwrap_or(s), checksum, args.wait_healthy)))
            .collect();
        let total = places.len();
        let mut limits = Limits {
            max_concurrent: args.max_concurrent.of(total, true),
            max_errors: args.max_errors.of(total, false),
            wait_healthy: args.wait_healthy,
            timeout: args.timeout,
        };
        report(&places, &mut shown, &limits, terminal.then_some(&snaps));
        if told != control {
            match control.as_deref() {
                Some("paused") => crate::cli::out!("paused: no new node starts (nodeplan rollout resume goes on)"),
                Some("canceled") => crate::cli::out!("canceled: no new node starts; waiting for the nodes in flight"),
                _ if told.is_some() => crate::cli::out!("resumed"),
                _ => {}
            }
            told = control.clone();
        }
        match control.as_deref() {
            Some("canceled") => {
                let c = rollout::counts(&places);
                if c.in_flight == 0 {
                    crate::cli::out!("canceled: {} of {total} nodes succeeded, {} not started", c.done, c.to_start);
                    return Ok(exit::CANCELED);
                }
                continue;
            }
            Some("paused") => limits.max_concurrent = 0,
            _ => {}
        }
        let step = rollout::decide(&places, &limits, chrono::Utc::now());
        for name in &step.give_up {
            crate::cli::out!("{name}: in flight longer than {}: canceled, counted failed", show_timeout(&limits));
            let s = write(kube, &ns, name, rollout::give_up_patch(), t).await.map_err(|e| (exit::FAILED, e))?;
            written.insert(name.clone(), s);
        }
        for name in &step.start {
            crate::cli::out!("{name}: starting");
            let mut patch = rollout::start_patch(raw, chrono::Utc::now());
            if let Some(lease) = &claimed {
                patch["metadata"]["annotations"][rollout::ANNOTATION_LEASE] = lease.clone().into();
            }
            let s = write(kube, &ns, name, patch, t).await.map_err(|e| (exit::FAILED, e))?;
            written.insert(name.clone(), s);
        }
        if let Some(f) = step.finish {
            let c = rollout::counts(&places);
            let summary = format!("{} of {total} nodes succeeded, {} failed", c.done, c.failed + step.give_up.len());
            return Ok(match f {
                Finish::AllSucceeded => {
                    crate::cli::out!("done: {summary}");
                    exit::OK
                }
                Finish::SomeFailed => {
                    crate::cli::out!("done with failures within --max-errors: {summary}");
                    exit::FAILED
                }
                Finish::ErrorBudget => {
                    crate::cli::out!(
                        "stopped by the error budget (more than {} failed): {summary}; {} not started",
                        limits.max_errors,
                        c.to_start
                    );
                    exit::ERROR_BUDGET
                }
            });
        }
    }
}

/// The control annotation of the rollout's Lease as it changes (`None`: none, or no Lease).
fn control_of(kube: kube::Client, ns: &str, name: &str) -> impl futures::Stream<Item = Option<String>> + Send {
    use kube::runtime::{WatchStreamExt as _, watcher};
    let api: kube::Api<k8s_openapi::api::coordination::v1::Lease> = kube::Api::namespaced(kube, ns);
    let fields = format!("metadata.name={name}");
    watcher(api, watcher::Config::default().fields(&fields)).default_backoff().filter_map(|e| async move {
        match e {
            Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l)) => {
                Some(l.metadata.annotations.and_then(|a| a.get(ANNOTATION_CONTROL).cloned()))
            }
            Ok(watcher::Event::Delete(_)) => Some(None),
            _ => None,
        }
    })
}

/// Whether the watch has caught up with a write: it shows the written version or a later one.
/// resourceVersions are opaque, but every API server in use numbers them from etcd's revision; a
/// version that is not a number only matches itself.
fn caught_up(seen: &str, written: &str) -> bool {
    match (seen.parse::<u64>(), written.parse::<u64>()) {
        (Ok(a), Ok(b)) => a >= b,
        _ => seen == written,
    }
}

fn show_timeout(l: &Limits) -> String {
    l.timeout.map(crate::duration::show).unwrap_or_default()
}

/// A line per node whose place changed since the last report, with the overall counts.
/// What changed since the last report: in a terminal, the fleet table (as `plan status
/// --selector` shows it) redrawn with a progress bar; elsewhere a line per node transition and
/// the counts.
fn report(
    places: &BTreeMap<String, Place>,
    shown: &mut BTreeMap<String, Place>,
    limits: &Limits,
    terminal: Option<&BTreeMap<String, client::SecretSnapshot>>,
) {
    let mut changed = false;
    for (name, p) in places {
        if shown.get(name) == Some(p) {
            continue;
        }
        changed = true;
        shown.insert(name.clone(), p.clone());
        if terminal.is_some() {
            continue;
        }
        let what = match p {
            Place::Done => "succeeded".to_string(),
            Place::Failed(why) => format!("FAILED: {why}"),
            Place::InFlight { .. } => "in flight".to_string(),
            Place::ToStart => "waiting".to_string(),
        };
        crate::cli::out!("{name}: {what}");
    }
    if changed {
        let c = rollout::counts(places);
        if let Some(snaps) = terminal {
            let rows = crate::fleet::sorted(snaps.iter().map(|(n, s)| crate::fleet::row_of(n, s)).collect());
            crate::cli::out!("\x1b[H\x1b[2J{}", crate::fleet::table(&rows));
            crate::cli::out!("{}", rollout::bar(c, places.len(), 40));
        }
        crate::cli::out!(
            "[{}/{} done, {} in flight (at most {}), {} failed (at most {} tolerated), {} waiting]",
            c.done,
            places.len(),
            c.in_flight,
            limits.max_concurrent,
            c.failed,
            limits.max_errors,
            c.to_start
        );
    }
}

/// Write one node's Secret; its answer (the Secret as written).
async fn write(
    kube: &kube::Client,
    ns: &str,
    name: &str,
    patch: serde_json::Value,
    t: &RemoteTarget,
) -> Result<client::SecretSnapshot, String> {
    let c = SecretClient::new(kube.clone(), SecretRef { namespace: ns.to_string(), name: name.to_string() });
    super::plan_cmd::bounded(t, "patch the secret", c.orchestrator_patch(patch)).await
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_watch_catches_up_with_a_write() {
        assert!(super::caught_up("10", "10") && super::caught_up("11", "10") && !super::caught_up("9", "10"));
        assert!(super::caught_up("x", "x") && !super::caught_up("y", "x") && !super::caught_up("10", "x"));
    }
}
