//! Named policies (the proposal's `retry_after_policy`), their constants, and the signals they
//! read.
//!
//! A policy turns the signals of one moment into a base estimate in seconds, or declines with
//! a reason. Adding a policy is one new variant, one arm in [`RetryAfterPolicy::compute`] and
//! its own function; existing policies, and the configurations that name them, are untouched.

use std::{fmt, str::FromStr};

use crate::{FallbackReason, QueueDepthSource, UnknownName};

/// A named Retry-After policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RetryAfterPolicy {
    /// The operator's static `retry_after_s` (the default, as today).
    #[default]
    Static,
    /// `ceil(queue_depth / drain_rate × saturation_factor)`, from the proposal. Its revision
    /// calls it `queue_drain_rate` (it runs wherever the rejection happens, router or
    /// replica); both names select it.
    RouterQueueDrainRate,
}

impl RetryAfterPolicy {
    /// Every policy.
    pub const ALL: [RetryAfterPolicy; 2] = [Self::Static, Self::RouterQueueDrainRate];

    /// The canonical name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Static => "static",
            Self::RouterQueueDrainRate => "router_queue_drain_rate",
        }
    }
}

impl FromStr for RetryAfterPolicy {
    type Err = UnknownName;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "static" => Ok(Self::Static),
            "router_queue_drain_rate" | "queue_drain_rate" => Ok(Self::RouterQueueDrainRate),
            other => Err(UnknownName {
                what: "policy",
                name: other.to_owned(),
                expected: "\"static\" \"router_queue_drain_rate\" (alias \"queue_drain_rate\")",
            }),
        }
    }
}

impl fmt::Display for RetryAfterPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The constants of the formula and the ladder; defaults are the proposal's. (The drain-rate
/// EWMA's own constants live with the EWMA, in the agent: a client never needs them.)
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyConstants {
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

impl Default for PolicyConstants {
    fn default() -> Self {
        Self {
            backoff_streak_saturation: 5,
            occupancy_weight: 0.25,
            backoff_weight: 0.25,
            jitter: 0.2,
            min_retry_after_s: 1,
            max_retry_after_s: crate::MAX_RETRY_AFTER_S,
        }
    }
}

impl PolicyConstants {
    /// The revision's simple form: no saturation factor (w1 = w2 = 0), so the estimate is
    /// `ceil(queue_depth / drain_rate)` before jitter and clamp.
    pub fn simple() -> Self {
        Self {
            occupancy_weight: 0.0,
            backoff_weight: 0.0,
            ..Self::default()
        }
    }

    /// `1 + w1·occupancy + w2·min(streak / B, 1)`, and the backoff signal `min(streak / B, 1)`.
    /// The occupancy term drops when occupancy is unknown; occupancy is kept within [0, 1].
    pub fn saturation_factor(&self, occupancy: Option<f64>, backoff_streak: u32) -> (f64, f64) {
        let occupancy = occupancy
            .filter(|o| o.is_finite())
            .map_or(0.0, |o| o.clamp(0.0, 1.0));
        let saturation = self.backoff_streak_saturation.max(1);
        let backoff_signal = (f64::from(backoff_streak) / f64::from(saturation)).min(1.0);
        (
            1.0 + self.occupancy_weight * occupancy + self.backoff_weight * backoff_signal,
            backoff_signal,
        )
    }
}

/// A queue depth and where it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueDepth {
    /// Requests ahead of the rejected one.
    pub depth: u64,
    /// Its source.
    pub source: QueueDepthSource,
}

/// What the policies may look at, gathered at one moment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Signals {
    /// The queue, if some source can see it.
    pub queue_depth: Option<QueueDepth>,
    /// Responses completed per second in the queue's scope (EWMA), or `None` while the rate
    /// is not warm.
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
    /// This policy's estimate for `signals`, or why it has none.
    ///
    /// # Errors
    /// The [`FallbackReason`] the ladder reports when it steps down.
    pub fn compute(
        &self,
        signals: &Signals,
        constants: &PolicyConstants,
    ) -> Result<Computed, FallbackReason> {
        match self {
            Self::Static => Err(FallbackReason::StaticPolicy),
            Self::RouterQueueDrainRate => queue_drain_rate(signals, constants),
        }
    }
}

