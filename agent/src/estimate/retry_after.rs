//! From a policy's estimate to the header value: jitter, rounding, clamp and the fallback
//! ladder (computed → static → no header).
//!
//! Jitter is applied to the unrounded estimate, then the value is rounded up to whole seconds
//! (RFC 9110 delta-seconds), then clamped. Nothing here can fail or produce a value outside the
//! clamp: a NaN, infinite, negative or missing estimate falls to the next rung.

use std::fmt;

use super::policy::{Computed, PolicyConstants, RetryAfterPolicy, Signals};

/// A source of uniform random numbers in [0, 1): injected, so tests are deterministic.
pub trait Jitter {
    /// The next number in [0, 1).
    fn unit(&mut self) -> f64;
}

impl<R: rand::Rng + ?Sized> Jitter for R {
    fn unit(&mut self) -> f64 {
        rand::RngExt::random::<f64>(self)
    }
}

/// Which rung of the fallback ladder answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rung {
    /// The policy's computed value.
    Computed,
    /// The operator's static `retry_after_s`.
    Static,
    /// No header.
    None,
}

impl Rung {
    /// Every rung, top first.
    pub const ALL: [Rung; 3] = [Rung::Computed, Rung::Static, Rung::None];

    /// Name used in the protocol, metrics and logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            Rung::Computed => "computed",
            Rung::Static => "static",
            Rung::None => "none",
        }
    }
}

