//! How the agent's client reaches the API server: HTTP/2 where the server speaks it, so the
//! client finds a connection that died without a FIN or an RST by itself. On an HTTP/2
//! connection it sends a PING every [`PING_INTERVAL`] (with requests in flight or not) and closes
//! the connection when no answer comes within [`PING_TIMEOUT`]: every request on it fails at
//! once, watches list again on a new connection, and a write waiting to be sent goes on a new
//! one too. All the agent's requests share that one connection (a watch, the Lease, writes,
//! Events), so one PING covers them all.
//!
//! A request on that connection that fails or goes unanswered (its caller's bound, or the answer's
//! header bound) makes the next request go on a new connection ([`Renewing`]): the old one may
//! have died silently, and its PINGs may take up to [`PING_INTERVAL`] + [`PING_TIMEOUT`] to tell.
//! So once the network heals, the next request (usually the Lease renewal) is answered at once,
//! and its comeback makes every watch list afresh (`k8s::liveness`) instead of waiting for the
//! PINGs; on HTTP/1.1 a busy connection did the same by itself.
//!
//! The stack is kube's own (base URL, retry of 429/503/504, credentials, extra headers, the bound
//! on TCP connect and TLS) with the HTTP/2 settings added, and without kube's read and write
//! bounds on the socket: the PINGs find a dead connection sooner, and the bound on an answer's
//! headers is [`super::liveness`]'s. A server that negotiates HTTP/1.1 gets no PINGs: watches
//! there keep their short server-side timeout as the liveness signal ([`super::watch::Bounds`]).
//! An HTTP proxy (`proxy-url`, with its `user:password`), a `tls-server-name` and a credential
//! plugin are taken as kube takes them; a proxy of another kind (SOCKS) is left to kube's own
//! HTTP/1.1 client, which refuses it with its own error.
//!
//! Every connection sets `TCP_NODELAY`: a write never waits for the server's delayed ACK.
//!
//! Owns: the transport settings. The bounds of one request and the health account are
//! [`super::liveness`]'s.

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::ConfigExt as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;
use tower::BoxError;

/// How often an HTTP/2 connection is asked whether it is alive.
pub const PING_INTERVAL: Duration = Duration::from_secs(10);
/// How long a PING may go unanswered before its connection is taken for dead and closed.
pub const PING_TIMEOUT: Duration = Duration::from_secs(10);

/// Why `config` is left to kube's own HTTP/1.1 client, if it is.
pub fn kube_stack_only(config: &kube::Config) -> Option<&'static str> {
    match &config.proxy_url {
        Some(p) if p.scheme_str() != Some("http") => Some("a proxy that is not an HTTP proxy"),
        _ => None,
    }
}

/// The client builder for `config` with HTTP/2 and its PINGs (see the module doc), or `None`
/// where kube's own stack must be used.
pub fn builder(config: &kube::Config) -> Result<Option<kube::client::ClientBuilder<Stack>>, kube::Error> {
    if kube_stack_only(config).is_some() {
        return Ok(None);
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    // Each request goes out at once: with Nagle's algorithm a request written in two parts
    // (headers, then body) waits for the server's delayed ACK of the first, about 40 ms.
    http.set_nodelay(true);
    match &config.proxy_url {
        Some(proxy) => {
            let mut tunnel = hyper_util::client::legacy::connect::proxy::Tunnel::new(proxy.clone(), http);
            if let Some(auth) = proxy_authorization(proxy) {
                tunnel = tunnel.with_auth(auth);
            }
            stack(config, tunnel)
        }
        None => stack(config, http),
    }
}

/// The `Proxy-Authorization` for a proxy URL's `user:password`, if it has one.
fn proxy_authorization(proxy: &hyper::Uri) -> Option<hyper::header::HeaderValue> {
    use base64::Engine as _;
    let (userinfo, _) = proxy.authority()?.as_str().rsplit_once('@')?;
    let plain: Vec<u8> = percent_encoding::percent_decode_str(userinfo).collect();
    let mut v = hyper::header::HeaderValue::from_str(&format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(plain)
    ))
    .ok()?;
    v.set_sensitive(true);
    Some(v)
}

