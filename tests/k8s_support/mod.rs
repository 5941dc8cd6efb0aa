//! A real Kubernetes control plane for integration tests: etcd + kube-apiserver on loopback, in a
//! temp dir, reached over HTTPS with a `system:masters` bearer token. Two versions are tested: 1.20.2
//! (built by `tools/build-kube-apiserver.sh` from Debian's source package, etcd 3.4) and the current
//! release (built by `tools/build-kube-apiserver-current.sh` from the Go module proxy, etcd 3.7);
//! `tools/test.sh` runs every test binary that uses this module against both.
//!
//! Owns: the etcd and kube-apiserver child processes it spawns (by pid, never by name), their
//! temp dir (data, certs, logs, kubeconfig), and the loud skip/fail policy when the binaries are
//! missing. It must not touch anything else: no global kubeconfig, no `KUBECONFIG` env, no
//! processes it did not start.
//!
//! Binaries: `$NODEPLAN_K8S_BIN`, else `/var/tmp/nodeplan-k8s/bin` if it exists. When they are
//! missing, [`ControlPlane::start`] / [`ControlPlane::shared`] print a loud `*** SKIPPED ... ***`
//! line (straight to stderr, past libtest's capture) and return `None`; with `NODEPLAN_CI` set
//! they panic instead, so CI never skips silently. Custom-resource tests use
//! [`ControlPlane::shared_for_custom_resources`], which also needs `kubectl` beside the apiserver
//! ([`ControlPlane::kubectl`]) and, for a 1.20 cache, its `recipe` stamp to be
//! [`CUSTOM_RESOURCE_RECIPE`] or later.
//!
//! Versions: [`k8s_version`] asks the cache's `kube-apiserver --version` (once per test binary);
//! [`ControlPlane::version`] is it. Both versions get the same flags (none was removed by 1.24+:
//! no `--insecure-port`; the service-account issuer and keys 1.20 already required) but one: the
//! current release also gets `--endpoint-reconciler-type=none`, as it refuses to publish the
//! loopback advertise address as the `kubernetes` Service's endpoint. A test whose expectation
//! depends on the version asks [`ControlPlane::version`] and says why.
//!
//! Sharing: a start (RSA key, etcd, apiserver up to `/readyz` = ok) measured 3.3-4.0 s on a
//! 2-core machine and costs ~350 MB, so a test binary shares one control plane
//! ([`ControlPlane::shared`]) and gives every test its own namespace
//! ([`ControlPlane::new_namespace`]). Tests that stop/start the apiserver take their own
//! ([`ControlPlane::start`]). Each test builds its own [`ControlPlane::client`]: a client's
//! pooled connections belong to the tokio runtime that opened them.
//!
//! Cleanup, in layers:
//! 1. `Drop` SIGKILLs the apiserver, then etcd, by pid, reaps them, and removes the temp dir.
//! 2. The shared control plane lives in a `static` and is never dropped: a `libc::atexit` hook
//!    SIGKILLs and reaps every child still registered and removes the temp dirs when the test
//!    binary exits (normally or after a failed test).
//! 3. If the test binary is killed outright (SIGKILL, so neither runs), each child has a tiny
//!    `sh` watchdog that polls the test process's pid once a second and SIGKILLs the child (and
//!    removes the temp dir) when the test process is gone. `PR_SET_PDEATHSIG` is deliberately not
//!    used: it fires when the spawning *thread* exits, and test threads come and go.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

/// Bounded wait for the apiserver to answer `/readyz` with `ok`.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// Interval of the bounded readiness poll.
const READY_POLL: Duration = Duration::from_millis(100);
/// The bearer token the apiserver accepts (group `system:masters`); loopback only.
const TOKEN: &str = "nodeplan-test-token";
/// A second user, with no group and so no permission beyond what [`ControlPlane::grant_agent`]
/// grants in a namespace: an agent whose writes can be refused while its watch goes on.
pub const AGENT_USER: &str = "nodeplan-agent";
const AGENT_TOKEN: &str = "nodeplan-agent-token";
/// The agents of two nodes under the identity convention of the NodePlan status-writer policy
/// (`nodeplan:node:<node>`, `deploy/nodeplan-status-policy.yaml`), with their tokens: no group,
/// and no permission beyond what a test grants ([`ControlPlane::client_as`]).
pub const NODE_AGENTS: [(&str, &str); 2] =
    [("nodeplan:node:node-a", "node-a-agent-token"), ("nodeplan:node:node-b", "node-b-agent-token")];
const DEFAULT_BIN: &str = "/var/tmp/nodeplan-k8s/bin";

// ---------------------------------------------------------------------------------------------
// Process bookkeeping for the atexit hook.

#[derive(Default)]
struct Registry {
    pids: Vec<u32>,
    dirs: Vec<PathBuf>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry { pids: Vec::new(), dirs: Vec::new() });
static ATEXIT: Once = Once::new();

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

extern "C" fn kill_registered_at_exit() {
    let mut reg = registry();
    // Reverse order of spawning: watchdogs and apiservers before etcd.
    for pid in reg.pids.drain(..).rev() {
        let pid = pid as libc::pid_t;
        // SAFETY: plain syscalls on pids this process spawned and has not reaped.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
    }
    for dir in reg.dirs.drain(..) {
        let _ = fs::remove_dir_all(dir);
    }
}

