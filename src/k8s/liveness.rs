//! Is the API server reachable, and has it just come back? Every request the agent's client
//! makes goes through [`Layer`], which bounds the wait for the answer's headers and keeps
//! one process-wide account of the connection's health: a request that fails (transport error,
//! no answer in time, or given up by its caller before an answer) marks the connection failing;
//! the first answer after that marks it back and bumps [`Liveness::epoch`].
//!
//! A watch opened before those failures may sit on a connection that died without a FIN or an
//! RST (a NAT timeout, a load balancer's failover): it would wait for events that never come.
//! Watches therefore subscribe to [`reconnected`] and list again from scratch when the epoch moves
//! (`k8s::watch`). Any request counts: while a plan executes, the Lease renewal every few seconds
//! is what notices a healed network first (an idle agent renews every 8 min: its connection's PINGs
//! usually notice first).
//!
//! The account is one per process (the agent talks to one API server). A second client in the same
//! process (tests, the CLI) shares it; the worst it can cause is one relist more than needed.
//!
//! Owns: the header timeout and the health account. It does not retry, and it does not look at
//! what the answer says (any HTTP answer, even a 500, proves the connection carries bytes).

use std::future::Future;
use std::pin::Pin;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::watch;

/// How long a request may wait for its answer's headers (a watch's answer starts at once).
pub const HEADERS_TIMEOUT: Duration = Duration::from_secs(30);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The health of the connection to the API server.
#[derive(Debug)]
pub struct Liveness {
    failing: AtomicBool,
    epoch: watch::Sender<u64>,
    /// How the last answer came: [`NO_ANSWER_YET`], [`HTTP1`] or [`HTTP2`] (whose connection
    /// PINGs itself, `k8s::connection`).
    protocol: AtomicU8,
    /// Answers that refused the agent (401, 403), and whether any is in force (the fast path).
    refusals: super::refusals::Refusals,
    refused: AtomicBool,
}

const NO_ANSWER_YET: u8 = 0;
const HTTP1: u8 = 1;
const HTTP2: u8 = 2;

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            failing: AtomicBool::new(false),
            epoch: watch::Sender::new(0),
            protocol: AtomicU8::new(NO_ANSWER_YET),
            refusals: Default::default(),
            refused: AtomicBool::new(false),
        }
    }
}

impl Liveness {
    /// A request failed or was given up before its answer.
    pub fn failed(&self) {
        if !self.failing.swap(true, Ordering::SeqCst) {
            crate::board::api_failing(&shown_server());
            crate::metrics::api_failing(true);
        }
    }

    /// A request was answered: after failures, the connection is back (the epoch moves).
    pub fn answered(&self) {
        if self.failing.swap(false, Ordering::SeqCst) {
            self.epoch.send_modify(|e| *e += 1);
            self.tell_board();
            crate::metrics::api_failing(false);
        }
    }

    /// The board's line for the API server, as it answers now.
    fn tell_board(&self) {
        let over = match self.protocol.load(Ordering::Relaxed) {
            HTTP2 => format!("HTTP/2, PINGed every {}", crate::duration::human(super::connection::PING_INTERVAL)),
            HTTP1 => "HTTP/1.1".to_string(),
            _ => String::new(),
        };
        crate::board::api_answered(&shown_server(), &over);
    }

    /// An answer came over `version`.
    fn spoke(&self, version: hyper::Version) {
        let now = if version == hyper::Version::HTTP_2 { HTTP2 } else { HTTP1 };
        if self.protocol.swap(now, Ordering::Relaxed) != now {
            match now {
                HTTP2 => tracing::debug!("the API server answers over HTTP/2: its connection is PINGed"),
                _ => tracing::debug!("the API server answers over {version:?}: no PINGs, short watches"),
            }
            self.tell_board();
        }
    }

