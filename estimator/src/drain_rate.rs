//! The drain rate: an EWMA of responses completed per second in the queue's scope.
//!
//! The proposal's average is `alpha` per one-second interval. Ticks may be shorter or longer
//! (`agent.tick_interval_ms`), so an interval of `dt` seconds is weighted
//! `1 − (1 − alpha)^dt`: a second of history is forgotten at the same pace whatever the tick,
//! and a piecewise-steady stream gives the same average at 100 ms ticks as at 1 s ticks.
//!
//! An interval updates the average only if the backends had work in it (something completed,
//! or something was in flight): an idle service tells nothing about capacity, and averaging its
//! zeros in would make the first rejection after a lull suggest the 60 s maximum. An interval
//! with work and no completions (a stall) is real information and pulls the average down.
//!
//! * **Seeding**: the first interval with completions sets the average to its rate, instead of
//!   averaging it with zero (which would underestimate the rate by 0.7³ ≈ 34% after three
//!   seconds with the default alpha).
//! * **Warm** once `warm_after` of time with completions has been seen (default 3 s: the
//!   proposal's "a minimum number of intervals with traffic", at its 1 s interval).
//! * **Cold again** after `cold_after` with no backend work at all (default 30 s). The average
//!   is then held from a past that may no longer exist: replicas scale, move and restart while
//!   a service idles, and half a minute is long against a request's life but short against
//!   autoscaling. The fallback ladder answers until the rate is warm again.
//! * A total that goes *down* means the counters restarted (the endpoint was watched anew):
//!   the rate starts over.

use std::time::{Duration, Instant};

/// The EWMA's constants; defaults are the proposal's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrainRateConstants {
    /// Weight of the newest second's rate (0.3).
    pub alpha: f64,
    /// Time with completions before the rate is used (3 s).
    pub warm_after: Duration,
    /// Time without any backend work after which the rate is forgotten (30 s).
    pub cold_after: Duration,
}

impl Default for DrainRateConstants {
    fn default() -> Self {
        Self {
            alpha: 0.3,
            warm_after: Duration::from_secs(3),
            cold_after: Duration::from_secs(30),
        }
    }
}

/// The EWMA of one service's drain rate.
#[derive(Clone, Debug)]
pub struct DrainRate {
    constants: DrainRateConstants,
    /// Responses per second; meaningful once an interval had completions.
    ewma: f64,
    /// Time covered by intervals with completions since the last cold start.
    time_with_completions: Duration,
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
    pub fn new(constants: DrainRateConstants) -> Self {
        Self {
            constants,
            ewma: 0.0,
            time_with_completions: Duration::ZERO,
            last: None,
            last_work: None,
        }
    }

    /// Feed one tick: the scope's total of completed responses and requests in flight, at
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
            let seconds = elapsed.as_secs_f64();
            let rate = completed as f64 / seconds;
            if self.time_with_completions.is_zero() {
                if completed > 0 {
                    self.ewma = rate;
                }
            } else {
                let weight = 1.0 - (1.0 - self.constants.alpha).powf(seconds);
                self.ewma += weight * (rate - self.ewma);
            }
            if completed > 0 {
                self.time_with_completions = self.time_with_completions.saturating_add(elapsed);
            }
        } else if self
            .last_work
            .is_none_or(|work| at.saturating_duration_since(work) >= self.constants.cold_after)
        {
            self.forget();
        }
    }

    /// Responses per second, once warm.
    pub fn rate(&self) -> Option<f64> {
        self.is_warm().then_some(self.ewma)
    }

    /// True once enough time with completions has been seen since the last cold start.
    pub fn is_warm(&self) -> bool {
        !self.time_with_completions.is_zero()
            && self.time_with_completions >= self.constants.warm_after
    }

    /// The average so far, warm or not (for metrics).
    pub fn ewma(&self) -> f64 {
        self.ewma
    }

    fn forget(&mut self) {
        self.ewma = 0.0;
        self.time_with_completions = Duration::ZERO;
        self.last_work = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn constants(warm_after_s: u64) -> DrainRateConstants {
        DrainRateConstants {
            warm_after: secs(warm_after_s),
            ..DrainRateConstants::default()
        }
    }

    #[test]
    fn seeds_then_averages_and_warms_after_three_seconds() {
        let t0 = Instant::now();
        let mut d = DrainRate::new(constants(3));
        d.observe(t0, 0, 0);
        d.observe(t0 + secs(1), 10, 5); // 10/s: seed
        assert_eq!((d.ewma(), d.rate()), (10.0, None));
        d.observe(t0 + secs(2), 30, 5); // 20/s: 0.3·20 + 0.7·10 = 13
        assert!((d.ewma() - 13.0).abs() < 1e-9);
        assert_eq!(d.rate(), None);
        d.observe(t0 + secs(3), 30, 5); // stall, work in flight: 0.7·13 = 9.1, still 2 s
        assert!((d.ewma() - 9.1).abs() < 1e-9);
        assert!(!d.is_warm());
        d.observe(t0 + secs(4), 40, 0); // 10/s: 0.3·10 + 0.7·9.1 = 9.37, third second
        assert!((d.rate().unwrap() - 9.37).abs() < 1e-9);
    }

    #[test]
    fn alpha_is_per_second_whatever_the_tick() {
        // Half a second at 20/s after a seed of 10/s: weight 1 − 0.7^0.5 ≈ 0.1633.
        let t0 = Instant::now();
        let mut d = DrainRate::new(constants(1));
        d.observe(t0, 0, 1);
        d.observe(t0 + secs(1), 10, 1);
        d.observe(t0 + Duration::from_millis(1500), 20, 1);
        let weight = 1.0 - 0.7f64.sqrt();
        assert!(
            (d.ewma() - (10.0 + weight * 10.0)).abs() < 1e-9,
            "{}",
            d.ewma()
        );
        // At 100 ms ticks, warm after 3 s is thirty ticks with completions, not three.
        let mut d = DrainRate::new(constants(3));
        d.observe(t0, 0, 1);
        for tick in 1..=30u64 {
            assert!(!d.is_warm(), "warm after {} ticks", tick - 1);
            d.observe(t0 + Duration::from_millis(100 * tick), tick, 1);
        }
        assert_eq!(d.rate(), Some(10.0));
    }

    #[test]
    fn idle_intervals_hold_the_rate_and_a_long_idle_makes_it_cold() {
        let t0 = Instant::now();
        let mut d = DrainRate::new(constants(1));
        d.observe(t0, 0, 0);
        d.observe(t0 + secs(1), 8, 0);
        for s in 2..=30 {
            d.observe(t0 + secs(s), 8, 0);
            assert_eq!(d.rate(), Some(8.0), "idle second {s} holds the rate");
        }
        d.observe(t0 + secs(31), 8, 0);
        assert_eq!(d.rate(), None, "30 s after the last work: cold");
        d.observe(t0 + secs(32), 11, 0);
        assert_eq!(d.rate(), Some(3.0), "warm again, seeded afresh");
    }

    #[test]
    fn a_counter_restart_starts_over() {
        let t0 = Instant::now();
        let mut d = DrainRate::new(constants(1));
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
        let mut d = DrainRate::new(constants(1));
        d.observe(t0, 0, 0);
        d.observe(t0, 5, 0);
        d.observe(t0 + secs(1), 5, 0);
        assert_eq!(d.rate(), Some(5.0));
    }
}
