//! The eBPF programs of retry-after-agent.
//!
//! Six programs. Four count: three attach to the root of the cgroup v2 hierarchy (or to the
//! cgroups of `agent.attach_cgroups`), so they see every TCP socket there without touching any
//! application; the fourth is a tracepoint:
//!
//! * `ra_sockops` (sock_ops): a connection to or from a watched endpoint is established →
//!   count it, start tracking it in its socket's own storage, and ask for state callbacks; it
//!   reaches TCP_CLOSE → close its open turn, count the close, forget it.
//! * `ra_destroy` (tp_btf `tcp_destroy_sock`): the close of a connection that was adopted
//!   after it opened, which asked for no state callbacks.
//! * `ra_ingress` / `ra_egress` (cgroup_skb): every TCP segment a tracked socket receives or
//!   sends → feed the turn state machine of `retry_after_common::turn`, through the TLS record
//!   framing of `retry_after_common::tls` on an encrypted connection; on an HTTP/2
//!   connection, walk its frames and count its streams instead (`retry_after_common::h2`).
//!   Segments are seen as they arrive, before the application reads them, so a request
//!   waiting unread in a socket buffer is already counted.
//!
//! Each of the four has a `_noh2` twin without HTTP/2 streams (an HTTP/2 connection is left
//! out), which the agent loads instead on a kernel without `bpf_loop` or atomic fetch
//! operations. The other two, `ra_floor_in` / `ra_floor_out` (cgroup_skb), let every segment
//! pass at once: the data path's floor, which the bench measures; the agent never attaches
//! them. The feature probes (`features.rs`) are loaded at start and never attached.
//!
//! The programs only observe: every path returns "allow", whatever happens.

#![no_std]
#![no_main]
// Atomic adds (see counters.rs); the eBPF build enables unstable features for this crate.
#![allow(internal_features)]
#![feature(core_intrinsics)]

mod counters;
mod features;
mod packet;

use core::{
    ffi::c_void,
    ptr::{null_mut, read_volatile},
};

use aya_ebpf::{
    EbpfContext,
    bindings::{
        __sk_buff, BPF_SK_STORAGE_GET_F_CREATE, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG,
        BPF_TCP_CLOSE, BPF_TCP_ESTABLISHED, BPF_TCP_LISTEN, BPF_TCP_SYN_SENT, bpf_sock,
    },
    btf_maps::SkStorage,
    helpers::{
        bpf_get_smp_processor_id, bpf_sk_fullsock, bpf_sk_storage_delete, bpf_sk_storage_get,
        bpf_skb_ancestor_cgroup_id, bpf_skb_cgroup_id, bpf_tcp_sock,
    },
    macros::{btf_map, btf_tracepoint, cgroup_skb, map, sock_ops},
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
    programs::{BtfTracePointContext, SkBuffContext, SockOpsContext},
};
use aya_log_ebpf::{debug, warn};
use retry_after_common::{
    ConnState, ENDPOINT_COUNTER_ENTRIES, EndpointCounters, EndpointKey, MAX_WATCHED_ENDPOINTS,
    PROBE_STATS_LEN, ProbeStat, Protocol, SETTINGS_LEN, Setting, Side, WATCHED_PORT_WORDS,
    WatchValue, counter_index,
    h2::{Detected, FrameSegment},
    tls::{Sender, Walked},
    turn::{PHASE_REQUEST, ResponseStart, STATUS_LINE_PREFIX, TurnDelta},
};

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
fn tracked<S>(sk: *mut S) -> Option<*mut ConnState> {
    // SAFETY: the helper checks the socket; no value is passed, nothing is created.
    let state = unsafe { bpf_sk_storage_get(connections(), sk.cast(), null_mut(), 0) };
    (!state.is_null()).then_some(state.cast())
}

/// A state [`store`] was handed.
enum Stored {
    /// The one it stored.
    Mine(*mut ConnState),
    /// One stored for the socket from another CPU a moment before (the kernel keeps the first).
    Theirs(*mut ConnState),
}

/// [`store`] called from the established callback.
const MADE_AT_ESTABLISHED: u16 = 0;
/// [`store`] called from the segment path (`adopt`).
const MADE_AT_SEGMENT: u16 = 1;

