//! One CPU at a time walks the HTTP/2 frames a vantage point receives.
//!
//! The ingress program runs before TCP takes the socket's lock, and the segments of one
//! direction can be received on two CPUs at once (a sender that writes from a system call on
//! one CPU and from its ACK processing on another queues them on both). Two walks of the same
//! byte stream at once would each read the other's half-written place. So the walk, its hole
//! and the connection's parked places belong to the CPU whose entry is in `H2_WALKERS` under
//! the connection's id; another waits for it, as it would wait for the socket's own lock a
//! moment later, and a segment it then finds ahead of the walk is parked as any other. The
//! CPU that holds it walks what is parked through the chain of tail calls that follows its
//! segment, and the last program of the chain gives it back.
//!
//! The entry is taken by inserting it where none is (`BPF_NOEXIST`), which the map's own lock
//! makes an exchange on every kernel: atomic exchange (5.12) is not needed, and the verifier
//! checks a wait of a fixed number of looks at little cost.

use aya_ebpf::{
    bindings::BPF_NOEXIST, helpers::bpf_get_smp_processor_id, macros::map, maps::HashMap,
};
use retry_after_common::ProbeStat;

use crate::{counters, maps::PROBE_STATS};

/// Connections being walked: the connection's id (its socket's cookie) → the walking CPU + 1.
/// At most one entry per CPU at a time; a close removes its connection's.
#[map]
static H2_WALKERS: HashMap<u64, u64> = HashMap::with_max_entries(WALKERS, 0);

/// Entries of `H2_WALKERS`: far more than CPUs walk at once.
const WALKERS: u32 = 4096;

/// Tries to take the walk in one call of [`ra_h2_take_walk`]. Each is a step the verifier
/// checks, with one branch it keeps for later: 4,000 stay below its limit of 8,192 such
/// branches.
const TRIES: u32 = 4000;

/// Calls of [`ra_h2_take_walk`] before a segment is walked without the walk (counted in
/// `http2_walks_contended`): 256,000 tries, far longer than the walk of any segment takes.
/// (A wait in a `bpf_loop` would do as well where there is one, but 6.18's verifier then walks
/// the segment program past its million instructions.)
const ROUNDS: u32 = 64;

/// Take the walk of `connection` (its socket cookie) for this CPU, waiting while another CPU
/// holds it; if the wait runs out, the segment is walked all the same, and counted. Give it
/// back with [`give_back`]. A function of its own: what follows it is then checked once, not
/// once for each round the wait can end in.
#[inline(never)]
pub(crate) fn take(connection: u64) {
    let mut round = 0;
    while round < ROUNDS {
        if ra_h2_take_walk(connection) != 0 {
            return;
        }
        round += 1;
    }
    counters::probe_stat(&PROBE_STATS, ProbeStat::Http2WalksContended);
}

/// Up to [`TRIES`] tries to take the walk of `connection` for this CPU: 1 if taken. A global
/// function, which the verifier checks once, apart from the program that calls it.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ra_h2_take_walk(connection: u64) -> i32 {
    let me = this_cpu();
    let mut i = 0;
    while i < TRIES {
        if H2_WALKERS
            .insert(&connection, &me, u64::from(BPF_NOEXIST))
            .is_ok()
        {
            return 1;
        }
        i += 1;
    }
    0
}

/// Give back the walk of `connection` if this CPU holds it; if another holds it (this CPU's
/// wait ran out), it stays theirs.
#[inline(always)]
pub(crate) fn give_back(connection: u64) {
    // SAFETY: the value is only compared.
    if unsafe { H2_WALKERS.get(&connection) }.copied() == Some(this_cpu()) {
        let _ = H2_WALKERS.remove(&connection);
    }
}

/// Drop the walker entry of `connection`, which closed (whoever held it).
#[inline(always)]
pub(crate) fn forget(connection: u64) {
    let _ = H2_WALKERS.remove(&connection);
}

/// This CPU's mark: its number + 1.
#[inline(always)]
fn this_cpu() -> u64 {
    // SAFETY: the helper takes no argument.
    u64::from(unsafe { bpf_get_smp_processor_id() }) + 1
}
