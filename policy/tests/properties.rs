//! Properties of the policy over arbitrary inputs, including NaN, infinities and huge depths.

mod common;

use common::strategies;
use proptest::prelude::*;
use retry_after_policy::{
    FallbackReason, OverloadRule, PolicyConstants, PromisedReturns, QueueDepth, QueueDepthSource,
    RetryAfterPolicy, Rung, Signals, answer,
};

fn any_float() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(-1.0),
        Just(0.0),
        1e-9..1e9f64,
    ]
}

proptest! {
    #[test]
    fn the_answer_is_absent_static_or_within_the_clamp(
        depth in prop::option::of(any::<u64>()),
        drain in prop::option::of(any_float()),
        occupancy in prop::option::of(any_float()),
        streak in any::<u32>(),
        constants in strategies::constants(),
        retry_after_s in prop::option::of(1u64..3600),
        jitter_draw in any_float(),
        policy in prop::sample::select(RetryAfterPolicy::ALL.to_vec()),
        arrivals in prop::option::of(any_float()),
        promised in prop::collection::vec(any::<u32>(), 0..70),
        age in prop::option::of(any_float()),
    ) {
        let signals = Signals {
            queue_depth: depth.map(|depth| QueueDepth { depth, source: QueueDepthSource::Proxy }),
            drain_rate: drain,
            occupancy,
            backoff_streak: streak,
            arrival_rate: arrivals,
            promised: PromisedReturns::from_bins(promised),
            overload_age_s: age,
        };
        let a = answer(policy, &constants, retry_after_s, signals, jitter_draw);
        match a.rung {
            Rung::Computed => {
                let s = a.seconds.unwrap();
                prop_assert!((constants.min_retry_after_s..=constants.max_retry_after_s).contains(&s));
                let ms = a.millis.unwrap();
                prop_assert!(ms <= s * 1000 && ms + 1000 > s * 1000, "{ms} ms vs {s} s");
                prop_assert_eq!(a.reason, None);
            }
            Rung::Static => {
                prop_assert_eq!(a.seconds, retry_after_s);
                prop_assert!(a.reason.is_some());
            }
            Rung::None => {
                prop_assert_eq!((a.seconds, retry_after_s), (None, None));
                prop_assert!(a.reason.is_some());
            }
        }
        if policy == RetryAfterPolicy::Static {
            prop_assert_eq!(a.reason, Some(FallbackReason::StaticPolicy));
        } else if depth.is_none() && a.rung != Rung::Computed {
            prop_assert!(matches!(
                a.reason,
                Some(FallbackReason::QueueInvisible | FallbackReason::DrainNotWarm)
            ));
        }
    }

    #[test]
    fn without_jitter_monotone_in_depth_and_drain(
        d1 in 0u64..100_000, d2 in 0u64..100_000,
        r1 in 0.01..10_000.0f64, r2 in 0.01..10_000.0f64,
        occupancy in 0.0..1.0f64, streak in 0u32..10,
    ) {
        let constants = PolicyConstants { jitter: 0.0, ..PolicyConstants::default() };
        let at = |depth, drain| {
            let signals = Signals {
                queue_depth: Some(QueueDepth { depth, source: QueueDepthSource::Frontend }),
                drain_rate: Some(drain),
                occupancy: Some(occupancy),
                backoff_streak: streak,
                arrival_rate: None,
                promised: PromisedReturns::NONE,
            overload_age_s: None,
            };
            answer(RetryAfterPolicy::RouterQueueDrainRate, &constants, None, signals, 0.5).seconds.unwrap()
        };
        let (dl, dh) = (d1.min(d2), d1.max(d2));
        let (rl, rh) = (r1.min(r2), r1.max(r2));
        prop_assert!(at(dl, rl) <= at(dh, rl));
        prop_assert!(at(dl, rh) <= at(dl, rl));
    }

    #[test]
    fn the_simple_profile_is_ceil_of_depth_over_drain(depth in 0u64..1_000_000, drain in 0.01..10_000.0f64) {
        let constants = PolicyConstants { jitter: 0.0, ..PolicyConstants::simple() };
        let signals = Signals {
            queue_depth: Some(QueueDepth { depth, source: QueueDepthSource::Proxy }),
            drain_rate: Some(drain),
            occupancy: Some(1.0),
            backoff_streak: 9,
            arrival_rate: None,
            promised: PromisedReturns::NONE,
            overload_age_s: None,
        };
        let a = answer(RetryAfterPolicy::RouterQueueDrainRate, &constants, None, signals, 0.5);
        let base = depth as f64 / drain;
        prop_assert_eq!(a.computed.unwrap().base_s, base);
        let expected = ((base * 1e6).round() as u64).div_ceil(1_000_000).clamp(1, 60);
        prop_assert_eq!(a.seconds, Some(expected));
    }
}

