//! `nodeplan apply FILE`: one plan in the foreground with live progress.

use super::{PROGRESS, exit};
use crate::apply::{
    ApplyConfig, ApplyInput, Applyinator, InstructionReport, Interrupt, Interruption, Observer, instruction_label,
    result_word,
};
use crate::process::{RecoveryResult, StopPolicy, Supervisor, SupervisorConfig};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

#[derive(Args, Debug)]
pub struct ApplyArgs {
    /// The plan file (system-agent plan JSON).
    pub file: PathBuf,
    /// Skip the first N one-time instructions (they finished in an earlier, paused run).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub resume_from: usize,
    /// Directory for execution directories; absolute. Before the instructions run, the execution
    /// directories of earlier applies (`YYYYMMDD-HHMMSS[-N]`) are removed and nothing else; a
    /// directory that holds anything else is refused (exit 2) and left untouched. One apply at a
    /// time per directory: by default the agent's, so a hand-run apply waits for the agent's plan
    /// [default: the agent's workDirectory (see --config), else /var/lib/rancher/agent/work].
    #[arg(long, value_name = "DIR", value_parser = super::absolute_path)]
    pub work_dir: Option<PathBuf>,
    /// Keep the execution directories of earlier applies [default: off].
    #[arg(long)]
    pub preserve_work_dir: bool,
    /// Where PID records of running instructions are kept; absolute [default: the agent's
    /// pidDirectory (see --config), else /run/nodeplan/pids].
    #[arg(long, value_name = "DIR", value_parser = super::absolute_path)]
    pub pid_dir: Option<PathBuf>,
    /// The agent's config, whose workDirectory and pidDirectory are the defaults of --work-dir
    /// and --pid-dir [default: NODEPLAN_CONFIG, else CATTLE_AGENT_CONFIG, else
    /// /etc/rancher/agent/config.yaml; when it cannot be read, the agent's own defaults].
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Grace period after SIGTERM when an instruction is stopped (500ms, 10s, 5m, 1h or seconds).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = crate::duration::parse_positive)]
    pub stop_timeout: Duration,
    /// How long to wait after SIGKILL for the tree to be gone (500ms, 10s, 5m, 1h or seconds).
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = crate::duration::parse_positive)]
    pub kill_timeout: Duration,
    /// Bytes of output kept per instruction (head and tail); at least 1024, as the config's outputCap.
    #[arg(long, value_name = "BYTES", default_value = "65536", value_parser = super::parse_output_cap)]
    pub output_cap: usize,
    /// Where instructions get their cgroups: `auto` (cgroup v2 discovered from /proc/self/mountinfo,
    /// else the cgroup v1 freezer hierarchy), `v1` (the v1 freezer hierarchy), `off` (process
    /// groups only), or an existing directory inside a cgroup2 mount or a v1 freezer hierarchy.
    #[arg(long, value_name = "MODE|DIR", default_value = "auto", value_parser = super::parse_cgroup_mode)]
    pub cgroup: crate::process::CgroupMode,
    /// Skip the periodic instructions [default: off].
    #[arg(long)]
    pub no_periodic: bool,
    /// Show what the plan would change (each file's diff, each instruction with its
    /// environment) and touch nothing; exit 6 when a file differs from the plan (drift), 0 when
    /// every file matches (instructions run at every apply: listed, not counted).
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run: show the content of files that are not world-readable and env values
    /// (masked by default: join tokens, keys).
    #[arg(long, requires = "dry_run")]
    pub show_secrets: bool,
    /// Image tarballs searched before pulling (for `image` instructions); absolute.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/rancher/agent/images", value_parser = super::absolute_path)]
    pub images_dir: PathBuf,
    /// Registries file (k3s/rke2 `registries.yaml` format: mirrors, credentials, TLS); absolute.
    #[arg(long, value_name = "FILE", default_value = "/etc/rancher/agent/registries.yaml", value_parser = super::absolute_path)]
    pub registries: PathBuf,
    /// Bytes one image's layers may decompress to, all together (the config's imageMaxBytes).
    #[arg(long, value_name = "BYTES", default_value_t = crate::image::DEFAULT_MAX_BYTES, value_parser = clap::value_parser!(u64).range(1..))]
    pub image_max_bytes: u64,
    /// Tar entries one image's layers may hold, all together (the config's imageMaxEntries).
    #[arg(long, value_name = "N", default_value_t = crate::image::DEFAULT_MAX_ENTRIES, value_parser = clap::value_parser!(u64).range(1..))]
    pub image_max_entries: u64,
}

