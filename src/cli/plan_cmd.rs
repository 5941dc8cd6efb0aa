//! `nodeplan plan push|pause|resume|cancel|reset|status`: the orchestrator's side, for people
//! without Rancher. For a local plan (`PLANFILE`) the commands only write control files beside it;
//! the agent (the only writer of `.pos`) acts on them. For a node's plan Secret
//! (`--secret NAMESPACE/NAME`) they write what Rancher would: the `plan` and `plan-state` keys and
//! the `plan.cattle.io/paused|canceled` annotations. Of the agent's keys, only `probe-statuses` is
//! touched: `push` of a new plan deletes it, as Rancher does. For a NodePlan
//! (`--nodeplan NAMESPACE/NAME`, and `status --node` for a node's list) they write its spec only,
//! see [`nodeplan`].
//!
//! Every request to the API server is bounded by `--request-timeout`: kube has no read timeout of
//! its own, and a command must not hang on a server that accepts and never answers.

pub(super) mod fleet;
pub(super) mod nodeplan;

use super::exit;
use super::format::Output;
use crate::local::pos::{self, PlanFiles};
use crate::plan::{self, Annotations, Checkpoint};
use clap::{Args, Subcommand};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(subcommand)]
    pub action: PlanAction,
}

/// Which plan: a local `.plan` file, a node's plan Secret or a NodePlan.
#[derive(Args, Debug)]
pub struct Target {
    /// A local plan file (omit with --secret or --nodeplan).
    pub file: Option<PathBuf>,
    #[command(flatten)]
    pub remote: RemoteTarget,
}

#[derive(Args, Debug)]
pub struct RemoteTarget {
    /// The node's plan Secret, as NAMESPACE/NAME.
    #[arg(long, value_name = "NAMESPACE/NAME", value_parser = parse_secret, conflicts_with = "nodeplan")]
    pub secret: Option<String>,
    /// A NodePlan (agent.cattle.io/v1alpha1), as NAMESPACE/NAME.
    #[arg(long, value_name = "NAMESPACE/NAME", value_parser = nodeplan::parse_ref)]
    pub nodeplan: Option<nodeplan::NodePlanRef>,
    /// Kubeconfig for --secret and --nodeplan [default: KUBECONFIG, else ~/.kube/config].
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The longest one request to the API server may take (`500ms`, `10s`, `1m`).
    #[arg(long, value_name = "DURATION", default_value = "15s", value_parser = parse_request_timeout)]
    pub request_timeout: Duration,
}