proptest! {
    #[test]
    fn scheduled_returns_never_answers_earlier_for_more_ahead(
        depth in 0u64..10_000, more in 0u64..1000,
        drain in 0.1..1000.0f64, arrivals in 0.0..1000.0f64,
        promised in prop::collection::vec(0u32..100, 0..64),
        bin in 0usize..64, extra in 0u32..100,
        rule in prop::sample::select(OverloadRule::ALL.to_vec()),
    ) {
        let constants = PolicyConstants { overload_rule: rule, ..PolicyConstants::default() };
        let at = |depth: u64, promised: PromisedReturns| {
            let signals = scheduling(depth, drain, arrivals, promised, None);
            answer(RetryAfterPolicy::ScheduledReturns, &constants, None, signals, 0.0).seconds.unwrap()
        };
        let base = PromisedReturns::from_bins(promised.clone());
        let mut added = promised;
        added.resize(64, 0);
        added[bin] += extra;
        let fewer = at(depth, base);
        if rule == OverloadRule::Latest {
            // (With `fill_capacity`, more ahead can tip an answer from the horizon back to the
            // filled capacity; only the latest rule is monotone.)
            prop_assert!(at(depth + more, base) >= fewer);
            prop_assert!(at(depth, PromisedReturns::from_bins(added)) >= fewer);
        }
        prop_assert!((1..=60).contains(&fewer));
    }
}

/// What `scheduled_returns` reads: a queue the proxy sees, a warm drain rate, fresh arrivals,
/// the returns promised and the overload's age.
fn scheduling(
    depth: u64,
    drain: f64,
    arrivals: f64,
    promised: PromisedReturns,
    overload_age_s: Option<f64>,
) -> Signals {
    Signals {
        arrival_rate: Some(arrivals),
        promised,
        overload_age_s,
        ..Signals::proxy_queue(depth, drain)
    }
}

/// `scheduled_returns` as docs/estimator.md states it, by brute force: every second tried,
/// nothing skipped.
fn scheduled_by_the_book(
    depth: u64,
    drain: f64,
    arrivals: f64,
    promised: &[u32],
    constants: &PolicyConstants,
    age: Option<f64>,
) -> u64 {
    let (min, max) = constants.clamp();
    let horizon = constants.overload_horizon(age);
    let due = |s: u64| f64::from(promised.get(s as usize).copied().unwrap_or(0));
    let earliest = |room: f64, top: u64| {
        (min..=top).find(|&s| {
            let ahead = (0..=s).fold(depth as f64 + 1.0, |a, i| a + due(i));
            room > 0.0 && room * (s + 1) as f64 >= ahead
        })
    };
    earliest(drain - arrivals, max)
        .or_else(|| match constants.overload_rule {
            OverloadRule::Latest => None,
            OverloadRule::FillCapacity => earliest(drain, horizon),
            OverloadRule::LatestWithRoom => ((horizon / 2).max(min)..=horizon)
                .rev()
                .find(|&s| due(s) + 1.0 <= drain),
        })
        .unwrap_or(horizon)
}

proptest! {
    #[test]
    fn scheduled_returns_is_the_rule_as_written(
        depth in prop_oneof![0u64..50, 0u64..5000],
        drain in prop_oneof![0.5..200.0f64, (1u32..100).prop_map(f64::from)],
        arrivals in prop_oneof![Just(0.0), 0.0..300.0f64, (0u32..100).prop_map(f64::from)],
        promised in prop::collection::vec(prop_oneof![0u32..3, 0u32..100], 0..64),
        constants in strategies::constants(),
        age in prop::option::of(0.0..100.0f64),
    ) {
        let signals =
            scheduling(depth, drain, arrivals, PromisedReturns::from_bins(promised.clone()), age);
        let got = RetryAfterPolicy::ScheduledReturns.compute(&signals, &constants).unwrap().base_s;
        let want = scheduled_by_the_book(depth, drain, arrivals, &promised, &constants, age);
        prop_assert_eq!(got, want as f64);
    }
}
