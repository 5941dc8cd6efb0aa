//! The Kubernetes edge: how the agent's client reaches the API server, and the one list/watch
//! every source follows objects with.
//!
//! - [`client()`]: a [`kube::Client`] whose every request is bounded (TCP connect and TLS, each read,
//!   each write, the answer's headers) and counted by [`liveness`].
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
pub mod liveness;
pub mod watch;
pub mod write;

use std::time::Duration;

/// TCP connect plus the TLS handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest wait for the next bytes of an answer, or for a write to go out. Longer than
/// [`watch::WATCH_GAP`], so a quiet watch is given up by its own bound with a clear line first.
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// One line for a kube error: the API server's status as code, reason and message, anything else
/// as its chain of causes.
pub fn error_line(err: &kube::Error) -> String {
    match err {
        kube::Error::Api(status) => {
            let reason = if status.reason.is_empty() { "Unknown" } else { status.reason.as_str() };
            format!("apiserver answered {} {}: {}", status.code, reason, status.message).replace(['\n', '\r'], " ")
        }
        other => crate::error_line(other),
    }
}

/// The agent's client for `config`: every request bounded ([`CONNECT_TIMEOUT`], [`IO_TIMEOUT`],
/// [`liveness::HEADERS_TIMEOUT`]) and counted by [`liveness`].
pub fn client(mut config: kube::Config) -> Result<kube::Client, kube::Error> {
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    config.read_timeout = Some(IO_TIMEOUT);
    config.write_timeout = Some(IO_TIMEOUT);
    Ok(kube::client::ClientBuilder::try_from(config)?.with_layer(&liveness::Layer).build())
}
