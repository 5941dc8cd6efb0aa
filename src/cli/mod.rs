//! Commands, progress display, logging set-up and exit codes. Business rules live in the library
//! modules; this module only parses arguments, wires the pieces together and reports.
//!
//! Bad arguments are one line and exit 2 (clap's errors are folded to one line). Everything
//! written to stderr after start-up goes through [`output`], which never blocks the runtime
//! thread and never panics, whatever stderr is.
//!
//! On Windows the agent's commands are built (`agent`, `validate-*`, `crd`, completions, man);
//! the others are Unix-only so far (docs/windows.md), which leaves some helpers unused there.
#![cfg_attr(windows, allow(dead_code, unused_imports, unused_macros))]

mod agent;
#[cfg(unix)]
mod apply;
#[cfg(unix)]
mod dry_run;
mod format;
#[cfg(unix)]
mod install;
mod output;
#[cfg(unix)]
mod plan_cmd;
#[cfg(unix)]
mod rollout;
#[cfg(unix)]
mod status;
#[cfg(unix)]
mod supervise;

use crate::logging::parse_log_level;
use clap::{CommandFactory as _, Parser, Subcommand, ValueEnum};
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Duration;

/// Exit codes shared by the commands (`apply --help` lists them; keep [`APPLY_EXIT_CODES`] in step).
pub mod exit {
    pub const OK: u8 = 0;
    /// The plan failed, or the supervised process could not be stopped.
    pub const FAILED: u8 = 1;
    /// Bad input: unreadable or invalid plan, bad arguments.
    pub const BAD_INPUT: u8 = 2;
    /// The plan was paused at an instruction boundary.
    pub const PAUSED: u8 = 3;
    /// The plan was canceled.
    pub const CANCELED: u8 = 4;
    /// Another live `nodeplan apply` of the same plan, or `supervise` of the same name, is running
    /// (with the same PID directory); nothing was started or stopped.
    pub const ALREADY_RUNNING: u8 = 5;
    /// `apply --dry-run`: a file differs from the plan (drift); `plan push --dry-run`: the push
    /// would change what the target holds.
    pub const CHANGES_PENDING: u8 = 6;
    /// `install`: a file nodeplan install did not write is in the way (nothing was written).
    pub const REFUSED: u8 = 3;
    /// `rollout`: more nodes failed than `--max-errors`; no new node was started.
    pub const ERROR_BUDGET: u8 = 7;
    /// `rollout`: interrupted (Ctrl-C, SIGTERM); the same command continues it.
    pub const INTERRUPTED: u8 = 8;
}

/// The first SIGINT or SIGTERM (never, if the handlers cannot be installed).
#[cfg(unix)]
pub(crate) async fn interrupted() {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) {
        (Ok(mut i), Ok(mut t)) => {
            tokio::select! {
                _ = i.recv() => {}
                _ = t.recv() => {}
            }
        }
        _ => std::future::pending().await,
    }
}

/// The first Ctrl-C or Ctrl-Break, or the console being closed (never, if the handlers cannot be
/// installed).
#[cfg(windows)]
pub(crate) async fn interrupted() {
    use tokio::signal::windows::{ctrl_break, ctrl_c, ctrl_close};
    match (ctrl_c(), ctrl_break(), ctrl_close()) {
        (Ok(mut c), Ok(mut b), Ok(mut x)) => {
            tokio::select! {
                _ = c.recv() => {}
                _ = b.recv() => {}
                _ = x.recv() => {}
            }
        }
        _ => std::future::pending().await,
    }
}

/// `nodeplan --version`: the release, the commit it was built from and that commit's date.
pub const VERSION: &str =
    concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("NODEPLAN_COMMIT"), ", ", env!("NODEPLAN_COMMIT_DATE"), ")");

#[derive(Parser, Debug)]
#[command(
    name = "nodeplan",
    version = VERSION,
    about = "Apply plans to this node; supervise processes that never hang",
    propagate_version = true
)]
struct Cli {
    /// Log level: trace, debug, info, warn or error (or TARGET=LEVEL directives, comma-separated)
    /// [default: NODEPLAN_LOG, else CATTLE_LOGLEVEL, else info]
    #[arg(long, global = true, value_name = "LEVEL", value_parser = parse_log_level)]
    log_level: Option<String>,
    /// Log format: `text` for people, `json` for log shippers (one JSON object per line).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Colour in log lines: `auto` (when stderr is a terminal and NO_COLOR is unset or empty),
    /// `always` or `never`.
    #[arg(long, global = true, value_name = "WHEN", value_enum, hide_possible_values = true, default_value_t = output::ColorChoice::Auto)]
    color: output::ColorChoice,
    #[command(subcommand)]
    command: Command,
}

