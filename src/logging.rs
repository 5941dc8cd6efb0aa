//! Log levels as the agent and its installer take them (`--log-level`, `NODEPLAN_LOG`,
//! `CATTLE_LOGLEVEL`, `CATTLE_AGENT_LOGLEVEL`). A leaf: it imports nothing of the crate; `cli`
//! sets up the subscriber, `install` checks a level before writing it into a unit.

/// The log levels accepted everywhere (`--log-level`, `NODEPLAN_LOG`, `CATTLE_LOGLEVEL`).
const LOG_LEVELS: &str = "trace, debug, info, warn, error";

/// One level name as tracing spells it. Besides nodeplan's own, logrus's names (system-agent's
/// `CATTLE_LOGLEVEL`) are taken: `warning`, and `fatal`/`panic` as `error`.
fn level_name(s: &str) -> Option<&'static str> {
    Some(match s.trim().to_ascii_lowercase().as_str() {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "warn" | "warning" => "warn",
        "error" | "fatal" | "panic" => "error",
        "off" => "off",
        _ => return None,
    })
}

/// A log level (`info`) or comma-separated `TARGET=LEVEL` directives (`info,nodeplan::process=debug`),
/// as an `EnvFilter` string. Anything else is an error listing the valid levels: an unknown word
/// must not become a filter that silently drops every line.
pub fn parse_log_level(s: &str) -> Result<String, String> {
    let bad = || format!("{s:?} is not a log level: use one of {LOG_LEVELS}");
    let mut out = Vec::new();
    for d in s.split(',').map(str::trim) {
        match d.split_once('=') {
            None => out.push(level_name(d).ok_or_else(bad)?.to_string()),
            Some((target, level)) => {
                let ok_target = !target.is_empty()
                    && target.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':' || c == '-');
                if !ok_target {
                    return Err(format!("{s:?}: {target:?} is not a module name (TARGET=LEVEL)"));
                }
                out.push(format!("{target}={}", level_name(level).ok_or_else(bad)?));
            }
        }
    }
    Ok(out.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_levels() {
        assert_eq!(parse_log_level("INFO"), Ok("info".into()));
        assert_eq!(parse_log_level("warning"), Ok("warn".into()));
        assert_eq!(parse_log_level("info,nodeplan::process=debug"), Ok("info,nodeplan::process=debug".into()));
        let e = parse_log_level("bogus").unwrap_err();
        assert!(e.contains("trace, debug, info, warn, error"), "{e}");
        assert!(parse_log_level("nodeplan=loud").is_err());
        assert!(parse_log_level("").is_err());
    }
}
