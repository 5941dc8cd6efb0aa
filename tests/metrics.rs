//! Prometheus metrics end to end: the real `nodeplan agent` in local mode with `metricsAddress`,
//! scraped over HTTP, checked by `promtool check metrics` and scraped by a real Prometheus server
//! (Debian's `prometheus` package; skipped loudly outside CI when it is missing).

mod common;

use common::*;
use nodeplan::plan::PlanState;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

struct Setup {
    node: LocalNode,
    port: u16,
}

impl std::ops::Deref for Setup {
    type Target = LocalNode;
    fn deref(&self) -> &LocalNode {
        &self.node
    }
}

/// A loopback port nobody listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Setup {
    fn new() -> Setup {
        let port = free_port();
        let node =
            LocalNode::new(|d| format!("imagesDirectory: {}/images\nmetricsAddress: 127.0.0.1:{port}\n", d.display()));
        Setup { node, port }
    }
    /// The agent, once its endpoint listens (the log line is the handshake).
    fn start(&self) -> AgentProc {
        let mut agent = AgentProc::start(&self.config());
        agent.wait_log("metrics: serving GET /metrics");
        agent
    }
}

fn sh(name: &str, script: &str) -> serde_json::Value {
    serde_json::json!({"name": name, "command": "sh", "args": ["-c", script]})
}

/// One HTTP/1.1 GET on loopback: the status code, the headers (lower-cased) and the body.
fn http_get(port: u16, target: &str, accept: Option<&str>) -> (u16, String, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(GUARD)).unwrap();
    let accept = accept.map(|a| format!("Accept: {a}\r\n")).unwrap_or_default();
    write!(s, "GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n{accept}Connection: close\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_string())
}

fn scrape(port: u16) -> String {
    let (status, head, body) = http_get(port, "/metrics", None);
    assert_eq!(status, 200, "{head}\n{body}");
    assert!(head.contains("content-type: text/plain; version=0.0.4"), "{head}");
    body
}

/// The value of the sample `series` (`name{labels}` exactly as exposed), if there is one.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Scrape until `pred` holds for the exposition (a bounded poll of the endpoint's answers).
fn wait_metrics(port: u16, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + GUARD;
    loop {
        let text = scrape(port);
        if pred(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "the metrics never showed {what}:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn which(cmd: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(cmd)).find(|p| p.is_file())
}

/// `promtool check metrics` on `text`: its exit status and what it said.
fn promtool_check(promtool: &Path, text: &str) -> (bool, String) {
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), said)
}

