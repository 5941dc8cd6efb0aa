//! Health probes: this module owns running a plan's `probes` (an `httpGet` is one GET, TLS set up
//! from the probe's `caCert` / `clientCert` / `clientKey` / `insecure`; a `fileExists` checks that
//! a path exists), applying the
//! success/failure thresholds, and producing the `ProbeStatus` map that the writer publishes as
//! `probe-statuses`. It decides nothing about plan state (paused, canceled, failed: callers keep
//! probing through all of them), spawns no processes and does no Kubernetes I/O.
//!
//! Semantics follow Rancher's system-agent (`pkg/prober`) on top of the kubelet HTTP prober:
//! - `GET` with `User-Agent: kube-probe/1.33` ([`USER_AGENT`]), `Accept: */*`, `Connection: close`,
//!   no proxy (the kubelet prober ignores `HTTP(S)_PROXY`), HTTP/1.1, at most 10 KiB of body read.
//! - A final status 200–299 is success; 400+ (and anything below 200) is failure. Redirects
//!   (301/302/303/307/308) are followed only while they stay on the same host name, up to 10
//!   requests in the chain, exactly like the kubelet's "local redirect" check (which compares the
//!   host name only, so a redirect to another port or from http to https on the same host is
//!   followed). A redirect to another host is not followed; the kubelet reports that 3xx as a
//!   *warning*, and Rancher counts warnings as failures, so it is a failure here. Any other final
//!   3xx is a failure for the same reason.
//! - `timeoutSeconds` bounds the whole request: connect, TLS handshake, headers and body.
//!   **Difference from Rancher:** `0` (or negative) means the Kubernetes default of 1 s, not "no
//!   timeout" as in Rancher.
//! - `initialDelaySeconds` is slept before the probe only when the caller passes `initial = true`.
//! - `successThreshold` 0 → 1, `failureThreshold` 0 → 3 (negative values are treated like 0);
//!   counters saturate as in Rancher ([`update_status`]).
//! - TLS (rustls, ring): the system roots plus every certificate of the `caCert` PEM file;
//!   `clientCert` + `clientKey` (both set) present a client identity; `insecure` skips server
//!   verification (the `caCert` file is then ignored, as in Rancher; unlike Rancher a client
//!   identity is still presented when both files are set). **Difference from Rancher:** a cert or
//!   key file that cannot be read or parsed is logged with `warn!` and makes the probe fail; Rancher
//!   only logs it and probes anyway.
//! - An invalid URL is a probe failure (Rancher leaves the status untouched).
//!
//! Files are looked at only off the runtime threads, one check per path or TLS configuration at a
//! time, each bounded by its probe's timeout ([`Waiting`]): a path that never answers (a hung
//! mount) is a failing probe, never a stuck agent or a growing number of threads.
//!
//! One `reqwest::Client` is built per distinct TLS configuration (insecure flag and the three
//! paths) and cached in the [`Prober`]. Before each probe the referenced files are `stat`ed; the
//! cached client is rebuilt when any file's modification time or length changed. System roots are
//! read only when a client is built. `probe_all` drops cache entries that no current probe uses.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use futures::future::join_all;
use reqwest::{Client, Url, redirect};
use tracing::{debug, info, warn};

use crate::plan::{Probe, ProbeStatus};

/// `User-Agent` sent with every probe, in the kubelet's `kube-probe/<major>.<minor>` form.
pub const USER_AGENT: &str = "kube-probe/1.33";

/// Timeout used when `timeoutSeconds` is 0 (Kubernetes' default).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
const DEFAULT_SUCCESS_THRESHOLD: i64 = 1;
const DEFAULT_FAILURE_THRESHOLD: i64 = 3;
/// The kubelet stops when the chain (original request included) reaches this many requests.
const MAX_REDIRECT_CHAIN: usize = 10;
/// The kubelet reads at most this much of the body.
const MAX_BODY: usize = 10 * 1024;

/// Outcome of one probe request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeResult {
    Success,
    /// Failure with a human-readable reason (`HTTP 503`, `timed out after 1s`, …).
    Failure(String),
}

