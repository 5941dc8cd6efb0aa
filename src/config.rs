//! The agent's configuration: this module owns reading the config file (`/etc/rancher/agent/config.yaml`
//! or the file named by `--config`, `NODEPLAN_CONFIG`, `CATTLE_AGENT_CONFIG`) and the remote-mode
//! connection-info file, with system-agent's rules for both (the file must exist, be mode exactly 0600
//! and belong to the agent's effective uid and gid, on Unix; the format is chosen by the file name
//! *containing* `.json` or `.yaml`, and on Windows a name without an extension is YAML: rancher-wins'
//! `config`, whose `systemagent:` section holds the keys; unknown keys are ignored; key names match case-insensitively as in Go's JSON
//! decoder), nodeplan's documented defaults for every key ([`defaults_table`]), and semantic
//! validation with warnings ([`validate`]). It only reads: it must not start anything, create or
//! touch the work, plan or PID directories, or talk to Kubernetes; [`validate`] merely looks at
//! whether the local plan directory and the connection-info file exist.

use crate::quoted;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::ffi::OsString;
use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Used when neither `--config`, `NODEPLAN_CONFIG` nor `CATTLE_AGENT_CONFIG` names a file.
#[cfg(not(windows))]
pub const DEFAULT_CONFIG_PATH: &str = "/etc/rancher/agent/config.yaml";
/// On Windows, the file rancher-wins' `install.ps1` writes (`CATTLE_AGENT_CONFIG_DIR`, default
/// `C:/etc/rancher/wins`, then `/config`): YAML with system-agent's keys under `systemagent:`.
#[cfg(windows)]
pub const DEFAULT_CONFIG_PATH: &str = "C:/etc/rancher/wins/config";

/// A default path of the node: as on Linux, on the system drive on Windows (where rancher-wins
/// keeps system-agent's: `CATTLE_AGENT_VAR_DIR` defaults to `C:/var/lib/rancher/agent`).
fn node_path(p: &str) -> PathBuf {
    if cfg!(windows) { PathBuf::from(format!("C:{p}")) } else { PathBuf::from(p) }
}

/// Config and connection-info files larger than this are refused (a kubeconfig is a few KiB).
pub const MAX_FILE_BYTES: u64 = 4 << 20;

/// The smallest accepted `outputCap`.
pub const MIN_OUTPUT_CAP: usize = 1024;

/// Every key the config file understands, in the order of [`defaults_table`].
pub const KEYS: [&str; 29] = [
    "workDirectory",
    "localEnabled",
    "localPlanDirectory",
    "appliedPlanDirectory",
    "remoteEnabled",
    "connectionInfoFile",
    "nodePlanEnabled",
    "nodeName",
    "nodePlanStateDirectory",
    "leaseDuration",
    "rivalCheck",
    "preserveWorkDirectory",
    "imagesDirectory",
    "agentRegistriesFile",
    "imageCredentialProviderConfig",
    "imageCredentialProviderBinDirectory",
    "imageMaxBytes",
    "imageMaxEntries",
    "interlockDirectory",
    "stopTimeout",
    "killTimeout",
    "noKill",
    "outputCap",
    "cgroupRoot",
    "pidDirectory",
    "probePeriodSeconds",
    "rescanSeconds",
    "localRetrySeconds",
    "metricsAddress",
];

const WHAT_CONFIG: &str = "config file";
const WHAT_CONNECTION: &str = "connection info file";

/// The agent's configuration: system-agent's keys plus nodeplan's own. Absent keys (and `null`
/// values) take the defaults of [`AgentConfig::default`], listed by [`defaults_table`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// `workDirectory`: parent of the per-apply execution directories.
    pub work_directory: PathBuf,
    /// `localEnabled`: local mode (plans from `local_plan_directory`).
    pub local_enabled: bool,
    /// `localPlanDirectory`: root of the local `.plan` files.
    pub local_plan_directory: PathBuf,
    /// `appliedPlanDirectory`: archive of applied plans; empty = no archive.
    pub applied_plan_directory: PathBuf,
    /// `remoteEnabled`: remote mode (the plan Secret named by the connection-info file).
    pub remote_enabled: bool,
    /// `connectionInfoFile`: kubeconfig, namespace and Secret name for remote mode.
    pub connection_info_file: PathBuf,
    /// `nodePlanEnabled`: NodePlan mode (the node's NodePlans in the connection info's namespace).
    pub node_plan_enabled: bool,
    /// `nodePlanStateDirectory`: the NodePlan runs in progress, kept so that a restarted agent
    /// recovers the plan it was running even when the spec changed meanwhile.
    pub node_plan_state_directory: PathBuf,
    /// `nodeName`: the node NodePlans are selected for; empty: `CATTLE_NODE_NAME`, else the
    /// hostname.
    pub node_name: String,
    /// `leaseDuration`: remote and NodePlan modes hold a Kubernetes Lease per plan source for this
    /// long, renewed every quarter of it (while idle, 24 times less often), so two agents never
    /// act on one source; 0 turns it off.
    pub lease_duration: Duration,
    /// `rivalCheck`: remote mode waits (and stops) while Rancher's `rancher-system-agent` runs
    /// (unless its own files say it serves another Secret).
    pub rival_check: bool,
    /// `preserveWorkDirectory`: do not wipe `work_directory` before an apply.
    pub preserve_work_directory: bool,
    /// `imagesDirectory`: image tarballs (an empty value means the default, as in system-agent).
    pub images_directory: PathBuf,
    /// `agentRegistriesFile`: registries config (an empty value means the default).
    pub agent_registries_file: PathBuf,
    /// `imageCredentialProviderConfig` (an empty value means the default).
    pub image_credential_provider_config: PathBuf,
    /// `imageCredentialProviderBinDirectory` (an empty value means the default).
    pub image_credential_provider_bin_directory: PathBuf,
    /// `imageMaxBytes`: bytes one image's layers may decompress to together (and the largest
    /// layer download).
    pub image_max_bytes: u64,
    /// `imageMaxEntries`: tar entries one image's layers may hold together.
    pub image_max_entries: u64,
    /// `interlockDirectory`: upgrade interlock files; empty = no interlock.
    pub interlock_directory: PathBuf,
    /// `stopTimeout`: stop ladder grace after SIGTERM.
    pub stop_timeout: Duration,
    /// `killTimeout`: stop ladder wait after SIGKILL.
    pub kill_timeout: Duration,
    /// `noKill`: never SIGKILL; give up after `stop_timeout` instead.
    pub no_kill: bool,
    /// `outputCap`: bytes of output kept per instruction.
    pub output_cap: usize,
    /// `cgroupRoot`: `auto`, `v1`, `off` or an absolute directory; see [`AgentConfig::cgroup_root`].
    pub cgroup_root: String,
    /// `pidDirectory`: PID records of running instructions.
    pub pid_directory: PathBuf,
    /// `probePeriodSeconds`: local mode probe period.
    pub probe_period_seconds: u64,
    /// `rescanSeconds`: local mode rescan period.
    pub rescan_seconds: u64,
    /// `localRetrySeconds`: local mode retries a failed plan after this, doubling per failure up
    /// to 5 minutes (or to this, when it is longer).
    pub local_retry_seconds: u64,
    /// `metricsAddress`: where `GET /metrics` is served (`IP:PORT`, or `:PORT` for every
    /// interface); empty = no metrics endpoint. See [`AgentConfig::metrics_address`].
    pub metrics_address: String,
    /// Keys of the file that nodeplan does not know (ignored, as in system-agent; [`validate`]
    /// warns about them). Empty for [`AgentConfig::default`].
    pub unknown_keys: Vec<String>,
}

