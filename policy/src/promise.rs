//! What a rejection promises: the place a proxy gives a rejected client in its [`TicketBook`],
//! and the seconds that tell it. Every proxy (the Rust reference proxy, HAProxy's and nginx's
//! Lua, Ray Serve's Python) gives places by this rule, held to the shared ticket vectors.

use crate::{TicketBook, TicketKey};

/// The place a rejection promised: the second it is due and the `Retry-After` that says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Promise {
    /// The second the place is due, on the book's clock.
    pub due: u64,
    /// Seconds from now to it, within the header's clamp (a client told the clamp's top
    /// comes back early and is told the rest).
    pub seconds: u64,
}

/// The answer a rejection would carry without a place: its seconds, and whether they come
/// from a fresh estimate (the agent's answer: computed, or its static fallback while the
/// drain rate warms) or are the proxy's own static value (no fresh estimate held).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hint {
    /// `Retry-After`'s seconds.
    pub seconds: u64,
    /// From a fresh estimate; `false` for the proxy's own static value (the agent away).
    pub fresh: bool,
}

/// What a client whose place is due at `due` is told at `now_s`: the seconds to it, within
/// `clamp` (low, high).
pub fn told(due: u64, now_s: u64, clamp: (u64, u64)) -> Promise {
    Promise {
        due,
        seconds: due.saturating_sub(now_s).clamp(clamp.0, clamp.1),
    }
}

/// The wait a request allows, in whole seconds: the lesser of its deadline header's value
/// (`header`: seconds, up to 9 digits, a fraction allowed and cut off; anything else is no
/// deadline) and the proxy's budget for every request (`budget_s`). `None`: no deadline.
pub fn deadline_s(header: Option<&str>, budget_s: Option<u64>) -> Option<u64> {
    let from_header = header.and_then(|value| {
        let value = value.trim();
        let (whole, fraction) = value.split_once('.').unwrap_or((value, "0"));
        let digits = |s: &str, max: usize| {
            !s.is_empty() && s.len() <= max && s.bytes().all(|b| b.is_ascii_digit())
        };
        (digits(whole, 9) && digits(fraction, 9)).then(|| whole.parse::<u64>().ok())?
    });
    match (from_header, budget_s) {
        (Some(h), Some(b)) => Some(h.min(b)),
        (h, b) => h.or(b),
    }
}

/// What a rejection with kept returns carries ([`give_place`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// A place kept for the client: its second and the seconds that tell it.
    Kept(Promise),
    /// No place: the rejection carries the hint alone.
    HintAlone,
    /// The earliest place lies beyond the wait the request allows: none is given (no room is
    /// reserved for a client that will not come), and the rejection tells the seconds to it
    /// and says not to retry (`x-should-retry: false`), counted as beyond its deadline.
    BeyondDeadline(Promise),
}

impl Placement {
    /// The place kept, if one is.
    pub fn kept(self) -> Option<Promise> {
        match self {
            Self::Kept(promise) => Some(promise),
            Self::HintAlone | Self::BeyondDeadline(_) => None,
        }
    }
}

