//! nodeplan: a node agent that applies plans (files, one-time instructions, periodic instructions,
//! health probes) with safe pause and cancel, and a process supervisor that never hangs and never
//! loses track of what it started. Wire-compatible with Rancher's system-agent.
//!
//! The rules that the code and tests cite as R1, R2, … are stated in the repository's
//! `docs/rules.md`.
//!
//! Module boundaries (each module's own doc says what it owns and must not touch). The modules form
//! layers that point one way (`docs/architecture.md`, checked by `tests/architecture.rs`):
//! - [`plan`]: wire types, validation, checksum, codecs, checkpoint, states, annotation values. No I/O.
//! - [`flow`]: the plan-state flow with pause and cancel as pure decide/record functions shared by
//!   every plan source (the rules of `docs/rules.md` that decide what runs and what is written).
//! - [`reconcile`]: the one reconcile loop, generic over a plan source: recovery, back-off,
//!   commits, runs, interrupt delivery, probes.
//! - [`process`]: the only place that spawns, waits for or signals a process.
//! - [`apply`]: the applyinator: files, instructions, periodic instructions, interrupts.
//! - [`image`]: images for `image` instructions: tarballs, registries, pulls, layer extraction.
//! - [`probe`]: health probes (HTTP(S) and file existence), thresholds and statuses.
//! - [`local`]: local mode: the plan directory, `.pos` and control files, as a plan source.
//! - [`metrics`]: Prometheus metrics: the registry, the hooks that feed it, the `/metrics` endpoint.
//! - [`remote`]: remote mode: the plan Secret (Kubernetes), as a plan source.
//! - [`k8s`]: the Kubernetes edge: the bounded client, its liveness account, the one list/watch.
//! - [`lease`]: the Kubernetes Lease that keeps a second agent off a remote or NodePlan source.
//! - [`config`]: the config and connection-info files, defaults and validation.
//! - [`fleet`]: many nodes' plan objects (plan Secrets or NodePlans) as rows (state, progress,
//!   probes) for status, fan-out and rollouts; the rollout's rules (`fleet::rollout`: who starts,
//!   when it stops); `fleet::objects` reads and writes them.
//! - [`formats`]: the versions of the files nodeplan keeps on the node (R25).
//! - [`duration`]: durations as people write and read them (parse, show, human).
//! - [`backoff`]: the one back-off type and its jitter.
//! - [`board`]: the running agent's status record, for `nodeplan status`.
//! - [`logging`]: log levels as the agent and the installer take them.
//! - [`events`]: Kubernetes Events about plans.
//! - [`nodeplan`]: the NodePlan custom resource: its types, status wire, and the agent's source.
//! - [`install`]: `nodeplan install`/`uninstall`: settings, the Rancher exchange, the files and unit.
//! - [`cli`]: commands, progress display, logging, exit codes.
//! - [`safefs`]: race-free writes and bounded reads of files other local users may touch.
//! - [`disk`]: the state disk's operations, in order, off the agent's thread (a stalled disk never
//!   holds the agent).

/// Modules built for Unix only so far (issue 42 brings them to Windows one by one).
macro_rules! unix_only {
    ($($module:ident),* $(,)?) => { $( #[cfg(unix)] pub mod $module; )* };
}

unix_only!(fleet, install, local);
pub mod apply;
pub mod backoff;
pub mod board;
pub mod cli;
pub mod config;
pub mod disk;
pub mod duration;
pub mod events;
pub mod flow;
pub mod formats;
pub mod image;
pub mod k8s;
pub mod lease;
pub mod logging;
pub mod metrics;
pub mod nodeplan;
pub mod plan;
pub mod probe;
pub mod process;
pub mod reconcile;
pub mod remote;
pub mod safefs;

/// An error and its sources on one line, joined with `: ` (a source already in the text is not
/// repeated): the one-line form every user-facing message takes.
pub(crate) fn error_line(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out.replace(['\n', '\r'], " ")
}

/// Now in RFC 3339 to the second, UTC (`2026-12-07T15:04:15Z`): the form status records show.
pub fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// `1 instruction`, `2 instructions`: a count and its noun (a regular plural).
pub fn count(n: usize, noun: &str) -> String {
    if n == 1 { format!("1 {noun}") } else { format!("{n} {noun}s") }
}

/// Rows of cells as table lines: each column padded to its widest cell, three spaces apart (as
/// kubectl prints), no trailing spaces. The first row is the header.
pub fn columns(rows: &[Vec<String>]) -> Vec<String> {
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> =
        (0..n).map(|i| rows.iter().filter_map(|r| r.get(i)).map(|c| c.chars().count()).max().unwrap_or(0)).collect();
    rows.iter()
        .map(|r| {
            let cells: Vec<String> = r.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
            cells.join("   ").trim_end().to_string()
        })
        .collect()
}

/// A value quoted for a one-line message, cut to 60 characters.
pub(crate) fn quoted(s: &str) -> String {
    let mut cut: String = s.chars().take(60).collect();
    if cut.len() < s.len() {
        cut.push('…');
    }
    format!("\"{}\"", cut.escape_debug())
}

/// `user:password@` in a reference or URL (`https://u:p@host/…`, `u:p@host/…`) replaced by
/// `***@`, for messages: a password someone put there must not reach a log.
pub fn redact_userinfo(s: &str) -> String {
    let (scheme, rest) = match s.find("://") {
        Some(i) => s.split_at(i + 3),
        None => ("", s),
    };
    let host_end = rest.find('/').unwrap_or(rest.len());
    match rest[..host_end].rfind('@') {
        Some(at) if rest[..at].contains(':') && !rest[at + 1..].starts_with("sha256:") => {
            format!("{scheme}***{}", &rest[at..])
        }
        _ => s.to_string(),
    }
}

/// Aborts the task when dropped (a background task that lives as long as its owner).
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