/// The default bound on the bytes one image may unpack to (`imageMaxBytes`).
pub const DEFAULT_IMAGE_MAX_BYTES: u64 = 4 << 30;
/// The default bound on the entries one image may unpack to (`imageMaxEntries`).
pub const DEFAULT_IMAGE_MAX_ENTRIES: u64 = 1_000_000;
/// The shortest `leaseDuration` (renewal every quarter of it).
pub const LEASE_MIN_DURATION: Duration = Duration::from_secs(4);
/// The longest `leaseDuration`.
pub const LEASE_MAX_DURATION: Duration = Duration::from_secs(3600);
const DEFAULT_IMAGES_DIRECTORY: &str = "/var/lib/rancher/agent/images";
/// No `/run` on Windows: the PID records sit beside the agent's other state there.
const DEFAULT_PID_DIRECTORY: &str = if cfg!(windows) { "/var/lib/rancher/agent/pids" } else { "/run/nodeplan/pids" };
const DEFAULT_AGENT_REGISTRIES_FILE: &str = "/etc/rancher/agent/registries.yaml";
const DEFAULT_IMAGE_CREDENTIAL_PROVIDER_CONFIG: &str = "/var/lib/rancher/credentialprovider/config.yaml";
const DEFAULT_IMAGE_CREDENTIAL_PROVIDER_BIN_DIRECTORY: &str = "/var/lib/rancher/credentialprovider/bin";

impl Default for AgentConfig {
    fn default() -> AgentConfig {
        AgentConfig {
            work_directory: node_path("/var/lib/rancher/agent/work"),
            local_enabled: false,
            local_plan_directory: node_path("/var/lib/rancher/agent/plans"),
            applied_plan_directory: node_path("/var/lib/rancher/agent/applied"),
            remote_enabled: false,
            connection_info_file: node_path("/var/lib/rancher/agent/rancher2_connection_info.json"),
            node_plan_enabled: false,
            node_plan_state_directory: node_path("/var/lib/rancher/agent/nodeplans"),
            node_name: String::new(),
            lease_duration: Duration::from_secs(40),
            rival_check: true,
            preserve_work_directory: false,
            images_directory: node_path(DEFAULT_IMAGES_DIRECTORY),
            agent_registries_file: node_path(DEFAULT_AGENT_REGISTRIES_FILE),
            image_credential_provider_config: node_path(DEFAULT_IMAGE_CREDENTIAL_PROVIDER_CONFIG),
            image_credential_provider_bin_directory: node_path(DEFAULT_IMAGE_CREDENTIAL_PROVIDER_BIN_DIRECTORY),
            image_max_bytes: DEFAULT_IMAGE_MAX_BYTES,
            image_max_entries: DEFAULT_IMAGE_MAX_ENTRIES,
            interlock_directory: node_path("/var/lib/rancher/agent/interlock"),
            stop_timeout: Duration::from_secs(10),
            kill_timeout: Duration::from_secs(5),
            no_kill: false,
            output_cap: 65536,
            cgroup_root: "auto".into(),
            pid_directory: node_path(DEFAULT_PID_DIRECTORY),
            probe_period_seconds: 5,
            rescan_seconds: 5,
            local_retry_seconds: 30,
            metrics_address: String::new(),
            unknown_keys: Vec::new(),
        }
    }
}

/// What `cgroupRoot` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupRoot {
    /// Find the cgroup v2 mount and use a leaf per instruction under the agent's own cgroup; where
    /// cgroup v2 is unusable, the cgroup v1 freezer hierarchy.
    Auto,
    /// The cgroup v1 freezer hierarchy, under the agent's own freezer cgroup.
    V1,
    /// No cgroups: process groups only.
    Off,
    /// Leaves under this directory.
    Dir(PathBuf),
}

impl AgentConfig {
    /// `cgroupRoot` parsed; an error for anything but `auto`, `v1`, `off` or an absolute directory.
    pub fn cgroup_root(&self) -> Result<CgroupRoot, ConfigError> {
        match self.cgroup_root.as_str() {
            "auto" => Ok(CgroupRoot::Auto),
            "v1" => Ok(CgroupRoot::V1),
            "off" => Ok(CgroupRoot::Off),
            p if p.starts_with('/') => Ok(CgroupRoot::Dir(p.into())),
            other => Err(ConfigError::Invalid {
                problems: vec![format!(
                    "cgroupRoot: {} must be \"auto\", \"v1\", \"off\" or an absolute directory",
                    quoted(other)
                )],
            }),
        }
    }

    /// `metricsAddress` parsed: `None` when empty; `IP:PORT` (`[::1]:9100` for IPv6) or `:PORT`
    /// (every interface, as Go writes it). Host names are not accepted: the address is bound as
    /// given, never looked up.
    pub fn metrics_address(&self) -> Result<Option<std::net::SocketAddr>, ConfigError> {
        parse_metrics_address(&self.metrics_address).map_err(|problem| ConfigError::Invalid { problems: vec![problem] })
    }

    /// `probePeriodSeconds` as a duration.
    pub fn probe_period(&self) -> Duration {
        Duration::from_secs(self.probe_period_seconds)
    }

    /// `rescanSeconds` as a duration.
    pub fn rescan_period(&self) -> Duration {
        Duration::from_secs(self.rescan_seconds)
    }
}

