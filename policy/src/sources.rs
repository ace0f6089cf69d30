//! Places per source: how many new places the requests of one source (a client address, as a
//! key) may be given, so that no source reserves more than a share of the fleet's drain, however
//! many keys it mints (a fresh cookie at every rejection, header keys made up).
//!
//! Each source has an allowance that fills at `share` of the drain rate, up to one second's
//! worth (at least one place), and every place given to it spends one. A source that spends
//! faster than its share gets the hint without a place until its allowance fills again:
//! kept in a steady stream at its share of each second, and no more. The allowances live in a
//! fixed table of `max_sources` slots, eight to a bucket as the book's keys are: a
//! source whose allowance is full is as a source never seen, and its slot is free; a source
//! that finds its bucket full of sources still spending is given no place (counted, the
//! `over_share` outcome).

use crate::{BUCKET, TicketKey, tickets::bucket_of};

/// The address a request's source is followed under: the last entry of the source header's
/// value (what the load balancer in front saw, appended to its `X-Forwarded-For`; what a client
/// wrote itself comes before it), trimmed, or else `peer`, the connection's address (without
/// the header, or with an empty last entry: a client cannot leave its share by leaving the
/// header out).
pub fn source_address<'a>(header: Option<&'a [u8]>, peer: &'a [u8]) -> &'a [u8] {
    header
        .and_then(|value| value.rsplit(|&b| b == b',').next())
        .map(<[u8]>::trim_ascii)
        .filter(|last| !last.is_empty())
        .unwrap_or(peer)
}

/// One source's allowance: places it may still be given, as of `at` (seconds on the book's
/// clock).
#[derive(Clone, Copy, Debug, Default)]
struct Allowance {
    source: u64,
    places: f64,
    at: f64,
    used: bool,
}

/// The allowances of the sources seen lately, in fixed memory.
#[derive(Clone, Debug)]
pub struct SourceAllowances {
    /// The share of the drain one source may be given, in percent (1 to 100).
    share_percent: u8,
    slots: Box<[Allowance]>,
}

impl SourceAllowances {
    /// Room for `sources` sources (rounded up to a bucket), each allowed `share_percent` of the
    /// drain.
    pub fn new(share_percent: u8, sources: usize) -> Self {
        let buckets = sources.div_ceil(BUCKET).max(1);
        Self {
            share_percent,
            slots: vec![Allowance::default(); buckets * BUCKET].into_boxed_slice(),
        }
    }

    /// Bytes of memory it holds (fixed at creation).
    pub fn memory_bytes(&self) -> usize {
        size_of::<Self>() + self.slots.len() * size_of::<Allowance>()
    }

    /// Spend one place of `source`'s allowance at time `t` (seconds on the book's clock), the
    /// fleet draining `drain_rate` a second: `false` if it has none left, or if `source` is not
    /// followed and its bucket has no slot free.
    pub fn spend(&mut self, source: TicketKey, t: f64, drain_rate: f64) -> bool {
        let rate = drain_rate * f64::from(self.share_percent) / 100.0;
        let full = rate.max(1.0);
        let refilled = |a: &Allowance| (a.places + (t - a.at).max(0.0) * rate).min(full);
        let bucket = bucket_of(source, self.slots.len());
        let found = bucket
            .clone()
            .find(|&i| self.slots[i].used && self.slots[i].source == source.0);
        let (i, places) = match found {
            Some(i) => (i, refilled(&self.slots[i])),
            None => {
                let free = bucket
                    .clone()
                    .find(|&i| !self.slots[i].used || refilled(&self.slots[i]) >= full);
                match free {
                    Some(i) => (i, full),
                    None => return false,
                }
            }
        };
        let spent = places >= 1.0;
        self.slots[i] = Allowance {
            source: source.0,
            places: if spent { places - 1.0 } else { places },
            at: t,
            used: true,
        };
        spent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ATTACKER: TicketKey = TicketKey(1 << 32);

    #[test]
    fn a_source_is_given_its_share_of_the_drain_and_no_more() {
        // 10% of 40 a second: 4 places a second, up to 4 at once.
        let mut sources = SourceAllowances::new(10, 64);
        let mut given = 0;
        for tick in 0..1000 {
            let t = 100.0 + f64::from(tick) * 0.01;
            given += u32::from(sources.spend(ATTACKER, t, 40.0));
        }
        // 10 s at 4 a second, and the first second's 4 at once.
        assert!((40..=44).contains(&given), "{given}");
    }

    #[test]
    fn at_least_one_place_whatever_the_share() {
        let mut sources = SourceAllowances::new(1, 64);
        assert!(sources.spend(ATTACKER, 0.0, 2.0));
        assert!(!sources.spend(ATTACKER, 0.5, 2.0));
        // 1% of 2 a second: a place every 50 s.
        assert!(sources.spend(ATTACKER, 51.0, 2.0));
    }

    #[test]
    fn a_bucket_of_sources_still_spending_turns_a_ninth_away_and_a_full_allowance_frees_its_slot() {
        let mut sources = SourceAllowances::new(10, 8);
        for s in 0..8u64 {
            assert!(sources.spend(TicketKey(s), 0.0, 10.0));
        }
        assert!(!sources.spend(TicketKey(8), 0.1, 10.0), "no slot free");
        // A second later every allowance is full again: as sources never seen.
        assert!(sources.spend(TicketKey(8), 1.0, 10.0));
    }
}