/// How progress is shown: a live bar on a terminal, a line per start and end otherwise, JSON
/// events with `--log-format json` (nothing else is mixed into JSON output).
#[derive(Clone)]
enum Display {
    Bar(ProgressBar),
    Lines,
    Json,
}

/// Lines of a failed instruction's output shown under its result.
const TAIL_LINES: usize = 20;

struct Progress {
    display: Display,
}

impl Observer for Progress {
    fn instruction_started(&self, index: usize, total: usize, name: &str, periodic: bool) {
        let what = instruction_label(index, total, name, periodic);
        match &self.display {
            Display::Bar(bar) => {
                if !periodic {
                    bar.set_length(total as u64);
                    bar.set_position(index as u64);
                }
                bar.set_message(what);
                bar.reset_elapsed();
            }
            Display::Lines => super::tell(&format!("{what}: started")),
            Display::Json => {
                let (i, n) = (index + 1, total);
                tracing::info!(event = "instruction_started", i, n, name, periodic, "{what}: started");
            }
        }
    }

    fn instruction_finished(&self, r: &InstructionReport) {
        let what = instruction_label(r.index, r.total, &r.name, r.periodic);
        let ok = r.outcome.success();
        let word = result_word(&r.outcome);
        let line = format!("{what}: {word} ({}, {})", r.outcome, crate::duration::human(r.elapsed));
        // A failure is reported here, once, with its outcome and the end of its output.
        let tail = if word != "FAILED" || matches!(r.outcome, crate::process::Outcome::NotStarted(_)) {
            Vec::new()
        } else {
            let text = String::from_utf8_lossy(&r.output.combined);
            let lines: Vec<String> = text.lines().map(str::to_string).collect();
            lines[lines.len().saturating_sub(TAIL_LINES)..].to_vec()
        };
        match &self.display {
            Display::Bar(_) | Display::Lines => {
                let mut text = line;
                for l in &tail {
                    text.push_str("\n  | ");
                    text.push_str(l);
                }
                if word == "FAILED" { super::say(&text) } else { super::tell(&text) }
            }
            Display::Json => {
                let (i, n, name, periodic) = (r.index + 1, r.total, r.name.as_str(), r.periodic);
                let (outcome, elapsed_ms, output) =
                    (r.outcome.to_string(), r.elapsed.as_millis() as u64, tail.join("\n"));
                let result = word.to_ascii_lowercase();
                if word == "FAILED" {
                    tracing::error!(event = "instruction_finished", i, n, name, periodic, ok, %result, %outcome, elapsed_ms, %output, "{line}");
                } else {
                    tracing::info!(event = "instruction_finished", i, n, name, periodic, ok, %result, %outcome, elapsed_ms, "{line}");
                }
            }
        }
    }
}

/// The plan's result: one line (the command that resumes on a second line), or one JSON event.
fn finished(result: &str, completed: usize, total: usize, elapsed: Duration, text: &str, resume: Option<&str>) {
    if super::output::is_json() {
        let elapsed_ms = elapsed.as_millis() as u64;
        let resume = resume.unwrap_or_default();
        if result == "failed" {
            tracing::error!(event = "plan_finished", result, completed, total, elapsed_ms, resume, "{text}");
        } else {
            tracing::info!(event = "plan_finished", result, completed, total, elapsed_ms, resume, "{text}");
        }
    } else {
        let mut line = text.to_string();
        if let Some(cmd) = resume {
            line.push_str("; resume with:\n  ");
            line.push_str(cmd);
        }
        if result == "failed" { super::say(&line) } else { super::tell(&line) }
    }
}

