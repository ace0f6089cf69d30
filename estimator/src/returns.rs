//! What `scheduled_returns` reads besides the load: the returns already promised and the
//! fresh arrivals forecast, per service.
//!
//! * **Promised returns** are kept in a [`ReturnBook`] of one-second bins: every answer the
//!   agent gives to `QUERY`, and every value a proxy says it handed out (`REPORT … handed_out=`),
//!   is a client due back at the time named. A bin is freed when its second passes, so a proxy
//!   that stops reporting leaves nothing behind after a minute. What does not fit (a counter
//!   full) is counted in [`Returns::dropped`].
//! * **Fresh arrivals** are the requests proxies report (`admitted + rejected`) less the
//!   returns among them. A proxy that tells its retries (`retry_admitted=`, `retry_rejected=`)
//!   says how many were returns: those are taken, so a client told to come back that never
//!   does (wrk, a closed browser) takes nothing from the fresh arrivals. For a proxy that
//!   does not, the returns that fell due meanwhile are taken instead, in the share of the
//!   arrivals such proxies reported over the last tick: every return told is then assumed to
//!   come back. Each tick turns what arrived since the last one into a
//!   rate, averaged with a time constant of [`ARRIVALS_TIME_CONSTANT`] (2 s). With no report for
//!   [`ARRIVALS_STALE_AFTER`], the rate is unknown (and `scheduled_returns` counts no fresh
//!   arrivals).
//! * **The overload's age**: since when fresh arrivals have matched or exceeded the drain rate,
//!   until they have stayed below it for [`OVERLOAD_OVER_AFTER`].
//!
//! After an agent restart both are empty: answers count only the queue until the proxies'
//! next reports (one report interval for arrivals, and every value handed out from then on).

use std::time::{Duration, Instant};

use retry_after_policy::{MAX_RETRY_AFTER_S, PromisedReturns, ReturnBook};

/// How fast the fresh arrival rate follows a change: the weight of older samples falls by e
/// every 2 s (5 s admitted 78% of the retries on the real-socket scenarios in the simulator,
/// 2 s 90%, 1 s 90% with noisier samples).
pub const ARRIVALS_TIME_CONSTANT: Duration = Duration::from_secs(2);
/// A fresh arrival rate with no report for this long is unknown.
pub const ARRIVALS_STALE_AFTER: Duration = Duration::from_secs(10);
/// An overload (fresh arrivals at or above the drain rate) is over once arrivals have stayed
/// below the drain rate for this long: a second of respite is not the end of it.
pub const OVERLOAD_OVER_AFTER: Duration = Duration::from_secs(5);

/// One service's promised returns and fresh arrivals.
#[derive(Clone, Debug, Default)]
pub struct Returns {
    book: ReturnBook,
    /// The clock's zero: the first instant seen.
    epoch: Option<Instant>,
    /// Arrivals reported since the last tick, less the returns among them.
    pending: f64,
    /// Arrivals reported since the last tick by proxies that tell their retries, and by
    /// proxies that do not.
    told: f64,
    untold: f64,
    /// The share of the last tick's arrivals whose proxies told their retries: returns due
    /// are taken from the rest only (0 until a proxy tells).
    told_share: f64,
    /// Fresh arrivals per second (EWMA), once a tick has followed a report.
    rate: Option<f64>,
    last_tick: Option<Instant>,
    /// Every second before this one has had its returns subtracted from the arrivals.
    due_counted_to: u64,
    last_report: Option<Instant>,
    dropped: u64,
    /// Since when fresh arrivals have matched the drain rate, if they do.
    overloaded_since: Option<Instant>,
    /// The last tick at which they did.
    last_overloaded: Option<Instant>,
}

impl Returns {
    /// `count` clients told at `at` to come back after `seconds`. Values beyond the widest
    /// clamp (a static value of minutes) fall outside the schedule's minute and are not kept.
    pub fn promise(&mut self, at: Instant, seconds: u64, count: u64) {
        if seconds > MAX_RETRY_AFTER_S {
            return;
        }
        let now = self.second(at);
        let due = self.second(at + Duration::from_secs(seconds));
        self.settle_dues(now);
        if due < self.due_counted_to {
            // Dated in a second already settled (a report's interval is dated at its
            // middle): it fell due there, so it is not a fresh arrival.
            self.pending -= count as f64 * (1.0 - self.told_share);
            return;
        }
        let count32 = u32::try_from(count).unwrap_or(u32::MAX);
        self.dropped += match self.book.promise(now, due, count32) {
            Ok(()) => count - u64::from(count32),
            Err(_) => count,
        };
    }

    /// A proxy reported `arrivals` requests (admitted or rejected) at `at`, `retries` of
    /// them returns if it tells its retries.
    pub fn reported(&mut self, at: Instant, arrivals: u64, retries: Option<u64>) {
        let now = self.second(at);
        self.settle_dues(now);
        match retries {
            Some(retries) => {
                self.pending += arrivals.saturating_sub(retries) as f64;
                self.told += arrivals as f64;
            }
            None => {
                self.pending += arrivals as f64;
                self.untold += arrivals as f64;
            }
        }
        self.last_report = Some(at);
    }

