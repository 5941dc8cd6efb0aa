//! `nodeplan install` / `uninstall` and `install.sh` end to end, always into a temporary `--root`
//! tree (never the machine's /etc, /usr or /var): the Rancher exchange against a local HTTPS
//! server that checks the token and every X-Cattle-* header, the CA checksum, retries, the
//! read-only /usr/local fallback (in a private mount namespace), re-install, refusal of foreign
//! files, uninstall, the environment file, the Cattle id, a planted symlink, the interlock, and
//! `systemd-analyze verify` on the unit.

mod common;

use common::{NODEPLAN, require};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

// ---------------------------------------------------------------------------------------------
// A minimal HTTP(S) server: one request per connection, the handler sees the method, path and
// headers and answers a status and a body (for a 3xx, the body is sent as the Location header);
// every request is recorded. A dual server answers TLS and plain HTTP on one port.

#[derive(Debug, Clone)]
struct Request {
    path: String,
    headers: Vec<(String, String)>,
    /// Whether it came over TLS.
    tls: bool,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

type Handler = Arc<dyn Fn(&Request) -> (u16, Vec<u8>) + Send + Sync>;

struct Server {
    addr: std::net::SocketAddr,
    requests: Arc<Mutex<Vec<Request>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    async fn start(tls: Option<Arc<ServerConfig>>, handler: Handler) -> Server {
        Server::start_with(tls, false, handler).await
    }

    /// TLS (a connection that starts with a TLS record) and plain HTTP on the same port.
    async fn dual(tls: Arc<ServerConfig>, handler: Handler) -> Server {
        Server::start_with(Some(tls), true, handler).await
    }

    async fn start_with(tls: Option<Arc<ServerConfig>>, dual: bool, handler: Handler) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let log = requests.clone();
        let acceptor = tls.map(TlsAcceptor::from);
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let (h, log, acceptor) = (handler.clone(), log.clone(), acceptor.clone());
                conns.spawn(async move {
                    let mut first = [0u8; 1];
                    // 0x16: a TLS handshake record.
                    let is_tls = !dual || matches!(stream.peek(&mut first).await, Ok(1) if first[0] == 0x16);
                    match acceptor {
                        Some(a) if is_tls => {
                            if let Ok(s) = a.accept(stream).await {
                                serve_one(s, true, &h, &log).await
                            }
                        }
                        _ => serve_one(stream, false, &h, &log).await,
                    }
                });
                while conns.try_join_next().is_some() {}
            }
        });
        Server { addr, requests, task }
    }

    fn url(&self, scheme: &str) -> String {
        format!("{scheme}://{}", self.addr)
    }

    fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }

    fn count(&self, path: &str) -> usize {
        self.requests().iter().filter(|r| r.path == path).count()
    }
}

async fn serve_one<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, tls: bool, h: &Handler, log: &Mutex<Vec<Request>>) {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut lines = text.split("\r\n");
    let path = lines.next().unwrap_or("").split(' ').nth(1).unwrap_or("/").to_string();
    let headers =
        lines.filter_map(|l| l.split_once(':').map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))).collect();
    let req = Request { path, headers, tls };
    log.lock().unwrap().push(req.clone());
    let (status, mut body) = h(&req);
    let location = if (300..400).contains(&status) {
        format!("Location: {}\r\n", String::from_utf8_lossy(&std::mem::take(&mut body)))
    } else {
        String::new()
    };
    let mut resp =
        format!("HTTP/1.1 {status} X\r\n{location}Content-Length: {}\r\nConnection: close\r\n\r\n", body.len())
            .into_bytes();
    resp.extend_from_slice(&body);
    let _ = s.write_all(&resp).await;
    let _ = s.shutdown().await;
}

/// A throw-away CA and a server certificate for 127.0.0.1 it signed.
struct Pki {
    ca_pem: String,
    tls: Arc<ServerConfig>,
}

fn pki() -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, "nodeplan install test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &ca).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let der: CertificateDer<'static> = cert.der().clone();
    let tls = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![der], PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())))
        .unwrap();
    Pki { ca_pem: ca.pem(), tls: Arc::new(tls) }
}

fn sha256_hex(data: &[u8]) -> String {
    nodeplan::install::sha256_hex(data)
}

const TOKEN: &str = "tok-0123456789";
/// A kubeconfig a client can be made from (the agent's check), trusting the test CA.
fn kubeconfig(ca_pem: &str) -> String {
    kubeconfig_with_user(ca_pem, "token: secret-agent-token")
}

/// [`kubeconfig`] with `user` (YAML, one line per key) as its user's credentials.
fn kubeconfig_with_user(ca_pem: &str, user: &str) -> String {
    use base64::Engine as _;
    let user: String = user.lines().map(|l| format!("    {l}\n")).collect();
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: c
  cluster:
    server: https://127.0.0.1:6443
    certificate-authority-data: {ca}
users:
- name: u
  user:
{user}contexts:
- name: ctx
  context:
    cluster: c
    user: u
current-context: ctx
"
    )
}

fn connection_json(ca_pem: &str) -> Vec<u8> {
    connection_json_with(&kubeconfig(ca_pem))
}

fn connection_json_with(kubeconfig: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "kubeConfig": kubeconfig, "namespace": "fleet-default", "secretName": "custom-abc-machine-plan"
    }))
    .unwrap()
}