/// `queue_depth / drain_rate × saturation_factor`. Declines when the drain rate is unknown,
/// zero or not finite, when the queue is invisible, or when the result is not a finite
/// non-negative number.
fn queue_drain_rate(
    signals: &Signals,
    constants: &PolicyConstants,
) -> Result<Computed, FallbackReason> {
    let drain_rate = signals
        .drain_rate
        .filter(|d| d.is_finite() && *d > 0.0)
        .ok_or(FallbackReason::DrainNotWarm)?;
    let queue = signals.queue_depth.ok_or(FallbackReason::QueueInvisible)?;
    let (saturation_factor, backoff_signal) =
        constants.saturation_factor(signals.occupancy, signals.backoff_streak);
    let base_s = queue.depth as f64 / drain_rate * saturation_factor;
    if !(base_s.is_finite() && base_s >= 0.0) {
        return Err(FallbackReason::EstimateUnusable);
    }
    Ok(Computed {
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
            queue_depth: Some(QueueDepth {
                depth,
                source: QueueDepthSource::Proxy,
            }),
            drain_rate: Some(drain),
            occupancy: None,
            backoff_streak: 0,
        }
    }

    const COMPUTED: RetryAfterPolicy = RetryAfterPolicy::RouterQueueDrainRate;

    #[test]
    fn names_parse_and_print_and_the_revision_name_is_an_alias() {
        for policy in RetryAfterPolicy::ALL {
            assert_eq!(policy.to_string().parse::<RetryAfterPolicy>(), Ok(policy));
        }
        assert_eq!("queue_drain_rate".parse::<RetryAfterPolicy>(), Ok(COMPUTED));
        let e = "auto".parse::<RetryAfterPolicy>().unwrap_err();
        assert_eq!(e.name, "auto");
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
        let c = COMPUTED.compute(&s, &constants).unwrap();
        assert!((c.saturation_factor - 1.3).abs() < 1e-12, "{c:?}");
        assert!((c.base_s - 9.75).abs() < 1e-12, "{c:?}");
        assert!((c.backoff_signal - 0.4).abs() < 1e-12);
        // The factor is bounded by [1, 1.5] with the default weights.
        let s = Signals {
            occupancy: Some(7.0),
            backoff_streak: 99,
            ..signals(10, 1.0)
        };
        assert_eq!(
            COMPUTED.compute(&s, &constants).unwrap().saturation_factor,
            1.5
        );
    }

    #[test]
    fn the_simple_profile_is_depth_over_drain() {
        let s = Signals {
            occupancy: Some(1.0),
            backoff_streak: 5,
            ..signals(7, 2.0)
        };
        let c = COMPUTED.compute(&s, &PolicyConstants::simple()).unwrap();
        assert_eq!(c.base_s, 3.5);
    }

    #[test]
    fn declines_with_a_reason() {
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
                COMPUTED.compute(&s, &constants),
                Err(FallbackReason::DrainNotWarm),
                "{drain:?}"
            );
        }
        let invisible = Signals {
            queue_depth: None,
            ..signals(5, 1.0)
        };
        assert_eq!(
            COMPUTED.compute(&invisible, &constants),
            Err(FallbackReason::QueueInvisible)
        );
        assert_eq!(
            RetryAfterPolicy::Static.compute(&signals(5, 1.0), &constants),
            Err(FallbackReason::StaticPolicy)
        );
        let tiny = Signals {
            drain_rate: Some(f64::MIN_POSITIVE),
            ..signals(u64::MAX, 1.0)
        };
        assert_eq!(
            COMPUTED.compute(&tiny, &constants),
            Err(FallbackReason::EstimateUnusable)
        );
    }
}
