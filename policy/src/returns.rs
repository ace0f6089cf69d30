//! The returns already promised: clients told to come back, counted per one-second bin.
//!
//! [`PromisedReturns`] is the schedule as the `scheduled_returns` policy reads it, from now
//! on: a plain array, copied into [`Signals`](crate::Signals). [`ReturnBook`] is where a
//! schedule is kept: bins keyed by whole seconds of a clock its owner chooses, lock-free (one
//! atomic per bin) so that a proxy's reject path can read and add to it without waiting, and
//! bounded whatever the rejection rate: [`RETURN_BINS`] bins of one counter each.

use std::{
    fmt,
    sync::atomic::{AtomicU64, Ordering},
};

/// Bins of a schedule: one per second from now to a minute ahead, with room to spare. Every
/// value a rejection can carry (at most 60 s) lands within it.
pub const RETURN_BINS: usize = 64;

/// Clients told to come back, per second from now: bin `i` counts those due in [i, i + 1) s.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PromisedReturns {
    bins: [u32; RETURN_BINS],
}

impl PromisedReturns {
    /// No return promised.
    pub const NONE: Self = Self {
        bins: [0; RETURN_BINS],
    };

    /// From counts per second, bin 0 first; counts past [`RETURN_BINS`] are ignored.
    pub fn from_bins(bins: impl IntoIterator<Item = u32>) -> Self {
        let mut returns = Self::NONE;
        for (slot, count) in returns.bins.iter_mut().zip(bins) {
            *slot = count;
        }
        returns
    }

    /// The counts, bin 0 first.
    pub fn bins(&self) -> &[u32; RETURN_BINS] {
        &self.bins
    }

    /// The counts up to the last non-zero one (nothing if none is promised).
    pub fn trimmed(&self) -> &[u32] {
        let len = self.bins.iter().rposition(|&c| c > 0).map_or(0, |i| i + 1);
        &self.bins[..len]
    }

    /// Returns due in bin `i` (0 past the end).
    pub fn due(&self, i: usize) -> u32 {
        self.bins.get(i).copied().unwrap_or(0)
    }

    /// This schedule `skip` bins later (bin `i` is this one's `i + skip`), bin by bin no less
    /// than `other`: what two views of one schedule both know (the agent's, as pushed a while
    /// ago, and a proxy's own promises, which it may already hold).
    pub fn shifted_max(&self, skip: usize, other: &Self) -> Self {
        let mut out = *other;
        for (i, slot) in out.bins.iter_mut().enumerate() {
            if let Some(&count) = self.bins.get(i + skip) {
                *slot = (*slot).max(count);
            }
        }
        out
    }

    /// Every promised return.
    pub fn total(&self) -> u64 {
        self.bins.iter().map(|&c| u64::from(c)).sum()
    }
}

impl Default for PromisedReturns {
    fn default() -> Self {
        Self::NONE
    }
}

impl fmt::Debug for PromisedReturns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PromisedReturns{:?}", self.trimmed())
    }
}

/// A promise could not be kept in the book: its second is not within [`RETURN_BINS`] of the
/// book's present, or its bin's counter is full. The caller counts it as dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a return promised for second {second} does not fit the schedule")]
pub struct ReturnDropped {
    /// The second it was due.
    pub second: u64,
}

/// A schedule of returns keyed by whole seconds of its owner's clock, bounded and lock-free.
///
/// Each bin holds the second it counts for and its count in one atomic word, so a bin whose
/// second has passed is reused by the first promise that needs it; nothing else ever has to
/// clear it.
#[derive(Debug)]
pub struct ReturnBook {
    bins: [AtomicU64; RETURN_BINS],
}

impl Default for ReturnBook {
    fn default() -> Self {
        Self::new()
    }
}

impl Clone for ReturnBook {
    /// A book with the same bins (each read once; promises added meanwhile may or may not be
    /// in the copy).
    fn clone(&self) -> Self {
        Self {
            bins: std::array::from_fn(|i| AtomicU64::new(self.bins[i].load(Ordering::Relaxed))),
        }
    }
}

