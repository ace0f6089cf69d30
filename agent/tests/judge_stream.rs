//! The judge on a synthetic stream: constant arrivals above capacity, then a drain. Every
//! expected figure below is worked out by hand in the comments.

use std::time::{Duration, Instant};

use rand::{SeedableRng, rngs::SmallRng};
use retry_after_agent::{
    endpoint::Endpoint,
    estimate::{
        BackendLoad, PolicyConstants, Query, RetryAfterPolicy, Rung, ServiceEstimator, ServiceLoad,
        ServiceSettings,
    },
};

/// A computed-policy service with one backend and a frontend, without jitter or saturation
/// terms (so each suggestion is ceil(depth / drain)), and no static fallback.
fn plain_estimator(max_queued_requests: u64) -> ServiceEstimator {
    ServiceEstimator::new(ServiceSettings {
        name: "stream".into(),
        policy: RetryAfterPolicy::RouterQueueDrainRate,
        constants: PolicyConstants {
            jitter: 0.0,
            occupancy_weight: 0.0,
            backoff_weight: 0.0,
            ..PolicyConstants::default()
        },
        static_retry_after_s: None,
        status_code: 429,
        max_queued_requests: Some(max_queued_requests),
        backends: vec![(Endpoint::AnyAddress(9000), None)],
        frontend: Some(Endpoint::AnyAddress(8000)),
        tick_interval: Duration::from_secs(1),
    })
}

#[test]
fn admitted_share_and_drain_times_match_the_hand_computation() {
    // One backend draining 10 requests per second; the proxy's queue limit is 30.
    // Arrivals: 15/s during ticks 1..=6, then none. The proxy queue q(t) (the frontend's in
    // flight minus the 10 being served) grows by 5 a tick, then drains by 10:
    //   t:    0  1  2   3   4   5   6   7   8  9 10
    //   q:    0  5 10  15  20  25  30  20  10  0  0
    //   done: 0 10 20  30  40  50  60  70  80 90 90   (completed responses, total)
    let q = [0u64, 5, 10, 15, 20, 25, 30, 20, 10, 0, 0, 0];
    let done = [0u64, 10, 20, 30, 40, 50, 60, 70, 80, 90, 90, 90];
    // No jitter and no saturation terms: the suggestion is ceil(q / 10).
    let mut estimator = plain_estimator(30);
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(1);
    let mut suggestions = Vec::new();
    for t in 0..q.len() {
        let busy = if done[t] < 90 || t == 9 { 10 } else { 0 };
        estimator.observe_load(
            t0 + Duration::from_secs(t as u64),
            ServiceLoad {
                backends: vec![BackendLoad {
                    in_flight: busy,
                    client_in_flight: busy,
                    completed_total: done[t],
                    max_ongoing_requests: None,
                    accept_backlog: None,
                }],
                frontend_in_flight: Some(q[t] + busy),
            },
        );
        // One rejection per tick, during the overload and the drain.
        if (1..=9).contains(&t) {
            let r = estimator.estimate(
                t0 + Duration::from_secs(t as u64),
                Query::default(),
                &mut rng,
            );
            suggestions.push((t, r.rung, r.seconds, r.signals.queue_depth));
        }
    }
    // Warm after three intervals with completions (ticks 1, 2, 3); the drain EWMA is seeded
    // with 10/s and stays there. Before that: no static value, so no header.
    // Suggestions ceil(q / 10), clamped to at least 1:
    //   t=3: 15 → 2   t=4: 20 → 2   t=5: 25 → 3   t=6: 30 → 3
    //   t=7: 20 → 2   t=8: 10 → 1   t=9: 0 → 1
    assert_eq!(
        suggestions,
        vec![
            (1, Rung::None, None, 5),
            (2, Rung::None, None, 10),
            (3, Rung::Computed, Some(2), 15),
            (4, Rung::Computed, Some(2), 20),
            (5, Rung::Computed, Some(3), 25),
            (6, Rung::Computed, Some(3), 30),
            (7, Rung::Computed, Some(2), 20),
            (8, Rung::Computed, Some(1), 10),
            (9, Rung::Computed, Some(1), 0),
        ]
    );
    // Admission, at t + suggested, q < 30?
    //   t=3 → t=5: 25 yes   t=4 → t=6: 30 NO    t=5 → t=8: 10 yes   t=6 → t=9: 0 yes
    //   t=7 → t=9: 0 yes    t=8 → t=9: 0 yes    t=9 → t=10: 0 yes          → 6 of 7.
    // Drain, first tick when done − done(t) ≥ q(t):
    //   t=3: 30+15 → t=5 (2 s)   t=4: 40+20 → t=6 (2 s)   t=5: 50+25 → t=8 (3 s)
    //   t=6: 60+30 → t=9 (3 s)   t=7: 70+20 → t=9 (2 s)   t=8: 80+10 → t=9 (1 s)
    //   t=9: 90+0 → t=10 (1 s, the first tick after it)   → observed / suggested = 1 for all.
    let judge = estimator.judge();
    assert_eq!((judge.admission_judged, judge.admitted), (7, 6));
    assert_eq!(judge.admitted_share(), Some(6.0 / 7.0));
    assert_eq!((judge.drained, judge.undrained, judge.dropped), (7, 0, 0));
    assert_eq!(
        judge.ratio_counts,
        [0, 0, 0, 7, 0, 0, 0, 0, 0],
        "all in (0.75, 1.0]"
    );
    assert!((judge.ratio_sum - 7.0).abs() < 1e-12);
}

#[test]
fn a_slowdown_the_estimate_did_not_foresee_shows_as_ratios_above_one() {
    // The backend drains 10/s for four ticks, then only 5/s. A suggestion made at t=4 with 20
    // queued says ceil(20 / 10) = 2 s; the queue actually takes 4 s (t=8: 5 a tick).
    let mut estimator = plain_estimator(15);
    let done = [0u64, 10, 20, 30, 40, 45, 50, 55, 60, 65];
    let q = [20u64, 20, 20, 20, 20, 15, 10, 5, 0, 0];
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(1);
    for t in 0..done.len() {
        estimator.observe_load(
            t0 + Duration::from_secs(t as u64),
            ServiceLoad {
                backends: vec![BackendLoad {
                    in_flight: 10,
                    client_in_flight: 10,
                    completed_total: done[t],
                    max_ongoing_requests: None,
                    accept_backlog: None,
                }],
                frontend_in_flight: Some(q[t] + 10),
            },
        );
        if t == 4 {
            let r = estimator.estimate(t0 + Duration::from_secs(4), Query::default(), &mut rng);
            assert_eq!((r.rung, r.seconds), (Rung::Computed, Some(2)));
        }
    }
    // Drained when done ≥ 40 + 20 = 60: t=8, 4 s after → ratio 2.0 (bucket "≤ 2.0").
    // Admission at t=6: q = 10 < 15 → admitted.
    let judge = estimator.judge();
    assert_eq!(
        (judge.admission_judged, judge.admitted, judge.drained),
        (1, 1, 1)
    );
    assert_eq!(judge.ratio_counts, [0, 0, 0, 0, 0, 0, 1, 0, 0]);
}