fn install_atexit() {
    ATEXIT.call_once(|| {
        // SAFETY: registering a plain `extern "C" fn()`.
        let rc = unsafe { libc::atexit(kill_registered_at_exit) };
        assert_eq!(rc, 0, "atexit registration failed");
    });
}

/// A child process plus the watchdog that kills it if the test process disappears.
struct Proc {
    name: &'static str,
    child: Child,
    watchdog: Option<Child>,
}

impl Proc {
    fn spawn(name: &'static str, mut cmd: Command, log: &Path, cleanup_dir: Option<&Path>) -> Proc {
        install_atexit();
        let log_file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap_or_else(|e| panic!("open {}: {e}", log.display()));
        let log_err = log_file.try_clone().unwrap_or_else(|e| panic!("dup log fd: {e}"));
        cmd.stdin(Stdio::null()).stdout(log_file).stderr(log_err);
        let mut reg = registry();
        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        reg.pids.push(child.id());
        let watchdog = Command::new("sh")
            .arg("-c")
            .arg(r#"while kill -0 "$1" 2>/dev/null; do sleep 1; done; kill -9 "$2" 2>/dev/null; [ -n "$3" ] && rm -rf "$3"; exit 0"#)
            .arg("nodeplan-k8s-watchdog")
            .arg(std::process::id().to_string())
            .arg(child.id().to_string())
            .arg(cleanup_dir.map(|d| d.display().to_string()).unwrap_or_default())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok();
        if let Some(w) = &watchdog {
            reg.pids.push(w.id());
        }
        Proc { name, child, watchdog }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Has it exited already? Returns the exit status text.
    fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            Ok(None) => None,
            Err(e) => Some(format!("wait failed: {e}")),
        }
    }

    /// SIGKILL the watchdog then the child, and reap both.
    fn kill(&mut self) {
        let mut reg = registry();
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
            reg.pids.retain(|p| *p != w.id());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        reg.pids.retain(|p| *p != self.child.id());
    }
}

// ---------------------------------------------------------------------------------------------
// Binaries and the skip policy.

/// Print straight to the process's stderr: libtest captures `eprintln!` of passing tests, and a
/// skip must be seen.
pub fn loud(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

fn k8s_bin() -> Option<PathBuf> {
    let dir = match std::env::var_os("NODEPLAN_K8S_BIN") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(DEFAULT_BIN),
    };
    let missing: Vec<&str> = ["etcd", "kube-apiserver"].into_iter().filter(|b| !dir.join(b).is_file()).collect();
    if missing.is_empty() {
        return Some(dir);
    }
    skip(&format!(
        "real kube-apiserver tests need {} in {} (set NODEPLAN_K8S_BIN; build with tools/build-kube-apiserver.sh \
         or tools/build-kube-apiserver-current.sh)",
        missing.join(" and "),
        dir.display()
    ))
}

/// The loud skip (None) outside CI; a panic with `NODEPLAN_CI` set.
fn skip<T>(need: &str) -> Option<T> {
    if std::env::var_os("NODEPLAN_CI").is_some() {
        panic!("NODEPLAN_CI is set, so these tests must not skip: {need}");
    }
    let test = std::thread::current().name().unwrap_or("?").to_string();
    loud(&format!("*** SKIPPED {test}: {need} ***"));
    None
}

/// The first recipe of `tools/build-kube-apiserver.sh` whose cache serves custom resources (its
/// kube-apiserver has Debian's reflect2 1.0.2; recipe 1's dies with SIGSEGV on the first custom
/// resource create) and holds `kubectl`. Only 1.20 caches have numbered recipes; the current
/// version's cache (`tools/build-kube-apiserver-current.sh`) never had the crash.
pub const CUSTOM_RESOURCE_RECIPE: u32 = 2;

/// The build recipe of the 1.20 cache `bin` belongs to: `bin/../recipe`, written by
/// `tools/build-kube-apiserver.sh`. A cache without the stamp predates it (recipe 1).
fn recipe_of(bin: &Path) -> u32 {
    bin.parent()
        .and_then(|cache| fs::read_to_string(cache.join("recipe")).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(1)
}

/// The version of a cache's kube-apiserver, from `kube-apiserver --version` (`Kubernetes v1.37.2`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct K8sVersion {
    pub major: u32,
    pub minor: u32,
    /// As the binary says it, e.g. `v1.20.2`.
    pub git: String,
}

impl K8sVersion {
    /// Parse `kube-apiserver --version`'s output.
    pub fn parse(out: &str) -> Option<K8sVersion> {
        let git = out.split_whitespace().find(|w| w.starts_with('v'))?.to_string();
        let mut parts = git.trim_start_matches('v').split('.');
        let major = parts.next()?.parse().ok()?;
        let minor: String = parts.next()?.chars().take_while(char::is_ascii_digit).collect();
        Some(K8sVersion { major, minor: minor.parse().ok()?, git })
    }

    /// At least `major.minor`?
    pub fn at_least(&self, major: u32, minor: u32) -> bool {
        (self.major, self.minor) >= (major, minor)
    }
}

