//! One CPU at a time walks the HTTP/2 frames a vantage point receives.
//!
//! The ingress program runs before TCP takes the socket's lock, and the segments of one
//! direction can be received on two CPUs at once (a sender that writes from a system call on
//! one CPU and from its ACK processing on another queues them on both). Two walks of the same
//! byte stream at once would each read the other's half-written place. So the walk, its hole
//! and the connection's parked places belong to the CPU that holds `ConnState::h2_walker`;
//! another waits for it, as it would wait for the socket's own lock a moment later, and a
//! segment it then finds ahead of the walk is parked as any other. The CPU that holds it
//! walks what is parked through the chain of tail calls that follows its segment, and the
//! last program of the chain gives it back.

use core::{
    intrinsics::{AtomicOrdering, atomic_cxchg},
    ptr::read_volatile,
};

use aya_ebpf::helpers::bpf_get_smp_processor_id;
use retry_after_common::{ConnState, ProbeStat, h2::FrameOps};

use crate::{
    counters::{self, KernelFrameOps},
    maps::PROBE_STATS,
};

/// Looks at the walker word before a segment is walked without the walk (counted in
/// `http2_walks_contended`): far more than the longest walk takes (a segment of 64 KiB of
/// empty frames), so only a holder that never gives it back (which a program that always
/// runs to its end cannot be) makes a CPU give up.
const TRIES: u32 = 1 << 20;

/// Take the walk of `conn`'s received bytes for this CPU, waiting while another CPU holds it;
/// if the wait runs out, the segment is walked all the same, and counted. Give it back with
/// [`give_back`]. Nothing after it depends on whether it was taken: the verifier then checks
/// the walk once, not once for each. A function of its own: its loop's state is then on a
/// stack frame of its own, not added to the segment program's on the way to the frame walk
/// (Debian 12's 6.1 counts 512 bytes for a program's calls together, and refuses more).
#[inline(never)]
pub(crate) fn take(conn: &mut ConnState) {
    let word = &raw mut conn.h2_walker;
    let me = this_cpu();
    KernelFrameOps::repeat(TRIES, || {
        // Read before the exchange, so a waiting CPU does not keep taking the line away
        // from the walking one.
        // SAFETY: `word` points into the socket's live, 8-byte aligned state.
        !(unsafe { read_volatile(word) } == 0 && unsafe { exchange(word, 0, me) })
    });
    // SAFETY: as above.
    if unsafe { read_volatile(word) } != me {
        counters::probe_stat(&PROBE_STATS, ProbeStat::Http2WalksContended);
    }
}

/// Give back the walk of `conn` if this CPU holds it, so that what this CPU wrote is seen
/// whole by the next walker (an exchange orders every write before it); if another holds it
/// (this CPU's wait ran out), it stays theirs.
#[inline(always)]
pub(crate) fn give_back(conn: &mut ConnState) {
    // SAFETY: the socket's live, 8-byte aligned state.
    unsafe { exchange(&raw mut conn.h2_walker, this_cpu(), 0) };
}

/// Put `new` in `*word` if it holds `old`: true if it did.
///
/// # Safety
/// `word` must point into a live, 8-byte aligned map value.
#[inline(always)]
pub(crate) unsafe fn exchange(word: *mut u64, old: u64, new: u64) -> bool {
    // SAFETY: guaranteed by the caller.
    let (held, _) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(word, old, new)
    };
    held == old
}

/// This CPU's mark in the walker word: its number + 1 (0 is nobody).
#[inline(always)]
fn this_cpu() -> u64 {
    // SAFETY: the helper takes no argument.
    u64::from(unsafe { bpf_get_smp_processor_id() }) + 1
}
