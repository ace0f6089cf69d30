//! A connection's life: the sock_ops program (established, closed) and the `tcp_destroy_sock`
//! tracepoint (the close of a connection adopted after it opened), and what they count.

use core::{
    ffi::c_void,
    ptr::{null_mut, read_volatile},
};

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_TCP_CLOSE,
    },
    helpers::{bpf_get_socket_cookie, bpf_ktime_get_ns},
    macros::{btf_tracepoint, sock_ops},
    programs::{BtfTracePointContext, SockOpsContext},
};
use aya_log_ebpf::{debug, warn};
use retry_after_common::{ConnState, ProbeStat, Protocol, Side, WatchValue, turn::TurnDelta};

use crate::{
    addresses::{Addresses, addresses, endpoint_of},
    counters, first_flight,
    h2_walk::{H2_LOOP, H2_OFF, H2_STEPS},
    maps::{
        EARLY_FIRST_FLIGHT, EARLY_NOT_A_REQUEST, EARLY_PAYLOADS, HandshakePeer,
        MADE_AT_ESTABLISHED, PROBE_STATS, Stored, forget, live_counters, matching_watch, store,
        tracked,
    },
    parking, streams, walk_lock,
};

/// Connection establishment and close.
#[sock_ops]
fn ra_sockops(ctx: SockOpsContext) -> u32 {
    sockops::<H2_LOOP>(&ctx)
}

/// `ra_sockops` walking a first flight in steps, for kernels without `bpf_loop` (`steps.rs`).
#[sock_ops]
fn ra_sockops_step(ctx: SockOpsContext) -> u32 {
    sockops::<H2_STEPS>(&ctx)
}