    /// Take the returns due in every second before `now` from the arrivals of proxies that do
    /// not tell their retries, once each, before their bins can be reused.
    fn settle_dues(&mut self, now: u64) {
        if now > self.due_counted_to {
            let due = self.book.due_between(self.due_counted_to, now) as f64;
            self.pending -= due * (1.0 - self.told_share);
            self.due_counted_to = now;
        }
    }

    /// A tick at `at`: the returns that fell due since the last one are taken from the
    /// arrivals, what is left becomes a sample of the fresh arrival rate, and the overload's
    /// age follows the arrivals against `drain_rate`.
    pub fn tick(&mut self, at: Instant, drain_rate: Option<f64>) {
        self.sample_arrivals(at);
        let overloaded = match (self.arrival_rate(at), drain_rate) {
            (Some(arrivals), Some(drain)) => arrivals >= drain,
            _ => false,
        };
        if overloaded {
            self.overloaded_since.get_or_insert(at);
            self.last_overloaded = Some(at);
        } else if self
            .last_overloaded
            .is_none_or(|last| at.saturating_duration_since(last) >= OVERLOAD_OVER_AFTER)
        {
            self.overloaded_since = None;
        }
    }

    /// Seconds since the overload began at `at`, while it lasts.
    pub fn overload_age_s(&self, at: Instant) -> Option<f64> {
        self.overloaded_since
            .map(|since| at.saturating_duration_since(since).as_secs_f64())
    }

    fn sample_arrivals(&mut self, at: Instant) {
        let now = self.second(at);
        self.settle_dues(now);
        let Some(last) = self.last_tick.replace(at) else {
            self.pending = 0.0;
            return;
        };
        let dt = at.saturating_duration_since(last).as_secs_f64();
        if dt <= 0.0 {
            return;
        }
        let reported = self.told + self.untold;
        if reported > 0.0 {
            self.told_share = self.told / reported;
        }
        (self.told, self.untold) = (0.0, 0.0);
        if self.arrival_rate(at).is_none() {
            // No proxy reports (or none lately): returns falling due tell nothing of fresh
            // arrivals, and the next report starts the average afresh.
            (self.pending, self.rate) = (0.0, None);
            return;
        }
        let sample = self.pending / dt;
        let weight = 1.0 - (-dt / ARRIVALS_TIME_CONSTANT.as_secs_f64()).exp();
        self.rate = Some(match self.rate {
            Some(rate) => rate + weight * (sample - rate),
            None => sample.max(0.0),
        });
        self.pending = 0.0;
    }

    /// Fresh arrivals per second at `at`, if a proxy reported lately (0 until the first
    /// tick after the first report).
    pub fn arrival_rate(&self, at: Instant) -> Option<f64> {
        let recent = self
            .last_report
            .is_some_and(|r| at.saturating_duration_since(r) <= ARRIVALS_STALE_AFTER);
        recent.then(|| self.rate.unwrap_or(0.0).max(0.0))
    }

    /// The schedule from `at` on.
    pub fn ahead(&self, at: Instant) -> PromisedReturns {
        match self.epoch {
            Some(epoch) => self
                .book
                .ahead(at.saturating_duration_since(epoch).as_secs()),
            None => PromisedReturns::NONE,
        }
    }

    /// Promises that did not fit the schedule, since start.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Whole seconds from the epoch to `at` (the first instant seen is the epoch).
    fn second(&mut self, at: Instant) -> u64 {
        let epoch = *self.epoch.get_or_insert(at);
        at.saturating_duration_since(epoch).as_secs()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: f64) -> Duration {
        Duration::from_secs_f64(n)
    }

    #[test]
    fn promises_land_in_the_second_they_are_due() {
        let t0 = Instant::now();
        let mut returns = Returns::default();
        returns.tick(t0, None);
        returns.promise(t0 + s(0.5), 3, 2);
        returns.promise(t0 + s(0.7), 3, 1);
        let ahead = returns.ahead(t0 + s(1.0));
        assert_eq!((ahead.due(2), ahead.total()), (3, 3));
        // Once due, they are gone.
        assert_eq!(returns.ahead(t0 + s(4.0)).total(), 0);
        assert_eq!(returns.dropped(), 0);
    }

    #[test]
    fn fresh_arrivals_are_reported_requests_less_the_returns_due() {
        let t0 = Instant::now();
        let mut returns = Returns::default();
        returns.tick(t0, None);
        // 10 arrive each second, 4 of them returns promised the second before.
        returns.promise(t0, 1, 4);
        for second in 1..60u64 {
            let at = t0 + s(second as f64);
            returns.reported(at, 10, None);
            returns.promise(at, 1, 4);
            returns.tick(at, Some(8.0));
        }
        let rate = returns.arrival_rate(t0 + s(59.0)).unwrap();
        assert!((rate - 6.0).abs() < 0.1, "{rate}");
        // 6/s fresh against a drain of 8/s: no overload.
        assert_eq!(returns.overload_age_s(t0 + s(59.0)), None);
        // Reports stop: the rate is unknown after a while, and the promises run out.
        assert!(returns.arrival_rate(t0 + s(80.0)).is_none());
        assert_eq!(returns.ahead(t0 + s(61.0)).total(), 0);
    }