/// [`builder`]'s stack over `tcp` (a connection to the server, or a tunnel through a proxy).
fn stack<C>(config: &kube::Config, tcp: C) -> Result<Option<kube::client::ClientBuilder<Stack>>, kube::Error>
where
    C: tower::Service<hyper::Uri> + Clone + Send + Sync + 'static,
    C::Response: hyper::rt::Read + hyper::rt::Write + hyper_util::client::legacy::connect::Connection + Send + Unpin,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    use tower::ServiceBuilder;
    let mut tls =
        hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config.rustls_client_config()?).https_or_http();
    if let Some(name) = &config.tls_server_name {
        let name = name.clone().try_into().map_err(|e| {
            kube::Error::Service(format!("tls-server-name {name:?} is not a valid server name: {e}").into())
        })?;
        tls = tls.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name));
    }
    let tls = tls.enable_http1().enable_http2().wrap_connector(tcp);
    // The bound covers TCP and TLS: a relay that accepts and then says nothing is given up.
    // No read or write bound on the socket: on HTTP/2 every stream shares it, so it would only
    // find a dead connection later than the PINGs do, and would close a healthy quiet one.
    let mut connector = hyper_timeout::TimeoutConnector::new(tls);
    connector.set_connect_timeout(config.connect_timeout);
    let client = Renewing::new(move || {
        hyper_util::client::legacy::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .http2_keep_alive_interval(PING_INTERVAL)
            .http2_keep_alive_timeout(PING_TIMEOUT)
            .http2_keep_alive_while_idle(true)
            .build::<_, kube::client::Body>(connector.clone())
    });
    let retry =
        config.default_retry.then(|| tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry()));
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .service(client);
    let stack = tower::util::BoxService::new(service);
    Ok(Some(kube::client::ClientBuilder::new(stack, config.default_namespace.clone())))
}

/// A client (with its own pool of connections) made afresh after a request on it failed or was
/// given up before its answer: the next request goes on a new connection. Requests already on
/// the old client go on there (a watch ends with its connection).
pub struct Renewing<S> {
    make: Arc<dyn Fn() -> S + Send + Sync>,
    /// The client in use, and how many were made before it.
    current: Arc<Mutex<(u64, S)>>,
}

impl<S> Clone for Renewing<S> {
    fn clone(&self) -> Self {
        Renewing { make: self.make.clone(), current: self.current.clone() }
    }
}

impl<S> Renewing<S> {
    pub fn new(make: impl Fn() -> S + Send + Sync + 'static) -> Self {
        let first = make();
        Renewing { make: Arc::new(make), current: Arc::new(Mutex::new((0, first))) }
    }

    /// The client `made` failed a request: the next request gets a new one (once per client).
    fn renew(&self, made: u64) {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if current.0 == made {
            *current = (made + 1, (self.make)());
            tracing::debug!("a request to the API server failed: the next one goes on a new connection");
        }
    }
}

/// Renews the client when dropped armed: its request failed or was given up before an answer.
struct Unanswered<S>(Option<(Renewing<S>, u64)>);

impl<S> Drop for Unanswered<S> {
    fn drop(&mut self) {
        if let Some((r, made)) = self.0.take() {
            r.renew(made);
        }
    }
}

impl<S, Req> tower::Service<Req> for Renewing<S>
where
    S: tower::Service<Req> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Into<BoxError>,
    Req: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Each call takes the client in use then, and waits for it to be ready (`oneshot`).
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let (made, client) = {
            let current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
            (current.0, current.1.clone())
        };
        let this = self.clone();
        Box::pin(async move {
            let mut pending = Unanswered(Some((this, made)));
            let answer = tower::ServiceExt::oneshot(client, req).await.map_err(Into::into)?;
            pending.0 = None;
            Ok(answer)
        })
    }
}

/// The service [`builder`] makes.
pub type Stack = tower::util::BoxService<
    hyper::Request<kube::client::Body>,
    hyper::Response<hyper::body::Incoming>,
    tower::BoxError,