#[derive(Copy, Clone, Debug, ValueEnum, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The daemon: applies this node's plans from the config file's sources: local plan files, the
    /// node's plan Secret (remote mode) and its NodePlans (nodePlanEnabled), one plan at a time.
    #[command(alias = "sentinel", after_help = AGENT_EXIT_CODES)]
    Agent(agent::AgentArgs),
    #[cfg(unix)]
    /// This node's agent at a glance: its sources and their Leases, the plan and instruction it
    /// runs, the last result and the next retry (from the running agent's record).
    #[command(after_help = status::EXIT_CODES)]
    Status(status::StatusArgs),
    /// Check a config file (format, mode 0600, owner, keys, values).
    #[command(after_help = VALIDATE_EXIT_CODES)]
    ValidateConfig(agent::ValidateArgs),
    /// Check a connection-info file (kubeConfig, namespace, secretName).
    #[command(after_help = VALIDATE_EXIT_CODES)]
    ValidateConnection(agent::ValidateArgs),
    #[cfg(unix)]
    /// Apply one plan file in the foreground with live progress; exit 0 only if it succeeded.
    /// The first Ctrl-C pauses at the next instruction boundary, a second one cancels.
    #[command(after_help = APPLY_EXIT_CODES)]
    Apply(apply::ApplyArgs),
    #[cfg(unix)]
    /// Run one long-lived command under the supervisor: respawn with backoff, the stop ladder on
    /// SIGTERM/SIGINT, a PID record with identity.
    #[command(after_help = SUPERVISE_EXIT_CODES)]
    Supervise(supervise::SuperviseArgs),
    #[cfg(unix)]
    /// The orchestrator's side: push, pause, resume, cancel or reset a plan, show its status or
    /// what its instructions printed (local, in a Secret or a NodePlan), or list a node's NodePlans.
    #[command(after_help = PLAN_EXIT_CODES)]
    Plan(plan_cmd::PlanArgs),
    #[cfg(unix)]
    /// Push one plan to many nodes' plan Secrets or NodePlans (a label selector), a few at a
    /// time, stopping by itself when too many fail; a rerun continues where it stopped.
    #[command(after_help = rollout::EXIT_CODES)]
    Rollout(rollout::RolloutArgs),
    #[cfg(unix)]
    /// Install the agent on this machine (or into --root DIR) as system-agent's installer does:
    /// connection info from Rancher (or a kubeconfig given), config, binary, systemd unit, enabled.
    #[command(after_help = install::INSTALL_EXIT_CODES)]
    Install(install::InstallArgs),
    #[cfg(unix)]
    /// Remove what `nodeplan install` wrote (files changed since are kept and named).
    #[command(after_help = install::UNINSTALL_EXIT_CODES)]
    Uninstall(install::UninstallArgs),
    /// Print the NodePlan CustomResourceDefinition (`kubectl apply -f -` installs it), or with
    /// --admission-policy the policy that lets only a node's own agent write its NodePlans' status.
    #[command(after_help = CRD_HELP)]
    Crd(CrdArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish or powershell).
    #[command(after_help = PRINTED_EXIT_CODES)]
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff; `nodeplan man | man -l -`).
    #[command(after_help = PRINTED_EXIT_CODES)]
    Man,
}

/// `nodeplan crd`'s options.
#[derive(clap::Args, Debug)]
pub struct CrdArgs {
    /// The API server's release (`1.20`, `v1.37.2`): leave out what it does not know (CEL rules
    /// before 1.25, the selectable field before 1.30). Default: a current release.
    #[arg(long, value_name = "VERSION", value_parser = crate::nodeplan::resource::parse_kube_version)]
    kube_version: Option<(u32, u32)>,
    /// Print the ValidatingAdmissionPolicy and its binding instead (Kubernetes 1.30 and later).
    #[arg(long)]
    admission_policy: bool,
}

const CRD_HELP: &str = "Exit codes:
  0  printed
  2  bad arguments, or --admission-policy for a release without ValidatingAdmissionPolicies

