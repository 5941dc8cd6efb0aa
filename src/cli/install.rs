//! `nodeplan install` and `nodeplan uninstall`: arguments, the report and exit codes; the work is
//! [`crate::install`]'s.

use super::exit;
use crate::install::run::{self, Error};
use crate::install::settings::{Flags, Settings};
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct InstallArgs {
    /// Install into this directory tree instead of this machine (an image being built, a test):
    /// paths are resolved beneath it, no symlink in it is followed, and systemctl is not run (the
    /// unit is enabled with a link, as `systemctl --root` does) [env: NODEPLAN_INSTALL_ROOT]
    #[arg(long, value_name = "DIR", value_parser = super::absolute_path)]
    root: Option<PathBuf>,
    /// Overwrite files that nodeplan install did not write (a config, a unit or a binary that is
    /// already there)
    #[arg(long)]
    force: bool,
    /// The Rancher server (https://…) [env: CATTLE_SERVER]; the token comes from CATTLE_TOKEN only
    #[arg(long, value_name = "URL")]
    server: Option<String>,
    /// SHA-256 (hex) of the server's /cacerts; that CA then is the only one trusted
    /// [env: CATTLE_CA_CHECKSUM]
    #[arg(long, value_name = "HEX")]
    ca_checksum: Option<String>,
    /// No Rancher: this kubeconfig, with --secret or --nodeplan, goes into the connection info
    #[arg(long, value_name = "FILE", value_parser = super::absolute_path)]
    kubeconfig: Option<PathBuf>,
    /// With --kubeconfig: remote mode on this plan Secret
    #[arg(long, value_name = "NAMESPACE/NAME", conflicts_with = "nodeplan")]
    secret: Option<String>,
    /// With --kubeconfig: NodePlan mode, the node's NodePlans in this namespace
    #[arg(long, value_name = "NAMESPACE")]
    nodeplan: Option<String>,
    /// Local mode only (plans from the local plan directory), no server [env: CATTLE_LOCAL_ENABLED
    /// with CATTLE_REMOTE_ENABLED=false]
    #[arg(long, conflicts_with_all = ["server", "kubeconfig"])]
    local: bool,
    /// The binary to install [default: CATTLE_AGENT_BINARY_LOCAL_LOCATION when
    /// CATTLE_AGENT_BINARY_LOCAL=true, else the running binary]
    #[arg(long, value_name = "FILE", value_parser = super::absolute_path)]
    binary: Option<PathBuf>,
    /// Retries of a request to the server that did not answer 200 [env: NODEPLAN_INSTALL_RETRIES;
    /// default: 10]
    #[arg(long, value_name = "N")]
    retries: Option<u32>,
    /// Wait between retries [env: NODEPLAN_INSTALL_RETRY_INTERVAL; default: 5s]
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse)]
    retry_interval: Option<Duration>,
    /// Time limit of each request to the server
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse_positive, default_value = "30s")]
    request_timeout: Duration,
    /// How long to wait for a plan being applied to end before replacing a running agent
    #[arg(long, value_name = "DURATION", value_parser = crate::duration::parse, default_value = "5m")]
    interlock_timeout: Duration,
}

#[derive(Args, Debug)]
pub struct UninstallArgs {
    /// The directory tree install wrote into [env: NODEPLAN_INSTALL_ROOT; default: /]
    #[arg(long, value_name = "DIR", value_parser = super::absolute_path)]
    root: Option<PathBuf>,
}

pub const INSTALL_EXIT_CODES: &str = "Exit codes:
  0  installed (or nothing to change: everything was already as asked)
  1  failed: the server did not give the connection info (after the retries), its CA did not
     match CATTLE_CA_CHECKSUM, a write or systemctl failed, or a plan being applied did not end
     within --interlock-timeout
  2  bad arguments or settings (CATTLE_* variables), an unreadable binary or kubeconfig
  3  refused: a file nodeplan install did not write is in the way (nothing was written; --force
     overwrites it)

Settings read from the environment (system-agent's installer variables): CATTLE_AGENT_CONFIG_DIR,
CATTLE_AGENT_VAR_DIR, CATTLE_AGENT_BIN_PREFIX (default /usr/local, /opt/nodeplan when that is
read-only), CATTLE_AGENT_LOGLEVEL, CATTLE_AGENT_STRICT_VERIFY, CATTLE_SERVER, CATTLE_TOKEN,
CATTLE_CA_CHECKSUM, CATTLE_ID (default: derived from /etc/machine-id and kept), CATTLE_ROLE_ETCD,
CATTLE_ROLE_CONTROLPLANE, CATTLE_ROLE_WORKER, CATTLE_LABELS, CATTLE_TAINTS, CATTLE_NODE_NAME,
CATTLE_ADDRESS, CATTLE_INTERNAL_ADDRESS, CATTLE_LOCAL_ENABLED, CATTLE_REMOTE_ENABLED,
CATTLE_PRESERVE_WORKDIR, CATTLE_AGENT_BINARY_LOCAL(_LOCATION), and the proxy variables
(HTTP_PROXY, HTTPS_PROXY, NO_PROXY and their lower-case forms), which go into the installer's
block of /etc/systemd/system/nodeplan.env.";

pub const UNINSTALL_EXIT_CODES: &str = "Exit codes:
  0  uninstalled (files changed since install wrote them are kept and named), or nothing to do
  1  a file could not be removed, or the manifest is unreadable
  2  bad arguments

The config directory holding the manifest is CATTLE_AGENT_CONFIG_DIR (default /etc/rancher/agent).";

fn print(lines: &[String]) {
    for l in lines {
        super::out!("{l}");
    }
}

pub async fn install(a: InstallArgs) -> u8 {
    let flags = Flags {
        root: a.root,
        force: a.force,
        server: a.server,
        ca_checksum: a.ca_checksum,
        kubeconfig: a.kubeconfig,
        secret: a.secret,
        nodeplan: a.nodeplan,
        local: a.local,
        binary: a.binary,
        retries: a.retries,
        retry_interval: a.retry_interval,
        request_timeout: Some(a.request_timeout),
        interlock_timeout: Some(a.interlock_timeout),
    };
    let settings = match Settings::resolve(|k| std::env::var(k).ok(), &flags) {
        Ok(s) => s,
        Err(e) => {
            super::say(&format!("nodeplan install: {e}"));
            return exit::BAD_INPUT;
        }
    };
    report("install", run::install(&settings).await)
}

pub fn uninstall(a: UninstallArgs) -> u8 {
    let flags = Flags { root: a.root, local: true, ..Flags::default() };
    let settings = match Settings::resolve(|k| std::env::var(k).ok(), &flags) {
        Ok(s) => s,
        Err(e) => {
            super::say(&format!("nodeplan uninstall: {e}"));
            return exit::BAD_INPUT;
        }
    };
    report("uninstall", run::uninstall(&settings.root, &settings.config_dir))
}

fn report(what: &str, r: Result<run::Outcome, Error>) -> u8 {
    match r {
        Ok(o) => {
            print(&o.lines);
            exit::OK
        }
        Err(Error::Bad(e)) => {
            super::say(&format!("nodeplan {what}: {e}"));
            exit::BAD_INPUT
        }
        Err(Error::Failed(e)) => {
            super::say(&format!("nodeplan {what}: {e}"));
            exit::FAILED
        }
        Err(Error::Refused(files)) => {
            super::say(&format!(
                "nodeplan {what}: refused, nothing was written: {} (use --force to overwrite)",
                files.join("; ").replace(" (use --force)", "")
            ));
            exit::REFUSED
        }
    }
}
