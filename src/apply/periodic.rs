//! When a periodic instruction is due, and how its saved output changes after a run. Pure.

use crate::plan::{PeriodicInstructionOutput, format_unix_date, parse_unix_date};
use chrono::{DateTime, Utc};
use std::time::Duration;

/// Backoff after failures: 30 s × min(failures, 6) (at least one step).
pub fn failure_backoff(failures: i64) -> Duration {
    Duration::from_secs(30 * failures.clamp(1, 6) as u64)
}

/// Whether a periodic instruction should run now. A forced run (the one-time instructions were just
/// applied) always runs; otherwise it waits a full period after its last success and the failure
/// backoff after its last failure.
pub fn is_due(prev: Option<&PeriodicInstructionOutput>, period: Duration, now: DateTime<Utc>, forced: bool) -> bool {
    if forced {
        return true;
    }
    let Some(prev) = prev else { return true };
    let within = |t: &str, d: Duration| {
        parse_unix_date(t).is_some_and(|t| chrono::Duration::from_std(d).is_ok_and(|d| t > now - d))
    };
    if within(&prev.last_successful_run_time, period) {
        return false;
    }
    if within(&prev.last_failed_run_time, failure_backoff(prev.failures)) {
        return false;
    }
    true
}

/// The saved output after a completed run.
pub fn record_run(
    prev: Option<&PeriodicInstructionOutput>,
    name: &str,
    stdout: Vec<u8>,
    stderr: Option<Vec<u8>>,
    exit_code: i64,
    now: DateTime<Utc>,
) -> PeriodicInstructionOutput {
    let prev = prev.cloned().unwrap_or_default();
    let stamp = format_unix_date(now);
    let (last_ok, last_failed, failures) = if exit_code == 0 {
        (stamp, String::new(), 0)
    } else {
        (prev.last_successful_run_time, stamp, prev.failures + 1)
    };
    PeriodicInstructionOutput {
        name: name.to_string(),
        stdout,
        stderr: stderr.unwrap_or_default(),
        exit_code,
        last_successful_run_time: last_ok,
        failures,
        last_failed_run_time: last_failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(s: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + s, 0).unwrap()
    }

    #[test]
    fn schedule_table() {
        let period = Duration::from_secs(60);
        let ok_at =
            |s| PeriodicInstructionOutput { last_successful_run_time: format_unix_date(at(s)), ..Default::default() };
        let failed = |s, n| PeriodicInstructionOutput {
            last_failed_run_time: format_unix_date(at(s)),
            failures: n,
            ..Default::default()
        };
        let rows: Vec<(&str, Option<PeriodicInstructionOutput>, i64, bool, bool)> = vec![
            ("never ran", None, 0, false, true),
            ("ran 59 s ago", Some(ok_at(0)), 59, false, false),
            ("ran 60 s ago", Some(ok_at(0)), 60, false, true),
            ("forced inside the period", Some(ok_at(0)), 1, true, true),
            ("1 failure, 29 s ago", Some(failed(0, 1)), 29, false, false),
            ("1 failure, 30 s ago", Some(failed(0, 1)), 30, false, true),
            ("3 failures, 89 s ago", Some(failed(0, 3)), 89, false, false),
            ("3 failures, 90 s ago", Some(failed(0, 3)), 90, false, true),
            ("10 failures cap at 180 s: 179 s", Some(failed(0, 10)), 179, false, false),
            ("10 failures cap at 180 s: 180 s", Some(failed(0, 10)), 180, false, true),
            (
                "unparsable times run",
                Some(PeriodicInstructionOutput { last_successful_run_time: "junk".into(), ..Default::default() }),
                0,
                false,
                true,
            ),
        ];
        for (what, prev, now, forced, want) in rows {
            assert_eq!(is_due(prev.as_ref(), period, at(now), forced), want, "{what}");
        }
    }

    #[test]
    fn recording_keeps_last_success_on_failure_and_resets_on_success() {
        let first = record_run(None, "p", b"o".to_vec(), None, 0, at(0));
        assert_eq!(first.last_successful_run_time, format_unix_date(at(0)));
        let fail = record_run(Some(&first), "p", vec![], Some(b"e".to_vec()), 2, at(10));
        assert_eq!((fail.failures, fail.exit_code), (1, 2));
        assert_eq!(fail.last_successful_run_time, first.last_successful_run_time);
        assert_eq!(fail.last_failed_run_time, format_unix_date(at(10)));
        assert_eq!(fail.stderr, b"e");
        let fail2 = record_run(Some(&fail), "p", vec![], None, 1, at(50));
        assert_eq!(fail2.failures, 2);
        let ok = record_run(Some(&fail2), "p", vec![], None, 0, at(100));
        assert_eq!((ok.failures, ok.last_failed_run_time.as_str()), (0, ""));
    }
}