/// The place a rejected client with `key`, from `source` (its address as a key, where the book
/// bounds each source's share), is given at `now_s` (`elapsed` seconds into it), the request
/// allowing a wait of `deadline_s` seconds at most (`None`: no deadline known).
///
/// With a drain rate, the earliest second with room behind the `queue_depth` queued and
/// every place given, no sooner than `clamp.0` ([`TicketBook::place`]); no room up to the
/// horizon, or a key the book refuses, gets no place. Before the drain rate is known, the
/// `hint`'s second is kept as the place, without looking for room, but only a hint from a
/// fresh estimate (the agent up, its drain rate warming): without one the agent may be away
/// for long, and places at the static value would pass the queue's bound when they fall due,
/// for as long as it is away. No place: the rejection carries the hint alone, counted as
/// unplaced (or as refused by the book). A place further than `deadline_s` is not given
/// ([`Placement::BeyondDeadline`]). A place with room found, a source past its share of the
/// drain gets none either ([`TicketBook::spend_source`], counted as over its share); before
/// the drain rate is known its allowance does not fill, so a source gets one place until it is
/// (a flood from one address in the first seconds takes one place, not one per request). `hint`
/// is asked only when it is needed.
#[allow(clippy::too_many_arguments)]
pub fn give_place(
    book: &mut TicketBook,
    key: TicketKey,
    source: Option<TicketKey>,
    now_s: u64,
    elapsed: f64,
    queue_depth: u64,
    drain_rate: Option<f64>,
    clamp: (u64, u64),
    deadline_s: Option<u64>,
    hint: impl FnOnce() -> Option<Hint>,
) -> Placement {
    let due = match drain_rate {
        Some(drain_rate) => book.place(now_s, elapsed, queue_depth, drain_rate, clamp.0),
        None => hint().filter(|h| h.fresh).map(|h| now_s + h.seconds),
    };
    let Some(due) = due else {
        book.unplaced();
        return Placement::HintAlone;
    };
    if deadline_s.is_some_and(|d| due - now_s > d) {
        book.beyond_deadline();
        return Placement::BeyondDeadline(told(due, now_s, clamp));
    }
    if let Some(source) = source
        && !book.spend_source(source, now_s as f64 + elapsed, drain_rate.unwrap_or(0.0))
    {
        return Placement::HintAlone;
    }
    match book.issue(key, due, now_s) {
        Some(due) => Placement::Kept(told(due, now_s, clamp)),
        None => Placement::HintAlone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KeptReturnsSettings;

    fn book() -> TicketBook {
        TicketBook::new(KeptReturnsSettings::default())
    }

    #[test]
    fn a_place_beyond_the_clamp_is_told_in_steps() {
        assert_eq!(told(190, 100, (1, 60)).seconds, 60);
        assert_eq!(told(190, 160, (1, 60)).seconds, 30);
        assert_eq!(told(100, 100, (1, 60)).seconds, 1);
    }

    #[test]
    fn with_a_drain_rate_the_place_is_behind_the_queue() {
        // 8 queued at 2 a second, half a second in: the end of second 4 from now.
        let place = give_place(
            &mut book(),
            TicketKey(1),
            None,
            1000,
            0.5,
            8,
            Some(2.0),
            (1, 60),
            None,
            || panic!("no hint is asked for while the drain rate is known"),
        );
        assert_eq!(
            place,
            Placement::Kept(Promise {
                due: 1004,
                seconds: 4
            })
        );
    }

    #[test]
    fn without_a_drain_rate_only_a_fresh_hint_is_kept() {
        let fresh = || {
            Some(Hint {
                seconds: 7,
                fresh: true,
            })
        };
        let fallback = || {
            Some(Hint {
                seconds: 5,
                fresh: false,
            })
        };
        let mut b = book();
        let kept = give_place(
            &mut b,
            TicketKey(1),
            None,
            1000,
            0.0,
            8,
            None,
            (1, 60),
            None,
            fresh,
        );
        assert_eq!(
            kept,
            Placement::Kept(Promise {
                due: 1007,
                seconds: 7
            })
        );
        assert_eq!(
            give_place(
                &mut b,
                TicketKey(2),
                None,
                1000,
                0.0,
                8,
                None,
                (1, 60),
                None,
                fallback
            ),
            Placement::HintAlone
        );
        assert_eq!(
            give_place(
                &mut b,
                TicketKey(3),
                None,
                1000,
                0.0,
                8,
                None,
                (1, 60),
                None,
                || None
            ),
            Placement::HintAlone
        );
        assert_eq!(b.counters().get(crate::TicketOutcome::Unplaced), 2);
    }

    #[test]
    fn a_source_past_its_share_of_the_drain_gets_no_place() {
        // 25% of 8 a second: two places a second for one address, whatever its keys.
        let mut b = TicketBook::new(KeptReturnsSettings {
            source_share_percent: 25,
            ..KeptReturnsSettings::default()
        });
        let source = Some(TicketKey(99));
        let give = |b: &mut TicketBook, key: u64, now: u64| {
            give_place(
                b,
                TicketKey(key),
                source,
                now,
                0.0,
                0,
                Some(8.0),
                (1, 60),
                None,
                || None,
            )
            .kept()
        };
        assert!(give(&mut b, 1, 1000).is_some());
        assert!(give(&mut b, 2, 1000).is_some());
        assert_eq!(give(&mut b, 3, 1000), None);
        assert_eq!(b.counters().get(crate::TicketOutcome::OverShare), 1);
        // Another address is not held back, and the first has its share again a second later.
        let other = give_place(
            &mut b,
            TicketKey(4),
            Some(TicketKey(7)),
            1000,
            0.0,
            0,
            Some(8.0),
            (1, 60),
            None,
            || None,
        );
        assert!(other.kept().is_some());
        assert!(give(&mut b, 5, 1001).is_some());
    }

    #[test]
    fn a_deadline_is_the_header_or_the_budget_whichever_is_less() {
        assert_eq!(deadline_s(Some(" 30 "), None), Some(30));
        assert_eq!(deadline_s(Some("2.9"), Some(10)), Some(2));
        assert_eq!(deadline_s(Some("30"), Some(10)), Some(10));
        for bad in [
            "",
            "-1",
            "+3",
            "1e3",
            ".5",
            "5.",
            "abc",
            "1234567890",
            "1.2.3",
        ] {
            assert_eq!(deadline_s(Some(bad), None), None, "{bad:?}");
            assert_eq!(deadline_s(Some(bad), Some(7)), Some(7), "{bad:?}");
        }
        assert_eq!(deadline_s(None, None), None);
    }

    #[test]
    fn a_place_beyond_the_deadline_is_not_given_and_is_told() {
        // 8 queued at 2 a second, the second just begun: the place is 4 s away. A client that may wait 4 s gets it;
        // one that may wait 3 s gets none, is told the 4 s, and no room is reserved for it.
        let mut b = book();
        let give = |b: &mut TicketBook, key: u64, deadline: Option<u64>| {
            give_place(
                b,
                TicketKey(key),
                None,
                1000,
                0.0,
                8,
                Some(2.0),
                (1, 60),
                deadline,
                || None,
            )
        };
        let beyond = give(&mut b, 1, Some(3));
        assert_eq!(
            beyond,
            Placement::BeyondDeadline(Promise {
                due: 1004,
                seconds: 4
            })
        );
        assert_eq!(b.reserved(1004), 0, "nothing reserved");
        assert_eq!(b.counters().get(crate::TicketOutcome::BeyondDeadline), 1);
        assert_eq!(
            give(&mut b, 2, Some(4)),
            Placement::Kept(Promise {
                due: 1004,
                seconds: 4
            })
        );
        assert_eq!(give(&mut b, 3, None).kept().map(|p| p.due), Some(1004));
        // Before the drain rate is known, a fresh hint's second is measured the same way.
        let hinted = give_place(
            &mut b,
            TicketKey(4),
            None,
            1000,
            0.0,
            8,
            None,
            (1, 60),
            Some(6),
            || {
                Some(Hint {
                    seconds: 7,
                    fresh: true,
                })
            },
        );
        assert!(matches!(hinted, Placement::BeyondDeadline(p) if p.seconds == 7));
    }
}
