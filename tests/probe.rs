//! Probe tests against real servers on 127.0.0.1 (ephemeral ports), over HTTP and HTTPS.

mod probe_support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use nodeplan::plan::{HttpGetAction, Probe, ProbeStatus};
use nodeplan::probe::{ProbeResult, Prober, USER_AGENT, update_status};
use probe_support::{Pki, Reply, TempDir, serve_http, serve_https};

fn probe(url: &str) -> Probe {
    Probe {
        name: "test".into(),
        http_get: HttpGetAction { url: url.into(), ..HttpGetAction::default() },
        ..Probe::default()
    }
}

fn tls_probe(url: &str, insecure: bool, ca: &str, cert: &str, key: &str) -> Probe {
    let mut p = probe(url);
    p.http_get.insecure = insecure;
    p.http_get.ca_cert = ca.into();
    p.http_get.client_cert = cert.into();
    p.http_get.client_key = key.into();
    p
}

#[track_caller]
fn assert_success(result: ProbeResult) {
    assert_eq!(result, ProbeResult::Success);
}

/// Asserts a failure whose reason contains `needle`, and returns the reason.
#[track_caller]
fn assert_failure(result: ProbeResult, needle: &str) -> String {
    match result {
        ProbeResult::Failure(reason) => {
            assert!(reason.contains(needle), "reason {reason:?} does not mention {needle:?}");
            reason
        }
        ProbeResult::Success => panic!("expected a failure mentioning {needle:?}, got success"),
    }
}

/// Turns a hang (e.g. a timeout that is never applied) into a test failure.
async fn bounded<T>(fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .expect("probe still running after 10 s: its timeout was not applied")
}

// ---- plain HTTP -----------------------------------------------------------------------------

#[tokio::test]
async fn http_200_succeeds_with_kube_probe_user_agent() {
    let server = serve_http(|_, _| Reply::Status(200)).await;
    let prober = Prober::new();
    assert_success(prober.probe_once(&probe(&server.http_url("/healthz"))).await);

    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    let head = requests[0].to_ascii_lowercase();
    assert!(head.starts_with("get /healthz http/1.1\r\n"), "{head}");
    assert!(head.contains(&format!("\r\nuser-agent: {USER_AGENT}\r\n")), "{head}");
    assert!(USER_AGENT.starts_with("kube-probe/1."));
}

#[tokio::test]
async fn http_2xx_and_local_redirects_succeed() {
    let server = serve_http(|path, port| match path {
        "/no-content" => Reply::Status(204),
        "/moved" => Reply::Redirect(302, format!("http://127.0.0.1:{port}/ok")),
        "/relative" => Reply::Redirect(307, "/moved".into()),
        _ => Reply::Status(200),
    })
    .await;
    let prober = Prober::new();
    assert_success(prober.probe_once(&probe(&server.http_url("/no-content"))).await);
    assert_success(prober.probe_once(&probe(&server.http_url("/moved"))).await);
    assert_success(prober.probe_once(&probe(&server.http_url("/relative"))).await);
    assert_eq!(server.paths(), ["/no-content", "/moved", "/ok", "/relative", "/moved", "/ok"]);
}

#[tokio::test]
async fn redirect_to_another_port_of_the_same_host_is_followed() {
    // The kubelet's "local redirect" check compares host names only.
    let target = serve_http(|_, _| Reply::Status(200)).await;
    let location = target.http_url("/ok");
    let server = serve_http(move |_, _| Reply::Redirect(301, location.clone())).await;
    assert_success(Prober::new().probe_once(&probe(&server.http_url("/"))).await);
    assert_eq!(target.paths(), ["/ok"]);
}

#[tokio::test]
async fn http_error_statuses_fail() {
    let server = serve_http(|path, _| match path {
        "/404" => Reply::Status(404),
        "/500" => Reply::Status(500),
        "/503" => Reply::Status(503),
        _ => Reply::Status(304),
    })
    .await;
    let prober = Prober::new();
    assert_failure(prober.probe_once(&probe(&server.http_url("/404"))).await, "HTTP 404");
    assert_failure(prober.probe_once(&probe(&server.http_url("/500"))).await, "HTTP 500");
    assert_failure(prober.probe_once(&probe(&server.http_url("/503"))).await, "HTTP 503");
    // A final 3xx is the kubelet's "warning", which Rancher counts as a failure.
    assert_failure(prober.probe_once(&probe(&server.http_url("/304"))).await, "HTTP 304");
}

