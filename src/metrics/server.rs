//! The metrics endpoint: `GET /metrics` on `metricsAddress`, nothing else (every other method or
//! path is 404). It owns the listening socket and its connections, and must never hold up the
//! reconcile loop: it runs as its own task, encodes on the blocking pool, and bounds what a slow
//! or hostile client can hold: at most [`MAX_CONNECTIONS`] connections at once (more are closed
//! at once), [`HEADER_TIMEOUT`] to send a request's head (an idle keep-alive connection is
//! closed after as long), [`MAX_HEAD_BYTES`] of it buffered, and [`CONNECTION_TIMEOUT`] for a
//! whole connection, however busy.
//!
//! The answer is the Prometheus text format (0.0.4), or OpenMetrics 1.0 when the client's
//! `Accept` asks for it (Prometheus does), chosen by [`negotiate`].

use super::Metrics;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

/// Connections served at once; more are closed as soon as they are accepted.
pub const MAX_CONNECTIONS: usize = 16;
/// Time a client has to send the head of a request.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a connection may stay open, however busy.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes of a request head buffered, at most.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;

/// The exposition format of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// The Prometheus text format, version 0.0.4 (what `promtool check metrics` reads).
    Text,
    /// OpenMetrics 1.0 text.
    OpenMetrics,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// The format for a request's `Accept` header: OpenMetrics when it lists
/// `application/openmetrics-text` (with a non-zero quality), the Prometheus text format
/// otherwise.
pub fn negotiate(accept: Option<&str>) -> Format {
    let Some(accept) = accept else { return Format::Text };
    let wants = accept.split(',').any(|item| {
        let mut parts = item.split(';').map(str::trim);
        let media = parts.next().unwrap_or_default();
        let q_zero =
            parts.any(|p| p.strip_prefix("q=").and_then(|q| q.trim().parse::<f64>().ok()).is_some_and(|q| q <= 0.0));
        media.eq_ignore_ascii_case("application/openmetrics-text") && !q_zero
    });
    if wants { Format::OpenMetrics } else { Format::Text }
}

/// What a request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Metrics,
    NotFound,
}

/// `GET /metrics` (any query string) is the metrics; everything else is not found.
pub fn route(method: &Method, path: &str) -> Route {
    if method == Method::GET && path == "/metrics" { Route::Metrics } else { Route::NotFound }
}

/// Bind the endpoint's socket. An address in use (or not ours to bind) is an error naming it.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(addr).await.map_err(|e| format!("metricsAddress {addr}: cannot listen: {e}"))
}

/// Serve `metrics` on `listener` until `shutdown` turns true (or its sender is gone).
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, mut shutdown: watch::Receiver<bool>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut full_warned = false;
    loop {
        if *shutdown.borrow() {
            return;
        }
        let accepted = tokio::select! {
            r = listener.accept() => r,
            r = shutdown.changed() => {
                if r.is_err() { return }
                continue;
            }
        };
        let (stream, _) = match accepted {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors and the like: say so, and do not spin on it.
                tracing::warn!("metrics endpoint: cannot accept a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if !std::mem::replace(&mut full_warned, true) {
                tracing::warn!("metrics endpoint: {MAX_CONNECTIONS} connections open; closing new ones until one ends");
            }
            drop(stream);
            continue;
        };
        full_warned = false;
        let m = metrics.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| answer(req, m.clone()));
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES)
                .serve_connection(TokioIo::new(stream), service);
            // A connection past its time is dropped, whatever it is doing.
            let _ = tokio::time::timeout(CONNECTION_TIMEOUT, conn).await;
            drop(slot);
        });
    }
}

