//! The HTTP/2 stream table in the kernel: one entry per open (connection, stream), shared by
//! every connection and both directions, and the close notices that hand the streams a
//! connection left open to the agent.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_ns, macros::map, maps::HashMap};
use retry_after_common::{
    ConnState, ProbeStat,
    h2::{CLOSED_ENTRIES, DEFAULT_MAX_STREAMS, Ended, Opened, StreamEntry, StreamKey, StreamTable},
};

use crate::{
    counters,
    maps::{PROBE_STATS, live_counters_of},
};

/// The kernel's error for a key already in a map (`BPF_NOEXIST`).
const EEXIST: i32 = 17;

/// The open streams (`h2::STREAMS_MAP`). Its size is the agent's to set at load time
/// (`agent.http2_max_streams`); a stream that finds it full is counted, not started.
#[map]
static H2_STREAMS: HashMap<StreamKey, StreamEntry> =
    HashMap::with_max_entries(DEFAULT_MAX_STREAMS, 0);

/// The open streams whose body has begun (`h2::BODIES_MAP`), sized as `H2_STREAMS` by the
/// agent. See `retry_after_common::h2`'s stream module, "Bodies", for how its insertions and
/// removals keep the two directions' counts exact.
#[map]
static H2_BODIES: HashMap<StreamKey, u8> = HashMap::with_max_entries(DEFAULT_MAX_STREAMS, 0);

/// Connections that closed with streams open (`h2::CLOSED_MAP`): id to close time. The agent
/// abandons their streams at its next tick and removes the notice.
#[map]
static H2_CLOSED: HashMap<u64, u64> = HashMap::with_max_entries(CLOSED_ENTRIES, 0);

/// Where a connection's stream bookkeeping lives: its id, the entry template its streams are
/// inserted with, and the count of its open streams.
pub(crate) trait StreamOwner {
    /// The connection's id (its socket's cookie).
    fn connection(&self) -> u64;
    /// The entry its streams are inserted with (the open time is set at each).
    fn entry(&mut self) -> &mut StreamEntry;
    /// Its open streams, added to atomically (2^64 - 1 subtracts one).
    fn open_count(&mut self) -> *mut u64;
}

impl StreamOwner for ConnState {
    #[inline(always)]
    fn connection(&self) -> u64 {
        self.h2_connection
    }

    #[inline(always)]
    fn entry(&mut self) -> &mut StreamEntry {
        &mut self.h2_entry
    }

    #[inline(always)]
    fn open_count(&mut self) -> *mut u64 {
        &raw mut self.h2_open
    }
}

/// The streams of one connection, as its segment's walk opens and ends them. One pointer:
/// the walk's loop body, which builds the keys, runs three calls deep, and the verifier holds
/// the three stacks together to 512 bytes.
pub(crate) struct ConnectionStreams<O = ConnState> {
    owner: *mut O,
}

impl<O: StreamOwner> ConnectionStreams<O> {
    /// The streams of the connection `owner` keeps.
    #[inline(always)]
    pub(crate) fn of(owner: &mut O) -> Self {
        Self { owner }
    }

    #[inline(always)]
    fn key(&self, stream: u32) -> StreamKey {
        StreamKey {
            // SAFETY: `owner` points at live state.
            connection: unsafe { (*self.owner).connection() },
            stream,
            pad: 0,
        }
    }
}

impl<O: StreamOwner> StreamTable for ConnectionStreams<O> {
    #[inline(always)]
    fn open(&self, stream: u32) -> Opened {
        // SAFETY: `owner` points at live state.
        let owner = unsafe { &mut *self.owner };
        // SAFETY: the helper takes no argument.
        owner.entry().opened_ns = unsafe { bpf_ktime_get_ns() };
        let inserted = H2_STREAMS.insert(&self.key(stream), owner.entry(), u64::from(BPF_NOEXIST));
        match inserted {
            Ok(()) => {
                // SAFETY: a field of live state.
                unsafe { counters::add(owner.open_count(), 1) };
                Opened::New
            }
            Err(error) if error == -EEXIST => Opened::Known,
            Err(_) => Opened::Full,
        }
    }

    // A function of its own: inlined, its keys took the frame walk's first step (`begin_steps`)
    // past what 6.1 allows the segment programs' chains of calls (512 bytes). The wait goes
    // straight to the stream's counters (atomically, whichever program walks), so that no
    // walk carries it.
    #[inline(never)]
    fn begin_body(&self, stream: u32) -> bool {
        let key = self.key(stream);
        let Some(entry) = H2_STREAMS.get_ptr_mut(&key) else {
            return false;
        };
        // SAFETY: a value of the table, alive while this program runs even if removed (read
        // through its pointer, not copied: a copy took this frame past 32 bytes); its `body` is
        // written by the server's walk alone, which runs on one CPU at a time.
        unsafe {
            if (*entry).body != 0 {
                return false;
            }
            (*entry).body = 1;
        }
        if H2_BODIES.insert(&key, &0, u64::from(BPF_NOEXIST)).is_err() {
            counters::probe_stat(&PROBE_STATS, ProbeStat::Http2BodiesUntracked);
            return false;
        }
        // Ended meanwhile on another CPU: counted begun only if that end took the body's
        // entry (and counted it ended) before this takes it back.
        if H2_STREAMS.get_ptr(&key).is_none() && H2_BODIES.remove(&key).is_ok() {
            return false;
        }
        // SAFETY: as above.
        let (slot, generation, side, opened_ns) = unsafe {
            (
                (*entry).slot,
                (*entry).generation,
                (*entry).side,
                (*entry).opened_ns,
            )
        };
        if let Some(c) = live_counters_of::<false>(slot, generation, side) {
            // SAFETY: the helper takes no argument; `c` is this CPU's copy of a live map value.
            unsafe { c.add_first_byte_wait(bpf_ktime_get_ns().saturating_sub(opened_ns)) };
        }
        true
    }

    #[inline(always)]
    fn end(&self, stream: u32) -> Ended {
        let key = self.key(stream);
        if H2_STREAMS.remove(&key).is_err() {
            return Ended::NotOpen;
        }
        // SAFETY: as in `open`; adding 2^64 - 1 subtracts one.
        unsafe { counters::add((*self.owner).open_count(), u64::MAX) };
        if H2_BODIES.remove(&key).is_ok() {
            Ended::Streaming
        } else {
            Ended::Waiting
        }
    }
}

/// A connection closes: if the table may still hold streams of it, note the close for the
/// agent, which abandons them (counted in the connection's counters) at its next tick. A
/// notice that finds no room is counted; those streams are abandoned when they expire.
#[inline(always)]
pub(crate) fn note_close(conn: &ConnState) {
    // SAFETY: a plain load of a field another CPU may add to; no program of this connection
    // runs after its close.
    let open = unsafe { core::ptr::read_volatile(&raw const conn.h2_open) };
    if conn.h2_connection == 0 || open == 0 {
        return;
    }
    // SAFETY: the helper takes no argument.
    let now = unsafe { bpf_ktime_get_ns() };
    if H2_CLOSED.insert(&conn.h2_connection, &now, 0).is_err() {
        counters::probe_stat(&PROBE_STATS, ProbeStat::Http2ClosesUnnoted);
    }
}