#[tokio::test]
async fn redirect_to_another_host_fails_and_is_not_followed() {
    // 127.0.0.1 → localhost: same machine, but another host string.
    let server = serve_http(|path, port| match path {
        "/" => Reply::Redirect(302, format!("http://localhost:{port}/ok")),
        _ => Reply::Status(200),
    })
    .await;
    let reason = assert_failure(
        Prober::new().probe_once(&probe(&server.http_url("/"))).await,
        "redirect to other host http://localhost:",
    );
    assert!(reason.ends_with("/ok"), "{reason}");
    assert_eq!(server.paths(), ["/"], "the other host must not be requested");
}

#[tokio::test]
async fn redirect_loop_stops_after_ten_requests() {
    let server = serve_http(|_, _| Reply::Redirect(302, "/again".into())).await;
    assert_failure(Prober::new().probe_once(&probe(&server.http_url("/"))).await, "stopped after 10 redirects");
    assert_eq!(server.requests().len(), 10);
}

#[tokio::test]
async fn connection_refused_fails_with_a_reason() {
    // Bind, note the port, close: nothing listens there any more.
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let reason = match Prober::new().probe_once(&probe(&format!("http://127.0.0.1:{port}/"))).await {
        ProbeResult::Failure(reason) => reason,
        ProbeResult::Success => panic!("nothing listens on {port}"),
    };
    assert!(!reason.is_empty());
    assert!(!reason.contains("timed out"), "{reason}");
}

// ---- timeouts and concurrency ---------------------------------------------------------------

#[tokio::test]
async fn stalled_server_times_out() {
    let server = serve_http(|_, _| Reply::Stall).await;
    let prober = Prober::new();
    let mut p = probe(&server.http_url("/"));
    p.timeout_seconds = 1;
    assert_failure(bounded(prober.probe_once(&p)).await, "timed out after 1s");
    // 0 is the Kubernetes default of 1 s (Rancher would wait forever).
    p.timeout_seconds = 0;
    assert_failure(bounded(prober.probe_once(&p)).await, "timed out after 1s");
}

#[tokio::test]
async fn timeout_bounds_the_tls_handshake() {
    // Accepts TCP but never answers the ClientHello.
    let server = serve_http(|_, _| Reply::Stall).await;
    let mut p = probe(&server.https_url("/"));
    p.http_get.insecure = true;
    assert_failure(bounded(Prober::new().probe_once(&p)).await, "timed out after 1s");
}

#[tokio::test]
async fn probes_run_concurrently_and_a_stalled_one_does_not_delay_the_others() {
    let ok_a = serve_http(|_, _| Reply::Status(200)).await;
    let ok_b = serve_http(|_, _| Reply::Status(200)).await;
    let stalled = serve_http(|_, _| Reply::Stall).await;
    let mut probes = BTreeMap::new();
    for (name, url) in [("a", ok_a.http_url("/")), ("b", ok_b.http_url("/")), ("stalled", stalled.http_url("/"))] {
        let mut p = probe(&url);
        p.timeout_seconds = 1;
        probes.insert(name.to_string(), p);
    }
    let prober = Prober::new();
    let start = Instant::now();
    let statuses = bounded(prober.probe_all(&probes, &BTreeMap::new(), false)).await;
    let elapsed = start.elapsed();
    assert!(elapsed < Duration::from_millis(2500), "took {elapsed:?}");

    let healthy = ProbeStatus { healthy: true, success_count: 1, failure_count: 0 };
    assert_eq!(statuses["a"], healthy);
    assert_eq!(statuses["b"], healthy);
    assert_eq!(statuses["stalled"], ProbeStatus { healthy: false, success_count: 0, failure_count: 1 });
    assert_eq!(statuses.len(), 3);
}

#[tokio::test]
async fn stalled_probes_time_out_in_parallel_not_one_after_another() {
    // Sequential probing would take 3 × 1 s.
    let stalled = serve_http(|_, _| Reply::Stall).await;
    let probes: BTreeMap<String, Probe> = ["x", "y", "z"]
        .into_iter()
        .map(|name| {
            let mut p = probe(&stalled.http_url(&format!("/{name}")));
            p.timeout_seconds = 1;
            (name.to_string(), p)
        })
        .collect();
    let start = Instant::now();
    let statuses = bounded(Prober::new().probe_all(&probes, &BTreeMap::new(), false)).await;
    let elapsed = start.elapsed();
    assert!(elapsed < Duration::from_millis(2500), "took {elapsed:?}");
    assert!(statuses.values().all(|s| s.failure_count == 1 && !s.healthy));
    assert_eq!(stalled.requests().len(), 3);
}

