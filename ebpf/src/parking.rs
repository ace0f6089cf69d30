//! Segments of HTTP/2 connections that arrive ahead of a gap (reordered on the way, or after
//! a loss), parked whole until the gap fills and then walked in their place, so that the
//! frame walk sees each direction's bytes in order.
//!
//! Only the ingress program parks: what a vantage point sends passes its programs in order.
//! It never nests with itself on one CPU, so one scratch buffer per CPU is enough to copy a
//! segment in before the map takes it.

use core::ffi::c_void;

use core::ptr::null_mut;

use aya_ebpf::{
    EbpfContext,
    bindings::{__sk_buff, BPF_SK_STORAGE_GET_F_CREATE},
    btf_maps::SkStorage,
    helpers::{bpf_get_smp_processor_id, bpf_ktime_get_ns, bpf_sk_storage_get, bpf_skb_load_bytes},
    macros::{btf_map, map},
    maps::{Array, HashMap, ProgramArray},
    programs::SkBuffContext,
};
use retry_after_common::{
    ConnState, Payload, ProbeStat,
    h2::{PARKED_BYTES, PARKED_PER_CONNECTION, ParkKey, Parked, ParkedBytes, ParkedPlaces},
    seq_after,
    tls::Sender,
};

use crate::{counters, maps::PROBE_STATS, packet::Segment};

/// Segments parked on the whole node at most (the map allocates each as it is parked).
const PARKED_SEGMENTS: u32 = 128;
/// CPUs the scratch buffers cover where the agent does not size them (it sizes them to the
/// possible CPUs).
const SCRATCH_CPUS: u32 = 64;

/// The parked segments (`H2_PARKED`).
#[map]
static H2_PARKED: HashMap<ParkKey, ParkedBytes> = HashMap::with_max_entries(PARKED_SEGMENTS, 0);

/// One buffer per CPU a segment is copied into before the map takes it (`H2_PARK_SCRATCH`).
#[map]
static H2_PARK_SCRATCH: Array<ParkedBytes> = Array::with_max_entries(SCRATCH_CPUS, 0);

/// Where each connection's parked segments are, in its socket's storage (made at its first
/// parked segment, freed by the kernel with the socket).
#[btf_map]
static H2_PARKED_PLACES: SkStorage<ParkedPlaces> = SkStorage::new();

/// The places of the connection of socket `sk`, made if `create` and there are none yet.
#[inline(always)]
pub(crate) fn places<S>(sk: *mut S, create: bool) -> Option<&'static mut ParkedPlaces> {
    let map = core::ptr::from_ref(&H2_PARKED_PLACES).cast_mut().cast();
    let flags = if create {
        u64::from(BPF_SK_STORAGE_GET_F_CREATE)
    } else {
        0
    };
    // SAFETY: the helper checks the socket; with the flag it makes a zeroed value (every
    // place free).
    let places = unsafe { bpf_sk_storage_get(map, sk.cast(), null_mut(), flags) };
    // SAFETY: a live value of the map's type, or null.
    unsafe { places.cast::<ParkedPlaces>().as_mut() }
}

/// The program that walks parked segments (`H2_PARKED_WALK`, index 0: `ra_ingress_parked`),
/// set by the agent once it is loaded.
#[map]
static H2_PARKED_WALK: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// Hand the segment's socket to the program that walks parked segments (this program ends
/// here); nothing happens if it is not set.
#[inline(always)]
pub(crate) fn walk_parked_next(ctx: &SkBuffContext) {
    // SAFETY: a tail call with the program's own context.
    unsafe { H2_PARKED_WALK.tail_call(ctx, 0) };
}

/// True if the connection of socket `sk` has a parked segment.
#[inline(always)]
pub(crate) fn any_parked<S>(sk: *mut S) -> bool {
    places(sk, false).is_some_and(|p| p.places.iter().any(|place| place.len != 0))
}