impl std::fmt::Display for K8sVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.git)
    }
}

/// The version of the kube-apiserver in `bin`, asked once per test binary (the cache does not
/// change under a running test binary: a rebuild swaps in a new directory). Panics when the
/// binary cannot say: every other test would fail less clearly.
pub fn k8s_version(bin: &Path) -> K8sVersion {
    static VERSION: std::sync::OnceLock<(PathBuf, K8sVersion)> = std::sync::OnceLock::new();
    let (asked, version) = VERSION.get_or_init(|| {
        let exe = bin.join("kube-apiserver");
        let out = Command::new(&exe)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run {} --version: {e}", exe.display()));
        let text = String::from_utf8_lossy(&out.stdout);
        let version = K8sVersion::parse(&text)
            .unwrap_or_else(|| panic!("{} --version said {text:?}, not `Kubernetes vX.Y.Z`", exe.display()));
        (bin.to_path_buf(), version)
    });
    assert_eq!(asked, bin, "one test binary, one kube-apiserver cache");
    version.clone()
}

/// The cache's binaries and that they can serve custom resources (`kubectl`, and the recipe of a
/// 1.20 cache), or None after the loud skip (a panic in CI).
fn custom_resource_bin() -> Option<PathBuf> {
    let bin = k8s_bin()?;
    let recipe = recipe_of(&bin);
    if !k8s_version(&bin).at_least(1, 21) && recipe < CUSTOM_RESOURCE_RECIPE {
        return skip(&format!(
            "custom-resource tests need a kube-apiserver cache of recipe {CUSTOM_RESOURCE_RECIPE} or later, and {} is \
             recipe {recipe} (its kube-apiserver crashes on the first custom resource): rebuild it with \
             tools/build-kube-apiserver.sh",
            bin.display()
        ));
    }
    if !bin.join("kubectl").is_file() {
        return skip(&format!(
            "custom-resource tests need kubectl in {} (build with tools/build-kube-apiserver.sh)",
            bin.display()
        ));
    }
    Some(bin)
}

/// N distinct free loopback ports, chosen at random *below* the kernel's ephemeral range
/// (`ip_local_port_range`): a port the kernel hands out for outgoing connections (the apiserver's
/// own connections to etcd, other tests' clients) could otherwise be taken between this choice
/// and the server's bind, or while an apiserver restarts on the same port. Falls back to port 0
/// when the range leaves no room below it.
fn free_ports<const N: usize>() -> [u16; N] {
    let low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|w| w.parse::<u32>().ok()))
        .unwrap_or(32768);
    let (min, max) = (10_000u32, low.saturating_sub(1));
    // Hold all listeners until every port is chosen so the N ports are distinct.
    let mut listeners: Vec<std::net::TcpListener> = Vec::new();
    let mut seed = (std::process::id() as u64) << 32
        ^ std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1);
    for _ in 0..1000 {
        if listeners.len() == N || max <= min {
            break;
        }
        // xorshift64: good enough to spread concurrent test binaries over the range.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let port = min + (seed % u64::from(max - min)) as u32;
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port as u16)) {
            listeners.push(l);
        }
    }
    while listeners.len() < N {
        listeners.push(std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind 127.0.0.1:0: {e}")));
    }
    let mut out = [0u16; N];
    for (slot, l) in out.iter_mut().zip(&listeners) {
        *slot = l.local_addr().unwrap_or_else(|e| panic!("local_addr: {e}")).port();
    }
    out
}

fn tail(path: &Path, lines: usize) -> String {
    match fs::read_to_string(path) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}

fn run_checked(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The CA certificate: the second PEM block of the apiserver's self-signed `apiserver.crt`
/// (leaf first, then its CA). `None` until the file is completely written.
fn ca_from_cert_file(path: &Path) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if line.starts_with("-----BEGIN CERTIFICATE-----") {
            current = Some(String::new());
        }
        if let Some(block) = current.as_mut() {
            block.push_str(line);
            block.push('\n');
        }
        if line.starts_with("-----END CERTIFICATE-----") {
            blocks.extend(current.take());
        }
    }
    if blocks.len() >= 2 { blocks.into_iter().nth(1) } else { None }
}

// ---------------------------------------------------------------------------------------------

static NS_COUNTER: AtomicU64 = AtomicU64::new(0);
static SHARED: tokio::sync::OnceCell<Option<ControlPlane>> = tokio::sync::OnceCell::const_new();

pub struct ControlPlane {
    dir: PathBuf,
    bin: PathBuf,
    etcd_url: String,
    port: u16,
    etcd: Option<Proc>,
    apiserver: Option<Proc>,
    ca_pem: String,
    started_in: Duration,
    /// Whether the API server writes an audit log (`audit.log`, [`ControlPlane::audited`]).
    audit: bool,
}

/// One request the API server answered, from its audit log.
#[derive(Debug, Clone)]
pub struct Audited {
    pub verb: String,
    pub resource: String,
    pub namespace: String,
    pub name: String,
    pub user_agent: String,
    pub code: i64,
}