#[tokio::test]
async fn probe_all_applies_thresholds_across_rounds() {
    let ok = serve_http(|_, _| Reply::Status(200)).await;
    let bad = serve_http(|_, _| Reply::Status(500)).await;
    let mut probes = BTreeMap::new();
    let mut p = probe(&ok.http_url("/"));
    p.success_threshold = 2;
    probes.insert("ok".to_string(), p);
    let mut p = probe(&bad.http_url("/"));
    p.failure_threshold = 2;
    probes.insert("bad".to_string(), p);
    let previous =
        BTreeMap::from([("bad".to_string(), ProbeStatus { healthy: true, success_count: 1, failure_count: 0 })]);

    let prober = Prober::new();
    let round1 = prober.probe_all(&probes, &previous, false).await;
    assert_eq!(round1["ok"], ProbeStatus { healthy: false, success_count: 1, failure_count: 0 });
    assert_eq!(round1["bad"], ProbeStatus { healthy: true, success_count: 0, failure_count: 1 });
    let round2 = prober.probe_all(&probes, &round1, false).await;
    assert!(round2["ok"].healthy);
    assert!(!round2["bad"].healthy);
    assert_eq!(round2["bad"].failure_count, 2);
}

// ---- HTTPS ----------------------------------------------------------------------------------

#[tokio::test]
async fn https_with_ca_cert_succeeds_and_without_it_fails() {
    let pki = Pki::new();
    let server = serve_https(pki.server_config(false), |_, _| Reply::Status(200)).await;
    let url = server.https_url("/livez");
    let prober = Prober::new();

    assert_success(prober.probe_once(&tls_probe(&url, false, &pki.ca_pem_path, "", "")).await);
    // The test CA is not in the system roots.
    let reason = match prober.probe_once(&tls_probe(&url, false, "", "", "")).await {
        ProbeResult::Failure(reason) => reason,
        ProbeResult::Success => panic!("verified without the CA"),
    };
    assert!(!reason.contains("timed out"), "{reason}");
    assert!(reason.to_ascii_lowercase().contains("certificate"), "{reason}");
    // insecure skips verification.
    assert_success(prober.probe_once(&tls_probe(&url, true, "", "", "")).await);
    // …and then the caCert path is ignored, as in Rancher.
    assert_success(prober.probe_once(&tls_probe(&url, true, "/nonexistent/ca.pem", "", "")).await);
    assert_eq!(server.requests().len(), 3);
}

#[tokio::test]
async fn https_requiring_a_client_certificate() {
    let pki = Pki::new();
    let server = serve_https(pki.server_config(true), |_, _| Reply::Status(200)).await;
    let url = server.https_url("/readyz");
    let prober = Prober::new();
    let (ca, cert, key) = (pki.ca_pem_path.as_str(), pki.client_cert_path.as_str(), pki.client_key_path.as_str());

    assert_success(prober.probe_once(&tls_probe(&url, false, ca, cert, key)).await);
    // No identity: the server rejects the handshake.
    let reason = match prober.probe_once(&tls_probe(&url, false, ca, "", "")).await {
        ProbeResult::Failure(reason) => reason,
        ProbeResult::Success => panic!("server accepted a client without a certificate"),
    };
    assert!(!reason.contains("timed out"), "{reason}");
    // Only one of the pair set: no identity either.
    assert!(!prober.probe_once(&tls_probe(&url, false, ca, cert, "")).await.is_success());
    // insecure still presents the identity.
    assert_success(prober.probe_once(&tls_probe(&url, true, "", cert, key)).await);
    assert_eq!(server.requests().len(), 2);
}