/// The Rancher side: `/cacerts` answers the CA; `/v3/connect/agent` answers 503 `fail_first`
/// times, then checks the token (401) and every X-Cattle-* header against `want` (400 naming
/// the header), then answers the connection info.
fn rancher_handler(ca_pem: String, want: Vec<(&'static str, String)>, fail_first: usize) -> Handler {
    let seen = Arc::new(Mutex::new(0usize));
    Arc::new(move |r: &Request| match r.path.as_str() {
        "/cacerts" => (200, ca_pem.clone().into_bytes()),
        "/v3/connect/agent" => {
            let n = {
                let mut s = seen.lock().unwrap();
                *s += 1;
                *s
            };
            if n <= fail_first {
                return (503, b"starting".to_vec());
            }
            if r.header("Authorization") != Some(&format!("Bearer {TOKEN}")) {
                return (401, b"Unauthorized".to_vec());
            }
            for (k, v) in &want {
                if r.header(k) != Some(v.as_str()) {
                    return (400, format!("bad {k}: {:?}", r.header(k)).into_bytes());
                }
            }
            (200, connection_json(&ca_pem))
        }
        _ => (404, Vec::new()),
    })
}

// ---------------------------------------------------------------------------------------------
// Running the installer.

/// A temporary tree plus a small stand-in binary (a shell script) for tests that do not need the
/// real one.
struct Tree {
    dir: tempfile::TempDir,
}

impl Tree {
    fn new() -> Tree {
        let t = Tree { dir: tempfile::tempdir().unwrap() };
        std::fs::create_dir(t.root()).unwrap();
        std::fs::write(t.bin(), "#!/bin/sh\necho stand-in nodeplan\n").unwrap();
        std::fs::set_permissions(t.bin(), std::fs::Permissions::from_mode(0o755)).unwrap();
        t
    }
    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }
    fn bin(&self) -> PathBuf {
        self.dir.path().join("stand-in")
    }
    /// A path of the tree, written as the agent sees it (`/etc/…`).
    fn at(&self, p: &str) -> PathBuf {
        self.root().join(p.trim_start_matches('/'))
    }
    fn read(&self, p: &str) -> String {
        std::fs::read_to_string(self.at(p)).unwrap_or_else(|e| panic!("{p}: {e}"))
    }
    fn write(&self, p: &str, content: &str) {
        let p = self.at(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }
    fn mode(&self, p: &str) -> u32 {
        std::fs::metadata(self.at(p)).unwrap().permissions().mode() & 0o7777
    }
}

/// `nodeplan ARGS` with only `env` (and PATH) in its environment.
async fn nodeplan(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = tokio::process::Command::new(NODEPLAN);
    c.args(args).env_clear().env("PATH", std::env::var_os("PATH").unwrap_or_default());
    for (k, v) in env {
        c.env(k, v);
    }
    tokio::time::timeout(Duration::from_secs(120), c.output()).await.expect("nodeplan install hung").unwrap()
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

/// `install --root T --local --binary <stand-in>` plus `more`.
async fn install_local(t: &Tree, more: &[&str], env: &[(&str, &str)]) -> Output {
    let root = t.root().display().to_string();
    let bin = t.bin().display().to_string();
    let mut args = vec!["install", "--root", &root, "--local", "--binary", &bin];
    args.extend_from_slice(more);
    nodeplan(&args, env).await
}

/// `nodeplan install` into `t` from Rancher (as `env` says), retrying twice 10 ms apart.
async fn install_retrying(t: &Tree, env: &[(&str, &str)]) -> Output {
    let root = t.root().display().to_string();
    let bin = t.bin().display().to_string();
    nodeplan(&["install", "--root", &root, "--binary", &bin, "--retries", "2", "--retry-interval", "10ms"], env).await
}

async fn uninstall(t: &Tree) -> Output {
    nodeplan(&["uninstall", "--root", &t.root().display().to_string()], &[]).await
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rancher_exchange_with_retries_headers_and_a_kept_cattle_id() {
    let pki = pki();
    let t = Tree::new();
    let machine_id = "0123456789abcdef0123456789abcdef\n";
    t.write("/etc/machine-id", machine_id);
    let id = sha256_hex(machine_id.as_bytes());
    let want = vec![
        ("X-Cattle-Id", id.clone()),
        ("X-Cattle-Role-Etcd", "true".to_string()),
        ("X-Cattle-Role-Control-Plane", "false".to_string()),
        ("X-Cattle-Role-Worker", "true".to_string()),
        ("X-Cattle-Labels", "zone=a,disk=ssd".to_string()),
        ("X-Cattle-Taints", "dedicated=infra:NoSchedule".to_string()),
        ("X-Cattle-Node-Name", "node-1".to_string()),
    ];
    let server = Server::start(Some(pki.tls.clone()), rancher_handler(pki.ca_pem.clone(), want, 2)).await;
    let url = server.url("https");
    let sum = sha256_hex(pki.ca_pem.as_bytes());
    let env = [
        ("CATTLE_SERVER", url.as_str()),
        ("CATTLE_TOKEN", TOKEN),
        ("CATTLE_CA_CHECKSUM", sum.as_str()),
        ("CATTLE_ROLE_ETCD", "true"),
        ("CATTLE_ROLE_WORKER", "true"),
        ("CATTLE_LABELS", "zone=a,disk=ssd"),
        ("CATTLE_TAINTS", "dedicated=infra:NoSchedule"),
        ("CATTLE_NODE_NAME", "node-1"),
        ("CATTLE_AGENT_LOGLEVEL", "debug"),
    ];
    let root = t.root().display().to_string();
    let bin = t.bin().display().to_string();
    let args = ["install", "--root", &root, "--binary", &bin, "--retry-interval", "10ms"];
    let o = nodeplan(&args, &env).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 0, "{out}\n{err}");
    // 503 twice (each retry said why), then 200: three requests counted by the server.
    assert_eq!(server.count("/v3/connect/agent"), 3, "{err}");
    assert!(err.contains("HTTP 503") && err.contains("retry 1/10") && err.contains("retry 2/10"), "{err}");
    // /cacerts was fetched with no credential on it.
    for r in server.requests().iter().filter(|r| r.path == "/cacerts") {
        assert_eq!(r.header("Authorization"), None);
    }
    assert!(out.contains("derived from /etc/machine-id"), "{out}");

    // The config and the connection info load and validate as the agent reads them.
    let cfg_path = t.at("/etc/rancher/agent/config.yaml");
    let cfg = nodeplan::config::load(&cfg_path).unwrap();
    nodeplan::config::validate(&cfg).unwrap();
    assert!(cfg.remote_enabled && !cfg.local_enabled);
    assert_eq!(cfg.connection_info_file, Path::new("/var/lib/rancher/agent/rancher2_connection_info.json"));
    assert_eq!(cfg.interlock_directory, Path::new("/var/lib/rancher/agent/interlock"));
    let conn_path = t.at("/var/lib/rancher/agent/rancher2_connection_info.json");
    let conn = nodeplan::config::load_connection(&conn_path).unwrap();
    assert_eq!((conn.namespace.as_str(), conn.secret_name.as_str()), ("fleet-default", "custom-abc-machine-plan"));
    assert_eq!(conn.kube_config, kubeconfig(&pki.ca_pem));
    assert_eq!(
        (t.mode("/etc/rancher/agent/config.yaml"), t.mode("/var/lib/rancher/agent/rancher2_connection_info.json")),
        (0o600, 0o600)
    );
    let v = nodeplan(&["validate-connection", &conn_path.display().to_string()], &[]).await;
    assert_eq!(code(&v), 0, "{:?}", text(&v));
    assert_eq!(t.read("/etc/rancher/agent/cattle-id"), format!("{id}\n"));
    assert!(t.read("/etc/systemd/system/nodeplan.env").contains("CATTLE_LOGLEVEL=\"debug\"\n"));

    // A second run with another machine id keeps the id (the server checks the header again)
    // and changes nothing.
    t.write("/etc/machine-id", "ffffffffffffffffffffffffffffffff\n");
    let before = server.count("/v3/connect/agent");
    let o = nodeplan(&args, &env).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 0, "{out}\n{err}");
    assert!(out.contains("kept from an earlier install"), "{out}");
    assert!(out.contains("nothing changed"), "{out}");
    assert!(!out.contains("created") && !out.contains("updated"), "{out}");
    assert_eq!(server.count("/v3/connect/agent"), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_retried_then_fails_clearly_and_writes_nothing() {
    let pki = pki();
    let t = Tree::new();
    let server = Server::start(Some(pki.tls.clone()), rancher_handler(pki.ca_pem.clone(), vec![], 0)).await;
    let url = server.url("https");
    let sum = sha256_hex(pki.ca_pem.as_bytes());
    let env = [
        ("CATTLE_SERVER", url.as_str()),
        ("CATTLE_TOKEN", "wrong"),
        ("CATTLE_CA_CHECKSUM", sum.as_str()),
        ("CATTLE_ID", "id-1"),
    ];
    let o = install_retrying(&t, &env).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 1, "{out}\n{err}");
    assert_eq!(server.count("/v3/connect/agent"), 3);
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.contains("401") && last.contains("CATTLE_TOKEN") && last.contains("gave up after 3 attempts"),
        "{err}"
    );
    assert!(!err.contains("wrong"), "the token is never shown: {err}");
    assert_eq!(std::fs::read_dir(t.root()).unwrap().count(), 0, "nothing written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_checksum_mismatch_is_refused_before_the_token_is_sent() {
    let pki = pki();
    let t = Tree::new();
    let server = Server::start(Some(pki.tls.clone()), rancher_handler(pki.ca_pem.clone(), vec![], 0)).await;
    let url = server.url("https");
    let other = sha256_hex(b"some other CA");
    let env = [("CATTLE_SERVER", url.as_str()), ("CATTLE_TOKEN", TOKEN), ("CATTLE_CA_CHECKSUM", other.as_str())];
    let root = t.root().display().to_string();
    let bin = t.bin().display().to_string();
    let o = nodeplan(&["install", "--root", &root, "--binary", &bin, "--retry-interval", "10ms"], &env).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 1, "{out}\n{err}");
    assert!(err.contains(&other) && err.contains(&sha256_hex(pki.ca_pem.as_bytes())), "{err}");
    let reqs = server.requests();
    assert_eq!(reqs.len(), 1, "one /cacerts, no retry of a mismatch, no connect: {reqs:?}");
    assert!(reqs.iter().all(|r| r.path == "/cacerts" && r.header("Authorization").is_none()));
    assert_eq!(std::fs::read_dir(t.root()).unwrap().count(), 0, "nothing written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_checksum_only_the_system_roots_are_trusted() {
    let pki = pki();
    let t = Tree::new();
    let server = Server::start(Some(pki.tls.clone()), rancher_handler(pki.ca_pem.clone(), vec![], 0)).await;
    let url = server.url("https");
    let env = [("CATTLE_SERVER", url.as_str()), ("CATTLE_TOKEN", TOKEN), ("CATTLE_ID", "id-1")];
    let root = t.root().display().to_string();
    let bin = t.bin().display().to_string();
    let o =
        nodeplan(&["install", "--root", &root, "--binary", &bin, "--retries", "1", "--retry-interval", "10ms"], &env)
            .await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 1, "{out}\n{err}");
    assert!(err.contains("gave up after 2 attempts"), "{err}");
    assert!(err.contains("not signed by a CA this machine trusts; set CATTLE_CA_CHECKSUM"), "the fix is named: {err}");
    // The test CA is in no system store: no request ever got through the handshake.
    assert_eq!(server.requests().len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reinstall_changes_nothing_and_a_foreign_config_needs_force() {
    let t = Tree::new();
    let o = install_local(&t, &[], &[]).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 0, "{out}\n{err}");
    assert!(out.contains("created config") && out.contains("created binary") && out.contains("created unit"), "{out}");
    let cfg = nodeplan::config::load(&t.at("/etc/rancher/agent/config.yaml")).unwrap();
    nodeplan::config::validate(&cfg).unwrap();
    assert!(cfg.local_enabled && !cfg.remote_enabled);
    assert_eq!(std::fs::read(t.at("/usr/local/bin/nodeplan")).unwrap(), std::fs::read(t.bin()).unwrap());
    assert_eq!(t.mode("/usr/local/bin/nodeplan"), 0o755);
    assert_eq!(t.mode("/etc/systemd/system/nodeplan.service"), 0o644);
    assert_eq!(
        std::fs::read_link(t.at("/etc/systemd/system/multi-user.target.wants/nodeplan.service")).unwrap(),
        Path::new("/etc/systemd/system/nodeplan.service")
    );
    let meta = |p: &str| {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(t.at(p)).unwrap();
        (m.ino(), m.mtime_nsec(), m.mtime())
    };
    let files = ["/etc/rancher/agent/config.yaml", "/usr/local/bin/nodeplan", "/etc/systemd/system/nodeplan.service"];
    let before: Vec<_> = files.iter().map(|p| meta(p)).collect();

    t.write("/etc/systemd/system/rancher-system-agent.service", "[Service]\n");
    let o = install_local(&t, &[], &[]).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 0, "{out}\n{err}");
    assert!(out.contains("nothing changed") && !out.contains("created") && !out.contains("updated"), "{out}");
    assert!(out.contains("warning: ") && out.contains("rancher-system-agent.service is installed too"), "{out}");
    assert_eq!(t.read("/etc/systemd/system/rancher-system-agent.service"), "[Service]\n", "Rancher's is left alone");
    assert_eq!(files.iter().map(|p| meta(p)).collect::<Vec<_>>(), before, "not rewritten");

    // A config somebody else wrote: refused (exit 3), nothing written, not even the new binary.
    t.write("/etc/rancher/agent/config.yaml", "localEnabled: true\n# the operator's own\n");
    std::fs::write(t.bin(), "#!/bin/sh\necho newer\n").unwrap();
    let o = install_local(&t, &[], &[]).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 3, "{out}\n{err}");
    assert!(err.contains("config.yaml") && err.contains("--force") && err.contains("nothing was written"), "{err}");
    assert_eq!(t.read("/etc/rancher/agent/config.yaml"), "localEnabled: true\n# the operator's own\n");
    assert_eq!(t.read("/usr/local/bin/nodeplan"), "#!/bin/sh\necho stand-in nodeplan\n");

    let o = install_local(&t, &["--force"], &[]).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 0, "{out}\n{err}");
    assert!(out.contains("updated config") && out.contains("updated binary"), "{out}");
    assert!(t.read("/etc/rancher/agent/config.yaml").starts_with("# Written by `nodeplan install`"));
    assert_eq!(t.read("/usr/local/bin/nodeplan"), "#!/bin/sh\necho newer\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_variables_join_the_env_file_and_uninstall_keeps_what_the_user_changed() {
    let t = Tree::new();
    let users = "# the operator's own settings\nFOO=bar\nNO_PROXY=10.0.0.0/8\n";
    t.write("/etc/systemd/system/nodeplan.env", users);
    t.write("/var/lib/rancher/agent/work/state", "the agent's, not install's");
    let env =
        [("HTTPS_PROXY", "http://proxy.internal:3128"), ("NO_PROXY", "127.0.0.1"), ("http_proxy", "http://p:8080")];
    let o = install_local(&t, &[], &env).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 0, "{out}\n{err}");
    let envfile = t.read("/etc/systemd/system/nodeplan.env");
    assert!(envfile.ends_with(users), "the user's lines survive byte for byte: {envfile}");
    assert!(
        envfile.contains("HTTPS_PROXY=\"http://proxy.internal:3128\"\n")
            && envfile.contains("http_proxy=\"http://p:8080\"\n"),
        "{envfile}"
    );
    assert!(!envfile.contains("127.0.0.1"), "the user's NO_PROXY wins: {envfile}");
    assert!(out.contains("NO_PROXY is set by your own line"), "{out}");
    // Re-install: same file.
    let o = install_local(&t, &[], &env).await;
    assert_eq!(code(&o), 0);
    assert_eq!(t.read("/etc/systemd/system/nodeplan.env"), envfile);

    // The user edits the config; uninstall keeps it (and says so) and removes the rest.
    let cfg = t.read("/etc/rancher/agent/config.yaml");
    t.write("/etc/rancher/agent/config.yaml", &format!("{cfg}# tuned by hand\n"));
    let o = uninstall(&t).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 0, "{out}\n{err}");
    assert!(out.contains("kept") && out.contains("config.yaml: changed since nodeplan install wrote it"), "{out}");
    assert!(t.at("/etc/rancher/agent/config.yaml").exists());
    for gone in [
        "/usr/local/bin/nodeplan",
        "/etc/systemd/system/nodeplan.service",
        "/etc/systemd/system/multi-user.target.wants/nodeplan.service",
        "/etc/rancher/agent/nodeplan-install.json",
        "/usr/local",
        "/var/lib/rancher/agent/interlock",
        "/var/lib/rancher/agent/plans",
    ] {
        assert!(std::fs::symlink_metadata(t.at(gone)).is_err(), "{gone} should be gone: {out}");
    }
    assert_eq!(t.read("/etc/systemd/system/nodeplan.env"), users, "only the installer's block went");
    assert_eq!(t.read("/var/lib/rancher/agent/work/state"), "the agent's, not install's");
    // Twice is fine.
    let o = uninstall(&t).await;
    assert_eq!(code(&o), 0);
    assert!(text(&o).0.contains("nothing to uninstall"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlink_planted_in_the_tree_is_never_followed() {
    let t = Tree::new();
    let outside = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(t.at("/etc")).unwrap();
    std::os::unix::fs::symlink(outside.path(), t.at("/etc/rancher")).unwrap();
    let o = install_local(&t, &[], &[]).await;
    let (out, err) = text(&o);
    assert_ne!(code(&o), 0, "{out}\n{err}");
    assert!(err.contains("symlink") && err.contains("rancher"), "{err}");
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0, "nothing written through the link");
    // A link in place of a file install writes is not followed either: without --force it is
    // refused, with --force the link itself is replaced.
    std::fs::remove_file(t.at("/etc/rancher")).unwrap();
    let victim = outside.path().join("victim");
    std::fs::write(&victim, "keep me").unwrap();
    std::fs::create_dir_all(t.at("/etc/systemd/system")).unwrap();
    std::os::unix::fs::symlink(&victim, t.at("/etc/systemd/system/nodeplan.service")).unwrap();
    let o = install_local(&t, &[], &[]).await;
    assert_eq!(code(&o), 3, "{:?}", text(&o));
    let o = install_local(&t, &["--force"], &[]).await;
    assert_eq!(code(&o), 0, "{:?}", text(&o));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");
    assert!(std::fs::symlink_metadata(t.at("/etc/systemd/system/nodeplan.service")).unwrap().is_file());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_usr_local_falls_back_to_opt() {
    // A read-only /usr/local inside the tree, in a private mount namespace so nothing outside
    // this test sees the mount (the machine's own /usr/local is never touched).
    let unshare = std::process::Command::new("unshare").args(["-m", "true"]).status().is_ok_and(|s| s.success());
    if !require(unshare, "unshare -m (root, mount namespaces)") {
        return;
    }
    let t = Tree::new();
    std::fs::create_dir_all(t.at("/usr/local")).unwrap();
    let ul = t.at("/usr/local").display().to_string();
    let script = format!(
        "set -e; mount --bind '{ul}' '{ul}'; mount -o remount,bind,ro '{ul}' '{ul}'; \
         exec '{NODEPLAN}' install --root '{}' --local --binary '{}'",
        t.root().display(),
        t.bin().display()
    );
    let o = tokio::process::Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &script])
        .output()
        .await
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(code(&o), 0, "{out}\n{err}");
    assert!(out.contains("/usr/local is read-only"), "{out}");
    assert!(t.at("/opt/nodeplan/bin/nodeplan").is_file());
    assert!(!t.at("/usr/local/bin").exists());
    assert!(t.read("/etc/systemd/system/nodeplan.service").contains("\nExecStart=/opt/nodeplan/bin/nodeplan agent\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_installed_unit_passes_systemd_analyze_verify() {
    let have =
        std::process::Command::new("systemd-analyze").arg("--version").output().is_ok_and(|o| o.status.success());
    if !require(have, "systemd-analyze (Debian package systemd)") {
        return;
    }
    let t = Tree::new();
    let o = install_local(&t, &[], &[]).await;
    assert_eq!(code(&o), 0, "{:?}", text(&o));
    let unit = t.read("/etc/systemd/system/nodeplan.service");
    // The unit names host paths; for the check, ExecStart points at the binary in the tree.
    let dir = tempfile::tempdir().unwrap();
    let verify = |exec: &Path| {
        let u = unit.replace("ExecStart=/usr/local/bin/nodeplan", &format!("ExecStart={}", exec.display()));
        assert_ne!(u, unit);
        let p = dir.path().join("nodeplan.service");
        std::fs::write(&p, u).unwrap();
        std::process::Command::new("systemd-analyze").arg("verify").arg(&p).output().unwrap()
    };
    let o = verify(&t.at("/usr/local/bin/nodeplan"));
    assert!(o.status.success() && o.stderr.is_empty(), "{:?}", text(&o));
    // The check does look: a binary that is not there fails it.
    let o = verify(&t.at("/usr/local/bin/missing"));
    assert!(!o.status.success(), "{:?}", text(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_rancher_a_kubeconfig_with_a_secret_or_nodeplans() {
    let t = Tree::new();
    let kc = t.dir.path().join("kubeconfig");
    let kc_text = kubeconfig(&pki().ca_pem);
    std::fs::write(&kc, &kc_text).unwrap();
    let root = t.root().display().to_string();
    let bin = t.bin().display().to_string();
    let kcs = kc.display().to_string();
    let o = nodeplan(
        &["install", "--root", &root, "--binary", &bin, "--kubeconfig", &kcs, "--secret", "default/machine-plan"],
        &[],
    )
    .await;
    assert_eq!(code(&o), 0, "{:?}", text(&o));
    let cfg = nodeplan::config::load(&t.at("/etc/rancher/agent/config.yaml")).unwrap();
    nodeplan::config::validate(&cfg).unwrap();
    assert!(cfg.remote_enabled && !cfg.node_plan_enabled);
    let conn =
        nodeplan::config::load_connection(&t.at("/var/lib/rancher/agent/rancher2_connection_info.json")).unwrap();
    assert_eq!(
        (conn.namespace.as_str(), conn.secret_name.as_str(), conn.kube_config.as_str()),
        ("default", "machine-plan", kc_text.as_str())
    );
    assert!(!t.at("/etc/rancher/agent/cattle-id").exists());

    // Switching to NodePlan mode rewrites the files install wrote (no --force needed).
    let o = nodeplan(
        &["install", "--root", &root, "--binary", &bin, "--kubeconfig", &kcs, "--nodeplan", "fleet"],
        &[("CATTLE_NODE_NAME", "worker-7")],
    )
    .await;
    assert_eq!(code(&o), 0, "{:?}", text(&o));
    let cfg = nodeplan::config::load(&t.at("/etc/rancher/agent/config.yaml")).unwrap();
    nodeplan::config::validate(&cfg).unwrap();
    assert!(cfg.node_plan_enabled && !cfg.remote_enabled);
    assert_eq!(cfg.node_name, "worker-7");
    let conn =
        nodeplan::config::load_connection(&t.at("/var/lib/rancher/agent/rancher2_connection_info.json")).unwrap();
    assert_eq!(conn.namespace, "fleet");

    // A kubeconfig that makes no client is bad input (exit 2), nothing changes.
    std::fs::write(&kc, "apiVersion: v1\nkind: Config\n").unwrap();
    let o =
        nodeplan(&["install", "--root", &root, "--binary", &bin, "--kubeconfig", &kcs, "--secret", "default/x"], &[])
            .await;
    assert_eq!(code(&o), 2, "{:?}", text(&o));
    assert_eq!(
        nodeplan::config::load_connection(&t.at("/var/lib/rancher/agent/rancher2_connection_info.json"))
            .unwrap()
            .namespace,
        "fleet"
    );

    // Local mode now: the connection info an earlier install wrote stays listed, and uninstall
    // removes it with the rest.
    let o = install_local(&t, &[], &[]).await;
    assert_eq!(code(&o), 0, "{:?}", text(&o));
    assert!(t.at("/var/lib/rancher/agent/rancher2_connection_info.json").exists());
    let o = uninstall(&t).await;
    assert_eq!(code(&o), 0, "{:?}", text(&o));
    assert!(!t.at("/var/lib/rancher/agent/rancher2_connection_info.json").exists(), "{:?}", text(&o));
    assert!(!t.at("/etc/rancher/agent/config.yaml").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_files_in_the_tree_give_one_line_and_no_hang() {
    let mkfifo = |p: &Path| {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let s = std::process::Command::new("mkfifo").arg(p).status().unwrap();
        assert!(s.success());
    };
    // A FIFO where the config goes: refused like any file install did not write.
    let t = Tree::new();
    mkfifo(&t.at("/etc/rancher/agent/config.yaml"));
    let o = install_local(&t, &[], &[]).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 3, "{out}\n{err}");
    assert!(err.contains("a FIFO"), "{err}");
    assert!(!t.at("/usr/local/bin/nodeplan").exists(), "nothing written");

    // A FIFO as the environment file: one line, nothing written.
    let t = Tree::new();
    mkfifo(&t.at("/etc/systemd/system/nodeplan.env"));
    let o = install_local(&t, &[], &[]).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 1, "{out}\n{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("nodeplan.env") && err.contains("not a regular file"), "{err}");
    assert!(!t.at("/etc/rancher/agent/config.yaml").exists(), "nothing written");

    // A manifest that is not one: one line naming it, for install and uninstall alike.
    let t = Tree::new();
    let o = install_local(&t, &[], &[]).await;
    assert_eq!(code(&o), 0, "{:?}", text(&o));
    t.write(
        "/etc/rancher/agent/nodeplan-install.json",
        r#"{"version": 1, "files": [{"path": "../../etc/passwd", "sha256": "x"}]}"#,
    );
    for o in [install_local(&t, &[], &[]).await, uninstall(&t).await] {
        let (out, err) = text(&o);
        assert_eq!(code(&o), 1, "{out}\n{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains("nodeplan-install.json") && err.contains("not absolute"), "{err}");
    }
    assert!(t.at("/usr/local/bin/nodeplan").exists(), "nothing removed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_waits_for_a_running_apply_through_the_interlock() {
    let t = Tree::new();
    let o = install_local(&t, &[], &[]).await;
    assert_eq!(code(&o), 0, "{:?}", text(&o));
    let active = t.at("/var/lib/rancher/agent/interlock/applyinator-active");
    let pending = t.at("/var/lib/rancher/agent/interlock/restart-pending");
    std::fs::write(&active, "Tue Dec  1 12:00:00 UTC 2026").unwrap();
    std::fs::write(t.bin(), "#!/bin/sh\necho upgraded\n").unwrap();

    // Gives up after --interlock-timeout: nothing installed, restart-pending taken back.
    let o = install_local(&t, &["--interlock-timeout", "300ms"], &[]).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 1, "{out}\n{err}");
    assert!(err.contains("applyinator-active") && err.contains("nothing was installed"), "{err}");
    assert!(!pending.exists());
    assert_eq!(t.read("/usr/local/bin/nodeplan"), "#!/bin/sh\necho stand-in nodeplan\n");

    // Waits while the apply runs: restart-pending appears, the binary is not replaced until the
    // apply ends, then it is, and restart-pending goes.
    let root = t.root().display().to_string();
    let bin = t.bin().display().to_string();
    let child = tokio::process::Command::new(NODEPLAN)
        .args(["install", "--root", &root, "--local", "--binary", &bin])
        .env_clear()
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !pending.exists() {
        assert!(std::time::Instant::now() < deadline, "restart-pending never appeared");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(t.read("/usr/local/bin/nodeplan"), "#!/bin/sh\necho stand-in nodeplan\n", "not while applying");
    std::fs::remove_file(&active).unwrap();
    let o = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await.unwrap().unwrap();
    assert_eq!(code(&o), 0, "{:?}", text(&o));
    assert_eq!(t.read("/usr/local/bin/nodeplan"), "#!/bin/sh\necho upgraded\n");
    assert!(!pending.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_sh_with_a_local_binary_and_a_download() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/install.sh");
    let o = std::process::Command::new("sh").args(["-n", script]).output().unwrap();
    assert!(o.status.success(), "{:?}", text(&o));

    // The real binary, given locally: it is installed byte for byte and runs from the tree.
    let t = Tree::new();
    let root = t.root().display().to_string();
    let o = tokio::process::Command::new("sh")
        .args([script, "--root", &root, "--local"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CATTLE_AGENT_BINARY_LOCAL", "true")
        .env("CATTLE_AGENT_BINARY_LOCAL_LOCATION", NODEPLAN)
        .output()
        .await
        .unwrap();
    assert_eq!(code(&o), 0, "{:?}", text(&o));
    let installed = t.at("/usr/local/bin/nodeplan");
    assert!(std::fs::read(&installed).unwrap() == std::fs::read(NODEPLAN).unwrap(), "installed byte for byte");
    let v = std::process::Command::new(&installed).arg("--version").output().unwrap();
    assert!(v.status.success() && String::from_utf8_lossy(&v.stdout).starts_with("nodeplan "), "{:?}", text(&v));

    // A download (curl or wget) over https, checked against CATTLE_AGENT_BINARY_SHA256, run with
    // the options.
    let Some(path) = downloader_paths().into_iter().next() else { return };
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("args");
    let fake = format!("#!/bin/sh\necho \"$*\" > '{}'\nexit 7\n", record.display());
    let body = fake.clone().into_bytes();
    let server = Server::start(
        Some(pki.tls.clone()),
        Arc::new(move |r: &Request| if r.path == "/nodeplan" { (200, body.clone()) } else { (404, vec![]) }),
    )
    .await;
    let url = format!("{}/nodeplan", server.url("https"));
    let ca = ca_env(dir.path(), &pki.ca_pem);
    let run = |sum: String| {
        let mut env = ca.clone();
        env.push(("CATTLE_AGENT_BINARY_URL".into(), url.clone()));
        env.push(("CATTLE_AGENT_BINARY_SHA256".into(), sum));
        let path = path.1.clone();
        async move { install_sh(&["--root", "/nonexistent-tree", "--local"], &env, &path).await }
    };
    let o = run(sha256_hex(fake.as_bytes())).await;
    assert_eq!(code(&o), 7, "the binary's exit code comes back: {:?}", text(&o));
    let args = std::fs::read_to_string(&record).unwrap();
    assert!(
        args.starts_with("install --binary /")
            && args.trim_end().ends_with("nodeplan --root /nonexistent-tree --local"),
        "{args}"
    );
    std::fs::remove_file(&record).unwrap();
    let o = run(sha256_hex(b"something else")).await;
    assert_eq!(code(&o), 2, "{:?}", text(&o));
    assert!(text(&o).1.contains("CATTLE_AGENT_BINARY_SHA256"));
    assert!(!record.exists(), "a download that does not match is never run");
}

/// `install.sh ARGS` with only `env` and `path` as PATH in its environment.
async fn install_sh(args: &[&str], env: &[(String, String)], path: &std::ffi::OsStr) -> Output {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/install.sh");
    let mut c = tokio::process::Command::new("/bin/sh");
    c.arg(script).args(args).env_clear().env("PATH", path);
    for (k, v) in env {
        c.env(k, v);
    }
    tokio::time::timeout(Duration::from_secs(120), c.output()).await.expect("install.sh hung").unwrap()
}

/// What makes install.sh's downloaders trust the test CA: curl reads CURL_CA_BUNDLE, GNU wget
/// its WGETRC.
fn ca_env(dir: &Path, ca_pem: &str) -> Vec<(String, String)> {
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, ca_pem).unwrap();
    let rc = dir.join("wgetrc");
    std::fs::write(&rc, format!("ca_certificate = {}\n", ca.display())).unwrap();
    vec![("CURL_CA_BUNDLE".into(), ca.display().to_string()), ("WGETRC".into(), rc.display().to_string())]
}

/// The downloaders install.sh can use here, each with a PATH that makes it the one used: curl
/// with the test's PATH, GNU wget with a PATH of links to the tools the script needs and wget
/// (no curl). The temp dir holding the links lives as long as the test process.
fn downloader_paths() -> Vec<(&'static str, std::ffi::OsString)> {
    let runs = |c: &str| std::process::Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success());
    let mut out = Vec::new();
    if runs("curl") {
        out.push(("curl", std::env::var_os("PATH").unwrap_or_default()));
    }
    if runs("wget") {
        static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
        let dir = DIR.get_or_init(|| {
            let d = tempfile::tempdir().unwrap();
            for tool in ["mktemp", "rm", "sed", "tr", "grep", "sha256sum", "cut", "chmod", "touch", "wget", "sh"] {
                let found = ["/usr/bin", "/bin", "/usr/local/bin"]
                    .iter()
                    .map(|p| Path::new(p).join(tool))
                    .find(|p| p.exists())
                    .unwrap_or_else(|| panic!("{tool} not found"));
                std::os::unix::fs::symlink(found, d.path().join(tool)).unwrap();
            }
            d
        });
        out.push(("wget", dir.path().as_os_str().to_owned()));
    }
    require(!out.is_empty(), "curl or wget");
    out
}

/// Issue 23, item 1: a download runs as root, so it is https only (a redirect to http is not
/// followed), and without a checksum it is refused unless CATTLE_AGENT_BINARY_UNCHECKED=true.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_sh_downloads_over_https_only_and_needs_a_checksum() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran-as-root");
    let fake = format!("#!/bin/sh\ntouch '{}'\nexit 7\n", marker.display());
    let sum = sha256_hex(fake.as_bytes());
    let body = fake.clone().into_bytes();
    let serve = move |r: &Request| if r.path == "/nodeplan" { (200, body.clone()) } else { (404, vec![]) };
    let plain = Server::start(None, Arc::new(serve.clone())).await;
    let to_plain = format!("{}/nodeplan", plain.url("http"));
    let https = Server::start(
        Some(pki.tls.clone()),
        Arc::new(move |r: &Request| match r.path.as_str() {
            "/to-http" => (302, to_plain.clone().into_bytes()),
            _ => serve(r),
        }),
    )
    .await;
    let direct = format!("{}/nodeplan", https.url("https"));
    let to_https = direct.clone();
    let hop =
        Server::start(Some(pki.tls.clone()), Arc::new(move |_: &Request| (302, to_https.clone().into_bytes()))).await;
    let ca = ca_env(dir.path(), &pki.ca_pem);

    for (tool, path) in downloader_paths() {
        let run = |vars: &[(&str, &str)]| {
            let mut env = ca.clone();
            env.extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            let path = path.clone();
            async move { install_sh(&["--root", "/nonexistent-tree", "--local"], &env, &path).await }
        };
        // The attack: an https URL that redirects to http, no checksum, the opt-out given.
        let o = run(&[
            ("CATTLE_AGENT_BINARY_URL", &format!("{}/to-http", https.url("https"))),
            ("CATTLE_AGENT_BINARY_UNCHECKED", "true"),
        ])
        .await;
        assert_eq!(code(&o), 2, "{tool}: {:?}", text(&o));
        assert!(!marker.exists(), "{tool}: what a redirect to http served ran");
        assert_eq!(plain.count("/nodeplan"), 0, "{tool}: the http URL was fetched");
        assert!(text(&o).1.contains("cannot download"), "{tool}: {:?}", text(&o));

        // An http URL, even with a checksum.
        let o = run(&[("CATTLE_AGENT_BINARY_URL", &plain.url("http")), ("CATTLE_AGENT_BINARY_SHA256", &sum)]).await;
        assert_eq!(code(&o), 2, "{tool}: {:?}", text(&o));
        assert!(text(&o).1.contains("must be an https:// URL"), "{tool}: {:?}", text(&o));
        assert_eq!(plain.count("/nodeplan"), 0);

        // No checksum: refused before anything is downloaded, naming both ways on.
        let before = https.count("/nodeplan");
        let o = run(&[("CATTLE_AGENT_BINARY_URL", &direct)]).await;
        assert_eq!(code(&o), 2, "{tool}: {:?}", text(&o));
        let err = text(&o).1;
        assert!(
            err.contains("CATTLE_AGENT_BINARY_SHA256 is not set") && err.contains("CATTLE_AGENT_BINARY_UNCHECKED=true"),
            "{err}"
        );
        assert_eq!(https.count("/nodeplan"), before, "{tool}: downloaded without a checksum");
        assert!(!marker.exists());

        // The opt-out runs it, with a warning naming the missing checksum.
        let o = run(&[("CATTLE_AGENT_BINARY_URL", &direct), ("CATTLE_AGENT_BINARY_UNCHECKED", "true")]).await;
        assert_eq!(code(&o), 7, "{tool}: {:?}", text(&o));
        let err = text(&o).1;
        assert!(err.contains("WARNING") && err.contains("CATTLE_AGENT_BINARY_SHA256 is not set"), "{err}");
        std::fs::remove_file(&marker).unwrap();

        // A password in the URL is never shown.
        let secret_url = direct.replace("https://", "https://admin:hunter2@").replace("/nodeplan", "/missing");
        let o = run(&[("CATTLE_AGENT_BINARY_URL", &secret_url), ("CATTLE_AGENT_BINARY_SHA256", &sum)]).await;
        assert_eq!(code(&o), 2, "{tool}: {:?}", text(&o));
        let err = text(&o).1;
        assert!(err.contains("https://***@127.0.0.1") && !err.contains("hunter2"), "{tool}: {err}");

        // https → https: curl follows it; wget follows no redirect at all.
        let o = run(&[("CATTLE_AGENT_BINARY_URL", &hop.url("https")), ("CATTLE_AGENT_BINARY_SHA256", &sum)]).await;
        match tool {
            "curl" => {
                assert_eq!(code(&o), 7, "{tool}: {:?}", text(&o));
                std::fs::remove_file(&marker).unwrap();
            }
            _ => {
                assert_eq!(code(&o), 2, "{tool}: {:?}", text(&o));
                assert!(!marker.exists());
            }
        }
    }
}

/// Issue 23, item 2: the Rancher client follows no redirect: a 3xx (here to plain HTTP on the
/// same host and port, which would get the token again in clear) is one error line naming the
/// Location, not retried, and nothing is sent there or taken from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_follows_no_redirect_and_never_sends_the_token_again() {
    let pki = pki();
    let t = Tree::new();
    let port = Arc::new(std::sync::OnceLock::<u16>::new());
    let (ca_pem, p) = (pki.ca_pem.clone(), port.clone());
    let server = Server::dual(
        pki.tls.clone(),
        Arc::new(move |r: &Request| match (r.tls, r.path.as_str()) {
            // What the attacker's plaintext side answers.
            (false, _) => (200, connection_json(&ca_pem)),
            (true, "/cacerts") => (200, ca_pem.clone().into_bytes()),
            (true, _) => {
                let port = p.get().copied().unwrap_or(0);
                (302, format!("http://admin:hunter2@127.0.0.1:{port}/v3/connect/agent").into_bytes())
            }
        }),
    )
    .await;
    port.set(server.addr.port()).unwrap();
    let sum = sha256_hex(pki.ca_pem.as_bytes());
    let url = server.url("https");
    let env =
        [("CATTLE_SERVER", url.as_str()), ("CATTLE_TOKEN", TOKEN), ("CATTLE_CA_CHECKSUM", &sum), ("CATTLE_ID", "id-1")];
    let o = install_retrying(&t, &env).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 1, "{out}\n{err}");
    let location = format!("http://***@127.0.0.1:{}/v3/connect/agent", server.addr.port());
    assert!(err.contains("redirects are not followed") && err.contains(&location), "{err}");
    assert!(!err.contains("hunter2") && !out.contains(TOKEN) && !err.contains(TOKEN), "{out}\n{err}");
    let reqs = server.requests();
    assert!(reqs.iter().all(|r| r.tls), "a request went out in clear: {reqs:?}");
    assert_eq!(server.count("/v3/connect/agent"), 1, "a redirect is not retried: {reqs:?}");
    assert!(!t.at("/var/lib/rancher/agent/rancher2_connection_info.json").exists());
}

/// Issue 23, item 10: a password in CATTLE_SERVER never reaches an error line or a log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_in_cattle_server_is_never_shown() {
    let pki = pki();
    let t = Tree::new();
    let server = Server::start(Some(pki.tls.clone()), rancher_handler(pki.ca_pem.clone(), vec![], 100)).await;
    let url = server.url("https").replace("https://", "https://admin:hunter2@");
    let sum = sha256_hex(pki.ca_pem.as_bytes());
    let root = t.root().display().to_string();
    let bin = t.bin().display().to_string();
    let args = ["install", "--root", &root, "--binary", &bin, "--retries", "1", "--retry-interval", "10ms"];
    let env =
        [("CATTLE_SERVER", url.as_str()), ("CATTLE_TOKEN", TOKEN), ("CATTLE_CA_CHECKSUM", &sum), ("CATTLE_ID", "id-1")];
    let o = nodeplan(&args, &env).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 1, "{out}\n{err}");
    assert!(err.contains("gave up after 2 attempts") && err.contains("https://***@127.0.0.1"), "{err}");
    assert!(!err.contains("hunter2") && !out.contains("hunter2"), "{out}\n{err}");
    // Nothing listens there: the transport error is masked too.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("https://admin:hunter2@127.0.0.1:{closed}");
    let env =
        [("CATTLE_SERVER", url.as_str()), ("CATTLE_TOKEN", TOKEN), ("CATTLE_CA_CHECKSUM", &sum), ("CATTLE_ID", "id-1")];
    let o = nodeplan(&args, &env).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 1, "{out}\n{err}");
    assert!(!err.contains("hunter2") && !out.contains("hunter2"), "{out}\n{err}");
    // Not https: bad input, masked.
    let env = [("CATTLE_SERVER", "http://admin:hunter2@rancher.example"), ("CATTLE_TOKEN", TOKEN)];
    let o = nodeplan(&args, &env).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 2, "{out}\n{err}");
    assert!(err.contains("http://***@rancher.example") && !err.contains("hunter2"), "{err}");
}

/// Issue 23, item 2: a credential plugin is a command root would run. From Rancher's answer it is
/// refused; in the operator's kubeconfig (install --kubeconfig, validate-connection) it is
/// checked around, never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credential_plugin_is_refused_from_rancher_and_never_run() {
    let pki = pki();
    let t = Tree::new();
    let marker = t.dir.path().join("plugin-ran");
    let plugin = t.dir.path().join("plugin");
    std::fs::write(
        &plugin,
        format!(
            "#!/bin/sh\ntouch '{}'\necho '{{\"apiVersion\":\"client.authentication.k8s.io/v1\",\"kind\":\"ExecCredential\",\"status\":{{\"token\":\"t\"}}}}'\n",
            marker.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let exec = kubeconfig_with_user(
        &pki.ca_pem,
        &format!("exec:\n  apiVersion: client.authentication.k8s.io/v1\n  command: {}", plugin.display()),
    );
    let gcp = kubeconfig_with_user(
        &pki.ca_pem,
        &format!("auth-provider:\n  name: gcp\n  config:\n    cmd-path: {}\n    cmd-args: x", plugin.display()),
    );
    let root = t.root().display().to_string();
    let bin = t.bin().display().to_string();
    let sum = sha256_hex(pki.ca_pem.as_bytes());
    for (kc, what) in [(&exec, "exec credential plugin"), (&gcp, "auth-provider")] {
        let (ca_pem, answer) = (pki.ca_pem.clone(), connection_json_with(kc));
        let server = Server::start(
            Some(pki.tls.clone()),
            Arc::new(move |r: &Request| match r.path.as_str() {
                "/cacerts" => (200, ca_pem.clone().into_bytes()),
                _ => (200, answer.clone()),
            }),
        )
        .await;
        let url = server.url("https");
        let env = [
            ("CATTLE_SERVER", url.as_str()),
            ("CATTLE_TOKEN", TOKEN),
            ("CATTLE_CA_CHECKSUM", &sum),
            ("CATTLE_ID", "id-1"),
        ];
        let o = nodeplan(&["install", "--root", &root, "--binary", &bin, "--retries", "0"], &env).await;
        let (out, err) = text(&o);
        assert_eq!(code(&o), 1, "{out}\n{err}");
        assert!(err.contains(what) && err.contains("refused"), "{err}");
        assert!(!marker.exists(), "Rancher's {what} ran");
        assert!(!t.at("/var/lib/rancher/agent/rancher2_connection_info.json").exists());
    }

    // The operator's kubeconfig: installed, its plugin named and not run.
    let kc = t.dir.path().join("kubeconfig");
    std::fs::write(&kc, &exec).unwrap();
    let kcs = kc.display().to_string();
    let o = nodeplan(
        &["install", "--root", &root, "--binary", &bin, "--kubeconfig", &kcs, "--secret", "default/machine-plan"],
        &[],
    )
    .await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 0, "{out}\n{err}");
    assert!(out.contains("exec credential plugin was not run"), "{out}");
    assert!(!marker.exists(), "install ran the kubeconfig's plugin");

    // validate-connection starts nothing: valid, the plugin named, not run.
    let conn = t.at("/var/lib/rancher/agent/rancher2_connection_info.json").display().to_string();
    for kc in [&exec, &gcp] {
        std::fs::write(&conn, connection_json_with(kc)).unwrap();
        let o = nodeplan(&["validate-connection", &conn], &[]).await;
        let (out, err) = text(&o);
        assert_eq!(code(&o), 0, "{out}\n{err}");
        assert!(out.contains("was not run"), "{out}");
        assert!(!marker.exists(), "validate-connection ran a plugin");
    }
}

#[tokio::test]
async fn help_lists_the_exit_codes_and_the_variables() {
    for cmd in ["install", "uninstall"] {
        let o = nodeplan(&[cmd, "--help"], &[]).await;
        let (out, _) = text(&o);
        assert_eq!(code(&o), 0);
        assert!(out.contains("Exit codes:") && out.contains("  2  bad arguments"), "{out}");
    }
    let (out, _) = text(&nodeplan(&["install", "--help"], &[]).await);
    for v in
        ["CATTLE_AGENT_BIN_PREFIX", "CATTLE_CA_CHECKSUM", "CATTLE_ROLE_CONTROLPLANE", "HTTPS_PROXY", "  3  refused"]
    {
        assert!(out.contains(v), "{v}: {out}");
    }
    // Bad settings: one line, exit 2.
    let o = nodeplan(&["install", "--root", "/tmp"], &[("CATTLE_SERVER", "http://plain"), ("CATTLE_TOKEN", "t")]).await;
    let (_, err) = text(&o);
    assert_eq!(code(&o), 2, "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("https://"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_that_fails_midway_leaves_a_manifest_of_what_was_written() {
    let t = Tree::new();
    // A file where the enable link goes: the last step fails, after the files were written.
    t.write("/etc/systemd/system/multi-user.target.wants/nodeplan.service", "not a link");
    let o = install_local(&t, &[], &[]).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 1, "{out}\n{err}");
    assert!(err.contains("in the way of the unit's enable link"), "{err}");
    let m = nodeplan::install::plan::Manifest::parse(t.read("/etc/rancher/agent/nodeplan-install.json").as_bytes())
        .unwrap();
    let listed: Vec<_> = m.files.iter().map(|f| f.path.display().to_string()).collect();
    assert_eq!(
        listed,
        ["/etc/rancher/agent/config.yaml", "/usr/local/bin/nodeplan", "/etc/systemd/system/nodeplan.service"]
    );
    // Once the way is clear the install completes, and uninstall removes everything it wrote.
    std::fs::remove_file(t.at("/etc/systemd/system/multi-user.target.wants/nodeplan.service")).unwrap();
    let o = install_local(&t, &[], &[]).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 0, "{out}\n{err}");
    assert!(out.contains("unchanged config") && out.contains("enabled: link"), "{out}");
    let o = uninstall(&t).await;
    assert_eq!(code(&o), 0, "{:?}", text(&o));
    assert!(!t.at("/etc/systemd/system/nodeplan.service").exists() && !t.at("/usr/local/bin/nodeplan").exists());
}

/// A local user made for one test (`useradd`), removed when the test ends however it ends.
struct OtherUser {
    name: String,
    uid: u32,
}

impl OtherUser {
    fn new() -> OtherUser {
        let name = format!("np23u{}", std::process::id());
        let o = std::process::Command::new("useradd")
            .args(["--no-create-home", "--shell", "/usr/sbin/nologin", &name])
            .output()
            .unwrap();
        assert!(o.status.success(), "useradd: {}", String::from_utf8_lossy(&o.stderr));
        let id = std::process::Command::new("id").args(["-u", &name]).output().unwrap();
        let uid = String::from_utf8_lossy(&id.stdout).trim().parse().unwrap();
        OtherUser { name, uid }
    }
}

impl Drop for OtherUser {
    fn drop(&mut self) {
        let _ = std::process::Command::new("userdel").arg(&self.name).output();
    }
}

/// Another user's hand on an install: missing parents of the var dir are made 0755 (they were
/// 0700, as the var dir itself); files planted with the right content become root's with the
/// installed mode (they stayed the other user's, reported unchanged); a `--root` or a `--binary`
/// another user owns or can write is refused with one line and nothing written (it proceeded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_users_tree_binary_and_planted_files_are_never_trusted() {
    use std::os::unix::fs::MetadataExt;
    let other = OtherUser::new();
    let t = Tree::new();
    let o = install_local(&t, &[], &[]).await;
    assert_eq!(code(&o), 0, "{:?}", text(&o));
    let modes = ["/var", "/var/lib", "/var/lib/rancher", "/var/lib/rancher/agent"].map(|p| t.mode(p));
    assert_eq!(modes, [0o755, 0o755, 0o755, 0o700]);

    // Files with the right content, planted by the other user.
    let planted = ["/etc/rancher/agent/config.yaml", "/etc/systemd/system/nodeplan.service"];
    let wanted: Vec<u32> = planted.iter().map(|p| t.mode(p)).collect();
    for p in planted {
        std::os::unix::fs::chown(t.at(p), Some(other.uid), Some(other.uid)).unwrap();
        std::fs::set_permissions(t.at(p), std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let o = install_local(&t, &[], &[]).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 0, "{out}\n{err}");
    assert!(out.contains("unchanged config") && out.contains("unchanged unit"), "{out}");
    assert!(out.contains(&format!("owner set to uid 0 (was {}), mode 0600 (was 0666)", other.uid)), "{out}");
    for (p, mode) in planted.iter().zip(wanted) {
        let m = std::fs::metadata(t.at(p)).unwrap();
        assert_eq!((m.uid(), m.gid(), t.mode(p)), (0, 0, mode), "{p}");
    }

    // A --root the other user owns, a --binary they own or anyone can write.
    let theirs = Tree::new();
    std::os::unix::fs::chown(theirs.root(), Some(other.uid), None).unwrap();
    let o = install_local(&theirs, &[], &[]).await;
    let (out, err) = text(&o);
    assert_eq!(code(&o), 2, "{out}\n{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("--root") && err.contains(&format!("is owned by uid {}", other.uid)), "{err}");
    assert_eq!(std::fs::read_dir(theirs.root()).unwrap().count(), 0, "nothing written");
    for (what, uid, mode) in [("owned by uid", other.uid, 0o755), ("writable by group or others", 0, 0o757)] {
        let b = Tree::new();
        std::os::unix::fs::chown(b.bin(), Some(uid), None).unwrap();
        std::fs::set_permissions(b.bin(), std::fs::Permissions::from_mode(mode)).unwrap();
        let o = install_local(&b, &[], &[]).await;
        let (out, err) = text(&o);
        assert_eq!(code(&o), 2, "{what}: {out}\n{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("--binary") && err.contains(what), "{err}");
        assert_eq!(std::fs::read_dir(b.root()).unwrap().count(), 0, "nothing written");
    }
}

/// Issue 41, item 9: install.sh with `CATTLE_AGENT_BINARY_LOCAL=true` runs the named file as root
/// only when no other user could change it, as `nodeplan install --binary` requires: a file
/// another user owns, or one in a directory others may write (not sticky), is refused before
/// anything runs (exit 2, one line naming it); a root-owned file in a sticky directory runs.
#[tokio::test]
async fn install_sh_runs_a_local_binary_only_when_no_other_user_can_change_it() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/install.sh");
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let bin = dir.path().join("nodeplan");
    std::fs::write(&bin, format!("#!/bin/sh\ntouch '{}'\nexit 7\n", ran.display())).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let run = || async {
        tokio::process::Command::new("sh")
            .arg(script)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("CATTLE_AGENT_BINARY_LOCAL", "true")
            .env("CATTLE_AGENT_BINARY_LOCAL_LOCATION", &bin)
            .output()
            .await
            .unwrap()
    };
    let chown = |uid: u32| std::os::unix::fs::chown(&bin, Some(uid), None).unwrap();
    let dir_mode = |mode: u32| std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(mode)).unwrap();
    dir_mode(0o755);
    chown(65534);
    let o = run().await;
    assert_eq!(code(&o), 2, "{:?}", text(&o));
    let (_, err) = text(&o);
    assert!(err.contains("refused") && err.contains("owned by uid 65534"), "{err}");
    assert!(!ran.exists(), "a file another user owns ran as root");
    chown(0);
    dir_mode(0o777);
    let o = run().await;
    assert_eq!(code(&o), 2, "{:?}", text(&o));
    assert!(text(&o).1.contains("writable by group or others"), "{:?}", text(&o));
    assert!(!ran.exists(), "a file in a directory others may write ran as root");
    // Root's file in a sticky directory (as /tmp): run, with install's arguments.
    dir_mode(0o1777);
    let o = run().await;
    assert_eq!(code(&o), 7, "{:?}", text(&o));
    assert!(ran.exists());
}

/// Issue 41, item 8: `install --root DIR` in a sticky world-writable directory, raced by another
/// user who keeps making DIR (0777, theirs) and removing it. The root is judged as it was opened,
/// so every attempt either installs into a tree of root's or refuses: never into the user's (it
/// checked the path, then opened it by path; the user won about one try in 31).
#[tokio::test]
async fn install_root_raced_by_another_user_never_installs_into_their_tree() {
    use std::os::unix::fs::MetadataExt as _;
    let has_setpriv = std::process::Command::new("setpriv").arg("--version").output().is_ok_and(|o| o.status.success());
    if !require(has_setpriv, "setpriv (util-linux), which runs the racing user") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sticky = dir.path().join("shared");
    std::fs::create_dir(&sticky).unwrap();
    std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let bin = dir.path().join("nodeplan-binary");
    std::fs::write(&bin, b"not really nodeplan").unwrap();
    let turn = sticky.join("turn");
    let script = format!(
        "while :; do i=$(cat {turn} 2>/dev/null); mkdir -m 0777 {s}/r$i 2>/dev/null; rmdir {s}/r$i 2>/dev/null; done",
        turn = turn.display(),
        s = sticky.display()
    );
    /// Stops the racing user's loop however the test ends.
    struct Racer(std::process::Child);
    impl Drop for Racer {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let racer = Racer(
        std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c", &script])
            .spawn()
            .unwrap(),
    );
    let (mut installed, mut refused) = (0, 0);
    for i in 0..300 {
        std::fs::write(&turn, i.to_string()).unwrap();
        let root = sticky.join(format!("r{i}"));
        let o = nodeplan(
            &["install", "--root", &root.display().to_string(), "--local", "--binary", &bin.display().to_string()],
            &[],
        )
        .await;
        let (_, err) = text(&o);
        match code(&o) {
            0 => installed += 1,
            _ if err.contains("refused") => refused += 1,
            c => {
                // The user removed the directory under the install: fine, as long as nothing of
                // theirs holds what it wrote (checked below).
                assert!(err.contains("--root") || err.contains("No such file"), "exit {c}: {err}");
            }
        }
        if let Ok(m) = std::fs::metadata(&root) {
            let holds = root.join("etc").exists() || root.join("usr").exists();
            assert!(!(m.uid() == 65534 && holds), "attempt {i}: installed into a tree uid 65534 owns");
        }
    }
    drop(racer);
    eprintln!("300 attempts: {installed} installed into root's tree, {refused} refused the user's");
    assert!(installed > 0, "no attempt installed");
}