/// A plan that succeeds (with a probe), one that fails, one canceled while its instruction runs,
/// one paused before it starts: the counts, the stop ladder, the cancel latency, the probe gauge
/// and the directory sizes follow, and `promtool` accepts the exposition.
#[test]
fn counts_follow_what_the_agent_does_and_promtool_accepts_them() {
    let Some(promtool) = which("promtool") else {
        require(false, "promtool (Debian's prometheus package)");
        return;
    };
    let s = Setup::new();
    let health = Arc::new(AtomicU16::new(200));
    let web = http_server(health.clone());
    let ready = s.p("ready");
    mkfifo(&ready);
    // Applied in path order: bad, cancel, held, ok.
    s.plan("bad", serde_json::json!({"instructions": [sh("fails", "exit 3")]}));
    s.plan("cancel", serde_json::json!({"instructions": [sh("waits", &format!("echo > {ready}; exec sleep 600"))]}));
    s.plan("held", serde_json::json!({"instructions": [sh("never", "true")]}));
    std::fs::write(s.dir.path().join("plans/held.paused"), b"").unwrap();
    let ok = s.plan(
        "ok",
        serde_json::json!({
            "instructions": [sh("works", "true")],
            "probes": {"web": {"httpGet": {"url": format!("http://127.0.0.1:{web}/healthz")}, "successThreshold": 1, "failureThreshold": 1}}
        }),
    );
    // Series name plans by the id every command shows, and nodeplan_plan_info says where each is.
    let ok_id = nodeplan::plan::id_of(&ok).unwrap();
    let ok_info = format!("nodeplan_plan_info{{plan=\"{ok_id}\",name=\"{}\"}}", s.plan_path("ok").display());
    let mut agent = s.start();
    let before = scrape(s.port);
    // Every result's count is there at 0 before anything ran, and the build is named.
    for result in ["succeeded", "failed", "paused", "canceled"] {
        let series = format!("nodeplan_plans_total{{result=\"{result}\"}}");
        assert_eq!(value(&before, &series), Some(0.0), "{series} before anything ran:\n{before}");
    }
    assert!(
        before.contains(&format!("nodeplan_build_info{{version=\"{}\",commit=\"", env!("CARGO_PKG_VERSION"))),
        "{before}"
    );
    assert_eq!(value(&before, "nodeplan_api_refusals{status=\"401\"}"), Some(0.0), "{before}");
    for series in [
        "nodeplan_stop_ladder_total{outcome=\"survivors\"}",
        "nodeplan_pid_record_recoveries_total{result=\"not_stopped\"}",
        "nodeplan_write_retries_total{target=\"secret\",reason=\"conflict\"}",
    ] {
        assert_eq!(value(&before, series), Some(0.0), "{series} before anything ran:\n{before}");
    }

    read_fifo(&ready);
    let out =
        Command::new(NODEPLAN).args(["plan", "cancel", s.plan_path("cancel").to_str().unwrap()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    s.wait_pos("cancel", "canceled", |p| p.plan_state == Some(PlanState::Canceled));
    s.wait_pos("ok", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    let probe = format!("nodeplan_probe_healthy{{plan=\"{ok_id}\",probe=\"web\"}}");
    let t = wait_metrics(s.port, "the outcomes", |t| {
        value(t, "nodeplan_cancel_latency_seconds_count") == Some(1.0)
            && value(t, "nodeplan_plans_total{result=\"succeeded\"}") == Some(1.0)
            && value(t, &probe) == Some(1.0)
            && value(t, &ok_info) == Some(1.0)
            && value(t, "nodeplan_plans_failed") == Some(1.0)
    });
    assert_eq!(t.lines().filter(|l| l.starts_with("nodeplan_plan_info{")).count(), 4, "one per plan file:\n{t}");
    assert_eq!(value(&t, "nodeplan_plans_total{result=\"canceled\"}"), Some(1.0), "{t}");
    assert_eq!(value(&t, "nodeplan_plans_total{result=\"paused\"}"), Some(1.0), "{t}");
    assert!(value(&t, "nodeplan_plans_total{result=\"failed\"}").is_some_and(|n| n >= 1.0), "{t}");
    // The sleep died of SIGTERM: one ladder run, no SIGKILL, nothing left.
    assert_eq!(value(&t, "nodeplan_stop_ladder_total{outcome=\"exited_on_term\"}"), Some(1.0), "{t}");
    assert_eq!(value(&t, "nodeplan_stop_ladder_total{outcome=\"killed\"}"), Some(0.0), "{t}");
    assert_eq!(value(&t, "nodeplan_stop_survivors_total"), Some(0.0), "{t}");
    let count = |kind: &str, result: &str| {
        value(&t, &format!("nodeplan_instruction_duration_seconds_count{{kind=\"{kind}\",result=\"{result}\"}}"))
    };
    assert_eq!(count("one_time", "canceled"), Some(1.0), "{t}");
    assert_eq!(count("one_time", "ok"), Some(1.0), "{t}");
    assert!(count("one_time", "failed").is_some_and(|n| n >= 1.0), "{t}");
    // The work directory holds execution directories, the archive the applied plan: measured
    // again once the first scrape's measurement (empty directories) is 10 s old.
    let size = |t: &str, dir: &str| value(t, &format!("nodeplan_directory_size_bytes{{directory=\"{dir}\"}}"));
    let t = wait_metrics(s.port, "the directories' sizes", |t| {
        ["work", "applied"].iter().all(|dir| size(t, dir).is_some_and(|b| b > 0.0))
    });
    for dir in ["work", "applied"] {
        assert_eq!(value(&t, &format!("nodeplan_directory_size_complete{{directory=\"{dir}\"}}")), Some(1.0), "{t}");
    }
    assert_eq!(value(&t, "nodeplan_directory_size_bytes{directory=\"images\"}"), Some(0.0), "missing: {t}");

    let (ok, said) = promtool_check(&promtool, &t);
    assert!(ok, "promtool check metrics failed:\n{said}\n--- exposition:\n{t}");

    // The probe turns unhealthy, then goes away with its plan.
    health.store(503, Ordering::SeqCst);
    wait_metrics(s.port, "the probe unhealthy", |t| value(t, &probe) == Some(0.0));
    std::fs::remove_file(s.plan_path("ok")).unwrap();
    wait_metrics(s.port, "the probe gone", |t| !t.contains("nodeplan_probe_healthy{") && value(t, &ok_info).is_none());
    // The failed plan is counted as failed now until it goes away.
    std::fs::remove_file(s.plan_path("bad")).unwrap();
    wait_metrics(s.port, "no plan failed now", |t| value(t, "nodeplan_plans_failed") == Some(0.0));

    // OpenMetrics for those who ask; 404 for every other path.
    let (status, head, body) = http_get(s.port, "/metrics", Some("application/openmetrics-text; version=1.0.0"));
    assert_eq!(status, 200);
    assert!(head.contains("content-type: application/openmetrics-text"), "{head}");
    assert!(body.trim_end().ends_with("# EOF"), "{body}");
    for target in ["/", "/metrics/extra", "/debug/pprof", "/api/v1/query"] {
        assert_eq!(http_get(s.port, target, None).0, 404, "{target}");
    }
    assert_eq!(agent.stop(), 0);
}

/// An agent killed while its instruction ignores SIGTERM leaves it running; the next agent finds
/// it through its PID record and stops it (SIGTERM is ignored, so SIGKILL after `stopTimeout`):
/// one record recovered as `stopped`, one ladder run that `killed`.
#[test]
fn a_leftover_stopped_at_restart_is_counted() {
    let s = Setup::new();
    s.plan(
        "stuck",
        serde_json::json!({"instructions": [{"name": "stuck", "command": HELPER, "args": ["term-ignore"]}]}),
    );
    let mut first = AgentProc::start_with(&s.config(), &[OUTPUT_LOGGED]);
    let leftover: i32 = first.wait_log("ready ").split_whitespace().last().unwrap().parse().unwrap();
    first.crash();
    assert!(alive(leftover));
    let mut second = s.start();
    second.wait_log("stopped leftover");
    let gone = !alive(leftover);
    kill_all(&[leftover]);
    assert!(gone, "the leftover was not stopped");
    let t = wait_metrics(s.port, "the recovery", |t| {
        value(t, "nodeplan_pid_record_recoveries_total{result=\"stopped\"}") == Some(1.0)
    });
    assert_eq!(value(&t, "nodeplan_stop_ladder_total{outcome=\"killed\"}"), Some(1.0), "{t}");
    assert_eq!(value(&t, "nodeplan_stop_ladder_total{outcome=\"exited_on_term\"}"), Some(0.0), "{t}");
    assert_eq!(second.stop(), 0);
}

fn sha256(b: &[u8]) -> String {
    use sha2::Digest;
    format!("sha256:{:x}", sha2::Sha256::digest(b))
}

/// A registry without authentication serving one image `test/img:v1` whose single layer holds
/// an executable `run.sh`; returns its port and the layer's size in bytes.
fn tiny_registry() -> (u16, usize) {
    let mut tar = tar::Builder::new(Vec::new());
    let script = b"#!/bin/sh\nexit 0\n";
    let mut h = tar::Header::new_gnu();
    h.set_size(script.len() as u64);
    h.set_mode(0o755);
    h.set_cksum();
    tar.append_data(&mut h, "run.sh", &script[..]).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&tar.into_inner().unwrap()).unwrap();
    let layer = gz.finish().unwrap();
    let config = br#"{"architecture":"amd64","os":"linux"}"#.to_vec();
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha256(&config), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": sha256(&layer), "size": layer.len()}],
    }))
    .unwrap();
    let size = layer.len();
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && c.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let head = String::from_utf8_lossy(&head).into_owned();
            let path = head.split_whitespace().nth(1).unwrap_or("").to_string();
            let (status, ct, body): (&str, &str, &[u8]) = if path == "/v2/test/img/manifests/v1" {
                ("200 OK", "application/vnd.oci.image.manifest.v1+json", &manifest)
            } else if path == format!("/v2/test/img/blobs/{}", sha256(&layer)) {
                ("200 OK", "application/octet-stream", &layer)
            } else {
                ("404 Not Found", "text/plain", b"")
            };
            let _ = write!(
                c,
                "HTTP/1.1 {status}\r\nContent-Type: {ct}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = c.write_all(body);
        }
    });
    (port, size)
}