/// Every config key with its default (as written in a config file) and its meaning, in the order of
/// [`KEYS`]. The defaults come from [`AgentConfig::default`], so the table cannot drift from the code.
pub fn defaults_table() -> Vec<(&'static str, String, &'static str)> {
    let d = AgentConfig::default();
    let p = |p: &Path| p.display().to_string();
    vec![
        (
            "workDirectory",
            p(&d.work_directory),
            "parent of the per-apply execution directories; a successful apply's directory (staged images included) is removed at its end, a failed one's before the next apply, unless `preserveWorkDirectory`; one holding anything else is refused (the apply is retried) and never touched",
        ),
        (
            "localEnabled",
            d.local_enabled.to_string(),
            "local mode: apply the `*.plan` files under `localPlanDirectory`",
        ),
        ("localPlanDirectory", p(&d.local_plan_directory), "root of the local plans, scanned recursively"),
        ("appliedPlanDirectory", p(&d.applied_plan_directory), "archive of applied plans; empty = no archive"),
        (
            "remoteEnabled",
            d.remote_enabled.to_string(),
            "remote mode: apply the plan Secret named in `connectionInfoFile` (install.sh writes `true`)",
        ),
        (
            "connectionInfoFile",
            p(&d.connection_info_file),
            "remote mode: JSON with `kubeConfig`, `namespace` and `secretName` (mode 0600, written by install.sh)",
        ),
        (
            "nodePlanEnabled",
            d.node_plan_enabled.to_string(),
            "NodePlan mode: apply the NodePlans labelled `cattle.io/node: <nodeName>` in the connection info's namespace",
        ),
        ("nodeName", "\"\"".to_string(), "NodePlan mode: the node; empty = `CATTLE_NODE_NAME`, else the hostname"),
        (
            "nodePlanStateDirectory",
            p(&d.node_plan_state_directory),
            "NodePlan mode: the runs in progress, so a restarted agent recovers the plan it was running",
        ),
        (
            "leaseDuration",
            crate::duration::show(d.lease_duration),
            "remote and NodePlan modes: the Lease that keeps a second agent off the same plan source (renewed every quarter of it while a plan runs, 24 times less often while idle; 0 = no Lease)",
        ),
        (
            "rivalCheck",
            d.rival_check.to_string(),
            "remote mode: wait while Rancher's `rancher-system-agent` runs on this node (and stop if it starts) unless its own config and connection info, root's and writable by no one else, say it serves another Secret or has remote mode off; `false` turns the check off where the node's operator knows better",
        ),
        ("preserveWorkDirectory", d.preserve_work_directory.to_string(), "never wipe `workDirectory`"),
        (
            "imagesDirectory",
            p(&d.images_directory),
            "`docker save` tarballs searched before pulling an `image` instruction's image; empty = default",
        ),
        (
            "agentRegistriesFile",
            p(&d.agent_registries_file),
            "registries file for `image` instructions (k3s/rke2 `registries.yaml` format); empty = default",
        ),
        (
            "imageCredentialProviderConfig",
            p(&d.image_credential_provider_config),
            "kubelet credential-provider config; accepted and unused (system-agent never reaches it either): credentials come from `agentRegistriesFile`",
        ),
        (
            "imageCredentialProviderBinDirectory",
            p(&d.image_credential_provider_bin_directory),
            "credential-provider plugin binaries; accepted and unused, as above",
        ),
        (
            "imageMaxBytes",
            d.image_max_bytes.to_string(),
            "bytes one image's layers may decompress to, all together (also the largest layer download); more is an error naming this key",
        ),
        (
            "imageMaxEntries",
            d.image_max_entries.to_string(),
            "files, directories and links one image's layers may hold, all together; more is an error naming this key",
        ),
        (
            "interlockDirectory",
            p(&d.interlock_directory),
            "upgrade interlock files shared with install.sh; empty = no interlock",
        ),
        (
            "stopTimeout",
            crate::duration::show(d.stop_timeout),
            "stop ladder: grace after SIGTERM for the process tree to exit (`500ms`, `10s`, `5m`, `1h` or a number of seconds)",
        ),
        (
            "killTimeout",
            crate::duration::show(d.kill_timeout),
            "stop ladder: wait after SIGKILL for the process tree to be gone",
        ),
        (
            "noKill",
            d.no_kill.to_string(),
            "never SIGKILL: after `stopTimeout` give up and leave the processes and their PID records",
        ),
        (
            "outputCap",
            d.output_cap.to_string(),
            "bytes of output kept per instruction (head and tail, with a marker line); at least 1024",
        ),
        (
            "cgroupRoot",
            d.cgroup_root.clone(),
            "`auto` (a cgroup v2 leaf per instruction under the agent's own cgroup; on cgroup v1 hosts a v1 freezer leaf), `v1` (the v1 freezer hierarchy), `off`, or an existing absolute directory in a cgroup2 mount or a v1 freezer hierarchy (checked at start)",
        ),
        ("pidDirectory", p(&d.pid_directory), "PID records of running instructions, verified before any signal"),
        ("probePeriodSeconds", d.probe_period_seconds.to_string(), "local mode: seconds between probe runs"),
        (
            "rescanSeconds",
            d.rescan_seconds.to_string(),
            "local mode: seconds between full rescans of `localPlanDirectory` (besides inotify)",
        ),
        (
            "localRetrySeconds",
            d.local_retry_seconds.to_string(),
            "local mode: a failed plan is retried after this many seconds, doubling per failure up to 5 minutes (or this, if longer)",
        ),
        (
            "metricsAddress",
            "\"\"".to_string(),
            "serve Prometheus metrics (`GET /metrics`) on this `IP:PORT` (or `:PORT`, every interface); empty = off; `--metrics-address` overrides it (see [Metrics](metrics.md))",
        ),
    ]
}

/// [`defaults_table`] as a Markdown table (`| key | default | meaning |`), one row a line, ending
/// with a newline: what docs/local-mode.md shows.
pub fn defaults_markdown() -> String {
    let mut s = String::from("| key | default | meaning |\n|---|---|---|\n");
    for (key, default, meaning) in defaults_table() {
        s.push_str(&format!("| `{key}` | `{default}` | {meaning} |\n"));
    }
    s
}

/// The remote-mode connection info written by install.sh (`rancher2_connection_info.json`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectionInfo {
    /// `kubeConfig`: kubeconfig YAML text (holds credentials; never logged).
    pub kube_config: String,
    /// `namespace` of the plan Secret.
    pub namespace: String,
    /// `secretName`: name of the plan Secret.
    pub secret_name: String,
}

impl fmt::Debug for ConnectionInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionInfo")
            .field("kube_config", &format_args!("<{} bytes, redacted>", self.kube_config.len()))
            .field("namespace", &self.namespace)
            .field("secret_name", &self.secret_name)
            .finish()
    }
}

