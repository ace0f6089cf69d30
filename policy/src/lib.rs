//! The Retry-After policy, in one place: the signals an estimate is made of, the named
//! policies that turn them into seconds, the fallback ladder, jitter, rounding and clamp.
//!
//! No I/O, no clock, no randomness of its own: the jitter draw is an argument. The agent's
//! estimator answers `QUERY` with [`answer`], and the client library answers a rejection from
//! a pushed estimate with the same [`answer`], so a proxy that computes locally says exactly
//! what the agent would have said for the same inputs and the same draw.
//!
//! ```text
//! retry_after = ceil(queue_depth / drain_rate × saturation_factor × jitter)   in [min, max]
//! saturation_factor = 1 + w1·occupancy + w2·min(backoff_streak / B, 1)
//! ```
//!
//! `scheduled_returns` answers instead with the earliest second at which the drain rate, less
//! the fresh arrivals, has room for the queue ahead, the returns already promised by then
//! ([`PromisedReturns`], kept in a [`ReturnBook`]) and this one; see [`RetryAfterPolicy`].
//!
//! Ladder: computed (the policy computes, the drain rate is warm and positive, the queue is
//! visible) → the static `retry_after_s` → no header. Every step down names its
//! [`FallbackReason`].

mod ladder;
mod names;
mod policy;
mod promise;
mod returns;
mod sources;
mod tickets;

pub use ladder::{Answer, answer, header_value, jitter_factor};
pub use names::{FallbackReason, OverloadRule, QueueDepthSource, Rung, TicketOutcome, UnknownName};
pub use policy::{Computed, PolicyConstants, QueueDepth, RetryAfterPolicy, Signals, Spread};
pub use promise::{Hint, Placement, Promise, deadline_s, give_place, told};
#[doc(hidden)]
pub use retry_after_common::vocabulary;
pub use returns::{PromisedReturns, RETURN_BINS, ReturnBook, ReturnDropped};
pub use sources::{SourceAllowances, source_address};
pub use tickets::{
    BUCKET, CookieError, Held, KeptReturnsSettings, KeyHasher, ReturnCookie, TicketBook,
    TicketCounters, TicketKey,
};

/// The default clamp of a header value, and the widest for the hint policies: common client
/// SDKs ignored Retry-After above 60 s (the proposal's clamp).
pub const MAX_RETRY_AFTER_S: u64 = 60;

/// The widest clamp of a service that keeps returns and opts in (`max_retry_after_s` above
/// 60): the ticket book's horizon, the farthest place it gives, so that a place minutes away
/// is told as it is to a client that honours it. Every port clamps to this; the agent's
/// configuration allows more than [`MAX_RETRY_AFTER_S`] only where returns are kept.
pub const MAX_KEPT_RETRY_AFTER_S: u64 = 300;