impl ReturnBook {
    /// An empty book.
    pub fn new() -> Self {
        Self {
            bins: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// Count `count` returns due at `second`, promised at second `now`.
    ///
    /// # Errors
    /// [`ReturnDropped`] if `second` is before `now` or [`RETURN_BINS`] or more after it, or
    /// the bin's count would pass `u32::MAX`.
    pub fn promise(&self, now: u64, second: u64, count: u32) -> Result<(), ReturnDropped> {
        let dropped = ReturnDropped { second };
        if second < now || second - now >= RETURN_BINS as u64 || second > u64::from(u32::MAX) {
            return Err(dropped);
        }
        let bin = &self.bins[second as usize % RETURN_BINS];
        let mut current = bin.load(Ordering::Relaxed);
        loop {
            let (held, held_count) = unpack(current);
            let base = if held == second { held_count } else { 0 };
            let total = base.checked_add(count).ok_or(dropped)?;
            if held > second && held_count > 0 {
                // A later second already owns the bin: `now` went backwards.
                return Err(dropped);
            }
            match bin.compare_exchange_weak(
                current,
                pack(second, total),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(seen) => current = seen,
            }
        }
    }

    /// Returns due at `second`.
    pub fn due(&self, second: u64) -> u32 {
        let (held, count) =
            unpack(self.bins[second as usize % RETURN_BINS].load(Ordering::Relaxed));
        if held == second { count } else { 0 }
    }

    /// The schedule from second `now` on.
    pub fn ahead(&self, now: u64) -> PromisedReturns {
        let mut returns = PromisedReturns::NONE;
        let start = now as usize % RETURN_BINS;
        for (i, slot) in returns.bins.iter_mut().enumerate() {
            let (held, count) =
                unpack(self.bins[(start + i) % RETURN_BINS].load(Ordering::Relaxed));
            if held == now + i as u64 {
                *slot = count;
            }
        }
        returns
    }

    /// Returns due in the seconds `from..to` (at most the last [`RETURN_BINS`] of them: older
    /// bins may have been reused).
    pub fn due_between(&self, from: u64, to: u64) -> u64 {
        let from = from.max(to.saturating_sub(RETURN_BINS as u64));
        (from..to).map(|s| u64::from(self.due(s))).sum()
    }
}

fn pack(second: u64, count: u32) -> u64 {
    (second << 32) | u64::from(count)
}

fn unpack(word: u64) -> (u64, u32) {
    (word >> 32, word as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn promises_are_counted_per_second_and_read_from_now() {
        let book = ReturnBook::new();
        book.promise(100, 103, 2).unwrap();
        book.promise(100, 103, 1).unwrap();
        book.promise(101, 160, 4).unwrap();
        assert_eq!(book.due(103), 3);
        let ahead = book.ahead(101);
        assert_eq!((ahead.due(2), ahead.due(59), ahead.total()), (3, 4, 7));
        assert_eq!(book.due_between(100, 104), 3);
    }

    #[test]
    fn a_passed_second_frees_its_bin_and_the_book_stays_bounded() {
        let book = ReturnBook::new();
        book.promise(0, 5, 9).unwrap();
        // 64 s later the same bin counts a new second, from zero.
        book.promise(60, 69, 1).unwrap();
        assert_eq!((book.due(5), book.due(69)), (0, 1));
        assert!(book.ahead(69).total() == 1);
    }

    #[test]
    fn what_does_not_fit_is_refused() {
        let book = ReturnBook::new();
        assert_eq!(
            book.promise(10, 9, 1),
            Err(ReturnDropped { second: 9 }),
            "in the past"
        );
        assert!(book.promise(10, 10 + RETURN_BINS as u64, 1).is_err());
        book.promise(10, 11, u32::MAX).unwrap();
        assert!(book.promise(10, 11, 1).is_err(), "a full counter");
        assert_eq!(book.due(11), u32::MAX);
    }

    #[test]
    fn promised_returns_trim_and_merge() {
        let a = PromisedReturns::from_bins([0, 2, 0, 1, 0]);
        let b = PromisedReturns::from_bins([3, 1]);
        assert_eq!(a.trimmed(), &[0, 2, 0, 1]);
        assert_eq!(a.shifted_max(0, &b).trimmed(), &[3, 2, 0, 1]);
        assert_eq!(a.shifted_max(1, &b).trimmed(), &[3, 1, 1]);
        assert_eq!(PromisedReturns::NONE.trimmed(), &[] as &[u32]);
    }
}
