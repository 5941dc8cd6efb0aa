//! `nodeplan agent` (alias `sentinel`), `validate-config`, `validate-connection`.

use super::exit;
use crate::apply::AgentExit;
use crate::apply::{ApplyConfig, Applyinator};
use crate::config::{self, AgentConfig, CgroupRoot};
#[cfg(unix)]
use crate::local::{DirSource, LocalConfig};
use crate::probe::Prober;
use crate::process::{CgroupMode, StopPolicy, Supervisor, SupervisorConfig};
use crate::reconcile::Reconciler;
use crate::reconcile::both::Both;
use crate::reconcile::gate::Gated;
use clap::Args;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

#[derive(Args, Debug)]
pub struct AgentArgs {
    /// Config file [default: NODEPLAN_CONFIG, else CATTLE_AGENT_CONFIG, else
    /// /etc/rancher/agent/config.yaml].
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Serve Prometheus metrics (GET /metrics) on this IP:PORT (or :PORT for every interface);
    /// overrides the config's metricsAddress, an empty value turns them off [default: the
    /// config's metricsAddress, empty = off].
    #[arg(long, value_name = "ADDR")]
    pub metrics_address: Option<String>,
}

#[derive(Args, Debug)]
pub struct ValidateArgs {
    /// The file to check.
    pub file: PathBuf,
}

fn non_empty(p: &Path) -> Option<PathBuf> {
    (!p.as_os_str().is_empty()).then(|| p.to_path_buf())
}

/// The pieces every mode shares, built from the config: one supervisor, one applyinator (its lock
/// serialises applies across modes), one prober.
pub struct Parts {
    pub app: Arc<Applyinator>,
    pub prober: Arc<Prober>,
}

pub fn build(cfg: &AgentConfig) -> Result<Parts, String> {
    let cgroup = match cfg.cgroup_root().map_err(|e| e.to_string())? {
        CgroupRoot::Auto => CgroupMode::Auto,
        CgroupRoot::V1 => CgroupMode::V1,
        CgroupRoot::Off => CgroupMode::Off,
        CgroupRoot::Dir(d) => CgroupMode::Root(d),
    };
    super::check_cgroup_dir(&cgroup).map_err(|e| format!("cgroupRoot {e}"))?;
    let sup = Supervisor::new(SupervisorConfig {
        policy: StopPolicy { grace: cfg.stop_timeout, kill_timeout: cfg.kill_timeout, kill: !cfg.no_kill },
        capture_limit: cfg.output_cap,
        cgroup,
        pid_dir: non_empty(&cfg.pid_directory),
        drain_timeout: Duration::from_secs(1),
    });
    let mut ac = ApplyConfig::new(&cfg.work_directory);
    ac.preserve_work_dir = cfg.preserve_work_directory;
    ac.applied_plan_dir = non_empty(&cfg.applied_plan_directory);
    ac.interlock_dir = non_empty(&cfg.interlock_directory);
    ac.restart_requests = true;
    ac.images = crate::image::ImageConfig {
        images_dir: non_empty(&cfg.images_directory),
        registries_file: non_empty(&cfg.agent_registries_file),
        limits: crate::image::Limits { max_bytes: cfg.image_max_bytes, max_entries: cfg.image_max_entries },
    };
    Ok(Parts { app: Arc::new(Applyinator::new(ac, sup)), prober: Arc::new(Prober::new()) })
}

