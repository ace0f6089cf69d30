//! The stream window: which client streams of an HTTP/2 connection are open, as the frame walk
//! ([`super::FrameStream`]) opens and ends them.
//!
//! The last [`STREAM_WINDOW`] client streams are tracked by index, one bit each. A stream still
//! open when that many newer ones have started (a long-lived stream beside many short ones,
//! streams answered late) leaves the window: its index is no longer known, but it is still
//! counted in flight, in [`Streams::beyond`], and the next end sent for a stream below the
//! window completes one of those. Such a stream is forgotten (counted abandoned, its end no
//! longer counted) when its end has not come 1 to 2 [`EPOCH`]s of streams later, or when 64
//! are beyond the window at once; the close abandons what is left.
//!
//! The walk sees four operations: a client's HEADERS opens a stream ([`Streams::open`]), an end
//! or a reset closes one ([`Streams::close`]), a GOAWAY closes every one above its last stream
//! ([`Streams::close_from`]), and the connection's close abandons the rest
//! ([`Streams::on_close`]). Both directions change the bits, atomically ([`FrameOps`]).

use core::ptr::{read_volatile, write_volatile};

use super::FrameOps;
use crate::turn::TurnDelta;

/// Client streams tracked per connection: the most recent this many.
pub const STREAM_WINDOW: u32 = 128;
/// Stream indices per epoch: a stream counted beyond the window whose end has not come when
/// `next_index` has moved into the epoch after next (1 to 2 epochs later) is forgotten.
pub const EPOCH: u32 = 1024;

/// The open client streams of a connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Streams {
    /// Bit `i % 128` (word `i % 128 / 64`) is set while client stream index `i` (stream id
    /// `2i + 1`) is open. Changed by both directions, atomically.
    pub open: [u64; 2],
    /// Streams still open when pushed out of the window, one bit each (up to 64 a word),
    /// in word `epoch % 2` of the epoch ([`EPOCH`] stream indices) `next_index` was in: each
    /// end (or cancel) of a stream below the window takes one; a word left from two epochs
    /// back is given up. Set by client segments, cleared by either direction, atomically.
    pub beyond: [u64; 2],
    /// One past the highest client stream index started; 0 before the first. Written by
    /// client segments only.
    pub next_index: u32,
    /// Always zero (explicit padding).
    pub pad: u32,
}

impl Streams {
    /// No stream started yet.
    pub const NEW: Self = Self {
        open: [0; 2],
        beyond: [0; 2],
        next_index: 0,
        pad: 0,
    };

    /// One past the highest client stream index started, as client segments last wrote it.
    #[inline(always)]
    fn next(&self) -> u32 {
        // SAFETY: an aligned read of this value's own field (written by client segments).
        unsafe { read_volatile(&raw const self.next_index) }
    }

    /// A client HEADERS frame on stream `index`: a new stream if above every one started
    /// (counted in `delta`). The open streams it pushes out of the window are counted beyond
    /// it, and those it cannot keep there forgotten (counted in `forgotten`, and abandoned).
    #[inline(always)]
    pub(super) fn open<A: FrameOps>(
        &mut self,
        index: u32,
        delta: &mut TurnDelta,
        forgotten: &mut u16,
    ) {
        let next = self.next();
        if index < next {
            return;
        }
        let new_next = index + 1;
        // SAFETY: an aligned write of this value's own field; client segments are its only
        // writer. Written before the bits change, so a close of a stream pushed out reads it
        // out of the window.
        unsafe { write_volatile(&raw mut self.next_index, new_next) };
        let leaving = (
            next.saturating_sub(STREAM_WINDOW),
            new_next.saturating_sub(STREAM_WINDOW),
        );
        let epoch = new_next / EPOCH;
        if epoch != next / EPOCH {
            let given_up = self.give_up_beyond::<A>(epoch, epoch - next / EPOCH);
            *forgotten += given_up;
            delta.abandoned += given_up;
        }
        if leaving.1 > leaving.0 {
            let gone = self.clear::<A>(window_mask(leaving.0, leaving.1));
            // One stream leaves at a time while ids follow one another; past a jump in ids,
            // the others leaving with it are forgotten at once.
            let lost = if gone > 0 {
                gone - self.count_beyond::<A>(epoch)
            } else {
                0
            };
            *forgotten += lost;
            delta.abandoned += lost;
        }
        let (word, bit) = slot_of(index);
        // SAFETY: `word` is an index into this value's own array.
        unsafe { A::set(&raw mut self.open[word], bit) };
        delta.started += 1;
    }

    /// Stream `index` ends: true if it was open (then it is no longer). Below the window, it
    /// takes one of the streams counted beyond it, if any: the streams there are not known
    /// by index, and a stream's first end is the one its peer sends once (a second end of a
    /// stream, a reset after END_STREAM, comes at once, within the window).
    #[inline(always)]
    pub(super) fn close<A: FrameOps>(&mut self, index: u32) -> bool {
        let next = self.next();
        if index >= next {
            return false;
        }
        if index < next.saturating_sub(STREAM_WINDOW) {
            return self.take_beyond::<A>();
        }
        let (word, bit) = slot_of(index);
        // SAFETY: `word` is an index into this value's own array.
        unsafe { A::fetch_clear(&raw mut self.open[word], bit) & bit != 0 }
    }