    /// An answer with `status` to `method` `uri`: a refusal (401, 403) is accounted, said and
    /// shown; a success ends the refusals it proves wrong ([`super::refusals`]).
    fn judged(&self, status: u16, method: &hyper::Method, uri: &hyper::Uri) {
        use super::refusals::Tell;
        let refusal = status == 401 || status == 403;
        let cure = self.refused.load(Ordering::Relaxed) && (200..300).contains(&status);
        if !(refusal || cure) {
            return;
        }
        let what = super::refusals::what(method, uri.path_and_query().map_or(uri.path(), |p| p.as_str()));
        let at = crate::now_rfc3339();
        let tells = self.refusals.account(status, &what, &at, std::time::Instant::now());
        if tells.is_empty() || tells == [Tell::Nothing] {
            return;
        }
        for t in tells {
            match t {
                Tell::Refused { line, again: false, .. } => tracing::error!("{line}"),
                Tell::Refused { line, since, again: true } => tracing::error!("still, since {since}: {line}"),
                Tell::Ended { line, since } => tracing::info!("answered again (refused since {since}): {line}"),
                Tell::Nothing => {}
            }
        }
        let now = self.refusals.in_force();
        self.refused.store(!now.lines.is_empty(), Ordering::Relaxed);
        crate::board::api_refused(&shown_server(), now.lines);
        crate::metrics::api_refusals(now.counts);
    }

    /// The last answer came over HTTP/2: its connection is PINGed, so a watch on it may be long.
    pub fn on_http2(&self) -> bool {
        self.protocol.load(Ordering::Relaxed) == HTTP2
    }

    /// The epoch: it moves each time the API server answers again after failures.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.epoch.subscribe()
    }
}

static LIVENESS: LazyLock<Liveness> = LazyLock::new(Liveness::default);

/// The epoch of the process-wide account, marked seen: `changed()` fires at the next comeback.
pub fn reconnected() -> watch::Receiver<u64> {
    let mut rx = LIVENESS.subscribe();
    rx.mark_unchanged();
    rx
}

/// The API server's URL for the board (set by the first client made).
fn shown_server() -> String {
    super::server().unwrap_or("the API server").to_string()
}

/// The 403s on the plan objects in force ([`super::refusals::Refusals::forbidden`]); nothing to
/// read while none is (one atomic load).
pub fn forbidden() -> Vec<(String, String)> {
    if !LIVENESS.refused.load(Ordering::Relaxed) {
        return Vec::new();
    }
    LIVENESS.refusals.forbidden()
}

/// The process-wide account's [`Liveness::on_http2`].
pub fn on_http2() -> bool {
    LIVENESS.on_http2()
}

/// The tower layer the agent's kube client is built with.
#[derive(Debug, Clone, Copy, Default)]
pub struct Layer;

impl<S> tower::Layer<S> for Layer {
    type Service = Service<S>;
    fn layer(&self, inner: S) -> Service<S> {
        Service { inner, live: &LIVENESS, timeout: HEADERS_TIMEOUT }
    }
}

/// See [`Layer`].
#[derive(Debug, Clone)]
pub struct Service<S> {
    inner: S,
    live: &'static Liveness,
    timeout: Duration,
}

/// No answer's headers within [`HEADERS_TIMEOUT`].
#[derive(Debug, thiserror::Error)]
#[error("no answer from the API server within {}", crate::duration::human(*.0))]
pub struct NoAnswer(Duration);

/// Marks the request failed when it is dropped before its answer (its caller gave up waiting).
struct Unanswered(Option<&'static Liveness>);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(l) = self.0.take() {
            l.failed();
        }
    }
}