impl ControlPlane {
    /// Start etcd and kube-apiserver on free loopback ports in a temp dir and wait (at most
    /// 60 s) until `/readyz` says `ok`. Returns None (after the loud skip message) when the
    /// binaries are missing outside CI; panics with the logs' tails if the start fails.
    pub async fn start() -> Option<ControlPlane> {
        ControlPlane::start_with(false).await
    }

    /// [`ControlPlane::start`] with an audit log of every request but the API server's own
    /// ([`ControlPlane::audited`]): what a client asked of it, counted.
    pub async fn start_audited() -> Option<ControlPlane> {
        ControlPlane::start_with(true).await
    }

    async fn start_with(audit: bool) -> Option<ControlPlane> {
        let bin = k8s_bin()?;
        let t0 = Instant::now();
        let dir = tempfile::Builder::new()
            .prefix("nodeplan-k8s-")
            .tempdir()
            .unwrap_or_else(|e| panic!("temp dir: {e}"))
            .keep();
        registry().dirs.push(dir.clone());
        for sub in ["certs", "etcd"] {
            fs::create_dir_all(dir.join(sub)).unwrap_or_else(|e| panic!("mkdir {sub}: {e}"));
        }
        run_checked(Command::new("openssl").args(["genrsa", "-out"]).arg(dir.join("sa.key")).arg("2048"));
        run_checked(
            Command::new("openssl")
                .args(["rsa", "-pubout", "-in"])
                .arg(dir.join("sa.key"))
                .arg("-out")
                .arg(dir.join("sa.pub")),
        );
        let mut tokens = format!("{TOKEN},admin,admin-uid,system:masters\n{AGENT_TOKEN},{AGENT_USER},agent-uid\n");
        for (i, (user, token)) in NODE_AGENTS.iter().enumerate() {
            tokens.push_str(&format!("{token},{user},node-agent-uid-{i}\n"));
        }
        fs::write(dir.join("tokens.csv"), tokens).unwrap_or_else(|e| panic!("write tokens.csv: {e}"));

        let mut cp = ControlPlane {
            dir,
            bin,
            etcd_url: String::new(),
            port: 0,
            etcd: None,
            apiserver: None,
            ca_pem: String::new(),
            started_in: Duration::ZERO,
            audit,
        };
        if audit {
            let policy = "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n\
                          - level: None\n  users: [\"system:apiserver\"]\n\
                          - level: None\n  nonResourceURLs: [\"/readyz*\", \"/healthz*\", \"/livez*\"]\n\
                          - level: Metadata\n";
            fs::write(cp.dir.join("audit-policy.yaml"), policy).unwrap_or_else(|e| panic!("write audit policy: {e}"));
        }
        // Another process may still bind a chosen port first; then start over on new ports.
        for attempt in 1.. {
            let why = match cp.launch().await {
                Ok(()) => break,
                Err(why) => why,
            };
            let in_use = ["apiserver.log", "etcd.log"]
                .iter()
                .any(|l| fs::read_to_string(cp.dir.join(l)).is_ok_and(|t| t.contains("address already in use")));
            if !in_use || attempt == 3 {
                cp.fail(&why);
            }
            loud(&format!("k8s_support: a port was taken ({why}); starting again on other ports"));
            cp.kill_all();
            for (f, keep) in [("apiserver.log", "apiserver"), ("etcd.log", "etcd")] {
                let _ = fs::rename(cp.dir.join(f), cp.dir.join(format!("{keep}.attempt{attempt}.log")));
            }
            let _ = fs::remove_dir_all(cp.dir.join("etcd"));
            fs::create_dir_all(cp.dir.join("etcd")).unwrap_or_else(|e| panic!("mkdir etcd: {e}"));
        }
        cp.started_in = t0.elapsed();
        Some(cp)
    }

    /// Start etcd and the apiserver on fresh ports and wait until ready.
    async fn launch(&mut self) -> Result<(), String> {
        let [etcd_port, peer_port, port] = free_ports::<3>();
        self.etcd_url = format!("http://127.0.0.1:{etcd_port}");
        self.port = port;
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let etcd_url = &self.etcd_url;
        let mut etcd = Command::new(self.bin.join("etcd"));
        etcd.arg("--name=default")
            .arg(format!("--data-dir={}", self.dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={etcd_url}"))
            .arg(format!("--advertise-client-urls={etcd_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=default={peer_url}"));
        self.etcd = Some(Proc::spawn("etcd", etcd, &self.dir.join("etcd.log"), Some(&self.dir)));
        self.spawn_apiserver();
        self.wait_ready().await
    }

    fn kill_all(&mut self) {
        if let Some(mut p) = self.apiserver.take() {
            p.kill();
        }
        if let Some(mut p) = self.etcd.take() {
            p.kill();
        }
    }

    /// The control plane shared by all tests of this test binary (started on first use; killed
    /// at process exit by the atexit hook). Never stop its apiserver: use [`ControlPlane::start`]
    /// for that. Returns None (after the loud skip message) when the binaries are missing.
    pub async fn shared() -> Option<&'static ControlPlane> {
        let already_tried = SHARED.initialized();
        let cp = SHARED
            .get_or_init(|| async {
                let cp = ControlPlane::start().await;
                if let Some(cp) = &cp {
                    loud(&format!(
                        "k8s_support: shared control plane (kube-apiserver {}) ready in {:?} at {}",
                        cp.version(),
                        cp.started_in,
                        cp.dir.display()
                    ));
                }
                cp
            })
            .await
            .as_ref();
        if cp.is_none() && already_tried {
            // Repeat the skip for every test that wanted it (the first one printed it in start).
            let _ = k8s_bin();
        }
        cp
    }

    /// [`ControlPlane::shared`], for tests of custom resources: also requires a cache whose
    /// kube-apiserver serves them and that holds `kubectl` (see [`CUSTOM_RESOURCE_RECIPE`]), with
    /// the same loud skip outside CI and failure in CI.
    pub async fn shared_for_custom_resources() -> Option<&'static ControlPlane> {
        custom_resource_bin()?;
        ControlPlane::shared().await
    }

