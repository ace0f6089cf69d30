//! The estimator and its judge on streams worked out by hand: queries and a subscribed
//! proxy's reports, each answer followed forward against the completions after it, and the
//! admitted share taken from what the proxy reported doing at the due time.

use std::time::{Duration, Instant};

use retry_after_estimator::{
    endpoint::Endpoint,
    {
        BackendLoad, DrainRateConstants, PolicyConstants, Query, RejectedAt, ReplicaQueue,
        RetryAfterPolicy, Rung, ServiceEstimator, ServiceLoad, ServiceSettings, SideLoad,
    },
};
use retry_after_protocol::Report;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A proxy-scope service over two backends (2 slots each), computing with the simple profile
/// and no jitter, warm after 3 s, 5 s static fallback.
fn service() -> ServiceEstimator {
    ServiceEstimator::new(ServiceSettings {
        name: "api".into(),
        rejected_at: RejectedAt::Proxy,
        replica_queue: ReplicaQueue::BeyondCapacity,
        policy: RetryAfterPolicy::RouterQueueDrainRate,
        constants: PolicyConstants {
            jitter: 0.0,
            ..PolicyConstants::simple()
        },
        drain: DrainRateConstants::default(),
        retry_after_s: Some(5),
        status_code: 429,
        backends: vec![
            (Endpoint::AnyAddress(9001), Some(2)),
            (Endpoint::AnyAddress(9002), Some(2)),
        ],
        frontend: Some(Endpoint::AnyAddress(9000)),
    })
}

/// At second `t`: this proxy has completed 10 per second (5 per backend) and has 2 in flight
/// at each backend; its listener holds those 4 plus 20 queued. The replicas' server side also
/// serves other callers (100 per second), which must not count.
fn load(t: u64) -> ServiceLoad {
    let backend = BackendLoad {
        client: SideLoad {
            in_flight: 2,
            waiting: 0,
            completed_total: 5 * t,
        },
        server: SideLoad {
            in_flight: 2,
            waiting: 0,
            completed_total: 50 * t,
        },
        max_ongoing_requests: Some(2),
    };
    ServiceLoad {
        rejected_at: RejectedAt::Proxy,
        replica_queue: ReplicaQueue::BeyondCapacity,
        backends: vec![backend, backend],
        frontend_in_flight: Some(24),
    }
}

