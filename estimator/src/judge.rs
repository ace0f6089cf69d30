//! The judge: how good did each answer turn out to be?
//!
//! The proposal leaves open what makes a computed Retry-After "good" and asks for the evidence
//! to decide. The judge never grades an answer with the signal the answer came from. For every
//! answer with a header and a visible queue, on any path (a `QUERY`, or the rejections a
//! subscribed proxy reports, weighted by their count), labelled by its rung:
//!
//! * **primary, observed drain time**: the time from the answer until the scope's completions
//!   *after the answer* reach the queue depth of that moment, against the suggested delay.
//!   Completion totals are read at ticks; the count at the answer and the moment the target
//!   is crossed are interpolated linearly within their ticks, so completions before the answer
//!   never count toward draining it.
//! * **secondary, admitted share**: what the proxy actually did at the suggested time. Proxies
//!   `REPORT` their admissions and rejections per interval; an answer counts as admitted in
//!   the share of the requests the proxies admitted in the interval that holds
//!   `answer + suggested`. With no report there, it is not judged.
//!
//! Memory is bounded: answers are grouped per tick by (rung, suggested seconds, depth), with a
//! weight, and at most `capacity` groups wait at once; what does not fit is counted as dropped.
//! A queue that has not drained within `horizon` counts as undrained.

use std::{
    collections::{HashMap, VecDeque},
    time::{Duration, Instant},
};

use retry_after_policy::Rung;

/// Upper bounds of the observed / suggested histogram buckets (the last is +∞).
pub const RATIO_BUCKETS: [f64; 8] = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 4.0];

/// How long after its due time an answer waits for a proxy report before its admission is
/// left unjudged.
const REPORT_GRACE: Duration = Duration::from_secs(10);

/// Most proxy report intervals kept (per service).
const MAX_OUTCOMES: usize = 65_536;

/// Running results for one rung of one service.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RungStats {
    /// Answers whose queue drained within the horizon.
    pub drained: u64,
    /// Answers whose queue had not drained within the horizon.
    pub undrained: u64,
    /// Drained answers per bucket of [`RATIO_BUCKETS`] (observed / suggested), then +∞.
    pub ratio_counts: [u64; RATIO_BUCKETS.len() + 1],
    /// Sum of observed / suggested over drained answers.
    pub ratio_sum: f64,
    /// Answers judged for admission (a proxy report covered their due time).
    pub admission_judged: u64,
    /// Of those, the admitted share, summed (each answer adds the proxy's admitted share of
    /// the interval it was due in).
    pub admitted: f64,
}

impl RungStats {
    /// Share of judged answers after which a retry at the suggested time was admitted.
    pub fn admitted_share(&self) -> Option<f64> {
        (self.admission_judged > 0).then(|| self.admitted / self.admission_judged as f64)
    }
}

/// Running results for one service.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JudgeStats {
    /// Per rung that carries a header: computed, static.
    pub computed: RungStats,
    /// Static answers.
    pub static_: RungStats,
    /// Answers not followed because too many were already waiting.
    pub dropped: u64,
}

impl JudgeStats {
    /// The stats of `rung` (`None` for the rung without a header).
    pub fn rung(&self, rung: Rung) -> Option<&RungStats> {
        match rung {
            Rung::Computed => Some(&self.computed),
            Rung::Static => Some(&self.static_),
            Rung::None => None,
        }
    }

    fn rung_mut(&mut self, rung: Rung) -> Option<&mut RungStats> {
        match rung {
            Rung::Computed => Some(&mut self.computed),
            Rung::Static => Some(&mut self.static_),
            Rung::None => None,
        }
    }