Install both on a current API server:
  nodeplan crd | kubectl apply -f -
  nodeplan crd --admission-policy | kubectl apply -f -
On Kubernetes 1.20: nodeplan crd --kube-version 1.20 | kubectl apply -f -";

/// `nodeplan crd`: the definition or the policy on stdout.
fn crd(args: &CrdArgs) -> u8 {
    use crate::nodeplan::resource;
    let text = if args.admission_policy {
        resource::status_policy_yaml(args.kube_version).map(str::to_string)
    } else {
        resource::crd_yaml(args.kube_version)
    };
    match text {
        Ok(t) => {
            out!("{}", t.trim_end());
            exit::OK
        }
        Err(e) => {
            say(&format!("nodeplan: {e}"));
            exit::BAD_INPUT
        }
    }
}

/// `apply --help`'s list of [`exit`] codes (docs/commands.md's list says the same).
const APPLY_EXIT_CODES: &str = "Exit codes:
  0  the plan succeeded
  1  the plan failed, or a process could not be stopped
  2  bad input: unreadable or invalid plan, bad arguments (nothing on the node was touched)
  3  paused at an instruction boundary (the command that resumes is printed)
  4  canceled (second Ctrl-C or SIGTERM)
  5  already running: another live `nodeplan apply` of this plan with the same --pid-dir
     (nothing was started or stopped)
  6  --dry-run: a file differs from the plan (drift; 0: every file matches)";

const SUPERVISE_EXIT_CODES: &str = "Exit codes:
  0  stopped by SIGTERM/SIGINT through the stop ladder
  1  the command could not be supervised (a first start that fails), or could not be stopped,
     or a previous instance's leftover could not be stopped or its record was refused
  2  bad arguments
  5  already running: another live `nodeplan supervise` with this --name and the same
     --pid-dir (nothing was started or stopped)";

const AGENT_EXIT_CODES: &str = "Exit codes:
  0  stopped by SIGTERM/SIGINT
  1  a process could not be stopped on the way out, or another agent took a plan source's Lease,
     or rancher-system-agent started on this node
  2  bad arguments, an invalid config or connection-info file";

const PRINTED_EXIT_CODES: &str = "Exit codes:
  0  printed
  1  stdout could not be written
  2  bad arguments";

const VALIDATE_EXIT_CODES: &str = "Exit codes:
  0  valid
  1  invalid (one line says why)
  2  bad arguments";

const PLAN_EXIT_CODES: &str = "Exit codes:
  0  done
  1  the plan, its control files, the Secret or the NodePlan could not be read or written (or the
     API server gave no answer within --request-timeout)
  2  bad arguments or plan file, no such plan, or a push to a NodePlan of another node
  6  push --dry-run: the push would change something";

/// Open /dev/null on any of fds 0, 1 and 2 that the agent was started without (a daemon started by
/// a careless parent), so that no file the agent opens later lands there: a pipe end on fd 1
/// would be mistaken for stdout by children and by logging.
#[cfg(unix)]
fn ensure_std_fds() {
    for fd in 0..3 {
        // SAFETY: F_GETFD only queries the descriptor.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1 {
            // Opens the lowest free descriptor, which is `fd` (the lower ones are open by now).
            if let Ok(f) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null") {
                let _ = std::os::fd::IntoRawFd::into_raw_fd(f);
            }
        }
    }
}

