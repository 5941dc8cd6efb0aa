//! The installer's settings from system-agent's installer variables and the command's flags, as a
//! pure function of both ([`Settings::resolve`]); every value is checked here, so the rest of the
//! installer never sees a relative directory, a non-HTTPS server or a header value with a line
//! break in it.
//!
//! Owns the names and meaning of the variables; must not read files or talk to the network.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// system-agent's defaults.
pub const DEFAULT_CONFIG_DIR: &str = "/etc/rancher/agent";
pub const DEFAULT_VAR_DIR: &str = "/var/lib/rancher/agent";
pub const DEFAULT_BIN_PREFIX: &str = "/usr/local";
/// The prefix used when `/usr/local` is read-only (Flatcar, SLE Micro) and no prefix was given.
pub const FALLBACK_BIN_PREFIX: &str = "/opt/nodeplan";

/// Proxy variables copied from the installer's environment into the unit's environment file.
pub const PROXY_VARS: [&str; 6] = ["HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"];

/// What the command line gave (the flags; everything else comes from the environment).
#[derive(Debug, Clone, Default)]
pub struct Flags {
    pub root: Option<PathBuf>,
    pub force: bool,
    pub server: Option<String>,
    pub ca_checksum: Option<String>,
    pub kubeconfig: Option<PathBuf>,
    pub secret: Option<String>,
    pub nodeplan: Option<String>,
    pub local: bool,
    pub binary: Option<PathBuf>,
    pub retries: Option<u32>,
    pub retry_interval: Option<Duration>,
    pub request_timeout: Option<Duration>,
    pub interlock_timeout: Option<Duration>,
}

/// The roles sent to Rancher.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Roles {
    pub etcd: bool,
    pub control_plane: bool,
    pub worker: bool,
}

/// A Rancher server to fetch the connection info from.
#[derive(Clone, PartialEq, Eq)]
pub struct Rancher {
    /// `CATTLE_SERVER` without a trailing slash; always `https://`.
    pub server: String,
    /// `CATTLE_TOKEN` (never logged; not taken as a flag so it stays out of `ps`).
    pub token: String,
    /// `CATTLE_CA_CHECKSUM`: lowercase hex SHA-256 of `/cacerts` as served; `None`: system roots.
    pub ca_checksum: Option<String>,
    /// `CATTLE_ID`; `None`: derived from the machine id (and kept in the config directory).
    pub id: Option<String>,
    pub roles: Roles,
    pub labels: String,
    pub taints: String,
    pub address: String,
    pub internal_address: String,
}

impl std::fmt::Debug for Rancher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rancher")
            .field("server", &shown_url(&self.server))
            .field("token", &"<redacted>")
            .field("ca_checksum", &self.ca_checksum)
            .field("id", &self.id)
            .field("roles", &self.roles)
            .finish_non_exhaustive()
    }
}

/// Where the agent gets its plans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Remote mode with the connection info from a Rancher server.
    Rancher(Rancher),
    /// No Rancher: a kubeconfig given directly, with the plan Secret (`remote`) or the
    /// namespace of the node's NodePlans (`nodeplan`).
    Kubeconfig { kubeconfig: PathBuf, namespace: String, name: String, nodeplan: bool },
    /// Local mode only (`localPlanDirectory`); no connection info.
    Local,
}

/// Everything the installer needs, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The tree to install into (`/` for this machine).
    pub root: PathBuf,
    pub config_dir: PathBuf,
    pub var_dir: PathBuf,
    /// `CATTLE_AGENT_BIN_PREFIX`; `None`: `/usr/local`, or `/opt/nodeplan` when that is read-only.
    pub bin_prefix: Option<PathBuf>,
    pub log_level: Option<String>,
    pub strict_verify: bool,
    pub source: Source,
    /// Local mode as well as (or instead of) the source's mode (`CATTLE_LOCAL_ENABLED`).
    pub local_enabled: bool,
    pub preserve_work_dir: bool,
    pub node_name: Option<String>,
    /// The binary to install; `None`: the running one.
    pub binary: Option<PathBuf>,
    /// Proxy variables for the unit's environment file, in [`PROXY_VARS`] order.
    pub proxy: Vec<(String, String)>,
    pub force: bool,
    pub retries: u32,
    pub retry_interval: Duration,
    pub request_timeout: Duration,
    pub interlock_timeout: Duration,
}