impl ProbeResult {
    pub fn is_success(&self) -> bool {
        matches!(self, ProbeResult::Success)
    }
}

impl fmt::Display for ProbeResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProbeResult::Success => f.write_str("success"),
            ProbeResult::Failure(reason) => write!(f, "failure: {reason}"),
        }
    }
}

/// Runs probes; holds the cache of HTTP clients (one per TLS configuration), and the checks whose
/// file system has not answered yet.
#[derive(Debug, Default)]
pub struct Prober {
    clients: Arc<Mutex<HashMap<TlsKey, CachedClient>>>,
    waiting: Waiting,
}

/// The file-system checks still waiting for an answer (a probe's `fileExists` path, its TLS
/// configuration's files), by probe and what it looks at. Each check runs on a thread of its own,
/// bounded by its probe's timeout; while one has not returned (a hung mount), the probe's next
/// check fails at once instead of starting another: at most one thread per probe ever waits, and
/// the runtime threads and the blocking pool (the disk lane, spawns) never do.
#[derive(Debug, Default, Clone)]
struct Waiting(Arc<Mutex<HashSet<String>>>);

impl Waiting {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `f` on a thread of its own, waited for at most `timeout`.
    async fn check<T: Send + 'static>(
        &self,
        key: String,
        timeout: Duration,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, String> {
        if !self.lock().insert(key.clone()) {
            return Err("the previous check has not returned: no answer from the file system".into());
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (waiting, done) = (self.clone(), key.clone());
        let spawned = std::thread::Builder::new().name("probe-check".into()).spawn(move || {
            let r = f();
            waiting.lock().remove(&done);
            let _ = tx.send(r);
        });
        if let Err(e) = spawned {
            self.lock().remove(&key);
            return Err(format!("cannot start a thread: {e}"));
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(_)) => Err("the check ended without an answer".into()),
            Err(_) => Err("no answer from the file system".into()),
        }
    }