/// Park `segment` of `conn` (its payload at `segment.payload_offset`) if it arrived ahead of
/// the walk's place and there is room: true if it is parked (and must not be walked now).
#[inline(always)]
pub(crate) fn park<S>(
    ctx: &SkBuffContext,
    sk: *mut S,
    conn: &ConnState,
    segment: &Segment,
    sender: Sender,
) -> bool {
    let (seq, len) = (segment.seq, segment.payload_len);
    if len == 0 || !conn.frames(sender).is_ahead(seq) {
        return false;
    }
    let parked = len <= PARKED_BYTES
        && places(sk, true).is_some_and(|places| park_copy(ctx, conn, places, segment));
    if !parked {
        counters::probe_stat(&PROBE_STATS, ProbeStat::Http2SegmentsNotParked);
    }
    parked
}

/// Copy `segment` of `conn` into the parking map, in a free place of the connection's
/// `places`: false if there is none, or the map has no room. A segment within bytes parked
/// already (a duplicate, a retransmission) is parked already; a longer one from the same
/// first byte replaces them.
/// A segment that continues a parked one (a window's segments behind one lost) is added to
/// its bytes while they stay within `APPENDED_BYTES`: a place holds a run of them.
#[inline(always)]
fn park_copy(
    ctx: &SkBuffContext,
    conn: &ConnState,
    places: &mut ParkedPlaces,
    segment: &Segment,
) -> bool {
    let (seq, len) = (segment.seq, segment.payload_len);
    let key = key(conn.h2_connection, seq);
    // The place to fill: the one of the same segment, else the first free one.
    let mut place = PARKED_PER_CONNECTION;
    for (i, parked) in places.places.iter_mut().enumerate() {
        let end = parked.seq.wrapping_add(parked.len);
        // Within a run parked already (a duplicate, or a retransmission): parked.
        if parked.len != 0 && !seq_after(parked.seq, seq) && !seq_after(seq.wrapping_add(len), end)
        {
            return true;
        }
        if parked.len != 0 && parked.seq == seq {
            place = i;
            break;
        }
        if parked.len == 0 && place == PARKED_PER_CONNECTION {
            place = i;
        }
        if parked.len != 0
            && end == seq
            && ra_h2_append(
                ctx.as_ptr().cast(),
                conn.h2_connection,
                u64::from(parked.seq) << 32 | u64::from(parked.len),
                u64::from(segment.payload_offset) << 32 | u64::from(len),
            ) != 0
        {
            parked.len += len;
            return true;
        }
    }
    let Some(place) = places.places.get_mut(place) else {
        return false;
    };
    if !copy_in(ctx, &key, segment) {
        return false;
    }
    *place = Parked { seq, len };
    true
}

/// Bytes a run of appended segments stops growing at: its length is masked below it, and a
/// segment of up to `APPENDED_SEGMENT` bytes copied there stays within the parked bytes.
const APPENDED_BYTES: u32 = PARKED_BYTES / 2;
/// The largest segment appended to a run (an MSS of 1,448 and more; larger ones, as GRO
/// makes, take a place of their own).
const APPENDED_SEGMENT: u32 = 2_048;

/// Add the segment of `skb` at `segment` (its payload's offset in the high word, its length
/// in the low), which begins where the run of connection `connection` parked at `run` (its
/// first byte's sequence number, its length) ends, to the run's bytes: 1 if added, 0 if it
/// does not fit (the run at `APPENDED_BYTES`, the segment over `APPENDED_SEGMENT`) or cannot
/// be read. A global function, which the verifier checks once, apart from the loop over the
/// places that calls it; the caller adds the length to the run's place.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ra_h2_append(
    skb: *mut __sk_buff,
    connection: u64,
    run: u64,
    segment: u64,
) -> i32 {
    let (run_seq, run_len) = ((run >> 32) as u32, run as u32);
    let (offset, len) = ((segment >> 32) as u32, segment as u32);
    if run_len >= APPENDED_BYTES || len == 0 || len > APPENDED_SEGMENT {
        return 0;
    }
    let Some(bytes) = H2_PARKED.get_ptr_mut(&key(connection, run_seq)) else {
        return 0;
    };
    // Both masks change nothing (checked above) but what the verifier knows: the copy ends
    // within the parked bytes.
    let at = core::hint::black_box(run_len) & (APPENDED_BYTES - 1);
    let n = ((core::hint::black_box(len) - 1) & (APPENDED_SEGMENT - 1)) + 1;
    // SAFETY: `skb` is the calling program's context; `bytes` is a live map value of
    // `PARKED_BYTES + 16` bytes, and `at + n` is within it; the entry is this connection's,
    // changed only under its walk.
    let copied = unsafe {
        bpf_skb_load_bytes(
            skb.cast(),
            offset,
            (&raw mut (*bytes).bytes)
                .cast::<u8>()
                .add(at as usize)
                .cast::<c_void>(),
            n,
        )
    };
    if copied < 0 {
        return 0;
    }
    // SAFETY: as above.
    unsafe { (*bytes).len = run_len + len };
    1
}

