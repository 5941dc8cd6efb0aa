//! `nodeplan rollout PLAN --selector S`: push one plan to every node's plan object the selector
//! picks (plan Secrets, or with `--nodeplans` one NodePlan per node), `--max-concurrent` at a
//! time, stopping when more than `--max-errors` fail. The rules are [`crate::fleet::rollout`]'s; this is
//! the loop around them: a watch on the selected objects (every change decides again at once), a
//! tick for the per-node timeout, the writes (through [`crate::fleet::objects`], at most
//! [`objects::PARALLEL`] in flight), and a line per node transition with the overall counts.

use super::exit;
use super::format::Output;
use super::plan_cmd::RemoteTarget;
use crate::fleet::objects::{self, Change, Kind, Object, Scope, Tracker, Write};
use crate::fleet::rollout::{self, Amount, Finish, Limits, Place};
/// What `rollout pause|resume|cancel` does to each node (as `plan pause|resume|cancel`).
use crate::nodeplan::cli_wire::Control as Act;
use clap::Args;
use futures::StreamExt as _;
use std::collections::{BTreeMap, BTreeSet};
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
    /// Show which nodes the rollout would start, in what order and how many at a time (and
    /// which it skips), and write nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// Which nodes (and how to reach their API server).
#[derive(Args, Debug)]
pub struct Nodes {
    /// The nodes: every plan Secret (or with --nodeplans, NodePlan) this label selector picks
    /// (kubectl's syntax).
    #[arg(long, short = 'l', value_name = "SELECTOR", required = true)]
    pub selector: Option<String>,
    /// The namespace of the plan objects, and of the rollout's Lease [default: the kubeconfig
    /// context's namespace, else default].
    #[arg(long, short = 'n', value_name = "NAMESPACE", value_parser = super::plan_cmd::nodeplan::parse_namespace)]
    pub namespace: Option<String>,
    /// The selector picks NodePlans, one per node (two selected NodePlans of one node are
    /// refused), instead of plan Secrets.
    #[arg(long)]
    pub nodeplans: bool,
    /// With --nodeplans: select in every namespace (one namespace per node); the Lease stays in
    /// the context's namespace (or -n).
    #[arg(long, short = 'A', requires = "nodeplans")]
    pub all_namespaces: bool,
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

    /// The selected objects, and the rollout's Lease (namespace, name) and the claim a node of
    /// the rollout carries.
    fn scope(&self, kube: &kube::Client) -> (Scope, Lease) {
        let ns = self.namespace.clone().unwrap_or_else(|| kube.default_namespace().to_string());
        let kind = if self.nodeplans { Kind::NodePlans } else { Kind::Secrets };
        let scope = Scope {
            kind,
            namespace: (!self.all_namespaces).then(|| ns.clone()),
            selector: self.selector().to_string(),
        };
        let lease = match kind {
            Kind::Secrets => {
                let name = rollout::lease_name(&ns, self.selector());
                Lease { namespace: ns, claim: name.clone(), name }
            }
            Kind::NodePlans => {
                let place = if self.all_namespaces { "*" } else { ns.as_str() };
                let name = rollout::lease_name(&format!("nodeplans/{place}"), self.selector());
                Lease { claim: format!("{ns}/{name}"), namespace: ns, name }
            }
        };
        (scope, lease)
    }
}

/// A rollout's Lease, and the value of [`rollout::ANNOTATION_LEASE`] on its nodes: the Lease's
/// name for a plan Secret (in the same namespace), `NAMESPACE/NAME` for a NodePlan.
#[derive(Debug, Clone)]
struct Lease {
    namespace: String,
    name: String,
    claim: String,
}

/// The Lease a claim names (a claim without a namespace is in the object's).
fn lease_of_claim<'a>(claim: &'a str, object_namespace: &'a str) -> (&'a str, &'a str) {
    claim.split_once('/').unwrap_or((object_namespace, claim))
}

/// `rollout pause|resume|cancel`: act on the running (or stopped) rollout over a selection.
#[derive(clap::Subcommand, Debug)]
pub enum Control {
    /// Start no new node, and pause the nodes in flight at their next instruction boundary.
    #[command(after_help = CONTROL_EXIT_CODES)]
    Pause(ControlArgs),
    /// Undo a pause: the nodes in flight go on, and the rollout starts nodes again.
    #[command(after_help = CONTROL_EXIT_CODES)]
    Resume(ControlArgs),
    /// Start no new node and cancel the nodes in flight; the rollout ends (exit 4) once they have.
    #[command(after_help = CONTROL_EXIT_CODES)]
    Cancel(ControlArgs),
    /// Where the rollout over the selection stands: running, paused, canceled or none (its Lease),
    /// its plan, and every selected node's row as `plan status --selector` shows it.
    #[command(after_help = STATUS_EXIT_CODES)]
    Status(StatusArgs),
}