    #[cfg(all(test, unix))]
    fn count(&self) -> usize {
        self.lock().len()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct TlsKey {
    insecure: bool,
    /// Empty when unused (no CA file, or `insecure`).
    ca_cert: String,
    /// Both empty unless both are set.
    client_cert: String,
    client_key: String,
}

impl TlsKey {
    fn of(probe: &Probe) -> Self {
        let http = &probe.http_get;
        let identity = !http.client_cert.is_empty() && !http.client_key.is_empty();
        TlsKey {
            insecure: http.insecure,
            ca_cert: if http.insecure { String::new() } else { http.ca_cert.clone() },
            client_cert: if identity { http.client_cert.clone() } else { String::new() },
            client_key: if identity { http.client_key.clone() } else { String::new() },
        }
    }

    /// The files this configuration reads, with the probe field that names each.
    fn files(&self) -> Vec<(&'static str, &str)> {
        let mut files = Vec::new();
        if !self.ca_cert.is_empty() {
            files.push(("caCert", self.ca_cert.as_str()));
        }
        if !self.client_cert.is_empty() {
            files.push(("clientCert", self.client_cert.as_str()));
            files.push(("clientKey", self.client_key.as_str()));
        }
        files
    }
}

/// What a file looked like when the cached client was built from it.
type FileStamp = (Option<SystemTime>, u64);

#[derive(Debug)]
struct CachedClient {
    stamps: Vec<FileStamp>,
    client: Client,
}

impl Prober {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs every probe of a plan concurrently and returns the new status of each. A probe with no
    /// previous status starts from `ProbeStatus::default()`; statuses of probes that are not in
    /// `probes` are dropped. With `initial`, each probe first sleeps its `initialDelaySeconds`.
    pub async fn probe_all(
        &self,
        probes: &BTreeMap<String, Probe>,
        previous: &BTreeMap<String, ProbeStatus>,
        initial: bool,
    ) -> BTreeMap<String, ProbeStatus> {
        let runs = probes.iter().map(|(name, probe)| async move {
            if initial && probe.initial_delay_seconds > 0 {
                let delay = Duration::from_secs(probe.initial_delay_seconds.unsigned_abs());
                debug!(probe = %name, ?delay, "waiting initialDelaySeconds before probing");
                tokio::time::sleep(delay).await;
            }
            let result = self.run(name, probe).await;
            let old = previous.get(name).cloned().unwrap_or_default();
            let mut status = old.clone();
            update_status(&mut status, probe, result.is_success());
            match &result {
                ProbeResult::Success => debug!(probe = %name, ?status, "probe succeeded"),
                ProbeResult::Failure(reason) => {
                    debug!(probe = %name, %reason, ?status, "probe failed")
                }
            }
            if status.healthy != old.healthy {
                if status.healthy {
                    info!(probe = %name, "probe is now healthy");
                } else {
                    info!(probe = %name, last = %result, "probe is now unhealthy");
                }
            }
            (name.clone(), status)
        });
        let statuses = join_all(runs).await.into_iter().collect();

        let in_use: Vec<TlsKey> = probes.values().map(TlsKey::of).collect();
        lock(&self.clients).retain(|key, _| in_use.contains(key));
        statuses
    }

    /// Runs one probe request (no initial delay) and reports the outcome.
    pub async fn probe_once(&self, probe: &Probe) -> ProbeResult {
        self.run(&probe.name, probe).await
    }

    /// Runs preflight checks once each, concurrently (each within its probe's timeout).
    pub async fn preflight(&self, checks: &[crate::plan::Preflight]) -> crate::plan::PreflightResult {
        let runs = checks.iter().map(|c| async move { (c, self.probe_once(&c.probe).await) });
        let mut out = crate::plan::PreflightResult::default();
        for (c, r) in join_all(runs).await {
            if let ProbeResult::Failure(why) = r {
                let list = if c.required { &mut out.required_failed } else { &mut out.optional_failed };
                list.push((c.name.clone(), why));
            }
        }
        out
    }

    async fn run(&self, name: &str, probe: &Probe) -> ProbeResult {
        if let Some(f) = &probe.file_exists {
            let path = f.path.clone();
            let check = self.waiting.check(format!("{name}\0path {path}"), effective_timeout(probe), {
                let path = path.clone();
                move || std::fs::metadata(&path).map(|_| ())
            });
            return match check.await {
                Ok(Ok(())) => ProbeResult::Success,
                Ok(Err(e)) => ProbeResult::Failure(format!("{path}: {e}")),
                Err(why) => ProbeResult::Failure(format!("{path}: {why}")),
            };
        }
        let url = match Url::parse(&probe.http_get.url) {
            Ok(url) => url,
            Err(err) => {
                let shown = crate::redact_userinfo(&probe.http_get.url);
                return ProbeResult::Failure(format!("invalid URL {shown:?}: {err}"));
            }
        };
        if !matches!(url.scheme(), "http" | "https") {
            return ProbeResult::Failure(format!("unsupported URL scheme {:?}", url.scheme()));
        }
        let timeout = effective_timeout(probe);
        let key = TlsKey::of(probe);
        if probe.http_get.client_cert.is_empty() != probe.http_get.client_key.is_empty() {
            debug!(probe = %name, "only one of clientCert/clientKey is set; no client certificate is presented");
        }
        // Its files are looked at (and read for a new client) off the runtime threads.
        let cached = key.files().is_empty().then(|| lock(&self.clients).get(&key).map(|c| c.client.clone())).flatten();
        let client = match cached {
            Some(client) => client,
            None => {
                let (clients, name) = (self.clients.clone(), name.to_string());
                let files = key.files().iter().map(|(_, p)| *p).collect::<Vec<_>>().join(", ");
                let check = self
                    .waiting
                    .check(format!("{name}\0tls {key:?}"), timeout, move || client_for(&clients, &name, key));
                match check.await {
                    Ok(Ok(client)) => client,
                    Ok(Err(reason)) => return ProbeResult::Failure(reason),
                    Err(why) => return ProbeResult::Failure(format!("{files}: {why}")),
                }
            }
        };
        match tokio::time::timeout(timeout, request(&client, url)).await {
            Ok(result) => result,
            Err(_) => ProbeResult::Failure(format!("timed out after {}", crate::duration::show(timeout))),
        }
    }
}

fn lock(clients: &Mutex<HashMap<TlsKey, CachedClient>>) -> std::sync::MutexGuard<'_, HashMap<TlsKey, CachedClient>> {
    // The map holds no invariant a panic could break, so a poisoned lock is still usable.
    clients.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The cached client for a TLS configuration, rebuilt when one of its files changed. Errors are
/// logged (naming the probe and the file) and returned as the failure reason. It reads files: off
/// the runtime threads ([`Waiting::check`]).
fn client_for(clients: &Mutex<HashMap<TlsKey, CachedClient>>, name: &str, key: TlsKey) -> Result<Client, String> {
    let stamps = key
        .files()
        .into_iter()
        .map(|(field, path)| stamp(path).map_err(|err| file_error(name, field, path, &err)))
        .collect::<Result<Vec<_>, _>>()?;
    let cached = lock(clients).get(&key).filter(|cached| cached.stamps == stamps).map(|cached| cached.client.clone());
    if let Some(client) = cached {
        return Ok(client);
    }
    let client = build_client(name, &key)?;
    lock(clients).insert(key, CachedClient { stamps, client: client.clone() });
    Ok(client)
}

/// Applies one probe outcome to `status`, with Rancher's saturating counters: the counter of the
/// outcome grows up to its threshold (flipping `healthy` when it reaches it) and the other
/// counter resets to 0.
pub fn update_status(status: &mut ProbeStatus, probe: &Probe, success: bool) {
    let success_threshold = threshold(probe.success_threshold, DEFAULT_SUCCESS_THRESHOLD);
    let failure_threshold = threshold(probe.failure_threshold, DEFAULT_FAILURE_THRESHOLD);
    if success {
        if status.success_count < success_threshold {
            status.success_count += 1;
            if status.success_count >= success_threshold {
                status.healthy = true;
            }
        }
        status.failure_count = 0;
    } else {
        if status.failure_count < failure_threshold {
            status.failure_count += 1;
            if status.failure_count >= failure_threshold {
                status.healthy = false;
            }
        }
        status.success_count = 0;
    }
}

fn threshold(value: i64, default: i64) -> i64 {
    if value <= 0 { default } else { value }
}

fn effective_timeout(probe: &Probe) -> Duration {
    if probe.timeout_seconds <= 0 { DEFAULT_TIMEOUT } else { Duration::from_secs(probe.timeout_seconds.unsigned_abs()) }
}

fn stamp(path: &str) -> std::io::Result<FileStamp> {
    let meta = std::fs::metadata(path)?;
    Ok((meta.modified().ok(), meta.len()))
}

fn file_error(probe: &str, field: &str, path: &str, err: &dyn fmt::Display) -> String {
    let reason = format!("cannot read {field} {path}: {err}");
    warn!(probe = %probe, file = %path, "{reason}");
    reason
}

fn build_client(name: &str, key: &TlsKey) -> Result<Client, String> {
    let policy = redirect::Policy::custom(|attempt| {
        let same_host = attempt.previous().first().is_none_or(|first| first.host_str() == attempt.url().host_str());
        if !same_host {
            attempt.stop()
        } else if attempt.previous().len() >= MAX_REDIRECT_CHAIN {
            attempt.error("stopped after 10 redirects")
        } else {
            attempt.follow()
        }
    });
    let mut builder = Client::builder()
        .user_agent(USER_AGENT)
        .default_headers(
            [(reqwest::header::CONNECTION, reqwest::header::HeaderValue::from_static("close"))].into_iter().collect(),
        )
        .redirect(policy)
        .no_proxy()
        .pool_max_idle_per_host(0)
        .danger_accept_invalid_certs(key.insecure);

    if !key.ca_cert.is_empty() {
        let pem = read_file(name, "caCert", &key.ca_cert)?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|err| file_error(name, "caCert", &key.ca_cert, &err))?;
        if certs.is_empty() {
            return Err(file_error(name, "caCert", &key.ca_cert, &"no PEM certificate in file"));
        }
        for cert in certs {
            builder = builder.add_root_certificate(cert);
        }
    }

    if !key.client_cert.is_empty() {
        let cert = read_file(name, "clientCert", &key.client_cert)?;
        let cert = pem_blocks(&cert, |label| label == "CERTIFICATE");
        if cert.is_empty() {
            return Err(file_error(name, "clientCert", &key.client_cert, &"no PEM CERTIFICATE block in file"));
        }
        let pem = read_file(name, "clientKey", &key.client_key)?;
        let Some(private_key) = pem_blocks(&pem, |label| label.ends_with("PRIVATE KEY")).into_iter().next() else {
            return Err(file_error(name, "clientKey", &key.client_key, &"no PEM PRIVATE KEY block in file"));
        };
        let mut identity = cert.concat();
        identity.push_str(&private_key);
        let identity = reqwest::Identity::from_pem(identity.as_bytes()).map_err(|err| {
            let reason = format!(
                "cannot use clientCert {} / clientKey {}: {}",
                key.client_cert,
                key.client_key,
                crate::error_line(&err)
            );
            warn!(probe = %name, file = %key.client_cert, "{reason}");
            reason
        })?;
        builder = builder.identity(identity);
    }

    builder.build().map_err(|err| {
        let reason = format!("cannot build HTTP client: {}", crate::error_line(&err));
        warn!(probe = %name, "{reason}");
        reason
    })
}

fn read_file(name: &str, field: &str, path: &str) -> Result<Vec<u8>, String> {
    std::fs::read(Path::new(path)).map_err(|err| file_error(name, field, path, &err))
}

/// The PEM blocks of `text` (each `-----BEGIN L-----` … `-----END L-----`, newline-terminated)
/// whose label satisfies `keep`. Like Go's `tls.X509KeyPair`, other blocks (e.g. `EC PARAMETERS`)
/// are skipped.
fn pem_blocks(text: &[u8], keep: impl Fn(&str) -> bool) -> Vec<String> {
    let text = String::from_utf8_lossy(text);
    let mut blocks = Vec::new();
    let mut rest = text.as_ref();
    while let Some(start) = rest.find("-----BEGIN ") {
        let after = &rest[start + "-----BEGIN ".len()..];
        let Some(label_end) = after.find("-----") else {
            break;
        };
        let label = &after[..label_end];
        let end_marker = format!("-----END {label}-----");
        let Some(end) = rest[start..].find(&end_marker) else {
            break;
        };
        let block_end = start + end + end_marker.len();
        if keep(label) {
            blocks.push(format!("{}\n", &rest[start..block_end]));
        }
        rest = &rest[block_end..];
    }
    blocks
}

/// One GET, following local redirects; never longer than the caller's timeout.
async fn request(client: &Client, url: Url) -> ProbeResult {
    let mut response = match client.get(url).send().await {
        Ok(response) => response,
        Err(err) => return ProbeResult::Failure(crate::error_line(&err)),
    };
    // Read (at most MAX_BODY of) the body like the kubelet, so a server that stalls mid-body
    // times out instead of passing.
    let mut read = 0;
    while read < MAX_BODY {
        match response.chunk().await {
            Ok(Some(chunk)) => read += chunk.len(),
            Ok(None) => break,
            Err(err) => return ProbeResult::Failure(format!("reading body: {}", crate::error_line(&err))),
        }
    }
    let status = response.status();
    if status.is_success() {
        return ProbeResult::Success;
    }
    if status.is_redirection() {
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| response.url().join(value).ok());
        if let Some(location) = location.filter(|l| l.host_str() != response.url().host_str()) {
            let shown = crate::redact_userinfo(location.as_str());
            return ProbeResult::Failure(format!("redirect to other host {shown}"));
        }
        return ProbeResult::Failure(format!("HTTP {} (redirect not followed)", status.as_u16()));
    }
    ProbeResult::Failure(format!("HTTP {}", status.as_u16()))
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    fn probe(success_threshold: i64, failure_threshold: i64) -> Probe {
        Probe { success_threshold, failure_threshold, ..Probe::default() }
    }