impl Settings {
    /// Whether the target is this machine (then systemctl is run).
    pub fn is_host(&self) -> bool {
        self.root == Path::new("/")
    }

    /// The config file's path as the agent sees it.
    pub fn config_path(&self) -> PathBuf {
        self.config_dir.join("config.yaml")
    }

    /// The connection-info file's path as the agent sees it.
    pub fn connection_path(&self) -> PathBuf {
        self.var_dir.join("rancher2_connection_info.json")
    }

    /// Resolves the settings from `env` (a variable lookup; empty counts as unset) and `flags`
    /// (which win). Every problem is reported, joined with `; `.
    pub fn resolve(env: impl Fn(&str) -> Option<String>, flags: &Flags) -> Result<Settings, String> {
        let get = |k: &str| env(k).filter(|v| !v.is_empty());
        let mut problems = Vec::new();
        let dir = |flag: Option<&PathBuf>, var: &str, default: &str, problems: &mut Vec<String>| -> PathBuf {
            let p = flag.cloned().or_else(|| get(var).map(PathBuf::from)).unwrap_or_else(|| default.into());
            let text = p.to_string_lossy();
            if !p.is_absolute()
                || p.components().any(|c| matches!(c, std::path::Component::ParentDir))
                || text.chars().any(char::is_control)
            {
                problems.push(format!(
                    "{var}: {} must be an absolute path without \"..\" or control characters",
                    crate::quoted(&text)
                ));
            }
            p
        };
        let root = dir(flags.root.as_ref(), "NODEPLAN_INSTALL_ROOT", "/", &mut problems);
        let config_dir = dir(None, "CATTLE_AGENT_CONFIG_DIR", DEFAULT_CONFIG_DIR, &mut problems);
        let var_dir = dir(None, "CATTLE_AGENT_VAR_DIR", DEFAULT_VAR_DIR, &mut problems);
        let bin_prefix =
            get("CATTLE_AGENT_BIN_PREFIX").map(|_| dir(None, "CATTLE_AGENT_BIN_PREFIX", "", &mut problems));
        let log_level = get("CATTLE_AGENT_LOGLEVEL");
        if let Some(l) = &log_level
            && crate::logging::parse_log_level(l).is_err()
        {
            problems.push(format!("CATTLE_AGENT_LOGLEVEL: {} is not a log level", crate::quoted(l)));
        }
        let strict_verify = match get("CATTLE_AGENT_STRICT_VERIFY").or_else(|| get("STRICT_VERIFY")) {
            None => false,
            Some(v) => boolean("CATTLE_AGENT_STRICT_VERIFY", &v, &mut problems),
        };
        let flag_bool = |var: &str, default: bool, problems: &mut Vec<String>| match get(var) {
            None => default,
            Some(v) => boolean(var, &v, problems),
        };
        let local_enabled = flags.local || flag_bool("CATTLE_LOCAL_ENABLED", false, &mut problems);
        let remote_enabled = flag_bool("CATTLE_REMOTE_ENABLED", true, &mut problems) && !flags.local;
        let preserve_work_dir = flag_bool("CATTLE_PRESERVE_WORKDIR", false, &mut problems);
        let node_name = get("CATTLE_NODE_NAME");
        if let Some(n) = &node_name {
            header_safe("CATTLE_NODE_NAME", n, &mut problems);
        }

        let source = if let Some(kc) = &flags.kubeconfig {
            let (target, nodeplan) = match (&flags.secret, &flags.nodeplan) {
                (Some(s), None) => (s.as_str(), false),
                (None, Some(n)) => (n.as_str(), true),
                _ => {
                    problems.push(
                        "--kubeconfig needs exactly one of --secret NAMESPACE/NAME or --nodeplan NAMESPACE".into(),
                    );
                    ("", false)
                }
            };
            let (namespace, name) = match target.split_once('/') {
                Some((ns, n)) => (ns.to_string(), n.to_string()),
                None => (target.to_string(), String::new()),
            };
            if (namespace.is_empty() || (!nodeplan && name.is_empty())) && !target.is_empty() {
                problems.push(format!(
                    "{}: {} must be {}",
                    if nodeplan { "--nodeplan" } else { "--secret" },
                    crate::quoted(target),
                    if nodeplan { "NAMESPACE (or NAMESPACE/NAME)" } else { "NAMESPACE/NAME" }
                ));
            }
            // The connection info needs a non-empty secretName; NodePlan mode does not read it.
            let name = if name.is_empty() { "unused".to_string() } else { name };
            Source::Kubeconfig { kubeconfig: kc.clone(), namespace, name, nodeplan }
        } else if flags.secret.is_some() || flags.nodeplan.is_some() {
            problems.push("--secret and --nodeplan need --kubeconfig".into());
            Source::Local
        } else if !remote_enabled {
            if !local_enabled {
                problems
                    .push("CATTLE_REMOTE_ENABLED is false and local mode is off: the agent would do nothing".into());
            }
            Source::Local
        } else {
            match rancher(&get, flags, &mut problems) {
                Some(r) => Source::Rancher(r),
                None => Source::Local,
            }
        };

        let binary = flags.binary.clone().or_else(|| {
            match get("CATTLE_AGENT_BINARY_LOCAL").map(|v| boolean("CATTLE_AGENT_BINARY_LOCAL", &v, &mut problems)) {
                Some(true) => match get("CATTLE_AGENT_BINARY_LOCAL_LOCATION") {
                    Some(p) => Some(PathBuf::from(p)),
                    None => {
                        problems.push(
                            "CATTLE_AGENT_BINARY_LOCAL is true but CATTLE_AGENT_BINARY_LOCAL_LOCATION is not set"
                                .into(),
                        );
                        None
                    }
                },
                _ => None,
            }
        });
        let proxy: Vec<(String, String)> =
            PROXY_VARS.iter().filter_map(|k| get(k).map(|v| (k.to_string(), v))).collect();
        for (k, v) in &proxy {
            header_safe(k, v, &mut problems);
        }
        let retries = match flags.retries {
            Some(n) => n,
            None => uint(get("NODEPLAN_INSTALL_RETRIES"), "NODEPLAN_INSTALL_RETRIES", 10, &mut problems),
        };
        let retry_interval = match flags.retry_interval {
            Some(d) => d,
            None => {
                duration(get("NODEPLAN_INSTALL_RETRY_INTERVAL"), "NODEPLAN_INSTALL_RETRY_INTERVAL", 5, &mut problems)
            }
        };
        if problems.is_empty() {
            Ok(Settings {
                root,
                config_dir,
                var_dir,
                bin_prefix,
                log_level,
                strict_verify,
                source,
                local_enabled,
                preserve_work_dir,
                node_name,
                binary,
                proxy,
                force: flags.force,
                retries,
                retry_interval,
                request_timeout: flags.request_timeout.unwrap_or(Duration::from_secs(30)),
                interlock_timeout: flags.interlock_timeout.unwrap_or(Duration::from_secs(300)),
            })
        } else {
            Err(problems.join("; "))
        }
    }
}