/// A config or connection-info problem. Every message is one line that names the file or the key
/// and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("no {what} given (empty path)")]
    EmptyPath { what: &'static str },
    #[error("{what} {} does not exist{hint}", shown(.path))]
    NotFound { what: &'static str, path: PathBuf, hint: &'static str },
    #[error("{what} {}: cannot read: {error}", shown(.path))]
    Io { what: &'static str, path: PathBuf, error: io::Error },
    #[error("{what} {}: not a regular file", shown(.path))]
    NotAFile { what: &'static str, path: PathBuf },
    #[error("{what} {}: mode is {found:04o}, expected exactly 0600", shown(.path))]
    Mode { what: &'static str, path: PathBuf, found: u32 },
    #[error(
        "{what} {}: owned by uid {uid} gid {gid}, expected uid {expected_uid} gid {expected_gid} (the agent's effective user and group)",
        shown(.path)
    )]
    Owner { what: &'static str, path: PathBuf, uid: u32, gid: u32, expected_uid: u32, expected_gid: u32 },
    #[error(
        "{what} {}: cannot tell the format: the file name must contain \".json\" or \".yaml\" (\".yml\" is not accepted, as in system-agent)",
        shown(.path)
    )]
    Format { what: &'static str, path: PathBuf },
    #[error("{what} {}: larger than {MAX_FILE_BYTES} bytes", shown(.path))]
    TooLarge { what: &'static str, path: PathBuf },
    #[error("{what} {}: invalid {format}: {message}", shown(.path))]
    Parse { what: &'static str, path: PathBuf, format: &'static str, message: String },
    #[error("{what} {}: {key}: {problem}", shown(.path))]
    Value { what: &'static str, path: PathBuf, key: &'static str, problem: String },
    #[error("{what} {}: {key} is missing or empty; it is required", shown(.path))]
    Missing { what: &'static str, path: PathBuf, key: &'static str },
    #[error("invalid config: {}", .problems.join("; "))]
    Invalid { problems: Vec<String> },
}

/// The config file to read: the `--config` flag, else `NODEPLAN_CONFIG`, else `CATTLE_AGENT_CONFIG`,
/// else [`DEFAULT_CONFIG_PATH`]. Empty variables count as unset.
pub fn config_path(flag: Option<&Path>) -> PathBuf {
    config_path_from(flag, |k| std::env::var_os(k))
}

/// [`config_path`] with the environment lookup given (for tests).
pub fn config_path_from(flag: Option<&Path>, env: impl Fn(&str) -> Option<OsString>) -> PathBuf {
    if let Some(f) = flag {
        return f.to_path_buf();
    }
    ["NODEPLAN_CONFIG", "CATTLE_AGENT_CONFIG"]
        .into_iter()
        .filter_map(env)
        .find(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH), PathBuf::from)
}

/// Reads and parses the config file. Absent keys take their defaults; unknown keys are ignored
/// (and listed in [`AgentConfig::unknown_keys`]). Does not [`validate`].
pub fn load(path: &Path) -> Result<AgentConfig, ConfigError> {
    let doc = Doc::read(path, WHAT_CONFIG, true)?;
    let mut c = AgentConfig::default();
    doc.path_into("workDirectory", &mut c.work_directory, false)?;
    doc.bool_into("localEnabled", &mut c.local_enabled)?;
    doc.path_into("localPlanDirectory", &mut c.local_plan_directory, false)?;
    doc.path_into("appliedPlanDirectory", &mut c.applied_plan_directory, false)?;
    doc.bool_into("remoteEnabled", &mut c.remote_enabled)?;
    doc.path_into("connectionInfoFile", &mut c.connection_info_file, false)?;
    doc.bool_into("nodePlanEnabled", &mut c.node_plan_enabled)?;
    if let Some(n) = doc.string("nodeName")? {
        c.node_name = n;
    }
    doc.duration_into("leaseDuration", &mut c.lease_duration)?;
    doc.bool_into("rivalCheck", &mut c.rival_check)?;
    doc.bool_into("preserveWorkDirectory", &mut c.preserve_work_directory)?;
    doc.path_into("imagesDirectory", &mut c.images_directory, true)?;
    doc.path_into("agentRegistriesFile", &mut c.agent_registries_file, true)?;
    doc.path_into("imageCredentialProviderConfig", &mut c.image_credential_provider_config, true)?;
    doc.path_into("imageCredentialProviderBinDirectory", &mut c.image_credential_provider_bin_directory, true)?;
    if let Some(n) = doc.uint("imageMaxBytes")? {
        c.image_max_bytes = n;
    }
    if let Some(n) = doc.uint("imageMaxEntries")? {
        c.image_max_entries = n;
    }
    doc.path_into("interlockDirectory", &mut c.interlock_directory, false)?;
    doc.duration_into("stopTimeout", &mut c.stop_timeout)?;
    doc.duration_into("killTimeout", &mut c.kill_timeout)?;
    doc.bool_into("noKill", &mut c.no_kill)?;
    if let Some(n) = doc.uint("outputCap")? {
        c.output_cap = usize::try_from(n).map_err(|_| doc.value_err("outputCap", "too large".into()))?;
    }
    if let Some(s) = doc.string("cgroupRoot")? {
        c.cgroup_root = s;
    }
    doc.path_into("pidDirectory", &mut c.pid_directory, false)?;
    doc.path_into("nodePlanStateDirectory", &mut c.node_plan_state_directory, false)?;
    if let Some(n) = doc.uint("probePeriodSeconds")? {
        c.probe_period_seconds = n;
    }
    if let Some(n) = doc.uint("rescanSeconds")? {
        c.rescan_seconds = n;
    }
    if let Some(n) = doc.uint("localRetrySeconds")? {
        c.local_retry_seconds = n;
    }
    if let Some(a) = doc.string("metricsAddress")? {
        c.metrics_address = a;
    }
    c.unknown_keys =
        doc.map.keys().filter(|k| !KEYS.iter().any(|known| known.eq_ignore_ascii_case(k))).cloned().collect();
    tracing::debug!(path = %path.display(), unknown_keys = ?c.unknown_keys, "config file read");
    Ok(c)
}

/// The known key an unknown one is most likely a misspelling of: at most two edits away (case
/// aside), or one is the other with letters added at the end.
fn nearest_key(unknown: &str) -> Option<&'static str> {
    let u = unknown.to_ascii_lowercase();
    KEYS.iter()
        .map(|k| (edits(&u, &k.to_ascii_lowercase()), *k))
        .filter(|(d, k)| *d <= 2 || (u.len() >= 6 && k.to_ascii_lowercase().starts_with(&u)))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// Levenshtein distance (insertions, deletions, substitutions), by characters.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(row[j + 1] + 1);
            prev = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// Checks what [`load`] cannot: at least one mode enabled, remote mode with a `connectionInfoFile`,
/// local mode with a `localPlanDirectory`, non-empty `workDirectory` and `pidDirectory`, `cgroupRoot`,
/// positive durations and periods, `outputCap` ≥ [`MIN_OUTPUT_CAP`]. Every problem is reported in
/// the one error. Returns warnings for what may still work: a local plan directory or
/// connection-info file that does not exist (yet), relative paths, unknown keys.
pub fn validate(cfg: &AgentConfig) -> Result<Vec<String>, ConfigError> {
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    if !cfg.local_enabled && !cfg.remote_enabled && !cfg.node_plan_enabled {
        let misspelt: Vec<String> = cfg
            .unknown_keys
            .iter()
            .filter_map(|k| {
                nearest_key(k).filter(|n| n.ends_with("Enabled")).map(|n| format!("{} is not {n}", quoted(k)))
            })
            .collect();
        let hint = if misspelt.is_empty() { String::new() } else { format!(" ({})", misspelt.join(", ")) };
        problems.push(format!(
            "none of localEnabled, remoteEnabled and nodePlanEnabled is true: the agent would do nothing{hint}"
        ));
    }
    if cfg.remote_enabled || cfg.node_plan_enabled {
        if cfg.connection_info_file.as_os_str().is_empty() {
            problems.push("connectionInfoFile is empty but remoteEnabled or nodePlanEnabled is true".into());
        } else if !cfg.connection_info_file.exists() {
            warnings.push(format!(
                "connectionInfoFile {} does not exist (install.sh writes it); remote mode cannot start without it",
                shown(&cfg.connection_info_file)
            ));
        }
    }
    if cfg.local_enabled {
        let dir = &cfg.local_plan_directory;
        if dir.as_os_str().is_empty() {
            problems.push("localPlanDirectory is empty but localEnabled is true".into());
        } else if !dir.exists() {
            warnings.push(format!("localPlanDirectory {} does not exist (yet); no local plan will run", shown(dir)));
        } else if !dir.is_dir() {
            warnings.push(format!("localPlanDirectory {} is not a directory; no local plan will run", shown(dir)));
        }
    }
    for (key, p) in [("workDirectory", &cfg.work_directory), ("pidDirectory", &cfg.pid_directory)] {
        if p.as_os_str().is_empty() {
            problems.push(format!("{key} must not be empty"));
        }
    }
    if let Err(ConfigError::Invalid { problems: p }) = cfg.cgroup_root() {
        problems.extend(p);
    }
    if let Err(ConfigError::Invalid { problems: p }) = cfg.metrics_address() {
        problems.extend(p);
    }
    for (key, d) in [("stopTimeout", cfg.stop_timeout), ("killTimeout", cfg.kill_timeout)] {
        if d.is_zero() {
            problems.push(format!("{key} must be positive, found 0"));
        }
    }
    let lease = cfg.lease_duration;
    if !lease.is_zero() && !(LEASE_MIN_DURATION..=LEASE_MAX_DURATION).contains(&lease) {
        problems.push(format!(
            "leaseDuration must be 0 (no Lease) or between {} and {}, found {}",
            crate::duration::show(LEASE_MIN_DURATION),
            crate::duration::show(LEASE_MAX_DURATION),
            crate::duration::show(lease)
        ));
    }
    for (key, n) in [
        ("probePeriodSeconds", cfg.probe_period_seconds),
        ("rescanSeconds", cfg.rescan_seconds),
        ("localRetrySeconds", cfg.local_retry_seconds),
        ("imageMaxBytes", cfg.image_max_bytes),
        ("imageMaxEntries", cfg.image_max_entries),
    ] {
        if n == 0 {
            problems.push(format!("{key} must be at least 1, found 0"));
        }
    }
    if cfg.output_cap < MIN_OUTPUT_CAP {
        problems.push(format!("outputCap must be at least {MIN_OUTPUT_CAP} bytes, found {}", cfg.output_cap));
    }
    let paths = [
        ("workDirectory", &cfg.work_directory),
        ("localPlanDirectory", &cfg.local_plan_directory),
        ("appliedPlanDirectory", &cfg.applied_plan_directory),
        ("connectionInfoFile", &cfg.connection_info_file),
        ("imagesDirectory", &cfg.images_directory),
        ("agentRegistriesFile", &cfg.agent_registries_file),
        ("imageCredentialProviderConfig", &cfg.image_credential_provider_config),
        ("imageCredentialProviderBinDirectory", &cfg.image_credential_provider_bin_directory),
        ("interlockDirectory", &cfg.interlock_directory),
        ("pidDirectory", &cfg.pid_directory),
        ("nodePlanStateDirectory", &cfg.node_plan_state_directory),
    ];
    for (key, p) in paths {
        if !p.as_os_str().is_empty() && !p.is_absolute() {
            warnings.push(format!("{key} {} is relative: it depends on the agent's working directory", shown(p)));
        }
    }
    for k in &cfg.unknown_keys {
        let hint = nearest_key(k).map(|n| format!(" (did you mean {n}?)")).unwrap_or_default();
        warnings.push(format!("unknown key {} ignored{hint}", quoted(k)));
    }
    if problems.is_empty() { Ok(warnings) } else { Err(ConfigError::Invalid { problems }) }
}

/// Reads the connection-info file with the config file's rules (mode, owner, format by name);
/// `kubeConfig`, `namespace` and `secretName` are required and non-empty.
pub fn load_connection(path: &Path) -> Result<ConnectionInfo, ConfigError> {
    let doc = Doc::read(path, WHAT_CONNECTION, false)?;
    let field = |key: &'static str| -> Result<String, ConfigError> {
        match doc.string(key)? {
            Some(s) if !s.is_empty() => Ok(s),
            _ => Err(ConfigError::Missing { what: doc.what, path: doc.path.to_path_buf(), key }),
        }
    };
    let kube_config = field("kubeConfig")?;
    // Checked here so `validate-connection` and the agent's start both name the problem; the
    // kubeconfig holds tokens and keys, so the error gives the position only.
    if let Err(e) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(&kube_config) {
        return Err(doc.value_err("kubeConfig", format!("invalid YAML {}", yaml_location(&e))));
    }
    Ok(ConnectionInfo { kube_config, namespace: field("namespace")?, secret_name: field("secretName")? })
}

