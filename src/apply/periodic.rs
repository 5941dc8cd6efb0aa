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
/// backoff after its last failure ([`due_in`] is zero).
pub fn is_due(prev: Option<&PeriodicInstructionOutput>, period: Duration, now: DateTime<Utc>, forced: bool) -> bool {
    forced || due_in(prev, period, now).is_zero()
}

/// How long until a periodic instruction is due (zero: it is): a full period after its last
/// success and the failure backoff after its last failure have both passed. A time that cannot be
/// read holds nothing back, and neither does one in the future: no run happened then (the node's
/// clock was set back, as at a boot before the time is synced, or someone else wrote it), and
/// counting from it would hold the instruction back until the clock gets there.
pub fn due_in(prev: Option<&PeriodicInstructionOutput>, period: Duration, now: DateTime<Utc>) -> Duration {
    let Some(prev) = prev else { return Duration::ZERO };
    let left = |t: &str, d: Duration| {
        let (Some(t), Ok(d)) = (parse_unix_date(t), chrono::Duration::from_std(d)) else { return Duration::ZERO };
        if t > now {
            return Duration::ZERO;
        }
        t.checked_add_signed(d).and_then(|end| (end - now).to_std().ok()).unwrap_or(Duration::ZERO)
    };
    left(&prev.last_successful_run_time, period).max(left(&prev.last_failed_run_time, failure_backoff(prev.failures)))
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

    /// How long until due: the later of the period after a success and the backoff after a
    /// failure; nothing for what never ran or cannot be read.
    #[test]
    fn due_in_table() {
        let period = Duration::from_secs(60);
        let out = |ok: Option<i64>, failed: Option<i64>, failures| PeriodicInstructionOutput {
            last_successful_run_time: ok.map(|s| format_unix_date(at(s))).unwrap_or_default(),
            last_failed_run_time: failed.map(|s| format_unix_date(at(s))).unwrap_or_default(),
            failures,
            ..Default::default()
        };
        let s = Duration::from_secs;
        let rows: Vec<(&str, Option<PeriodicInstructionOutput>, i64, Duration)> = vec![
            ("never ran", None, 0, s(0)),
            ("ran 20 s ago", Some(out(Some(0), None, 0)), 20, s(40)),
            ("ran 60 s ago", Some(out(Some(0), None, 0)), 60, s(0)),
            ("ran an hour ago", Some(out(Some(0), None, 0)), 3600, s(0)),
            ("2 failures 10 s ago", Some(out(None, Some(0), 2)), 10, s(50)),
            ("a success 50 s ago, then 3 failures 5 s ago", Some(out(Some(0), Some(45), 3)), 50, s(85)),
            ("a success 10 s ago, a failure 70 s ago", Some(out(Some(0), Some(-60), 1)), 10, s(50)),
            ("ran a day from now (a clock set back)", Some(out(Some(86_400), None, 0)), 0, s(0)),
            ("failed a minute from now", Some(out(Some(-30), Some(60), 5)), 0, s(30)),
            (
                "unreadable times",
                Some(PeriodicInstructionOutput { last_successful_run_time: "junk".into(), ..Default::default() }),
                0,
                s(0),
            ),
        ];
        for (what, prev, now, want) in rows {
            assert_eq!(due_in(prev.as_ref(), period, at(now)), want, "{what}");
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
