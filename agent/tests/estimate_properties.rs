//! Properties of the Retry-After ladder that must hold for any input.

use proptest::prelude::*;
use retry_after_agent::estimate::{
    PolicyConstants, QueueDepthSource, RetryAfterPolicy, Rung, Signals, retry_after::retry_after,
};

/// A random source that returns one fixed number.
struct Fixed(f64);

impl retry_after_agent::estimate::Jitter for Fixed {
    fn unit(&mut self) -> f64 {
        self.0
    }
}

fn any_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => 0.0..1e6f64,
        1 => Just(0.0),
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(f64::NEG_INFINITY),
        1 => -1e6..0.0f64,
        1 => any::<f64>(),
    ]
}

fn constants() -> impl Strategy<Value = PolicyConstants> {
    (
        0.0..2.0f64,
        0.0..2.0f64,
        0.0..=0.5f64,
        1u64..=60,
        1u64..=60,
        1u32..10,
    )
        .prop_map(|(w1, w2, jitter, a, b, saturation)| PolicyConstants {
            occupancy_weight: w1,
            backoff_weight: w2,
            jitter,
            min_retry_after_s: a.min(b),
            max_retry_after_s: a.max(b),
            backoff_streak_saturation: saturation,
            ..PolicyConstants::default()
        })
}

fn signals(depth: u64, drain: Option<f64>, occupancy: Option<f64>, streak: u32) -> Signals {
    Signals {
        queue_depth: depth,
        queue_depth_source: QueueDepthSource::Proxy,
        drain_rate: drain,
        occupancy,
        backoff_streak: streak,
    }
}

const COMPUTED: RetryAfterPolicy = RetryAfterPolicy::RouterQueueDrainRate;

proptest! {
    #[test]
    fn the_value_is_absent_static_or_an_integer_within_the_clamp(
        depth in any::<u64>(),
        drain in proptest::option::of(any_f64()),
        occupancy in proptest::option::of(any_f64()),
        streak in any::<u32>(),
        c in constants(),
        static_s in proptest::option::of(0u64..=86_400),
        u in any_f64(),
    ) {
        let r = retry_after(COMPUTED, &c, static_s, signals(depth, drain, occupancy, streak), &mut Fixed(u));
        match r.rung {
            Rung::Computed => {
                let s = r.seconds.unwrap();
                prop_assert!((c.min_retry_after_s..=c.max_retry_after_s).contains(&s), "{s} {c:?}");
                let ms = r.millis.unwrap();
                prop_assert!((c.min_retry_after_s * 1000..=c.max_retry_after_s * 1000).contains(&ms));
                prop_assert!(ms <= s * 1000 && ms + 1000 > s * 1000 || s == c.min_retry_after_s || s == c.max_retry_after_s);
            }
            Rung::Static => prop_assert_eq!(r.seconds, static_s),
            Rung::None => prop_assert_eq!((r.seconds, r.millis, static_s), (None, None, None)),
        }
    }

    #[test]
    fn without_jitter_the_value_grows_with_depth_and_shrinks_with_drain(
        d1 in 0u64..1_000_000, d2 in 0u64..1_000_000,
        r1 in 0.001f64..1e4, r2 in 0.001f64..1e4,
        occupancy in proptest::option::of(0.0..=1.0f64),
        streak in 0u32..20,
        c in constants(),
    ) {
        let c = PolicyConstants { jitter: 0.0, ..c };
        let value = |depth, drain| {
            retry_after(COMPUTED, &c, None, signals(depth, Some(drain), occupancy, streak), &mut Fixed(0.5))
                .seconds
                .unwrap()
        };
        let (lo, hi) = (d1.min(d2), d1.max(d2));
        prop_assert!(value(lo, r1) <= value(hi, r1));
        let (slow, fast) = (r1.min(r2), r1.max(r2));
        prop_assert!(value(d1, slow) >= value(d1, fast));
    }

    #[test]
    fn zero_weights_reduce_to_depth_over_drain(
        depth in 0u64..10_000_000,
        drain in 0.001f64..1e5,
        occupancy in proptest::option::of(0.0..=1.0f64),
        streak in any::<u32>(),
    ) {
        let c = PolicyConstants { occupancy_weight: 0.0, backoff_weight: 0.0, jitter: 0.0, ..PolicyConstants::default() };
        let r = retry_after(COMPUTED, &c, None, signals(depth, Some(drain), occupancy, streak), &mut Fixed(0.5));
        let exact = depth as f64 / drain;
        prop_assert_eq!(r.computed.unwrap().base_s, exact);
        // Away from whole seconds (where rounding to microseconds first matters), the header is
        // ceil(depth / drain), clamped.
        prop_assume!((exact - exact.round()).abs() > 1e-5);
        prop_assert_eq!(r.seconds.unwrap(), (exact.ceil() as u64).clamp(1, 60));
    }
}
