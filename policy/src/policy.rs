//! Named policies (the proposal's `retry_after_policy`), their constants, and the signals they
//! read.
//!
//! A policy turns the signals of one moment into a base estimate in seconds, or declines with
//! a reason. Adding a policy is one new variant, one arm in [`RetryAfterPolicy::compute`] and
//! its own function; existing policies, and the configurations that name them, are untouched.

use crate::{FallbackReason, OverloadRule, PromisedReturns, QueueDepthSource};

crate::names! {
    /// A named Retry-After policy: the `retry_after_policy` of the configuration, the push and
    /// the evaluation, spelled one way everywhere.
    #[derive(Default)]
    RetryAfterPolicy, "policy" {
        /// The operator's static `retry_after_s` (the default, as today).
        #[default]
        Static = "static",
        /// `ceil(queue_depth / drain_rate × saturation_factor)`, from the proposal (its
        /// revision calls it `queue_drain_rate`: it runs wherever the rejection happens, router
        /// or replica).
        RouterQueueDrainRate = "router_queue_drain_rate",
        /// The earliest second at which the drain rate, less the fresh arrivals forecast, has
        /// room for the queue ahead, every return already promised by then and this one (not
        /// the proposal's; see docs/estimator.md).
        ScheduledReturns = "scheduled_returns",
        /// The earliest second at which the drain rate has room for the queue ahead, every
        /// return already promised by then and this one, the returns not competing with fresh
        /// arrivals: the proxy keeps the place ([`TicketBook`](crate::TicketBook)), admitting
        /// a returning client ahead of fresh ones (not the proposal's; see
        /// docs/estimator.md). Without a book it is `scheduled_returns` with the
        /// `fill_capacity` rule.
        KeptReturns = "kept_returns",
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
    /// Upper clamp of the header value, seconds (60; up to [`crate::MAX_KEPT_RETRY_AFTER_S`]
    /// where the service keeps returns).
    pub max_retry_after_s: u64,
    /// What `scheduled_returns` answers when no second within the clamp has room.
    pub overload_rule: OverloadRule,
    /// In an overload, `scheduled_returns` looks no further than this many times the
    /// overload's age so far (an overload is expected to last about as long again as it has);
    /// `None`: up to the clamp's top.
    pub overload_horizon_factor: Option<f64>,
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
            overload_rule: OverloadRule::LatestWithRoom,
            overload_horizon_factor: None,
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

    /// The latest second `scheduled_returns` considers in an overload that has lasted
    /// `overload_age_s`: `ceil(factor · age)` within the clamp, or the clamp's top without a
    /// factor, an age, or a finite product.
    pub fn overload_horizon(&self, overload_age_s: Option<f64>) -> u64 {
        let (min, max) = self.clamp();
        match (self.overload_horizon_factor, overload_age_s) {
            (Some(factor), Some(age)) if (factor * age).is_finite() => {
                ((factor * age).ceil().max(0.0) as u64).clamp(min, max)
            }
            _ => max,
        }
    }

    /// The clamp as applied: `[min, max]` kept within [1, 300] (the agent's configuration
    /// allows a top above 60 only where the service keeps returns).
    pub fn clamp(&self) -> (u64, u64) {
        let max = self
            .max_retry_after_s
            .clamp(1, crate::MAX_KEPT_RETRY_AFTER_S);
        (self.min_retry_after_s.clamp(1, max), max)
    }

    /// `1 + w1·occupancy + w2·backoff_signal`. The occupancy term drops when occupancy is
    /// unknown; occupancy is kept within [0, 1].
    pub fn saturation_factor(&self, occupancy: Option<f64>, backoff_streak: u32) -> f64 {
        let occupancy = occupancy
            .filter(|o| o.is_finite())
            .map_or(0.0, |o| o.clamp(0.0, 1.0));
        1.0 + self.occupancy_weight * occupancy
            + self.backoff_weight * self.backoff_signal(backoff_streak)
    }

    /// The backoff signal: `min(streak / B, 1)`.
    pub fn backoff_signal(&self, backoff_streak: u32) -> f64 {
        let saturation = self.backoff_streak_saturation.max(1);
        (f64::from(backoff_streak) / f64::from(saturation)).min(1.0)
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
    /// Fresh arrivals per second (requests that are not returns), or `None` while no proxy
    /// reports them.
    pub arrival_rate: Option<f64>,
    /// The returns already promised, per second from now.
    pub promised: PromisedReturns,
    /// How long fresh arrivals have matched or exceeded the drain rate, seconds, or `None`
    /// when they do not (or either rate is unknown).
    pub overload_age_s: Option<f64>,
}

impl Signals {
    /// A proxy's own queue of `depth` requests draining at `drain_rate`, and nothing else
    /// known: no occupancy, streak, arrivals, promises or overload.
    pub fn proxy_queue(depth: u64, drain_rate: f64) -> Self {
        Self {
            queue_depth: Some(QueueDepth {
                depth,
                source: QueueDepthSource::Proxy,
            }),
            drain_rate: Some(drain_rate),
            occupancy: None,
            backoff_streak: 0,
            arrival_rate: None,
            promised: PromisedReturns::NONE,
            overload_age_s: None,
        }
    }
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
    /// How the jitter spreads this estimate.
    pub spread: Spread,
}

/// How the jitter draw spreads an estimate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spread {
    /// By the relative `jitter` around the value (the proposal's ±20%).
    Relative,
    /// Across the second that ends at the value: the header stays that second, the
    /// milliseconds fall anywhere within it (the slot of `scheduled_returns`).
    WithinSecond,
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
            Self::ScheduledReturns => scheduled_returns(signals, constants),
            Self::KeptReturns => scheduled_returns(
                signals,
                &PolicyConstants {
                    overload_rule: OverloadRule::FillCapacity,
                    ..*constants
                },
            ),
        }
    }
}

