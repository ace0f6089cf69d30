//! The returns a proxy promised its clients itself (`scheduled_returns`), so that its next
//! rejections count them at once: the agent's schedule holds them only once reported.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use retry_after_protocol::{
    EstimatePush,
    policy::{MAX_RETRY_AFTER_S, RetryAfterPolicy, ReturnBook},
};

use crate::{Decision, decide};

/// One proxy's own promises, by whole second of its owner's clock, bounded and lock-free.
#[derive(Debug, Default)]
pub struct OwnReturns {
    book: ReturnBook,
    dropped: AtomicU64,
}

impl OwnReturns {
    /// The answer to one rejection at `now` from `push`, received at `received` (both times
    /// on the owner's clock, from any fixed zero): [`decide`] with the schedule seen
    /// ([`EstimatePush::schedule`]: the push's, no less than this proxy's own promises),
    /// then the value handed out is counted as a promise (other policies read no schedule).
    /// `local` is the proxy's own queue depth and backoff streak, where it has them.
    pub fn decide(
        &self,
        push: &EstimatePush,
        received: Duration,
        now: Duration,
        local: (Option<u64>, Option<u32>),
        jitter_draw: f64,
    ) -> Decision {
        if push.retry_after_policy != RetryAfterPolicy::ScheduledReturns {
            return decide(push, local.0, local.1, &push.pushed_schedule(), jitter_draw);
        }
        let own = self.book.ahead(now.as_secs());
        let schedule = push.schedule(now.saturating_sub(received), &own);
        let decision = decide(push, local.0, local.1, &schedule, jitter_draw);
        // A static fallback beyond the minute is outside the schedule (as at the agent).
        if let Some(seconds) = decision.seconds.filter(|&s| s <= MAX_RETRY_AFTER_S) {
            let due = (now + Duration::from_secs(seconds)).as_secs();
            if self.book.promise(now.as_secs(), due, 1).is_err() {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        decision
    }

    /// Promises the book could not hold.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}