    /// Count a settled answer group; the drained ones are returned for the histograms.
    fn count(&mut self, p: &Pending) -> Option<Settled> {
        let rung = self.rung_mut(p.key.rung)?;
        if let Some(share) = p.admitted {
            rung.admission_judged += p.weight;
            rung.admitted += share * p.weight as f64;
        }
        let Some(observed) = p.drained else {
            rung.undrained += p.weight;
            return None;
        };
        rung.drained += p.weight;
        let ratio = observed.as_secs_f64() / p.key.suggested_s.max(1) as f64;
        let bucket = RATIO_BUCKETS
            .iter()
            .position(|upper| ratio <= *upper)
            .unwrap_or(RATIO_BUCKETS.len());
        rung.ratio_counts[bucket] += p.weight;
        rung.ratio_sum += ratio * p.weight as f64;
        Some(Settled {
            rung: p.key.rung,
            ratio,
            weight: p.weight,
        })
    }
}

/// One drained answer group settled at a tick.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settled {
    /// Its rung.
    pub rung: Rung,
    /// Observed drain time over the suggested delay.
    pub ratio: f64,
    /// How many answers it stands for.
    pub weight: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    rung: Rung,
    suggested_s: u64,
    depth: u64,
}

/// Answers of the current tick with the same key.
#[derive(Clone, Copy, Debug)]
struct Open {
    weight: u64,
    /// Σ (answer time − `open_since`), nanoseconds, for the group's mean answer time.
    offset_sum_ns: u128,
}

#[derive(Clone, Debug)]
struct Pending {
    key: Key,
    weight: u64,
    at: Instant,
    /// Completions at which the queue of the answer has drained.
    target: f64,
    /// The last (time, completions) point seen, interpolation starts there.
    last: (Instant, f64),
    drained: Option<Duration>,
    /// The admitted share at the due time, once a report covered it.
    admitted: Option<f64>,
    /// Admission judged, or known never to be (no report will cover the due time).
    admission_done: bool,
}

impl Pending {
    /// Has the queue of the answer drained by `now`? The crossing is interpolated within the
    /// tick.
    fn follow_drain(&mut self, now: Instant, completed: f64) {
        if self.drained.is_some() {
            return;
        }
        if completed < self.target {
            self.last = (now, completed);
            return;
        }
        let (t0, c0) = self.last;
        let crossed = if completed > c0 && self.target > c0 {
            t0 + (now - t0).mul_f64((self.target - c0) / (completed - c0))
        } else {
            t0
        };
        self.drained = Some(crossed.saturating_duration_since(self.at));
    }

    /// The admitted share of the report intervals that hold the answer's due time, once a
    /// report covers it (or none will: a later report, or the grace passed).
    fn follow_admission(&mut self, now: Instant, outcomes: &VecDeque<Outcome>) {
        if self.admission_done {
            return;
        }
        let due = self.at + Duration::from_secs(self.key.suggested_s);
        let covering = outcomes.iter().filter(|o| o.from <= due && due <= o.to);
        let (admitted, total) = covering.fold((0u64, 0u64), |(a, t), o| {
            (a + o.admitted, t + o.admitted + o.rejected)
        });
        if total > 0 {
            self.admitted = Some(admitted as f64 / total as f64);
            self.admission_done = true;
        } else if outcomes.iter().any(|o| o.to >= due) || now > due + REPORT_GRACE {
            self.admission_done = true;
        }
    }

    /// Judged on both counts: admission, and drained or past the horizon.
    fn is_settled(&self, now: Instant, horizon: Duration) -> bool {
        let undrained = self.drained.is_none() && now.saturating_duration_since(self.at) > horizon;
        self.admission_done && (self.drained.is_some() || undrained)
    }
}

#[derive(Clone, Copy, Debug)]
struct Outcome {
    from: Instant,
    to: Instant,
    admitted: u64,
    rejected: u64,
}

/// Follows one service's answers forward.
#[derive(Clone, Debug)]
pub struct Judge {
    horizon: Duration,
    capacity: usize,
    open_since: Option<Instant>,
    open: HashMap<Key, Open>,
    last_tick: Option<(Instant, u64)>,
    pending: VecDeque<Pending>,
    outcomes: VecDeque<Outcome>,
    stats: JudgeStats,
}

