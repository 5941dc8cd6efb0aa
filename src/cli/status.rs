//! `nodeplan status`: this node's agent at a glance, from the record the running agent keeps
//! ([`crate::board`]) in the PID directory of the config it runs with (found as `agent` finds it).

use super::exit;
use crate::board::AgentStatus;
use clap::{Args, ValueEnum};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// Config file [default: NODEPLAN_CONFIG, else CATTLE_AGENT_CONFIG, else
    /// /etc/rancher/agent/config.yaml].
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// `table` (one line per fact), `json` or `yaml` (the agent's record as it is).
    #[arg(long, short = 'o', value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Table,
    Json,
    Yaml,
}

/// Exit codes of `nodeplan status`.
pub const EXIT_CODES: &str = "Exit codes:\n  0  the agent runs (its status is shown)\n  1  no agent runs with this config, or its record cannot be read\n  2  bad arguments or an invalid config file";

pub fn run(args: StatusArgs) -> u8 {
    let path = crate::config::config_path(args.config.as_deref());
    let cfg = match crate::config::load(&path) {
        Ok(c) => c,
        Err(e) => {
            super::say(&format!("nodeplan: {e}"));
            return exit::BAD_INPUT;
        }
    };
    if cfg.pid_directory.as_os_str().is_empty() {
        super::say(&format!(
            "nodeplan: {} sets no pidDirectory: the agent keeps no status record without one",
            path.display()
        ));
        return exit::FAILED;
    }
    let record = match crate::board::read(&cfg.pid_directory) {
        Ok(r) => r,
        Err(e) => {
            super::say(&format!("nodeplan: {e}"));
            return exit::FAILED;
        }
    };
    let Some(s) = record.filter(alive) else {
        super::say(&format!(
            "nodeplan: no agent runs with {} (no live agent's record in {})",
            path.display(),
            cfg.pid_directory.display()
        ));
        return exit::FAILED;
    };
    match args.output {
        Format::Json => crate::cli::out!("{}", serde_json::to_string_pretty(&s).unwrap_or_default()),
        Format::Yaml => crate::cli::out!("{}", serde_yaml_ng::to_string(&s).unwrap_or_default().trim_end()),
        Format::Table => {
            for l in table(&s, chrono::Utc::now()) {
                crate::cli::out!("{l}");
            }
        }
    }
    exit::OK
}

/// Whether the record's process still runs: its pid names a process started when the agent did
/// (a record left by a killed agent, or a pid given to another process since, is not).
pub(super) fn alive(s: &AgentStatus) -> bool {
    s.pid > 0 && crate::process::start_time_of(s.pid as i32).is_some_and(|t| t == s.pid_start)
}

/// The record as `label: value` lines, times with how long ago (or how soon).
pub fn table(s: &AgentStatus, now: chrono::DateTime<chrono::Utc>) -> Vec<String> {
    let line = |label: &str, value: String| format!("{:<12}{}", format!("{label}:"), shown(&value));
    let mut out = vec![
        line("agent", format!("running, pid {}, since {}", s.pid, when(&s.started, now))),
        line("version", s.version.clone()),
        line("config", s.config.clone()),
        line("node", s.node.clone()),
    ];
    if s.sources.is_empty() {
        out.push(line("source", "none enabled".into()));
    }
    for src in &s.sources {
        let lease = if src.lease.is_empty() { String::new() } else { format!(" (Lease: {})", src.lease) };
        let problem = match src.problem.as_str() {
            "" => String::new(),
            p => format!("; {p}, since {}", when(&src.problem_since, now)),
        };
        out.push(line("source", format!("{}: {}{lease}{problem}", src.kind, src.target)));
    }
    if let Some(api) = &s.api {
        let over = if api.over.is_empty() { String::new() } else { format!(", over {}", api.over) };
        let failing = match api.failing_since.as_str() {
            "" => String::new(),
            t => format!("; requests failing since {}", when(t, now)),
        };
        out.push(line("api server", format!("{}{over}{failing}", api.server)));
        for r in &api.refused {
            out.push(line("refused", format!("{}; since {}", r.what, when(&r.since, now))));
        }
    }
    match &s.current {
        Some(c) => {
            out.push(line("applying", format!("{}, since {}", c.plan, when(&c.since, now))));
            if !c.instruction.is_empty() {
                out.push(line("running", format!("{}, since {}", c.instruction, when(&c.instruction_since, now))));
            }
        }
        None => out.push(line("applying", "nothing".into())),
    }
    if let Some(l) = &s.last {
        out.push(line("last", format!("{}: {}, {}", l.plan, l.result, when(&l.at, now))));
    }
    for r in &s.retries {
        out.push(line("retry", format!("{} {}", r.plan, when(&r.at, now))));
    }
    out.push(line("updated", when(&s.updated, now)));
    out
}