/// Start tracking the connection of socket `sk` as `conn`, stored from program path `path`
/// (`MADE_AT_*`): the kernel copies it into new storage before the socket shows it, so no
/// program finds it half made. If a state was stored for the socket first, from another CPU
/// (or from a segment that interrupted the callback on this one), that one is returned.
/// `None` if the kernel could not allocate it.
#[inline(always)]
fn store<S>(sk: *mut S, conn: &mut ConnState, path: u16) -> Option<Stored> {
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
fn forget<S>(sk: *mut S) {
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
struct HandshakePeer {
    addr: [u8; 16],
    port: u16,
    local_port: u16,
}

/// Clients of watched listeners whose first bytes reached the listener with the handshake
/// (TCP_DEFER_ACCEPT, TCP Fast Open, a lost third ACK), with what they were
/// (`EARLY_NOT_A_REQUEST` or `EARLY_OTHER`). The segment passes while the listener owns it; the
/// connection established next takes its entry, and starts a turn unless the bytes were a TLS
/// ClientHello or the HTTP/2 preface. An LRU of handshakes in progress: without its entry, a
/// connection falls back on the kernel's own data count (see `early_request`).
#[map]
static EARLY_PAYLOADS: LruHashMap<HandshakePeer, u8> = LruHashMap::with_max_entries(4_096, 0);

/// `EARLY_PAYLOADS`: the bytes began with a TLS handshake record (a ClientHello) or with the
/// HTTP/2 connection preface: not a request turn.
const EARLY_NOT_A_REQUEST: u8 = 1;
/// `EARLY_PAYLOADS`: anything else (a request).
const EARLY_OTHER: u8 = 2;

/// Probe-wide counters of things that went wrong (see `ProbeStat`).
#[map]
static PROBE_STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(PROBE_STATS_LEN, 0);

/// What the agent switched off for this kernel (see `Setting`); all zero: nothing.
#[map]
static SETTINGS: Array<u32> = Array::with_max_entries(SETTINGS_LEN, 0);

/// The value of `setting` (0 if unreadable).
#[inline(always)]
fn setting(setting: Setting) -> u32 {
    SETTINGS.get(setting as u32).copied().unwrap_or(0)
}

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// Connection establishment and close.
#[sock_ops]
fn ra_sockops(ctx: SockOpsContext) -> u32 {
    sockops::<true>(&ctx)
}

/// `ra_sockops` without HTTP/2 streams, for kernels without atomic fetch operations.
#[sock_ops]
fn ra_sockops_noh2(ctx: SockOpsContext) -> u32 {
    sockops::<false>(&ctx)
}

/// A full TCP socket is destroyed (once, after TCP_CLOSE, when no process holds it any more).
/// A tracked connection is closed here if its sock_ops state callback was never enabled:
/// connections adopted after they opened (see `adopt`). Every other close was seen already.
#[btf_tracepoint(function = "tcp_destroy_sock")]
fn ra_destroy(ctx: BtfTracePointContext) -> i32 {
    let sk: *mut c_void = ctx.arg(0);
    close_tracked::<_, true>(sk);
    0
}

/// `ra_destroy` without HTTP/2 streams.
#[btf_tracepoint(function = "tcp_destroy_sock")]
fn ra_destroy_noh2(ctx: BtfTracePointContext) -> i32 {
    let sk: *mut c_void = ctx.arg(0);
    close_tracked::<_, false>(sk);
    0
}

/// A segment arrives at a local socket.
#[cgroup_skb(ingress)]
fn ra_ingress(ctx: SkBuffContext) -> i32 {
    if ports_watched(&ctx) {
        on_segment::<true, true>(&ctx);
    }
    1
}

/// `ra_ingress` without HTTP/2 streams, for kernels without `bpf_loop` or atomic fetch
/// operations: an HTTP/2 connection is left out, and counted as such.
#[cgroup_skb(ingress)]
fn ra_ingress_noh2(ctx: SkBuffContext) -> i32 {
    if ports_watched(&ctx) {
        on_segment::<true, false>(&ctx);
    }
    1
}

/// A local socket sends a segment.
#[cgroup_skb(egress)]
fn ra_egress(ctx: SkBuffContext) -> i32 {
    if ports_watched(&ctx) {
        on_segment::<false, true>(&ctx);
    }
    1
}

/// `ra_egress` without HTTP/2 streams (see `ra_ingress_noh2`).
#[cgroup_skb(egress)]
fn ra_egress_noh2(ctx: SkBuffContext) -> i32 {
    if ports_watched(&ctx) {
        on_segment::<false, false>(&ctx);
    }
    1
}

/// The sock_ops callbacks, counting HTTP/2 streams at a close if `HTTP2`.
#[inline(always)]
fn sockops<const HTTP2: bool>(ctx: &SockOpsContext) -> u32 {
    match ctx.op() {
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => on_established(ctx, Side::Server),
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => on_established(ctx, Side::Client),
        BPF_SOCK_OPS_STATE_CB if ctx.arg(1) == BPF_TCP_CLOSE => on_close::<HTTP2>(ctx),
        _ => {}
    }
    // sock_ops return values are ignored for these callbacks; 1 means "handled".
    1
}

/// The data path's floor, for the bench: the ingress hook with a program that lets the
/// segment pass at once. Never attached by the agent.
#[cgroup_skb(ingress)]
fn ra_floor_in(_ctx: SkBuffContext) -> i32 {
    1
}

/// The floor's egress half (see `ra_floor_in`).
#[cgroup_skb(egress)]
fn ra_floor_out(_ctx: SkBuffContext) -> i32 {
    1
}

/// A socket's addresses, as both the sock_ops and the cgroup_skb context carry them: ports in
/// the kernel's orders (local in host order, remote in network order in the upper 16 bits),
/// addresses in network order.
struct Addresses {
    family: u32,
    local_port: u32,
    remote_port: u32,
    local_ip4: u32,
    remote_ip4: u32,
    local_ip6: [u32; 4],
    remote_ip6: [u32; 4],
}

/// Read the address fields of a context (`bpf_sock_ops` or `__sk_buff`, which name them
/// alike). The verifier only accepts context loads at a constant offset from the context
/// pointer; each field gets its own volatile load, so the compiler selects between loaded
/// values, never between field pointers (which the verifier rejects).
macro_rules! addresses {
    ($ptr:expr) => {{
        let p = $ptr;
        // SAFETY: `p` is the context the kernel passed in; these are plain u32 fields.
        unsafe {
            let family = read_volatile(&raw const (*p).family);
            let mut local_ip6 = [0u32; 4];
            let mut remote_ip6 = [0u32; 4];
            if family == AF_INET6 {
                local_ip6[0] = read_volatile(&raw const (*p).local_ip6[0]);
                local_ip6[1] = read_volatile(&raw const (*p).local_ip6[1]);
                local_ip6[2] = read_volatile(&raw const (*p).local_ip6[2]);
                local_ip6[3] = read_volatile(&raw const (*p).local_ip6[3]);
                remote_ip6[0] = read_volatile(&raw const (*p).remote_ip6[0]);
                remote_ip6[1] = read_volatile(&raw const (*p).remote_ip6[1]);
                remote_ip6[2] = read_volatile(&raw const (*p).remote_ip6[2]);
                remote_ip6[3] = read_volatile(&raw const (*p).remote_ip6[3]);
            }
            Addresses {
                family,
                local_port: read_volatile(&raw const (*p).local_port),
                remote_port: read_volatile(&raw const (*p).remote_port),
                local_ip4: read_volatile(&raw const (*p).local_ip4),
                remote_ip4: read_volatile(&raw const (*p).remote_ip4),
                local_ip6,
                remote_ip6,
            }
        }
    }};
}

/// The endpoint of `addresses` seen from `side`: the local address for a connection accepted
/// here, the remote one for a connection opened from here.
fn endpoint_of(a: &Addresses, side: Side) -> Option<EndpointKey> {
    let (ip4, ip6, port) = match side {
        Side::Server => (a.local_ip4, a.local_ip6, a.local_port as u16),
        Side::Client => (
            a.remote_ip4,
            a.remote_ip6,
            u32::from_be(a.remote_port) as u16,
        ),
    };
    match a.family {
        AF_INET => Some(EndpointKey::from_ipv4(ip4.to_ne_bytes(), port)),
        AF_INET6 => {
            let mut addr = [0u8; 16];
            let mut i = 0;
            while i < 4 {
                let word = ip6[i].to_ne_bytes();
                addr[i * 4] = word[0];
                addr[i * 4 + 1] = word[1];
                addr[i * 4 + 2] = word[2];
                addr[i * 4 + 3] = word[3];
                i += 1;
            }
            Some(EndpointKey::new(addr, port))
        }
        _ => None,
    }
}

/// The watch entry matching `endpoint`: the exact address first, then the port wildcard.
fn matching_watch(endpoint: &EndpointKey) -> Option<WatchValue> {
    // SAFETY: the values are copied out at once; the map holds plain integers.
    if let Some(watch) = unsafe { WATCHED_ENDPOINTS.get(endpoint) } {
        return Some(*watch);
    }
    let wildcard = EndpointKey::any_address(endpoint.port);
    unsafe { WATCHED_ENDPOINTS.get(&wildcard) }.copied()
}

/// A connection of a watched endpoint is established: start tracking it. Two functions of
/// their own, called one after the other, so their stacks (the addresses read by the first,
/// the state built by the second) are never added together: Debian's 6.1 rounds each frame
/// up to 32 bytes and refuses a call chain over 512 (6.12 does not round a leaf up).
#[inline(always)]
fn on_established(ctx: &SockOpsContext, side: Side) {
    let mut found = Established {
        watch: WatchValue::default(),
        sk: null_mut(),
        port: 0,
        early_end: 0,
        early_bytes: 0,
        early: false,
    };
    if established_watch(ctx, side, &mut found) {
        track_established(ctx, side, &found);
    }
}

/// What `established_watch` found for `track_established`.
struct Established {
    /// The watch the connection matched.
    watch: WatchValue,
    /// Its socket.
    sk: *mut c_void,
    /// The endpoint's port (for the log).
    port: u16,
    /// A request came with the handshake (`early_request`): where it ends and the bytes
    /// counted so far. Three fields, not an `Option`, for the reason `packet::Segment` gives.
    early_end: u32,
    early_bytes: u32,
    early: bool,
}

/// Whether the connection of this callback, seen from `side`, is one of a watched endpoint,
/// and if so (into `found`) its watch and the request that came with its handshake; its state
/// callback (its close) is asked for.
#[inline(never)]
fn established_watch(ctx: &SockOpsContext, side: Side, found: &mut Established) -> bool {
    let a = addresses!(ctx.ops);
    let Some(endpoint) = endpoint_of(&a, side) else {
        return false;
    };
    let Some(watch) = matching_watch(&endpoint) else {
        return false;
    };
    // SAFETY: the context's socket field, a plain load.
    let sk = unsafe { (*ctx.ops).__bindgen_anon_2.sk };
    if sk.is_null() {
        return false;
    }
    enable_state_callback(ctx);
    found.watch = watch;
    found.sk = sk.cast();
    found.port = endpoint.port;
    if let Some((end, bytes)) = early_request(ctx, &a, side) {
        found.early_end = end;
        found.early_bytes = bytes;
        found.early = true;
    }
    true
}

/// Start tracking the connection `found` describes, seen from `side`, and count it opened.
#[inline(never)]
fn track_established(ctx: &SockOpsContext, side: Side, found: &Established) {
    let mut conn = ConnState::new(&found.watch, side);
    // A request that came with the handshake: its bytes passed before this connection was
    // tracked (see `early_request`). The state is complete before it is stored, so a segment
    // on another CPU never finds it without its request.
    let early_delta = if found.early {
        conn.turn
            .on_early_request(found.early_end, found.early_bytes)
    } else {
        TurnDelta::default()
    };
    match store(found.sk, &mut conn, MADE_AT_ESTABLISHED) {
        Some(Stored::Mine(_)) => {}
        // Its first response arrived before this callback, and started it (see `adopt`).
        Some(Stored::Theirs(_)) => return,
        None => {
            counters::probe_stat(&PROBE_STATS, ProbeStat::ConnectionsUntracked);
            warn!(ctx, "cannot track connection on port {}", found.port);
            return;
        }
    }
    count_opened(&conn, &early_delta);
    debug!(
        ctx,
        "tracking {} connection on port {}", side as u32, found.port
    );
}

/// Ask for this socket's state changes (its close), counting a refusal.
fn enable_state_callback(ctx: &SockOpsContext) {
    if ctx
        .set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32)
        .is_err()
    {
        counters::probe_stat(&PROBE_STATS, ProbeStat::StateCallbackRefused);
    }
}

/// A request that came with the handshake, as (sequence number just past it, or just past
/// what has been received of it; bytes counted so far), or `None`.
///
/// * Server side (TCP_DEFER_ACCEPT, TCP Fast Open, a lost third ACK): the segment carrying the
///   client's first bytes passed while the listener owned it. `note_early_payload` saw it and
///   noted whether it began with a TLS ClientHello or the HTTP/2 preface (neither is a
///   request; an HTTP/2 connection's first flight is not walked, so the streams it opened are
///   not counted). Without a note (evicted), the kernel's own count tells: it counts the
///   data segment that completes the handshake (`data_segs_in`) before it queues its bytes, so
///   at this callback the bytes may still be 0 while a request is already there.
/// * Client side (TCP Fast Open): the request went out in the SYN, before the connection was
///   tracked; the kernel counted it in `data_segs_out`. If it was a ClientHello, the client's
///   next segment shows TLS records and the turn is withdrawn
///   (`Turn::on_early_bytes_not_a_request`).
fn early_request(ctx: &SockOpsContext, a: &Addresses, side: Side) -> Option<(u32, u32)> {
    let ops = ctx.ops;
    // SAFETY: `ops` is the sock_ops context the kernel passed in; plain integer fields.
    let (data_in, received, rcv_nxt, data_out, snd_nxt) = unsafe {
        (
            read_volatile(&raw const (*ops).data_segs_in),
            read_volatile(&raw const (*ops).bytes_received),
            read_volatile(&raw const (*ops).rcv_nxt),
            read_volatile(&raw const (*ops).data_segs_out),
            read_volatile(&raw const (*ops).snd_nxt),
        )
    };
    let bytes = |n: u64| n.min(u64::from(u32::MAX)) as u32;
    match side {
        Side::Server => match take_early_payload(a) {
            Some(EARLY_NOT_A_REQUEST) => None,
            Some(_) => Some((rcv_nxt, bytes(received))),
            None => (data_in > 0 || received > 0).then_some((rcv_nxt, bytes(received))),
        },
        // Its bytes are not counted (as on the server side, where they are not queued yet).
        Side::Client => (data_out > 0).then_some((snd_nxt, 0)),
    }
}

/// The note `note_early_payload` left for this (server-side) connection's client, if any; the
/// note is used up.
fn take_early_payload(a: &Addresses) -> Option<u8> {
    let remote = endpoint_of(a, Side::Client)?;
    let peer = HandshakePeer {
        addr: remote.addr,
        port: remote.port,
        local_port: a.local_port as u16,
    };
    // SAFETY: the value is copied out at once.
    let kind = unsafe { EARLY_PAYLOADS.get(&peer) }.copied()?;
    let _ = EARLY_PAYLOADS.remove(&peer);
    Some(kind)
}

/// A segment with payload reached a watched listener: it completes a handshake (or is a SYN
/// with data) and carries the client's first bytes. Note the client, and whether the bytes
/// begin a TLS ClientHello or the HTTP/2 preface (`EARLY_PAYLOADS`).
#[inline(never)]
fn note_early_payload(ctx: &SkBuffContext, segment: &packet::Segment, local_port: u16) {
    let kind = match ctx.load::<[u8; 5]>(segment.payload_offset as usize) {
        Ok(first) if retry_after_common::tls::is_handshake_header(first) || first == *b"PRI *" => {
            EARLY_NOT_A_REQUEST
        }
        _ => EARLY_OTHER,
    };
    if let Some((addr, port)) = packet::source(ctx, segment) {
        let peer = HandshakePeer {
            addr,
            port,
            local_port,
        };
        let _ = EARLY_PAYLOADS.insert(&peer, &kind, 0);
    }
}

fn on_close<const HTTP2: bool>(ctx: &SockOpsContext) {
    // SAFETY: the context's socket field, a plain load.
    let sk = unsafe { (*ctx.ops).__bindgen_anon_2.sk };
    if !sk.is_null() {
        close_tracked::<_, HTTP2>(sk);
    }
}

/// A tracked connection closed: close its open turn, count the close, forget it. Reached from
/// the sock_ops state callback and from the `tcp_destroy_sock` tracepoint, whichever runs
/// first (the second finds nothing). Without `HTTP2`, no connection is counted by streams.
#[inline(always)]
fn close_tracked<S, const HTTP2: bool>(sk: *mut S) {
    let Some(conn) = tracked(sk) else {
        return;
    };
    // SAFETY: `conn` points at the socket's live state; it is deleted only below.
    let conn = unsafe { &mut *conn };
    // A scoped connection that never sent a segment was never counted.
    if conn.scope_cgroup == 0
        && let Some(c) = live_counters::<false>(conn)
    {
        let delta = if HTTP2 && conn.client_frames.is_http2() {
            conn.streams.on_close::<counters::KernelFrameOps>()
        } else {
            conn.turn.on_close(conn.server_records.is_tls())
        };
        // SAFETY: `c` is this CPU's copy of a live map value.
        unsafe {
            c.apply(&delta);
            c.count_closed();
        }
    }
    forget(sk);
}

/// Count a tracked connection as opened, with `early`, what came with its handshake. Not yet
/// for a scoped client side: its socket's cgroup is read from its first segment (a callback
/// may run on behalf of any task), and only then is it counted (by `on_segment`).
#[inline(always)]
fn count_opened(conn: &ConnState, early: &TurnDelta) {
    if conn.scope_cgroup == 0
        && let Some(c) = live_counters::<false>(conn)
    {
        // SAFETY: `c` is this CPU's copy of a live map value.
        unsafe {
            c.count_opened();
            c.apply(early);
        }
    }
}

/// The copy `writer` updates of the counters a tracked connection feeds, or `None` if its
/// watch was removed or replaced since it was opened. Two array lookups, which the verifier
/// inlines.
#[inline(always)]
fn live_counters<const PLAIN: bool>(conn: &ConnState) -> Option<counters::Counters<PLAIN>> {
    let generation = SLOT_GENERATIONS.get(conn.slot)?;
    if *generation != conn.generation {
        return None;
    }
    let side = if conn.side == Side::Client as u16 {
        Side::Client
    } else {
        Side::Server
    };
    let index = counter_index(conn.slot, side, counters::Counters::<PLAIN>::WRITER);
    ENDPOINT_COUNTERS
        .get_ptr_mut(index)
        .map(counters::Counters::new)
}

/// True if either port of the segment's socket is the port of a watched endpoint: a tracked
/// connection always has a watched port on one end. Checked in the program itself, so every
/// other socket's segment leaves without a call.
#[inline(always)]
fn ports_watched(ctx: &SkBuffContext) -> bool {
    // Local in host byte order, remote in network byte order in the upper 16 bits.
    let local_port = ctx.skb.local_port() as u16;
    let remote_port = u32::from_be(ctx.skb.remote_port()) as u16;
    port_watched(local_port) || port_watched(remote_port)
}

/// True if `port` (host byte order) is the port of a watched endpoint.
#[inline(always)]
fn port_watched(port: u16) -> bool {
    match WATCHED_PORTS.get((port / 64) as u32) {
        Some(word) => word & (1u64 << (port % 64)) != 0,
        None => false,
    }
}

/// A segment of any socket, seen on ingress (`INGRESS`) or egress: a constant, so each
/// program's copy carries only its own direction's paths, and its own way of counting.
/// HTTP/2 connections are counted by streams if `HTTP2`, left out if not.
fn on_segment<const INGRESS: bool, const HTTP2: bool>(ctx: &SkBuffContext) {
    let ingress = INGRESS;
    let skb = ctx.as_ptr().cast::<__sk_buff>();
    // SAFETY: the context's socket field, a plain load.
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return;
    }
    let state = tracked(sk);
    let segment = packet::parse_tcp(ctx);
    if !segment.parsed {
        if state.is_some() {
            counters::probe_stat(&PROBE_STATS, ProbeStat::PacketsUnparsed);
        }
        return;
    }
    let Some((conn, c)) = connection::<INGRESS>(ctx, ingress, sk, state, &segment) else {
        return;
    };
    // SAFETY: `conn` points at the socket's live state.
    let conn = unsafe { &mut *conn };
    if conn.scope_cgroup != 0 && !enter_scope(skb, sk, conn) {
        return;
    }
    // Which way the segment travels between client and server. On a TLS connection only the
    // segments that carry request or response records take part in turns (`tls`); on an
    // HTTP/2 connection, its frames count streams instead (`h2`).
    let sender = if (conn.side == Side::Server as u16) == ingress {
        Sender::Client
    } else {
        Sender::Server
    };
    let payload = packet::SegmentPayload::new(ctx, segment.payload_offset);
    match streams_or_turns::<INGRESS, HTTP2>(conn, c, &segment, &payload, sender) {
        // Nothing runs after it: the verifier checks the rest of this path once, not once for
        // each way out of the frame walk.
        Counted::ByStreams => {
            if HTTP2 {
                http2_segment(conn, c.values(), &segment, &payload, sender);
            }
        }
        Counted::NotAtAll => {}
        Counted::ByTurns => {
            let delta = match sender {
                Sender::Client => {
                    let walked = walk_records(conn, &segment, &payload, Sender::Client);
                    client_segment(conn, c, &segment, &walked)
                }
                Sender::Server => {
                    let walked = walk_records(conn, &segment, &payload, Sender::Server);
                    server_segment(ctx, conn, &segment, &walked)
                }
            };
            // SAFETY: `c` is this CPU's copy of a live map value.
            unsafe { c.apply(&delta) };
        }
    }
}