fn rancher(get: &impl Fn(&str) -> Option<String>, flags: &Flags, problems: &mut Vec<String>) -> Option<Rancher> {
    let Some(server) = flags.server.clone().or_else(|| get("CATTLE_SERVER")) else {
        problems.push(
            "no CATTLE_SERVER (or --server): give a Rancher server, or --kubeconfig with --secret/--nodeplan, or --local"
                .into(),
        );
        return None;
    };
    let server = server.trim_end_matches('/').to_string();
    match reqwest::Url::parse(&server) {
        Ok(u) if u.scheme() == "https" && u.host_str().is_some() && u.query().is_none() => {}
        _ => problems.push(format!("CATTLE_SERVER: {} must be an https:// URL", crate::quoted(&shown_url(&server)))),
    }
    let token = get("CATTLE_TOKEN").unwrap_or_default();
    if token.is_empty() {
        problems.push("CATTLE_TOKEN is not set (the registration token from Rancher)".into());
    } else if !header_value_ok(&token) {
        problems.push("CATTLE_TOKEN holds characters not allowed in an HTTP header".into());
    }
    let ca_checksum = flags.ca_checksum.clone().or_else(|| get("CATTLE_CA_CHECKSUM")).map(|c| c.to_ascii_lowercase());
    if let Some(c) = &ca_checksum
        && (c.len() != 64 || !c.bytes().all(|b| b.is_ascii_hexdigit()))
    {
        problems.push(format!("CATTLE_CA_CHECKSUM: {} is not a SHA-256 in hex (64 digits)", crate::quoted(c)));
    }
    let id = get("CATTLE_ID");
    let mut text = |var: &str| {
        let v = get(var).unwrap_or_default();
        header_safe(var, &v, problems);
        v
    };
    let (labels, taints) = (text("CATTLE_LABELS"), text("CATTLE_TAINTS"));
    let (address, internal_address) = (text("CATTLE_ADDRESS"), text("CATTLE_INTERNAL_ADDRESS"));
    if let Some(i) = &id {
        header_safe("CATTLE_ID", i, problems);
    }
    let mut role = |var: &str| match get(var) {
        None => false,
        Some(v) => boolean(var, &v, problems),
    };
    let roles = Roles {
        etcd: role("CATTLE_ROLE_ETCD"),
        control_plane: role("CATTLE_ROLE_CONTROLPLANE"),
        worker: role("CATTLE_ROLE_WORKER"),
    };
    Some(Rancher { server, token, ca_checksum, id, roles, labels, taints, address, internal_address })
}