/// An `image` instruction pulled from a registry: its layer bytes and one successful pull.
#[test]
fn an_image_pull_is_counted() {
    let s = Setup::new();
    let (port, layer_bytes) = tiny_registry();
    let host = format!("127.0.0.1:{port}");
    let registries = s.p("registries.yaml");
    std::fs::write(&registries, format!("mirrors:\n  \"{host}\":\n    endpoint: [\"http://{host}\"]\n")).unwrap();
    let config = s.p("config.yaml");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(&format!("agentRegistriesFile: {registries}\n"));
    std::fs::write(&config, text).unwrap();
    s.plan("img", serde_json::json!({"instructions": [{"name": "install", "image": format!("{host}/test/img:v1")}]}));
    let mut agent = s.start();
    s.wait_pos("img", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    let t = wait_metrics(s.port, "the pull", |t| {
        value(t, "nodeplan_image_pull_duration_seconds_count{result=\"ok\"}") == Some(1.0)
    });
    assert_eq!(value(&t, "nodeplan_image_pull_bytes_total"), Some(layer_bytes as f64), "{t}");
    assert_eq!(value(&t, "nodeplan_image_pull_duration_seconds_count{result=\"error\"}"), None, "{t}");
    assert_eq!(agent.stop(), 0);
}

/// Two probes whose names share their first 64 characters are two series (they were one, cut to
/// the same label, each overwriting the other's health): one healthy, one not.
#[test]
fn probes_with_a_long_common_prefix_are_distinct_series() {
    let s = Setup::new();
    let (up, down) = (http_server(Arc::new(AtomicU16::new(200))), http_server(Arc::new(AtomicU16::new(500))));
    let common = "p".repeat(64);
    let probe = |port: u16| serde_json::json!({"httpGet": {"url": format!("http://127.0.0.1:{port}/")}, "successThreshold": 1, "failureThreshold": 1});
    s.plan(
        "twins",
        serde_json::json!({
            "instructions": [sh("works", "true")],
            "probes": {format!("{common}-up"): probe(up), format!("{common}-down"): probe(down)}
        }),
    );
    let mut agent = s.start();
    let series = |t: &str| -> Vec<String> {
        t.lines().filter(|l| l.starts_with("nodeplan_probe_healthy{")).map(str::to_string).collect()
    };
    let t = wait_metrics(s.port, "both probes, one healthy", |t| {
        let v = series(t);
        v.len() == 2 && v.iter().any(|l| l.ends_with(" 1")) && v.iter().any(|l| l.ends_with(" 0"))
    });
    for l in series(&t) {
        let label = l.split("probe=\"").nth(1).and_then(|r| r.split('"').next()).unwrap_or_default();
        assert!(label.starts_with(&"p".repeat(55)) && label.chars().count() <= 64, "{l}");
    }
    assert_eq!(agent.stop(), 0);
}

/// A connection flood leaves the endpoint scrapeable: more idle connections than the cap (they
/// used to take every slot, and every scrape was closed unanswered), each with the first byte of
/// a request sent, are closed oldest first to make room, and scrapes are answered; a connection
/// that pipelines requests gets its budget of answers and is closed (it used to be served for as
/// long as it sent).
#[test]
fn a_connection_flood_leaves_the_endpoint_scrapeable() {
    use nodeplan::metrics::server::{MAX_CONNECTIONS, REQUESTS_PER_CONNECTION};
    let s = Setup::new();
    let mut agent = s.start();
    let flood = MAX_CONNECTIONS + 8;
    let mut idle: Vec<std::net::TcpStream> = (0..flood)
        .map(|_| {
            let mut c = std::net::TcpStream::connect(("127.0.0.1", s.port)).unwrap();
            c.write_all(b"G").unwrap();
            c
        })
        .collect();
    for _ in 0..10 {
        scrape(s.port);
    }
    // The oldest made room; the newest is still open (the header timeout is seconds away).
    for (i, c) in idle.iter_mut().take(8).enumerate() {
        c.set_read_timeout(Some(GUARD)).unwrap();
        // Closed with its byte unread: an end of file or a reset.
        let r = c.read(&mut [0u8; 1]).map_err(|e| e.kind());
        assert!(matches!(r, Ok(0) | Err(std::io::ErrorKind::ConnectionReset)), "idle connection {i}: {r:?}");
    }
    let newest = &mut idle[flood - 1];
    newest.set_nonblocking(true).unwrap();
    let open = newest.read(&mut [0u8; 1]).map_err(|e| e.kind());
    assert_eq!(open, Err(std::io::ErrorKind::WouldBlock), "the newest idle connection was closed");
    let mut c = std::net::TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    c.set_read_timeout(Some(GUARD)).unwrap();
    let budget = REQUESTS_PER_CONNECTION as usize;
    c.write_all("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".repeat(budget + 5).as_bytes()).unwrap();
    let mut raw = Vec::new();
    c.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw);
    assert_eq!(text.matches("HTTP/1.1 200").count(), budget, "answers on one pipelined connection");
    assert_eq!(text.to_ascii_lowercase().matches("connection: close").count(), 1, "the last answer closes");
    drop(idle);
    assert_eq!(agent.stop(), 0);
}