/// Every descriptor above 2 that whoever started the agent left open becomes close-on-exec, so
/// no instruction inherits it (a leaked fd to a root-only file or socket would be readable by
/// whatever the plan runs, and by anyone who can attach to those processes).
#[cfg(unix)]
fn cloexec_inherited_fds() {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range with the CLOEXEC flag only sets a flag on descriptors.
    let r = unsafe { libc::syscall(libc::SYS_close_range, 3 as libc::c_uint, libc::c_uint::MAX, CLOSE_RANGE_CLOEXEC) };
    if r != 0 {
        // Kernels before 5.11: one by one.
        if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
            let fds: Vec<i32> = dir.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect();
            for fd in fds.into_iter().filter(|fd| *fd > 2) {
                // SAFETY: F_SETFD on a descriptor number; a closed one just fails.
                unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
            }
        }
    }
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    #[cfg(unix)]
    ensure_std_fds();
    #[cfg(unix)]
    cloexec_inherited_fds();
    agent::note_program();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if e.use_stderr() => {
            say(&clap_error_line(&e));
            output::flush(STDERR_DRAIN);
            return ExitCode::from(exit::BAD_INPUT);
        }
        Err(e) => {
            // --help and --version, on stdout; a closed stdout is not worth a panic.
            let _ = e.print();
            return ExitCode::from(exit::OK);
        }
    };
    let color = output::use_color(cli.color, output::stderr_is_terminal(), std::env::var_os("NO_COLOR").as_deref());
    if let Err(e) = init_logging(cli.log_level.as_deref(), cli.log_format, color) {
        say(&format!("nodeplan: {e}"));
        output::flush(STDERR_DRAIN);
        return ExitCode::from(exit::BAD_INPUT);
    }
    // One thread runs every task: the agent's work is waiting (on the watch, pidfds, pipes,
    // timers), and a single thread spares the cross-thread wake-ups that dominate both the cost
    // of a short instruction and the idle agent's wake-ups. Work that can stall (/proc, file
    // trees) goes to the blocking pool.
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            say(&format!("nodeplan: cannot start the runtime: {e}"));
            output::flush(STDERR_DRAIN);
            return ExitCode::from(exit::FAILED);
        }
    };
    let code = rt.block_on(async move {
        let code = match cli.command {
            Command::Agent(a) => agent::run(a).await,
            #[cfg(unix)]
            Command::Status(a) => status::run(a),
            Command::ValidateConfig(a) => agent::validate_config(a),
            Command::ValidateConnection(a) => agent::validate_connection(a).await,
            #[cfg(unix)]
            Command::Apply(a) => apply::run(a).await,
            #[cfg(unix)]
            Command::Supervise(s) => supervise::run(s).await,
            #[cfg(unix)]
            Command::Plan(p) => plan_cmd::run(p).await,
            #[cfg(unix)]
            Command::Rollout(r) => rollout::run(r).await,
            #[cfg(unix)]
            Command::Install(a) => install::install(a).await,
            #[cfg(unix)]
            Command::Uninstall(a) => install::uninstall(a),
            Command::Crd(a) => crd(&a),
            Command::Completions { shell } => generated(|w| {
                clap_complete::generate(shell, &mut Cli::command(), "nodeplan", w);
                Ok(())
            }),
            Command::Man => generated(|w| clap_mangen::Man::new(Cli::command()).render(w)),
        };
        // What the command handed to the state disk and did not wait for (a successful apply's
        // execution directory, a lock's release, a kept outcome's clear) runs before the runtime
        // goes, which would drop it unrun; a disk that does not answer holds the exit 5 s (R31).
        if !crate::disk::settle(crate::disk::PATIENCE).await {
            tracing::warn!(
                "the state disk did not answer in {}: what was left to do there (a clean-up, a record) is not done",
                crate::duration::human(crate::disk::PATIENCE)
            );
        }
        code
    });
    // Do not wait for blocking tasks (a stuck /proc read) on the way out.
    rt.shutdown_timeout(Duration::from_millis(100));
    // The last lines (the plan's result) get a bounded time to reach stderr; a stderr nobody
    // reads does not hold the exit code back for longer.
    output::flush(STDERR_DRAIN);
    if agent::RESTART.load(std::sync::atomic::Ordering::SeqCst) {
        say(&format!("nodeplan: {}", agent::exec_again()));
        output::flush(STDERR_DRAIN);
        return ExitCode::from(exit::FAILED);
    }
    ExitCode::from(code)
}

/// How long the exit waits for queued stderr lines to be written.
const STDERR_DRAIN: Duration = Duration::from_secs(2);

/// The progress bar that log lines must not tear; set by `apply`.
pub(crate) static PROGRESS: OnceLock<indicatif::ProgressBar> = OnceLock::new();

/// Write generated text (completions, the man page) to stdout; a closed stdout is no error.
fn generated(write: impl FnOnce(&mut Vec<u8>) -> std::io::Result<()>) -> u8 {
    let mut buf = Vec::new();
    if let Err(e) = write(&mut buf) {
        say(&format!("nodeplan: {e}"));
        return exit::FAILED;
    }
    out!("{}", String::from_utf8_lossy(&buf).trim_end());
    exit::OK
}