/// The drain rate and the queue both computing policies need, or why one is missing: a
/// drain rate that is unknown, zero or not finite; a queue no source can see.
fn drain_and_queue(signals: &Signals) -> Result<(f64, QueueDepth), FallbackReason> {
    let drain_rate = signals
        .drain_rate
        .filter(|d| d.is_finite() && *d > 0.0)
        .ok_or(FallbackReason::DrainNotWarm)?;
    let queue = signals.queue_depth.ok_or(FallbackReason::QueueInvisible)?;
    Ok((drain_rate, queue))
}

/// `queue_depth / drain_rate × saturation_factor`. Declines when the drain rate is unknown,
/// zero or not finite, when the queue is invisible, or when the result is not a finite
/// non-negative number.
fn queue_drain_rate(
    signals: &Signals,
    constants: &PolicyConstants,
) -> Result<Computed, FallbackReason> {
    let (drain_rate, queue) = drain_and_queue(signals)?;
    let saturation_factor = constants.saturation_factor(signals.occupancy, signals.backoff_streak);
    let backoff_signal = constants.backoff_signal(signals.backoff_streak);
    let base_s = queue.depth as f64 / drain_rate * saturation_factor;
    if !(base_s.is_finite() && base_s >= 0.0) {
        return Err(FallbackReason::EstimateUnusable);
    }
    Ok(Computed {
        base_s,
        saturation_factor,
        backoff_signal,
        spread: Spread::Relative,
    })
}

/// The earliest whole second `s` within the clamp such that, by the end of second `s`, the
/// drain rate less the fresh arrivals forecast, `(drain_rate − arrival_rate) · (s + 1)`, has
/// drained the queue ahead, every return promised up to second `s`, and this one. When no
/// such second exists within the clamp (fresh arrivals alone take the capacity, or the
/// schedule is full to the horizon), [`OverloadRule`] decides, up to the overload horizon
/// ([`PolicyConstants::overload_horizon`]). Declines like
/// `queue_drain_rate` when the drain rate is not warm or the queue is invisible; an unknown
/// arrival rate counts as none.
fn scheduled_returns(
    signals: &Signals,
    constants: &PolicyConstants,
) -> Result<Computed, FallbackReason> {
    let (drain_rate, queue) = drain_and_queue(signals)?;
    let arrival_rate = signals
        .arrival_rate
        .filter(|a| a.is_finite() && *a > 0.0)
        .unwrap_or(0.0);
    let (min, max) = constants.clamp();
    let slot = |arrivals: f64, top: u64| {
        earliest_second(
            queue.depth,
            drain_rate - arrivals,
            |s| f64::from(signals.promised.due(s as usize)),
            min,
            top,
        )
    };
    let horizon = constants.overload_horizon(signals.overload_age_s);
    let seconds = slot(arrival_rate, max)
        .or_else(|| match constants.overload_rule {
            OverloadRule::Latest => None,
            OverloadRule::FillCapacity => slot(0.0, horizon),
            OverloadRule::LatestWithRoom => latest_second_with_room(
                drain_rate,
                &signals.promised,
                (horizon / 2).max(min),
                horizon,
            ),
        })
        .unwrap_or(horizon);
    Ok(Computed {
        base_s: seconds as f64,
        saturation_factor: 1.0,
        backoff_signal: 0.0,
        spread: Spread::WithinSecond,
    })
}

/// The latest second `s` in `low..=high` whose promised returns leave room for one more
/// within a second of the drain rate.
fn latest_second_with_room(
    drain_rate: f64,
    promised: &PromisedReturns,
    low: u64,
    high: u64,
) -> Option<u64> {
    (low..=high)
        .rev()
        .find(|&s| f64::from(promised.due(s as usize)) + 1.0 <= drain_rate)
}