>;

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tower::Service as _;

    /// A client numbered when made; its answer to a request is decided by the request: `ok`
    /// (its number), `err`, or never.
    #[derive(Clone)]
    struct Numbered(u64);

    impl tower::Service<&'static str> for Numbered {
        type Response = u64;
        type Error = BoxError;
        type Future = Pin<Box<dyn Future<Output = Result<u64, BoxError>> + Send>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, req: &'static str) -> Self::Future {
            let n = self.0;
            Box::pin(async move {
                match req {
                    "ok" => Ok(n),
                    "err" => Err("connection reset".into()),
                    _ => std::future::pending().await,
                }
            })
        }
    }

    fn numbered() -> Renewing<Numbered> {
        let made = Arc::new(AtomicU64::new(0));
        Renewing::new(move || Numbered(made.fetch_add(1, Ordering::SeqCst)))
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_fails_or_goes_unanswered_sends_the_next_on_a_new_client() {
        let mut r = numbered();
        assert_eq!(r.call("ok").await.unwrap(), 0);
        assert_eq!(r.call("ok").await.unwrap(), 0, "answered: the same client");
        assert!(r.call("err").await.is_err());
        assert_eq!(r.call("ok").await.unwrap(), 1, "after a failure: a new one");
        // Given up before its answer (a caller's bound): a new one too.
        assert!(tokio::time::timeout(Duration::from_secs(5), r.call("never")).await.is_err());
        assert_eq!(r.call("ok").await.unwrap(), 2);
        // Two requests that failed on one client make one new client, not two.
        let (a, b) = (r.call("err"), r.call("err"));
        assert!(a.await.is_err() && b.await.is_err());
        assert_eq!(r.call("ok").await.unwrap(), 3);
    }

    /// The `TCP_NODELAY` of this process's socket whose local address is `local`, read from the
    /// socket itself (found through `/proc/self/fd`).
    fn nodelay_of(local: std::net::SocketAddr) -> Option<bool> {
        use std::os::fd::BorrowedFd;
        for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
            let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
            let is_socket = std::fs::read_link(entry.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:"));
            if !is_socket {
                continue;
            }
            // SAFETY: the fd is open in this process (listed just now) and only duplicated here.
            let Ok(owned) = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned() else { continue };
            let stream = std::net::TcpStream::from(owned);
            if stream.local_addr().ok() == Some(local) {
                return stream.nodelay().ok();
            }
        }
        None
    }

    #[tokio::test]
    async fn every_connection_to_the_api_server_sends_at_once() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let client = crate::k8s::client(kube::Config::new(url.parse().unwrap())).unwrap();
        let request = tokio::spawn(async move {
            let req = http::Request::patch("/api/v1/namespaces/n/secrets/s").body(b"{}".to_vec()).unwrap();
            client.request_text(req).await
        });
        let (mut server, client_addr) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = server.read(&mut buf).await.unwrap();
        assert!(n > 0, "the client sent its request");
        let nodelay = tokio::task::spawn_blocking(move || nodelay_of(client_addr)).await.unwrap();
        assert_eq!(nodelay, Some(true), "the client's socket to {url} (its end {client_addr}) has TCP_NODELAY set");
        server.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").await.unwrap();
        assert_eq!(request.await.unwrap().unwrap(), "{}");
    }

    #[test]
    fn only_a_proxy_that_is_not_http_is_left_to_kube() {
        let plain = kube::Config::new("https://127.0.0.1:6443".parse().unwrap());
        assert_eq!(kube_stack_only(&plain), None);
        let mut proxied = plain.clone();
        proxied.proxy_url = Some("http://127.0.0.1:3128".parse().unwrap());
        assert_eq!(kube_stack_only(&proxied), None);
        proxied.proxy_url = Some("socks5://127.0.0.1:1080".parse().unwrap());
        assert_eq!(kube_stack_only(&proxied), Some("a proxy that is not an HTTP proxy"));
        let mut named = plain.clone();
        named.tls_server_name = Some("api".into());
        assert_eq!(kube_stack_only(&named), None);
        let mut plugin = plain.clone();
        let exec = serde_json::json!({"apiVersion": "client.authentication.k8s.io/v1", "command": "get-token"});
        plugin.auth_info.exec = Some(serde_json::from_value(exec).unwrap());
        assert_eq!(kube_stack_only(&plugin), None);
    }

    /// The first bytes a client made from `config` sends to `listener` (a request to the API
    /// server at `config`'s URL), and whether its socket has `TCP_NODELAY`.
    async fn first_bytes(config: kube::Config, listener: tokio::net::TcpListener) -> (Vec<u8>, Option<bool>) {
        use tokio::io::AsyncReadExt as _;
        let client = crate::k8s::client(config).unwrap();
        let _request = crate::AbortOnDrop(tokio::spawn(async move {
            let req = http::Request::patch("/api/v1/namespaces/n/secrets/s").body(b"{}".to_vec()).unwrap();
            let _ = client.request_text(req).await;
        }));
        let (mut server, client_addr) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = server.read(&mut buf).await.unwrap();
        buf.truncate(n);
        let nodelay = tokio::task::spawn_blocking(move || nodelay_of(client_addr)).await.unwrap();
        (buf, nodelay)
    }

    /// Through an HTTP proxy (with credentials in its URL) the tunnel's socket sends at once too,
    /// and the proxy is asked for the API server with the decoded credentials.
    #[tokio::test]
    async fn a_connection_through_a_proxy_sends_at_once_and_authenticates() {
        let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut config = kube::Config::new("https://10.0.0.1:6443".parse().unwrap());
        config.proxy_url = Some(format!("http://user:p%40ss@{}", proxy.local_addr().unwrap()).parse().unwrap());
        let (sent, nodelay) = first_bytes(config, proxy).await;
        let sent = String::from_utf8_lossy(&sent);
        assert!(sent.starts_with("CONNECT 10.0.0.1:6443 HTTP/1.1\r\n"), "{sent}");
        // base64("user:p@ss")
        assert!(sent.contains("Basic dXNlcjpwQHNz"), "{sent}");
        assert_eq!(nodelay, Some(true));
    }

    /// With `tls-server-name` the TLS handshake names that server (SNI), on a socket that sends
    /// at once.
    #[tokio::test]
    async fn a_tls_server_name_is_the_name_the_handshake_asks_for() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut config = kube::Config::new(format!("https://{}", listener.local_addr().unwrap()).parse().unwrap());
        config.tls_server_name = Some("api.cluster.example".into());
        let (hello, nodelay) = first_bytes(config, listener).await;
        assert_eq!(hello.first(), Some(&0x16), "a TLS handshake record");
        assert!(hello.windows(19).any(|w| w == b"api.cluster.example"), "SNI names the server");
        assert_eq!(nodelay, Some(true));
    }
}