/// `rollout pause|resume|cancel --help`'s exit codes.
const CONTROL_EXIT_CODES: &str = "Exit codes:
  0  done (the rollout's Lease says so; the running rollout acts on it)
  1  the API server could not be read or written
  2  bad arguments, or no rollout over the selection";

/// `rollout status --help`'s exit codes.
const STATUS_EXIT_CODES: &str = "Exit codes:
  0  shown (a selection without a rollout says so)
  1  the API server could not be read
  2  bad arguments";

#[derive(Args, Debug)]
pub struct ControlArgs {
    #[command(flatten)]
    pub nodes: Nodes,
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub nodes: Nodes,
    /// `table`, `wide` (the objects too), `json` or `yaml` (one document: the rollout and its
    /// nodes' rows), `name` (each node's object, `secret/NAME` or `nodeplan.agent.cattle.io/NAME`).
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// `rollout status -o json|yaml`.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct RolloutStatus {
    /// `running`, `paused`, `canceled`, `stopped` (its command ended; the same command continues
    /// it) or `none`.
    state: String,
    /// Whether a rollout command runs now (it holds the Lease).
    running: bool,
    /// The rollout's plan id (empty without a rollout).
    plan: String,
    /// Who runs it (the Lease's holder).
    #[serde(skip_serializing_if = "String::is_empty")]
    holder: String,
    nodes: Vec<crate::fleet::Row>,
}

/// `rollout --help`'s exit codes.
pub const EXIT_CODES: &str = "Exit codes:
  0  every selected node succeeded (nodes already at the plan and succeeded count, untouched)
  1  every node was tried and some failed, within --max-errors; or the API server could not be
     read or written
  2  bad arguments or plan file; with --nodeplans, a selection that is not one NodePlan per node
     (pause|resume|cancel: no rollout over the selection)
  4  canceled (nodeplan rollout cancel): no new node started, the nodes in flight canceled
  5  another rollout is running over these nodes (its Lease is held); nothing was written
  7  stopped by the error budget: more than --max-errors failed, no new node was started
  8  interrupted (Ctrl-C, SIGTERM): nodes in flight go on; the same command continues";

/// How long a rollout's Lease lasts without renewal (renewed every quarter of it).
const LEASE_DURATION: Duration = Duration::from_secs(30);

pub async fn run(args: RolloutArgs) -> u8 {
    let r = match &args.control {
        Some(Control::Status(a)) => status(a).await,
        Some(Control::Pause(a)) => control(a, Act::Pause).await,
        Some(Control::Resume(a)) => control(a, Act::Resume).await,
        Some(Control::Cancel(a)) => control(a, Act::Cancel).await,
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
/// The annotation on a rollout's Lease naming the plan it pushes (its checksum, as a node's
/// [`crate::fleet::Standing::plan`]).
const ANNOTATION_PLAN: &str = "rollout.nodeplan.cattle.io/plan";
/// The annotation on a rollout's Lease naming the plan as people read it (its id).
const ANNOTATION_PLAN_ID: &str = "rollout.nodeplan.cattle.io/plan-id";

/// `rollout pause|resume|cancel`: the control on the rollout's Lease (the running rollout watches
/// it), and the same on every node of the rollout in flight, in one pass.
async fn control(args: &ControlArgs, act: Act) -> Result<u8, (u8, String)> {
    let (value, done) = match act {
        Act::Pause => (Some("paused"), "paused"),
        Act::Resume => (None, "resumed"),
        Act::Cancel => (Some("canceled"), "canceled"),
    };
    let t = args.nodes.target();
    let kube = super::plan_cmd::kube_client(&t).await.map_err(|e| (exit::FAILED, e))?;
    let (scope, lease) = args.nodes.scope(&kube);
    let node_patch = node_control_patch(scope.kind, act);
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(kube.clone(), &lease.namespace);
    let patch = serde_json::json!({"metadata": {"annotations": {ANNOTATION_CONTROL: value}}});
    let pp = kube::api::PatchParams::default();
    let plan = match crate::k8s::bounded(t.request_timeout, "write the rollout's Lease", async {
        leases.patch(&lease.name, &pp, &kube::api::Patch::Merge(&patch)).await.map_err(|e| crate::k8s::error_line(&e))
    })
    .await
    {
        Ok(l) => l.metadata.annotations.and_then(|mut a| a.remove(ANNOTATION_PLAN)),
        Err(e) if e.contains("not found") || e.contains("NotFound") => {
            return Err((
                exit::BAD_INPUT,
                format!("no rollout over {} (no Lease {}/{})", scope.describe(), lease.namespace, lease.name),
            ));
        }
        Err(e) => return Err((exit::FAILED, e)),
    };
    let found = objects::list(kube.clone(), &scope, t.request_timeout).await.map_err(|e| (exit::FAILED, e))?;
    let resume = act == Act::Resume;
    let writes: Vec<(String, Write)> = found
        .iter()
        .filter(|(key, o)| {
            let st = o.standing(key);
            let ours = st.annotations.get(rollout::ANNOTATION_LEASE) == Some(&lease.claim);
            // A resume takes the pause off every node of the rollout (one that finished while
            // paused would hold its next plan otherwise).
            let wanted = if resume { held(o) } else { st.outcome == crate::fleet::Outcome::Running };
            // Only the nodes running the rollout's plan (a node claimed but not started yet may
            // be running another one); a Lease of an older rollout names none.
            let its_plan = plan.as_ref().is_none_or(|p| st.plan.as_ref() == Some(p));
            ours && st.plan.is_some() && its_plan && wanted
        })
        .map(|(key, _)| (key.clone(), Write::Merge(node_patch.clone())))
        .collect();
    let n = writes.len();
    let answers = objects::write_all(&kube, &scope, writes, t.request_timeout).await;
    let failed = super::plan_cmd::fleet::tell_writes(&scope, answers, done);
    if failed > 0 {
        return Err((exit::FAILED, format!("{failed} of {} could not be {done}", crate::count(n, "node"))));
    }
    crate::cli::out!("{done} the rollout over {} ({n} of its nodes {done})", scope.describe());
    Ok(exit::OK)
}

/// `rollout status`: the rollout's Lease (whether one runs, paused or canceled, and its plan),
/// then the selected nodes' rows. Writes nothing.
async fn status(args: &StatusArgs) -> Result<u8, (u8, String)> {
    let t = args.nodes.target();
    let kube = super::plan_cmd::kube_client(&t).await.map_err(|e| (exit::FAILED, e))?;
    let (scope, lease) = args.nodes.scope(&kube);
    let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
        kube::Api::namespaced(kube.clone(), &lease.namespace);
    let found = crate::k8s::bounded(t.request_timeout, "read the rollout's Lease", async {
        leases.get_opt(&lease.name).await.map_err(|e| crate::k8s::error_line(&e))
    })
    .await
    .map_err(|e| (exit::FAILED, e))?;
    let mut st = RolloutStatus {
        state: "none".into(),
        running: false,
        plan: String::new(),
        holder: String::new(),
        nodes: Vec::new(),
    };
    let line = match found {
        None => format!("rollout:    none over {} (no Lease {}/{})", scope.describe(), lease.namespace, lease.name),
        Some(l) => {
            let a = l.metadata.annotations.unwrap_or_default();
            st.plan = a
                .get(ANNOTATION_PLAN_ID)
                .or(a.get(ANNOTATION_PLAN))
                .map(|p| crate::plan::failure::shown(crate::plan::short(p), 12))
                .unwrap_or_default();
            let spec = l.spec.unwrap_or_default();
            st.holder = spec.holder_identity.map(|h| crate::plan::failure::shown_line(&h)).unwrap_or_default();
            st.running = !st.holder.is_empty();
            let control = a.get(ANNOTATION_CONTROL).map(|c| crate::plan::failure::shown_line(c));
            st.state = match (&control, st.running) {
                (Some(c), _) => c.clone(),
                (None, true) => "running".into(),
                (None, false) => "stopped".into(),
            };
            let state = match (control, st.running) {
                (Some(c), true) => format!("{c} (running)"),
                (Some(c), false) => format!("{c} (not running)"),
                (None, true) => "running".to_string(),
                (None, false) => "not running (run the same rollout command to continue)".to_string(),
            };
            let held = if st.running { format!(", held by {}", st.holder) } else { String::new() };
            let plan = if st.plan.is_empty() { "-" } else { &st.plan };
            format!("rollout:    {state}, plan {plan}{held}")
        }
    };
    let found = objects::list(kube, &scope, t.request_timeout).await.map_err(|e| (exit::FAILED, e))?;
    st.nodes = crate::fleet::sorted(found.iter().map(|(key, o)| o.row(&scope, key)).collect());
    match args.output {
        Output::Table | Output::Wide => {
            crate::cli::out!("{line}");
            if st.nodes.is_empty() {
                crate::cli::out!("no objects: {} (none)", scope.describe());
            } else {
                crate::cli::out!("{}", crate::fleet::table(&st.nodes, args.output == Output::Wide));
                crate::cli::out!("{}", crate::fleet::summary(&st.nodes));
            }
        }
        Output::Name => super::format::print(&st.nodes, false, Output::Name, crate::fleet::Row::kube_name),
        _ => super::format::print(&[st], true, args.output, |_| String::new()),
    }
    Ok(exit::OK)
}

/// The patch that pauses, resumes or cancels one node's plan object.
fn node_control_patch(kind: Kind, act: Act) -> serde_json::Value {
    use crate::plan::{ANNOTATION_CANCELED, ANNOTATION_PAUSED};
    use crate::remote::wire::annotation_patch;
    match (kind, act) {
        (Kind::Secrets, Act::Pause) => annotation_patch(ANNOTATION_PAUSED, Some("true")),
        (Kind::Secrets, Act::Resume) => annotation_patch(ANNOTATION_PAUSED, None),
        (Kind::Secrets, Act::Cancel) => annotation_patch(ANNOTATION_CANCELED, Some("true")),
        (Kind::NodePlans, act) => act.patch(),
    }
}

/// Whether the object carries a pause (the annotation, `spec.paused`).
fn held(o: &Object) -> bool {
    match o {
        Object::Secret(s) => s.annotations.contains_key(crate::plan::ANNOTATION_PAUSED),
        Object::NodePlan(o) => crate::nodeplan::cli_wire::spec_of(o).paused,
    }
}

/// The plan a rollout pushes: its bytes (a plan Secret holds them as they are) and, for
/// NodePlans, the object `spec.plan` holds (null for plan Secrets); the checksum a node's [`crate::fleet::Standing`] is
/// compared with.
struct Pushed {
    raw: Vec<u8>,
    object: serde_json::Value,
    checksum: String,
    /// The plan's id, as every command shows it.
    id: String,
}

fn read_plan(path: &std::path::Path, kind: Kind) -> Result<Pushed, (u8, String)> {
    let bad = |e: String| (exit::BAD_INPUT, format!("{}: {e}", path.display()));
    let raw = crate::safefs::read_named(path, 16 << 20)
        .map_err(|e| (exit::BAD_INPUT, format!("cannot read {}: {e}", path.display())))?;
    let id = crate::plan::parse(&raw).map_err(|e| bad(e.to_string()))?.id();
    if kind == Kind::Secrets {
        super::warn_unknown_keys(path, &raw);
    }
    let (object, checksum) = match kind {
        Kind::Secrets => (serde_json::Value::Null, crate::plan::checksum(&raw)),
        Kind::NodePlans => {
            // As the API server stores it (it drops nulls), so the checksum compared is the stored one.
            let object = crate::nodeplan::cli_wire::plan_object(&raw).map_err(bad)?;
            let spec = crate::nodeplan::resource::NodePlanSpec { plan: Some(object.clone()), ..Default::default() };
            let checksum =
                crate::nodeplan::wire::plan_bytes(&spec).map(|b| crate::plan::checksum(&b)).unwrap_or_default();
            (object, checksum)
        }
    };
    Ok(Pushed { raw, object, checksum, id })
}

async fn rollout(args: &RolloutArgs) -> Result<u8, (u8, String)> {
    let t = args.nodes.target();
    let kind = if args.nodes.nodeplans { Kind::NodePlans } else { Kind::Secrets };
    let plan = read_plan(&args.plan.clone().unwrap_or_default(), kind)?;
    let kube = super::plan_cmd::kube_client(&t).await.map_err(|e| (exit::FAILED, e))?;
    if args.dry_run {
        return dry_run(args, &plan, &kube).await;
    }
    let mut held: Option<crate::lease::Held> = None;
    let r = drive(args, &plan, &kube, &mut held).await;
    if let Some(h) = held {
        h.release().await;
    }
    r
}

/// `rollout --dry-run`: the selection as the rollout would see it now, and the order and waves
/// in which it would start the nodes (a wave is `--max-concurrent` nodes; in the rollout a node
/// starts as soon as one in flight finishes). Writes nothing, takes no Lease.
async fn dry_run(args: &RolloutArgs, plan: &Pushed, kube: &kube::Client) -> Result<u8, (u8, String)> {
    let t = args.nodes.target();
    let (scope, _) = args.nodes.scope(kube);
    let found: BTreeMap<String, Object> = objects::list(kube.clone(), &scope, t.request_timeout)
        .await
        .map_err(|e| (exit::FAILED, e))?
        .into_iter()
        .collect();
    if let Some(e) = one_per_node(&found) {
        return Err((exit::BAD_INPUT, e));
    }
    let total = found.len();
    let (concurrent, errors) = (args.max_concurrent.of(total, true).max(1), args.max_errors.of(total, false));
    let id = &plan.id;
    crate::cli::out!(
        "dry run: roll plan {id} out to {} ({}); nothing is written",
        crate::count(total, "node"),
        scope.describe()
    );
    crate::cli::out!("at most {concurrent} in flight at once; no new node starts after more than {errors} failed");
    let (mut done, mut running, mut failed, mut to_start) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (key, o) in &found {
        let st = o.standing(key);
        let name = crate::plan::failure::shown_line(&st.node);
        match rollout::classify(&st, &plan.checksum, args.wait_healthy) {
            Place::Done => done.push(name),
            Place::InFlight { .. } => running.push(name),
            Place::Failed(why) => failed.push(format!("{name} ({})", crate::plan::failure::shown_line(&why))),
            Place::ToStart => to_start.push(name),
        }
    }
    for (what, nodes) in [
        ("skipped, already at this plan and succeeded", &done),
        ("already running this plan (waited for)", &running),
        ("already failed with this plan (counted failed)", &failed),
    ] {
        if !nodes.is_empty() {
            crate::cli::out!("{what}: {}", nodes.join(", "));
        }
    }
    let slots = concurrent.saturating_sub(running.len()).max(1);
    let mut waves = vec![to_start.iter().take(slots).cloned().collect::<Vec<_>>()];
    waves.extend(to_start[to_start.len().min(slots)..].chunks(concurrent).map(<[String]>::to_vec));
    for (i, wave) in waves.iter().filter(|w| !w.is_empty()).enumerate() {
        crate::cli::out!("wave {}: {}", i + 1, wave.join(", "));
    }
    if to_start.is_empty() {
        crate::cli::out!("nothing to start");
    }
    Ok(exit::OK)
}

/// With NodePlans: why the selection is not one NodePlan per node (a NodePlan of no node, which
/// no agent runs, or a node with two), if it is not.
fn one_per_node(objects: &BTreeMap<String, Object>) -> Option<String> {
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    for (key, o) in objects {
        let Object::NodePlan(o) = o else { continue };
        let Some(node) = crate::nodeplan::cli_wire::node_name(o) else {
            return Some(format!(
                "{key} has no {} label: no agent runs it; narrow the selector",
                crate::nodeplan::resource::NODE_LABEL
            ));
        };
        if let Some(first) = seen.insert(node, key) {
            return Some(format!(
                "node {} has two selected NodePlans ({first} and {key}); a rollout writes one per node: narrow the \
                 selector",
                crate::plan::failure::shown(node, 80)
            ));
        }
    }
    None
}

/// Take the rollout's Lease and check its nodes, refusing when another running rollout holds
/// one of them (exit 5, nothing written). The nodes to claim (not claimed by this rollout yet)
/// are claimed with the first step's starts (a node started carries its claim in the start), so
/// a rollout of every node at once writes each node once.
async fn take_nodes(
    kube: &kube::Client,
    scope: &Scope,
    lease: &Lease,
    t: &RemoteTarget,
    held: &mut Option<crate::lease::Held>,
    view: &View,
    plan: &Pushed,
) -> Result<Taken, (u8, String)> {
    let checksum = plan.checksum.as_str();
    let snaps = &view.tracker.objects;
    if let Some(e) = one_per_node(snaps) {
        return Err((exit::BAD_INPUT, e));
    }
    let (ns, name) = (&lease.namespace, &lease.name);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    let r = crate::lease::LeaseRef {
        namespace: ns.clone(),
        name: name.clone(),
        identity: crate::lease::identity(&host),
        duration: LEASE_DURATION,
        // A command runs no instructions: nothing to stop before the Lease can be taken over.
        stop_budget: Duration::ZERO,
        what: format!("the rollout over {}", scope.describe()),
    };
    *held = crate::lease::take_now(kube.clone(), r).await.map_err(|e| {
        (exit::ALREADY_RUNNING, format!("this rollout is running already: its Lease {ns}/{name} is {e}"))
    })?;
    for (key, st) in &view.standings {
        let Some(other) = st.annotations.get(rollout::ANNOTATION_LEASE).filter(|o| **o != lease.claim) else {
            continue;
        };
        let (object_ns, _) = scope.locate(key);
        let (other_ns, other_name) = lease_of_claim(other, &object_ns);
        if let Some(holder) = crate::lease::active_holder(kube.clone(), other_ns, other_name).await {
            return Err((
                exit::ALREADY_RUNNING,
                format!(
                    "{key} belongs to another running rollout (Lease {other_ns}/{other_name}, held by {holder}); \
                     nothing written"
                ),
            ));
        }
    }
    // The Lease names the plan (so `rollout pause|cancel` act on the nodes running it only). A
    // canceled rollout run again starts again, its canceled nodes too; a paused one stays paused
    // until resumed.
    let mut anew = BTreeSet::new();
    if held.is_some() {
        let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> = kube::Api::namespaced(kube.clone(), ns);
        let canceled = crate::k8s::bounded(t.request_timeout, "read the rollout's Lease", async {
            leases.get_opt(name).await.map_err(|e| crate::k8s::error_line(&e))
        })
        .await
        .map_err(|e| (exit::FAILED, e))?
        .and_then(|l| l.metadata.annotations)
        .is_some_and(|a| a.get(ANNOTATION_CONTROL).is_some_and(|v| v == "canceled"));
        let mut annotations = serde_json::json!({ANNOTATION_PLAN: checksum, ANNOTATION_PLAN_ID: plan.id});
        if canceled {
            annotations[ANNOTATION_CONTROL] = serde_json::Value::Null;
            anew = view
                .standings
                .iter()
                .filter(|(_, st)| {
                    st.annotations.get(rollout::ANNOTATION_LEASE) == Some(&lease.claim)
                        && rollout::classify(st, checksum, false) == Place::Failed("canceled".into())
                })
                .map(|(k, _)| k.clone())
                .collect();
        }
        let patch = serde_json::json!({"metadata": {"annotations": annotations}});
        crate::k8s::bounded(t.request_timeout, "write the rollout's Lease", async {
            leases
                .patch(name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch))
                .await
                .map_err(|e| crate::k8s::error_line(&e))
        })
        .await
        .map_err(|e| (exit::FAILED, e))?;
        if canceled {
            crate::cli::out!("the rollout was canceled: starting it again ({} canceled nodes start anew)", anew.len());
        }
    }
    let to_claim = view
        .standings
        .iter()
        .filter(|(_, st)| st.annotations.get(rollout::ANNOTATION_LEASE) != Some(&lease.claim))
        .map(|(key, _)| key.clone())
        .collect();
    Ok(Taken { to_claim, anew })
}

/// What taking the nodes left to do.
struct Taken {
    /// Nodes not claimed by this rollout yet: claimed with the first step's writes.
    to_claim: Vec<String>,
    /// Nodes a cancel of this rollout stopped: started again (not counted failed) when the
    /// canceled rollout is run again.
    anew: BTreeSet<String>,
}

/// The selected nodes as the rollout sees them: each object's latest version (the watch's, or
/// this run's own write until the watch has caught up with it: a decision from the older version
/// would start or give up on the node again) and its standing, recomputed only for the object
/// that changed (a fleet of 500 sees thousands of changes).
#[derive(Default)]
struct View {
    tracker: Tracker,
    written: BTreeMap<String, Object>,
    standings: BTreeMap<String, crate::fleet::Standing>,
}

impl View {
    fn apply(&mut self, e: objects::Selected) {
        match self.tracker.apply(e) {
            Change::Is(key) => {
                let seen = self.tracker.objects.get(&key).map(|o| o.resource_version().to_string());
                if self.written.get(&key).is_some_and(|w| caught_up(&seen.unwrap_or_default(), w.resource_version())) {
                    self.written.remove(&key);
                }
                self.refresh(&key);
            }
            Change::Gone(key) => {
                self.written.remove(&key);
                self.refresh(&key);
            }
            Change::Listed(gone) => {
                for key in gone {
                    self.written.remove(&key);
                    self.refresh(&key);
                }
            }
            Change::None => {}
        }
    }

    /// This run wrote `o` (the API server's answer).
    fn wrote(&mut self, key: String, o: Object) {
        self.written.insert(key.clone(), o);
        self.refresh(&key);
    }

    fn refresh(&mut self, key: &str) {
        let latest = self.tracker.objects.get(key).map(|o| self.written.get(key).unwrap_or(o));
        match latest {
            Some(o) => self.standings.insert(key.to_string(), o.standing(key)),
            None => self.standings.remove(key),
        };
    }
}

async fn drive(
    args: &RolloutArgs,
    plan: &Pushed,
    kube: &kube::Client,
    held: &mut Option<crate::lease::Held>,
) -> Result<u8, (u8, String)> {
    let t = &args.nodes.target();
    let (scope, lease) = args.nodes.scope(kube);
    let mut claimed = false;
    let mut to_claim: Vec<String> = Vec::new();
    let mut anew: BTreeSet<String> = BTreeSet::new();
    let mut stream = objects::watch(kube.clone(), &scope);
    // The control annotation is watched from when the Lease is this run's (and a cancel left
    // from before is cleared): an earlier watch could still report that old cancel after it.
    let mut controls: std::pin::Pin<Box<dyn futures::Stream<Item = Option<String>> + Send>> =
        Box::pin(futures::stream::pending());
    let mut control: Option<String> = None;
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut told: Option<String> = None;
    let mut stop = std::pin::pin!(super::interrupted());
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut view = View::default();
    let mut shown: BTreeMap<String, Place> = BTreeMap::new();
    // The first list is one request's work: an API server that cannot be read ends the rollout
    // (exit 1) after --request-timeout rather than being retried for ever.
    let first_list = tokio::time::sleep(t.request_timeout);
    tokio::pin!(first_list);
    crate::cli::out!("rollout of plan {} to {}", plan.id, scope.describe());
    loop {
        tokio::select! {
            () = &mut stop => {
                crate::cli::out!("interrupted: the nodes in flight go on; run the same command to continue");
                return Ok(exit::INTERRUPTED);
            }
            () = &mut first_list, if !view.tracker.listed => {
                let why = format!(
                    "cannot read the API server: {} could not be listed within {} (--request-timeout); nothing was written",
                    scope.describe(),
                    crate::duration::show(t.request_timeout)
                );
                return Err((exit::FAILED, why));
            }
            _ = tick.tick() => {}
            c = controls.next() => if let Some(c) = c {
                control = c;
            },
            e = stream.next() => {
                let Some(e) = e else { return Err((exit::FAILED, "the watch ended".into())) };
                view.apply(e);
                // Whatever else has arrived is taken in before deciding again: one decision per
                // burst of changes, not one per change.
                while let Some(Some(e)) = futures::FutureExt::now_or_never(stream.next()) {
                    view.apply(e);
                }
            }
        }
        if !view.tracker.listed {
            continue;
        }
        if !claimed {
            let taken = take_nodes(kube, &scope, &lease, t, held, &view, plan).await?;
            (to_claim, anew) = (taken.to_claim, taken.anew);
            claimed = true;
            // Without a Lease (the account may not use them: warned already) there is no control.
            if held.is_some() {
                let mut watch = control_of(kube.clone(), &lease.namespace, &lease.name);
                // Its first report (the Lease as it is now) decides whether to start at all; a
                // Lease that cannot be watched leaves the rollout without pause and cancel.
                match tokio::time::timeout(t.request_timeout, watch.next()).await {
                    Ok(Some(c)) => {
                        control = c;
                        controls = watch;
                    }
                    Ok(None) | Err(_) => super::say(
                        "nodeplan: no answer watching the rollout's Lease: `nodeplan rollout pause|resume|cancel` will \
                         not reach this run",
                    ),
                }
            }
        }
        if held.as_ref().is_some_and(|h| *h.lost().borrow()) {
            return Err((exit::FAILED, "another rollout took this rollout's Lease; stopped".into()));
        }
        // The selection may change while the rollout runs (a NodePlan labelled in).
        if let Some(e) = one_per_node(&view.tracker.objects) {
            return Err((exit::BAD_INPUT, format!("{e}; nothing more started")));
        }
        let standings = &view.standings;
        let places: BTreeMap<String, Place> = standings
            .iter()
            .map(|(k, st)| {
                let p = match rollout::classify(st, &plan.checksum, args.wait_healthy) {
                    Place::Failed(_) if anew.contains(k) => Place::ToStart,
                    p => p,
                };
                (k.clone(), p)
            })
            .collect();
        let total = places.len();
        let mut limits = Limits {
            max_concurrent: args.max_concurrent.of(total, true),
            max_errors: args.max_errors.of(total, false),
            wait_healthy: args.wait_healthy,
            timeout: args.timeout,
        };
        report(&places, &mut shown, &limits, terminal.then_some(standings));
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
                    crate::cli::out!(
                        "canceled: {} of {total} nodes succeeded, {} canceled, {} failed, {} not started",
                        c.done,
                        c.canceled,
                        c.failed,
                        c.to_start
                    );
                    return Ok(exit::CANCELED);
                }
                continue;
            }
            Some("paused") => limits.max_concurrent = 0,
            _ => {}
        }
        let step = rollout::decide(&places, &limits, chrono::Utc::now());
        let mut writes: Vec<(String, Write)> = Vec::new();
        for key in &step.give_up {
            crate::cli::out!("{key}: in flight longer than {}: canceled, counted failed", show_timeout(&limits));
            let patch = match scope.kind {
                Kind::Secrets => rollout::give_up_patch(),
                Kind::NodePlans => rollout::give_up_nodeplan_patch(),
            };
            writes.push((key.clone(), Write::Merge(patch)));
        }
        for key in &step.start {
            anew.remove(key);
            crate::cli::out!("{key}: starting");
            writes.push((key.clone(), start(scope.kind, plan, &lease.claim)));
        }
        for key in to_claim.drain(..).filter(|k| !step.start.contains(k) && !step.give_up.contains(k)) {
            writes.push((key, Write::Merge(rollout::claim_patch(&lease.claim))));
        }
        take_answers(&mut view, objects::write_all(kube, &scope, writes, t.request_timeout).await)?;
        // A node just started that does not hold the plan as sent was changed by the API server
        // (a schema that rewrites it): starting it again would loop, so stop here.
        for key in &step.start {
            if view.standings.get(key).is_some_and(|st| st.plan.as_deref() != Some(plan.checksum.as_str())) {
                return Err((
                    exit::FAILED,
                    format!(
                        "{key}: the API server stored the plan differently from the one sent; nothing more started"
                    ),
                ));
            }
        }
        if let Some(f) = step.finish {
            let c = rollout::counts(&places);
            let mut summary =
                format!("{} of {total} nodes succeeded, {} failed", c.done, c.failed + step.give_up.len());
            if c.canceled > 0 {
                summary.push_str(&format!(", {} canceled", c.canceled));
            }
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

/// Take in a batch's answers: every write that landed is recorded (so no decision is made from
/// the version before it); the ones that failed are each told, and end the rollout (exit 1; the
/// same command continues).
fn take_answers(view: &mut View, answers: Vec<(String, Result<Object, String>)>) -> Result<(), (u8, String)> {
    let mut failed = Vec::new();
    for (key, r) in answers {
        match r {
            Ok(o) => view.wrote(key, o),
            Err(e) => {
                super::say(&format!("nodeplan: {key}: {e}"));
                failed.push(key);
            }
        }
    }
    match failed.len() {
        0 => Ok(()),
        n => Err((
            exit::FAILED,
            format!("{n} write(s) failed ({}); run the same command to continue", failed.join(", ")),
        )),
    }
}

/// The write that starts a node: the plan pushed as `pending` with the start time and the claim.
fn start(kind: Kind, plan: &Pushed, claim: &str) -> Write {
    match kind {
        Kind::Secrets => {
            let mut patch = rollout::start_patch(&plan.raw, chrono::Utc::now());
            patch["metadata"]["annotations"][rollout::ANNOTATION_LEASE] = claim.into();
            Write::Merge(patch)
        }
        Kind::NodePlans => Write::StartNodePlan { plan: plan.object.clone(), lease: Some(claim.to_string()) },
    }
}

/// The control annotation of the rollout's Lease, first as it is now, then as it changes (`None`:
/// none, or no Lease), through the one list/watch (its log lines say when it fails).
fn control_of(
    kube: kube::Client,
    ns: &str,
    name: &str,
) -> std::pin::Pin<Box<dyn futures::Stream<Item = Option<String>> + Send>> {
    use crate::k8s::watch::{Event, KubeListWatch, follow};
    let api: kube::Api<k8s_openapi::api::coordination::v1::Lease> = kube::Api::namespaced(kube, ns);
    let what = format!("the rollout's Lease {ns}/{name}");
    // What a list shows is reported once the list is complete (it may not hold the Lease at all).
    let mut listing: Option<Option<String>> = None;
    Box::pin(follow(KubeListWatch::named(api, name), what).filter_map(move |e| {
        let r = match e {
            Event::Relisting => {
                listing = Some(None);
                None
            }
            Event::Is(_, l) => {
                let control = l.metadata.annotations.and_then(|mut a| a.remove(ANNOTATION_CONTROL));
                match &mut listing {
                    Some(listed) => {
                        *listed = control;
                        None
                    }
                    None => Some(control),
                }
            }
            Event::Gone(_) => Some(None),
            Event::Listed => listing.take(),
        };
        std::future::ready(r)
    }))
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

/// What changed since the last report: in a terminal, the fleet table (as `plan status
/// --selector` shows it) redrawn with a progress bar; elsewhere a line per node transition and
/// the counts.
fn report(
    places: &BTreeMap<String, Place>,
    shown: &mut BTreeMap<String, Place>,
    limits: &Limits,
    terminal: Option<&BTreeMap<String, crate::fleet::Standing>>,
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
        if let Some(standings) = terminal {
            let rows = crate::fleet::sorted(standings.values().map(crate::fleet::row_of).collect());
            crate::cli::out_raw!("\x1b[H\x1b[2J{}", crate::cli::terminal_safe(&crate::fleet::table(&rows, false)));
            crate::cli::out!("{}", rollout::bar(c, places.len(), 40));
        }
        crate::cli::out!(
            "[{}/{} done, {} in flight (at most {}), {} failed{} (at most {} tolerated), {} waiting]",
            c.done,
            places.len(),
            c.in_flight,
            limits.max_concurrent,
            c.failed,
            if c.canceled > 0 { format!(" and {} canceled", c.canceled) } else { String::new() },
            limits.max_errors,
            c.to_start
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nodeplan_rollout_needs_one_nodeplan_per_node() {
        let np = |name: &str, labels: serde_json::Value| {
            let o: kube::api::DynamicObject = serde_json::from_value(serde_json::json!({
                "apiVersion": "agent.cattle.io/v1alpha1", "kind": "NodePlan",
                "metadata": {"name": name, "labels": labels}, "spec": {},
            }))
            .unwrap_or_else(|e| panic!("{e}"));
            (name.to_string(), Object::NodePlan(Box::new(o)))
        };
        let node = |n: &str| serde_json::json!({"cattle.io/node": n});
        let ok: BTreeMap<String, Object> = [np("a", node("n1")), np("b", node("n2"))].into_iter().collect();
        assert_eq!(one_per_node(&ok), None);
        let two: BTreeMap<String, Object> = [np("a", node("n1")), np("b", node("n1"))].into_iter().collect();
        assert!(one_per_node(&two).is_some_and(|e| e.contains("node n1 has two selected NodePlans (a and b)")));
        let none: BTreeMap<String, Object> = [np("a", serde_json::json!({}))].into_iter().collect();
        assert!(one_per_node(&none).is_some_and(|e| e.contains("a has no cattle.io/node label")));
    }

    #[test]
    fn the_watch_catches_up_with_a_write() {
        assert!(super::caught_up("10", "10") && super::caught_up("11", "10") && !super::caught_up("9", "10"));
        assert!(super::caught_up("x", "x") && !super::caught_up("y", "x") && !super::caught_up("10", "x"));
    }
}
