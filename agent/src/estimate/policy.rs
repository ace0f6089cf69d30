//! Retry-After policies, selected by name (the proposal's `retry_after_policy`).
//!
//! A policy turns the signals of one moment into a base estimate in seconds, or declines. The
//! fallback ladder, jitter and clamp around it are shared (see `retry_after.rs`). Adding a
//! policy means one new variant, one new arm in [`RetryAfterPolicy::compute`] and its own
//! function; existing policies and the configs that name them are untouched.

use std::{fmt, str::FromStr};

use super::queue_depth::QueueDepthSource;

/// A named Retry-After policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RetryAfterPolicy {
    /// The operator's static `retry_after_s` (the default, as today).
    #[default]
    Static,
    /// `ceil(queue_depth / drain_rate × saturation_factor)`, from the proposal.
    RouterQueueDrainRate,
}

/// A policy name that no policy has.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown policy {0:?}: expected \"static\" or \"router_queue_drain_rate\"")]
pub struct UnknownPolicy(pub String);

impl FromStr for RetryAfterPolicy {
    type Err = UnknownPolicy;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "static" => Ok(Self::Static),
            "router_queue_drain_rate" => Ok(Self::RouterQueueDrainRate),
            other => Err(UnknownPolicy(other.to_owned())),
        }
    }
}

impl fmt::Display for RetryAfterPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Static => "static",
            Self::RouterQueueDrainRate => "router_queue_drain_rate",
        })
    }
}

/// The tunables of the computed policy; defaults are the proposal's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyConstants {
    /// EWMA weight of the newest interval's rate (0.3).
    pub alpha: f64,
    /// Intervals with completed responses before the drain rate is trusted (3).
    pub warm_after_intervals: u32,
    /// Seconds without any backend work after which the drain rate is forgotten (30).
    pub cold_after_s: f64,
    /// Backoff streak at which the backoff signal saturates: the proposal's B (5).
    pub backoff_streak_saturation: u32,
    /// Weight of occupancy in the saturation factor: w1 (0.25).
    pub occupancy_weight: f64,
    /// Weight of the backoff signal in the saturation factor: w2 (0.25).
    pub backoff_weight: f64,
    /// Relative jitter: the value is multiplied by a factor drawn from [1 − j, 1 + j] (0.2).
    pub jitter: f64,
    /// Lower clamp of the header value, seconds (1).
    pub min_retry_after_s: u64,
    /// Upper clamp of the header value, seconds (60; never more).
    pub max_retry_after_s: u64,
}

pub use retry_after_protocol::MAX_RETRY_AFTER_S;

impl Default for PolicyConstants {
    fn default() -> Self {
        Self {
            alpha: 0.3,
            warm_after_intervals: 3,
            cold_after_s: 30.0,
            backoff_streak_saturation: 5,
            occupancy_weight: 0.25,
            backoff_weight: 0.25,
            jitter: 0.2,
            min_retry_after_s: 1,
            max_retry_after_s: MAX_RETRY_AFTER_S,
        }
    }
}

impl PolicyConstants {
    /// `1 + w1 · occupancy`: the part of the saturation factor that does not depend on the
    /// query. The occupancy term drops when capacity (and so occupancy) is unknown.
    pub fn occupancy_factor(&self, occupancy: Option<f64>) -> f64 {
        let occupancy = occupancy
            .filter(|o| o.is_finite())
            .map_or(0.0, |o| o.clamp(0.0, 1.0));
        1.0 + self.occupancy_weight * occupancy
    }
}

/// What the policies may look at, gathered at one moment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Signals {
    /// Requests ahead of the rejected one.
    pub queue_depth: u64,
    /// Where `queue_depth` came from.
    pub queue_depth_source: QueueDepthSource,
    /// Responses completed per second (EWMA), or `None` while the rate is not warm.
    pub drain_rate: Option<f64>,
    /// In-flight requests over fleet capacity, or `None` when capacity is unknown.
    pub occupancy: Option<f64>,
    /// The proxy's current placement backoff streak (0 if it passed none).
    pub backoff_streak: u32,
}

/// A policy's base estimate and the terms it was made of.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Computed {
    /// Seconds, before jitter, rounding and clamp.
    pub base_s: f64,
    /// The multiplier applied (1 for policies without one).
    pub saturation_factor: f64,
    /// min(streak / B, 1).
    pub backoff_signal: f64,
}