/// The connection's state and the counters it feeds: its tracked state, or the state of a
/// connection adopted at this segment. State from an earlier watch of the endpoint (removed,
/// or removed and added again) is dropped: the connection is then as untracked, and may be
/// adopted by this very segment.
#[inline(always)]
fn connection<const INGRESS: bool>(
    ctx: &SkBuffContext,
    ingress: bool,
    sk: *mut bpf_sock,
    state: Option<*mut ConnState>,
    segment: &packet::Segment,
) -> Option<(*mut ConnState, counters::Counters<INGRESS>)> {
    if let Some(conn) = state
        && let Some(found) = with_counters::<INGRESS>(sk, conn)
    {
        return Some(found);
    }
    adopt(ctx, ingress, segment).and_then(|conn| with_counters::<INGRESS>(sk, conn))
}

/// A tracked connection `conn` of socket `sk` with the counters it feeds, or `None` (and the
/// state dropped) if its watch is gone.
#[inline(always)]
fn with_counters<const INGRESS: bool>(
    sk: *mut bpf_sock,
    conn: *mut ConnState,
) -> Option<(*mut ConnState, counters::Counters<INGRESS>)> {
    // SAFETY: `conn` points at the socket's live state.
    let c = live_counters::<INGRESS>(unsafe { &*conn });
    if c.is_none() {
        forget(sk);
    }
    c.map(|c| (conn, c))
}