    /// [`ControlPlane::start`] (a control plane of the test's own, e.g. to restart its apiserver),
    /// for tests of custom resources: the same checks and loud skip as
    /// [`ControlPlane::shared_for_custom_resources`].
    pub async fn start_for_custom_resources() -> Option<ControlPlane> {
        custom_resource_bin()?;
        ControlPlane::start().await
    }

    /// `kubectl` from the same cache, aimed at this apiserver: `--kubeconfig` is this control
    /// plane's, its discovery/HTTP cache and `HOME` are in the temp dir, and `KUBECONFIG` is
    /// removed, so it reads and writes nothing outside. The cache's kubectl is the one built
    /// with the apiserver (of the same version); get it through [`ControlPlane::shared_for_custom_resources`],
    /// which checks it is there.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(self.bin.join("kubectl"));
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig_path().display()))
            .arg(format!("--cache-dir={}", self.dir.join("kubectl-cache").display()))
            .env_remove("KUBECONFIG")
            .env("HOME", &self.dir)
            .stdin(Stdio::null());
        cmd
    }

    /// The last `lines` lines of the apiserver's log, for failure messages (a crash shows there).
    pub fn apiserver_log_tail(&self, lines: usize) -> String {
        tail(&self.dir.join("apiserver.log"), lines)
    }

    /// The version of this control plane's kube-apiserver ([`k8s_version`]).
    pub fn version(&self) -> K8sVersion {
        k8s_version(&self.bin)
    }

    /// How long `start()` took, from the temp dir to `/readyz` = ok.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    pub fn server_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A self-contained kubeconfig (CA embedded as `certificate-authority-data`, bearer token).
    pub fn kubeconfig_yaml(&self) -> String {
        self.kubeconfig_yaml_with_ca(&self.ca_pem)
    }

    /// The kubeconfig with another CA (PEM) in place of the apiserver's, e.g. to prove that
    /// verification is strict.
    pub fn kubeconfig_yaml_with_ca(&self, ca_pem: &str) -> String {
        self.kubeconfig(ca_pem, TOKEN)
    }

    /// The requests answered so far in `namespace` whose `User-Agent` begins with `agent` (a
    /// control plane from [`ControlPlane::start_audited`]; the log is written as each request
    /// completes). A watch or a list is one request each; a watch appears once it has ended.
    pub fn audited(&self, namespace: &str, agent: &str) -> Vec<Audited> {
        assert!(self.audit, "audited() needs ControlPlane::start_audited()");
        let text = fs::read_to_string(self.dir.join("audit.log")).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|e| e["stage"] == "ResponseComplete")
            .map(|e| {
                let s = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
                Audited {
                    verb: s(&e["verb"]),
                    resource: s(&e["objectRef"]["resource"]),
                    namespace: s(&e["objectRef"]["namespace"]),
                    name: s(&e["objectRef"]["name"]),
                    user_agent: s(&e["userAgent"]),
                    code: e["responseStatus"]["code"].as_i64().unwrap_or_default(),
                }
            })
            .filter(|a| a.namespace == namespace && a.user_agent.starts_with(agent))
            .collect()
    }

    /// The kubeconfig of [`AGENT_USER`].
    pub fn kubeconfig_yaml_as_agent(&self) -> String {
        self.kubeconfig(&self.ca_pem, AGENT_TOKEN)
    }

    fn kubeconfig(&self, ca_pem: &str, token: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: admin\n  user:\n    token: {token}\ncontexts:\n- name: local\n  context:\n    cluster: local\n    user: admin\n    namespace: default\ncurrent-context: local\n",
            server = self.server_url(),
            ca = b64(ca_pem.as_bytes()),
        )
    }

    /// A client as [`AGENT_USER`].
    pub async fn agent_client(&self) -> kube::Client {
        client_from_yaml(&self.kubeconfig_yaml_as_agent()).await.unwrap_or_else(|e| panic!("agent kube client: {e}"))
    }

    /// The kubeconfig of `user`, one of [`NODE_AGENTS`].
    pub fn kubeconfig_yaml_as(&self, user: &str) -> String {
        let (_, token) = NODE_AGENTS.iter().find(|(u, _)| *u == user).unwrap_or_else(|| panic!("no token for {user}"));
        self.kubeconfig(&self.ca_pem, token)
    }

    /// A client as `user`, one of [`NODE_AGENTS`].
    pub async fn client_as(&self, user: &str) -> kube::Client {
        client_from_yaml(&self.kubeconfig_yaml_as(user)).await.unwrap_or_else(|e| panic!("{user}'s client: {e}"))
    }

    /// Apply the NodePlan status-writer policy (`nodeplan crd --admission-policy`, cluster-wide;
    /// the NodePlan definition installed first) and wait (bounded) until it is in force: the API
    /// server takes a binding up asynchronously, so the agent of node-b, granted status writes in
    /// `namespace` (a Role `status-writers` bound to both [`NODE_AGENTS`]), writes the status of a
    /// NodePlan `policy-canary` of node-a until the policy denies it. Returns the NodePlans of
    /// `namespace` as the admin.
    pub async fn install_status_policy(&self, namespace: &str) -> Api<kube::api::DynamicObject> {
        use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
        use kube::api::{DynamicObject, Patch, PatchParams};
        self.install_nodeplan_crd().await;
        let policy = Command::new(env!("CARGO_BIN_EXE_nodeplan"))
            .args(["crd", "--admission-policy"])
            .output()
            .unwrap_or_else(|e| panic!("nodeplan crd --admission-policy: {e}"));
        assert!(
            policy.status.success(),
            "nodeplan crd --admission-policy: {}",
            String::from_utf8_lossy(&policy.stderr)
        );
        let mut kubectl = self
            .kubectl()
            .args(["apply", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("kubectl: {e}"));
        if let Some(mut stdin) = kubectl.stdin.take() {
            stdin.write_all(&policy.stdout).unwrap_or_else(|e| panic!("write to kubectl: {e}"));
        }
        let out = kubectl.wait_with_output().unwrap_or_else(|e| panic!("kubectl: {e}"));
        assert!(out.status.success(), "kubectl apply of the policy: {}", String::from_utf8_lossy(&out.stderr));

        let client = self.client().await;
        let pp = PostParams::default();
        let role: Role = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "status-writers", "namespace": namespace},
            "rules": [{"apiGroups": ["agent.cattle.io"], "resources": ["nodeplans", "nodeplans/status"], "verbs": ["get"]},
                      {"apiGroups": ["agent.cattle.io"], "resources": ["nodeplans/status"], "verbs": ["update", "patch"]}],
        }))
        .unwrap_or_else(|e| panic!("role: {e}"));
        Api::<Role>::namespaced(client.clone(), namespace).create(&pp, &role).await.unwrap_or_else(|e| panic!("{e}"));
        let subjects: Vec<_> = NODE_AGENTS
            .iter()
            .map(|(user, _)| serde_json::json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}))
            .collect();
        let binding: RoleBinding = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "status-writers", "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "status-writers"},
            "subjects": subjects,
        }))
        .unwrap_or_else(|e| panic!("binding: {e}"));
        Api::<RoleBinding>::namespaced(client.clone(), namespace)
            .create(&pp, &binding)
            .await
            .unwrap_or_else(|e| panic!("{e}"));

        let resource = nodeplan::nodeplan::resource::api_resource();
        let api: Api<DynamicObject> = Api::namespaced_with(client, namespace, &resource);
        let canary: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "agent.cattle.io/v1alpha1", "kind": "NodePlan",
            "metadata": {"name": "policy-canary", "labels": {"cattle.io/node": "node-a"}},
            "spec": {"nodeName": "node-a", "plan": {"instructions": []}},
        }))
        .unwrap_or_else(|e| panic!("canary: {e}"));
        api.create(&pp, &canary).await.unwrap_or_else(|e| panic!("create the canary: {e}"));
        let as_b: Api<DynamicObject> =
            Api::namespaced_with(self.client_as(NODE_AGENTS[1].0).await, namespace, &resource);
        let write = Patch::Merge(serde_json::json!({"status": {"phase": "Applied"}}));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match as_b.patch_status("policy-canary", &PatchParams::default(), &write).await {
                Err(kube::Error::Api(s))
                    if s.code == 403 && s.message.contains("ValidatingAdmissionPolicy 'nodeplan-status-writer'") =>
                {
                    return api;
                }
                other => assert!(
                    Instant::now() < deadline,
                    "the status-writer policy never denied {} within 30 s: last answer {:?}",
                    NODE_AGENTS[1].0,
                    other.map(|o| o.data.get("status").cloned())
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Let [`AGENT_USER`] do `verbs` on the Secrets of `namespace` (and nothing else): a Role and
    /// its RoleBinding, replaced on every call. The authorizer picks a change up asynchronously.
    pub async fn grant_agent(&self, namespace: &str, verbs: &[&str]) {
        use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
        use kube::api::{Patch, PatchParams};
        let client = self.client().await;
        let pp = PatchParams::apply("nodeplan-tests").force();
        let role = serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": AGENT_USER, "namespace": namespace},
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": verbs}],
        });
        Api::<Role>::namespaced(client.clone(), namespace)
            .patch(AGENT_USER, &pp, &Patch::Apply(&role))
            .await
            .unwrap_or_else(|e| panic!("role {namespace}/{AGENT_USER}: {e}"));
        let binding = serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": AGENT_USER, "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": AGENT_USER},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": AGENT_USER}],
        });
        Api::<RoleBinding>::namespaced(client, namespace)
            .patch(AGENT_USER, &pp, &Patch::Apply(&binding))
            .await
            .unwrap_or_else(|e| panic!("role binding {namespace}/{AGENT_USER}: {e}"));
    }

    /// Bind [`AGENT_USER`] to the Role `role` of `namespace` (created by the caller).
    pub async fn bind_agent(&self, namespace: &str, role: &str) {
        use k8s_openapi::api::rbac::v1::RoleBinding;
        use kube::api::{Patch, PatchParams};
        let binding = serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": format!("{AGENT_USER}-{role}"), "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": AGENT_USER}],
        });
        let pp = PatchParams::apply("nodeplan-tests").force();
        Api::<RoleBinding>::namespaced(self.client().await, namespace)
            .patch(&format!("{AGENT_USER}-{role}"), &pp, &Patch::Apply(&binding))
            .await
            .unwrap_or_else(|e| panic!("role binding {namespace}/{role}: {e}"));
    }

    /// The same kubeconfig, written in the temp dir.
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }

    /// A fresh client (one per test: a client's pooled connections belong to the tokio runtime
    /// that made them, and every `#[tokio::test]` has its own runtime).
    pub async fn client(&self) -> kube::Client {
        client_from_yaml(&self.kubeconfig_yaml()).await.unwrap_or_else(|e| panic!("test kube client: {e}"))
    }

    /// Create a namespace with a unique name starting with `prefix`; returns its name.
    pub async fn new_namespace(&self, prefix: &str) -> String {
        let n = NS_COUNTER.fetch_add(1, Ordering::Relaxed);
        let clean: String = prefix
            .chars()
            .map(|c| c.to_ascii_lowercase())
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .take(40)
            .collect();
        let name = format!("{}-{}-{n}", clean.trim_matches('-'), std::process::id());
        let mut ns = Namespace::default();
        ns.metadata.name = Some(name.clone());
        Api::<Namespace>::all(self.client().await)
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
        name
    }

    /// Kill the apiserver by pid (SIGKILL) and wait for it to exit; etcd stays.
    pub async fn stop_apiserver(&mut self) {
        if let Some(mut p) = self.apiserver.take() {
            // SIGKILL, then a blocking reap that takes milliseconds.
            p.kill();
        }
    }

    /// Start the apiserver again on the same port with the same certs and etcd; wait ready.
    pub async fn start_apiserver(&mut self) {
        self.spawn_apiserver();
        if let Err(why) = self.wait_ready().await {
            self.fail(&why);
        }
    }

    fn spawn_apiserver(&mut self) {
        assert!(self.apiserver.is_none(), "apiserver already running");
        let d = &self.dir;
        let mut cmd = Command::new(self.bin.join("kube-apiserver"));
        cmd.arg(format!("--etcd-servers={}", self.etcd_url))
            .arg(format!("--secure-port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg("--advertise-address=127.0.0.1")
            .arg(format!("--cert-dir={}", d.join("certs").display()))
            .arg(format!("--token-auth-file={}", d.join("tokens.csv").display()))
            .arg("--authorization-mode=RBAC")
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg(format!("--service-account-key-file={}", d.join("sa.pub").display()))
            .arg(format!("--service-account-signing-key-file={}", d.join("sa.key").display()))
            .arg("--service-cluster-ip-range=10.0.0.0/24")
            .arg("--disable-admission-plugins=ServiceAccount");
        if self.audit {
            cmd.arg(format!("--audit-log-path={}", d.join("audit.log").display()))
                .arg(format!("--audit-policy-file={}", d.join("audit-policy.yaml").display()))
                .arg("--audit-log-mode=blocking");
        }
        if self.version().at_least(1, 21) {
            // The current release refuses a loopback advertise address for the `kubernetes`
            // Service's endpoints ("cannot use public IP 127.0.0.1 with endpoint reconciler ...
            // may not be in the loopback range") and exits; 1.20 publishes it. Nothing here reads
            // those endpoints, so the current release reconciles none.
            cmd.arg("--endpoint-reconciler-type=none");
        }
        self.apiserver = Some(Proc::spawn("kube-apiserver", cmd, &d.join("apiserver.log"), None));
    }

    async fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut client: Option<kube::Client> = None;
        let mut last = String::from("no attempt yet");
        loop {
            let exited = self.apiserver.as_mut().and_then(Proc::exited).map(|s| format!("kube-apiserver exited: {s}"));
            let etcd_exited = self.etcd.as_mut().and_then(Proc::exited).map(|s| format!("etcd exited: {s}"));
            if let Some(why) = exited.or(etcd_exited) {
                return Err(why);
            }
            if Instant::now() > deadline {
                return Err(format!("not ready within {READY_TIMEOUT:?}; last: {last}"));
            }
            if client.is_none() {
                // The apiserver writes its self-signed cert at startup; the CA is the 2nd block.
                if let Some(ca) = ca_from_cert_file(&self.dir.join("certs/apiserver.crt")) {
                    self.ca_pem = ca;
                    let yaml = self.kubeconfig_yaml();
                    fs::write(self.kubeconfig_path(), &yaml).unwrap_or_else(|e| panic!("write kubeconfig: {e}"));
                    match client_from_yaml(&yaml).await {
                        Ok(c) => client = Some(c),
                        Err(e) => last = e,
                    }
                } else {
                    last = "certs/apiserver.crt not written yet".into();
                }
            }
            if let Some(c) = &client {
                let req = http::Request::get("/readyz").body(Vec::new());
                match req {
                    Ok(req) => match tokio::time::timeout(Duration::from_secs(5), c.request_text(req)).await {
                        Ok(Ok(body)) if body.trim() == "ok" => return Ok(()),
                        Ok(Ok(body)) => last = format!("/readyz said {body:?}"),
                        Ok(Err(e)) => last = format!("/readyz: {e}"),
                        Err(_) => last = "/readyz: no answer within 5 s".into(),
                    },
                    Err(e) => return Err(format!("build /readyz request: {e}")),
                }
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }

    fn fail(&mut self, why: &str) -> ! {
        let api_log = tail(&self.dir.join("apiserver.log"), 40);
        let etcd_log = tail(&self.dir.join("etcd.log"), 15);
        panic!(
            "control plane in {} failed: {why}\n--- apiserver.log (tail) ---\n{api_log}\n--- etcd.log (tail) ---\n{etcd_log}",
            self.dir.display()
        );
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.kill_all();
        registry().dirs.retain(|d| d != &self.dir);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl ControlPlane {
    /// Install the NodePlan CRD (`deploy/nodeplan-crd.yaml`) through this control plane's API (one
    /// already there is a conflict, fine) and wait (bounded) until NodePlans are served (a list of
    /// them answers). Not cached: a test may run its own control plane.
    pub async fn install_nodeplan_crd(&self) {
        use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
        const WAIT: Duration = Duration::from_secs(30);
        let crds: Api<CustomResourceDefinition> = Api::all(self.client().await);
        let crd: CustomResourceDefinition = serde_yaml_ng::from_str(nodeplan::nodeplan::resource::CRD_YAML)
            .unwrap_or_else(|e| panic!("the CRD does not parse: {e}"));
        match crds.create(&PostParams::default(), &crd).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("cannot install the CRD: {e}"),
        }
        let np: Api<kube::api::DynamicObject> =
            Api::all_with(self.client().await, &nodeplan::nodeplan::source::api_resource());
        let deadline = Instant::now() + WAIT;
        while np.list(&Default::default()).await.is_err() {
            assert!(Instant::now() < deadline, "NodePlans are never served");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// kube client from kubeconfig text, ignoring any proxy settings (the server is on loopback).
async fn client_from_yaml(yaml: &str) -> Result<kube::Client, String> {
    let kubeconfig = Kubeconfig::from_yaml(yaml).map_err(|e| e.to_string())?;
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    config.proxy_url = None;
    kube::Client::try_from(config).map_err(|e| e.to_string())
}

/// A fresh self-signed CA certificate (PEM) that signed nothing the apiserver serves; written
/// under `dir`.
/// The Events (`events.k8s.io/v1`) in `namespace` regarding the object `name`: (reason, note,
/// series count).
pub async fn events_regarding(client: &kube::Client, namespace: &str, name: &str) -> Vec<(String, String, i64)> {
    use kube::api::DynamicObject;
    let gvk = kube::core::GroupVersionKind::gvk("events.k8s.io", "v1", "Event");
    let ar = kube::api::ApiResource::from_gvk_with_plural(&gvk, "events");
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &ar);
    let list = api.list(&Default::default()).await.unwrap_or_else(|e| panic!("list events in {namespace}: {e}"));
    list.items
        .iter()
        .filter(|e| e.data.pointer("/regarding/name").and_then(|v| v.as_str()) == Some(name))
        .map(|e| {
            let text = |p: &str| e.data.pointer(p).and_then(|v| v.as_str()).unwrap_or_default().to_string();
            let count = e.data.pointer("/series/count").and_then(|v| v.as_i64()).unwrap_or(1);
            (text("/reason"), text("/note"), count)
        })
        .collect()
}

/// Poll the events regarding `name` until `pred` holds (panics after 30 s, naming `what`).
pub async fn wait_events(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    what: &str,
    pred: impl Fn(&[(String, String, i64)]) -> bool,
) -> Vec<(String, String, i64)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ev = events_regarding(client, namespace, name).await;
        if pred(&ev) {
            return ev;
        }
        assert!(Instant::now() < deadline, "{name} never got events {what}: {ev:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn throwaway_ca_pem(dir: &Path) -> String {
    let n = NS_COUNTER.fetch_add(1, Ordering::Relaxed);
    let (key, crt) = (dir.join(format!("other-ca-{n}.key")), dir.join(format!("other-ca-{n}.crt")));
    run_checked(
        Command::new("openssl")
            .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=not-the-apiserver-ca"])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&crt),
    );
    fs::read_to_string(&crt).unwrap_or_else(|e| panic!("read {}: {e}", crt.display()))
}

/// `BTreeMap` literal helper for tests.
pub fn map<V: Clone>(pairs: &[(&str, V)]) -> BTreeMap<String, V> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}
