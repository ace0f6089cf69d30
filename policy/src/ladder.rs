//! From a policy's estimate to the header value: jitter, rounding, clamp, and the fallback
//! ladder (computed → static → no header).
//!
//! Jitter is applied to the unrounded estimate, then the value is rounded up to whole seconds
//! (RFC 9110 delta-seconds), then clamped. Nothing here can fail or produce a value outside the
//! clamp: a missing, NaN, infinite or negative estimate falls to the next rung.

use crate::{
    Computed, FallbackReason, MAX_KEPT_RETRY_AFTER_S, PolicyConstants, RetryAfterPolicy, Rung,
    Signals, Spread,
};

/// The answer for one rejection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Answer {
    /// The `Retry-After` header value in delta-seconds, or `None` for no header.
    pub seconds: Option<u64>,
    /// The same value in milliseconds (for `retry-after-ms`), rounded up to a whole
    /// millisecond and clamped like `seconds`.
    pub millis: Option<u64>,
    /// Which rung produced it.
    pub rung: Rung,
    /// Why the computed rung did not answer (`None` when it did).
    pub reason: Option<FallbackReason>,
    /// The signals it was computed from.
    pub signals: Signals,
    /// The policy's terms, if it computed.
    pub computed: Option<Computed>,
    /// The jitter factor applied (1 when none was).
    pub jitter_factor: f64,
}

/// Run the ladder for one rejection. `jitter_draw` is a uniform draw from [0, 1) that sets
/// the jitter (0.5 is no jitter); callers draw it, so the same draw gives the same answer
/// anywhere.
pub fn answer(
    policy: RetryAfterPolicy,
    constants: &PolicyConstants,
    retry_after_s: Option<u64>,
    signals: Signals,
    jitter_draw: f64,
) -> Answer {
    let computed = policy.compute(&signals, constants);
    let reason = match computed {
        Ok(c) => {
            let value = spread(&c, constants.jitter, jitter_draw);
            let factor = if c.base_s > 0.0 {
                value / c.base_s
            } else {
                1.0
            };
            match rounded(
                value,
                constants.min_retry_after_s,
                constants.max_retry_after_s,
            ) {
                Some((seconds, millis)) => {
                    return Answer {
                        seconds: Some(seconds),
                        millis: Some(millis),
                        rung: Rung::Computed,
                        reason: None,
                        signals,
                        computed: Some(c),
                        jitter_factor: factor,
                    };
                }
                None => FallbackReason::EstimateUnusable,
            }
        }
        Err(reason) => reason,
    };
    let (seconds, rung) = match retry_after_s {
        Some(s) => (Some(s), Rung::Static),
        None => (None, Rung::None),
    };
    Answer {
        seconds,
        millis: seconds.map(|s| s.saturating_mul(1000)),
        rung,
        reason: Some(reason),
        signals,
        computed: computed.ok(),
        jitter_factor: 1.0,
    }
}

/// The header value of an estimate: `base_s` seconds times a jitter factor
/// `1 + jitter · (2·jitter_draw − 1)` (uniform in [1 − jitter, 1 + jitter] for `jitter_draw`
/// uniform in [0, 1)), rounded up to whole seconds and to whole milliseconds, each clamped to
/// [`min_s`, `max_s`] (themselves kept within [1, 300]).
///
/// Jitter comes before rounding. The value is rounded to whole microseconds first, so
/// floating-point noise (0.1 × 3 × 10 = 3.0000000000000004) cannot add a second. Returns
/// `None` if `base_s` is not a finite non-negative number; bad `jitter` or `jitter_draw` values are
/// brought into range.
pub fn header_value(
    base_s: f64,
    jitter: f64,
    jitter_draw: f64,
    min_s: u64,
    max_s: u64,
) -> Option<(u64, u64)> {
    if !(base_s.is_finite() && base_s >= 0.0) {
        return None;
    }
    rounded(base_s * jitter_factor(jitter, jitter_draw), min_s, max_s)
}