/// Decide a scoped connection's scope on its first segment with a full socket: true if its
/// client is inside the proxy's cgroup (the scope is then settled and any request that came
/// with the handshake counted), false if not yet known or outside (then forgotten).
#[inline(always)]
fn enter_scope(skb: *mut __sk_buff, sk: *mut bpf_sock, conn: &mut ConnState) -> bool {
    // SAFETY: the helpers only read the packet's socket.
    let ancestor = unsafe { bpf_skb_ancestor_cgroup_id(skb, conn.scope_level as i32) };
    // 0 from both: no full socket on this segment, decide on the next one. 0 only from
    // the ancestor: the socket's cgroup is shallower than the scope, so outside it.
    if ancestor == 0 && unsafe { bpf_skb_cgroup_id(skb) } == 0 {
        return false;
    }
    if ancestor != conn.scope_cgroup {
        counters::probe_stat(&PROBE_STATS, ProbeStat::ConnectionsOutOfScope);
        forget(sk);
        return false;
    }
    conn.scope_cgroup = 0;
    // No segment was fed to the turn before this one, so an open request is one that came
    // with the handshake (TCP Fast Open), started but not counted while the scope was open.
    let early = TurnDelta {
        started: u16::from(conn.turn.phase() == PHASE_REQUEST),
        ..TurnDelta::default()
    };
    count_opened(conn, &early);
    true
}