/// A `metricsAddress` value (see [`AgentConfig::metrics_address`]); the error is one line naming
/// the key.
pub fn parse_metrics_address(s: &str) -> Result<Option<std::net::SocketAddr>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    let bad = || {
        format!(
            "metricsAddress: {} must be IP:PORT (such as \"127.0.0.1:9100\" or \"[::1]:9100\") or :PORT, with a port from 1 to 65535",
            quoted(s)
        )
    };
    let addr = match s.strip_prefix(':') {
        Some(port) if port.bytes().all(|b| b.is_ascii_digit()) => {
            let port: u16 = port.parse().map_err(|_| bad())?;
            std::net::SocketAddr::from(([0, 0, 0, 0], port))
        }
        _ => s.parse::<std::net::SocketAddr>().map_err(|_| bad())?,
    };
    if addr.port() == 0 {
        return Err(bad());
    }
    Ok(Some(addr))
}

/// A path for a one-line message: control characters escaped.
fn shown(p: &Path) -> String {
    let s = p.display().to_string();
    if s.chars().any(char::is_control) { s.escape_debug().to_string() } else { s }
}

/// Where a JSON parser error is, never what the text there was (it can be a credential).
pub(crate) fn json_location(e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    let what = match e.classify() {
        Category::Io => "read error",
        Category::Syntax => "syntax error",
        Category::Data => "unexpected value",
        Category::Eof => "unexpected end of input",
    };
    if e.line() == 0 { what.to_string() } else { format!("{what} at line {} column {}", e.line(), e.column()) }
}

