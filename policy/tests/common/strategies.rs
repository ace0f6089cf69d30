//! Property-test strategies over the policy's inputs, shared by the tests of every crate that
//! answers with the policy (included with `#[path]`), so that they all explore one space.

use proptest::prelude::*;
use retry_after_policy::{OverloadRule, PolicyConstants};

/// Constants as a configuration could give them, and horizon factors no configuration would
/// (NaN, infinity: the policy must take those too): B from 1 to 9, weights below 1, jitter up
/// to 0.5, any clamp within [1, 60], any overload rule.
pub fn constants() -> impl Strategy<Value = PolicyConstants> {
    (
        1u32..10,
        0.0..1.0f64,
        0.0..1.0f64,
        0.0..=0.5f64,
        1u64..=60,
        1u64..=60,
        prop::sample::select(OverloadRule::ALL.to_vec()),
        prop::option::of(prop_oneof![
            Just(f64::NAN),
            Just(f64::INFINITY),
            0.0..10.0f64
        ]),
    )
        .prop_map(
            |(b, w1, w2, jitter, lo, hi, overload_rule, overload_horizon_factor)| PolicyConstants {
                backoff_streak_saturation: b,
                occupancy_weight: w1,
                backoff_weight: w2,
                jitter,
                min_retry_after_s: lo.min(hi),
                max_retry_after_s: lo.max(hi),
                overload_rule,
                overload_horizon_factor,
            },
        )
}