/// A segment from the client, its records walked (`walked`): a ClientHello found withdraws
/// what the turn counted as plaintext, then the turn is moved by the request bytes it carries.
#[inline(always)]
fn client_segment<const INGRESS: bool>(
    conn: &mut ConnState,
    c: counters::Counters<INGRESS>,
    segment: &packet::Segment,
    walked: &Walked,
) -> TurnDelta {
    if walked.found_tls {
        let withdrawn = conn.turn.on_early_bytes_not_a_request();
        // SAFETY: `c` is this CPU's copy of a live map value.
        unsafe { c.apply(&withdrawn) };
    }
    let len = if walked.plaintext || walked.message {
        segment.payload_len
    } else {
        0
    };
    let ack = segment.has_ack.then_some(segment.ack);
    conn.turn.on_client_segment(segment.seq, len, ack)
}

/// A segment from the server, its records walked (`walked`): the turn moved by the response
/// bytes it carries.
#[inline(always)]
fn server_segment(
    ctx: &SkBuffContext,
    conn: &mut ConnState,
    segment: &packet::Segment,
    walked: &Walked,
) -> TurnDelta {
    if !(walked.plaintext || walked.message) {
        return TurnDelta::default();
    }
    // Only a plaintext segment that could begin this request's response is looked into for
    // its status line: interim (1xx), or a rejection (429, 503).
    let start = if walked.plaintext
        && conn.turn.phase() == PHASE_REQUEST
        && segment.payload_len >= STATUS_LINE_PREFIX as u32
    {
        packet::response_start(ctx, segment.payload_offset)
    } else {
        ResponseStart::Other
    };
    conn.turn
        .on_server_segment(segment.seq, segment.payload_len, segment.push, start)
}

