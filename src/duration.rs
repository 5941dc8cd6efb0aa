//! Durations as people write and read them, one copy each: [`parse`] reads the config file's and
//! the command line's form (`10s`, `500ms`, `5m`, `1h`, `1.5s`, or a bare number of seconds),
//! [`show`] writes a duration back in that form, and [`human`] writes one for a log or result line
//! (`120ms`, `3.8s`, `2m05s`, rounded down to what is shown).

use crate::quoted;
use std::time::Duration;

/// `10s`, `500ms`, `5m`, `1h`, `1.5s`, or a bare number of seconds. Exact (no floating point).
/// The error is one line that quotes the text.
pub fn parse(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let bad = || format!("{} is not a duration such as \"10s\", \"500ms\" or \"5m\"", quoted(s));
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit_nanos: u128 = match unit {
        "" | "s" => 1_000_000_000,
        "ms" => 1_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ if num.is_empty() => return Err(bad()),
        _ => return Err(format!("{}: unknown unit {} (use ms, s, m or h)", quoted(s), quoted(unit))),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let digits = |d: &str| d.bytes().all(|b| b.is_ascii_digit());
    if (int.is_empty() && frac.is_empty()) || !digits(int) || !digits(frac) {
        return Err(bad());
    }
    let too_long = || format!("{} is too long", quoted(s));
    let int: u128 = if int.is_empty() { 0 } else { int.parse().map_err(|_| too_long())? };
    let mut nanos = int.checked_mul(unit_nanos).ok_or_else(too_long)?;
    // Fractional digits beyond nanosecond precision are dropped.
    let mut scale = unit_nanos;
    for b in frac.bytes() {
        scale /= 10;
        nanos += u128::from(b - b'0') * scale;
    }
    let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| too_long())?;
    Ok(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

/// [`parse`], refusing zero (a command-line grace period or timeout).
pub fn parse_positive(s: &str) -> Result<Duration, String> {
    let d = parse(s)?;
    if d.is_zero() {
        return Err(format!("{s:?}: must be positive"));
    }
    Ok(d)
}

/// `10s`, `250ms`, `1.5s`, `0.000001s`: the form [`parse`] reads back, exactly. Whole seconds
/// are `Ns`; less than a second in whole milliseconds is `Nms`; anything else is seconds with the
/// nanoseconds as decimals, trailing zeros trimmed (integer arithmetic: never
/// `2147483646.9999971s` for a duration just short of 2147483647 s).
pub fn show(d: Duration) -> String {
    let (secs, nanos) = (d.as_secs(), d.subsec_nanos());
    if nanos == 0 {
        return format!("{secs}s");
    }
    if secs == 0 && nanos.is_multiple_of(1_000_000) {
        return format!("{}ms", nanos / 1_000_000);
    }
    let frac = format!("{nanos:09}");
    format!("{secs}.{}s", frac.trim_end_matches('0'))
}

/// A duration for people: `120ms`, `3.8s`, `10s`, `2m05s`, `1h02m` (rounded down to what is shown).
pub fn human(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        // Tenths of a second, rounded down (never `3.8209999999999997s`); whole seconds bare.
        let tenths = ms / 100;
        if tenths.is_multiple_of(10) {
            format!("{}s", tenths / 10)
        } else {
            format!("{}.{}s", tenths / 10, tenths % 10)
        }
    } else if ms < 3_600_000 {
        let s = ms / 1000;
        if s.is_multiple_of(60) { format!("{}m", s / 60) } else { format!("{}m{:02}s", s / 60, s % 60) }
    } else {
        let m = ms / 60_000;
        if m.is_multiple_of(60) { format!("{}h", m / 60) } else { format!("{}h{:02}m", m / 60, m % 60) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_documented_form_exactly() {
        let ok = [
            ("10s", Duration::from_secs(10)),
            ("250ms", Duration::from_millis(250)),
            ("500ms", Duration::from_millis(500)),
            ("5m", Duration::from_secs(300)),
            ("1h", Duration::from_secs(3600)),
            ("1.5s", Duration::from_millis(1500)),
            ("1.5m", Duration::from_secs(90)),
            ("0.1s", Duration::from_millis(100)),
            (".5m", Duration::from_secs(30)),
            ("7", Duration::from_secs(7)),
            (" 10s ", Duration::from_secs(10)),
            ("0s", Duration::ZERO),
        ];
        for (s, want) in ok {
            assert_eq!(parse(s), Ok(want), "{s}");
        }
        for s in ["ten", "", "s", ".", "5d", "-5s", "1.2.3s", "10 s", "1e3s", "99999999999999999999999h"] {
            let e = parse(s).expect_err(s);
            assert!(!e.contains('\n'), "{e}");
        }
        assert!(parse("5d").unwrap_err().contains("unknown unit \"d\""));
        assert_eq!(parse_positive("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_positive("0s"), Err("\"0s\": must be positive".into()));
        assert!(parse_positive("ten").is_err());
    }

    #[test]
    fn show_is_exact_and_reads_back() {
        let cases = [
            (Duration::ZERO, "0s"),
            (Duration::from_secs(10), "10s"),
            (Duration::from_millis(250), "250ms"),
            (Duration::from_millis(1), "1ms"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_millis(60_001), "60.001s"),
            (Duration::from_micros(1), "0.000001s"),
            (Duration::from_nanos(1), "0.000000001s"),
            (Duration::new(1, 5), "1.000000005s"),
            (Duration::from_secs(2_147_483_647), "2147483647s"),
            (Duration::new(2_147_483_646, 999_997_100), "2147483646.9999971s"),
            (Duration::new(2_147_483_646, 999_999_999), "2147483646.999999999s"),
            (Duration::new(u64::MAX, 999_999_999), "18446744073709551615.999999999s"),
        ];
        for (d, want) in cases {
            assert_eq!(show(d), want, "{d:?}");
            assert_eq!(parse(&show(d)), Ok(d), "{d:?} reads back");
        }
    }

    #[test]
    fn human_durations() {
        let ms = Duration::from_millis;
        let cases = [
            (ms(0), "0ms"),
            (ms(120), "120ms"),
            (ms(999), "999ms"),
            (ms(1000), "1s"),
            (Duration::from_secs_f64(3.8209999999999997), "3.8s"),
            (ms(10_000), "10s"),
            (ms(59_990), "59.9s"),
            (ms(60_000), "1m"),
            (ms(125_400), "2m05s"),
            (ms(3_600_000), "1h"),
            (ms(3_725_000), "1h02m"),
        ];
        for (d, want) in cases {
            assert_eq!(human(d), want, "{d:?}");
        }
    }
}
