//! Commands, progress display, logging set-up and exit codes. Business rules live in the library
//! modules; this module only parses arguments, wires the pieces together and reports.

mod agent;
mod apply;
mod plan_cmd;
mod supervise;

use clap::{Parser, Subcommand, ValueEnum};
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Duration;

/// Exit codes shared by the commands.
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
}

/// `nodeplan apply --help`'s list of exit codes (the README lists the same).
const APPLY_EXIT_CODES: &str = "Exit codes:
  0  succeeded
  1  failed (or a process could not be stopped)
  2  bad input: unreadable or invalid plan, bad arguments (nothing on the node was touched)
  3  paused
  4  canceled
  5  already running: another live `nodeplan apply` of this plan with the same --pid-dir
     (nothing was started or stopped)";

/// `nodeplan supervise --help`'s list of exit codes (the README lists the same).
const SUPERVISE_EXIT_CODES: &str = "Exit codes:
  0  stopped on request
  1  could not be stopped, or a previous instance's leftover could not be stopped or its
     record was refused
  2  bad arguments
  5  already running: another live `nodeplan supervise` with this --name and the same
     --pid-dir (nothing was started or stopped)";

#[derive(Parser, Debug)]
#[command(
    name = "nodeplan",
    version,
    about = "Apply plans to this node; supervise processes that never hang",
    propagate_version = true
)]
struct Cli {
    /// Log level (trace, debug, info, warn, error); also NODEPLAN_LOG or CATTLE_LOGLEVEL.
    #[arg(long, global = true)]
    log_level: Option<String>,
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
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
    /// The daemon: local and/or remote mode from the config file.
    #[command(alias = "sentinel")]
    Agent(agent::AgentArgs),
    /// Check a config file (format, mode 0600, owner, keys, values).
    ValidateConfig(agent::ValidateArgs),
    /// Check a connection-info file (kubeConfig, namespace, secretName).
    ValidateConnection(agent::ValidateArgs),
    /// Apply one plan file in the foreground with live progress; exit 0 only if it succeeded.
    /// The first Ctrl-C pauses at the next instruction boundary, a second one cancels.
    #[command(after_help = APPLY_EXIT_CODES)]
    Apply(apply::ApplyArgs),
    /// Run one long-lived command under the supervisor: respawn with backoff, the stop ladder on
    /// SIGTERM/SIGINT, a PID record with identity.
    #[command(after_help = SUPERVISE_EXIT_CODES)]
    Supervise(supervise::SuperviseArgs),
    /// The orchestrator's side: push, pause, resume, cancel, reset or show a plan (local or in a Secret).
    Plan(plan_cmd::PlanArgs),
}

/// Open /dev/null on any of fds 0, 1 and 2 that the agent was started without (a daemon started by
/// a careless parent), so that no file the agent opens later lands there: a pipe end on fd 1
/// would be mistaken for stdout by children and by logging.
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
    ensure_std_fds();
    cloexec_inherited_fds();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { exit::BAD_INPUT } else { exit::OK };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    if let Err(e) = init_logging(cli.log_level.as_deref(), cli.log_format) {
        eprintln!("nodeplan: {e}");
        return ExitCode::from(exit::BAD_INPUT);
    }
    // One thread runs every task: the agent's work is waiting (on the watch, pidfds, pipes,
    // timers), and a single thread spares the cross-thread wake-ups that dominate both the cost
    // of a short instruction and the idle agent's wake-ups. Work that can stall (/proc, file
    // trees) goes to the blocking pool.
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nodeplan: cannot start the runtime: {e}");
            return ExitCode::from(exit::FAILED);
        }
    };
    let code = rt.block_on(async move {
        match cli.command {
            Command::Agent(a) => agent::run(a).await,
            Command::ValidateConfig(a) => agent::validate_config(a),
            Command::ValidateConnection(a) => agent::validate_connection(a).await,
            Command::Apply(a) => apply::run(a).await,
            Command::Supervise(s) => supervise::run(s).await,
            Command::Plan(p) => plan_cmd::run(p).await,
        }
    });
    // Do not wait for blocking tasks (a stuck /proc read) on the way out.
    rt.shutdown_timeout(Duration::from_millis(100));
    ExitCode::from(code)
}

/// The progress bar that log lines must not tear; set by `apply`.
pub(crate) static PROGRESS: OnceLock<indicatif::ProgressBar> = OnceLock::new();

/// Writes log lines to stderr, suspending the progress bar around each one.
struct StderrAroundProgress;

impl std::io::Write for StderrAroundProgress {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match PROGRESS.get() {
            Some(pb) => pb.suspend(|| std::io::stderr().write_all(buf))?,
            None => std::io::stderr().write_all(buf)?,
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

fn init_logging(level: Option<&str>, format: LogFormat) -> Result<(), String> {
    let level = level
        .map(str::to_string)
        .or_else(|| std::env::var("NODEPLAN_LOG").ok())
        .or_else(|| std::env::var("CATTLE_LOGLEVEL").ok())
        .unwrap_or_else(|| "info".into());
    let filter =
        tracing_subscriber::EnvFilter::try_new(&level).map_err(|e| format!("invalid log level {level:?}: {e}"))?;
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(|| StderrAroundProgress).with_target(false);
    let r = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    r.map_err(|e| format!("cannot set up logging: {e}"))
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

/// `10s`, `500ms`, `5m`, `1h`, or a bare number of seconds.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a duration such as 10s, 500ms or 5m"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s, m or h)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5m"), Ok(Duration::from_secs(90)));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("").is_err());
    }
}
