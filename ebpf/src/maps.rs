//! The maps the programs share with the agent and with one another, and the lookups that read
//! them: the watched endpoints and their counters, the tracked connections in their sockets'
//! storage, the notes of early payloads, the probe-wide counters and the settings.

use core::{ffi::c_void, ptr::null_mut};

use aya_ebpf::{
    bindings::BPF_SK_STORAGE_GET_F_CREATE,
    btf_maps::SkStorage,
    helpers::{bpf_get_smp_processor_id, bpf_sk_storage_delete, bpf_sk_storage_get},
    macros::{btf_map, map},
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
};
use retry_after_common::{
    ConnState, ENDPOINT_COUNTER_ENTRIES, EndpointCounters, EndpointKey, MAX_WATCHED_ENDPOINTS,
    PROBE_STATS_LEN, SETTINGS_LEN, Setting, Side, WATCHED_PORT_WORDS, WatchValue, counter_index,
};

use crate::counters;

/// Endpoints to observe; edited by the agent at run time.
#[map]
static WATCHED_ENDPOINTS: HashMap<EndpointKey, WatchValue> =
    HashMap::with_max_entries(MAX_WATCHED_ENDPOINTS, 0);

/// Counters per watch slot, side and writer (`counter_index`: the ingress program has a copy
/// of its own, see counters.rs). The agent zeroes a slot's counters before it hands the slot
/// to a new watch; the programs only increment.
#[map]
static ENDPOINT_COUNTERS: PerCpuArray<EndpointCounters> =
    PerCpuArray::with_max_entries(ENDPOINT_COUNTER_ENTRIES, 0);

/// The live generation of each watch slot (0: free). Checked on every segment, so removing a
/// watch stops its connections from counting at once.
#[map]
static SLOT_GENERATIONS: Array<u32> = Array::with_max_entries(MAX_WATCHED_ENDPOINTS, 0);

/// Bitmap of the ports of watched endpoints: lets every segment of every other socket on the
/// node leave after two array lookups, without a hash lookup.
#[map]
static WATCHED_PORTS: Array<u64> = Array::with_max_entries(WATCHED_PORT_WORDS, 0);

/// Tracked connections: each in its own socket's local storage, found from the socket itself
/// (no key, no shared table) and freed by the kernel with the socket. No bound, so nothing is
/// evicted or refused for want of room; only a failed allocation leaves a connection untracked,
/// and that is counted (`ProbeStat::ConnectionsUntracked`).
#[btf_map]
static CONNECTIONS: SkStorage<ConnState> = SkStorage::new();

/// The state of the connection of socket `sk` (any socket pointer the program was handed), if
/// it is tracked.
#[inline(always)]
pub(crate) fn tracked<S>(sk: *mut S) -> Option<*mut ConnState> {
    // SAFETY: the helper checks the socket; no value is passed, nothing is created.
    let state = unsafe { bpf_sk_storage_get(connections(), sk.cast(), null_mut(), 0) };
    (!state.is_null()).then_some(state.cast())
}

/// A state [`store`] was handed.
pub(crate) enum Stored {
    /// The one it stored.
    Mine(*mut ConnState),
    /// One stored for the socket from another CPU a moment before (the kernel keeps the first).
    Theirs(*mut ConnState),
}

/// [`store`] called from the established callback.
pub(crate) const MADE_AT_ESTABLISHED: u16 = 0;
/// [`store`] called from the segment path (`adopt`).
pub(crate) const MADE_AT_SEGMENT: u16 = 1;

/// Start tracking the connection of socket `sk` as `conn`, stored from program path `path`
/// (`MADE_AT_*`): the kernel copies it into new storage before the socket shows it, so no
/// program finds it half made. If a state was stored for the socket first, from another CPU
/// (or from a segment that interrupted the callback on this one), that one is returned.
/// `None` if the kernel could not allocate it.
#[inline(always)]
pub(crate) fn store<S>(sk: *mut S, conn: &mut ConnState, path: u16) -> Option<Stored> {
    // Unique among the programs that can store a state at the same moment: one per CPU and
    // path. Not zero, which is what a state not stored yet holds.
    // SAFETY: the helper takes no argument.
    let cpu = unsafe { bpf_get_smp_processor_id() } as u16;
    conn.maker = (cpu << 1 | path).wrapping_add(1);
    let init = core::ptr::from_mut(conn).cast();
    let create = u64::from(BPF_SK_STORAGE_GET_F_CREATE);
    // SAFETY: the helper checks the socket and copies `init`, a value of the map's type.
    let state = unsafe { bpf_sk_storage_get(connections(), sk.cast(), init, create) };
    let state = state.cast::<ConnState>();
    if state.is_null() {
        // Stored from another CPU between the helper's lookup and its insert, which it then
        // refuses; or no memory.
        return tracked(sk).map(Stored::Theirs);
    }
    // SAFETY: `state` points at the socket's state, a value of the map's type.
    if unsafe { (*state).maker } == conn.maker {
        Some(Stored::Mine(state))
    } else {
        Some(Stored::Theirs(state))
    }
}

/// Stop tracking the connection of socket `sk`.
#[inline(always)]
pub(crate) fn forget<S>(sk: *mut S) {
    // SAFETY: the helper checks the socket; a socket without state is left as it is.
    let _ = unsafe { bpf_sk_storage_delete(connections(), sk.cast()) };
}

/// The map argument the storage helpers take.
#[inline(always)]
fn connections() -> *mut c_void {
    core::ptr::from_ref(&CONNECTIONS).cast_mut().cast()
}