/// `plan status --node` (a node's NodePlans) or `--selector` (many nodes' plan Secrets or
/// NodePlans) instead of one plan.
#[derive(Args, Debug)]
pub struct NodeList {
    /// List this node's NodePlans, in the order its agent runs them (instead of one plan).
    #[arg(long, value_name = "NODE", value_parser = nodeplan::parse_node, conflicts_with_all = ["file", "secret", "nodeplan", "selector"])]
    pub node: Option<String>,
    /// Every node's plan Secret (NodePlan with --nodeplans) that this label selector picks
    /// (kubectl's syntax, e.g. `pool=workers,tier!=db`): one row per node, failures first.
    #[arg(long, short = 'l', value_name = "SELECTOR", conflicts_with_all = ["file", "secret", "nodeplan"])]
    pub selector: Option<String>,
    /// With --node or --selector: the namespace [default: the kubeconfig context's namespace,
    /// else default].
    #[arg(long, short = 'n', value_name = "NAMESPACE", value_parser = nodeplan::parse_namespace)]
    pub namespace: Option<String>,
    /// With --selector: the selector picks NodePlans (one per node) instead of plan Secrets.
    #[arg(long, requires = "selector")]
    pub nodeplans: bool,
    /// With --node, or --selector --nodeplans: every namespace.
    #[arg(long, short = 'A', conflicts_with = "namespace")]
    pub all_namespaces: bool,
    /// With --selector: keep going, showing every change as the API server reports it (a watch,
    /// not polling) until Ctrl-C.
    #[arg(long, short = 'w', requires = "selector")]
    pub watch: bool,
    /// `table` (with --watch redrawn in a terminal), `wide` (more columns), `json` or `yaml` (one
    /// document: the plan's row, or a `List` of rows with --node or --selector; with --watch one
    /// per change), `name` (`secret/NAME`, `nodeplan.agent.cattle.io/NAME` or the plan file).
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// A command that acts on a plan: one (`PLANFILE`, `--secret`, `--nodeplan`) or, with
/// `--selector`, every node's plan Secret the selector picks.
#[derive(Args, Debug)]
pub struct Acting {
    #[command(flatten)]
    pub target: Target,
    /// Every node's plan Secret (NodePlan with --nodeplans) that this label selector picks
    /// (kubectl's syntax), written with bounded parallelism.
    #[arg(long, short = 'l', value_name = "SELECTOR", conflicts_with_all = ["file", "secret", "nodeplan"])]
    pub selector: Option<String>,
    /// With --selector: the namespace [default: the kubeconfig context's namespace, else default].
    #[arg(long, short = 'n', value_name = "NAMESPACE", requires = "selector", value_parser = nodeplan::parse_namespace)]
    pub namespace: Option<String>,
    /// With --selector: the selector picks NodePlans (one per node) instead of plan Secrets.
    #[arg(long, requires = "selector")]
    pub nodeplans: bool,
    /// With --selector --nodeplans: every namespace.
    #[arg(long, short = 'A', requires = "nodeplans", conflicts_with = "namespace")]
    pub all_namespaces: bool,
}

#[derive(Subcommand, Debug)]
pub enum PlanAction {
    /// Put a plan into a node's Secret (`--secret`) as `pending`, creating the Secret if needed,
    /// or into a NodePlan's spec.plan (`--nodeplan`), creating the NodePlan if needed.
    #[command(after_help = super::PLAN_EXIT_CODES)]
    Push {
        /// The plan file (validated before anything is written).
        file: PathBuf,
        #[command(flatten)]
        remote: RemoteTarget,
        /// With --nodeplan: the node a new NodePlan is for (required to create one; an existing
        /// one must be for this node).
        #[arg(long, value_name = "NODE", requires = "nodeplan", value_parser = nodeplan::parse_node)]
        node: Option<String>,
        /// With --nodeplan: spec.priority, higher runs first [default: 0 for a new NodePlan, kept
        /// for an existing one].
        #[arg(long, value_name = "N", requires = "nodeplan", allow_negative_numbers = true)]
        priority: Option<i32>,
        /// Show what the push would change (files by path with size and SHA-256, instructions
        /// and probes by name) against what the target holds now, and write nothing; exit 6 when
        /// something would change, 0 when it holds this plan already.
        #[arg(long)]
        dry_run: bool,
        /// With --dry-run: show env values (masked by default).
        #[arg(long, requires = "dry_run")]
        show_secrets: bool,
    },
    /// Pause at the next instruction boundary (NAME.paused, the paused annotation, spec.paused).
    #[command(after_help = super::PLAN_EXIT_CODES)]
    Pause(Acting),
    /// Resume a paused plan without re-running finished instructions.
    #[command(after_help = super::PLAN_EXIT_CODES)]
    Resume(Acting),
    /// Cancel: stop the running instruction's whole tree now; terminal until reset.
    #[command(after_help = super::PLAN_EXIT_CODES)]
    Cancel(Acting),
    /// Run the plan again from its first instruction (clears the cancel and the pause).
    #[command(after_help = super::PLAN_EXIT_CODES)]
    Reset(Acting),
    /// Show what each instruction of the current plan printed (its saved output) and how it
    /// ended, then the periodic instructions' last results; with --selector, every selected
    /// node's.
    #[command(after_help = super::PLAN_EXIT_CODES)]
    Logs(Acting),
    /// Show the plan's state, progress and probe health; with --node a node's NodePlans; with
    /// --selector many nodes' plan Secrets.
    #[command(after_help = super::PLAN_EXIT_CODES)]
    Status {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        list: NodeList,
    },
}

impl PlanAction {
    /// The plan a command other than `push` acts on.
    fn target(&self) -> Option<&Target> {
        match self {
            PlanAction::Push { .. } => None,
            PlanAction::Pause(a) | PlanAction::Resume(a) | PlanAction::Cancel(a) | PlanAction::Reset(a) => {
                Some(&a.target)
            }
            PlanAction::Status { target, .. } => Some(target),
            PlanAction::Logs(a) => Some(&a.target),
        }
    }
}

/// `--request-timeout`: a positive duration.
fn parse_request_timeout(s: &str) -> Result<Duration, String> {
    match crate::duration::parse(s)? {
        d if d.is_zero() => Err("must be longer than 0".into()),
        d => Ok(d),
    }
}

fn parse_secret(s: &str) -> Result<String, String> {
    match s.split_once('/') {
        Some((n, name)) if !n.is_empty() && !name.is_empty() && !name.contains('/') => Ok(s.to_string()),
        _ => Err(format!("{s:?}: expected NAMESPACE/NAME")),
    }
}

/// Bad arguments (exit 2), as opposed to a plan or Secret that could not be read or written (1).
enum Failure {
    Usage(String),
    Failed(String),
}

impl From<String> for Failure {
    fn from(s: String) -> Failure {
        Failure::Failed(s)
    }
}

fn bad_input(line: String) -> Failure {
    Failure::Usage(line)
}

/// The files of an existing local plan: `file` must end in `.plan` and be a regular file (a
/// typo must not leave control files beside a plan that does not exist).
fn files_of(file: &Path) -> Result<PlanFiles, Failure> {
    let f = PlanFiles::new(file).ok_or_else(|| bad_input(format!("{}: not a .plan file", file.display())))?;
    match rustix::fs::stat(file) {
        Ok(st) => match rustix::fs::FileType::from_raw_mode(st.st_mode) {
            rustix::fs::FileType::RegularFile => Ok(f),
            kind => Err(bad_input(format!(
                "{}: is not a regular file ({})",
                file.display(),
                crate::safefs::kind_name(kind)
            ))),
        },
        Err(e) => Err(bad_input(format!("{}: {}", file.display(), std::io::Error::from(e)))),
    }
}

/// A plan file's bytes, without ever blocking: a FIFO, a device or a directory is one error line.
fn read_plan(path: &Path) -> Result<Vec<u8>, String> {
    crate::safefs::read_named(path, crate::local::PLAN_CAP).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn write(path: &Path, content: &[u8]) -> Result<(), String> {
    crate::safefs::write_atomic(path, content, 0o600).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Remove `path`; whether it was there.
fn remove(path: &Path) -> Result<bool, String> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(format!("cannot remove {}: {e}", path.display())),
    }
}

fn local(action: &PlanAction, file: &Path) -> Result<(), Failure> {
    let f = files_of(file)?;
    let plan = f.plan.display();
    match action {
        PlanAction::Pause(_) => {
            write(&f.paused(), pos::CONTROL_TRUE)?;
            crate::cli::out!(
                "paused {plan}: wrote {} (the agent pauses it at the next instruction boundary)",
                f.paused().display()
            );
        }
        PlanAction::Resume(_) => {
            if remove(&f.paused())? {
                crate::cli::out!("resumed {plan}: removed {}", f.paused().display());
            } else {
                crate::cli::out!("{plan} was not paused (no {}); nothing to do", f.paused().display());
            }
        }
        PlanAction::Cancel(_) => {
            write(&f.canceled(), pos::CONTROL_TRUE)?;
            crate::cli::out!(
                "canceled {plan}: wrote {} (the running instruction is stopped; `nodeplan plan reset` runs it again)",
                f.canceled().display()
            );
        }
        PlanAction::Reset(_) => {
            remove(&f.canceled())?;
            let unpaused = remove(&f.paused())?;
            write(&f.reset(), pos::RESET_REQUEST)?;
            let also = if unpaused { format!(", removed {}", f.paused().display()) } else { String::new() };
            crate::cli::out!(
                "reset {plan}: wrote {}{also} (the agent runs it again from its first instruction)",
                f.reset().display()
            );
        }
        PlanAction::Status { list, .. } if !list.output.text() => {
            let raw = read_plan(&f.plan)?;
            let mut ignored = Vec::new();
            let p = pos::read_pos_trusted(&f.pos(), &mut ignored).map_err(|e| format!("{}: {e}", f.pos().display()))?;
            let name = f.plan.display().to_string();
            let row = crate::fleet::Row {
                kind: "PlanFile".into(),
                name: name.clone(),
                ..crate::fleet::row_of(&crate::fleet::local::standing(&name, &raw, &p))
            };
            super::format::print(&[row], true, list.output, crate::fleet::Row::kube_name);
        }
        PlanAction::Status { .. } => status(&f)?,
        PlanAction::Logs(_) => {
            let raw = read_plan(&f.plan)?;
            let plan = plan::parse(&raw).map_err(|e| format!("{plan}: {e}"))?;
            let mut ignored = Vec::new();
            let p = pos::read_pos_trusted(&f.pos(), &mut ignored).map_err(|e| format!("{}: {e}", f.pos().display()))?;
            for i in &ignored {
                crate::cli::say(&format!("nodeplan: ignored {i} (only root's files, not writable by others, count)"));
            }
            print_lines(crate::fleet::logs::lines(&plan, &crate::fleet::logs::of_pos(&p, &plan::checksum(&raw))));
        }
        PlanAction::Push { .. } => return Err(bad_input("plan push needs --secret NAMESPACE/NAME".into())),
    }
    Ok(())
}

/// `push --dry-run`: the plan file checked as a push checks it, compared with what the target
/// holds now; nothing is written.
async fn push_dry_run(file: &Path, t: &RemoteTarget, show_secrets: bool) -> Result<u8, Failure> {
    let raw = read_plan(file).map_err(bad_input)?;
    let new = plan::parse(&raw).map_err(|e| bad_input(format!("{}: {e}", file.display())))?;
    super::warn_unknown_keys(file, &raw);
    let (target, old) = match (&t.nodeplan, &t.secret) {
        (Some(r), _) => (format!("nodeplan {r}"), nodeplan::current_plan(file, t, r).await?),
        (None, Some(s)) => (format!("secret {s}"), remote::current_plan(t).await.map_err(Failure::Failed)?),
        (None, None) => {
            return Err(bad_input("plan push needs --secret NAMESPACE/NAME or --nodeplan NAMESPACE/NAME".into()));
        }
    };
    let old = old.and_then(|b| plan::parse(&b).ok());
    crate::cli::out!("dry run: push {} to {target}; nothing is written", file.display());
    let lines = super::dry_run::plan_changes(old.as_ref(), &new, show_secrets);
    if lines.is_empty() {
        // A Secret's agent compares the bytes (system-agent's checksum); a NodePlan's the value.
        if t.nodeplan.is_none() && old.is_some_and(|o| o.checksum != new.checksum) {
            crate::cli::out!(
                "plan {}: the same plan, written differently (spacing, key order): the agent runs it again",
                new.id()
            );
            return Ok(exit::CHANGES_PENDING);
        }
        crate::cli::out!("no change: {target} holds plan {} already", new.id());
        return Ok(exit::OK);
    }
    for l in lines {
        crate::cli::out!("{l}");
    }
    Ok(exit::CHANGES_PENDING)
}

pub async fn run(args: PlanArgs) -> u8 {
    if let PlanAction::Push { file, remote, dry_run: true, show_secrets, .. } = &args.action {
        return match push_dry_run(file, remote, *show_secrets).await {
            Ok(code) => code,
            Err(f) => report(f),
        };
    }
    let r = match &args.action {
        PlanAction::Push { remote, .. } if remote.nodeplan.is_some() => nodeplan::run(&args.action, remote).await,
        PlanAction::Push { remote, .. } if remote.secret.is_none() => Err(bad_input(
            "plan push needs --secret NAMESPACE/NAME (the node's plan Secret) or --nodeplan NAMESPACE/NAME; a local \
             plan is pushed by copying it into the agent's plan directory"
                .into(),
        )),
        PlanAction::Push { remote, .. } => remote::run(&args.action, remote).await.map_err(Failure::Failed),
        PlanAction::Status { list: NodeList { all_namespaces: true, node: None, nodeplans: false, .. }, .. } => {
            Err(Failure::Usage("--all-namespaces goes with --node or --selector --nodeplans".into()))
        }
        PlanAction::Status { target, list: list @ NodeList { node: Some(node), .. } } => {
            nodeplan::list(node, list, &target.remote).await
        }
        PlanAction::Status { target, list: list @ NodeList { selector: Some(selector), .. } } => {
            fleet::status(selector, list, &target.remote).await
        }
        PlanAction::Status { list: NodeList { namespace: Some(_), .. }, .. } => {
            Err(Failure::Usage("--namespace goes with --node or --selector".into()))
        }
        PlanAction::Logs(a) if a.selector.is_some() => fleet::logs(a).await,
        PlanAction::Pause(a) | PlanAction::Resume(a) | PlanAction::Cancel(a) | PlanAction::Reset(a)
            if a.selector.is_some() =>
        {
            fleet::fan_out(&args.action, a).await
        }
        action => match action.target() {
            Some(t) => match (&t.file, &t.remote.secret, &t.remote.nodeplan) {
                (Some(file), None, None) => local(action, file),
                (None, Some(_), None) => remote::run(action, &t.remote).await.map_err(Failure::Failed),
                (None, None, Some(_)) => nodeplan::run(action, &t.remote).await,
                _ => Err(Failure::Usage(
                    "give one of a PLANFILE, --secret NAMESPACE/NAME or --nodeplan NAMESPACE/NAME".into(),
                )),
            },
            None => Err(Failure::Usage("no plan given".into())),
        },
    };
    match r {
        Ok(()) => exit::OK,
        Err(f) => report(f),
    }
}

fn print_lines(lines: Vec<String>) {
    for l in lines {
        crate::cli::out!("{l}");
    }
}

/// One line for a failure; its exit code.
fn report(f: Failure) -> u8 {
    match f {
        Failure::Usage(e) => {
            super::say(&format!("nodeplan: {e}"));
            exit::BAD_INPUT
        }
        Failure::Failed(e) => {
            super::say(&format!("nodeplan: {e}"));
            exit::FAILED
        }
    }
}

/// The kubeconfig's text: `--kubeconfig`, else `KUBECONFIG`, else `~/.kube/config`. Read without
/// blocking (a FIFO or a device is one error line) and capped.
fn kubeconfig_yaml(t: &RemoteTarget) -> Result<String, String> {
    const CAP: u64 = 16 << 20;
    let path = t
        .kubeconfig
        .clone()
        .or_else(|| std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty()).map(Into::into))
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".kube/config")))
        .ok_or("no kubeconfig: give --kubeconfig")?;
    let bytes = crate::safefs::read_named(&path, CAP).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    String::from_utf8(bytes).map_err(|_| format!("{}: not UTF-8 text", path.display()))
}