pub async fn run(args: AgentArgs) -> u8 {
    let path = config::config_path(args.config.as_deref());
    let mut cfg = match config::load(&path) {
        Ok(c) => c,
        Err(e) => {
            super::say(&format!("nodeplan: {e}"));
            return exit::BAD_INPUT;
        }
    };
    if let Some(a) = args.metrics_address {
        cfg.metrics_address = a;
    }
    match config::validate(&cfg) {
        Ok(warnings) => warnings.iter().for_each(|w| tracing::warn!("{w}")),
        Err(e) => {
            super::say(&format!("nodeplan: {e}"));
            return exit::BAD_INPUT;
        }
    }
    let parts = match build(&cfg) {
        Ok(p) => p,
        Err(e) => {
            super::say(&format!("nodeplan: {e}"));
            return exit::BAD_INPUT;
        }
    };
    let (sd_tx, sd_rx) = watch::channel(false);
    let sd_tx = Arc::new(sd_tx);
    let signals = sd_tx.clone();
    if let Err(e) = start_metrics(&cfg, sd_rx.clone()).await {
        super::say(&format!("nodeplan: {e}"));
        return exit::BAD_INPUT;
    }
    tokio::spawn(async move {
        let sd_tx = signals;
        #[cfg(unix)]
        let (Ok(mut int), Ok(mut term)) = (
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()),
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()),
        ) else {
            tracing::warn!("cannot install signal handlers");
            return;
        };
        // Ctrl-C, Ctrl-Break, the console closed.
        #[cfg(windows)]
        let (Ok(mut int), Ok(mut term)) = (tokio::signal::windows::ctrl_c(), tokio::signal::windows::ctrl_break())
        else {
            tracing::warn!("cannot install console control handlers");
            return;
        };
        loop {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
            if *sd_tx.borrow() {
                tracing::warn!("already stopping: the running instruction is being stopped through the stop ladder");
            } else {
                tracing::info!("stopping: the running instruction (if any) gets the stop ladder");
                let _ = sd_tx.send(true);
            }
        }
    });
    tracing::info!("nodeplan agent starting (config {})", path.display());
    if let Some(dir) = non_empty(&cfg.pid_directory) {
        let pid = std::process::id();
        let status = crate::board::AgentStatus {
            pid,
            pid_start: crate::process::start_time_of(pid as i32).unwrap_or_default(),
            version: super::VERSION.to_string(),
            config: path.display().to_string(),
            node: node_name(&cfg),
            ..Default::default()
        };
        crate::board::install(&dir, status, sd_rx.clone());
    }
    // One loop for the node over every enabled source (one plan at a time by construction). A
    // new source is one more `Both` here.
    #[cfg(windows)]
    if cfg.local_enabled {
        return refuse("localEnabled: local mode does not run on Windows yet (docs/windows.md); set it to false");
    }
    #[cfg(unix)]
    let local = cfg.local_enabled.then(|| {
        let mut lc = LocalConfig::new(&cfg.local_plan_directory);
        lc.rescan = cfg.rescan_period();
        lc.probe_period = cfg.probe_period();
        lc.set_retry_base(Duration::from_secs(cfg.local_retry_seconds));
        lc.inotify = std::env::var_os("NODEPLAN_NO_INOTIFY").is_none_or(|v| v != "1");
        crate::board::source("local", &format!("directory {}", cfg.local_plan_directory.display()), "");
        DirSource::new(lc)
    });
    let secret = match cfg.remote_enabled {
        true => match secret_source(&cfg, &sd_rx).await {
            Ok(s) => Some(s),
            Err(e) => return refuse(&e),
        },
        false => None,
    };
    let node_plans = match cfg.node_plan_enabled {
        true => match node_plan_source(&cfg, &sd_rx).await {
            Ok(s) => Some(s),
            Err(e) => return refuse(&e),
        },
        false => None,
    };
    #[cfg(unix)]
    let source = Both::new(local, Both::new(secret, node_plans));
    #[cfg(windows)]
    let source = Both::new(secret, node_plans);
    let (exit, _) = Reconciler::new(source, parts.app.clone(), parts.prober.clone(), sd_rx).run().await;
    let mut code = exit::OK;
    let mut restart = false;
    match exit {
        AgentExit::Clean => {}
        AgentExit::Restart => restart = true,
        AgentExit::Displaced(why) => {
            super::say(&format!("nodeplan: {why}; stopped (a restart waits until it may act again)"));
            code = exit::FAILED;
        }
        AgentExit::Incomplete(e) => {
            super::say(&format!("nodeplan: a process could not be stopped: {e}"));
            code = exit::FAILED;
        }
    }
    if restart && code == exit::OK {
        tracing::info!("nodeplan agent stopped; starting again as an instruction asked");
        RESTART.store(true, std::sync::atomic::Ordering::SeqCst);
    } else {
        tracing::info!("nodeplan agent stopped");
    }
    code
}

