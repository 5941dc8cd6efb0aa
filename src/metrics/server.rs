//! The metrics endpoint: `GET /metrics` on `metricsAddress`, nothing else (every other method or
//! path is 404). It owns the listening socket and its connections, and must never hold up the
//! reconcile loop: it runs as its own task, encodes on the blocking pool, and stays scrapeable
//! whatever a hostile client does:
//! - at most [`MAX_CONNECTIONS`] connections at once; a new one beyond that takes the place of the
//!   oldest idle one (not being answered: waiting for its first request or its next), which is
//!   closed; only when every connection is being answered is the new one closed at once;
//! - [`FIRST_BYTE_TIMEOUT`] for a new connection's first byte, [`HEADER_TIMEOUT`] to send a
//!   request's head (an idle keep-alive connection is closed after as long), [`MAX_HEAD_BYTES`] of
//!   it buffered, and [`CONNECTION_TIMEOUT`] for a whole connection, however busy;
//! - at most [`REQUESTS_PER_CONNECTION`] requests on one connection: the last answer says
//!   `Connection: close` and the connection ends (pipelined requests beyond it are not read);
//! - the exposition is rendered at most once per [`CACHE_FOR`] per format; requests meanwhile get
//!   the same bytes, so a flood of requests costs copies, not renders.
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
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

/// Connections open at once; a new one beyond this replaces the oldest idle one.
pub const MAX_CONNECTIONS: usize = 16;
/// Time a new connection has to send its first byte.
pub const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(2);
/// Time a client has to send the head of a request.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a connection may stay open, however busy.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes of a request head buffered, at most.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Requests answered on one connection; the last answer closes it. (A scraper reconnects: at one
/// scrape every 15 s and [`CONNECTION_TIMEOUT`], it makes at most 2 on one connection.)
pub const REQUESTS_PER_CONNECTION: u32 = 8;
/// How long a rendered exposition is served again before it is rendered anew.
pub const CACHE_FOR: Duration = Duration::from_secs(1);

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
    TcpListener::bind(addr).await.map_err(|e| match e.kind() {
        // Said in words everywhere (Windows's own text is long, and Wine has none).
        std::io::ErrorKind::AddrInUse => {
            format!("metricsAddress {addr}: cannot listen: the address is in use (another process listens there)")
        }
        _ => format!("metricsAddress {addr}: cannot listen: {e}"),
    })
}

/// One open connection, as the accept loop sees it.
struct Conn {
    /// Being answered now (never chosen to make room).
    answering: AtomicBool,
    /// When it last started waiting for a request (admitted, or answered): a tick of
    /// [`Conns::ticks`], so the oldest idle connection is the one with the lowest.
    idle_since: AtomicU64,
    /// Requests it has sent.
    requests: AtomicU32,
    /// It has sent a byte.
    read_any: AtomicBool,
    /// Closes it (to make room for a new one).
    close: Notify,
}

/// The open connections; the accept loop admits, the connections remove themselves.
struct Conns {
    /// A clock that only counts: one tick per admission or answer.
    ticks: AtomicU64,
    open: Mutex<Vec<Arc<Conn>>>,
}

impl Conns {
    fn now(&self) -> u64 {
        self.ticks.fetch_add(1, Ordering::SeqCst)
    }

    /// A slot for a new connection: when all are taken, the oldest idle connection is closed to
    /// make room; `None` when every connection is being answered.
    fn admit(&self) -> Option<Arc<Conn>> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if open.len() >= MAX_CONNECTIONS {
            let oldest = open
                .iter()
                .enumerate()
                .filter(|(_, c)| !c.answering.load(Ordering::SeqCst))
                .min_by_key(|(_, c)| c.idle_since.load(Ordering::SeqCst))
                .map(|(i, _)| i)?;
            open.swap_remove(oldest).close.notify_one();
        }
        let c = Arc::new(Conn {
            answering: AtomicBool::new(false),
            idle_since: AtomicU64::new(self.now()),
            requests: AtomicU32::new(0),
            read_any: AtomicBool::new(false),
            close: Notify::new(),
        });
        open.push(c.clone());
        Some(c)
    }

    fn remove(&self, c: &Arc<Conn>) {
        self.open.lock().unwrap_or_else(|e| e.into_inner()).retain(|o| !Arc::ptr_eq(o, c));
    }
}

/// The last rendering of each format, and when it was made.
struct Cache {
    metrics: Arc<Metrics>,
    renders: tokio::sync::Mutex<[Option<(Instant, Bytes)>; 2]>,
}

impl Cache {
    /// The exposition in `format`: the cached one when it is younger than [`CACHE_FOR`], else a
    /// new rendering (one at a time; requests meanwhile wait for it and share it).
    async fn get(&self, format: Format) -> Result<Bytes, tokio::task::JoinError> {
        let mut renders = self.renders.lock().await;
        let slot = &mut renders[format as usize];
        if let Some((at, b)) = slot.as_ref()
            && at.elapsed() < CACHE_FOR
        {
            return Ok(b.clone());
        }
        let m = self.metrics.clone();
        let text = Bytes::from(tokio::task::spawn_blocking(move || m.encode(format)).await?);
        *slot = Some((Instant::now(), text.clone()));
        Ok(text)
    }
}