async fn answer(req: Request<Incoming>, m: Arc<Metrics>) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let reply = |status: StatusCode, content_type: &'static str, body: Bytes| {
        let mut r = Response::new(Full::new(body));
        *r.status_mut() = status;
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
        Ok(r)
    };
    if route(req.method(), req.uri().path()) == Route::NotFound {
        return reply(StatusCode::NOT_FOUND, "text/plain; charset=utf-8", Bytes::from_static(b"not found\n"));
    }
    let accept = req.headers().get(hyper::header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = negotiate(accept);
    match tokio::task::spawn_blocking(move || m.encode(format)).await {
        Ok(text) => reply(StatusCode::OK, format.content_type(), Bytes::from(text)),
        Err(e) => {
            tracing::warn!("metrics endpoint: encoding failed: {e}");
            reply(StatusCode::INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8", Bytes::from_static(b"error\n"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn only_get_metrics_is_routed() {
        let table = [
            (Method::GET, "/metrics", Route::Metrics),
            (Method::GET, "/", Route::NotFound),
            (Method::GET, "/metrics/", Route::NotFound),
            (Method::GET, "/metricsx", Route::NotFound),
            (Method::GET, "/debug", Route::NotFound),
            (Method::POST, "/metrics", Route::NotFound),
            (Method::PUT, "/metrics", Route::NotFound),
            (Method::DELETE, "/metrics", Route::NotFound),
        ];
        for (m, p, want) in table {
            assert_eq!(route(&m, p), want, "{m} {p}");
        }
    }

    #[test]
    fn openmetrics_only_when_asked_for() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        let table = [
            (None, Format::Text),
            (Some(""), Format::Text),
            (Some("*/*"), Format::Text),
            (Some("text/plain"), Format::Text),
            (Some(prometheus), Format::OpenMetrics),
            (Some("Application/OpenMetrics-Text"), Format::OpenMetrics),
            (Some("application/openmetrics-text; q=0"), Format::Text),
            (Some("text/plain, application/openmetrics-text;q=0.0"), Format::Text),
            (Some("application/openmetrics-textx"), Format::Text),
        ];
        for (accept, want) in table {
            assert_eq!(negotiate(accept), want, "{accept:?}");
        }
    }

    /// One raw HTTP/1.1 exchange; the answer's status line and whole text.
    /// A connection the server closed early (reset) reads as what arrived before.
    async fn exchange(port: u16, request: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let _ = s.write_all(request.as_bytes()).await;
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
        assert!(read.is_ok(), "no answer within 10s");
        String::from_utf8_lossy(&out).into_owned()
    }

    /// The endpoint serving `m` on a loopback port: the port, the shutdown switch, the task.
    async fn serving(m: Arc<Metrics>) -> (u16, watch::Sender<bool>, tokio::task::JoinHandle<()>) {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (tx, rx) = watch::channel(false);
        (port, tx, tokio::spawn(serve(listener, m, rx)))
    }

    #[tokio::test]
    async fn the_endpoint_serves_metrics_and_404s_everything_else() {
        let m = Arc::new(Metrics::new(super::super::Directories::default()));
        m.plan_recorded(super::super::PlanResult::Succeeded);
        let (port, tx, server) = serving(m).await;
        let ok = exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(ok.contains("content-type: text/plain; version=0.0.4"), "{ok}");
        assert!(ok.contains("nodeplan_plans_total{result=\"succeeded\"} 1"), "{ok}");
        let om = exchange(
            port,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(om.contains("content-type: application/openmetrics-text"), "{om}");
        assert!(om.trim_end().ends_with("# EOF"), "{om}");
        for req in [
            "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            "GET /metrics/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        ] {
            let a = exchange(port, req).await;
            assert!(a.starts_with("HTTP/1.1 404"), "{req:?}: {a}");
            assert!(!a.contains("nodeplan_"), "{req:?}: {a}");
        }
        // A request head larger than the buffer is refused, not buffered without end.
        let huge = format!("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\n\r\n", "a".repeat(MAX_HEAD_BYTES * 2));
        let a = exchange(port, &huge).await;
        assert!(a.is_empty() || a.starts_with("HTTP/1.1 431"), "{a}");
        tx.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(10), server).await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn connections_beyond_the_limit_are_closed_and_the_endpoint_keeps_serving() {
        let (port, _tx, _server) = serving(Arc::new(Metrics::new(super::super::Directories::default()))).await;
        // Idle clients that never send a request take every slot.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap());
        }
        // One more is closed by the server without an answer (read ends at EOF, not a timeout).
        let extra = exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(extra.is_empty(), "{extra}");
        drop(idle);
        // Once they are gone the endpoint serves again (the server notices the closed sockets as
        // their connections end: retried with a bound, each try a real request).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let a = exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
            if a.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "the endpoint never served again");
            tokio::task::yield_now().await;
        }
    }

    /// A client that sends nothing, half a request head, or keeps its connection open after an
    /// answer is dropped by the header timeout. On a paused clock: the times are exact and the
    /// test takes no wall time.
    #[tokio::test(start_paused = true)]
    async fn slow_clients_are_dropped_on_time() {
        let (port, _tx, _server) = serving(Arc::new(Metrics::new(super::super::Directories::default()))).await;
        let cases: [(&str, &[u8], Duration); 3] = [
            ("nothing", b"", HEADER_TIMEOUT),
            ("half a head", b"GET /metrics HTTP/1.1\r\nHost: x\r\n", HEADER_TIMEOUT),
            ("an idle keep-alive connection", b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", HEADER_TIMEOUT),
        ];
        for (what, sent, deadline) in cases {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            let start = tokio::time::Instant::now();
            s.write_all(sent).await.unwrap();
            let mut out = Vec::new();
            let _ = s.read_to_end(&mut out).await;
            let took = start.elapsed();
            assert_eq!(out.starts_with(b"HTTP/1.1 200"), !sent.is_empty() && sent.ends_with(b"\r\n\r\n"), "{what}");
            assert!(
                took >= deadline.saturating_sub(Duration::from_secs(1)) && took <= deadline + Duration::from_secs(1),
                "{what}: closed after {took:?}, expected {deadline:?}"
            );
        }
    }

    #[test]
    fn an_address_in_use_is_a_clear_error() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let first = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
            let addr = first.local_addr().unwrap();
            let e = bind(addr).await.unwrap_err();
            assert!(e.contains("metricsAddress") && e.contains(&addr.to_string()) && e.contains("in use"), "{e}");
        });
    }
}
