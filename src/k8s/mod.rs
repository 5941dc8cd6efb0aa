//! The Kubernetes edge: how the agent's client reaches the API server, and the one list/watch
//! every source follows objects with.
//!
//! - [`client()`]: a [`kube::Client`] over HTTP/2 whose connection PINGs itself ([`connection`]),
//!   whose every request is bounded (TCP connect and TLS, the answer's headers), counted by
//!   [`liveness`], and sent as [`USER_AGENT`].
//! - [`liveness`]: the process-wide account of whether the API server answers, and the epoch that
//!   moves when it answers again after failures.
//! - [`watch`]: list, then watch with bookmarks and a bound on the gap between events; a list
//!   afresh when a watch ends, breaks, goes quiet, or may sit on a connection that died.
//! - [`write`]: the one conditional writer (resourceVersion precondition; 409 → read again, then
//!   write again or abandon; 404; 429 with the server's hint), over a source's small adapter.
//! - [`base`]: the base of an agent's next write to one object (its own last write's answer unless
//!   the watch has delivered something newer).
//! - [`error_line`]: one line for a kube error, the same everywhere.
//!
//! It decides nothing about plans: what a write means is its caller's.

pub mod base;
pub mod connection;
pub mod liveness;
pub mod refusals;
pub mod watch;
pub mod write;

use std::task::{Context, Poll};
use std::time::Duration;

/// The `User-Agent` of the agent's requests: the API server names the agent's writes after it in
/// `managedFields` (field manager `nodeplan`) and in its audit log, where they were `unknown`.
pub const USER_AGENT: &str = concat!("nodeplan/", env!("CARGO_PKG_VERSION"));

/// TCP connect plus the TLS handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// On kube's HTTP/1.1 client (no PINGs), the longest wait for the next bytes of an answer, or for
/// a write to go out. Longer than [`watch::WATCH_GAP`], so a quiet watch is given up by its own
/// bound with a clear line first.
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// The API server the process talks to (the first client's; an agent or a command has one).
static SERVER: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The URL of the API server the process talks to, once a client was made.
pub fn server() -> Option<&'static str> {
    SERVER.get().map(String::as_str)
}

/// One line for a kube error: the API server's status as code, reason and message; a request
/// that did not reach it names the server (`cannot reach the API server at URL: …`); anything
/// else as its chain of causes.
pub fn error_line(err: &kube::Error) -> String {
    match err {
        kube::Error::Api(status) => {
            let reason = if status.reason.is_empty() { "Unknown" } else { status.reason.as_str() };
            format!("the API server answered {} {}: {}", status.code, reason, status.message).replace(['\n', '\r'], " ")
        }
        kube::Error::Service(_) | kube::Error::HyperError(_) => {
            let line = crate::error_line(err);
            let cause = line.strip_prefix("ServiceError: ").unwrap_or(&line);
            format!("cannot reach the API server at {}: {cause}", server().unwrap_or("(unknown)"))
        }
        other => crate::error_line(other),
    }
}

/// A command's request (`what`) that got no answer within its `--request-timeout`, naming the
/// server.
pub fn no_answer(what: &str, timeout: Duration) -> String {
    let at = server().map(|s| format!(" at {s}")).unwrap_or_default();
    format!("{what}: no answer from the API server{at} within {} (--request-timeout)", crate::duration::show(timeout))
}

/// One request of a command (`what`), bounded by its `--request-timeout` ([`no_answer`] when it
/// gets no answer in time).
pub async fn bounded<T>(
    timeout: Duration,
    what: &str,
    request: impl std::future::Future<Output = Result<T, String>>,
) -> Result<T, String> {
    tokio::time::timeout(timeout, request).await.unwrap_or_else(|_| Err(no_answer(what, timeout)))
}

/// The agent's client for `config`: HTTP/2 with PINGs where [`connection`] can build it (else
/// kube's HTTP/1.1 client with [`IO_TIMEOUT`] on each read and write); every request bounded
/// ([`CONNECT_TIMEOUT`], [`liveness::HEADERS_TIMEOUT`]), counted by [`liveness`] and sent as
/// [`USER_AGENT`].
pub fn client(mut config: kube::Config) -> Result<kube::Client, kube::Error> {
    let _ = SERVER.set(crate::redact_userinfo(&config.cluster_url.to_string()).trim_end_matches('/').to_string());
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    config.read_timeout = Some(IO_TIMEOUT);
    config.write_timeout = Some(IO_TIMEOUT);
    if let Some(b) = connection::builder(&config)? {
        return Ok(b.with_layer(&liveness::Layer).with_layer(&UserAgentLayer).build());
    }
    if let Some(why) = connection::kube_stack_only(&config) {
        tracing::debug!("the kubeconfig has {why}: HTTP/1.1 to the API server, no PINGs, watches of 20 s");
    }
    Ok(kube::client::ClientBuilder::try_from(config)?.with_layer(&liveness::Layer).with_layer(&UserAgentLayer).build())
}

/// Sets [`USER_AGENT`] on every request that has no `User-Agent` of its own.
#[derive(Debug, Clone, Copy, Default)]
pub struct UserAgentLayer;

impl<S> tower::Layer<S> for UserAgentLayer {
    type Service = UserAgent<S>;
    fn layer(&self, inner: S) -> UserAgent<S> {
        UserAgent(inner)
    }
}

/// See [`UserAgentLayer`].
#[derive(Debug, Clone)]
pub struct UserAgent<S>(S);

impl<S, B> tower::Service<hyper::Request<B>> for UserAgent<S>
where
    S: tower::Service<hyper::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, mut req: hyper::Request<B>) -> S::Future {
        req.headers_mut()
            .entry(hyper::header::USER_AGENT)
            .or_insert(hyper::header::HeaderValue::from_static(USER_AGENT));
        self.0.call(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Layer as _, Service as _};

    /// Answers with the request's `User-Agent`.
    struct Echo;

    impl tower::Service<hyper::Request<()>> for Echo {
        type Response = Option<String>;
        type Error = std::convert::Infallible;
        type Future = std::future::Ready<Result<Option<String>, std::convert::Infallible>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, req: hyper::Request<()>) -> Self::Future {
            let ua = req.headers().get(hyper::header::USER_AGENT).map(|v| v.to_str().unwrap_or("?").to_string());
            std::future::ready(Ok(ua))
        }
    }

    #[tokio::test]
    async fn every_request_is_sent_as_nodeplan_unless_it_names_itself() {
        let mut svc = UserAgentLayer.layer(Echo);
        let plain = svc.call(hyper::Request::new(())).await.unwrap();
        assert_eq!(plain.as_deref(), Some(USER_AGENT));
        assert!(USER_AGENT.starts_with("nodeplan/"), "the field manager is the part before the slash");
        let own = hyper::Request::builder().header(hyper::header::USER_AGENT, "kubectl/v1.20").body(()).unwrap();
        assert_eq!(svc.call(own).await.unwrap().as_deref(), Some("kubectl/v1.20"));
    }
}