/// Where a YAML parser error is, never what the text there was (it can be a credential).
pub(crate) fn yaml_location(e: &serde_yaml_ng::Error) -> String {
    match e.location() {
        Some(l) => format!("at line {} column {}", l.line(), l.column()),
        None => "(no position given; the text is not shown, it may hold credentials)".to_string(),
    }
}

/// Squashes a parser message to one line.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[derive(Clone, Copy)]
enum Format {
    Json,
    Yaml,
}

/// A parsed config or connection-info file: its top-level mapping.
struct Doc<'a> {
    path: &'a Path,
    what: &'static str,
    /// Whether wrong values may be quoted in errors (not for the connection info: credentials).
    echo: bool,
    map: Map<String, Value>,
}

impl<'a> Doc<'a> {
    fn read(path: &'a Path, what: &'static str, echo: bool) -> Result<Doc<'a>, ConfigError> {
        let text = read_checked(path, what)?;
        let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
        let format = if name.contains(".json") {
            Format::Json
        } else if name.contains(".yaml") || (cfg!(windows) && !name.contains('.')) {
            // On Windows, a name without any extension: rancher-wins' `config`, YAML.
            Format::Yaml
        } else {
            return Err(ConfigError::Format { what, path: path.to_path_buf() });
        };
        let parse_err = |format: &'static str, message: String| ConfigError::Parse {
            what,
            path: path.to_path_buf(),
            format,
            message: one_line(&message),
        };
        let text = String::from_utf8(text).map_err(|e| {
            let name = if matches!(format, Format::Json) { "JSON" } else { "YAML" };
            parse_err(name, format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()))
        })?;
        // The connection info holds credentials: its parser messages, which can quote the text,
        // become positions only. The config file holds none, and a duplicate key named helps.
        let json_msg = |e: serde_json::Error| if echo { e.to_string() } else { json_location(&e) };
        let yaml_msg = |e: serde_yaml_ng::Error| if echo { e.to_string() } else { yaml_location(&e) };
        let value = match format {
            Format::Json => serde_json::from_str::<Value>(&text).map_err(|e| parse_err("JSON", json_msg(e)))?,
            Format::Yaml => {
                let mut y: serde_yaml_ng::Value =
                    serde_yaml_ng::from_str(&text).map_err(|e| parse_err("YAML", yaml_msg(e)))?;
                y.apply_merge().map_err(|e| parse_err("YAML", yaml_msg(e)))?;
                if has_non_finite(&y) {
                    // JSON has no such numbers; the conversion would quietly turn them into null.
                    return Err(parse_err("YAML", "infinite or NaN numbers are not accepted".into()));
                }
                serde_json::to_value(y).map_err(|e| parse_err("YAML", json_msg(e)))?
            }
        };
        let map = match value {
            // rancher-wins' config: system-agent's keys under `systemagent:`, beside wins' own.
            Value::Object(mut m) if what == WHAT_CONFIG && matches!(m.get("systemagent"), Some(Value::Object(_))) => {
                match m.remove("systemagent") {
                    Some(Value::Object(s)) => s,
                    _ => Map::new(),
                }
            }
            Value::Object(m) => m,
            // An empty YAML document (or a JSON `null`) sets nothing, as in system-agent.
            Value::Null => Map::new(),
            other => {
                let name = if matches!(format, Format::Json) { "JSON" } else { "YAML" };
                return Err(parse_err(name, format!("expected a mapping of keys at the top, found {}", kind(&other))));
            }
        };
        Ok(Doc { path, what, echo, map })
    }

    /// The value of `key`: an exact match, else a case-insensitive one (Go's JSON decoder, which
    /// system-agent uses for both formats, matches keys that way). `null` counts as absent.
    fn get(&self, key: &str) -> Option<&Value> {
        let exact = self.map.get(key).filter(|v| !v.is_null());
        exact.or_else(|| {
            self.map
                .iter()
                .find(|(k, v)| k.as_str() != key && k.eq_ignore_ascii_case(key) && !v.is_null())
                .map(|(_, v)| v)
        })
    }

    fn value_err(&self, key: &'static str, problem: String) -> ConfigError {
        ConfigError::Value { what: self.what, path: self.path.to_path_buf(), key, problem }
    }

    fn found(&self, v: &Value) -> String {
        if !self.echo {
            return kind(v).to_string();
        }
        match v {
            Value::String(s) => format!("the string {}", quoted(s)),
            Value::Number(n) => format!("the number {n}"),
            Value::Bool(b) => format!("{b}"),
            other => kind(other).to_string(),
        }
    }

    fn bool_into(&self, key: &'static str, out: &mut bool) -> Result<(), ConfigError> {
        match self.get(key) {
            None => Ok(()),
            Some(Value::Bool(b)) => {
                *out = *b;
                Ok(())
            }
            Some(v) => {
                let mut problem = format!("expected true or false, found {}", self.found(v));
                let yaml11 = ["yes", "no", "on", "off", "y", "n"];
                if let Value::String(s) = v
                    && yaml11.iter().any(|w| w.eq_ignore_ascii_case(s))
                {
                    problem.push_str(" (YAML 1.1 words such as yes/on are not booleans here)");
                }
                Err(self.value_err(key, problem))
            }
        }
    }

    fn string(&self, key: &'static str) -> Result<Option<String>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.value_err(key, format!("expected a string, found {}", self.found(v)))),
        }
    }

    /// A path key; with `empty_is_default` an empty string keeps the default (system-agent's own
    /// default for the image keys), otherwise it is kept (meaning "disabled" or, for some keys, an
    /// error left to [`validate`]).
    fn path_into(&self, key: &'static str, out: &mut PathBuf, empty_is_default: bool) -> Result<(), ConfigError> {
        match self.string(key)? {
            Some(s) if s.is_empty() && empty_is_default => {}
            Some(s) => *out = PathBuf::from(s),
            None => {}
        }
        Ok(())
    }

    fn uint(&self, key: &'static str) -> Result<Option<u64>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64()),
            Some(v) => Err(self.value_err(key, format!("expected a whole number ≥ 0, found {}", self.found(v)))),
        }
    }

    fn duration_into(&self, key: &'static str, out: &mut Duration) -> Result<(), ConfigError> {
        let d = match self.get(key) {
            None => return Ok(()),
            Some(Value::String(s)) => crate::duration::parse(s).map_err(|e| self.value_err(key, e))?,
            Some(Value::Number(n)) => match (n.as_u64(), n.as_f64()) {
                (Some(secs), _) => Duration::from_secs(secs),
                (None, Some(f)) => Duration::try_from_secs_f64(f).map_err(|_| {
                    self.value_err(
                        key,
                        format!(
                            "expected a duration ≥ 0 such as \"10s\" or 10, found {}",
                            self.found(&Value::Number(n.clone()))
                        ),
                    )
                })?,
                (None, None) => return Err(self.value_err(key, "not a number of seconds".into())),
            },
            Some(v) => {
                return Err(self.value_err(
                    key,
                    format!(
                        "expected a duration such as \"10s\", \"500ms\", \"5m\" or a number of seconds, found {}",
                        self.found(v)
                    ),
                ));
            }
        };
        *out = d;
        Ok(())
    }
}