#[test]
fn every_answer_is_judged_against_completions_after_it_by_rung() {
    let t0 = Instant::now();
    let at = |millis: u64| t0 + ms(millis);
    let mut api = service();
    api.observe_load(at(0), load(0));
    api.observe_load(at(1000), load(1));

    // 1.5 s: not warm (1 s of completions seen) → static 5 s. Its queue: 20 (frontend 24 − 4
    // forwarded). 15 completed by 1.5 s, so it drains when 35 have: at 3.5 s. 2 s / 5 s = 0.4.
    let a = api.answer_and_record(at(1500), Query::default(), 0.5);
    assert_eq!((a.seconds, a.rung), (Some(5), Rung::Static));
    api.observe_load(at(2000), load(2));
    api.observe_load(at(3000), load(3));

    // 3.5 s: warm at 10/s, the client side only (the server side's 100/s is other callers).
    // The queue of 20 → 2 s; drains at 55 completions, at 5.5 s: ratio 1.0.
    let a = api.answer_and_record(at(3500), Query::default(), 0.5);
    assert_eq!((a.seconds, a.rung), (Some(2), Rung::Computed));
    assert_eq!(a.signals.drain_rate, Some(10.0));
    // The proxy's own depth 5 → 0.5 s → 1 s; drains at 40, at 4.0 s: 0.5 s / 1 s = 0.5.
    let a = api.answer_and_record(
        at(3500),
        Query {
            queue_depth: Some(5),
            backoff_streak: None,
        },
        0.5,
    );
    assert_eq!(a.seconds, Some(1));
    api.observe_load(at(4000), load(4));

    // 4.4 s: the subscribed proxy reports 10 admitted and 20 rejected since 3.0 s, its queue
    // now 30: those 20 answers were 3 s each, and drain when 44 + 30 = 74 have completed, at
    // 7.4 s: ratio 1.0.
    let report = |admitted, rejected, depth| Report {
        service: "api",
        admitted,
        rejected,
        queue_depth: depth,
        ..Report::default()
    };
    let a = api.report(Some(at(3000)), at(4400), &report(10, 20, Some(30)));
    assert_eq!((a.seconds, a.rung), (Some(3), Rung::Computed));
    for t in 5..=6 {
        api.observe_load(at(t * 1000), load(t));
    }
    // What the proxy did next: all 30 admitted in [4.4, 6.0] (the 1 s answer was due at 4.5,
    // the 2 s one at 5.5); 6 of 8 in [6.0, 8.0] (the 5 s static answer was due at 6.5, the
    // reported ones at 7.4).
    api.report(Some(at(4400)), at(6000), &report(30, 0, None));
    api.report(Some(at(6000)), at(8000), &report(6, 2, None));
    for t in 7..=12 {
        api.observe_load(at(t * 1000), load(t));
    }

    let judge = api.judge();
    let computed = &judge.computed;
    assert_eq!((computed.drained, computed.undrained), (22, 0));
    // Ratios: 1.0 (the 2 s query) and 20 × 1.0 (the report) in the bucket ≤ 1.0, 0.5 in ≤ 0.5.
    assert_eq!(computed.ratio_counts, [0, 1, 0, 21, 0, 0, 0, 0, 0]);
    assert!((computed.ratio_sum - 21.5).abs() < 1e-9, "{computed:?}");
    // Admission: the two queries were due where 30 of 30 were admitted; the 20 reported
    // rejections where 6 of 8 were (the report's own 2 rejections with no depth are not
    // judged: the static answer they got at 8.0 is past the stream).
    assert_eq!(computed.admission_judged, 22);
    assert!((computed.admitted_share().unwrap() - 17.0 / 22.0).abs() < 1e-9);
    let static_ = &judge.static_;
    assert_eq!((static_.drained, static_.ratio_counts[1]), (1, 1));
    assert!((static_.ratio_sum - 0.4).abs() < 1e-9);
    assert_eq!(static_.admitted_share(), Some(0.75));
    assert_eq!(judge.dropped, 0);
}

#[test]
fn ten_thousand_rejections_a_second_are_followed_in_bounded_memory() {
    let t0 = Instant::now();
    let mut api = service();
    for t in 0..=3 {
        api.observe_load(t0 + Duration::from_secs(t), load(t));
    }
    // Ten seconds of 10,000 queries a second with the proxy's depth cycling 0..64, plus a
    // report every 100 ms: every answer is followed, none dropped.
    for t in 3..13u64 {
        for i in 0..10_000u64 {
            let at = t0 + Duration::from_secs(t) + Duration::from_micros(i * 100);
            api.answer_and_record(
                at,
                Query {
                    queue_depth: Some(i % 64),
                    backoff_streak: None,
                },
                0.5,
            );
        }
        api.observe_load(t0 + Duration::from_secs(t + 1), load(t + 1));
    }
    for t in 14..40 {
        api.observe_load(t0 + Duration::from_secs(t), load(t));
    }
    let judge = api.judge();
    assert_eq!(judge.dropped, 0);
    assert_eq!(judge.computed.drained + judge.computed.undrained, 100_000);
}

#[test]
fn a_queue_invisible_to_every_source_gets_the_static_rung_with_its_reason() {
    let t0 = Instant::now();
    let mut settings = service().settings().clone();
    settings.frontend = None;
    assert!(settings.queue_needs_proxy_depth());
    let mut api = ServiceEstimator::new(settings);
    for t in 0..=5 {
        let mut l = load(t);
        l.frontend_in_flight = None;
        api.observe_load(t0 + Duration::from_secs(t), l);
    }
    let a = api.answer_and_record(t0 + ms(5500), Query::default(), 0.5);
    assert_eq!((a.seconds, a.rung), (Some(5), Rung::Static));
    assert_eq!(
        a.reason,
        Some(retry_after_estimator::FallbackReason::QueueInvisible)
    );
    // With the proxy's own depth it computes: 30 / 10 = 3 s.
    let a = api.answer_and_record(
        t0 + ms(5500),
        Query {
            queue_depth: Some(30),
            backoff_streak: None,
        },
        0.5,
    );
    assert_eq!((a.seconds, a.rung), (Some(3), Rung::Computed));
}