/// A client of a watched listener, as the segment that completes its handshake and as the
/// connection then established both name it: its address and port, and the listener's port.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct HandshakePeer {
    /// The client's address (IPv4 as IPv4-mapped IPv6).
    pub(crate) addr: [u8; 16],
    /// The client's port.
    pub(crate) port: u16,
    /// The listener's port.
    pub(crate) local_port: u16,
}

impl HandshakePeer {
    /// The id its first flight is parked under until its connection exists (FNV-1a of its
    /// fields, the top bit set: a socket's cookie, which parks a connection's segments, is a
    /// count from 1 and never reaches it).
    #[inline(always)]
    pub(crate) fn first_flight_id(&self) -> u64 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        let [p0, p1] = self.port.to_be_bytes();
        let [l0, l1] = self.local_port.to_be_bytes();
        for byte in self.addr.into_iter().chain([p0, p1, l0, l1]) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        hash | 1 << 63
    }
}

/// Clients of watched listeners whose first bytes reached the listener with the handshake
/// (TCP_DEFER_ACCEPT, TCP Fast Open, a lost third ACK), with what they were
/// (`EARLY_NOT_A_REQUEST`, `EARLY_FIRST_FLIGHT` or `EARLY_OTHER`). The segment passes while the listener owns it; the
/// connection established next takes its entry, and starts a turn unless the bytes were a TLS
/// ClientHello or the HTTP/2 preface. An LRU of handshakes in progress: without its entry, a
/// connection falls back on the kernel's own data count (see `early_request`).
#[map]
pub(crate) static EARLY_PAYLOADS: LruHashMap<HandshakePeer, u8> =
    LruHashMap::with_max_entries(4_096, 0);

/// `EARLY_PAYLOADS`: the bytes began with a TLS handshake record (a ClientHello) or with the
/// HTTP/2 connection preface: not a request turn.
pub(crate) const EARLY_NOT_A_REQUEST: u8 = 1;
/// `EARLY_PAYLOADS`: anything else (a request).
pub(crate) const EARLY_OTHER: u8 = 2;
/// `EARLY_PAYLOADS`: the HTTP/2 preface, its segment (the first flight) parked for the
/// connection to walk (`parking::park_first_flight`): not a request turn either.
pub(crate) const EARLY_FIRST_FLIGHT: u8 = 3;

/// Scoped connections whose scope is entered, by socket cookie. The first segment with a full
/// socket decides a scoped connection's scope, and two can decide it at once (the ingress
/// program runs before TCP takes the socket's lock, on another CPU than the egress one): the
/// one whose entry goes in where none was (`BPF_NOEXIST`, an exchange under the map's lock)
/// counts the connection opened, the other only follows. An LRU: an entry matters only for the
/// moment two segments race, and a cookie is never reused.
#[map]
pub(crate) static SCOPES_ENTERED: LruHashMap<u64, u8> = LruHashMap::with_max_entries(4_096, 0);

/// Probe-wide counters of things that went wrong (see `ProbeStat`).
#[map]
pub(crate) static PROBE_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(PROBE_STATS_LEN, 0);

/// What the agent switched off for this kernel (see `Setting`); all zero: nothing.
#[map]
static SETTINGS: Array<u32> = Array::with_max_entries(SETTINGS_LEN, 0);

/// The value of `setting` (0 if unreadable).
#[inline(always)]
pub(crate) fn setting(setting: Setting) -> u32 {
    SETTINGS.get(setting as u32).copied().unwrap_or(0)
}

/// The watch entry matching `endpoint`: the exact address first, then the port wildcard.
pub(crate) fn matching_watch(endpoint: &EndpointKey) -> Option<WatchValue> {
    // SAFETY: the values are copied out at once; the map holds plain integers.
    if let Some(watch) = unsafe { WATCHED_ENDPOINTS.get(endpoint) } {
        return Some(*watch);
    }
    let wildcard = EndpointKey::any_address(endpoint.port);
    // SAFETY: as above.
    unsafe { WATCHED_ENDPOINTS.get(&wildcard) }.copied()
}

/// The copy `writer` updates of the counters a tracked connection feeds, or `None` if its
/// watch was removed or replaced since it was opened. Two array lookups, which the verifier
/// inlines.
#[inline(always)]
pub(crate) fn live_counters<const PLAIN: bool>(
    conn: &ConnState,
) -> Option<counters::Counters<PLAIN>> {
    live_counters_of(conn.slot, conn.generation, conn.side)
}

/// [`live_counters`] of the watch `slot` under `generation`, from `side` (`Side as u8`): an
/// HTTP/2 stream's, as its entry in the stream table says.
#[inline(always)]
pub(crate) fn live_counters_of<const PLAIN: bool>(
    slot: u16,
    generation: u32,
    side: u8,
) -> Option<counters::Counters<PLAIN>> {
    if *SLOT_GENERATIONS.get(u32::from(slot))? != generation {
        return None;
    }
    let side = if side == Side::Client as u8 {
        Side::Client
    } else {
        Side::Server
    };
    let index = counter_index(u32::from(slot), side, counters::Counters::<PLAIN>::WRITER);
    ENDPOINT_COUNTERS
        .get_ptr_mut(index)
        .map(counters::Counters::new)
}

/// True if `port` (host byte order) is the port of a watched endpoint.
#[inline(always)]
pub(crate) fn port_watched(port: u16) -> bool {
    match WATCHED_PORTS.get((port / 64) as u32) {
        Some(word) => word & (1u64 << (port % 64)) != 0,
        None => false,
    }
}