fn has_non_finite(v: &serde_yaml_ng::Value) -> bool {
    use serde_yaml_ng::Value as Y;
    match v {
        Y::Number(n) => n.as_f64().is_some_and(|f| !f.is_finite()),
        Y::Sequence(items) => items.iter().any(has_non_finite),
        Y::Mapping(m) => m.iter().any(|(k, v)| has_non_finite(k) || has_non_finite(v)),
        Y::Tagged(t) => has_non_finite(&t.value),
        Y::Null | Y::Bool(_) | Y::String(_) => false,
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

/// Opens `path` and checks it the way system-agent does (regular file, mode exactly 0600, owned by
/// the effective uid and gid) on the open descriptor, then reads it.
fn read_checked(path: &Path, what: &'static str) -> Result<Vec<u8>, ConfigError> {
    if path.as_os_str().is_empty() {
        return Err(ConfigError::EmptyPath { what });
    }
    let owned = || path.to_path_buf();
    let file = open_nonblocking(path).map_err(|error| match error.kind() {
        io::ErrorKind::NotFound => ConfigError::NotFound {
            what,
            path: owned(),
            hint: if what == WHAT_CONNECTION { " (install.sh writes it when remote mode is enabled)" } else { "" },
        },
        _ => ConfigError::Io { what, path: owned(), error },
    })?;
    let meta = file.metadata().map_err(|error| ConfigError::Io { what, path: owned(), error })?;
    if !meta.is_file() {
        return Err(ConfigError::NotAFile { what, path: owned() });
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let mode = meta.mode() & 0o7777;
        if mode != 0o600 {
            return Err(ConfigError::Mode { what, path: owned(), found: mode });
        }
        // SAFETY: geteuid and getegid have no preconditions and cannot fail.
        let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
        if meta.uid() != euid || meta.gid() != egid {
            return Err(ConfigError::Owner {
                what,
                path: owned(),
                uid: meta.uid(),
                gid: meta.gid(),
                expected_uid: euid,
                expected_gid: egid,
            });
        }
    }
    let mut buf = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut buf).map_err(|error| ConfigError::Io {
        what,
        path: owned(),
        error,
    })?;
    if buf.len() as u64 > MAX_FILE_BYTES {
        return Err(ConfigError::TooLarge { what, path: owned() });
    }
    Ok(buf)
}

/// Opening a FIFO for reading would block until a writer appears: open without blocking, the
/// regular-file check comes right after.
fn open_nonblocking(path: &Path) -> io::Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NONBLOCK);
    }
    o.open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// rancher-wins' config (`install.ps1`'s `Set-WinsConfig`): a file named `config` (on Windows;
    /// elsewhere `.yaml` is needed), YAML, with system-agent's keys under `systemagent:` beside
    /// wins' own.
    #[test]
    fn a_rancher_wins_config_is_read_from_its_systemagent_section() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(if cfg!(windows) { "config" } else { "config.yaml" });
        let text = "white_list:\n  processPaths: []\nsystemagent:\n  workDirectory: C:/var/lib/rancher/agent/work\n  \
                    appliedPlanDirectory: C:/var/lib/rancher/agent/applied\n  remoteEnabled: true\n  \
                    preserveWorkDirectory: false\n  connectionInfoFile: C:/var/lib/rancher/agent/rancher2_connection_info.json\n";
        std::fs::write(&path, text).unwrap();
        #[cfg(unix)]
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        let c = load(&path).unwrap();
        assert_eq!(c.work_directory, Path::new("C:/var/lib/rancher/agent/work"));
        assert_eq!(c.applied_plan_directory, Path::new("C:/var/lib/rancher/agent/applied"));
        assert!(c.remote_enabled && !c.preserve_work_directory);
        assert_eq!(c.connection_info_file, Path::new("C:/var/lib/rancher/agent/rancher2_connection_info.json"));
        assert!(c.unknown_keys.is_empty(), "wins' own keys are not the agent's: {:?}", c.unknown_keys);
    }

    /// On Windows the defaults are where rancher-wins puts system-agent's files.
    #[cfg(windows)]
    #[test]
    fn windows_defaults_are_rancher_wins_paths() {
        let d = AgentConfig::default();
        assert_eq!(DEFAULT_CONFIG_PATH, "C:/etc/rancher/wins/config");
        assert_eq!(d.work_directory, Path::new("C:/var/lib/rancher/agent/work"));
        assert_eq!(d.applied_plan_directory, Path::new("C:/var/lib/rancher/agent/applied"));
        assert_eq!(d.connection_info_file, Path::new("C:/var/lib/rancher/agent/rancher2_connection_info.json"));
        assert_eq!(d.pid_directory, Path::new("C:/var/lib/rancher/agent/pids"));
    }

    #[test]
    fn an_unknown_key_is_named_with_the_key_it_misspells() {
        for (unknown, nearest) in [
            ("remoteEnable", Some("remoteEnabled")),
            ("RemoteEnabeld", Some("remoteEnabled")),
            ("localenabled", Some("localEnabled")),
            ("workDir", Some("workDirectory")),
            ("connectionInfo", Some("connectionInfoFile")),
            ("colour", None),
            ("", None),
        ] {
            assert_eq!(nearest_key(unknown), nearest, "{unknown}");
        }
        let cfg = AgentConfig { unknown_keys: vec!["remoteEnable".into()], ..AgentConfig::default() };
        let problems = match validate(&cfg) {
            Err(ConfigError::Invalid { problems }) => problems,
            other => panic!("{other:?}"),
        };
        assert!(
            problems[0].ends_with("the agent would do nothing (\"remoteEnable\" is not remoteEnabled)"),
            "{problems:?}"
        );
    }

    #[test]
    fn defaults_table_covers_every_key_in_order() {
        let table = defaults_table();
        let keys: Vec<&str> = table.iter().map(|(k, _, _)| *k).collect();
        assert_eq!(keys, KEYS);
        for (k, default, meaning) in &table {
            assert!(!meaning.is_empty() && !meaning.contains('|') && !meaning.contains('\n'), "{k}");
            assert!(!default.is_empty(), "{k}");
        }
        let get = |k: &str| table.iter().find(|(key, _, _)| *key == k).map(|(_, d, _)| d.clone()).unwrap_or_default();
        assert_eq!(get("stopTimeout"), "10s");
        assert_eq!(get("killTimeout"), "5s");
        assert_eq!(get("outputCap"), "65536");
        assert_eq!(get("cgroupRoot"), "auto");
        if cfg!(unix) {
            assert_eq!(get("pidDirectory"), "/run/nodeplan/pids");
            assert_eq!(get("workDirectory"), "/var/lib/rancher/agent/work");
        }
    }

    #[test]
    fn cgroup_root_values() {
        let mut c = AgentConfig::default();
        assert_eq!(c.cgroup_root().ok(), Some(CgroupRoot::Auto));
        c.cgroup_root = "off".into();
        assert_eq!(c.cgroup_root().ok(), Some(CgroupRoot::Off));
        c.cgroup_root = "v1".into();
        assert_eq!(c.cgroup_root().ok(), Some(CgroupRoot::V1));
        c.cgroup_root = "/sys/fs/cgroup/np".into();
        assert_eq!(c.cgroup_root().ok(), Some(CgroupRoot::Dir("/sys/fs/cgroup/np".into())));
        for bad in ["Auto", "rel/dir", "", "V1", "v2"] {
            c.cgroup_root = bad.into();
            let e = c.cgroup_root().expect_err(bad).to_string();
            assert!(e.contains("cgroupRoot"), "{e}");
        }
    }

    #[test]
    fn metrics_addresses() {
        use std::net::SocketAddr;
        let ok: [(&str, Option<SocketAddr>); 5] = [
            ("", None),
            ("127.0.0.1:9100", Some(SocketAddr::from(([127, 0, 0, 1], 9100)))),
            (":9100", Some(SocketAddr::from(([0, 0, 0, 0], 9100)))),
            ("[::1]:9100", Some("[::1]:9100".parse().unwrap())),
            ("0.0.0.0:65535", Some(SocketAddr::from(([0, 0, 0, 0], 65535)))),
        ];
        for (s, want) in ok {
            assert_eq!(parse_metrics_address(s), Ok(want), "{s:?}");
        }
        for bad in [
            "9100",
            "localhost:9100",
            "127.0.0.1",
            "127.0.0.1:",
            "127.0.0.1:0",
            ":0",
            ":70000",
            ":-1",
            "::1:9100",
            "127.0.0.1:9100 ",
            "http://127.0.0.1:9100",
            "256.0.0.1:80",
        ] {
            let e = parse_metrics_address(bad).expect_err(bad);
            assert!(e.starts_with("metricsAddress: ") && !e.contains('\n'), "{e}");
        }
        let mut c = AgentConfig { local_enabled: true, local_plan_directory: "/".into(), ..AgentConfig::default() };
        c.metrics_address = "nonsense".into();
        let e = validate(&c).expect_err("invalid").to_string();
        assert!(e.contains("metricsAddress: \"nonsense\""), "{e}");
    }

    #[test]
    fn config_path_precedence() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v))
        };
        let both: &[(&str, &str)] = &[("NODEPLAN_CONFIG", "/n.yaml"), ("CATTLE_AGENT_CONFIG", "/c.yaml")];
        let flag = Path::new("/flag.json");
        assert_eq!(config_path_from(Some(flag), env(both)), flag);
        assert_eq!(config_path_from(None, env(both)), Path::new("/n.yaml"));
        assert_eq!(config_path_from(None, env(&[("CATTLE_AGENT_CONFIG", "/c.yaml")])), Path::new("/c.yaml"));
        assert_eq!(
            config_path_from(None, env(&[("NODEPLAN_CONFIG", ""), ("CATTLE_AGENT_CONFIG", "/c.yaml")])),
            Path::new("/c.yaml")
        );
        assert_eq!(config_path_from(None, env(&[])), Path::new(DEFAULT_CONFIG_PATH));
        assert_eq!(config_path_from(None, env(&[("CATTLE_AGENT_CONFIG", "")])), Path::new(DEFAULT_CONFIG_PATH));
    }

    #[test]
    fn connection_info_debug_hides_the_kubeconfig() {
        let c = ConnectionInfo { kube_config: "token: s3cret".into(), namespace: "ns".into(), secret_name: "s".into() };
        let d = format!("{c:?}");
        assert!(!d.contains("s3cret") && d.contains("13 bytes") && d.contains("\"ns\""), "{d}");
    }

    #[test]
    fn one_line_messages() {
        assert_eq!(one_line("a\n  b\tc"), "a b c");
        assert_eq!(shown(Path::new("/a\nb")), "/a\\nb");
        assert_eq!(quoted("yes"), "\"yes\"");
        assert_eq!(quoted(&"x".repeat(100)).chars().count(), 63);
    }
}
