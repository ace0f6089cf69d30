//! From a policy's estimate to the header value: jitter, rounding, clamp and the fallback
//! ladder (computed → static → no header).
//!
//! Jitter is applied to the unrounded estimate, then the value is rounded up to whole seconds
//! (RFC 9110 delta-seconds), then clamped. Nothing here can fail or produce a value outside the
//! clamp: a NaN, infinite, negative or missing estimate falls to the next rung.

use std::fmt;

use retry_after_protocol::{header_value, jitter_factor};

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
        let unit = if constants.jitter > 0.0 {
            jitter.unit()
        } else {
            0.5
        };
        if let Some((seconds, millis)) = header_value(
            c.base_s,
            constants.jitter,
            unit,
            constants.min_retry_after_s,
            constants.max_retry_after_s,
        ) {
            return RetryAfter {
                seconds: Some(seconds),
                millis: Some(millis),
                rung: Rung::Computed,
                signals,
                computed,
                jitter_factor: jitter_factor(constants.jitter, unit),
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
        let r = retry_after(
            COMPUTED,
            &wide,
            None,
            signals(0, Some(1.0)),
            &mut Fixed(vec![0.5]),
        );
        assert_eq!(r.seconds, Some(1));
        let r = retry_after(
            COMPUTED,
            &wide,
            None,
            signals(1000, Some(1.0)),
            &mut Fixed(vec![0.5]),
        );
        assert_eq!(r.seconds, Some(60));
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
        // Through the ladder: 30 queued at 10/s is 3 s.
        let r = retry_after(
            COMPUTED,
            &no_jitter(),
            None,
            signals(30, Some(10.0)),
            &mut Fixed(vec![0.5]),
        );
        assert_eq!((r.seconds, r.millis), (Some(3), Some(3000)));
        // A broken random source cannot push the value out of bounds.
        for u in [f64::NAN, -3.0, 7.0] {
            let r = retry_after(
                COMPUTED,
                &c,
                None,
                signals(10, Some(1.0)),
                &mut Fixed(vec![u]),
            );
            assert!((8..=12).contains(&r.seconds.unwrap()), "{u} → {r:?}");
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
