//! One policy in one place: the client library's answer from a pushed estimate equals the
//! agent's answer to a query with the same depth, streak and jitter draw, through the wire.
//! And the drain rate does not depend on the tick interval.

use std::time::{Duration, Instant};

#[path = "../../policy/tests/common/strategies.rs"]
mod strategies;

use proptest::prelude::*;
use rand::{RngExt, SeedableRng, rngs::SmallRng};
use retry_after_estimator::{
    endpoint::Endpoint,
    {
        BackendLoad, DrainRate, DrainRateConstants, PolicyConstants, Query, RejectedAt,
        ReplicaQueue, RetryAfterPolicy, ServiceEstimator, ServiceLoad, ServiceSettings, SideLoad,
    },
};
use retry_after_protocol::{EstimatePush, Request, Response};

fn settings(
    rejected_at: RejectedAt,
    policy: RetryAfterPolicy,
    constants: PolicyConstants,
    retry_after_s: Option<u64>,
    frontend: bool,
    max_ongoing: Option<u64>,
) -> ServiceSettings {
    ServiceSettings {
        name: "api".into(),
        rejected_at,
        replica_queue: ReplicaQueue::default(),
        policy,
        constants,
        drain: DrainRateConstants::default(),
        retry_after_s,
        status_code: 503,
        backends: vec![(Endpoint::AnyAddress(9001), max_ongoing)],
        frontend: frontend.then_some(Endpoint::AnyAddress(9000)),
    }
}

proptest! {
    #[test]
    fn the_clients_answer_from_a_push_is_the_agents_answer(
        rejected_at in prop_oneof![Just(RejectedAt::Proxy), Just(RejectedAt::Replica)],
        policy in prop::sample::select(RetryAfterPolicy::ALL.to_vec()),
        promised in prop::collection::vec((0u64..2_000, 1u64..=60), 0..40),
        constants in strategies::constants(),
        retry_after_s in prop::option::of(1u64..600),
        frontend in any::<bool>(),
        max_ongoing in prop::option::of(1u64..64),
        rates in prop::collection::vec((0u64..5_000, 0u64..200, 0u64..400), 1..8),
        queries in prop::collection::vec((prop::option::of(0u64..100_000), prop::option::of(0u32..20), 0.0..1.0f64), 1..16),
    ) {
        let mut agent = ServiceEstimator::new(settings(rejected_at, policy, constants, retry_after_s, frontend, max_ongoing));
        let t0 = Instant::now();
        let mut completed = 0;
        for (tick, (done, in_flight, frontend_in_flight)) in rates.iter().enumerate() {
            completed += done;
            let side = SideLoad { in_flight: *in_flight, waiting: 0, completed_total: completed };
            agent.observe_load(t0 + Duration::from_millis(700 * tick as u64), ServiceLoad {
                rejected_at,
                replica_queue: ReplicaQueue::default(),
                backends: vec![BackendLoad { client: side, server: side, max_ongoing_requests: max_ongoing }],
                frontend_in_flight: frontend.then_some(*frontend_in_flight),
            });
        }
        // Returns promised through a report (arrivals and values handed out), then a tick.
        let last = t0 + Duration::from_millis(700 * rates.len() as u64);
        let handed_out: Vec<String> = promised.iter().map(|(n, s)| format!("c{s}:{n}")).collect();
        let handed_out = if handed_out.is_empty() { "none".to_owned() } else { handed_out.join(",") };
        let report = format!("REPORT api admitted=40 rejected=90 handed_out={handed_out}");
        let Ok(Request::Report(report)) = Request::parse(report.as_bytes()) else {
            panic!("not a report: {report}");
        };
        agent.report(Some(last - Duration::from_millis(500)), last, &report);
        agent.observe_load(last + Duration::from_millis(700), ServiceLoad {
            rejected_at,
            replica_queue: ReplicaQueue::default(),
            backends: vec![BackendLoad { client: SideLoad { in_flight: 1, waiting: 0, completed_total: completed + 9 }, server: SideLoad { in_flight: 1, waiting: 0, completed_total: completed + 9 }, max_ongoing_requests: max_ongoing }],
            frontend_in_flight: frontend.then_some(3),
        });
        // Through the wire, as a subscriber receives it.
        let line = agent.push(1).to_string();
        let Ok(Response::Estimate(push)) = Response::parse(&line) else {
            panic!("not an estimate: {line}");
        };
        for (depth, streak, unit) in queries {
            let theirs = agent.answer(Query { queue_depth: depth, backoff_streak: streak }, unit);
            let ours = retry_after_client::decide(&push, depth, streak, &push.pushed_schedule(), unit);
            prop_assert_eq!(
                (ours.seconds, ours.millis, ours.rung, ours.reason, ours.status_code),
                (theirs.seconds, theirs.millis, theirs.rung, theirs.reason, 503),
                "{}", line
            );
        }
        prop_assert_eq!(EstimatePush::parse(&line).unwrap(), *push);
    }
}

/// The EWMA of one completion stream sampled every `tick`, read at whole seconds.
fn ewma_at_seconds(completions: &[Duration], tick: Duration, seconds: u64) -> Vec<f64> {
    let mut drain = DrainRate::new(DrainRateConstants::default());
    let t0 = Instant::now();
    let mut at = Duration::ZERO;
    let mut done = 0;
    let mut readings = Vec::new();
    while at <= Duration::from_secs(seconds) {
        while done < completions.len() && completions[done] <= at {
            done += 1;
        }
        drain.observe(t0 + at, done as u64, 1);
        if at.subsec_nanos() == 0 && !at.is_zero() {
            readings.push(drain.ewma());
        }
        at += tick;
    }
    readings
}

#[test]
fn the_same_stream_at_100_ms_and_1_s_ticks_gives_the_same_drain_within_1_percent() {
    // Steady seconds at 100, 300, 50, 170, 170/s, a stall (work in flight, nothing done),
    // then 90/s, each second's completions spread evenly; then half a minute of a Poisson
    // stream whose rate changes every 5 s.
    let mut completions = Vec::new();
    let mut start = Duration::ZERO;
    for rate in [100u32, 300, 50, 170, 170, 0, 90] {
        for i in 0..rate {
            completions.push(start + Duration::from_secs(1) * i / rate + Duration::from_nanos(1));
        }
        start += Duration::from_secs(1);
    }
    let mut rng = SmallRng::seed_from_u64(42);
    let mut t = start.as_secs_f64();
    for (i, rate) in [800.0, 1500.0, 400.0, 1200.0, 900.0, 2000.0]
        .into_iter()
        .enumerate()
    {
        let end = start.as_secs_f64() + 5.0 * (i + 1) as f64;
        while t < end {
            t += -(1.0 - rng.random::<f64>()).ln() / rate;
            completions.push(Duration::from_secs_f64(t));
        }
    }
    let seconds = start.as_secs() + 30;
    let coarse = ewma_at_seconds(&completions, Duration::from_secs(1), seconds);
    let fine = ewma_at_seconds(&completions, Duration::from_millis(100), seconds);
    assert_eq!(coarse.len(), fine.len());
    for (second, (c, f)) in coarse.iter().zip(&fine).enumerate() {
        assert!(
            (c - f).abs() <= 0.01 * c.max(*f),
            "second {}: {c} at 1 s ticks, {f} at 100 ms ticks",
            second + 1
        );
    }
}