impl<S, ReqBody, B> tower::Service<hyper::Request<ReqBody>> for Service<S>
where
    S: tower::Service<hyper::Request<ReqBody>, Response = hyper::Response<B>, Error = BoxError>,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: hyper::Request<ReqBody>) -> Self::Future {
        let (method, uri) = (req.method().clone(), req.uri().clone());
        let answer = self.inner.call(req);
        let (live, timeout) = (self.live, self.timeout);
        Box::pin(async move {
            let mut pending = Unanswered(Some(live));
            let r = tokio::time::timeout(timeout, answer).await;
            pending.0 = None;
            match r {
                Ok(Ok(response)) => {
                    live.spoke(response.version());
                    live.answered();
                    live.judged(response.status().as_u16(), &method, &uri);
                    Ok(response)
                }
                Ok(Err(e)) => {
                    live.failed();
                    Err(e)
                }
                Err(_) => {
                    live.failed();
                    Err(Box::new(NoAnswer(timeout)) as BoxError)
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::Service as _;

    fn leaked() -> &'static Liveness {
        Box::leak(Box::default())
    }

    /// A service whose answer is decided per request: `Ok`, `Err`, or never.
    #[derive(Clone)]
    struct Scripted;

    impl tower::Service<hyper::Request<&'static str>> for Scripted {
        type Response = hyper::Response<()>;
        type Error = BoxError;
        type Future = Pin<Box<dyn Future<Output = Result<hyper::Response<()>, BoxError>> + Send>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, req: hyper::Request<&'static str>) -> Self::Future {
            let over = |v, status: u16| {
                let mut r = hyper::Response::new(());
                *r.version_mut() = v;
                *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                Ok(r)
            };
            Box::pin(async move {
                match *req.body() {
                    "ok" => over(hyper::Version::HTTP_11, 200),
                    "ok over h2" => over(hyper::Version::HTTP_2, 200),
                    "401" => over(hyper::Version::HTTP_2, 401),
                    "err" => Err("connection reset".into()),
                    _ => std::future::pending().await,
                }
            })
        }
    }

    fn service(live: &'static Liveness) -> Service<Scripted> {
        Service { inner: Scripted, live, timeout: Duration::from_secs(5) }
    }

    /// A request whose answer is scripted by `script` (see [`Scripted`]).
    fn req(script: &'static str) -> hyper::Request<&'static str> {
        hyper::Request::builder()
            .method("PUT")
            .uri("/apis/coordination.k8s.io/v1/namespaces/n/leases/l")
            .body(script)
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn the_epoch_moves_once_per_comeback() {
        let live = leaked();
        let mut rx = live.subscribe();
        let mut s = service(live);
        s.call(req("ok")).await.unwrap();
        assert!(!rx.has_changed().unwrap(), "answers without failures are no comeback");
        assert!(s.call(req("err")).await.is_err());
        assert!(s.call(req("err")).await.is_err());
        assert!(!rx.has_changed().unwrap());
        s.call(req("ok")).await.unwrap();
        assert_eq!(*rx.borrow_and_update(), 1);
        s.call(req("ok")).await.unwrap();
        assert!(!rx.has_changed().unwrap(), "one comeback, one move");
    }

    #[tokio::test(start_paused = true)]
    async fn no_answer_in_time_and_a_request_given_up_count_as_failures() {
        let live = leaked();
        let mut rx = live.subscribe();
        let mut s = service(live);
        let e = s.call(req("never")).await.unwrap_err();
        assert!(e.to_string().contains("no answer from the API server within 5s"), "{e}");
        s.call(req("ok")).await.unwrap();
        assert_eq!(*rx.borrow_and_update(), 1);
        // The caller's own shorter timeout drops the request before the layer's.
        assert!(tokio::time::timeout(Duration::from_secs(1), s.call(req("never"))).await.is_err());
        s.call(req("ok")).await.unwrap();
        assert_eq!(*rx.borrow_and_update(), 2);
    }

    /// A 401 is an answer (the connection is alive) and a refusal, in force until a success.
    #[tokio::test(start_paused = true)]
    async fn a_refused_token_is_an_answer_and_a_refusal_until_a_success() {
        let live = leaked();
        let mut s = service(live);
        s.call(req("401")).await.unwrap();
        assert!(!live.failing.load(Ordering::SeqCst), "answered");
        let now = live.refusals.in_force();
        assert_eq!(now.counts, [(401, 1), (403, 0)]);
        assert!(now.lines[0].0.contains("refused the agent's token"), "{:?}", now.lines);
        s.call(req("ok")).await.unwrap();
        assert_eq!(live.refusals.in_force().counts, [(401, 0), (403, 0)]);
        assert!(!live.refused.load(Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn the_protocol_of_the_last_answer_is_known() {
        let live = leaked();
        let mut s = service(live);
        assert!(!live.on_http2(), "unknown until an answer: not HTTP/2");
        s.call(req("ok over h2")).await.unwrap();
        assert!(live.on_http2());
        assert!(s.call(req("err")).await.is_err());
        assert!(live.on_http2(), "a failure says nothing of the protocol");
        s.call(req("ok")).await.unwrap();
        assert!(!live.on_http2(), "an answer over HTTP/1.1 (a proxy on the way now)");
    }
}
