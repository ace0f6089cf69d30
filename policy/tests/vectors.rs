//! The shared vectors: answers of the Rust implementation (`EstimatePush::answer`, the
//! function the agent and the Rust client answer with) for pushes as the agent could send
//! them, edge values included, kept in `policy/tests/vectors.tsv`. The Lua and Python ports
//! are checked against that file (`ports.rs` beside this one, and LuaJIT in the root suite);
//! this test fails when the Rust answers drift from it. After an intended change of the
//! answers, write the file anew with `UPDATE_VECTORS=1 cargo test -p retry-after-policy --test
//! vectors` and say why in the commit.

use std::{fmt::Write as _, time::Duration};

use rand::{Rng, RngExt, SeedableRng, rngs::SmallRng};
use retry_after_protocol::{
    EstimatePush,
    policy::{
        OverloadRule, PolicyConstants, PromisedReturns, QueueDepth, QueueDepthSource, RETURN_BINS,
        RetryAfterPolicy,
    },
};

#[path = "common/vectors_file.rs"]
mod vectors_file;

/// How many vectors the file holds.
const COUNT: usize = 2000;

fn pick<T: Copy>(rng: &mut impl Rng, items: &[T]) -> T {
    items[rng.random_range(0..items.len())]
}

/// One of `items`, or (as often as any one of them) a fresh value from `fresh`.
fn pick_with<T: Copy, R: Rng>(rng: &mut R, items: &[T], fresh: impl FnOnce(&mut R) -> T) -> T {
    let i = rng.random_range(0..=items.len());
    if i == items.len() {
        fresh(rng)
    } else {
        items[i]
    }
}

/// A push as the agent could send it, edge values included.
fn random_push(rng: &mut impl Rng) -> EstimatePush {
    let drain = pick(
        rng,
        &[
            None,
            Some(0.0),
            Some(-3.0),
            Some(1e-300),
            Some(1e300),
            Some(0.5),
        ],
    )
    .or_else(|| rng.random_bool(0.5).then(|| rng.random_range(0.01..5000.0)));
    let drain = if rng.random_bool(0.6) {
        Some(rng.random_range(0.01..5000.0))
    } else {
        drain
    };
    let (lo, hi) = (rng.random_range(1..=60u64), rng.random_range(1..=60u64));
    // One push in ten has constants no valid configuration gives (a clamp upside down or past
    // 60, jitter of 1 or more, B of 0): every port must bring them into range the same way.
    let invalid = rng.random_bool(0.1);
    let (min, max) = if invalid {
        (rng.random_range(0..=400u64), rng.random_range(0..=400u64))
    } else {
        (lo.min(hi), lo.max(hi))
    };
    EstimatePush {
        service: "api".into(),
        seq: rng.random_range(0..1000),
        retry_after_policy: pick(
            rng,
            &[
                RetryAfterPolicy::RouterQueueDrainRate,
                RetryAfterPolicy::RouterQueueDrainRate,
                RetryAfterPolicy::ScheduledReturns,
                RetryAfterPolicy::ScheduledReturns,
                RetryAfterPolicy::Static,
            ],
        ),
        status_code: pick(rng, &[429, 503]),
        retry_after_s: rng.random_bool(0.7).then(|| rng.random_range(1..=120)),
        queue_depth: rng.random_bool(0.7).then(|| QueueDepth {
            depth: rng.random_range(0..100_000),
            source: pick(
                rng,
                &[QueueDepthSource::Frontend, QueueDepthSource::BeyondCapacity],
            ),
        }),
        drain_rate: drain,
        occupancy: pick(rng, &[None, Some(0.0), Some(1.0), Some(1.7)])
            .or_else(|| rng.random_bool(0.5).then(|| rng.random_range(0.0..1.0))),
        arrival_rate: pick(rng, &[None, Some(0.0), Some(-1.0)])
            .or_else(|| Some(rng.random_range(0.0..6000.0))),
        returns: random_returns(rng),
        overload_age_s: pick(rng, &[None, Some(0.0)])
            .or_else(|| Some(rng.random_range(0.0..200.0))),
        constants: PolicyConstants {
            backoff_streak_saturation: rng.random_range(if invalid { 0..3 } else { 1..10 }),
            occupancy_weight: pick_with(rng, &[0.0, 0.25], |rng| rng.random_range(0.0..2.0)),
            backoff_weight: pick_with(rng, &[0.0, 0.25], |rng| rng.random_range(0.0..2.0)),
            jitter: if invalid {
                rng.random_range(0.0..2.0)
            } else {
                pick_with(rng, &[0.0, 0.2, 0.5], |rng| rng.random_range(0.0..0.5))
            },
            min_retry_after_s: min,
            max_retry_after_s: max,
            overload_rule: pick(rng, OverloadRule::ALL),
            overload_horizon_factor: pick(rng, &[None, Some(1.0), Some(2.0)])
                .or_else(|| Some(rng.random_range(0.01..20.0))),
        },
        base_ms: None,
        reason: None,
    }
}

/// A schedule of promised returns: empty, sparse or dense, small or huge counts.
fn random_returns(rng: &mut impl Rng) -> PromisedReturns {
    let len = pick(rng, &[0, 3, 20, RETURN_BINS]);
    let max = pick(rng, &[2, 50, 5000, u32::MAX]);
    PromisedReturns::from_bins((0..len).map(|_| {
        if rng.random_bool(0.4) {
            0
        } else {
            rng.random_range(0..=max)
        }
    }))
}

/// Tab-separated vectors: push line, depth, streak, jitter_draw, seconds since the push, the proxy's
/// own promises (comma-separated counts from now, or `none`), then the answer's seconds,
/// millis, rung and reason (`none` for absent values).
fn vectors(count: usize) -> String {
    let mut rng = SmallRng::seed_from_u64(20_261_130);
    let mut file = String::new();
    let none = |v: Option<u64>| v.map_or("none".to_owned(), |v| v.to_string());
    for _ in 0..count {
        let push = random_push(&mut rng);
        let depth = if rng.random_bool(0.6) {
            Some(pick_with(&mut rng, &[0, 1, 7, 64, 1 << 52], |rng| {
                rng.random_range(0..1_000_000u64)
            }))
        } else {
            None
        };
        let streak = rng.random_bool(0.5).then(|| rng.random_range(0..12u32));
        let jitter_draw: f64 = pick_with(&mut rng, &[0.0, 0.5, 0.999_999_9], |rng| rng.random());
        // Whole and fractional seconds (exact in binary, so every port adds the same age).
        let elapsed_s = pick(&mut rng, &[0.0, 0.5, 1.0, 1.25, 5.75, 70.0]);
        let own = random_returns(&mut rng);
        let schedule = push.schedule(Duration::from_secs_f64(elapsed_s), &own);
        let answer = push.answer(depth, streak, &schedule, jitter_draw);
        let own_text = own
            .trimmed()
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",");
        writeln!(
            file,
            "{push}\t{}\t{}\t{jitter_draw}\t{elapsed_s}\t{}\t{}\t{}\t{}\t{}",
            none(depth),
            none(streak.map(u64::from)),
            if own_text.is_empty() {
                "none"
            } else {
                &own_text
            },
            none(answer.seconds),
            none(answer.millis),
            answer.rung,
            answer.reason.map_or("none", |r| r.as_str()),
        )
        .expect("writing to a String cannot fail");
    }
    file
}

#[test]
fn the_rust_answers_are_the_shared_vectors() {
    vectors_file::check_or_update(&vectors(COUNT), "vectors.tsv", "vectors");
}