fn boolean(var: &str, v: &str, problems: &mut Vec<String>) -> bool {
    match v.to_ascii_lowercase().as_str() {
        "true" => true,
        "false" => false,
        _ => {
            problems.push(format!("{var}: {} must be true or false", crate::quoted(v)));
            false
        }
    }
}

fn uint(v: Option<String>, var: &str, default: u32, problems: &mut Vec<String>) -> u32 {
    match v {
        None => default,
        Some(s) => s.parse().unwrap_or_else(|_| {
            problems.push(format!("{var}: {} is not a whole number", crate::quoted(&s)));
            default
        }),
    }
}

fn duration(v: Option<String>, var: &str, default_secs: u64, problems: &mut Vec<String>) -> Duration {
    match v {
        None => Duration::from_secs(default_secs),
        Some(s) => crate::duration::parse(&s).unwrap_or_else(|e| {
            problems.push(format!("{var}: {e}"));
            Duration::from_secs(default_secs)
        }),
    }
}

/// `url` for a message: any userinfo (`https://user:password@host`, `https://token@host`) is
/// shown as `***@`, so a password in `CATTLE_SERVER` (or in a redirect's `Location`) never reaches
/// an error line or a log.
pub fn shown_url(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => url.split_at(i + 3),
        None => ("", url),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}***{}", &rest[at..]),
        None => url.to_string(),
    }
}

/// Whether `v` may be sent as an HTTP header value (visible ASCII and spaces, no line breaks).
fn header_value_ok(v: &str) -> bool {
    v.bytes().all(|b| b == b' ' || b == b'\t' || (0x21..0x7f).contains(&b))
}