/// The work and PID directories: those given, else the agent's (its config, else its defaults),
/// so that an apply by hand and the agent share the one-apply-at-a-time lock.
fn directories(args: &ApplyArgs) -> (PathBuf, PathBuf) {
    let needed = args.work_dir.is_none() || args.pid_dir.is_none();
    let path = crate::config::config_path(args.config.as_deref());
    let agent = match needed.then(|| crate::config::load(&path)) {
        Some(Ok(c)) => c,
        Some(Err(e)) => {
            if args.config.is_some() || path.exists() {
                super::say(&format!("nodeplan: warning: {e}; using the agent's default directories"));
            }
            crate::config::AgentConfig::default()
        }
        None => crate::config::AgentConfig::default(),
    };
    // A config that names no directory (or a relative one, which the agent refuses) leaves the
    // agent's default.
    let defaults = crate::config::AgentConfig::default();
    let usable = |p: PathBuf, d: PathBuf| if p.is_absolute() { p } else { d };
    (
        args.work_dir.clone().unwrap_or_else(|| usable(agent.work_directory, defaults.work_directory.clone())),
        args.pid_dir.clone().unwrap_or_else(|| usable(agent.pid_directory, defaults.pid_directory.clone())),
    )
}

pub async fn run(args: ApplyArgs) -> u8 {
    let (work_dir, pid_dir) = directories(&args);
    // Never blocks: a FIFO, a device or a directory is refused at once.
    let raw = match crate::safefs::read_named(&args.file, crate::local::PLAN_CAP) {
        Ok(r) => r,
        Err(e) => {
            super::say(&format!("nodeplan: cannot read {}: {e}", args.file.display()));
            return exit::BAD_INPUT;
        }
    };
    let plan = match crate::plan::parse(&raw) {
        Ok(p) => p,
        Err(e) => {
            super::say(&format!("nodeplan: {}: {e}", args.file.display()));
            return exit::BAD_INPUT;
        }
    };
    super::warn_unknown_keys(&args.file, &raw);
    let total = plan.plan.instructions.len();
    if args.resume_from > total {
        super::say(&format!("nodeplan: --resume-from {} is past the plan's {total} instructions", args.resume_from));
        return exit::BAD_INPUT;
    }
    if args.dry_run {
        return super::dry_run::show(&plan, args.resume_from, !args.no_periodic, args.show_secrets);
    }
    if let Err(e) = super::check_cgroup_dir(&args.cgroup) {
        super::say(&format!("nodeplan: --cgroup {e}"));
        return exit::BAD_INPUT;
    }
    let sup = Supervisor::new(SupervisorConfig {
        policy: StopPolicy { grace: args.stop_timeout, kill_timeout: args.kill_timeout, kill: true },
        capture_limit: args.output_cap,
        pid_dir: Some(pid_dir.clone()),
        cgroup: args.cgroup.clone(),
        ..Default::default()
    });
    let owner = crate::process::Owner::apply(&plan.checksum);
    // One run of a plan at a time: a live `nodeplan apply` of it holds this lock until it exits
    // (the kernel drops it if it dies), so whatever records the owner left are leftovers.
    let _lock = match sup.lock_owner(&owner) {
        Ok(l) => l,
        Err(crate::process::LockError::Held { pid, .. }) => {
            let pid = pid.map_or("(pid unknown)".to_string(), |p| format!("pid {p}"));
            super::say(&format!(
                "nodeplan: {}: this plan is already being applied by nodeplan {pid}; not starting a second run",
                args.file.display()
            ));
            return exit::ALREADY_RUNNING;
        }
        Err(e) => {
            super::say(&format!("nodeplan: {e}; not running the plan"));
            return exit::FAILED;
        }
    };
    // A previous `nodeplan apply` of this plan that was killed may have left instructions running.
    for r in sup.recover(|rec| rec.owner.belongs_to_plan(&owner)).await {
        match r.result {
            RecoveryResult::OwnerAlive(pid) => {
                super::say(&format!(
                    "nodeplan: {}: this plan is already being applied by nodeplan pid {pid}; not starting a second run",
                    args.file.display()
                ));
                return exit::ALREADY_RUNNING;
            }
            RecoveryResult::NotStopped(o) => {
                super::say(&format!(
                    "nodeplan: a leftover instruction of this plan could not be stopped ({o}); not running a second copy"
                ));
                return exit::FAILED;
            }
            RecoveryResult::Refused(why) => {
                super::say(&format!("nodeplan: {why}; not running the plan (a leftover of it may still run)"));
                return exit::FAILED;
            }
            _ => {}
        }
    }

    let display = if super::output::is_json() {
        Display::Json
    } else if super::output::stderr_is_terminal() {
        let target = ProgressDrawTarget::term_like(Box::new(super::output::QueuedTerm));
        let bar = ProgressBar::with_draw_target(Some(total as u64), target);
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.enable_steady_tick(Duration::from_millis(120));
        let _ = PROGRESS.set(bar.clone());
        Display::Bar(bar)
    } else {
        Display::Lines
    };
    let started = Instant::now();
    let observer = Arc::new(Progress { display: display.clone() });

    let (tx, rx) = watch::channel(Interrupt::default());
    let signals = tokio::spawn(interrupt_on_signals(tx, signal_streams()));

    let mut cfg = ApplyConfig::new(&work_dir);
    cfg.preserve_work_dir = args.preserve_work_dir;
    // The operator watches this run: its output is logged as it comes (the agent's, at debug).
    cfg.output_level = tracing::Level::INFO;
    cfg.images = crate::image::ImageConfig {
        images_dir: Some(args.images_dir.clone()),
        registries_file: Some(args.registries.clone()),
        limits: crate::image::Limits { max_bytes: args.image_max_bytes, max_entries: args.image_max_entries },
    };
    let applyinator = Applyinator::new(cfg, sup);
    let result = applyinator
        .apply(ApplyInput {
            plan: &plan,
            reconcile_files: true,
            run_one_time: true,
            attempt: 1,
            resume_from: args.resume_from,
            one_time_output: BTreeMap::new(),
            periodic_output: BTreeMap::new(),
            run_periodic: !args.no_periodic,
            interrupts: rx,
            owner,
            observer,
        })
        .await;
    signals.abort();
    if let Display::Bar(bar) = &display {
        bar.finish_and_clear();
    }
    let result = match result {
        Ok(r) => r,
        Err(e) => {
            super::say(&format!("nodeplan: {}: {e}", args.file.display()));
            // A work directory nodeplan does not own is bad input: nothing was touched.
            return if matches!(e, crate::apply::ApplyError::ForeignWorkDir(_)) {
                exit::BAD_INPUT
            } else {
                exit::FAILED
            };
        }
    };
    if result.termination_incomplete {
        super::say(&format!(
            "nodeplan: warning: some processes could not be stopped (their PID records are kept in {})",
            pid_dir.display()
        ));
    }
    let elapsed = started.elapsed();
    let took = crate::duration::human(elapsed);
    let short = plan.id();
    let done = result.completed;
    match result.interruption {
        Some(Interruption::Paused) => {
            let text = format!("plan {short} paused after {done}/{total} instructions ({took})");
            finished("paused", done, total, elapsed, &text, Some(&resume_command(&args, done)));
            exit::PAUSED
        }
        Some(Interruption::Canceled | Interruption::Shutdown | Interruption::Fenced) => {
            let text = format!("plan {short} canceled after {done}/{total} instructions ({took})");
            finished("canceled", done, total, elapsed, &text, None);
            exit::CANCELED
        }
        None if result.one_time_succeeded && result.failed_reports().next().is_none() => {
            let text = format!("plan {short} succeeded: {total}/{total} instructions ({took})");
            finished("succeeded", total, total, elapsed, &text, None);
            exit::OK
        }
        None => {
            let text = format!("plan {short} failed after {done}/{total} instructions ({took})");
            finished("failed", done, total, elapsed, &text, None);
            exit::FAILED
        }
    }
}