/// A clap error (bad arguments) as one line: `nodeplan: <what>; see '<command> --help'`.
fn clap_error_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut parts = Vec::new();
    for l in text.lines().map(str::trim) {
        if l.starts_with("Usage:") || l.starts_with("For more information") {
            break;
        }
        if !l.is_empty() {
            parts.push(l.strip_prefix("error: ").unwrap_or(l));
        }
    }
    format!("nodeplan: {} (see --help)", parts.join(" ").trim_end_matches('.'))
}

/// The filter to use and, when an environment variable had a value that is not a level, the
/// warning to log. The flag was checked by clap already. A bad `NODEPLAN_LOG`/`CATTLE_LOGLEVEL`
/// is a warning, not an error: system-agent ignores a `CATTLE_LOGLEVEL` it cannot parse, and a
/// node that ran it must not stop starting because of it.
fn log_filter(flag: Option<&str>, env: impl Fn(&str) -> Option<String>) -> (String, Option<String>) {
    if let Some(f) = flag {
        return (f.to_string(), None);
    }
    for var in ["NODEPLAN_LOG", "CATTLE_LOGLEVEL"] {
        let Some(v) = env(var).filter(|v| !v.trim().is_empty()) else { continue };
        return match parse_log_level(&v) {
            Ok(f) => (f, None),
            Err(e) => ("info".into(), Some(format!("{var}: {e}; logging at info"))),
        };
    }
    ("info".into(), None)
}

fn init_logging(level: Option<&str>, format: LogFormat, color: bool) -> Result<(), String> {
    let (mut level, warning) = log_filter(level, |k| std::env::var(k).ok());
    // The Kubernetes client's own lines ("failed with error client error (Connect)") say less
    // than nodeplan's one line for the same failure, which names the server: off unless asked for.
    if !level.contains("kube") {
        level.push_str(",kube_client=off");
    }
    let filter =
        tracing_subscriber::EnvFilter::try_new(&level).map_err(|e| format!("invalid log level {level:?}: {e}"))?;
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(|| output::LogWriter).with_target(false);
    let r = match format {
        LogFormat::Text => builder.with_ansi(color).event_format(output::TextLines).try_init(),
        LogFormat::Json => builder
            .with_ansi(false)
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .event_format(output::JsonLines)
            .try_init(),
    };
    r.map_err(|e| format!("cannot set up logging: {e}"))?;
    output::set_json(format == LogFormat::Json);
    if let Some(w) = warning {
        tracing::warn!("{w}");
    }
    Ok(())
}

/// An absolute path (for directories and files the commands use): a relative one would depend on
/// the directory nodeplan happens to be started in.
pub(crate) fn absolute_path(s: &str) -> Result<std::path::PathBuf, String> {
    if s.is_empty() {
        return Err("must not be empty".into());
    }
    if !s.starts_with('/') {
        return Err(format!("{s:?} is relative: give an absolute path"));
    }
    Ok(s.into())
}

/// `--output-cap`: at least [`crate::config::MIN_OUTPUT_CAP`] bytes, as the config's `outputCap`.
pub(crate) fn parse_output_cap(s: &str) -> Result<usize, String> {
    let min = crate::config::MIN_OUTPUT_CAP;
    let n: usize = s.trim().parse().map_err(|_| format!("{s:?} is not a number of bytes"))?;
    if n < min {
        return Err(format!("must be at least {min} bytes (as the config's outputCap), found {n}"));
    }
    Ok(n)
}

/// `auto`, `v1`, `off` or a directory.
pub(crate) fn parse_cgroup_mode(s: &str) -> Result<crate::process::CgroupMode, String> {
    use crate::process::CgroupMode;
    Ok(match s {
        "auto" => CgroupMode::Auto,
        "v1" => CgroupMode::V1,
        "off" => CgroupMode::Off,
        p if p.starts_with('/') => CgroupMode::Root(p.into()),
        other => return Err(format!("{other:?}: expected auto, v1, off or an absolute directory")),
    })
}

/// A cgroup directory asked for by name must exist and be usable (in a cgroup2 mount or a v1
/// freezer hierarchy): otherwise the supervisor would fall back to process groups with only a
/// warning, and create the directory wherever it was. `auto`, `v1` and `off` pass.
pub(crate) fn check_cgroup_dir(mode: &crate::process::CgroupMode) -> Result<(), String> {
    let crate::process::CgroupMode::Root(dir) = mode else { return Ok(()) };
    if !dir.is_dir() {
        return Err(format!("{}: no such directory", dir.display()));
    }
    #[cfg(unix)]
    return crate::process::cgroup::CgroupRoot::discover(mode).map(|_| ());
    #[cfg(windows)]
    Err(format!(
        "{}: there are no cgroups on Windows (a run's tree is its Job Object); leave cgroupRoot unset",
        dir.display()
    ))
}

