//! The judge: how good did each suggestion turn out to be?
//!
//! The proposal leaves open what makes a computed Retry-After "good" and asks for the evidence
//! to decide. For every suggestion the judge follows the queue forward from the moment it was
//! made and records:
//!
//! * **observed drain time**: how long until the requests that were queued at that moment
//!   (the queue depth the estimate used) had been served, counted as that many completed
//!   responses after the suggestion; reported as the ratio observed / suggested;
//! * **admitted**: whether, at the first tick at or after `now + suggested`, the queue was below
//!   `max_queued_requests`, i.e. whether a client honouring the header would have been let in.
//!
//! Suggestions made in one tick with the same depth and value are judged together (a weight),
//! and at most `capacity` distinct ones wait at once, so memory stays bounded however many
//! rejections there are. A suggestion whose queue has not drained within `horizon` counts as
//! undrained.

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

/// Upper bounds of the observed / suggested histogram buckets (the last is +∞).
pub const RATIO_BUCKETS: [f64; 8] = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 4.0];

/// Running results for one service.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JudgeStats {
    /// Suggestions judged for admission.
    pub admission_judged: u64,
    /// Of those, the ones a retry at the suggested time would have been admitted.
    pub admitted: u64,
    /// Suggestions whose queue drained within the horizon.
    pub drained: u64,
    /// Suggestions whose queue had not drained within the horizon.
    pub undrained: u64,
    /// Counts of observed / suggested, per bucket of [`RATIO_BUCKETS`], then one for +∞.
    pub ratio_counts: [u64; RATIO_BUCKETS.len() + 1],
    /// Sum of observed / suggested over drained suggestions.
    pub ratio_sum: f64,
    /// Suggestions not followed because too many were already waiting.
    pub dropped: u64,
}

impl JudgeStats {
    /// Share of judged suggestions that would have been admitted.
    pub fn admitted_share(&self) -> Option<f64> {
        (self.admission_judged > 0).then(|| self.admitted as f64 / self.admission_judged as f64)
    }
}

#[derive(Clone, Debug)]
struct Pending {
    at: Instant,
    depth: u64,
    completed_at: u64,
    suggested_s: u64,
    weight: u64,
    drained: Option<Duration>,
    admitted: Option<bool>,
}

/// Follows one service's suggestions forward.
#[derive(Clone, Debug)]
pub struct Judge {
    max_queued_requests: Option<u64>,
    horizon: Duration,
    capacity: usize,
    pending: VecDeque<Pending>,
    stats: JudgeStats,
}

impl Judge {
    /// A judge; without `max_queued_requests` only drain times are judged.
    pub fn new(max_queued_requests: Option<u64>, horizon: Duration, capacity: usize) -> Self {
        Self {
            max_queued_requests,
            horizon,
            capacity: capacity.max(1),
            pending: VecDeque::new(),
            stats: JudgeStats::default(),
        }
    }

    /// Record a suggestion of `suggested_s` seconds made at `at`, when `depth` requests were
    /// queued and `completed_total` responses had completed.
    pub fn record(&mut self, at: Instant, depth: u64, completed_total: u64, suggested_s: u64) {
        if let Some(last) = self.pending.back_mut()
            && last.at == at
            && last.depth == depth
            && last.completed_at == completed_total
            && last.suggested_s == suggested_s
        {
            last.weight += 1;
            return;
        }
        if self.pending.len() >= self.capacity {
            self.stats.dropped += 1;
            return;
        }
        self.pending.push_back(Pending {
            at,
            depth,
            completed_at: completed_total,
            suggested_s,
            weight: 1,
            drained: None,
            admitted: None,
        });
    }

    /// Feed one tick: the queue depth and completed total at `now`. Settles what can be
    /// settled, and returns the observed / suggested ratios settled now, with their counts.
    pub fn observe(
        &mut self,
        now: Instant,
        queue_depth: u64,
        completed_total: u64,
    ) -> Vec<(f64, u64)> {
        let max_queued = self.max_queued_requests;
        let horizon = self.horizon;
        let stats = &mut self.stats;
        let mut settled = Vec::new();
        self.pending.retain_mut(|p| {
            let since = now.saturating_duration_since(p.at);
            if p.drained.is_none() && completed_total.saturating_sub(p.completed_at) >= p.depth {
                p.drained = Some(since);
            }
            let due = since >= Duration::from_secs(p.suggested_s);
            if p.admitted.is_none() && due {
                p.admitted = max_queued.map(|max| queue_depth < max);
            }
            let admission_settled = due;
            let drain_settled = p.drained.is_some() || since > horizon;
            if !(admission_settled && drain_settled) {
                return true;
            }
            if let Some(admitted) = p.admitted {
                stats.admission_judged += p.weight;
                if admitted {
                    stats.admitted += p.weight;
                }
            }
            match p.drained {
                Some(observed) => {
                    stats.drained += p.weight;
                    let ratio = observed.as_secs_f64() / p.suggested_s.max(1) as f64;
                    let bucket = RATIO_BUCKETS
                        .iter()
                        .position(|upper| ratio <= *upper)
                        .unwrap_or(RATIO_BUCKETS.len());
                    stats.ratio_counts[bucket] += p.weight;
                    stats.ratio_sum += ratio * p.weight as f64;
                    settled.push((ratio, p.weight));
                }
                None => stats.undrained += p.weight,
            }
            false
        });
        settled
    }

    /// The running results.
    pub fn stats(&self) -> &JudgeStats {
        &self.stats
    }

    /// Suggestions still being followed.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn drain_time_and_admission_of_one_suggestion() {
        let t0 = Instant::now();
        let mut judge = Judge::new(Some(10), secs(600), 16);
        // 6 queued, 100 completed so far, suggested 3 s.
        judge.record(t0, 6, 100, 3);
        judge.observe(t0 + secs(1), 12, 102);
        judge.observe(t0 + secs(2), 11, 105);
        assert_eq!(judge.pending(), 1, "not due yet");
        // At 3 s: 106 completed (6 drained at 3 s) and the queue is 9 < 10: admitted.
        judge.observe(t0 + secs(3), 9, 106);
        let s = judge.stats();
        assert_eq!((s.admission_judged, s.admitted, s.drained), (1, 1, 1));
        // ratio 3 / 3 = 1.0 → the bucket "≤ 1.0".
        assert_eq!(s.ratio_counts[3], 1);
        assert_eq!(judge.pending(), 0);
    }

    #[test]
    fn identical_suggestions_of_one_tick_share_a_record() {
        let t0 = Instant::now();
        let mut judge = Judge::new(Some(4), secs(600), 1);
        for _ in 0..5 {
            judge.record(t0, 2, 0, 1);
        }
        judge.record(t0, 3, 0, 1); // a different one: no room left
        assert_eq!(judge.stats().dropped, 1);
        judge.observe(t0 + secs(1), 9, 2);
        let s = judge.stats();
        assert_eq!((s.admission_judged, s.admitted, s.drained), (5, 0, 5));
    }

    #[test]
    fn a_queue_that_never_drains_is_undrained_after_the_horizon() {
        let t0 = Instant::now();
        let mut judge = Judge::new(None, secs(10), 4);
        judge.record(t0, 5, 0, 2);
        judge.observe(t0 + secs(2), 5, 1);
        assert_eq!(judge.pending(), 1);
        judge.observe(t0 + secs(11), 5, 1);
        let s = judge.stats();
        assert_eq!((s.undrained, s.admission_judged), (1, 0));
        assert_eq!(s.admitted_share(), None);
    }
}