/// A client for the kubeconfig's current context.
pub(super) async fn kube_client(t: &RemoteTarget) -> Result<kube::Client, String> {
    let yaml = kubeconfig_yaml(t)?;
    crate::k8s::bounded(
        t.request_timeout,
        "load the kubeconfig",
        crate::remote::client::SecretClient::client_from_kubeconfig_yaml(&yaml),
    )
    .await
}

/// What the agent of this node (the config found as `nodeplan agent` finds it) says of a local
/// plan file: why it does not watch it, or, from its live record, the instruction it runs now and
/// when it tries the plan again.
#[derive(Debug, Default)]
struct AgentView {
    /// Why no agent applies this file (`None`: the agent's config watches its directory).
    unwatched: Option<String>,
    running: Option<String>,
    retry: Option<String>,
}

fn agent_view(plan: &Path) -> AgentView {
    let path = crate::config::config_path(None);
    let cfg = match crate::config::load(&path) {
        Ok(c) => c,
        Err(_) => {
            let why = format!("no agent's config at {} watches it", path.display());
            return AgentView { unwatched: Some(why), ..AgentView::default() };
        }
    };
    let real = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let dir = plan.parent().map(real);
    if !cfg.local_enabled {
        let why = format!("local mode is off in {}", path.display());
        return AgentView { unwatched: Some(why), ..AgentView::default() };
    }
    if dir.as_deref() != Some(real(&cfg.local_plan_directory).as_path()) {
        let why = format!("the agent watches {} ({})", cfg.local_plan_directory.display(), path.display());
        return AgentView { unwatched: Some(why), ..AgentView::default() };
    }
    let mut view = AgentView::default();
    let record = crate::board::read(&cfg.pid_directory).ok().flatten().filter(super::status::alive);
    let Some(record) = record else { return view };
    let mine = |label: &str| real(Path::new(label)) == real(plan);
    let now = chrono::Utc::now();
    if let Some(c) = record.current.as_ref().filter(|c| mine(&c.plan) && !c.instruction.is_empty()) {
        view.running = Some(format!("{}, since {}", c.instruction, super::status::when(&c.instruction_since, now)));
    }
    if let Some(r) = record.retries.iter().find(|r| mine(&r.plan)) {
        view.retry = Some(super::status::when(&r.at, now));
    }
    view
}