/// Set when the agent stopped because an instruction asked for a restart (R23): the binary's
/// `main` then executes the agent's program again, with the same arguments, in the same process
/// (the pid, and with it the systemd unit's main process, stays).
pub(crate) static RESTART: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The program the agent was started as, noted at start-up (before a plan can replace it): the
/// path it was invoked by when that names a file (so a symlink that an upgrade points elsewhere is
/// followed again), else `/proc/self/exe` as it was then.
static PROGRAM: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

pub(crate) fn note_program() {
    let invoked =
        std::env::args_os().next().map(PathBuf::from).filter(|p| p.as_os_str().as_encoded_bytes().contains(&b'/'));
    if let Some(p) = invoked.or_else(|| std::env::current_exe().ok()) {
        let _ = PROGRAM.set(p);
    }
}

/// Execute the agent's program again with the same arguments and environment; returns only on
/// failure (the error line, for the exit).
#[cfg(unix)]
pub(crate) fn exec_again() -> String {
    use std::os::unix::process::CommandExt as _;
    let Some(program) = PROGRAM.get() else { return "the agent's program is not known".into() };
    let e = std::process::Command::new(program).args(std::env::args_os().skip(1)).exec();
    format!("cannot start {} again: {e}", program.display())
}

/// On Windows a process cannot be replaced in place: the agent stops instead (its service manager
/// starts it again).
#[cfg(windows)]
pub(crate) fn exec_again() -> String {
    "an instruction asked for a restart, and the agent cannot start itself again in place on Windows; stopped".into()
}

/// The Lease of a remote or NodePlan source: where, and the client to take it with (`None`: no
/// Lease, `leaseDuration: 0`).
type SourceLease = Option<(kube::Client, crate::lease::LeaseRef)>;

fn source_lease(cfg: &AgentConfig, client: &kube::Client, namespace: &str, source: &str, what: String) -> SourceLease {
    use crate::lease::{LeaseRef, identity, lease_name};
    (!cfg.lease_duration.is_zero()).then(|| {
        let stop_budget = cfg.stop_timeout + cfg.kill_timeout;
        let safe = crate::lease::shortest_safe_duration(stop_budget);
        if cfg.lease_duration < safe {
            tracing::warn!(
                "leaseDuration {} is too short for stopTimeout + killTimeout ({}): the holder must be able to stop its running instruction before the Lease can be taken over; using {}",
                crate::duration::show(cfg.lease_duration),
                crate::duration::show(stop_budget),
                crate::duration::show(safe)
            );
        }
        let r = LeaseRef {
            namespace: namespace.to_string(),
            name: lease_name(source),
            identity: identity(&node_name(cfg)),
            duration: cfg.lease_duration.max(safe),
            stop_budget,
            what,
        };
        (client.clone(), r)
    })
}