/// The command that resumes this run: the same command line, every option kept as given
/// (work and PID directories, timeouts, caps, images, registries, cgroup, log format…), with
/// `--resume-from` set to the first instruction not yet done.
fn resume_command(args: &ApplyArgs, completed: usize) -> String {
    let argv: Vec<String> = std::env::args_os().skip(1).map(|a| a.to_string_lossy().into_owned()).collect();
    resume_argv(&argv, &args.file.to_string_lossy(), completed)
        .iter()
        .map(|a| shell_quote(a))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `nodeplan` and `argv` (the arguments after the program) less any `--resume-from`, with
/// `--resume-from N` right after the plan file.
fn resume_argv(argv: &[String], file: &str, completed: usize) -> Vec<String> {
    let mut out = vec!["nodeplan".to_string()];
    let mut rest = argv.iter();
    let mut placed = false;
    while let Some(a) = rest.next() {
        if a == "--resume-from" {
            rest.next();
            continue;
        }
        if a.starts_with("--resume-from=") {
            continue;
        }
        out.push(a.clone());
        if !placed && a == file {
            out.extend(["--resume-from".to_string(), completed.to_string()]);
            placed = true;
        }
    }
    if !placed {
        out.extend(["--resume-from".to_string(), completed.to_string()]);
    }
    out
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "/._-+=:,".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// First SIGINT: pause at the next boundary. Second SIGINT (or SIGTERM): cancel. What it says
/// goes through the stderr queue, so a stderr nobody reads never holds a signal up.
/// SIGINT and SIGTERM as streams, registered now: before the plan's first instruction starts, so
/// a Ctrl-C that comes right after it is a pause, never the default death. `None`: they could not
/// be registered (Ctrl-C then kills nodeplan outright, as it says).
fn signal_streams() -> Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)> {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) {
        (Ok(int), Ok(term)) => Some((int, term)),
        _ => {
            tracing::warn!("cannot install signal handlers; Ctrl-C will kill nodeplan outright");
            None
        }
    }
}

