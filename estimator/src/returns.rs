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
//!   come back. Each report's count is laid over the interval it covers on a [`Timeline`],
//!   and each tick turns the part of it every reporter has covered since the last tick (up to
//!   the longest report interval back) into a rate, averaged with a time constant of
//!   [`ARRIVALS_TIME_CONSTANT`] (2 s). With no report for
//!   [`ARRIVALS_STALE_AFTER`], the rate is unknown (and `scheduled_returns` counts no fresh
//!   arrivals).
//! * **The overload's age**: since when fresh arrivals have matched or exceeded the drain rate,
//!   until they have stayed below it for [`OVERLOAD_OVER_AFTER`].
//!
//! After an agent restart both are empty: answers count only the queue until the proxies'
//! next reports (one report interval for arrivals, and every value handed out from then on).

use std::time::{Duration, Instant};

use retry_after_policy::{MAX_RETRY_AFTER_S, PromisedReturns, RETURN_BINS, ReturnBook};

use crate::arrivals::Timeline;

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
    /// Arrivals reported, less the returns among them, over the intervals they cover.
    arrivals: Timeline,
    /// Since when (from the epoch) the timeline holds every report, once reports began after
    /// none: the rate's first sample is no earlier.
    measured_from: Duration,
    /// Arrivals reported since the last tick by proxies that tell their retries, and by
    /// proxies that do not.
    told: f64,
    untold: f64,
    /// The share of the last tick's arrivals whose proxies told their retries: returns due
    /// are taken from the rest only (0 until a proxy tells).
    told_share: f64,
    /// Fresh arrivals per second (EWMA), once a tick has followed a report.
    rate: Option<f64>,
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
            self.take_returns(due, count as f64);
            return;
        }
        let count32 = u32::try_from(count).unwrap_or(u32::MAX);
        self.dropped += match self.book.promise(now, due, count32) {
            Ok(()) => count - u64::from(count32),
            Err(_) => count,
        };
    }

    /// A proxy reported `arrivals` requests (admitted or rejected) over `from..at` (`None`:
    /// since a time unknown), `retries` of them returns if it tells its retries.
    pub fn reported(
        &mut self,
        from: Option<Instant>,
        at: Instant,
        arrivals: u64,
        retries: Option<u64>,
    ) {
        let now = self.second(at);
        let end = self.offset(at);
        // A report of a time unknown is taken to cover the reporters' pace, if any is known.
        let pace = self.arrivals.pace(at);
        let start = match from {
            Some(from) => Some(self.offset(from)),
            None => pace.map(|pace| end.saturating_sub(pace)),
        };
        if !self.reported_lately(at) {
            // The first report after none: the rate is measured from its start (from its end
            // if that is unknown), and returns that fell due before fell due in no reported
            // arrivals.
            let measured_from = start.unwrap_or(end);
            self.measured_from = measured_from;
            self.due_counted_to = self.due_counted_to.max(measured_from.as_secs());
        }
        self.settle_dues(now);
        let fresh = match retries {
            Some(retries) => {
                self.told += arrivals as f64;
                arrivals.saturating_sub(retries)
            }
            None => {
                self.untold += arrivals as f64;
                arrivals
            }
        };
        if let Some(start) = start {
            self.arrivals.add(start, end, fresh as f64);
            if from.is_some() {
                self.arrivals.paced(end.saturating_sub(start), at);
            }
        }
        self.last_report = Some(at);
    }

    /// Take the returns due in every second before `now` from the arrivals of proxies that do
    /// not tell their retries, once each, before their bins can be reused.
    fn settle_dues(&mut self, now: u64) {
        let from = self
            .due_counted_to
            .max(now.saturating_sub(RETURN_BINS as u64));
        for second in from..now {
            self.take_returns(second, f64::from(self.book.due(second)));
        }
        self.due_counted_to = self.due_counted_to.max(now);
    }

    /// `count` returns due in `second`: taken from the arrivals of that second in the share
    /// of proxies that do not tell their retries.
    fn take_returns(&mut self, second: u64, count: f64) {
        let start = Duration::from_secs(second);
        let share = 1.0 - self.told_share;
        if count > 0.0 && share > 0.0 {
            self.arrivals
                .add(start, start + Duration::from_secs(1), -count * share);
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
        let reported = self.told + self.untold;
        if reported > 0.0 {
            self.told_share = self.told / reported;
        }
        (self.told, self.untold) = (0.0, 0.0);
        let recent = self.reported_lately(at);
        if recent && self.arrivals.pace(at).is_none() {
            // Only reports of a time unknown so far: wait for one that says when it began.
            return;
        }
        let until = self
            .offset(at)
            .saturating_sub(self.arrivals.settled_before(at));
        let taken = self.arrivals.take(until);
        if !recent {
            // No proxy reports (or none lately): returns falling due tell nothing of fresh
            // arrivals, and the next report starts the average afresh.
            self.rate = None;
            return;
        }
        let dt = taken.span.as_secs_f64();
        let began = until.saturating_sub(taken.span);
        if dt <= 0.0 || self.rate.is_none() && began < self.measured_from {
            return;
        }
        // Returns taken in a window can outnumber what was reported in it (returns answered
        // while no proxy reported): a window has no fewer than no fresh arrivals.
        let sample = (taken.count / dt).max(0.0);
        let weight = 1.0 - (-dt / ARRIVALS_TIME_CONSTANT.as_secs_f64()).exp();
        self.rate = Some(match self.rate {
            Some(rate) => rate + weight * (sample - rate),
            None => sample,
        });
    }

    /// Fresh arrivals per second at `at`, if a proxy reported lately and a whole report
    /// interval has been read since reports began.
    pub fn arrival_rate(&self, at: Instant) -> Option<f64> {
        self.rate.filter(|_| self.reported_lately(at))
    }

    fn reported_lately(&self, at: Instant) -> bool {
        self.last_report
            .is_some_and(|r| at.saturating_duration_since(r) <= ARRIVALS_STALE_AFTER)
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
        self.offset(at).as_secs()
    }

    /// The time from the epoch to `at` (the first instant seen is the epoch).
    fn offset(&mut self, at: Instant) -> Duration {
        let epoch = *self.epoch.get_or_insert(at);
        at.saturating_duration_since(epoch)
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
            returns.reported(Some(at - s(1.0)), at, 10, None);
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
            returns.reported(Some(at - s(1.0)), at, 100, retries);
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
    fn a_reporter_a_little_slower_than_the_tick_reads_as_its_rate_at_every_tick() {
        // HAProxy's Lua sleeps 1 s between reports and spends a little on each: 1.05 s
        // apart, 100 requests a second, against the agent's tick every second. Read per tick,
        // some ticks saw no report and others two, and the rate swung from 0.6 to 1.3 times
        // the truth for tens of seconds at a time.
        let t0 = Instant::now();
        let mut returns = Returns::default();
        returns.tick(t0, None);
        let (mut reported_to, mut next_report) = (0.0, 1.05);
        for tick in 1..60 {
            let now = tick as f64;
            while next_report <= now {
                let (from, at) = (t0 + s(reported_to), t0 + s(next_report));
                returns.reported(Some(from), at, 105, Some(0));
                (reported_to, next_report) = (next_report, next_report + 1.05);
            }
            returns.tick(t0 + s(now), Some(1000.0));
            if tick > 20 {
                let rate = returns.arrival_rate(t0 + s(now)).unwrap();
                assert!((rate - 100.0).abs() < 1.0, "tick {tick}: {rate}");
            }
        }
    }

    #[test]
    fn a_first_report_of_a_time_unknown_does_not_start_the_rate_from_a_lump() {
        // HAProxy's Lua connects and reports what it counted since it started (or since its
        // last report on a connection that failed): 20,000 at once, then 10,000 a second.
        let t0 = Instant::now();
        let mut returns = Returns::default();
        let mut seen = Vec::new();
        for tick in 0..200 {
            let at = t0 + s(1.0 + f64::from(tick) * 0.2);
            if tick == 0 {
                returns.reported(None, at, 20_000, Some(0));
            } else if tick % 5 == 0 {
                returns.reported(Some(at - s(1.0)), at, 10_000, Some(0));
            }
            returns.tick(at, Some(1.0));
            seen.extend(returns.rate);
        }
        assert!(
            seen.iter().all(|&rate| (rate - 10_000.0).abs() < 1.0),
            "{seen:?}"
        );
    }

    #[test]
    fn an_overload_ages_until_arrivals_stay_below_the_drain_for_a_while() {
        let t0 = Instant::now();
        let mut returns = Returns::default();
        returns.tick(t0, None);
        let mut tick = |second: u64, arrivals: u64, drain: f64| {
            let at = t0 + s(second as f64);
            returns.reported(Some(at - s(1.0)), at, arrivals, None);
            returns.tick(at, Some(drain));
            returns.overload_age_s(at)
        };
        // Read a report interval behind: the first second is read at the second tick.
        assert_eq!(tick(1, 20, 10.0), None);
        assert_eq!(tick(2, 20, 10.0), Some(0.0), "begins");
        assert_eq!(tick(3, 0, 10.0), Some(1.0));
        // One quiet second does not end it (the average is still above the drain).
        assert_eq!(tick(4, 0, 10.0), Some(2.0));
        let mut last = None;
        for second in 5..20 {
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
        for second in 61..66u64 {
            returns.reported(
                Some(t0 + s(second as f64 - 1.0)),
                t0 + s(second as f64),
                8,
                None,
            );
            returns.tick(t0 + s(second as f64), Some(10.0));
        }
        let rate = returns.arrival_rate(t0 + s(65.0)).unwrap();
        assert!(rate > 5.0, "{rate}");
    }

    #[test]
    fn an_overload_is_over_only_after_arrivals_stay_below_the_drain_for_5_s() {
        let t0 = Instant::now();
        let mut returns = Returns::default();
        returns.tick(t0, None);
        let mut step = |from: f64, to: f64, arrivals: u64, drain: f64| {
            returns.reported(Some(t0 + s(from)), t0 + s(to), arrivals, None);
            returns.tick(t0 + s(to), Some(drain));
            returns.overload_age_s(t0 + s(to))
        };
        // Read a report interval behind: the second second reads the first.
        step(0.0, 1.0, 30, 10.0);
        assert_eq!(step(1.0, 2.0, 30, 10.0), Some(0.0));
        // Drain rises far above the arrivals: still the overload for 5 s, then over.
        step(2.0, 3.0, 1, 1000.0);
        step(3.0, 4.0, 1, 1000.0);
        assert_eq!(step(4.0, 6.5, 1, 1000.0), Some(4.5));
        assert_eq!(step(6.5, 7.5, 1, 1000.0), None);
    }
}
