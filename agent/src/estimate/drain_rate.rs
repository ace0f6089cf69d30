//! The drain rate: an EWMA of responses completed per second across a service's backends.
//!
//! Each observation carries the total of completed responses and the requests in flight. An
//! interval updates the average only if the backends had work in it (something completed, or
//! something was in flight): an idle service tells nothing about capacity, and averaging its
//! zeros in would make the first rejection after a lull suggest the 60 s maximum. An interval
//! with work and no completions (a stall) is real information and pulls the average down.
//!
//! * **Seeding**: the first interval with completions sets the average to its rate, instead of
//!   averaging it with zero (which would underestimate the rate by 0.7³ ≈ 34% after three
//!   intervals with the default alpha).
//! * **Warm** after `warm_after_intervals` intervals with completions.
//! * **Cold again** after `cold_after_s` seconds with no backend work at all (default 30 s).
//!   The average is then held from a past that may no longer exist: replicas scale, move and
//!   restart while a service idles, and half a minute is long against a request's life but short
//!   against autoscaling. The fallback ladder answers until the rate is warm again.
//! * A total that goes *down* means the counters restarted (the endpoint was watched anew):
//!   the rate starts over.

use std::time::{Duration, Instant};

/// The EWMA of one service's drain rate.
#[derive(Clone, Debug)]
pub struct DrainRate {
    alpha: f64,
    warm_after_intervals: u32,
    cold_after: Duration,
    /// Responses per second; meaningful once at least one interval had completions.
    ewma: f64,
    intervals_with_completions: u32,
    last: Option<Observation>,
    last_work: Option<Instant>,
}

#[derive(Clone, Copy, Debug)]
struct Observation {
    at: Instant,
    completed_total: u64,
    in_flight: u64,
}

impl DrainRate {
    /// A cold drain rate.
    pub fn new(alpha: f64, warm_after_intervals: u32, cold_after: Duration) -> Self {
        Self {
            alpha,
            warm_after_intervals: warm_after_intervals.max(1),
            cold_after,
            ewma: 0.0,
            intervals_with_completions: 0,
            last: None,
            last_work: None,
        }
    }

    /// Feed one tick: the service's total of completed responses and requests in flight, at
    /// `at` (ticks must not go backwards; a repeated instant is ignored).
    pub fn observe(&mut self, at: Instant, completed_total: u64, in_flight: u64) {
        let now = Observation {
            at,
            completed_total,
            in_flight,
        };
        let Some(last) = self.last.replace(now) else {
            return;
        };
        let Some(elapsed) = at.checked_duration_since(last.at).filter(|d| !d.is_zero()) else {
            self.last = Some(last);
            return;
        };
        if completed_total < last.completed_total {
            self.forget();
            return;
        }
        let completed = completed_total - last.completed_total;
        let had_work = completed > 0 || in_flight > 0 || last.in_flight > 0;
        if had_work {
            self.last_work = Some(at);
            let rate = completed as f64 / elapsed.as_secs_f64();
            if completed > 0 && self.intervals_with_completions == 0 {
                self.ewma = rate;
            } else if self.intervals_with_completions > 0 {
                self.ewma = self.alpha * rate + (1.0 - self.alpha) * self.ewma;
            }
            if completed > 0 {
                self.intervals_with_completions = self.intervals_with_completions.saturating_add(1);
            }
        } else if self
            .last_work
            .is_none_or(|work| at.saturating_duration_since(work) >= self.cold_after)
        {
            self.forget();
        }
    }

    /// Responses per second, once warm.
    pub fn rate(&self) -> Option<f64> {
        self.is_warm().then_some(self.ewma)
    }

    /// True once enough intervals with completions have been seen since the last cold start.
    pub fn is_warm(&self) -> bool {
        self.intervals_with_completions >= self.warm_after_intervals
    }

    /// The average so far, warm or not (for metrics).
    pub fn ewma(&self) -> f64 {
        self.ewma
    }

    fn forget(&mut self) {
        self.ewma = 0.0;
        self.intervals_with_completions = 0;
        self.last_work = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn seeds_then_averages_and_warms_after_three_intervals() {
        let t0 = Instant::now();
        let mut d = DrainRate::new(0.3, 3, secs(30));
        d.observe(t0, 0, 0);
        d.observe(t0 + secs(1), 10, 5); // 10/s: seed
        assert_eq!((d.ewma(), d.rate()), (10.0, None));
        d.observe(t0 + secs(2), 30, 5); // 20/s: 0.3·20 + 0.7·10 = 13
        assert!((d.ewma() - 13.0).abs() < 1e-9);
        assert_eq!(d.rate(), None);
        d.observe(t0 + secs(3), 30, 5); // stall, work in flight: 0.7·13 = 9.1, still 2 intervals
        assert!((d.ewma() - 9.1).abs() < 1e-9);
        assert!(!d.is_warm());
        d.observe(t0 + secs(4), 40, 0); // 10/s: 0.3·10 + 0.7·9.1 = 9.37, third interval
        assert!((d.rate().unwrap() - 9.37).abs() < 1e-9);
    }

    #[test]
    fn uneven_ticks_use_the_real_elapsed_time() {
        let t0 = Instant::now();
        let mut d = DrainRate::new(0.3, 1, secs(30));
        d.observe(t0, 100, 1);
        d.observe(t0 + Duration::from_millis(500), 110, 1);
        assert_eq!(d.rate(), Some(20.0));
    }

    #[test]
    fn idle_intervals_hold_the_rate_and_a_long_idle_makes_it_cold() {
        let t0 = Instant::now();
        let mut d = DrainRate::new(0.3, 1, secs(30));
        d.observe(t0, 0, 0);
        d.observe(t0 + secs(1), 8, 0);
        for s in 2..=30 {
            d.observe(t0 + secs(s), 8, 0);
            assert_eq!(d.rate(), Some(8.0), "idle second {s} holds the rate");
        }
        d.observe(t0 + secs(31), 8, 0);
        assert_eq!(d.rate(), None, "30 s after the last work: cold");
        // Warm again after one interval with completions (warm_after = 1), seeded afresh.
        d.observe(t0 + secs(32), 11, 0);
        assert_eq!(d.rate(), Some(3.0));
    }

    #[test]
    fn a_counter_restart_starts_over() {
        let t0 = Instant::now();
        let mut d = DrainRate::new(0.3, 1, secs(30));
        d.observe(t0, 50, 0);
        d.observe(t0 + secs(1), 60, 0);
        assert!(d.is_warm());
        d.observe(t0 + secs(2), 3, 0);
        assert!(!d.is_warm());
        d.observe(t0 + secs(3), 7, 0);
        assert_eq!(d.rate(), Some(4.0));
    }

    #[test]
    fn a_repeated_instant_is_ignored() {
        let t0 = Instant::now();
        let mut d = DrainRate::new(0.3, 1, secs(30));
        d.observe(t0, 0, 0);
        d.observe(t0, 5, 0);
        d.observe(t0 + secs(1), 5, 0);
        assert_eq!(d.rate(), Some(5.0));
    }
}