impl RetryAfterPolicy {
    /// This policy's estimate for `signals`, or `None` if it has none (always, for `Static`).
    pub fn compute(&self, signals: &Signals, constants: &PolicyConstants) -> Option<Computed> {
        match self {
            Self::Static => None,
            Self::RouterQueueDrainRate => router_queue_drain_rate(signals, constants),
        }
    }
}

/// `queue_depth / drain_rate × saturation_factor`, with
/// `saturation_factor = 1 + w1·occupancy + w2·min(streak / B, 1)`. Declines (`None`) when the
/// drain rate is unknown, zero or not finite, or the result is not a finite non-negative number.
fn router_queue_drain_rate(signals: &Signals, constants: &PolicyConstants) -> Option<Computed> {
    let drain_rate = signals.drain_rate.filter(|d| d.is_finite() && *d > 0.0)?;
    let saturation = constants.backoff_streak_saturation.max(1);
    let backoff_signal = (f64::from(signals.backoff_streak) / f64::from(saturation)).min(1.0);
    let saturation_factor =
        constants.occupancy_factor(signals.occupancy) + constants.backoff_weight * backoff_signal;
    let base_s = signals.queue_depth as f64 / drain_rate * saturation_factor;
    (base_s.is_finite() && base_s >= 0.0).then_some(Computed {
        base_s,
        saturation_factor,
        backoff_signal,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signals(depth: u64, drain: f64) -> Signals {
        Signals {
            queue_depth: depth,
            queue_depth_source: QueueDepthSource::Proxy,
            drain_rate: Some(drain),
            occupancy: None,
            backoff_streak: 0,
        }
    }

    #[test]
    fn names_parse_and_print() {
        for policy in [
            RetryAfterPolicy::Static,
            RetryAfterPolicy::RouterQueueDrainRate,
        ] {
            assert_eq!(policy.to_string().parse::<RetryAfterPolicy>(), Ok(policy));
        }
        assert_eq!(
            "auto".parse::<RetryAfterPolicy>(),
            Err(UnknownPolicy("auto".into()))
        );
    }

    #[test]
    fn the_formula_by_hand() {
        let constants = PolicyConstants::default();
        // 30 queued, 4/s drain, occupancy 0.8, streak 2 of B = 5:
        // factor = 1 + 0.25·0.8 + 0.25·0.4 = 1.3; base = 30 / 4 · 1.3 = 9.75 s.
        let s = Signals {
            occupancy: Some(0.8),
            backoff_streak: 2,
            ..signals(30, 4.0)
        };
        let c = RetryAfterPolicy::RouterQueueDrainRate
            .compute(&s, &constants)
            .unwrap();
        assert!((c.saturation_factor - 1.3).abs() < 1e-12, "{c:?}");
        assert!((c.base_s - 9.75).abs() < 1e-12, "{c:?}");
        assert!((c.backoff_signal - 0.4).abs() < 1e-12);
        // The factor is bounded by [1, 1.5] with the default weights.
        let s = Signals {
            occupancy: Some(7.0),
            backoff_streak: 99,
            ..signals(10, 1.0)
        };
        let c = RetryAfterPolicy::RouterQueueDrainRate
            .compute(&s, &constants)
            .unwrap();
        assert_eq!(c.saturation_factor, 1.5);
    }

    #[test]
    fn zero_weights_reduce_to_depth_over_drain() {
        let constants = PolicyConstants {
            occupancy_weight: 0.0,
            backoff_weight: 0.0,
            ..PolicyConstants::default()
        };
        let s = Signals {
            occupancy: Some(1.0),
            backoff_streak: 5,
            ..signals(7, 2.0)
        };
        let c = RetryAfterPolicy::RouterQueueDrainRate
            .compute(&s, &constants)
            .unwrap();
        assert_eq!(c.base_s, 3.5);
    }

    #[test]
    fn declines_without_a_usable_drain_rate_and_static_always_declines() {
        let constants = PolicyConstants::default();
        for drain in [
            None,
            Some(0.0),
            Some(-1.0),
            Some(f64::NAN),
            Some(f64::INFINITY),
        ] {
            let s = Signals {
                drain_rate: drain,
                ..signals(5, 1.0)
            };
            assert_eq!(
                RetryAfterPolicy::RouterQueueDrainRate.compute(&s, &constants),
                None,
                "{drain:?}"
            );
        }
        assert_eq!(
            RetryAfterPolicy::Static.compute(&signals(5, 1.0), &constants),
            None
        );
    }
}
