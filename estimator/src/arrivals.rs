//! Reported arrivals laid out on a timeline, so that a rate can be read from whole intervals.
//!
//! A proxy's report counts the requests of the interval since its last one and arrives at the
//! interval's end. Read at the agent's ticks as "what arrived since the last tick", a report
//! every second against a tick every second gives some ticks none and others two: the rate
//! read swings between 0.6 and 1.3 times the truth, for as long as the two clocks keep their
//! phase (a Lua reporter sleeping 1 s drifts by a few percent a second). Here each report's
//! count is spread over the 100 ms bins of the interval it covers, and a tick reads the bins
//! up to [`Timeline::settled_before`]: a moment far enough back that every reporter's count
//! for it has arrived (the longest report interval seen lately, and a bin more).

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

/// The width of one bin.
pub const ARRIVAL_BIN: Duration = Duration::from_millis(100);
/// How long the longest report interval is remembered as the reporters' pace.
const PACE_MEMORY: Duration = Duration::from_secs(10);
/// The longest wait for a reporter's counts: a report interval longer than this is read in
/// part once it arrives (its earlier part in the first bin not yet read).
const MAX_WAIT: Duration = Duration::from_secs(10);
/// The most bins held not yet read (a tick of a minute and the longest wait).
const MAX_BINS: usize = 720;

/// Counts per 100 ms bin not yet read, and the reporters' pace.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    /// The bin (in [`ARRIVAL_BIN`]s from the epoch) that `bins[0]` counts; every bin before it
    /// has been read.
    first: u64,
    bins: VecDeque<f64>,
    /// The longest report interval lately, and when it ended.
    longest: Option<(Duration, Instant)>,
}

/// What one read of the timeline took.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Taken {
    /// The count over the bins read.
    pub count: f64,
    /// How long those bins cover.
    pub span: Duration,
}

impl Timeline {
    /// `count` arrivals over `[from, to]` (offsets from the epoch), spread evenly over the bins
    /// the interval covers; what falls before the first bin not yet read goes to that bin.
    pub fn add(&mut self, from: Duration, to: Duration, count: f64) {
        let (from, to) = (bins(from), bins(to).max(bins(from)));
        let start = from.max(self.first as f64);
        let end = to.max(start);
        if end - start < 1e-9 {
            self.add_to_bin(start.floor() as u64, count);
            return;
        }
        // The share before the first unread bin lands in it with the first slice.
        let early = count * (start - from) / (to - from).max(1e-9);
        let per_bin = (count - early) / (end - start);
        let mut at = start;
        let mut carried = early;
        while at < end {
            let bin = at.floor();
            let next = (bin + 1.0).min(end);
            self.add_to_bin(bin as u64, carried + per_bin * (next - at));
            carried = 0.0;
            at = next;
        }
    }

    fn add_to_bin(&mut self, bin: u64, count: f64) {
        let index = (bin.max(self.first) - self.first) as usize;
        let index = index.min(MAX_BINS - 1);
        if self.bins.len() <= index {
            self.bins.resize(index + 1, 0.0);
        }
        self.bins[index] += count;
    }

    /// A report covering `interval` ended at `at`: the reporters' pace follows the longest.
    pub fn paced(&mut self, interval: Duration, at: Instant) {
        let keep = self.longest.is_some_and(|(longest, seen)| {
            longest > interval && at.saturating_duration_since(seen) < PACE_MEMORY
        });
        if !keep {
            self.longest = Some((interval, at));
        }
    }

    /// The longest report interval lately, if any.
    pub fn pace(&self, at: Instant) -> Option<Duration> {
        self.longest
            .filter(|(_, seen)| at.saturating_duration_since(*seen) < PACE_MEMORY)
            .map(|(longest, _)| longest)
    }

    /// How far behind `at` the counts are complete: the longest report interval lately and a
    /// bin more (nothing before the first report).
    pub fn settled_before(&self, at: Instant) -> Duration {
        self.pace(at)
            .map_or(Duration::ZERO, |pace| (pace + ARRIVAL_BIN).min(MAX_WAIT))
    }

    /// Read the bins before `until` (an offset from the epoch), once each.
    pub fn take(&mut self, until: Duration) -> Taken {
        let until = bins(until).floor() as u64;
        if until <= self.first {
            return Taken {
                count: 0.0,
                span: Duration::ZERO,
            };
        }
        let read = (until - self.first) as usize;
        let count = self.bins.drain(..read.min(self.bins.len())).sum();
        let span = ARRIVAL_BIN * u32::try_from(until - self.first).unwrap_or(u32::MAX);
        self.first = until;
        Taken { count, span }
    }
}

/// An offset from the epoch in bins.
fn bins(offset: Duration) -> f64 {
    offset.as_secs_f64() / ARRIVAL_BIN.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: f64) -> Duration {
        Duration::from_secs_f64(n)
    }

    #[test]
    fn a_report_is_spread_over_the_bins_of_its_interval() {
        let mut timeline = Timeline::default();
        timeline.add(s(0.0), s(1.0), 100.0);
        let half = timeline.take(s(0.5));
        assert!((half.count - 50.0).abs() < 1e-6, "{half:?}");
        assert_eq!(half.span, s(0.5));
        let rest = timeline.take(s(2.0));
        assert!((rest.count - 50.0).abs() < 1e-6, "{rest:?}");
        assert_eq!(rest.span, s(1.5));
    }

    #[test]
    fn what_falls_before_the_bins_read_is_read_next_not_lost() {
        let mut timeline = Timeline::default();
        timeline.take(s(1.0));
        timeline.add(s(0.0), s(2.0), 20.0);
        let taken = timeline.take(s(2.0));
        assert!((taken.count - 20.0).abs() < 1e-6, "{taken:?}");
        assert_eq!(taken.span, s(1.0));
    }

    #[test]
    fn reports_a_second_apart_read_a_second_behind_give_every_tick_its_share() {
        // A reporter every 1.05 s against a tick every second: each tick, read behind by the
        // reporters' pace, sees one second's arrivals (100/s).
        let t0 = Instant::now();
        let mut timeline = Timeline::default();
        let mut reported_to = 0.0;
        let mut next_report = 1.05;
        for tick in 1..40 {
            let now = tick as f64;
            while next_report <= now {
                timeline.add(s(reported_to), s(next_report), 105.0);
                timeline.paced(s(1.05), t0 + s(next_report));
                reported_to = next_report;
                next_report += 1.05;
            }
            let until = s(now).saturating_sub(timeline.settled_before(t0 + s(now)));
            let taken = timeline.take(until);
            if tick > 3 {
                let rate = taken.count / taken.span.as_secs_f64();
                assert!((rate - 100.0).abs() < 1e-6, "tick {tick}: {rate}");
            }
        }
    }

    #[test]
    fn the_pace_is_the_longest_interval_lately() {
        let t0 = Instant::now();
        let mut timeline = Timeline::default();
        assert_eq!(timeline.settled_before(t0), Duration::ZERO);
        timeline.paced(s(1.0), t0);
        timeline.paced(s(0.01), t0 + s(0.01));
        assert_eq!(timeline.settled_before(t0 + s(0.5)), s(1.1));
        // Forgotten after a while: the shorter pace takes over.
        timeline.paced(s(0.2), t0 + s(11.0));
        assert_eq!(timeline.settled_before(t0 + s(11.0)), s(0.3));
    }
}