    fn st(healthy: bool, success_count: i64, failure_count: i64) -> ProbeStatus {
        ProbeStatus { healthy, success_count, failure_count }
    }

    /// A `fileExists` probe is healthy while its path exists, and never touches the network.
    #[tokio::test]
    async fn file_exists_probes_follow_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ready");
        let p = Probe {
            success_threshold: 1,
            failure_threshold: 1,
            file_exists: Some(crate::plan::FileExistsAction { path: path.display().to_string() }),
            ..Probe::default()
        };
        let probes = BTreeMap::from([("ready".to_string(), p)]);
        let prober = Prober::new();
        let down = prober.probe_all(&probes, &BTreeMap::new(), false).await;
        assert_eq!(down["ready"], st(false, 0, 1));
        std::fs::write(&path, b"").unwrap();
        let up = prober.probe_all(&probes, &down, false).await;
        assert_eq!(up["ready"], st(true, 1, 0));
        let gone = Probe {
            file_exists: Some(crate::plan::FileExistsAction { path: dir.path().join("gone").display().to_string() }),
            ..Probe::default()
        };
        let ProbeResult::Failure(why) = prober.probe_once(&gone).await else { panic!("a missing path is healthy") };
        assert!(why.contains("gone") && why.contains("No such file"), "{why}");
    }

    /// Issue 41, item 6: a check whose file system never answers holds one thread, fails at its
    /// timeout, and makes the next check of the same path fail at once instead of starting
    /// another; once it returns, checks run again.
    #[tokio::test]
    async fn a_check_that_does_not_return_holds_one_thread_and_the_next_fails_at_once() {
        let waiting = Waiting::default();
        let (release, hung) = std::sync::mpsc::channel::<()>();
        let t = Duration::from_millis(100);
        let first = waiting.check("path /hung".into(), t, move || hung.recv().is_ok()).await;
        assert_eq!(first, Err("no answer from the file system".into()));
        for _ in 0..20 {
            let again = waiting.check("path /hung".into(), t, || true).await;
            assert!(again.is_err_and(|e| e.contains("previous check has not returned")));
        }
        assert_eq!(waiting.count(), 1, "one thread waits, however many checks came");
        assert_eq!(waiting.check("path /other".into(), t, || 7).await, Ok(7), "another path is checked");
        release.send(()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while waiting.count() > 0 {
            assert!(std::time::Instant::now() < deadline, "the check never returned");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(waiting.check("path /hung".into(), t, || true).await, Ok(true));
    }

    /// Issue 41, item 6: an `httpGet` probe whose `caCert` never opens (a FIFO nobody writes, as a
    /// hung mount) fails at its timeout on a runtime of one thread (the file is read off it), and
    /// probing it again holds no more threads. A watchdog opens the FIFO after 20 s, so a
    /// regression fails instead of hanging.
    #[tokio::test(flavor = "current_thread")]
    async fn a_ca_cert_that_never_opens_fails_the_probe_without_holding_the_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("ca.pem");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let opener = fifo.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(20));
            let _ = std::fs::OpenOptions::new().write(true).open(opener);
        });
        let mut p = Probe { timeout_seconds: 1, ..Probe::default() };
        p.http_get.url = "https://127.0.0.1:9/".into();
        p.http_get.ca_cert = fifo.display().to_string();
        let prober = Prober::new();
        let started = std::time::Instant::now();
        let ProbeResult::Failure(why) = prober.probe_once(&p).await else { panic!("healthy") };
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}: {why}", started.elapsed());
        assert!(why.contains("ca.pem") && why.contains("no answer"), "{why}");
        for _ in 0..5 {
            let ProbeResult::Failure(why) = prober.probe_once(&p).await else { panic!("healthy") };
            assert!(why.contains("has not returned"), "{why}");
        }
        assert_eq!(prober.waiting.count(), 1);
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    /// Applies `outcomes` ('S' success, 'F' failure) from the default status and returns every
    /// intermediate status.
    fn run(p: &Probe, outcomes: &str) -> Vec<ProbeStatus> {
        let mut status = ProbeStatus::default();
        outcomes
            .chars()
            .map(|c| {
                update_status(&mut status, p, c == 'S');
                status.clone()
            })
            .collect()
    }

    #[test]
    fn threshold_streaks() {
        // (successThreshold, failureThreshold, outcomes, expected statuses after each outcome)
        let cases: Vec<(i64, i64, &str, Vec<ProbeStatus>)> = vec![
            // Defaults (0 → 1 and 3): one success is healthy; three failures are unhealthy.
            (
                0,
                0,
                "SSFFFF",
                vec![st(true, 1, 0), st(true, 1, 0), st(true, 0, 1), st(true, 0, 2), st(false, 0, 3), st(false, 0, 3)],
            ),
            // successThreshold 3: healthy exactly at the third success, counts saturate at 3.
            (3, 1, "SSSSF", vec![st(false, 1, 0), st(false, 2, 0), st(true, 3, 0), st(true, 3, 0), st(false, 0, 1)]),
            // A failure in the middle of a success streak resets it.
            (2, 5, "SFSS", vec![st(false, 1, 0), st(false, 0, 1), st(false, 1, 0), st(true, 2, 0)]),
            // failureThreshold 2 with successes in between: never reaches it.
            (
                1,
                2,
                "SFSFSF",
                vec![st(true, 1, 0), st(true, 0, 1), st(true, 1, 0), st(true, 0, 1), st(true, 1, 0), st(true, 0, 1)],
            ),
            // Negative thresholds behave like 0 (defaults).
            (-1, -4, "FFF", vec![st(false, 0, 1), st(false, 0, 2), st(false, 0, 3)]),
        ];
        for (success_threshold, failure_threshold, outcomes, expected) in cases {
            let p = probe(success_threshold, failure_threshold);
            assert_eq!(
                run(&p, outcomes),
                expected,
                "thresholds {success_threshold}/{failure_threshold}, outcomes {outcomes}"
            );
        }
    }

    #[test]
    fn counters_never_exceed_thresholds() {
        for success_threshold in 0..5 {
            for failure_threshold in 0..5 {
                let p = probe(success_threshold, failure_threshold);
                let st_max = threshold(success_threshold, 1);
                let ft_max = threshold(failure_threshold, 3);
                for status in run(&p, "SSSSSSSFFFFFFFFSFSSSSSSSFFFFFFFF") {
                    assert!(status.success_count <= st_max, "{status:?}");
                    assert!(status.failure_count <= ft_max, "{status:?}");
                    assert!(status.success_count == 0 || status.failure_count == 0);
                }
            }
        }
    }

    #[test]
    fn saturated_previous_status_is_kept_as_rancher_does() {
        // A count above the threshold (e.g. the plan lowered it) is not changed by another
        // outcome of the same kind, and does not flip `healthy`: Rancher's exact rule.
        let p = probe(2, 2);
        let mut status = st(false, 5, 0);
        update_status(&mut status, &p, true);
        assert_eq!(status, st(false, 5, 0));
        update_status(&mut status, &p, false);
        assert_eq!(status, st(false, 0, 1));
    }

    #[test]
    fn timeouts() {
        let mut p = Probe::default();
        assert_eq!(effective_timeout(&p), Duration::from_secs(1));
        p.timeout_seconds = -3;
        assert_eq!(effective_timeout(&p), Duration::from_secs(1));
        p.timeout_seconds = 7;
        assert_eq!(effective_timeout(&p), Duration::from_secs(7));
    }

    #[test]
    fn pem_block_filtering() {
        let text = b"junk\n-----BEGIN EC PARAMETERS-----\nBggq\n-----END EC PARAMETERS-----\n\
-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n\
-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----\n-----BEGIN CERTIFICATE-----\nCC\n\
-----END CERTIFICATE-----\n-----BEGIN CERTIFICATE-----\nunterminated";
        let keys = pem_blocks(text, |l| l.ends_with("PRIVATE KEY"));
        assert_eq!(keys, vec!["-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n"]);
        let certs = pem_blocks(text, |l| l == "CERTIFICATE");
        assert_eq!(certs.len(), 2);
        assert!(certs[1].contains("CC"));
        assert!(pem_blocks(b"", |_| true).is_empty());
    }

    #[tokio::test]
    async fn invalid_urls_fail_without_panicking() {
        let prober = Prober::new();
        for (url, expect) in
            [("", "invalid URL"), ("not a url", "invalid URL"), ("ftp://127.0.0.1/", "unsupported URL scheme")]
        {
            let mut p = Probe::default();
            p.http_get.url = url.into();
            match prober.probe_once(&p).await {
                ProbeResult::Failure(reason) => assert!(reason.contains(expect), "{url}: {reason}"),
                ProbeResult::Success => panic!("{url} succeeded"),
            }
        }
        // A password in a URL is masked as everywhere else (`***@`).
        let mut p = Probe::default();
        p.http_get.url = "http://u:hunter2@[bad/healthz".into();
        match prober.probe_once(&p).await {
            ProbeResult::Failure(reason) => {
                assert!(reason.contains("***@[bad") && !reason.contains("hunter2"), "{reason}")
            }
            ProbeResult::Success => panic!("a bad URL succeeded"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn initial_delay_only_when_initial() {
        let prober = Prober::new();
        let mut p = Probe { initial_delay_seconds: 30, ..Probe::default() };
        p.http_get.url = "not a url".into(); // fails without any I/O
        let probes = BTreeMap::from([("p".to_string(), p)]);

        let start = tokio::time::Instant::now();
        let statuses = prober.probe_all(&probes, &BTreeMap::new(), false).await;
        assert!(start.elapsed() < Duration::from_secs(30));
        assert_eq!(statuses["p"], st(false, 0, 1));

        let start = tokio::time::Instant::now();
        let statuses = prober.probe_all(&probes, &statuses, true).await;
        assert!(start.elapsed() >= Duration::from_secs(30));
        assert_eq!(statuses["p"], st(false, 0, 2));

        // The delays of several probes run concurrently too.
        let probes: BTreeMap<String, Probe> =
            ["a", "b", "c"].into_iter().map(|name| (name.to_string(), probes["p"].clone())).collect();
        let start = tokio::time::Instant::now();
        let statuses = prober.probe_all(&probes, &BTreeMap::new(), true).await;
        let elapsed = start.elapsed();
        assert!(elapsed >= Duration::from_secs(30) && elapsed < Duration::from_secs(60));
        assert_eq!(statuses.len(), 3);
    }

    #[test]
    fn prober_and_its_futures_can_be_shared_and_spawned() {
        fn assert_send_sync<T: Send + Sync>(_: &T) {}
        fn assert_send<T: Send>(_: T) {}
        let prober = Prober::new();
        assert_send_sync(&prober);
        let (probes, previous) = (BTreeMap::new(), BTreeMap::new());
        assert_send(prober.probe_all(&probes, &previous, true));
        assert_send(prober.probe_once(&Probe::default()));
    }

    #[tokio::test]
    async fn probe_all_keeps_only_current_probes() {
        let prober = Prober::new();
        let mut p = Probe::default();
        p.http_get.url = "not a url".into();
        let probes = BTreeMap::from([("a".to_string(), p.clone()), ("b".to_string(), p)]);
        let previous = BTreeMap::from([("a".to_string(), st(true, 1, 0)), ("gone".to_string(), st(true, 1, 0))]);
        let statuses = prober.probe_all(&probes, &previous, false).await;
        assert_eq!(statuses, BTreeMap::from([("a".to_string(), st(true, 0, 1)), ("b".to_string(), st(false, 0, 1)),]));
    }
}
