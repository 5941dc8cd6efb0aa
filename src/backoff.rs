//! Back-off: the one exponential delay type ([`Backoff`]) and its jitter ([`jittered`]), shared by
//! the process supervisor's respawns, the reconcile loop's retries and the Kubernetes list/watch;
//! and [`earlier`], the draw that spreads a fleet's periodic requests (the Lease's renewals).
//!
//! Owns: delays only. It sleeps on nothing, spawns nothing and knows no caller; it sits below
//! every module that waits (`docs/architecture.md` and `tests/architecture.rs`).

use std::time::Duration;

/// Exponential delay: `initial` doubling up to `max`, back to `initial` after a run that stayed up
/// for `healthy_after`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    pub healthy_after: Duration,
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new(Duration::from_secs(1), Duration::from_secs(300), Duration::from_secs(600))
    }
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration, healthy_after: Duration) -> Backoff {
        Backoff { initial, max, healthy_after, next: initial }
    }

    /// The delay before the next start, given how long the last run lasted.
    pub fn after_run(&mut self, ran_for: Duration) -> Duration {
        if ran_for >= self.healthy_after {
            self.next = self.initial;
        }
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }
}

/// A random number for jitter: the standard library's random hash keys (drawn from the system once
/// per thread, so each agent of a fleet draws its own) over a counter. No system call per draw, and
/// the same on every platform.
fn random_u64() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    std::collections::hash_map::RandomState::new().hash_one(DRAWS.fetch_add(1, Ordering::Relaxed))
}

/// Up to a tenth more (at most one second), so a fleet that failed together does not retry in the
/// same millisecond.
pub fn jittered(d: Duration) -> Duration {
    let r = random_u64();
    d + (d / 10).min(Duration::from_secs(1)).mul_f64(r as f64 / u64::MAX as f64)
}

/// Up to `share` of `d` less, drawn uniformly: a fleet that started together (a rollout, the end
/// of an outage) spreads its periodic requests out instead of sending them in the same second.
/// Never more than `d`, so a period that must not be exceeded (a Lease's renewal) stays safe.
pub fn earlier(d: Duration, share: f64) -> Duration {
    let r = random_u64();
    d.saturating_sub(d.mul_f64(share.clamp(0.0, 1.0) * (r as f64 / u64::MAX as f64)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within `[d - share·d, d]`, and spread over it (not one fixed value).
    #[test]
    fn earlier_is_never_later_and_spreads() {
        let d = Duration::from_secs(10);
        let draws: Vec<Duration> = (0..200).map(|_| earlier(d, 0.5)).collect();
        assert!(draws.iter().all(|e| *e >= d / 2 && *e <= d), "{draws:?}");
        let (lo, hi) = (draws.iter().min().unwrap(), draws.iter().max().unwrap());
        assert!(*lo < d.mul_f64(0.6) && *hi > d.mul_f64(0.9), "spread over the range: {lo:?} … {hi:?}");
        assert_eq!(earlier(d, 0.0), d);
        assert!(earlier(d, 7.0) <= d, "a share above 1 is 1");
    }

    #[test]
    fn backoff_doubles_caps_and_resets_after_a_healthy_run() {
        let mut b = Backoff::default();
        let short = Duration::from_secs(1);
        let got: Vec<u64> = (0..12).map(|_| b.after_run(short).as_secs()).collect();
        assert_eq!(got, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]);
        assert_eq!(b.after_run(Duration::from_secs(600)).as_secs(), 1, "reset after 10 min up");
        assert_eq!(b.after_run(short).as_secs(), 2);
    }

    #[test]
    fn jitter_stays_within_a_tenth_and_at_most_a_second() {
        for d in [Duration::ZERO, Duration::from_secs(5), Duration::from_secs(300)] {
            for _ in 0..50 {
                let j = jittered(d);
                assert!(j >= d && j <= d + (d / 10).min(Duration::from_secs(1)), "{d:?} → {j:?}");
            }
        }
    }
}