/// Park the first flight `segment` (the HTTP/2 preface and what came with it, which reached
/// the listener with the handshake) under `id`, the first flight's own (see
/// `HandshakePeer::first_flight_id`): the connection established next walks it there. False
/// if it cannot be (over 64 KiB, or the map full).
#[inline(always)]
pub(crate) fn park_first_flight(ctx: &SkBuffContext, segment: &Segment, id: u64) -> bool {
    segment.payload_len <= PARKED_BYTES && copy_in(ctx, &key(id, segment.seq), segment)
}

/// Copy the payload of `segment` (1 to `PARKED_BYTES` bytes) into the parking map at `key`,
/// through this CPU's scratch buffer: false if it cannot be read or the map has no room.
#[inline(always)]
fn copy_in(ctx: &SkBuffContext, key: &ParkKey, segment: &Segment) -> bool {
    let len = segment.payload_len;
    // SAFETY: the helper takes no argument.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    let Some(scratch) = H2_PARK_SCRATCH.get_ptr_mut(cpu) else {
        return false;
    };
    // `len` is 1 to `PARKED_BYTES` already: the arithmetic, hidden from the optimizer, hands the
    // verifier a length it can see is within the buffer and not zero.
    let n = ((core::hint::black_box(len) - 1) & (PARKED_BYTES - 1)) + 1;
    // SAFETY: `scratch` is this CPU's buffer of over `PARKED_BYTES`, and `n` is at most that.
    let copied = unsafe {
        bpf_skb_load_bytes(
            ctx.as_ptr(),
            segment.payload_offset,
            (&raw mut (*scratch).bytes).cast::<c_void>(),
            n,
        )
    };
    // SAFETY: `scratch` points at this CPU's live map value; the helper takes no argument.
    unsafe {
        (*scratch).len = len;
        (*scratch).parked_ns = bpf_ktime_get_ns();
    }
    // SAFETY: as above.
    copied >= 0 && H2_PARKED.insert(key, unsafe { &*scratch }, 0).is_ok()
}

/// The parked segment of connection `connection` (its `places`) that holds byte `at`, as a
/// payload to walk with its sequence number and length, taken out of its place (its map
/// entry stays until [`release`]); places wholly before `at` (walked since, as a
/// retransmission) are freed on the way.
#[inline(always)]
pub(crate) fn take(
    connection: u64,
    places: &mut ParkedPlaces,
    at: u32,
) -> Option<(Parked, ParkedPayload)> {
    let mut found = None;
    for place in places.places.iter_mut() {
        if place.len == 0 {
            continue;
        }
        let end = place.seq.wrapping_add(place.len);
        if !seq_after(end, at) {
            release_key(connection, place.seq);
            *place = Parked::default();
        } else if found.is_none() && !seq_after(place.seq, at) {
            found = Some(*place);
            *place = Parked::default();
        }
    }
    let seq = found?.seq;
    // SAFETY: the value is read while this program runs; only this connection's ingress
    // removes it, after the walk.
    let bytes = unsafe { H2_PARKED.get(&key(connection, seq)) }?;
    let parked = Parked {
        seq,
        len: bytes.len.min(PARKED_BYTES),
    };
    Some((
        parked,
        ParkedPayload {
            bytes: core::ptr::from_ref(bytes),
            len: parked.len,
        },
    ))
}