fn status(f: &PlanFiles) -> Result<(), Failure> {
    let raw = read_plan(&f.plan)?;
    let checksum = plan::checksum(&raw);
    let parsed = plan::parse(&raw);
    // As the agent reads them: files beside the plan that fail its owner and mode rule are ignored.
    let mut ignored = Vec::new();
    let p = pos::read_pos_trusted(&f.pos(), &mut ignored).map_err(|e| format!("{}: {e}", f.pos().display()))?;
    let current = p.plan_checksum == checksum;
    let id = parsed.as_ref().map_or_else(|_| plan::short(&checksum).to_string(), plan::ValidPlan::id);
    crate::cli::out!("plan:       {} (id {id})", f.plan.display());
    if let Err(e) = &parsed {
        crate::cli::out!("            {e}");
    }
    if let Some(w) = crate::plan::fields::unknown_keys_warning(&raw) {
        crate::cli::out!("warning:    {}", crate::plan::failure::shown(&w, 300));
    }
    let total = parsed.as_ref().map(|v| v.plan.instructions.len()).unwrap_or(0);
    let agent = agent_view(&f.plan);
    let state = match (&p.plan_state, &agent.unwatched) {
        _ if parsed.is_err() => "invalid (the agent does not run it until it is fixed)".to_string(),
        (Some(s), _) if current => s.as_str().to_string(),
        (_, Some(why)) => format!("pending (not started: {why})"),
        _ => "pending (not started)".to_string(),
    };
    crate::cli::out!("state:      {}", crate::plan::failure::shown(&state, 300));
    if let Some(r) = &agent.running {
        crate::cli::out!("running:    {}", crate::plan::failure::shown(r, 300));
    }
    if let Some(Checkpoint {
        completed_instructions,
        total_instructions,
        resume_state,
        paused,
        termination_incomplete,
        ..
    }) = p.checkpoint.as_ref().filter(|c| current && c.checksum == checksum)
    {
        let resume = match resume_state.as_ref().filter(|_| *paused) {
            Some(s) => format!(", resumes into {s}"),
            None => String::new(),
        };
        crate::cli::out!("progress:   {completed_instructions}/{total_instructions} instructions done{resume}");
        if *termination_incomplete {
            crate::cli::out!("warning:    a stopped process may have survived (terminationIncomplete)");
        }
    } else if current && p.plan_state == Some(plan::PlanState::Succeeded) {
        crate::cli::out!("progress:   {total}/{total} instructions done");
    }
    let show = |v: Result<Option<String>, String>| match v {
        Ok(None) => "absent".to_string(),
        Ok(Some(s)) => plan::shown_value(&s),
        Err(e) => e,
    };
    let (pv, cv) =
        (pos::read_control_trusted(&f.paused(), &mut ignored), pos::read_control_trusted(&f.canceled(), &mut ignored));
    let (pv2, cv2) = (pv.clone().ok().flatten(), cv.clone().ok().flatten());
    crate::cli::out!("control:    paused={} canceled={}", show(pv), show(cv));
    if let Err(mut e) = plan::resolve_annotations(&Annotations { paused: pv2.as_deref(), canceled: cv2.as_deref() }) {
        // Local plans: name the control file, not the annotation it stands for.
        for (key, _) in &mut e.0 {
            let file = if key == plan::ANNOTATION_PAUSED { f.paused() } else { f.canceled() };
            *key = file.display().to_string();
        }
        crate::cli::out!("            invalid: {e} (the plan is held; nothing is written)");
    }
    if pos::marker_trusted(&f.reset(), &mut ignored) {
        crate::cli::out!("            reset requested (the agent has not picked it up yet)");
    }
    for i in &ignored {
        crate::cli::out!("ignored:    {i} (only root's files, not writable by others, count)");
    }
    if current {
        crate::cli::out!(
            "attempts:   {} failed in a row, {} succeeded; last {}",
            p.failure_count,
            p.success_count,
            if p.last_apply_time.is_empty() { "never".into() } else { crate::plan::shown_time(&p.last_apply_time) }
        );
    }
    if let Some(failure) = p.last_failure.clone().filter(|f| current && f.checksum == checksum) {
        for l in failure.bounded().status_lines() {
            crate::cli::out!("{l}");
        }
    }
    if let Some(r) = agent.retry.as_ref().filter(|_| current) {
        crate::cli::out!("retry:      {}", crate::plan::failure::shown(r, 80));
    }
    if !p.blocked.is_empty() {
        crate::cli::out!("blocked:    {}", p.blocked);
    }
    for (name, s) in &p.probe_status {
        let h = if s.healthy { "healthy" } else { "unhealthy" };
        crate::cli::out!("probe:      {name}: {h} (successes {}, failures {})", s.success_count, s.failure_count);
    }
    match parsed {
        Ok(_) => Ok(()),
        Err(e) => Err(bad_input(format!("{}: {e}", f.plan.display()))),
    }
}