impl Judge {
    /// A judge that follows at most `capacity` answer groups for at most `horizon` each.
    pub fn new(horizon: Duration, capacity: usize) -> Self {
        Self {
            horizon,
            capacity: capacity.max(1),
            open_since: None,
            open: HashMap::new(),
            last_tick: None,
            pending: VecDeque::new(),
            outcomes: VecDeque::new(),
            stats: JudgeStats::default(),
        }
    }

    /// Record `weight` answers of `suggested_s` seconds on `rung`, made at `at` when `depth`
    /// requests were queued. Answers without a header are not judged.
    pub fn record(&mut self, at: Instant, rung: Rung, suggested_s: u64, depth: u64, weight: u64) {
        if rung == Rung::None || weight == 0 {
            return;
        }
        let key = Key {
            rung,
            suggested_s,
            depth,
        };
        let since = *self.open_since.get_or_insert(at);
        let offset = at.saturating_duration_since(since).as_nanos();
        if let Some(open) = self.open.get_mut(&key) {
            open.weight = open.weight.saturating_add(weight);
            open.offset_sum_ns += offset * u128::from(weight);
            return;
        }
        if self.open.len() + self.pending.len() >= self.capacity {
            self.stats.dropped = self.stats.dropped.saturating_add(weight);
            return;
        }
        self.open.insert(
            key,
            Open {
                weight,
                offset_sum_ns: offset * u128::from(weight),
            },
        );
    }

    /// What the proxies did between `from` and `to`: requests admitted and rejected.
    pub fn report_outcome(&mut self, from: Instant, to: Instant, admitted: u64, rejected: u64) {
        if self.outcomes.len() >= MAX_OUTCOMES {
            self.outcomes.pop_front();
        }
        self.outcomes.push_back(Outcome {
            from: from.min(to),
            to,
            admitted,
            rejected,
        });
    }

    /// Feed one tick: the scope's completed total at `now`. Settles what can be settled and
    /// returns the drained answer groups settled now.
    pub fn observe(&mut self, now: Instant, completed_total: u64) -> Vec<Settled> {
        let completed = completed_total as f64;
        self.close_tick(now, completed);
        self.last_tick = Some((now, completed_total));
        self.forget_outcomes_before(now);
        let mut settled = Vec::new();
        let (horizon, outcomes, stats) = (self.horizon, &self.outcomes, &mut self.stats);
        self.pending.retain_mut(|p| {
            p.follow_drain(now, completed);
            p.follow_admission(now, outcomes);
            if !p.is_settled(now, horizon) {
                return true;
            }
            settled.extend(stats.count(p));
            false
        });
        settled
    }

    /// This tick's answers become pending, each group at its mean answer time and with the
    /// completion count there interpolated between the last tick and this one.
    fn close_tick(&mut self, now: Instant, completed: f64) {
        let Some(since) = self.open_since.take() else {
            return;
        };
        let (prev_at, prev_completed) = self
            .last_tick
            .map_or((since, completed), |(t, c)| (t, c as f64));
        for (key, open) in self.open.drain() {
            let mean = Duration::from_nanos(
                u64::try_from(open.offset_sum_ns / u128::from(open.weight)).unwrap_or(u64::MAX),
            );
            let at = (since + mean).min(now);
            let baseline = interpolate((prev_at, prev_completed), (now, completed), at);
            self.pending.push_back(Pending {
                key,
                weight: open.weight,
                at,
                target: baseline + key.depth as f64,
                last: (at, baseline),
                drained: None,
                admitted: None,
                admission_done: false,
            });
        }
    }

    /// Drop report intervals that no pending answer can be due in any more.
    fn forget_outcomes_before(&mut self, now: Instant) {
        if let Some(oldest) = now.checked_sub(self.horizon + Duration::from_secs(120)) {
            while self.outcomes.front().is_some_and(|o| o.to < oldest) {
                self.outcomes.pop_front();
            }
        }
    }

    /// The running results.
    pub fn stats(&self) -> &JudgeStats {
        &self.stats
    }