fn header_safe(var: &str, v: &str, problems: &mut Vec<String>) {
    if !header_value_ok(v) {
        problems.push(format!("{var}: {} holds control or non-ASCII characters", crate::quoted(v)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    const SUM: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn rancher_settings_from_the_installer_variables() {
        let e = env(&[
            ("CATTLE_SERVER", "https://rancher.example/"),
            ("CATTLE_TOKEN", "tok"),
            ("CATTLE_CA_CHECKSUM", &SUM.to_uppercase()),
            ("CATTLE_ROLE_ETCD", "true"),
            ("CATTLE_ROLE_WORKER", "TRUE"),
            ("CATTLE_LABELS", "a=b,c=d"),
            ("CATTLE_AGENT_CONFIG_DIR", "/cfg"),
            ("CATTLE_AGENT_LOGLEVEL", "debug"),
            ("HTTPS_PROXY", "http://proxy:3128"),
            ("NO_PROXY", ""),
        ]);
        let s = Settings::resolve(e, &Flags::default()).unwrap();
        let Source::Rancher(r) = &s.source else { panic!("{s:?}") };
        assert_eq!(r.server, "https://rancher.example");
        assert_eq!(r.ca_checksum.as_deref(), Some(SUM));
        assert_eq!(r.roles, Roles { etcd: true, control_plane: false, worker: true });
        assert_eq!(r.labels, "a=b,c=d");
        assert_eq!(r.id, None);
        assert_eq!(s.config_path(), Path::new("/cfg/config.yaml"));
        assert_eq!(s.connection_path(), Path::new("/var/lib/rancher/agent/rancher2_connection_info.json"));
        assert_eq!(s.proxy, vec![("HTTPS_PROXY".to_string(), "http://proxy:3128".to_string())]);
        assert_eq!(s.bin_prefix, None);
        assert_eq!(s.log_level.as_deref(), Some("debug"));
        assert!(s.is_host() && !s.force && s.retries == 10);
        assert!(!format!("{r:?}").contains("tok\""), "the token is never shown");
    }

    #[test]
    fn userinfo_is_masked() {
        assert_eq!(shown_url("https://u:hunter2@r.example:8443/v3"), "https://***@r.example:8443/v3");
        assert_eq!(shown_url("https://tok@r.example"), "https://***@r.example");
        assert_eq!(shown_url("http://a:b@c@d/e@f"), "http://***@d/e@f");
        assert_eq!(shown_url("https://r.example/x@y"), "https://r.example/x@y");
        let e = Settings::resolve(
            env(&[("CATTLE_SERVER", "http://u:hunter2@x"), ("CATTLE_TOKEN", "t")]),
            &Flags::default(),
        )
        .unwrap_err();
        assert!(e.contains("***@x") && !e.contains("hunter2"), "{e}");
    }

    #[test]
    fn bad_values_are_all_named() {
        type Case<'a> = (&'a [(&'a str, &'a str)], Flags, &'a [&'a str]);
        let cases: &[Case] = &[
            (&[], Flags::default(), &["no CATTLE_SERVER"]),
            (&[("CATTLE_SERVER", "http://x"), ("CATTLE_TOKEN", "t")], Flags::default(), &["https:// URL"]),
            (&[("CATTLE_SERVER", "https://x")], Flags::default(), &["CATTLE_TOKEN is not set"]),
            (
                &[("CATTLE_SERVER", "https://x"), ("CATTLE_TOKEN", "t"), ("CATTLE_CA_CHECKSUM", "abc")],
                Flags::default(),
                &["CATTLE_CA_CHECKSUM"],
            ),
            (
                &[("CATTLE_SERVER", "https://x"), ("CATTLE_TOKEN", "t"), ("CATTLE_ROLE_ETCD", "yes")],
                Flags::default(),
                &["CATTLE_ROLE_ETCD: \"yes\" must be true or false"],
            ),
            (
                &[("CATTLE_SERVER", "https://x"), ("CATTLE_TOKEN", "t"), ("CATTLE_LABELS", "a\r\nX-Evil: 1")],
                Flags::default(),
                &["CATTLE_LABELS"],
            ),
            (
                &[
                    ("CATTLE_AGENT_VAR_DIR", "rel"),
                    ("CATTLE_LOCAL_ENABLED", "true"),
                    ("CATTLE_REMOTE_ENABLED", "false"),
                ],
                Flags::default(),
                &["CATTLE_AGENT_VAR_DIR"],
            ),
            (&[("CATTLE_REMOTE_ENABLED", "false")], Flags::default(), &["would do nothing"]),
            (
                &[("CATTLE_AGENT_LOGLEVEL", "loud")],
                Flags { local: true, ..Flags::default() },
                &["CATTLE_AGENT_LOGLEVEL"],
            ),
            (
                &[],
                Flags { kubeconfig: Some("/k".into()), ..Flags::default() },
                &["exactly one of --secret NAMESPACE/NAME or --nodeplan"],
            ),
            (
                &[],
                Flags { kubeconfig: Some("/k".into()), secret: Some("ns".into()), ..Flags::default() },
                &["NAMESPACE/NAME"],
            ),
            (&[], Flags { secret: Some("ns/n".into()), ..Flags::default() }, &["need --kubeconfig"]),
            (
                &[("CATTLE_AGENT_BINARY_LOCAL", "true")],
                Flags { local: true, ..Flags::default() },
                &["CATTLE_AGENT_BINARY_LOCAL_LOCATION"],
            ),
            (
                &[("NODEPLAN_INSTALL_RETRIES", "many")],
                Flags { local: true, ..Flags::default() },
                &["NODEPLAN_INSTALL_RETRIES"],
            ),
        ];
        for (vars, flags, wanted) in cases {
            let e = Settings::resolve(env(vars), flags).expect_err(&format!("{vars:?}"));
            for w in *wanted {
                assert!(e.contains(w), "{vars:?}: {e}");
            }
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn no_rancher_and_local_sources() {
        let f = Flags { kubeconfig: Some("/k".into()), secret: Some("ns/plan".into()), ..Flags::default() };
        let s = Settings::resolve(env(&[]), &f).unwrap();
        assert_eq!(
            s.source,
            Source::Kubeconfig {
                kubeconfig: "/k".into(),
                namespace: "ns".into(),
                name: "plan".into(),
                nodeplan: false
            }
        );
        let f = Flags { kubeconfig: Some("/k".into()), nodeplan: Some("fleet".into()), ..Flags::default() };
        let s = Settings::resolve(env(&[("CATTLE_NODE_NAME", "n1")]), &f).unwrap();
        assert_eq!(
            s.source,
            Source::Kubeconfig {
                kubeconfig: "/k".into(),
                namespace: "fleet".into(),
                name: "unused".into(),
                nodeplan: true
            }
        );
        assert_eq!(s.node_name.as_deref(), Some("n1"));
        let s = Settings::resolve(
            env(&[
                ("CATTLE_REMOTE_ENABLED", "false"),
                ("CATTLE_LOCAL_ENABLED", "true"),
                ("CATTLE_AGENT_BIN_PREFIX", "/opt/x"),
            ]),
            &Flags { root: Some("/tmp/tree".into()), ..Flags::default() },
        )
        .unwrap();
        assert_eq!(s.source, Source::Local);
        assert!(s.local_enabled && !s.is_host());
        assert_eq!(s.bin_prefix, Some(PathBuf::from("/opt/x")));
        let s = Settings::resolve(
            env(&[("CATTLE_AGENT_BINARY_LOCAL", "true"), ("CATTLE_AGENT_BINARY_LOCAL_LOCATION", "/tmp/np")]),
            &Flags { local: true, ..Flags::default() },
        )
        .unwrap();
        assert_eq!(s.binary, Some(PathBuf::from("/tmp/np")));
    }
}