/// Without `metricsAddress` nothing listens: the agent runs, the port stays closed.
#[test]
fn off_by_default() {
    let s = Setup::new();
    let config = s.p("config.yaml");
    let text = std::fs::read_to_string(&config).unwrap();
    let without: String = text.lines().filter(|l| !l.starts_with("metricsAddress")).map(|l| format!("{l}\n")).collect();
    std::fs::write(&config, without).unwrap();
    s.plan("ok", serde_json::json!({"instructions": [sh("works", "true")]}));
    let mut agent = AgentProc::start(Path::new(&config));
    // The endpoint is bound before this line is logged.
    agent.wait_log("nodeplan agent starting");
    s.wait_pos("ok", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    assert!(!agent.seen.iter().any(|l| l.contains("metrics")), "{}", agent.seen.join("\n"));
    let refused = std::net::TcpStream::connect(("127.0.0.1", s.port));
    assert!(refused.is_err(), "something listens on the metrics port");
    assert_eq!(agent.stop(), 0);
}

#[test]
fn a_bad_or_busy_metrics_address_is_one_line_and_exit_2() {
    let s = Setup::new();
    let config = s.p("config.yaml");
    let run = |extra: &[&str]| {
        let out = Command::new(NODEPLAN).args(["agent", "--config", &config]).args(extra).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for bad in ["localhost:9100", "127.0.0.1", ":0", "9100"] {
        let (code, err) = run(&["--metrics-address", bad]);
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{bad}: {err}");
        assert!(err.contains("metricsAddress") && err.contains(bad), "{bad}: {err}");
    }
    // Taken by someone else: the agent says so and starts nothing.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (code, err) = run(&["--metrics-address", &addr]);
    assert_eq!(code, Some(2), "{err}");
    let last = err.trim_end().lines().last().unwrap_or_default();
    assert!(last.contains("metricsAddress") && last.contains(&addr) && last.contains("in use"), "{err}");
    assert!(!err.contains("applying"), "nothing ran: {err}");
}

/// Kills Prometheus when the test ends, however it ends.
struct Prometheus(std::process::Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `s` for a URL's query string.
fn query_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The value Prometheus has for an instant query: `None` until it answers with one sample.
fn prom_query(port: u16, query: &str) -> Option<String> {
    let target = format!("/api/v1/query?query={}", query_escape(query));
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(GUARD)).ok()?;
    write!(s, "GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw);
    let body = text.split_once("\r\n\r\n")?.1;
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    let result = v["data"]["result"].as_array()?;
    match result.as_slice() {
        [one] => one["value"][1].as_str().map(str::to_string),
        _ => None,
    }
}

/// A real Prometheus server scrapes the agent every second: the agent's target is up and its
/// counts are what the agent did, read through Prometheus's query API.
#[test]
fn a_real_prometheus_scrapes_the_agent() {
    let Some(prometheus) = which("prometheus") else {
        require(false, "prometheus (Debian's prometheus package)");
        return;
    };
    let s = Setup::new();
    s.plan("ok", serde_json::json!({"instructions": [sh("works", "true")]}));
    let mut agent = s.start();
    s.wait_pos("ok", "succeeded", |p| p.plan_state == Some(PlanState::Succeeded));
    wait_metrics(s.port, "the success", |t| value(t, "nodeplan_plans_total{result=\"succeeded\"}") == Some(1.0));

    let prom_dir = s.dir.path().join("prometheus");
    std::fs::create_dir(&prom_dir).unwrap();
    let config = prom_dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: nodeplan\n    \
             static_configs:\n      - targets: ['127.0.0.1:{}']\n",
            s.port
        ),
    )
    .unwrap();
    let prom_port = free_port();
    let child = Command::new(prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", prom_dir.join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(prom_dir.join("prometheus.log")).unwrap()))
        .spawn()
        .unwrap();
    let mut prom = Prometheus(child);
    // Prometheus answers its API once it runs; it scrapes every second. Bounded: a minute covers
    // its start-up (WAL, first scrape) on a loaded machine.
    let deadline = Instant::now() + Duration::from_secs(60);
    let wanted = [("up{job=\"nodeplan\"}", "1"), ("nodeplan_plans_total{job=\"nodeplan\",result=\"succeeded\"}", "1")];
    loop {
        let got: Vec<Option<String>> = wanted.iter().map(|(q, _)| prom_query(prom_port, q)).collect();
        if wanted.iter().zip(&got).all(|((_, want), got)| got.as_deref() == Some(*want)) {
            break;
        }
        if let Ok(Some(status)) = prom.0.try_wait() {
            let log = std::fs::read_to_string(prom_dir.join("prometheus.log")).unwrap_or_default();
            panic!("prometheus exited ({status}):\n{log}");
        }
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(prom_dir.join("prometheus.log")).unwrap_or_default();
            panic!("prometheus never showed the agent's values (got {got:?}):\n{log}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(prom);
    assert_eq!(agent.stop(), 0);
}