/// Rancher's own agent, which acts on the plan Secret when it runs on the node: looked for among
/// every process before acting, and in its systemd unit's cgroup while acting. (Linux: on Windows
/// rancher-wins runs it inside its own service, and nodeplan does not look for it yet.)
#[cfg(unix)]
fn rancher_agent(ours: &crate::remote::client::SecretRef) -> crate::lease::Rival {
    use crate::remote::rival::{self, Serves};
    let program = rival::program();
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let unit = Arc::new(rival::unit_cgroups(&mountinfo, &program));
    // Whether the one of `pid` may act on this Secret: judged (and said) once per process, by its
    // pid and start time, so a poll of its unit reads no file again.
    let judged = Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    let (ns, name, p) = (ours.namespace.clone(), ours.name.clone(), program.clone());
    let acts = Arc::new(move |pid: i32| {
        let id = (pid, crate::process::start_time_of(pid));
        if let Some(acts) = judged.lock().ok().and_then(|j| j.get(&id).copied()) {
            return acts;
        }
        let serves = rival::serves(Path::new("/proc"), pid);
        let acts = match &serves {
            Serves::Secret(n, s) => (n, s) == (&ns, &name),
            Serves::NoSecret => false,
            Serves::Unknown(_) => true,
        };
        match serves {
            Serves::Secret(n, s) if !acts => {
                tracing::info!(
                    "{p} (pid {pid}) runs on this node for the plan Secret {n}/{s}, not this one: acting beside it"
                )
            }
            Serves::NoSecret => {
                tracing::info!("{p} (pid {pid}) runs on this node with remote mode off: acting beside it")
            }
            Serves::Unknown(why) => {
                tracing::info!("{p} (pid {pid}): which plan Secret it serves cannot be told ({why})")
            }
            Serves::Secret(..) => {}
        }
        if let Ok(mut j) = judged.lock() {
            j.insert(id, acts);
        }
        acts
    });
    let (p, a) = (program.clone(), acts.clone());
    let running: crate::lease::RivalCheck = Arc::new(move || {
        let (p, a) = (p.clone(), a.clone());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || rival::running(Path::new("/proc"), &p, |pid| a(pid)))
                .await
                .ok()
                .flatten()
        })
    });
    let started: crate::lease::RivalStarted = Arc::new(move || {
        // A few reads of in-memory files (cgroupfs, procfs), when inotify says the unit's cgroup may
        // have changed, and two small files once per process found: on the loop's thread, not the
        // blocking pool.
        let a = acts.clone();
        Box::pin(rival::started(std::path::PathBuf::from("/proc"), unit.to_vec(), move |pid| a(pid)))
    });
    crate::lease::Rival { program, running, started }
}

/// Bind the metrics endpoint when `metricsAddress` is set, and serve it until shutdown. Nothing
/// at all (no registry, no socket) when it is empty.
async fn start_metrics(cfg: &AgentConfig, shutdown: watch::Receiver<bool>) -> Result<(), String> {
    let Some(addr) = cfg.metrics_address().map_err(|e| e.to_string())? else { return Ok(()) };
    let listener = crate::metrics::server::bind(addr).await?;
    let shown = listener.local_addr().map_or_else(|_| addr.to_string(), |a| a.to_string());
    let metrics = crate::metrics::install(crate::metrics::Metrics::new(crate::metrics::Directories {
        applied: non_empty(&cfg.applied_plan_directory),
        images: non_empty(&cfg.images_directory),
        work: non_empty(&cfg.work_directory),
    }));
    tokio::spawn(crate::metrics::server::serve(listener, metrics, shutdown));
    tracing::info!("metrics: serving GET /metrics on http://{shown}/metrics");
    Ok(())
}

/// A mode that cannot start: say why (nothing ran yet at this point).
fn refuse(why: &str) -> u8 {
    super::say(&format!("nodeplan: {why}"));
    exit::BAD_INPUT
}

/// The plan Secret as a source, behind its gate: not while Rancher's agent runs, and only
/// holding the Secret's Lease.
async fn secret_source(
    cfg: &AgentConfig,
    shutdown: &watch::Receiver<bool>,
) -> Result<Gated<crate::remote::agent::SecretSource>, String> {
    use crate::remote::client::{SecretClient, SecretRef};
    let conn = config::load_connection(&cfg.connection_info_file)
        .map_err(|e| format!("{e} (the installer should have created it)"))?;
    let client = SecretClient::client_from_kubeconfig_yaml(&conn.kube_config)
        .await
        .map_err(|e| format!("connection info {}: {e}", cfg.connection_info_file.display()))?;
    let secret = SecretRef { namespace: conn.namespace.clone(), name: conn.secret_name.clone() };
    let secret_ref = secret.clone();
    let what = format!("secret {}/{}", secret.namespace, secret.name);
    crate::board::source("secret", &what, if cfg.lease_duration.is_zero() { "" } else { "waiting" });
    tracing::info!("remote mode: watching secret {}/{}", secret.namespace, secret.name);
    let lease = source_lease(cfg, &client, &secret.namespace, &secret.name, what);
    let source = crate::remote::agent::SecretSource::new(SecretClient::new(client, secret), Duration::from_secs(5))
        .with_kept_outcomes(non_empty(&cfg.applied_plan_directory).as_deref())
        .with_events(&node_name(cfg));
    if !cfg.rival_check {
        tracing::info!("not looking for rancher-system-agent on this node (rivalCheck: false)");
    }
    #[cfg(unix)]
    let rival = cfg.rival_check.then(|| rancher_agent(&secret_ref));
    #[cfg(windows)]
    let rival = {
        let _ = secret_ref;
        None
    };
    Ok(Gated::new(source, crate::lease::guard(lease, rival, shutdown.clone())))
}