/// An RFC 3339 time with how long ago it was (or how soon it is).
pub(super) fn when(t: &str, now: chrono::DateTime<chrono::Utc>) -> String {
    let Ok(at) = chrono::DateTime::parse_from_rfc3339(t) else { return t.to_string() };
    let d = now.signed_duration_since(at);
    if d.num_seconds() == 0 {
        return format!("{t} (now)");
    }
    match d.to_std() {
        Ok(ago) => format!("{t} ({} ago)", crate::duration::human(round(ago))),
        Err(_) => format!("{t} (in {})", crate::duration::human(round((-d).to_std().unwrap_or_default()))),
    }
}

fn round(d: std::time::Duration) -> std::time::Duration {
    std::time::Duration::from_secs(d.as_secs())
}

/// A value from the record (root's file, but written from what plans and the API server said)
/// on one line, cut, as `plan status` shows values.
fn shown(v: &str) -> String {
    crate::plan::failure::shown(v, 300)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::board::{ApiStatus, Current, Last, Refused, Retry, SourceStatus};

    #[test]
    fn the_table_says_what_the_agent_does_and_since_when() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-12-02T12:00:00Z").unwrap().with_timezone(&chrono::Utc);
        let s = AgentStatus {
            pid: 42,
            version: "1.0.0".into(),
            started: "2026-12-02T11:00:00Z".into(),
            config: "/etc/rancher/agent/config.yaml".into(),
            node: "node-a".into(),
            sources: vec![
                SourceStatus { kind: "local".into(), target: "directory /plans".into(), ..Default::default() },
                SourceStatus {
                    kind: "secret".into(),
                    target: "secret ns/p".into(),
                    lease: "held as a".into(),
                    problem: "the Secret does not exist".into(),
                    problem_since: "2026-12-02T11:59:00Z".into(),
                },
            ],
            api: Some(ApiStatus {
                server: "https://10.0.0.1:6443".into(),
                over: "HTTP/2, PINGed every 10s".into(),
                failing_since: "2026-12-02T11:59:40Z".into(),
                refused: vec![Refused { what: "the token was refused".into(), since: "2026-12-02T11:58:00Z".into() }],
            }),
            current: Some(Current {
                plan: "secret ns/p".into(),
                since: "2026-12-02T11:59:00Z".into(),
                instruction: "instruction 2/3 install".into(),
                instruction_since: "2026-12-02T11:59:50Z".into(),
            }),
            last: Some(Last {
                plan: "/plans/a.plan".into(),
                result: "failed: instruction 1/1 x: exit status 3\x1b[2J".into(),
                at: "2026-12-02T11:30:00Z".into(),
            }),
            retries: vec![Retry { plan: "/plans/a.plan".into(), at: "2026-12-02T12:00:30Z".into() }],
            updated: "2026-12-02T11:59:50Z".into(),
            ..AgentStatus::default()
        };
        assert_eq!(
            table(&s, now),
            [
                "agent:      running, pid 42, since 2026-12-02T11:00:00Z (1h ago)",
                "version:    1.0.0",
                "config:     /etc/rancher/agent/config.yaml",
                "node:       node-a",
                "source:     local: directory /plans",
                "source:     secret: secret ns/p (Lease: held as a); the Secret does not exist, since 2026-12-02T11:59:00Z (1m ago)",
                "api server: https://10.0.0.1:6443, over HTTP/2, PINGed every 10s; requests failing since 2026-12-02T11:59:40Z (20s ago)",
                "refused:    the token was refused; since 2026-12-02T11:58:00Z (2m ago)",
                "applying:   secret ns/p, since 2026-12-02T11:59:00Z (1m ago)",
                "running:    instruction 2/3 install, since 2026-12-02T11:59:50Z (10s ago)",
                "last:       /plans/a.plan: failed: instruction 1/1 x: exit status 3\\u{1b}[2J, 2026-12-02T11:30:00Z (30m ago)",
                "retry:      /plans/a.plan 2026-12-02T12:00:30Z (in 30s)",
                "updated:    2026-12-02T11:59:50Z (10s ago)",
            ]
        );
    }
}