async fn interrupt_on_signals(
    tx: watch::Sender<Interrupt>,
    signals: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
) {
    let Some((mut int, mut term)) = signals else { return };
    let mut seen_int = false;
    loop {
        tokio::select! {
            _ = int.recv() => {
                if seen_int {
                    tx.send_modify(|i| i.cancel = true);
                    super::tell("canceling: stopping the running instruction");
                } else {
                    seen_int = true;
                    tx.send_modify(|i| i.pause = true);
                    super::tell("pausing after the running instruction; press Ctrl-C again to cancel it");
                }
            }
            _ = term.recv() => {
                tx.send_modify(|i| i.cancel = true);
                super::tell("SIGTERM: canceling");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("/a/b.plan"), "/a/b.plan");
        assert_eq!(shell_quote("/a b/it's"), r"'/a b/it'\''s'");
    }
}

#[cfg(test)]
mod resume_tests {
    use super::resume_argv;

    #[test]
    fn the_resume_command_keeps_every_option_and_replaces_resume_from() {
        let argv = |s: &str| s.split(' ').map(str::to_string).collect::<Vec<_>>();
        let cases = [
            ("apply p.plan", "nodeplan apply p.plan --resume-from 3"),
            (
                "--log-format json apply p.plan --resume-from 1 --registries /r.yaml --images-dir /i --cgroup off",
                "nodeplan --log-format json apply p.plan --resume-from 3 --registries /r.yaml --images-dir /i --cgroup off",
            ),
            (
                "apply --resume-from=2 --preserve-work-dir --stop-timeout 1s p.plan --output-cap 2048",
                "nodeplan apply --preserve-work-dir --stop-timeout 1s p.plan --resume-from 3 --output-cap 2048",
            ),
        ];
        for (given, want) in cases {
            assert_eq!(resume_argv(&argv(given), "p.plan", 3).join(" "), want, "{given}");
        }
    }
}