/// The node NodePlans are selected for: `nodeName`, else `CATTLE_NODE_NAME`, else the hostname.
fn node_name(cfg: &AgentConfig) -> String {
    if !cfg.node_name.is_empty() {
        return cfg.node_name.clone();
    }
    match std::env::var("CATTLE_NODE_NAME") {
        Ok(n) if !n.is_empty() => n,
        _ => std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default(),
    }
}

/// The node's NodePlans as a source, behind the Lease of the node's NodePlans.
async fn node_plan_source(
    cfg: &AgentConfig,
    shutdown: &watch::Receiver<bool>,
) -> Result<Gated<crate::nodeplan::source::NodePlanSource>, String> {
    let conn = config::load_connection(&cfg.connection_info_file)
        .map_err(|e| format!("{e} (the installer should have created it)"))?;
    let client = crate::remote::client::SecretClient::client_from_kubeconfig_yaml(&conn.kube_config)
        .await
        .map_err(|e| format!("connection info {}: {e}", cfg.connection_info_file.display()))?;
    let node = node_name(cfg);
    let what = format!("the NodePlans of node {node}");
    crate::board::source("nodeplans", &what, if cfg.lease_duration.is_zero() { "" } else { "waiting" });
    let lease = source_lease(cfg, &client, &conn.namespace, &format!("node-{node}"), what);
    let source = crate::nodeplan::source::NodePlanSource::new(
        client,
        &conn.namespace,
        &node,
        Duration::from_secs(5),
        crate::nodeplan::runs::dir_of(&cfg.node_plan_state_directory),
    );
    Ok(Gated::new(source, crate::lease::guard(lease, None, shutdown.clone())))
}

pub fn validate_config(args: ValidateArgs) -> u8 {
    // What the agent's start reads too: a remote or NodePlan mode needs its connection info
    // (without it the agent exits 2, so a config that lacks it is not valid).
    let r = config::load(&args.file).and_then(|c| {
        let warnings = config::validate(&c)?;
        if c.remote_enabled || c.node_plan_enabled {
            config::load_connection(&c.connection_info_file)?;
        }
        Ok(warnings.into_iter().filter(|w| !w.starts_with("connectionInfoFile ")).collect::<Vec<_>>())
    });
    match r {
        Ok(warnings) => {
            for w in warnings {
                super::output::line(tracing::Level::WARN, &format!("warning: {w}"));
            }
            crate::cli::out!("{}: valid", args.file.display());
            exit::OK
        }
        Err(e) => {
            super::say(&format!("Validation failed: {e}"));
            exit::FAILED
        }
    }
}

/// Check a connection-info file as the agent's start does: the file, then its kubeconfig turned
/// into a client (contexts, credentials, TLS settings), without connecting and without running
/// anything: a user's `exec` or `auth-provider` plugin is named, never run (see SECURITY.md,
/// "Install and uninstall").
pub async fn validate_connection(args: ValidateArgs) -> u8 {
    use crate::remote::client::{Plugins, check_kubeconfig_yaml};
    let checked = match config::load_connection(&args.file) {
        Ok(c) => match check_kubeconfig_yaml(&c.kube_config, Plugins::NotRun).await {
            Ok(note) => Ok((c, note)),
            Err(e) => Err(format!("{}: kubeConfig: {e}", args.file.display())),
        },
        Err(e) => Err(e.to_string()),
    };
    match checked {
        Ok((c, note)) => {
            let note = note.map(|n| format!("; {n}")).unwrap_or_default();
            crate::cli::out!(
                "{}: valid (namespace {}, secret {}{note})",
                args.file.display(),
                c.namespace,
                c.secret_name
            );
            exit::OK
        }
        Err(e) => {
            super::say(&format!("Validation failed: {e}"));
            exit::FAILED
        }
    }
}