/// `ra_sockops` without HTTP/2 streams, for kernels that refuse both builds that count them.
#[sock_ops]
fn ra_sockops_noh2(ctx: SockOpsContext) -> u32 {
    sockops::<H2_OFF>(&ctx)
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

/// The sock_ops callbacks, counting HTTP/2 streams as `H2` says (`segments.rs`).
#[inline(always)]
fn sockops<const H2: u8>(ctx: &SockOpsContext) -> u32 {
    match ctx.op() {
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => on_established::<H2>(ctx, Side::Server),
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => on_established::<H2>(ctx, Side::Client),
        BPF_SOCK_OPS_STATE_CB if ctx.arg(1) == BPF_TCP_CLOSE => on_close::<H2>(ctx),
        _ => {}
    }
    // sock_ops return values are ignored for these callbacks; 1 means "handled".
    1
}

/// A connection of a watched endpoint is established: start tracking it. Two functions of
/// their own, called one after the other, so their stacks (the addresses read by the first,
/// the state built by the second) are never added together: Debian's 6.1 rounds each frame
/// up to 32 bytes and refuses a call chain over 512 (6.12 does not round a leaf up).
#[inline(always)]
fn on_established<const H2: u8>(ctx: &SockOpsContext, side: Side) {
    let mut found = Established {
        watch: WatchValue::default(),
        sk: null_mut(),
        port: 0,
        early_end: 0,
        early_bytes: 0,
        early: false,
        first_flight: 0,
        client_first_seq: 0,
        expect_first: false,
    };
    if !established_watch(ctx, side, &mut found) {
        return;
    }
    // Only a build that counts HTTP/2 streams parks what arrives ahead of the first byte.
    found.expect_first &= H2 != H2_OFF;
    if let Some(conn) = track_established(ctx, side, &found)
        && found.first_flight != 0
    {
        walk_first_flight::<H2>(conn, (found.first_flight, found.client_first_seq));
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
    /// The id its first flight is parked under (`parking::park_first_flight`), 0 if none,
    /// and the client's first byte (the flight's, or the one still to come).
    first_flight: u64,
    client_first_seq: u32,
    /// Nothing of the client's came with the handshake: its first byte, at
    /// `client_first_seq`, is still to come (`FrameStream::expect_first`).
    expect_first: bool,
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
    let note = match side {
        Side::Server => take_early_payload(&a),
        Side::Client => None,
    };
    if let Some((end, bytes)) = early_request(ctx, note, side) {
        found.early_end = end;
        found.early_bytes = bytes;
        found.early = true;
    }
    // The client's first byte: where the socket's next one is expected (bytes that came with
    // the handshake are not queued yet, see `early_request`).
    found.client_first_seq = next_expected(ctx);
    match note {
        Some((EARLY_FIRST_FLIGHT, id)) => found.first_flight = id,
        None => {
            found.expect_first = side == Side::Server
                && !found.early
                && Protocol::from_u32(watch.protocol).may_be_http2();
        }
        Some(_) => {}
    }
    true
}

/// Start tracking the connection `found` describes, seen from `side`, and count it opened:
/// its state, if this callback stored it.
#[inline(never)]
fn track_established(
    ctx: &SockOpsContext,
    side: Side,
    found: &Established,
) -> Option<*mut ConnState> {
    let mut conn = ConnState::new(&found.watch, side);
    conn.server_framing
        .expect_first(server_first_seq(ctx, side));
    // A request that came with the handshake: its bytes passed before this connection was
    // tracked (see `early_request`). The state is complete before it is stored, so a segment
    // on another CPU never finds it without its request.
    let early_delta = if found.early {
        // SAFETY: the helper takes no argument.
        conn.time_request(unsafe { bpf_ktime_get_ns() });
        conn.turn
            .on_early_request(found.early_end, found.early_bytes)
    } else {
        TurnDelta::default()
    };
    // Likewise a first flight: the connection is HTTP/2 from its preface, framed there. Or
    // where the client's first byte is still to come, what arrives ahead of it waits for it.
    // SAFETY: the helper reads the context's socket.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    if found.expect_first {
        conn.client_frames.expect_first(found.client_first_seq);
        // What is parked ahead of the first byte is keyed by it.
        conn.h2_connection = cookie;
    }
    if found.first_flight != 0 {
        first_flight::detect(
            &mut conn,
            cookie,
            (found.first_flight, found.client_first_seq),
        );
    }
    let state = match store(found.sk, &mut conn, MADE_AT_ESTABLISHED) {
        Some(Stored::Mine(state)) => state,
        // Its first response arrived before this callback, and started it (see `adopt`).
        Some(Stored::Theirs(_)) => return None,
        None => {
            counters::probe_stat(&PROBE_STATS, ProbeStat::ConnectionsUntracked);
            warn!(ctx, "cannot track connection on port {}", found.port);
            return None;
        }
    };
    count_opened(&conn, &early_delta);
    debug!(
        ctx,
        "tracking {} connection on port {}", side as u32, found.port
    );
    Some(state)
}

/// Walk the first flight parked under `id` at `seq` for the connection just stored at
/// `conn`, holding its walk (a segment that follows the flight may be on another CPU now). A
/// function of its own, after the one that built the state: their stacks are never added
/// together.
#[inline(never)]
fn walk_first_flight<const H2: u8>(conn: *mut ConnState, flight: (u64, u32)) {
    // SAFETY: the socket's live state, stored by this callback.
    let conn = unsafe { &mut *conn };
    let connection = conn.h2_connection;
    walk_lock::take(connection);
    first_flight::walk::<H2>(conn, flight);
    walk_lock::give_back(connection);
}

/// The sequence number of the next byte the socket expects to receive. A function of its own:
/// the verifier takes a context field only read at a constant offset from the context itself,
/// which the compiler, sharing the address with `early_request`'s read, would not keep.
#[inline(never)]
fn next_expected(ctx: &SockOpsContext) -> u32 {
    // SAFETY: `ops` is the sock_ops context the kernel passed in; a plain integer field.
    unsafe { read_volatile(&raw const (*ctx.ops).rcv_nxt) }
}

/// The sequence number of the server's first byte, seen from `side`: the next the server's
/// socket sends, or the next the client's expects.
#[inline(always)]
fn server_first_seq(ctx: &SockOpsContext, side: Side) -> u32 {
    match side {
        Side::Server => next_sent(ctx),
        Side::Client => next_expected(ctx),
    }
}

/// The sequence number of the next byte the socket sends (a function of its own, as
/// [`next_expected`]).
#[inline(never)]
fn next_sent(ctx: &SockOpsContext) -> u32 {
    // SAFETY: `ops` is the sock_ops context the kernel passed in; a plain integer field.
    unsafe { read_volatile(&raw const (*ctx.ops).snd_nxt) }
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
///   request; an HTTP/2 connection's first flight is walked by the callback, see
///   `first_flight`). Without a note (evicted), the kernel's own count tells: it counts the
///   data segment that completes the handshake (`data_segs_in`) before it queues its bytes, so
///   at this callback the bytes may still be 0 while a request is already there.
/// * Client side (TCP Fast Open): the request went out in the SYN, before the connection was
///   tracked; the kernel counted it in `data_segs_out`. If it was a ClientHello, the client's
///   next segment shows TLS records and the turn is withdrawn
///   (`Turn::on_early_bytes_not_a_request`).
fn early_request(ctx: &SockOpsContext, note: Option<(u8, u64)>, side: Side) -> Option<(u32, u32)> {
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
        Side::Server => match note {
            Some((EARLY_NOT_A_REQUEST | EARLY_FIRST_FLIGHT, _)) => None,
            Some(_) => Some((rcv_nxt, bytes(received))),
            None => (data_in > 0 || received > 0).then_some((rcv_nxt, bytes(received))),
        },
        // Its bytes are not counted (as on the server side, where they are not queued yet).
        Side::Client => (data_out > 0).then_some((snd_nxt, 0)),
    }
}

/// The note `note_early_payload` left for this (server-side) connection's client, if any, with
/// the id its first flight would be parked under; the note is used up.
fn take_early_payload(a: &Addresses) -> Option<(u8, u64)> {
    let remote = endpoint_of(a, Side::Client)?;
    let peer = HandshakePeer {
        addr: remote.addr,
        port: remote.port,
        local_port: a.local_port as u16,
    };
    // SAFETY: the value is copied out at once.
    let kind = unsafe { EARLY_PAYLOADS.get(&peer) }.copied()?;
    let _ = EARLY_PAYLOADS.remove(&peer);
    Some((kind, peer.first_flight_id()))
}

/// The state callback saw TCP_CLOSE: close the socket's connection, if it is tracked.
fn on_close<const H2: u8>(ctx: &SockOpsContext) {
    // SAFETY: the context's socket field, a plain load.
    let sk = unsafe { (*ctx.ops).__bindgen_anon_2.sk };
    if sk.is_null() {
        return;
    }
    if H2 == H2_OFF {
        close_tracked::<_, false>(sk);
    } else {
        close_tracked::<_, true>(sk);
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
            // Its open streams are the agent's to abandon, from the table.
            streams::note_close(conn);
            parking::release_all(sk, conn.h2_connection);
            walk_lock::forget(conn.h2_connection);
            TurnDelta::default()
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
pub(crate) fn count_opened(conn: &ConnState, early: &TurnDelta) {
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