/// A connection's socket that notes its first byte read.
struct Watched {
    inner: tokio::net::TcpStream,
    conn: Arc<Conn>,
}

impl AsyncRead for Watched {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.conn.read_any.store(true, Ordering::SeqCst);
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Serve `metrics` on `listener` until `shutdown` turns true (or its sender is gone).
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, mut shutdown: watch::Receiver<bool>) {
    let conns = Arc::new(Conns { ticks: AtomicU64::new(0), open: Mutex::new(Vec::new()) });
    let cache = Arc::new(Cache { metrics, renders: tokio::sync::Mutex::new([None, None]) });
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
        let Some(conn) = conns.admit() else {
            if !std::mem::replace(&mut full_warned, true) {
                tracing::warn!(
                    "metrics endpoint: {MAX_CONNECTIONS} connections being answered; closing new ones until one ends"
                );
            }
            drop(stream);
            continue;
        };
        full_warned = false;
        tokio::spawn(connection(stream, conn, conns.clone(), cache.clone()));
    }
}

/// Serve one connection until it ends, is closed to make room, sends nothing within
/// [`FIRST_BYTE_TIMEOUT`] or outlives [`CONNECTION_TIMEOUT`].
async fn connection(stream: tokio::net::TcpStream, conn: Arc<Conn>, conns: Arc<Conns>, cache: Arc<Cache>) {
    let service = {
        let (conn, conns) = (conn.clone(), conns.clone());
        hyper::service::service_fn(move |req| {
            let (conn, conns, cache) = (conn.clone(), conns.clone(), cache.clone());
            async move {
                conn.answering.store(true, Ordering::SeqCst);
                let last = conn.requests.fetch_add(1, Ordering::SeqCst) + 1 >= REQUESTS_PER_CONNECTION;
                let r = answer(req, &cache, last).await;
                conn.idle_since.store(conns.now(), Ordering::SeqCst);
                conn.answering.store(false, Ordering::SeqCst);
                r
            }
        })
    };
    let served = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_HEAD_BYTES)
        .serve_connection(TokioIo::new(Watched { inner: stream, conn: conn.clone() }), service);
    let silent = async {
        tokio::time::sleep(FIRST_BYTE_TIMEOUT).await;
        if conn.read_any.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
    };
    // Whichever ends first drops the connection, whatever it is doing.
    tokio::select! {
        _ = served => {}
        () = conn.close.notified() => {}
        () = silent => {}
        () = tokio::time::sleep(CONNECTION_TIMEOUT) => {}
    }
    conns.remove(&conn);
}

async fn answer(
    req: Request<Incoming>,
    cache: &Cache,
    last: bool,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    let reply = |status: StatusCode, content_type: &'static str, body: Bytes| {
        let mut r = Response::new(Full::new(body));
        *r.status_mut() = status;
        let h = r.headers_mut();
        h.insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
        if last {
            h.insert(hyper::header::CONNECTION, hyper::header::HeaderValue::from_static("close"));
        }
        Ok(r)
    };
    if route(req.method(), req.uri().path()) == Route::NotFound {
        return reply(StatusCode::NOT_FOUND, "text/plain; charset=utf-8", Bytes::from_static(b"not found\n"));
    }
    let accept = req.headers().get(hyper::header::ACCEPT).and_then(|v| v.to_str().ok());
    let format = negotiate(accept);
    match cache.get(format).await {
        Ok(text) => reply(StatusCode::OK, format.content_type(), text),
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
    async fn a_connection_beyond_the_limit_replaces_the_oldest_idle_one() {
        let (port, _tx, _server) = serving(Arc::new(Metrics::new(super::super::Directories::default()))).await;
        // Idle clients that never send a request take every slot; the first is admitted first.
        let mut idle = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            idle.push(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap());
        }
        // One more is served: the oldest idle connection makes room (its read ends at EOF).
        let a = exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await;
        assert!(a.starts_with("HTTP/1.1 200"), "{a}");
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), idle[0].read_to_end(&mut out)).await;
        assert!(matches!(read, Ok(Ok(0))), "the oldest idle connection was closed: {read:?}");
    }

    /// Pipelined requests on one connection: [`REQUESTS_PER_CONNECTION`] answers, the last with
    /// `Connection: close`, then the connection ends (the rest is never read).
    #[tokio::test]
    async fn a_connection_is_closed_after_its_request_budget() {
        let (port, _tx, _server) = serving(Arc::new(Metrics::new(super::super::Directories::default()))).await;
        let one = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
        let a = exchange(port, &one.repeat(REQUESTS_PER_CONNECTION as usize + 5)).await;
        assert_eq!(a.matches("HTTP/1.1 200").count(), REQUESTS_PER_CONNECTION as usize, "{a}");
        assert_eq!(a.matches("connection: close").count(), 1, "{a}");
    }

    /// A client that sends nothing is dropped by the first-byte timeout; one that sends half a
    /// request head, or keeps its connection open after an answer, by the header timeout. On a paused clock: the times are exact and the
    /// test takes no wall time.
    #[tokio::test(start_paused = true)]
    async fn slow_clients_are_dropped_on_time() {
        let (port, _tx, _server) = serving(Arc::new(Metrics::new(super::super::Directories::default()))).await;
        let cases: [(&str, &[u8], Duration); 3] = [
            ("nothing", b"", FIRST_BYTE_TIMEOUT),
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