/// How a connection's requests are counted.
enum Counted {
    /// By turns, through the TLS record walk.
    ByTurns,
    /// By HTTP/2 streams, from the frames.
    ByStreams,
    /// Not at all: HTTP/2 (the endpoint says so) inside TLS, whose frames are encrypted; or
    /// HTTP/2 where the programs cannot count streams.
    NotAtAll,
}

/// How this connection's requests are counted: decided at its client's first payload (the
/// HTTP/2 preface, a TLS record or anything else), on an endpoint that may speak HTTP/2. A
/// request that came with the handshake and was the preface is withdrawn. Without `HTTP2`,
/// an HTTP/2 connection is not counted at all (and counted as left out, once).
#[inline(always)]
fn streams_or_turns<const INGRESS: bool, const HTTP2: bool>(
    conn: &mut ConnState,
    c: counters::Counters<INGRESS>,
    segment: &packet::Segment,
    payload: &packet::SegmentPayload,
    sender: Sender,
) -> Counted {
    let protocol = Protocol::from_u32(u32::from(conn.protocol));
    if !protocol.may_be_http2() {
        return Counted::ByTurns;
    }
    if sender == Sender::Client
        && segment.payload_len > 0
        && !conn.client_frames.is_detected()
        && conn.client_frames.detect(segment.seq, payload, protocol) == Detected::Http2
    {
        let withdrawn = conn.turn.on_early_bytes_not_a_request();
        // SAFETY: `c` is this CPU's copy of a live map value.
        unsafe { c.apply(&withdrawn) };
        if !HTTP2 {
            counters::probe_stat(&PROBE_STATS, ProbeStat::Http2ConnectionsLeftOut);
        }
    }
    if conn.client_frames.is_http2() {
        if HTTP2 {
            Counted::ByStreams
        } else {
            Counted::NotAtAll
        }
    } else if conn.client_frames.is_encrypted()
        && matches!(protocol, Protocol::Http2 | Protocol::Grpc)
    {
        Counted::NotAtAll
    } else {
        Counted::ByTurns
    }
}

