//! The turn's word of what a vantage point receives, stored by exchange.
//!
//! The ingress program runs before TCP takes the socket's lock, and the segments of one
//! direction can be received on two CPUs at once (a client's ACK sent from its softirq on
//! one CPU and its next request from its system call on another). Each would read the
//! direction's word of the turn and write it back whole, and the later write would undo the
//! earlier one: a pure ACK that ends a turn written over the request that began the next one
//! leaves the turn idle, and that request's response uncounted. So the ingress program moves
//! a copy of the turn and stores the word only if it is still what the copy read (compare and
//! exchange, 5.12); if another CPU stored it meanwhile, the segment is moved again from what
//! that CPU stored. The build for kernels without `bpf_loop` (before 5.17; the exchange came
//! in 5.12) stores the word as before, and keeps the race.
//!
//! Each try is a call of a global function, [`ra_client_turn`] or [`ra_server_turn`], which the
//! verifier checks once, apart from the program (the tries inlined took `ra_ingress` past a
//! million instructions, and a loop of tries inside one function took 6.1's check of it there).
//! They take integers only (the segment's numbers), and count what the move did themselves:
//! the program then has no counts to follow past the call.

use core::{arch::asm, ptr::read_volatile};

use aya_ebpf::bindings::__sk_buff;
use retry_after_common::{
    ProbeStat,
    http1::Framed,
    tls::Sender,
    turn::{ResponseStart, Turn, TurnDelta},
};

use crate::{
    counters::{self, time_first_byte},
    maps::{PROBE_STATS, live_counters, tracked},
};

/// Tries of one segment's move before its word is stored whatever another CPU stored (counted
/// in `turns_contended`): two CPUs receive one connection's segments at once only for moments.
const TRIES: u64 = 4;

/// Move the turn by a received segment through `attempt` (one of the global functions below,
/// given 1 for the last try): tried until it stores its word, at most [`TRIES`] times.
#[inline(always)]
pub(crate) fn received_by_exchange(attempt: impl Fn(u64) -> u64) {
    let mut tries = 1;
    while attempt(u64::from(tries == TRIES)) == 0 && tries < TRIES {
        tries += 1;
    }
}

/// One try at moving the turn by a client segment received: `at` its sequence number (low
/// half) and payload length (high); `ack` its acknowledgement number (low half), bit 32 set if
/// it carries one; `head` 1 if its request is a `HEAD`; `last` 1 on the last try (the word is
/// then stored whatever). 1 if the move was stored and counted (or the socket's connection is
/// not tracked), 0 if another CPU stored the word first.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ra_client_turn(
    skb: *mut __sk_buff,
    at: u64,
    ack: u64,
    head: u64,
    last: u64,
) -> u64 {
    let ack = (ack >> 32 != 0).then_some(ack as u32);
    received(skb, (Sender::Client, last != 0), |turn| {
        turn.on_client_segment(at as u32, (at >> 32) as u32, ack, head != 0)
    })
}

/// One try at moving the turn by a server segment received: `at`, `last` and the result as
/// [`ra_client_turn`]'s; `start` its [`ResponseStart`] number, plus 256 if it carried PSH;
/// `framed` what its framing walk found ([`Framed::to_bits`]).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ra_server_turn(
    skb: *mut __sk_buff,
    at: u64,
    start: u64,
    framed: u64,
    last: u64,
) -> u64 {
    let push = start & 256 != 0;
    let start = ResponseStart::from_u8(start as u8);
    let framed = Framed::from_bits(framed as u8);
    received(skb, (Sender::Server, last != 0), |turn| {
        turn.on_server_segment(at as u32, (at >> 32) as u32, push, (start, framed))
    })
}

/// Move the turn of `skb`'s connection by a segment `sender` sent, as `step` does, storing its
/// word by exchange (whatever, if `last`), and count what the move did: 1, or 0 if another CPU
/// stored the word first.
#[inline(always)]
fn received(
    skb: *mut __sk_buff,
    (sender, last): (Sender, bool),
    step: impl Fn(&mut Turn) -> TurnDelta,
) -> u64 {
    // SAFETY: the context's socket field, a plain load.
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return 1;
    }
    let Some(conn) = tracked(sk) else {
        return 1;
    };
    // SAFETY: the socket's live state.
    let Some(c) = live_counters::<true>(unsafe { &*conn }) else {
        return 1;
    };
    // SAFETY: the socket's live state; aligned reads of its own words, each once, whole.
    let (word, mut copy) = unsafe {
        let turn = &raw mut (*conn).turn;
        let word = match sender {
            Sender::Client => &raw mut (*turn).client,
            Sender::Server => &raw mut (*turn).server,
        };
        let copy = Turn {
            client: read_volatile(&raw const (*turn).client),
            server: read_volatile(&raw const (*turn).server),
        };
        (word, copy)
    };
    let read = word_of(&copy, sender);
    let delta = step(&mut copy);
    let written = word_of(&copy, sender);
    // SAFETY: `word` is an aligned word of the live state.
    if written != read && !unsafe { exchanged(word, read, written) } {
        if !last {
            return 0;
        }
        counters::probe_stat(&PROBE_STATS, ProbeStat::TurnsContended);
        // SAFETY: as above: the move from what this try read, stored over what came since.
        unsafe { word.write_volatile(written) };
    }
    // SAFETY: as above.
    time_first_byte(unsafe { &mut *conn }, c, &delta);
    // SAFETY: `c` is this CPU's ingress copy of a live map value.
    unsafe { c.apply(&delta) };
    1
}

/// The word of `turn` that `sender`'s segments write.
#[inline(always)]
fn word_of(turn: &Turn, sender: Sender) -> u64 {
    match sender {
        Sender::Client => turn.client,
        Sender::Server => turn.server,
    }
}

/// Store `new` at `word` if it holds `old`: true if it did. The BPF compare-and-exchange
/// instruction (5.12), written out: the compiler's own atomic exchange does not reach the
/// linker whole.
///
/// # Safety
/// `word` must point at an aligned word of a live map value.
#[inline(always)]
unsafe fn exchanged(word: *mut u64, old: u64, new: u64) -> bool {
    let mut found = old;
    // SAFETY: guaranteed by the caller; the instruction reads and writes `word` only.
    unsafe {
        asm!(
            "r0 = cmpxchg_64({word} + 0, r0, {new})",
            word = in(reg) word,
            new = in(reg) new,
            inout("r0") found,
        );
    }
    found == old
}