impl fmt::Display for Rung {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The answer for one rejection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetryAfter {
    /// The `Retry-After` header value in delta-seconds, or `None` for no header.
    pub seconds: Option<u64>,
    /// The same value in milliseconds, unrounded but for the final ceiling to a whole
    /// millisecond (for `retry-after-ms`), clamped like `seconds`.
    pub millis: Option<u64>,
    /// Which rung produced it.
    pub rung: Rung,
    /// The signals it was computed from.
    pub signals: Signals,
    /// The policy's terms, if it computed.
    pub computed: Option<Computed>,
    /// The jitter factor applied (1 when none was).
    pub jitter_factor: f64,
}

/// Run the ladder for one rejection.
pub fn retry_after(
    policy: RetryAfterPolicy,
    constants: &PolicyConstants,
    static_retry_after_s: Option<u64>,
    signals: Signals,
    jitter: &mut impl Jitter,
) -> RetryAfter {
    let computed = policy.compute(&signals, constants);
    if let Some(c) = computed {
        let factor = jitter_factor(constants.jitter, jitter);
        let value = c.base_s * factor;
        if value.is_finite() && value >= 0.0 {
            let (min, max) = clamp_bounds(constants);
            let micros = to_micros(value);
            return RetryAfter {
                seconds: Some(micros.div_ceil(1_000_000).clamp(min, max)),
                millis: Some(micros.div_ceil(1_000).clamp(min * 1000, max * 1000)),
                rung: Rung::Computed,
                signals,
                computed,
                jitter_factor: factor,
            };
        }
    }
    let (seconds, rung) = match static_retry_after_s {
        Some(s) => (Some(s), Rung::Static),
        None => (None, Rung::None),
    };
    RetryAfter {
        seconds,
        millis: seconds.map(|s| s.saturating_mul(1000)),
        rung,
        signals,
        computed,
        jitter_factor: 1.0,
    }
}

/// A factor drawn uniformly from [1 − j, 1 + j], j limited to [0, 1).
pub fn jitter_factor(relative: f64, jitter: &mut impl Jitter) -> f64 {
    let j = if relative.is_finite() {
        relative.clamp(0.0, 0.999)
    } else {
        0.0
    };
    if j == 0.0 {
        return 1.0;
    }
    let u = jitter.unit();
    let u = if u.is_finite() {
        u.clamp(0.0, 1.0)
    } else {
        0.5
    };
    1.0 + j * (2.0 * u - 1.0)
}

/// The effective clamp: the configured one, never wider than [1, 60].
pub fn clamp_bounds(constants: &PolicyConstants) -> (u64, u64) {
    let max = constants
        .max_retry_after_s
        .clamp(1, super::policy::MAX_RETRY_AFTER_S);
    let min = constants.min_retry_after_s.clamp(1, max);
    (min, max)
}

/// Seconds to whole microseconds, rounded to nearest: rounding up to seconds or milliseconds
/// then happens in integers, so floating-point noise (30 × 0.1 = 3.0000000000000004) cannot
/// add a whole second. `value` must be finite and non-negative; `as` saturates far beyond the
/// clamp.
fn to_micros(value: f64) -> u64 {
    (value * 1e6).round() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::queue_depth::QueueDepthSource;

    /// Returns the numbers it was given, in order, forever repeating the last.
    pub struct Fixed(pub Vec<f64>);

    impl Jitter for Fixed {
        fn unit(&mut self) -> f64 {
            if self.0.len() > 1 {
                self.0.remove(0)
            } else {
                self.0[0]
            }
        }
    }

    fn signals(depth: u64, drain: Option<f64>) -> Signals {
        Signals {
            queue_depth: depth,
            queue_depth_source: QueueDepthSource::Proxy,
            drain_rate: drain,
            occupancy: None,
            backoff_streak: 0,
        }
    }

    fn no_jitter() -> PolicyConstants {
        PolicyConstants {
            jitter: 0.0,
            occupancy_weight: 0.0,
            backoff_weight: 0.0,
            ..PolicyConstants::default()
        }
    }

    const COMPUTED: RetryAfterPolicy = RetryAfterPolicy::RouterQueueDrainRate;

    #[test]
    fn computed_rounds_up_to_delta_seconds_and_keeps_the_milliseconds() {
        let r = retry_after(
            COMPUTED,
            &no_jitter(),
            Some(5),
            signals(10, Some(4.0)),
            &mut Fixed(vec![0.5]),
        );
        assert_eq!(
            (r.seconds, r.millis, r.rung),
            (Some(3), Some(2500), Rung::Computed)
        );
    }

    #[test]
    fn clamps_to_one_and_sixty_and_to_a_narrower_configured_range() {
        let c = no_jitter();
        let r = retry_after(
            COMPUTED,
            &c,
            None,
            signals(0, Some(4.0)),
            &mut Fixed(vec![0.5]),
        );
        assert_eq!((r.seconds, r.millis), (Some(1), Some(1000)));
        let r = retry_after(
            COMPUTED,
            &c,
            None,
            signals(1_000_000, Some(0.5)),
            &mut Fixed(vec![0.5]),
        );
        assert_eq!((r.seconds, r.millis), (Some(60), Some(60_000)));
        let narrow = PolicyConstants {
            min_retry_after_s: 3,
            max_retry_after_s: 10,
            ..c
        };
        let r = retry_after(
            COMPUTED,
            &narrow,
            None,
            signals(1, Some(1.0)),
            &mut Fixed(vec![0.5]),
        );
        assert_eq!(r.seconds, Some(3));
        let r = retry_after(
            COMPUTED,
            &narrow,
            None,
            signals(100, Some(1.0)),
            &mut Fixed(vec![0.5]),
        );
        assert_eq!(r.seconds, Some(10));
        // A configuration can never widen past 60.
        let wide = PolicyConstants {
            min_retry_after_s: 0,
            max_retry_after_s: 600,
            ..c
        };
        assert_eq!(clamp_bounds(&wide), (1, 60));
    }

    #[test]
    fn jitter_is_applied_before_rounding_within_its_bounds() {
        let c = PolicyConstants {
            jitter: 0.2,
            ..no_jitter()
        };
        // base 10 s: u = 0 → ×0.8 = 8; u → 1 → ×1.2 = 12; u = 0.5 → 10.
        let r = retry_after(
            COMPUTED,
            &c,
            None,
            signals(10, Some(1.0)),
            &mut Fixed(vec![0.0]),
        );
        assert_eq!((r.seconds, r.jitter_factor), (Some(8), 0.8));
        let r = retry_after(
            COMPUTED,
            &c,
            None,
            signals(10, Some(1.0)),
            &mut Fixed(vec![0.999_999]),
        );
        assert_eq!(r.seconds, Some(12));
        let r = retry_after(
            COMPUTED,
            &c,
            None,
            signals(10, Some(1.0)),
            &mut Fixed(vec![0.5]),
        );
        assert_eq!(r.seconds, Some(10));
        // base 2.1 s × 0.9 = 1.89 → rounds up to 2 (jitter before rounding, not after).
        let r = retry_after(
            COMPUTED,
            &c,
            None,
            signals(21, Some(10.0)),
            &mut Fixed(vec![0.25]),
        );
        assert_eq!((r.seconds, r.millis), (Some(2), Some(1890)));
        // Floating-point noise does not round up a whole second: 0.1 × 3 × 10 is
        // 3.0000000000000004 in floats, whose ceiling is 4.
        let noisy: f64 = 0.1 * 3.0 * 10.0;
        assert_eq!(noisy.ceil(), 4.0, "the case is real");
        assert_eq!(to_micros(noisy).div_ceil(1_000_000), 3);
        // Through the ladder: 30 queued at 10/s is 3 s.
        let r = retry_after(
            COMPUTED,
            &no_jitter(),
            None,
            signals(30, Some(10.0)),
            &mut Fixed(vec![0.5]),
        );
        assert_eq!((r.seconds, r.millis), (Some(3), Some(3000)));
        // A broken random source cannot push the factor out of bounds.
        for u in [f64::NAN, -3.0, 7.0] {
            let f = jitter_factor(0.2, &mut Fixed(vec![u]));
            assert!((0.8..=1.2).contains(&f), "{u} → {f}");
        }
    }

    #[test]
    fn every_rung_of_the_ladder() {
        let c = no_jitter();
        let mut j = Fixed(vec![0.5]);
        // Warm and draining: computed.
        assert_eq!(
            retry_after(COMPUTED, &c, Some(7), signals(4, Some(2.0)), &mut j).rung,
            Rung::Computed
        );
        // Not warm: static.
        let r = retry_after(COMPUTED, &c, Some(7), signals(4, None), &mut j);
        assert_eq!(
            (r.seconds, r.millis, r.rung),
            (Some(7), Some(7000), Rung::Static)
        );
        // Not warm, no static: no header.
        let r = retry_after(COMPUTED, &c, None, signals(4, None), &mut j);
        assert_eq!((r.seconds, r.millis, r.rung), (None, None, Rung::None));
        // Drain rate zero, NaN, infinite or negative: never a header from them.
        for drain in [0.0, f64::NAN, f64::INFINITY, -2.0] {
            let r = retry_after(COMPUTED, &c, Some(7), signals(4, Some(drain)), &mut j);
            assert_eq!((r.seconds, r.rung), (Some(7), Rung::Static), "{drain}");
        }
        // The static policy never computes.
        let r = retry_after(
            RetryAfterPolicy::Static,
            &c,
            Some(7),
            signals(4, Some(2.0)),
            &mut j,
        );
        assert_eq!((r.seconds, r.rung), (Some(7), Rung::Static));
        let r = retry_after(
            RetryAfterPolicy::Static,
            &c,
            None,
            signals(4, Some(2.0)),
            &mut j,
        );
        assert_eq!((r.seconds, r.rung), (None, Rung::None));
    }
}
