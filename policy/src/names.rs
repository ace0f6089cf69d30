//! The small vocabularies every layer prints and parses: ladder rungs, why the ladder fell,
//! and where a queue depth came from. One spelling each, used by the protocol, the metrics and
//! the logs.

/// A word that is not one of a vocabulary's names.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown {what} {name:?}: expected one of {expected}")]
pub struct UnknownName {
    /// Which vocabulary.
    pub what: &'static str,
    /// The word given.
    pub name: String,
    /// The names it has.
    pub expected: &'static str,
}

/// Declares a fieldless enum with one wire name per variant, `ALL`, `as_str`, `Display` and
/// `FromStr` (whose error, [`UnknownName`], lists the names): common's `vocabulary!`, printed
/// and parsed. The one way every crate declares a vocabulary that is printed and parsed.
#[macro_export]
macro_rules! names {
    ($(#[$meta:meta])* $name:ident, $what:literal { $($(#[$vmeta:meta])* $variant:ident = $text:literal,)+ }) => {
        $crate::vocabulary! {
            $(#[$meta])*
            pub enum $name {
                $($(#[$vmeta])* $variant => $text,)+
            }
        }

        impl ::core::fmt::Display for $name {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::core::str::FromStr for $name {
            type Err = $crate::UnknownName;

            fn from_str(name: &str) -> Result<Self, $crate::UnknownName> {
                match name {
                    $($text => Ok($name::$variant),)+
                    _ => Err($crate::UnknownName {
                        what: $what,
                        name: name.to_owned(),
                        expected: concat!($("\"", $text, "\" "),+),
                    }),
                }
            }
        }
    };
}

names! {
    /// Which rung of the fallback ladder answered.
    Rung, "rung" {
        /// The policy's computed value.
        Computed = "computed",
        /// The operator's static `retry_after_s`.
        Static = "static",
        /// No header.
        None = "none",
    }
}

names! {
    /// Why the computed rung did not answer.
    FallbackReason, "fallback reason" {
        /// The service's policy is `static`: it never computes.
        StaticPolicy = "static_policy",
        /// The drain rate is not warm yet (or has gone cold, or is zero).
        DrainNotWarm = "drain_not_warm",
        /// No source can see the queue: the proxy passed no depth, no frontend is declared,
        /// or (at the replicas) capacity is unknown. A computed value would be a guess.
        QueueInvisible = "queue_invisible",
        /// The formula produced no finite non-negative number.
        EstimateUnusable = "estimate_unusable",
    }
}

names! {
    /// Where a queue depth came from, best first.
    QueueDepthSource, "queue depth source" {
        /// Passed by the rejecting proxy (or replica): it knows its own queue exactly.
        Proxy = "proxy",
        /// The proxy's listener's requests in flight minus those it has in flight to the
        /// backends: the proxy's queue, seen from the kernel.
        Frontend = "frontend",
        /// Requests in flight at the replicas beyond their `max_ongoing_requests`: the
        /// replicas' own queues, seen from the kernel.
        BeyondCapacity = "beyond_capacity",
        /// Requests in flight at the replicas whose response's first body byte has not gone
        /// by: what waits inside an engine that sends its headers at once and streams its
        /// answer (`replica_queue = "waiting"`), seen from the kernel.
        Waiting = "waiting",
    }
}

names! {
    /// What `scheduled_returns` answers when no second within the clamp has room for a return
    /// after the fresh arrivals forecast (docs/estimator.md).
    #[derive(Default)]
    OverloadRule, "overload rule" {
        /// The horizon (the clamp's top): the latest time a client will still honour.
        Latest = "latest",
        /// The earliest second up to the horizon with room were there no fresh arrivals (the
        /// returns fill the capacity in turn, competing with whatever arrives then), else the
        /// horizon.
        FillCapacity = "fill_capacity",
        /// The latest second in the later half of the horizon that a second of the drain rate
        /// can still take (the returns fill the capacity backwards from the horizon, betting
        /// the overload ends before they land), else the horizon. The default: on the
        /// evaluation's suite it admits the largest share of the three, with less idle
        /// capacity than `latest`.
        #[default]
        LatestWithRoom = "latest_with_room",
    }
}

names! {
    /// What became of places in a [`TicketBook`](crate::TicketBook): the counters a proxy
    /// reports (`tickets=`) and the agent exports (`retry_after_tickets_total{outcome}`).
    TicketOutcome, "ticket outcome" {
        /// A place given to a rejected client.
        Issued = "issued",
        /// A place taken by its client, at or after its second.
        Honoured = "honoured",
        /// A client came back before its place (told the time left, or admitted into free
        /// room).
        Early = "early",
        /// A place unused past its grace.
        Expired = "expired",
        /// A key refused a place: its bucket was full of live places.
        Refused = "refused",
        /// A return cookie presented again after its place was taken (treated as fresh).
        Replayed = "replayed",
        /// A request the proxy's book could not decide for (its storage full, or its lock not
        /// had in time), or a return cookie whose taking it could not remember (the nonce's
        /// bucket full of live places): handled as without kept returns, no place given or
        /// taken and nothing let around the proxy's queue bound.
        Unrecorded = "unrecorded",
        /// A rejected client with a key given no place: no room up to the horizon, or no
        /// room known (no drain rate, and no hint from a fresh estimate: the agent away).
        /// It is told the hint alone.
        Unplaced = "unplaced",
        /// A rejected client given no place because its source (address) has been given its
        /// share of the drain lately (`source_share_percent`), or could not be followed (the
        /// table of sources full): told the hint alone.
        OverShare = "over_share",
        /// A rejected client whose earliest place lay beyond the wait its request allows (a
        /// deadline header, or the proxy's budget): given no place, told the seconds to it
        /// and not to retry (`x-should-retry: false`).
        BeyondDeadline = "beyond_deadline",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back() {
        for rung in Rung::ALL {
            assert_eq!(rung.as_str().parse::<Rung>(), Ok(*rung));
        }
        for reason in FallbackReason::ALL {
            assert_eq!(reason.to_string().parse::<FallbackReason>(), Ok(*reason));
        }
        for source in QueueDepthSource::ALL {
            assert_eq!(source.to_string().parse::<QueueDepthSource>(), Ok(*source));
        }
        let e = "in_flight".parse::<QueueDepthSource>().unwrap_err();
        assert!(e.to_string().contains("\"frontend\""), "{e}");
    }
}