/// The estimate after `jitter_draw`: scaled by [`jitter_factor`] (relative), or
/// placed within the second that ends at it, `base_s − jitter_draw` (within the second).
fn spread(computed: &Computed, jitter: f64, jitter_draw: f64) -> f64 {
    match computed.spread {
        Spread::Relative => computed.base_s * jitter_factor(jitter, jitter_draw),
        Spread::WithinSecond => {
            let u = if jitter_draw.is_finite() {
                jitter_draw.clamp(0.0, 0.999)
            } else {
                0.5
            };
            (computed.base_s - u).max(0.0)
        }
    }
}

/// A jittered value in seconds, rounded up to whole seconds and milliseconds and clamped.
fn rounded(value: f64, min_s: u64, max_s: u64) -> Option<(u64, u64)> {
    if !(value.is_finite() && value >= 0.0) {
        return None;
    }
    let max = max_s.clamp(1, MAX_KEPT_RETRY_AFTER_S);
    let min = min_s.clamp(1, max);
    // `as` saturates far beyond the clamp.
    let micros = (value * 1e6).round() as u64;
    Some((
        micros.div_ceil(1_000_000).clamp(min, max),
        micros.div_ceil(1_000).clamp(min * 1000, max * 1000),
    ))
}

/// `1 + j · (2·jitter_draw − 1)` with j limited to [0, 1) and jitter_draw to [0, 1].
pub fn jitter_factor(jitter: f64, jitter_draw: f64) -> f64 {
    let j = if jitter.is_finite() {
        jitter.clamp(0.0, 0.999)
    } else {
        0.0
    };
    let u = if jitter_draw.is_finite() {
        jitter_draw.clamp(0.0, 1.0)
    } else {
        0.5
    };
    1.0 + j * (2.0 * u - 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{QueueDepth, QueueDepthSource};

    fn signals(depth: u64, drain: Option<f64>) -> Signals {
        Signals {
            queue_depth: Some(QueueDepth {
                depth,
                source: QueueDepthSource::Proxy,
            }),
            drain_rate: drain,
            occupancy: None,
            backoff_streak: 0,
            arrival_rate: None,
            promised: crate::PromisedReturns::NONE,
            overload_age_s: None,
        }
    }

    fn no_jitter() -> PolicyConstants {
        PolicyConstants {
            jitter: 0.0,
            ..PolicyConstants::simple()
        }
    }

    const COMPUTED: RetryAfterPolicy = RetryAfterPolicy::RouterQueueDrainRate;

    #[test]
    fn header_values_by_hand() {
        // 2.1 s × 0.9 = 1.89 s → 2 s and 1890 ms (jitter before rounding).
        assert_eq!(header_value(2.1, 0.2, 0.25, 1, 60), Some((2, 1890)));
        // Float noise does not add a second.
        let noisy: f64 = 0.1 * 3.0 * 10.0;
        assert_eq!(noisy.ceil(), 4.0, "the case is real");
        assert_eq!(header_value(noisy, 0.0, 0.5, 1, 60), Some((3, 3000)));
        // Clamps, never wider than [1, 300].
        assert_eq!(header_value(0.0, 0.0, 0.5, 1, 60), Some((1, 1000)));
        assert_eq!(header_value(1e300, 0.0, 0.5, 0, 60), Some((60, 60_000)));
        assert_eq!(header_value(1e300, 0.0, 0.5, 0, 600), Some((300, 300_000)));
        assert_eq!(header_value(f64::NAN, 0.0, 0.5, 1, 60), None);
        assert_eq!(header_value(-1.0, 0.0, 0.5, 1, 60), None);
        for u in [f64::NAN, -3.0, 7.0] {
            let f = jitter_factor(0.2, u);
            assert!((0.8..=1.2).contains(&f), "{u} → {f}");
        }
    }

    #[test]
    fn computed_rounds_up_and_clamps() {
        let c = no_jitter();
        let a = answer(COMPUTED, &c, Some(5), signals(10, Some(4.0)), 0.5);
        assert_eq!(
            (a.seconds, a.millis, a.rung, a.reason),
            (Some(3), Some(2500), Rung::Computed, None)
        );
        let a = answer(COMPUTED, &c, None, signals(0, Some(4.0)), 0.5);
        assert_eq!((a.seconds, a.millis), (Some(1), Some(1000)));
        let a = answer(COMPUTED, &c, None, signals(1_000_000, Some(0.5)), 0.5);
        assert_eq!((a.seconds, a.millis), (Some(60), Some(60_000)));
        let narrow = PolicyConstants {
            min_retry_after_s: 3,
            max_retry_after_s: 10,
            ..c
        };
        assert_eq!(
            answer(COMPUTED, &narrow, None, signals(1, Some(1.0)), 0.5).seconds,
            Some(3)
        );
        assert_eq!(
            answer(COMPUTED, &narrow, None, signals(100, Some(1.0)), 0.5).seconds,
            Some(10)
        );
        // Constants can never widen past [1, 300] (the configuration allows above 60 only
        // where returns are kept).
        let wide = PolicyConstants {
            min_retry_after_s: 0,
            max_retry_after_s: 600,
            ..c
        };
        assert_eq!(
            answer(COMPUTED, &wide, None, signals(0, Some(1.0)), 0.5).seconds,
            Some(1)
        );
        assert_eq!(
            answer(COMPUTED, &wide, None, signals(1000, Some(1.0)), 0.5).seconds,
            Some(300)
        );
    }

    #[test]
    fn jitter_is_applied_before_rounding_within_its_bounds() {
        let c = PolicyConstants {
            jitter: 0.2,
            ..no_jitter()
        };
        // base 10 s: u = 0 → ×0.8 = 8; u → 1 → ×1.2 = 12; u = 0.5 → 10.
        let a = answer(COMPUTED, &c, None, signals(10, Some(1.0)), 0.0);
        assert_eq!((a.seconds, a.jitter_factor), (Some(8), 0.8));
        assert_eq!(
            answer(COMPUTED, &c, None, signals(10, Some(1.0)), 0.999_999).seconds,
            Some(12)
        );
        assert_eq!(
            answer(COMPUTED, &c, None, signals(10, Some(1.0)), 0.5).seconds,
            Some(10)
        );
        // base 2.1 s × 0.9 = 1.89 → 2 s and 1890 ms.
        let a = answer(COMPUTED, &c, None, signals(21, Some(10.0)), 0.25);
        assert_eq!((a.seconds, a.millis), (Some(2), Some(1890)));
        // A broken random source cannot push the value out of bounds.
        for u in [f64::NAN, -3.0, 7.0] {
            let a = answer(COMPUTED, &c, None, signals(10, Some(1.0)), u);
            assert!((8..=12).contains(&a.seconds.unwrap()), "{u} → {a:?}");
        }
    }

    #[test]
    fn every_rung_of_the_ladder_with_its_reason() {
        let c = no_jitter();
        let a = answer(COMPUTED, &c, Some(7), signals(4, Some(2.0)), 0.5);
        assert_eq!((a.rung, a.reason), (Rung::Computed, None));
        let a = answer(COMPUTED, &c, Some(7), signals(4, None), 0.5);
        assert_eq!(
            (a.seconds, a.millis, a.rung, a.reason),
            (
                Some(7),
                Some(7000),
                Rung::Static,
                Some(FallbackReason::DrainNotWarm)
            )
        );
        let a = answer(COMPUTED, &c, None, signals(4, None), 0.5);
        assert_eq!((a.seconds, a.millis, a.rung), (None, None, Rung::None));
        for drain in [0.0, f64::NAN, f64::INFINITY, -2.0] {
            let a = answer(COMPUTED, &c, Some(7), signals(4, Some(drain)), 0.5);
            assert_eq!((a.seconds, a.rung), (Some(7), Rung::Static), "{drain}");
        }
        let invisible = Signals {
            queue_depth: None,
            ..signals(4, Some(2.0))
        };
        let a = answer(COMPUTED, &c, Some(7), invisible, 0.5);
        assert_eq!(
            (a.seconds, a.rung, a.reason),
            (Some(7), Rung::Static, Some(FallbackReason::QueueInvisible))
        );
        let a = answer(
            RetryAfterPolicy::Static,
            &c,
            Some(7),
            signals(4, Some(2.0)),
            0.5,
        );
        assert_eq!(
            (a.seconds, a.rung, a.reason),
            (Some(7), Rung::Static, Some(FallbackReason::StaticPolicy))
        );
        let a = answer(
            RetryAfterPolicy::Static,
            &c,
            None,
            signals(4, Some(2.0)),
            0.5,
        );
        assert_eq!((a.seconds, a.rung), (None, Rung::None));
    }
}