mod remote {
    use super::{PlanAction, RemoteTarget};
    use crate::plan::{self, Checkpoint};
    use crate::remote::client::{SecretClient, SecretRef};
    use crate::remote::wire;

    async fn client(t: &RemoteTarget) -> Result<SecretClient, String> {
        let secret = t.secret.as_deref().unwrap_or_default();
        let Some((namespace, name)) = secret.split_once('/').filter(|(n, s)| !n.is_empty() && !s.is_empty()) else {
            return Err(format!("--secret {secret:?}: expected NAMESPACE/NAME"));
        };
        let kube = super::kube_client(t).await?;
        Ok(SecretClient::new(kube, SecretRef { namespace: namespace.into(), name: name.into() }))
    }

    /// The plan the Secret holds now (`None`: no Secret, or no plan in it).
    pub async fn current_plan(t: &RemoteTarget) -> Result<Option<Vec<u8>>, String> {
        let c = client(t).await?;
        let s = crate::k8s::bounded(t.request_timeout, "read the secret", c.get()).await?;
        Ok(s.and_then(|s| s.data.get(wire::PLAN).cloned()))
    }

    pub async fn run(action: &PlanAction, t: &RemoteTarget) -> Result<(), String> {
        let c = client(t).await?;
        let secret = t.secret.as_deref().unwrap_or_default();
        match action {
            PlanAction::Push { file, .. } => {
                let raw = super::read_plan(file)?;
                let id = plan::parse(&raw).map_err(|e| format!("{}: {e}", file.display()))?.id();
                crate::cli::warn_unknown_keys(file, &raw);
                if crate::k8s::bounded(t.request_timeout, "read the secret", c.get()).await?.is_none() {
                    crate::k8s::bounded(
                        t.request_timeout,
                        "create the secret",
                        c.create(wire::push_data(&raw), Default::default()),
                    )
                    .await?;
                } else {
                    crate::k8s::bounded(
                        t.request_timeout,
                        "patch the secret",
                        c.orchestrator_patch(wire::push_patch(&raw)),
                    )
                    .await?;
                }
                crate::cli::out!("pushed plan {id} to {secret}");
            }
            PlanAction::Pause(_) | PlanAction::Resume(_) | PlanAction::Cancel(_) | PlanAction::Reset(_) => {
                if let Some((patch, done)) = super::fleet::action_patch(action) {
                    crate::k8s::bounded(t.request_timeout, "patch the secret", c.orchestrator_patch(patch)).await?;
                    let what = match action {
                        PlanAction::Pause(_) => format!("set {}=true", plan::ANNOTATION_PAUSED),
                        PlanAction::Resume(_) => format!("removed {}", plan::ANNOTATION_PAUSED),
                        PlanAction::Cancel(_) => format!("set {}=true", plan::ANNOTATION_CANCELED),
                        _ => format!(
                            "plan-state=pending, {} and {} removed",
                            plan::ANNOTATION_CANCELED,
                            plan::ANNOTATION_PAUSED
                        ),
                    };
                    crate::cli::out!("{done} {secret}: {what}");
                }
            }
            PlanAction::Logs(_) => {
                let s = crate::k8s::bounded(t.request_timeout, "read the secret", c.get())
                    .await?
                    .ok_or("the secret does not exist")?;
                let lines = crate::fleet::logs::of_object(&crate::fleet::objects::Object::Secret(s))?;
                super::print_lines(lines);
            }
            PlanAction::Status { list, .. } if !list.output.text() => {
                let s = crate::k8s::bounded(t.request_timeout, "read the secret", c.get())
                    .await?
                    .ok_or("the secret does not exist")?;
                let r = c.secret_ref();
                let row =
                    crate::fleet::objects::Object::Secret(s).row_named(&r.name, r.namespace.clone(), r.name.clone());
                crate::cli::format::print(&[row], true, list.output, crate::fleet::Row::kube_name);
            }
            PlanAction::Status { .. } => {
                let s = crate::k8s::bounded(t.request_timeout, "read the secret", c.get())
                    .await?
                    .ok_or("the secret does not exist")?;
                let raw = s.data.get(wire::PLAN).ok_or("the secret has no plan")?;
                let checksum = plan::checksum(raw);
                let text = |k: &str| s.data.get(k).map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
                let parsed = plan::parse(raw);
                let total = parsed.as_ref().map(|p| p.plan.instructions.len()).unwrap_or(0);
                let id = parsed.as_ref().map_or_else(|_| plan::short(&checksum).to_string(), plan::ValidPlan::id);
                crate::cli::out!("plan:       {id} ({})", crate::count(total, "instruction"));
                if let Err(e) = &parsed {
                    crate::cli::out!("            {e}");
                }
                let state = text(wire::PLAN_STATE);
                crate::cli::out!(
                    "state:      {}",
                    if state.is_empty() { "(checksum flow)".into() } else { state.clone() }
                );
                crate::cli::out!("revision:   {}", text(wire::PLAN_REVISION));
                if let Some(cp) = Checkpoint::read(s.data.get(wire::PLAN_CHECKPOINT).map(Vec::as_slice), &checksum) {
                    let resume = if cp.paused {
                        format!(", resumes into {}", cp.resume_state.as_ref().map_or("", |s| s.as_str()))
                    } else {
                        String::new()
                    };
                    crate::cli::out!(
                        "progress:   {}/{} instructions done{resume}",
                        cp.completed_instructions,
                        cp.total_instructions
                    );
                } else if wire::plan_state(&s) == Some(plan::PlanState::Succeeded) {
                    crate::cli::out!("progress:   {total}/{total} instructions done");
                }
                let ann = |k: &str| s.annotations.get(k).map_or_else(|| "absent".into(), |v| plan::shown_value(v));
                crate::cli::out!(
                    "control:    paused={} canceled={}",
                    ann(plan::ANNOTATION_PAUSED),
                    ann(plan::ANNOTATION_CANCELED)
                );
                // As the agent reads them (R3): shown while a run goes on too, which it does not stop.
                if let Err(e) = plan::resolve_annotations(&wire::annotations(&s)) {
                    crate::cli::out!(
                        "            invalid: {} (neither pauses nor cancels a run; the plan is held, nothing written, until it is fixed)",
                        crate::plan::failure::shown(&e.to_string(), 300)
                    );
                }
                let last = text(wire::LAST_APPLY_TIME);
                // An agent that has not counted yet has written no count: none so far.
                let count = |k: &str| Some(text(k)).filter(|c| !c.is_empty()).unwrap_or_else(|| "0".into());
                crate::cli::out!(
                    "attempts:   {} failed, {} succeeded; applied {}; last {}",
                    count(wire::FAILURE_COUNT),
                    count(wire::SUCCESS_COUNT),
                    if text(wire::APPLIED_CHECKSUM) == checksum { "yes" } else { "no" },
                    if last.is_empty() {
                        "never".into()
                    } else {
                        crate::plan::failure::shown(&crate::plan::shown_time(&last), 40)
                    }
                );
                if let Some(failure) = wire::failure(&s, &checksum) {
                    for l in failure.status_lines() {
                        crate::cli::out!("{l}");
                    }
                }
                for (name, st) in wire::probe_statuses(&s) {
                    let h = if st.healthy { "healthy" } else { "unhealthy" };
                    crate::cli::out!(
                        "probe:      {name}: {h} (successes {}, failures {})",
                        st.success_count,
                        st.failure_count
                    );
                }
            }
        }
        Ok(())
    }
}