/// A line of a command's result on stdout, made safe for a terminal ([`terminal_safe`]): what it
/// shows of objects others write (a Secret's keys, a NodePlan's status, a file) can carry no
/// escape sequence. A closed or broken stdout (`nodeplan plan status … | head -1`) is the reader's
/// choice, not an error worth a panic: the line is dropped.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let line = $crate::cli::terminal_safe(&format!($($t)*)).into_owned();
        let _ = writeln!(std::io::stdout().lock(), "{line}");
    }};
}
pub(crate) use out;

/// [`out!`] for the command's own control sequences (a redrawn view's clear): what it formats from
/// others' values must be passed through [`terminal_safe`] first.
macro_rules! out_raw {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}
pub(crate) use out_raw;

/// `text` with every control character but line breaks and tabs escaped (`\u{1b}`): nothing in
/// it can move the cursor, clear the screen or set the clipboard (OSC 52). JSON and YAML carry no
/// such character raw, so they pass unchanged.
pub fn terminal_safe(text: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !text.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// One error or result line for a person on stderr (an error event with `--log-format json`).
/// Never blocks or panics, whatever stderr is (see [`output`]).
pub(crate) fn say(line: &str) {
    output::line(tracing::Level::ERROR, line);
}

/// A warning line naming a plan file's keys that no agent reads (a misspelt `instrutions` makes an
/// empty plan; system-agent ignores unknown keys, so the plan is still taken).
pub(crate) fn warn_unknown_keys(file: &std::path::Path, raw: &[u8]) {
    if let Some(w) = crate::plan::fields::unknown_keys_warning(raw) {
        output::line(tracing::Level::WARN, &format!("warning: {}: {w}", file.display()));
    }
}

/// One progress or result line for a person on stderr (an info event with `--log-format json`).
pub(crate) fn tell(line: &str) {
    output::line(tracing::Level::INFO, line);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_levels() {
        let env = |k: &str| (k == "CATTLE_LOGLEVEL").then(|| "verbose".to_string());
        let (f, w) = log_filter(None, env);
        assert_eq!(f, "info");
        assert!(w.is_some_and(|w| w.starts_with("CATTLE_LOGLEVEL: \"verbose\" is not a log level")));
        let env = |k: &str| Some(if k == "NODEPLAN_LOG" { "debug" } else { "junk" }.to_string());
        assert_eq!(log_filter(None, env), ("debug".into(), None), "NODEPLAN_LOG wins");
        assert_eq!(log_filter(Some("error"), env), ("error".into(), None), "the flag wins");
    }

    #[test]
    fn output_caps_and_paths() {
        assert_eq!(parse_output_cap("1024"), Ok(1024));
        assert!(parse_output_cap("1023").unwrap_err().contains("at least 1024"));
        assert!(parse_output_cap("-1").is_err());
        assert!(absolute_path("work").unwrap_err().contains("relative"));
        assert!(absolute_path("").is_err());
        assert_eq!(absolute_path("/w"), Ok("/w".into()));
    }
}

#[cfg(test)]
mod help_tests {
    use super::*;

    /// Every command's `--help` ends with its exit codes (docs/commands.md promises them).
    #[test]
    fn every_command_says_its_exit_codes() {
        fn walk(cmd: &mut clap::Command, path: String, missing: &mut Vec<String>) {
            let help = cmd.render_long_help().to_string();
            if !help.contains("Exit codes:") {
                missing.push(path.clone());
            }
            for sub in cmd.get_subcommands_mut().filter(|s| s.get_name() != "help") {
                let name = format!("{path} {}", sub.get_name());
                walk(sub, name, missing);
            }
        }
        let mut root = Cli::command();
        root.build();
        let mut missing = Vec::new();
        for sub in root.get_subcommands_mut().filter(|s| s.get_name() != "help") {
            let name = format!("nodeplan {}", sub.get_name());
            walk(sub, name, &mut missing);
        }
        assert!(missing.is_empty(), "no exit codes in --help of: {missing:?}");
    }
}