    /// The fresh arrival rate under wrk: 100 arrive each second, none a return, and 90 are
    /// told to come back in 2 s, which they never do; the proxy reports `retries` a second.
    fn fresh_rate_under_wrk(retries: Option<u64>) -> f64 {
        let t0 = Instant::now();
        let mut returns = Returns::default();
        returns.tick(t0, None);
        for second in 1..60u64 {
            let at = t0 + s(second as f64);
            returns.reported(at, 100, retries);
            returns.promise(at, 2, 90);
            returns.tick(at, Some(10.0));
        }
        returns.arrival_rate(t0 + s(59.0)).unwrap()
    }

    #[test]
    fn a_proxy_that_tells_its_retries_has_its_no_shows_count_as_nothing() {
        // A proxy keeping places tells none was a return.
        let told = fresh_rate_under_wrk(Some(0));
        assert!((told - 100.0).abs() < 0.5, "{told}");
        // One that cannot tell: every return told is assumed to come.
        let untold = fresh_rate_under_wrk(None);
        assert!((untold - 10.0).abs() < 0.5, "{untold}");
    }

    #[test]
    fn an_overload_ages_until_arrivals_stay_below_the_drain_for_a_while() {
        let t0 = Instant::now();
        let mut returns = Returns::default();
        returns.tick(t0, None);
        let mut tick = |second: u64, arrivals: u64, drain: f64| {
            let at = t0 + s(second as f64);
            returns.reported(at, arrivals, None);
            returns.tick(at, Some(drain));
            returns.overload_age_s(at)
        };
        assert_eq!(tick(1, 20, 10.0), Some(0.0), "begins");
        assert_eq!(tick(2, 20, 10.0), Some(1.0));
        // One quiet second does not end it (the average is still above the drain).
        assert_eq!(tick(3, 0, 10.0), Some(2.0));
        let mut last = None;
        for second in 4..20 {
            last = tick(second, 0, 10.0);
        }
        assert_eq!(last, None, "over once arrivals stayed below the drain");
    }

    #[test]
    fn what_does_not_fit_is_counted_and_what_lies_beyond_the_minute_is_not_kept() {
        let t0 = Instant::now();
        let mut returns = Returns::default();
        returns.promise(t0, 5, u64::from(u32::MAX) + 7);
        assert_eq!(returns.dropped(), 7);
        returns.promise(t0, 600, 3);
        assert_eq!(
            (returns.dropped(), returns.ahead(t0).total()),
            (7, u64::from(u32::MAX))
        );
    }

    #[test]
    fn returns_due_without_reports_do_not_weigh_on_the_first_report() {
        let t0 = Instant::now();
        let mut returns = Returns::default();
        returns.tick(t0, None);
        // Answers to queries fall due for a minute while no proxy reports.
        for second in 0..60u64 {
            returns.promise(t0 + s(second as f64), 1, 50);
            returns.tick(t0 + s(second as f64 + 0.5), Some(10.0));
        }
        assert_eq!(returns.arrival_rate(t0 + s(60.0)), None);
        // Then a proxy reports 8 a second: the rate is 8, not dragged below 0 by a minute of
        // returns.
        for second in 61..64u64 {
            returns.reported(t0 + s(second as f64), 8, None);
            returns.tick(t0 + s(second as f64), Some(10.0));
        }
        let rate = returns.arrival_rate(t0 + s(63.0)).unwrap();
        assert!(rate > 5.0, "{rate}");
    }

    #[test]
    fn an_overload_is_over_only_after_arrivals_stay_below_the_drain_for_5_s() {
        let t0 = Instant::now();
        let mut returns = Returns::default();
        returns.tick(t0, None);
        returns.reported(t0 + s(1.0), 30, None);
        returns.tick(t0 + s(1.0), Some(10.0));
        assert!(returns.overload_age_s(t0 + s(1.0)).is_some());
        // Drain rises far above the arrivals: still the overload for 5 s, then over.
        returns.reported(t0 + s(2.0), 1, None);
        returns.tick(t0 + s(2.0), Some(1000.0));
        returns.reported(t0 + s(5.5), 1, None);
        returns.tick(t0 + s(5.5), Some(1000.0));
        assert_eq!(returns.overload_age_s(t0 + s(5.5)), Some(4.5));
        returns.reported(t0 + s(6.5), 1, None);
        returns.tick(t0 + s(6.5), Some(1000.0));
        assert_eq!(returns.overload_age_s(t0 + s(6.5)), None);
    }
}