/// The first second `s` in `min..=max` with `room_per_s · (s + 1) ≥ depth + 1 + Σ promised[..=s]`,
/// `promised(s)` the returns due in second `s` from now (also the ticket book's placement).
pub(crate) fn earliest_second(
    depth: u64,
    room_per_s: f64,
    promised: impl Fn(u64) -> f64,
    min: u64,
    max: u64,
) -> Option<u64> {
    if !(room_per_s.is_finite() && room_per_s > 0.0) {
        return None;
    }
    let mut ahead = depth as f64 + 1.0;
    for s in 0..=max {
        ahead += promised(s);
        let capacity = room_per_s * (s + 1) as f64;
        if s >= min && capacity >= ahead {
            return Some(s);
        }
        // `ahead` never shrinks and the capacity of a later second is at most that of the
        // last: past it, no later second can qualify (a shortcut, exact in floating point:
        // both sides are the very values the loop would compare).
        if ahead > room_per_s * (max + 1) as f64 {
            return None;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signals(depth: u64, drain: f64) -> Signals {
        Signals::proxy_queue(depth, drain)
    }

    const COMPUTED: RetryAfterPolicy = RetryAfterPolicy::RouterQueueDrainRate;

    #[test]
    fn names_parse_and_print_one_spelling_each() {
        for policy in RetryAfterPolicy::ALL {
            assert_eq!(policy.to_string().parse::<RetryAfterPolicy>(), Ok(*policy));
        }
        assert!("queue_drain_rate".parse::<RetryAfterPolicy>().is_err());
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
    fn scheduled_returns_by_hand() {
        let scheduled = RetryAfterPolicy::ScheduledReturns;
        let constants = PolicyConstants::default();
        // Drain 4/s, fresh arrivals 2/s: 2/s of room. 5 queued ahead, 2 returns due in
        // second 1 and 3 in second 2: with this one, 11 need room, and 2 · (s + 1) ≥ 11
        // first at s = 5.
        let s = Signals {
            arrival_rate: Some(2.0),
            promised: PromisedReturns::from_bins([0, 2, 3]),
            ..signals(5, 4.0)
        };
        let c = scheduled.compute(&s, &constants).unwrap();
        assert_eq!((c.base_s, c.spread), (5.0, Spread::WithinSecond));
        // An empty queue and schedule: the first second the clamp allows.
        let idle = Signals {
            arrival_rate: Some(1.0),
            ..signals(0, 4.0)
        };
        assert_eq!(scheduled.compute(&idle, &constants).unwrap().base_s, 1.0);
        // Fresh arrivals beyond the drain rate: the latest second, or the capacity filled in
        // turn as if no one else arrived (6 + 2 need room, 4 · 2 ≥ 8 at s = 1).
        let overload = Signals {
            arrival_rate: Some(5.0),
            ..s
        };
        assert_eq!(
            scheduled.compute(&overload, &constants).unwrap().base_s,
            60.0
        );
        let fill = PolicyConstants {
            overload_rule: OverloadRule::FillCapacity,
            ..constants
        };
        assert_eq!(scheduled.compute(&overload, &fill).unwrap().base_s, 1.0);
        // The default rule walks back from the horizon: with second 60 holding 4 (a second
        // of drain) and 59 holding 3, the next return goes to 59; with both full, to 58.
        let mut bins = [0u32; 61];
        (bins[59], bins[60]) = (3, 4);
        let walking_back = Signals {
            promised: PromisedReturns::from_bins(bins),
            ..overload
        };
        assert_eq!(
            scheduled.compute(&walking_back, &constants).unwrap().base_s,
            59.0
        );
        bins[59] = 4;
        let walking_back = Signals {
            promised: PromisedReturns::from_bins(bins),
            ..overload
        };
        assert_eq!(
            scheduled.compute(&walking_back, &constants).unwrap().base_s,
            58.0
        );
        // With a horizon factor, an overload 4 s old looks 2 × 4 = 8 s ahead at most.
        let young = Signals {
            overload_age_s: Some(4.0),
            ..overload
        };
        let horizon = PolicyConstants {
            overload_horizon_factor: Some(2.0),
            ..constants
        };
        assert_eq!(scheduled.compute(&young, &horizon).unwrap().base_s, 8.0);
        assert_eq!(scheduled.compute(&young, &constants).unwrap().base_s, 60.0);
        // It declines as the proposal's policy does.
        let cold = Signals {
            drain_rate: None,
            ..s
        };
        assert_eq!(
            scheduled.compute(&cold, &constants),
            Err(FallbackReason::DrainNotWarm)
        );
    }

    #[test]
    fn a_second_with_room_to_the_last_bit_is_found() {
        // (51.704918032786885 − 2) · 61 is exactly 3032: second 60 has room for 3031 + 1. An
        // earlier shortcut gave up at second 13 by rounding.
        let s = Signals {
            arrival_rate: Some(2.0),
            ..signals(3031, 51.704918032786885)
        };
        let fill = PolicyConstants {
            overload_rule: OverloadRule::FillCapacity,
            ..PolicyConstants::default()
        };
        let c = RetryAfterPolicy::ScheduledReturns
            .compute(&s, &fill)
            .unwrap();
        assert_eq!(c.base_s, 60.0);
    }

    #[test]
    fn overload_rules_parse_and_print() {
        for rule in OverloadRule::ALL {
            assert_eq!(rule.to_string().parse::<OverloadRule>(), Ok(*rule));
        }
        assert!("soon".parse::<OverloadRule>().is_err());
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