/// The bytes parked for connection `connection` at `seq`, read as a segment's.
#[inline(always)]
pub(crate) fn parked_payload(connection: u64, seq: u32) -> Option<ParkedPayload> {
    // SAFETY: the value is read while this program runs; only this connection's ingress
    // removes it, after the walk.
    let bytes = unsafe { H2_PARKED.get(&key(connection, seq)) }?;
    Some(ParkedPayload {
        bytes: core::ptr::from_ref(bytes),
        len: bytes.len.min(PARKED_BYTES),
    })
}

/// Move the bytes parked under `from` at `seq` to `to` (the first flight's id to its
/// connection's), as a payload to walk; `None` if there are none or the map has no room. The
/// entry under `from` stays until [`release`].
#[inline(always)]
pub(crate) fn move_parked((from, to): (u64, u64), seq: u32) -> Option<ParkedPayload> {
    // SAFETY: the value is read at once, by the map itself.
    let bytes = unsafe { H2_PARKED.get(&key(from, seq)) }?;
    H2_PARKED.insert(&key(to, seq), bytes, 0).ok()?;
    parked_payload(to, seq)
}

/// Put `parked`, taken by [`take`] and walked in part (its walk paused), back in a free place
/// of `places` (the one it left is free).
#[inline(always)]
pub(crate) fn put_back(places: &mut ParkedPlaces, parked: Parked) {
    if let Some(place) = places.places.iter_mut().find(|place| place.len == 0) {
        *place = parked;
    }
}

/// Drop the bytes parked under `connection` at `seq`, once walked.
#[inline(always)]
pub(crate) fn release(connection: u64, seq: u32) {
    release_key(connection, seq);
}

/// Drop every parked segment of a connection that closes.
#[inline(always)]
pub(crate) fn release_all<S>(sk: *mut S, connection: u64) {
    let Some(places) = places(sk, false) else {
        return;
    };
    for place in places.places.iter_mut() {
        if place.len != 0 {
            release_key(connection, place.seq);
            *place = Parked::default();
        }
    }
}

/// Drop the parked bytes of connection `connection` that begin at `seq`.
#[inline(always)]
fn release_key(connection: u64, seq: u32) {
    let _ = H2_PARKED.remove(&key(connection, seq));
}

/// The key of the segment of connection `connection` that begins at `seq`.
#[inline(always)]
fn key(connection: u64, seq: u32) -> ParkKey {
    ParkKey {
        connection,
        seq,
        pad: 0,
    }
}

/// A parked segment's bytes, read as the walk reads a segment's.
pub(crate) struct ParkedPayload {
    bytes: *const ParkedBytes,
    len: u32,
}

impl ParkedPayload {
    /// The parked segment's payload bytes.
    #[inline(always)]
    pub(crate) fn bytes_len(&self) -> u32 {
        self.len
    }

    /// The `N` bytes at `at`, if the segment holds them.
    #[inline(always)]
    fn array<const N: usize>(&self, at: u32) -> Option<[u8; N]> {
        if at as usize + N > self.len as usize {
            return None;
        }
        // `len` is at most `PARKED_BYTES`, so the mask changes nothing but what the verifier
        // knows.
        let at = core::hint::black_box(at) as usize & (PARKED_BYTES as usize - 1);
        // SAFETY: `bytes` points at a live map value of `PARKED_BYTES + 16` bytes, and
        // `at + N` is within it.
        Some(unsafe { core::ptr::read_unaligned((*self.bytes).bytes.as_ptr().add(at).cast()) })
    }
}

impl Payload for ParkedPayload {
    #[inline(always)]
    fn header_at(&self, at: u32) -> Option<[u8; 5]> {
        self.array(at)
    }

    #[inline(always)]
    fn frame_header_at(&self, at: u32) -> Option<[u8; 9]> {
        self.array(at)
    }

    #[inline(always)]
    fn bytes_at(&self, at: u32, n: u32) -> Option<u32> {
        let bytes = match n {
            1 => {
                let [a] = self.array::<1>(at)?;
                [0, 0, 0, a]
            }
            2 => {
                let [a, b] = self.array::<2>(at)?;
                [0, 0, a, b]
            }
            3 => {
                let [a, b, c] = self.array::<3>(at)?;
                [0, a, b, c]
            }
            4 => self.array::<4>(at)?,
            _ => return None,
        };
        Some(u32::from_be_bytes(bytes))
    }
}
