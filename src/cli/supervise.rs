//! `nodeplan supervise -- CMD ARGS…`.

use super::exit;
use crate::process::supervise::{Backoff, supervise};
use crate::process::{LogSink, Owner, SpawnSpec, StopPolicy, StopReason, StopSignal, Supervisor, SupervisorConfig};
use clap::Args;
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct SuperviseArgs {
    /// Name of the service (PID record owner, log prefix) [default: the command's file name].
    #[arg(long)]
    pub name: Option<String>,
    /// Where the PID record is kept; absolute.
    #[arg(long, value_name = "DIR", default_value = "/run/nodeplan/supervise", value_parser = super::absolute_path)]
    pub pid_dir: PathBuf,
    /// Grace period after SIGTERM (500ms, 10s, 5m, 1h or seconds).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = crate::duration::parse_positive)]
    pub stop_timeout: Duration,
    /// How long to wait after SIGKILL (500ms, 10s, 5m, 1h or seconds).
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = crate::duration::parse_positive)]
    pub kill_timeout: Duration,
    /// Never SIGKILL: give up after the stop timeout, leave the process and its PID record, exit 1
    /// [default: off].
    #[arg(long)]
    pub no_kill: bool,
    /// The command and its arguments.
    #[arg(required = true, last = true)]
    pub command: Vec<OsString>,
}

pub async fn run(args: SuperviseArgs) -> u8 {
    let Some((program, rest)) = args.command.split_first() else {
        super::say("nodeplan: supervise needs a command after --");
        return exit::BAD_INPUT;
    };
    let name = args.name.clone().unwrap_or_else(|| {
        PathBuf::from(program).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "service".into())
    });
    let sup = Supervisor::new(SupervisorConfig {
        policy: StopPolicy { grace: args.stop_timeout, kill_timeout: args.kill_timeout, kill: !args.no_kill },
        pid_dir: Some(args.pid_dir.clone()),
        ..Default::default()
    });
    let mut spec = SpawnSpec::new(program.clone(), rest.iter().cloned());
    spec.owner = Owner::supervise(&name);
    spec.sink = Arc::new(LogSink { prefix: name.clone(), level: tracing::Level::INFO, mask: Default::default() });
    let (tx, stop) = StopSignal::channel();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut int), Ok(mut term)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
            return;
        };
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        let _ = tx.send(Some(StopReason::Shutdown));
        // Keep the sender alive so the stop stays requested.
        std::future::pending::<()>().await;
    });
    match supervise(&sup, spec, stop, Backoff::default(), &mut ()).await {
        Ok(outcome) => {
            tracing::info!("{name} stopped: {outcome}");
            exit::OK
        }
        Err(e @ crate::process::supervise::SuperviseError::AlreadyRunning { .. }) => {
            super::say(&format!("nodeplan: {name}: {e}"));
            exit::ALREADY_RUNNING
        }
        Err(e) => {
            super::say(&format!("nodeplan: {name}: {e}"));
            exit::FAILED
        }
    }
}