    /// Count one stream beyond the window in `epoch`'s word (64 there at most): 1 if it was,
    /// 0 if the word is full. Client segments only: the bit set is clear, and only this
    /// direction sets bits, so reading the free ones first is safe.
    #[inline(always)]
    fn count_beyond<A: FrameOps>(&mut self, epoch: u32) -> u16 {
        let word = (epoch % 2) as usize;
        // SAFETY: an aligned read, and an atomic set, of this value's own field.
        unsafe {
            let free = !read_volatile(&raw const self.beyond[word]);
            // No bit at all when the word is full.
            A::set(&raw mut self.beyond[word], free.isolate_lowest_one());
            ((free | free.wrapping_neg()) >> 63) as u16
        }
    }

    /// `next_index` moved `steps` epochs on, into `epoch`: the streams counted beyond the
    /// window two epochs back (both words, past a jump) are given up; how many.
    #[inline(always)]
    fn give_up_beyond<A: FrameOps>(&mut self, epoch: u32, steps: u32) -> u16 {
        let word = (epoch % 2) as usize;
        // SAFETY: atomic clears of this value's own fields.
        let (stale, other) = unsafe {
            (
                A::fetch_clear(&raw mut self.beyond[word], u64::MAX),
                if steps > 1 {
                    A::fetch_clear(&raw mut self.beyond[1 - word], u64::MAX)
                } else {
                    0
                },
            )
        };
        (stale.count_ones() + other.count_ones()) as u16
    }

    /// Take one of the streams counted beyond the window, the older epoch's first: false if
    /// there is none (or another end took the one found first).
    #[inline(always)]
    fn take_beyond<A: FrameOps>(&mut self) -> bool {
        let older = ((self.next() / EPOCH + 1) % 2) as usize;
        for word in [older, 1 - older] {
            // SAFETY: an aligned read, and an atomic clear, of this value's own field.
            unsafe {
                let held = read_volatile(&raw const self.beyond[word]);
                let bit = held.isolate_lowest_one();
                if held != 0 && A::fetch_clear(&raw mut self.beyond[word], bit) & bit != 0 {
                    return true;
                }
            }
        }
        false
    }

    /// End every open stream of index `first` or above; how many there were.
    #[inline(always)]
    pub(super) fn close_from<A: FrameOps>(&mut self, first: u32) -> u16 {
        let next = self.next();
        let first = first.max(next.saturating_sub(STREAM_WINDOW));
        if first >= next {
            return 0;
        }
        self.clear::<A>(window_mask(first, next))
    }

    /// Clear the bits of `mask`; how many were set.
    #[inline(always)]
    fn clear<A: FrameOps>(&mut self, mask: [u64; 2]) -> u16 {
        // SAFETY: indices into this value's own array.
        let (a, b) = unsafe {
            (
                A::fetch_clear(&raw mut self.open[0], mask[0]),
                A::fetch_clear(&raw mut self.open[1], mask[1]),
            )
        };
        ((a & mask[0]).count_ones() + (b & mask[1]).count_ones()) as u16
    }

    /// The connection closed: its open streams are abandoned, those beyond the window too.
    #[inline(always)]
    pub fn on_close<A: FrameOps>(&mut self) -> TurnDelta {
        // SAFETY: atomic clears of this value's own fields.
        let beyond = unsafe {
            A::fetch_clear(&raw mut self.beyond[0], u64::MAX).count_ones()
                + A::fetch_clear(&raw mut self.beyond[1], u64::MAX).count_ones()
        };
        let abandoned = self.close_from::<A>(0) + beyond as u16;
        TurnDelta {
            abandoned,
            ..TurnDelta::default()
        }
    }
}

/// The word and bit of stream index `index`.
#[inline(always)]
const fn slot_of(index: u32) -> (usize, u64) {
    let slot = index % STREAM_WINDOW;
    ((slot / 64) as usize, 1 << (slot % 64))
}

/// The bits of stream indices `first..end` (at most a window of them).
#[inline(always)]
const fn window_mask(first: u32, end: u32) -> [u64; 2] {
    let n = if end - first < STREAM_WINDOW {
        end - first
    } else {
        STREAM_WINDOW
    };
    let start = first % STREAM_WINDOW;
    let stop = start + n;
    let direct = bit_range(
        start,
        if stop < STREAM_WINDOW {
            stop
        } else {
            STREAM_WINDOW
        },
    );
    if stop <= STREAM_WINDOW {
        return direct;
    }
    let wrapped = bit_range(0, stop - STREAM_WINDOW);
    [direct[0] | wrapped[0], direct[1] | wrapped[1]]
}

/// Bits `from..to` of a 128-bit pair (`from <= to <= 128`).
#[inline(always)]
const fn bit_range(from: u32, to: u32) -> [u64; 2] {
    let low = if from < 64 {
        ones((if to < 64 { to } else { 64 }) - from) << from
    } else {
        0
    };
    let (from_high, to_high) = (from.saturating_sub(64), to.saturating_sub(64));
    let high = if to_high > from_high {
        ones(to_high - from_high) << from_high
    } else {
        0
    };
    [low, high]
}

/// The low `n` bits set (`n <= 64`).
#[inline(always)]
const fn ones(n: u32) -> u64 {
    if n >= 64 { u64::MAX } else { (1 << n) - 1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_masks_cover_exactly_their_indices() {
        for first in [0u32, 1, 63, 64, 100, 127, 128, 300] {
            for n in [0u32, 1, 2, 63, 64, 65, 127, 128] {
                let mask = window_mask(first, first + n);
                let count = mask[0].count_ones() + mask[1].count_ones();
                assert_eq!(count, n, "first {first} n {n}");
                for i in first..first + n {
                    let (word, bit) = slot_of(i);
                    assert!(mask[word] & bit != 0, "first {first} n {n} i {i}");
                }
            }
        }
    }
}