#[tokio::test]
async fn unreadable_tls_files_fail_naming_the_file() {
    let pki = Pki::new();
    let server = serve_https(pki.server_config(true), |_, _| Reply::Status(200)).await;
    let url = server.https_url("/");
    let prober = Prober::new();
    let (ca, cert, key) = (pki.ca_pem_path.as_str(), pki.client_cert_path.as_str(), pki.client_key_path.as_str());
    let missing = pki.dir.0.join("missing.pem");
    let missing = missing.to_str().unwrap();
    let garbage = pki.dir.write("garbage.pem", "this is not PEM\n");

    let reason = assert_failure(
        prober.probe_once(&tls_probe(&url, false, missing, "", "")).await,
        &format!("cannot read caCert {missing}"),
    );
    assert!(reason.contains("No such file"), "{reason}");
    assert_failure(prober.probe_once(&tls_probe(&url, false, &garbage, "", "")).await, &format!("caCert {garbage}"));
    assert_failure(
        prober.probe_once(&tls_probe(&url, false, ca, missing, key)).await,
        &format!("cannot read clientCert {missing}"),
    );
    assert_failure(
        prober.probe_once(&tls_probe(&url, false, ca, cert, missing)).await,
        &format!("cannot read clientKey {missing}"),
    );
    assert_failure(
        prober.probe_once(&tls_probe(&url, false, ca, cert, &garbage)).await,
        &format!("clientKey {garbage}"),
    );
    // The same files are fine once they exist: nothing was cached from the failures.
    assert_success(prober.probe_once(&tls_probe(&url, false, ca, cert, key)).await);
    assert_eq!(server.requests().len(), 1);
}

#[tokio::test]
async fn cached_client_is_rebuilt_when_the_ca_file_changes() {
    let pki = Pki::new();
    let other = Pki::new();
    let server = serve_https(pki.server_config(false), |_, _| Reply::Status(200)).await;
    let url = server.https_url("/");
    let dir = TempDir::new();
    let ca_path = dir.write("ca.pem", &std::fs::read_to_string(&other.ca_pem_path).unwrap());
    let p = tls_probe(&url, false, &ca_path, "", "");
    let prober = Prober::new();

    assert!(!prober.probe_once(&p).await.is_success(), "wrong CA must fail");
    // Replace the file with the right CA (length differs in general; make sure it does by
    // appending a comment line, which PEM parsers skip).
    let right = std::fs::read_to_string(&pki.ca_pem_path).unwrap() + "# rotated\n";
    std::fs::write(&ca_path, right).unwrap();
    assert_success(prober.probe_once(&p).await);
}

// ---- statuses -------------------------------------------------------------------------------

#[test]
fn update_status_flips_at_the_thresholds() {
    let p = Probe { success_threshold: 2, failure_threshold: 2, ..Probe::default() };
    let mut s = ProbeStatus::default();
    update_status(&mut s, &p, true);
    assert!(!s.healthy);
    update_status(&mut s, &p, true);
    assert!(s.healthy);
    update_status(&mut s, &p, false);
    assert!(s.healthy);
    update_status(&mut s, &p, false);
    assert!(!s.healthy);
    assert_eq!((s.success_count, s.failure_count), (0, 2));
}

#[test]
fn probe_status_wire_format() {
    let json = |s: &ProbeStatus| serde_json::to_string(s).unwrap();
    assert_eq!(json(&ProbeStatus::default()), "{}");
    assert_eq!(
        json(&ProbeStatus { healthy: true, success_count: 1, failure_count: 0 }),
        r#"{"healthy":true,"successCount":1}"#
    );
    assert_eq!(json(&ProbeStatus { healthy: false, success_count: 0, failure_count: 3 }), r#"{"failureCount":3}"#);
    let map = BTreeMap::from([
        ("etcd".to_string(), ProbeStatus::default()),
        ("kubelet".to_string(), ProbeStatus { healthy: true, success_count: 1, failure_count: 0 }),
    ]);
    assert_eq!(serde_json::to_string(&map).unwrap(), r#"{"etcd":{},"kubelet":{"healthy":true,"successCount":1}}"#);
    let parsed: ProbeStatus = serde_json::from_str(r#"{"healthy":true,"failureCount":2}"#).unwrap();
    assert_eq!(parsed, ProbeStatus { healthy: true, success_count: 0, failure_count: 2 });
}

#[test]
fn probe_wire_format() {
    let p: Probe = serde_json::from_str(
        r#"{"name":"x","initialDelaySeconds":5,"timeoutSeconds":2,"successThreshold":1,
            "failureThreshold":2,"httpGet":{"url":"https://127.0.0.1:6443/readyz",
            "insecure":false,"clientCert":"/c","clientKey":"/k","caCert":"/ca","extra":1}}"#,
    )
    .unwrap();
    assert_eq!(p.timeout_seconds, 2);
    assert_eq!(p.http_get.ca_cert, "/ca");
    assert_eq!(p.http_get.client_key, "/k");
    assert_eq!(serde_json::to_string(&Probe::default()).unwrap(), r#"{"httpGet":{}}"#);
}