    /// Answer groups still being followed (or of the current tick).
    pub fn pending(&self) -> usize {
        self.pending.len() + self.open.len()
    }
}

/// The completions at `at` on the line from `a` to `b`.
fn interpolate(a: (Instant, f64), b: (Instant, f64), at: Instant) -> f64 {
    let span = b.0.saturating_duration_since(a.0).as_secs_f64();
    if span <= 0.0 {
        return b.1;
    }
    let part = at.saturating_duration_since(a.0).as_secs_f64().min(span) / span;
    a.1 + (b.1 - a.1) * part
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn completions_before_the_answer_do_not_drain_it() {
        let t0 = Instant::now();
        let mut judge = Judge::new(Duration::from_secs(600), 16);
        judge.observe(t0, 100);
        // 10 completions per second, steady. Answer at 0.5 s: 105 completed by then; depth 10
        // drains when 115 have completed, at 1.5 s: observed 1 s, suggested 2 s → ratio 0.5.
        judge.record(t0 + ms(500), Rung::Computed, 2, 10, 1);
        judge.observe(t0 + ms(1000), 110);
        assert_eq!(judge.observe(t0 + ms(2000), 120), vec![]);
        // Settles once due (2.5 s) and past the report grace, with no report: unjudged admission.
        judge.observe(t0 + ms(13_000), 230);
        let s = &judge.stats().computed;
        assert_eq!((s.drained, s.admission_judged), (1, 0));
        assert!((s.ratio_sum - 0.5).abs() < 1e-9, "{s:?}");
        assert_eq!(s.ratio_counts[1], 1, "bucket ≤ 0.5");
    }

    #[test]
    fn admission_comes_from_what_the_proxy_did_at_the_due_time() {
        let t0 = Instant::now();
        let mut judge = Judge::new(Duration::from_secs(600), 16);
        judge.observe(t0, 0);
        judge.record(t0 + ms(100), Rung::Static, 1, 0, 4);
        judge.observe(t0 + ms(200), 5);
        // The proxies admitted 3 of 4 in [1.0 s, 1.2 s], which holds the due time 1.1 s.
        judge.report_outcome(t0 + ms(1000), t0 + ms(1200), 3, 1);
        let settled = judge.observe(t0 + ms(1200), 9);
        assert_eq!(
            settled,
            vec![Settled {
                rung: Rung::Static,
                ratio: 0.0,
                weight: 4
            }]
        );
        let s = &judge.stats().static_;
        assert_eq!(s.admission_judged, 4);
        assert_eq!(s.admitted_share(), Some(0.75));
        assert_eq!(judge.stats().computed, RungStats::default());
    }

    #[test]
    fn a_thousand_answers_in_a_tick_are_one_group_and_the_overflow_is_counted() {
        let t0 = Instant::now();
        let mut judge = Judge::new(Duration::from_secs(600), 2);
        judge.observe(t0, 0);
        for i in 0..1000 {
            judge.record(t0 + Duration::from_micros(i * 100), Rung::Computed, 3, 7, 1);
        }
        judge.record(t0 + ms(1), Rung::Computed, 4, 7, 1);
        judge.record(t0 + ms(1), Rung::Computed, 5, 7, 9); // no room
        assert_eq!(judge.pending(), 2);
        assert_eq!(judge.stats().dropped, 9);
    }

    #[test]
    fn a_queue_that_never_drains_is_undrained_after_the_horizon() {
        let t0 = Instant::now();
        let mut judge = Judge::new(Duration::from_secs(10), 4);
        judge.observe(t0, 0);
        judge.record(t0, Rung::Computed, 2, 5, 1);
        judge.observe(t0 + ms(2000), 1);
        assert_eq!(judge.pending(), 1);
        // Past the horizon (10 s) and the report grace after its due time (2 s + 10 s).
        judge.observe(t0 + ms(12_500), 1);
        let s = &judge.stats().computed;
        assert_eq!((s.undrained, s.drained), (1, 0));
    }
}