/// Count what a segment of an HTTP/2 connection, sent by `sender`, did to its streams. A
/// function of its own (so five arguments at most), so that its stack is not added to the
/// adoption path's.
#[inline(never)]
fn http2_segment(
    conn: &mut ConnState,
    c: *mut EndpointCounters,
    segment: &packet::Segment,
    payload: &packet::SegmentPayload,
    sender: Sender,
) {
    let protocol = Protocol::from_u32(u32::from(conn.protocol));
    let frames = match sender {
        Sender::Client => &mut conn.client_frames,
        Sender::Server => &mut conn.server_frames,
    };
    let walk = frames.walk::<_, counters::KernelFrameOps>(
        &mut conn.hole,
        &mut conn.streams,
        FrameSegment {
            seq: segment.seq,
            len: segment.payload_len,
            payload,
            sender,
            protocol,
        },
    );
    if walk.unframed {
        counters::probe_stat(&PROBE_STATS, ProbeStat::Http2SegmentsUnframed);
    }
    counters::probe_stats_unconditionally(
        &PROBE_STATS,
        ProbeStat::Http2StreamsForgotten,
        u64::from(walk.forgotten),
    );
    // SAFETY: `c` points into this CPU's copy of a live map value.
    unsafe { counters::apply_streams(c, &walk.delta) };
}

/// Walk the TLS records of one segment sent by `sender` (the other direction's framing flags
/// tell the TLS 1.3 handshake apart), counting a segment whose framing is lost.
#[inline(always)]
fn walk_records(
    conn: &mut ConnState,
    segment: &packet::Segment,
    payload: &packet::SegmentPayload,
    sender: Sender,
) -> Walked {
    let (records, peer_flags) = match sender {
        Sender::Client => (&mut conn.client_records, conn.server_records.flags.get()),
        Sender::Server => (&mut conn.server_records, conn.client_records.flags.get()),
    };
    let walked = records.walk(
        segment.seq,
        segment.payload_len,
        payload,
        sender,
        peer_flags,
    );
    if walked.unframed {
        counters::probe_stat(&PROBE_STATS, ProbeStat::TlsSegmentsUnframed);
    }
    walked
}

/// Start tracking a connection that was established before it was watched (a proxy's
/// connection pool, open before the agent started): at the first request it carries, that
/// is, at a client→server segment with payload on an established socket of a watched
/// endpoint. Its close is seen by `ra_destroy`. `None` if it is not to be tracked.
///
/// Also a client-side connection whose first response arrives before the established callback
/// has run: TCP Fast Open, the request in the SYN. While the connecting socket is busy in the
/// sender's own call, the SYN-ACK and the response wait in its backlog, and this program sees
/// the response on a socket still in SYN_SENT; or the SYN-ACK is being processed on another
/// CPU, the socket already ESTABLISHED but the callback not run yet. Either way the request is
/// started here and the response counted; the callback finds the connection tracked.
#[inline(always)]
fn adopt(ctx: &SkBuffContext, ingress: bool, segment: &packet::Segment) -> Option<*mut ConnState> {
    if segment.payload_len == 0 {
        return None;
    }
    let skb = ctx.as_ptr().cast::<__sk_buff>();
    // Only a full socket, established or connecting: a listener's segment completes a
    // handshake, and is only noted.
    // SAFETY: `sk` is read from the program's own context.
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return None;
    }
    // SAFETY: the helper checks the pointer it is given.
    let full = unsafe { bpf_sk_fullsock(sk) };
    if full.is_null() {
        return None;
    }
    // SAFETY: checked not null above; a full socket's state field.
    let state = unsafe { (*full).state };
    if state == BPF_TCP_LISTEN && ingress {
        // SAFETY: as above.
        note_early_payload(ctx, segment, unsafe { (*full).src_port } as u16);
        return None;
    }
    if state != BPF_TCP_ESTABLISHED && state != BPF_TCP_SYN_SENT {
        return None;
    }
    let mut found = Adoption {
        watch: WatchValue::default(),
        side: Side::Server,
        request_end: 0,
        request_in_syn: false,
    };
    if !adoption(ctx, full, state, ingress, &mut found) {
        return None;
    }
    adopt_as(full, &found)
}

/// A connection `adopt` is to track: its watch, seen from `side`, and where the request that
/// went in its SYN ends (`request_in_syn`).
struct Adoption {
    watch: WatchValue,
    side: Side,
    request_end: u32,
    request_in_syn: bool,
}

/// Whether a full socket `full` in `state` (ESTABLISHED or SYN_SENT) is to be adopted at this
/// segment, and as what (into `found`). A function of its own, as is `adopt_as`: called one
/// after the other, their stacks (the addresses read here, the state stored there) are not
/// added together, nor to `note_early_payload`'s.
#[inline(never)]
fn adoption(
    ctx: &SkBuffContext,
    full: *mut bpf_sock,
    state: u32,
    ingress: bool,
    found: &mut Adoption,
) -> bool {
    let skb = ctx.as_ptr().cast::<__sk_buff>();
    let a = addresses!(skb);
    let (side, watch) = match endpoint_of(&a, Side::Server).and_then(|e| matching_watch(&e)) {
        Some(watch) => (Side::Server, watch),
        None => match endpoint_of(&a, Side::Client).and_then(|e| matching_watch(&e)) {
            Some(watch) => (Side::Client, watch),
            None => return false,
        },
    };
    // A request begins with client data: an established connection is adopted there. Server
    // data is taken only on the client side, as the first response of a connection whose
    // request went in the SYN: nothing received yet, something sent.
    let request_end = if (side == Side::Server) == ingress {
        if state != BPF_TCP_ESTABLISHED || setting(Setting::AdoptionOff) != 0 {
            return false;
        }
        None
    } else if side == Side::Client {
        // SAFETY: the helper checks the full socket it is given.
        let tcp = unsafe { bpf_tcp_sock(full) };
        if tcp.is_null() {
            return false;
        }
        // SAFETY: checked not null above; plain fields of the TCP socket.
        let (received, data_sent, snd_nxt) =
            unsafe { ((*tcp).bytes_received, (*tcp).data_segs_out, (*tcp).snd_nxt) };
        if received != 0 || data_sent == 0 {
            return false;
        }
        Some(snd_nxt)
    } else {
        return false;
    };
    *found = Adoption {
        watch,
        side,
        request_end: request_end.unwrap_or(0),
        request_in_syn: request_end.is_some(),
    };
    true
}

/// Start tracking the full socket `full` as `found` says: its state, or `None` if the kernel
/// could not allocate it.
#[inline(never)]
fn adopt_as(full: *mut bpf_sock, found: &Adoption) -> Option<*mut ConnState> {
    let mut conn = ConnState::new(&found.watch, found.side);
    let early_delta = if found.request_in_syn {
        // The request went in the SYN: it ends where the sent bytes end.
        conn.turn.on_early_request(found.request_end, 0)
    } else {
        TurnDelta::default()
    };
    let state = match store(full, &mut conn, MADE_AT_SEGMENT) {
        Some(Stored::Mine(state)) => state,
        // Stored meanwhile by the established callback, with the request started.
        Some(Stored::Theirs(state)) => return Some(state),
        None => {
            // No memory for the state: tried again at the connection's next request.
            counters::probe_stat(&PROBE_STATS, ProbeStat::AdoptionsRefused);
            return None;
        }
    };
    if !found.request_in_syn {
        counters::probe_stat(&PROBE_STATS, ProbeStat::ConnectionsAdopted);
    }
    count_opened(&conn, &early_delta);
    Some(state)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
