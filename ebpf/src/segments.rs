//! The segment path: the cgroup_skb programs, which feed every segment of a tracked connection
//! to its turn (through the TLS record walk) or to its HTTP/2 frame walk, and the floor.

use aya_ebpf::{
    EbpfContext,
    bindings::{__sk_buff, BPF_NOEXIST, bpf_sock},
    helpers::{bpf_get_socket_cookie, bpf_skb_ancestor_cgroup_id, bpf_skb_cgroup_id},
    macros::cgroup_skb,
    programs::SkBuffContext,
};
use retry_after_common::{
    ConnState, EndpointCounters, Payload, ProbeStat, Protocol, Side,
    h2::{Detected, ParkedPlaces},
    http1::{Framed, is_head_request},
    tls::{Sender, Walked},
    turn::{PHASE_REQUEST, ResponseStart, STATUS_LINE_PREFIX, TurnDelta},
};

use crate::{
    adoption::adopt,
    counters, exchange,
    h2_walk::{H2_LOOP, H2_OFF, H2_STEPS, cut, walk_in_steps},
    http1,
    lifecycle::count_opened,
    maps::{PROBE_STATS, SCOPES_ENTERED, forget, live_counters, port_watched, tracked},
    packet, parking, steps, walk_lock,
};

/// A segment arrives at a local socket.
#[cgroup_skb(ingress)]
fn ra_ingress(ctx: SkBuffContext) -> i32 {
    if ports_watched(&ctx) {
        on_segment::<true, H2_LOOP>(&ctx);
    }
    1
}

/// `ra_ingress` walking HTTP/2 frames in steps, for kernels without `bpf_loop` (`steps.rs`).
#[cgroup_skb(ingress)]
fn ra_ingress_step(ctx: SkBuffContext) -> i32 {
    if ports_watched(&ctx) {
        on_segment::<true, H2_STEPS>(&ctx);
    }
    1
}

/// `ra_ingress` without HTTP/2 streams, for kernels that refuse both builds that count them:
/// an HTTP/2 connection is left out, and counted as such.
#[cgroup_skb(ingress)]
fn ra_ingress_noh2(ctx: SkBuffContext) -> i32 {
    if ports_watched(&ctx) {
        on_segment::<true, H2_OFF>(&ctx);
    }
    1
}

/// A local socket sends a segment.
#[cgroup_skb(egress)]
fn ra_egress(ctx: SkBuffContext) -> i32 {
    if ports_watched(&ctx) {
        on_segment::<false, H2_LOOP>(&ctx);
    }
    1
}

/// `ra_egress` walking HTTP/2 frames in steps (see `ra_ingress_step`).
#[cgroup_skb(egress)]
fn ra_egress_step(ctx: SkBuffContext) -> i32 {
    if ports_watched(&ctx) {
        on_segment::<false, H2_STEPS>(&ctx);
    }
    1
}

/// `ra_egress` without HTTP/2 streams (see `ra_ingress_noh2`).
#[cgroup_skb(egress)]
fn ra_egress_noh2(ctx: SkBuffContext) -> i32 {
    if ports_watched(&ctx) {
        on_segment::<false, H2_OFF>(&ctx);
    }
    1
}

/// The rest of a received segment whose HTTP/2 walk paused, in the build that walks in steps:
/// reached by a tail call from `ra_ingress_step` or from itself; then the parked segments, as
/// after any segment. Never attached.
#[cgroup_skb(ingress)]
fn ra_ingress_more(ctx: SkBuffContext) -> i32 {
    walk_rest::<true>(&ctx);
    1
}

/// The rest of a sent segment whose HTTP/2 walk paused (see `ra_ingress_more`).
#[cgroup_skb(egress)]
fn ra_egress_more(ctx: SkBuffContext) -> i32 {
    walk_rest::<false>(&ctx);
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

/// A segment of any socket, seen on ingress (`INGRESS`) or egress: a constant, so each
/// program's copy carries only its own direction's paths, and its own way of counting.
/// HTTP/2 connections are counted as `H2` says (`H2_OFF`, `H2_LOOP`, `H2_STEPS`).
fn on_segment<const INGRESS: bool, const H2: u8>(ctx: &SkBuffContext) {
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
    let sender = sender_of(conn, ingress);
    let payload = packet::SegmentPayload::new(ctx, segment.payload_offset);
    match streams_or_turns::<INGRESS, H2>(ctx, conn, c, &segment, &payload, sender) {
        // Nothing runs after it: the verifier checks the rest of this path once, not once for
        // each way out of the frame walk.
        Counted::ByStreams => {
            // What a vantage point receives is walked by one CPU at a time (`walk_lock`).
            if H2 != H2_OFF && INGRESS {
                walk_lock::take(conn.h2_connection);
            }
            // A segment the ingress program sees ahead of a gap is parked, and walked (with
            // whatever else was parked) once the gap fills: the walk sees the bytes in order.
            if H2 != H2_OFF
                && !(INGRESS && parking::park(ctx, sk, conn, &segment, sender))
                && http2_segment::<H2>(conn, c.values(), &segment, &payload, sender)
            {
                // Paused (walking in steps): the rest in the next program of the chain.
                steps::walk_more::<INGRESS>(ctx);
                cut(conn, sender);
            }
            // The parked segments are walked by a program of their own, which the verifier
            // checks apart: this one ends here, and the walk goes on held by this CPU, which
            // that program gives back. After every segment, parked or walked: a chain of tail
            // calls ends after 33, and what it left is walked at the next.
            if H2 != H2_OFF && INGRESS && parking::any_parked(sk) {
                parking::walk_parked_next(ctx);
            }
            // No tail call (nothing parked, or the chain's end): the walk is given back here.
            if H2 != H2_OFF && INGRESS {
                walk_lock::give_back(conn.h2_connection);
            }
        }
        Counted::NotAtAll => {}
        Counted::ByTurns => {
            let delta = match sender {
                Sender::Client => {
                    let walked = walk_records(conn, &segment, &payload, Sender::Client);
                    client_segment::<INGRESS, H2>(ctx, conn, c, &segment, (&payload, &walked))
                }
                Sender::Server => {
                    let walked = walk_records(conn, &segment, &payload, Sender::Server);
                    server_segment::<INGRESS, H2>(ctx, conn, &segment, &payload, &walked)
                }
            };
            counters::time_first_byte(conn, c, &delta);
            // SAFETY: `c` is this CPU's copy of a live map value.
            unsafe { c.apply(&delta) };
        }
    }
}

/// Who sent a segment of `conn` seen on ingress (`ingress`) or egress: on the server side,
/// what arrives is the client's.
#[inline(always)]
fn sender_of(conn: &ConnState, ingress: bool) -> Sender {
    if (conn.side == Side::Server as u8) == ingress {
        Sender::Client
    } else {
        Sender::Server
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
/// client is inside the proxy's cgroup (the scope is then settled, and the connection counted
/// opened with any request that came with the handshake, once: an ingress and an egress
/// segment can both find the scope open, on two CPUs), false if not yet known or outside
/// (then forgotten).
#[inline(always)]
fn enter_scope(skb: *mut __sk_buff, sk: *mut bpf_sock, conn: &mut ConnState) -> bool {
    // SAFETY: the helpers only read the packet's socket.
    let ancestor = unsafe { bpf_skb_ancestor_cgroup_id(skb, conn.scope_level as i32) };
    // 0 from both: no full socket on this segment, decide on the next one. 0 only from
    // the ancestor: the socket's cgroup is shallower than the scope, so outside it.
    // SAFETY: as above.
    if ancestor == 0 && unsafe { bpf_skb_cgroup_id(skb) } == 0 {
        return false;
    }
    if ancestor != conn.scope_cgroup {
        counters::probe_stat(&PROBE_STATS, ProbeStat::ConnectionsOutOfScope);
        forget(sk);
        return false;
    }
    // No segment was fed to the turn before this one, so an open request is one that came
    // with the handshake (TCP Fast Open), started but not counted while the scope was open.
    let early = TurnDelta {
        started: u16::from(conn.turn.phase() == PHASE_REQUEST),
        ..TurnDelta::default()
    };
    conn.scope_cgroup = 0;
    // Counted by one of the segments that found the scope open, once.
    // SAFETY: the helper reads the context's socket.
    let cookie = unsafe { bpf_get_socket_cookie(skb.cast()) };
    if SCOPES_ENTERED
        .insert(&cookie, &0, u64::from(BPF_NOEXIST))
        .is_ok()
    {
        count_opened(conn, &early);
    }
    true
}

/// A segment from the client, its records walked (`walked`): a ClientHello found withdraws
/// what the turn counted as plaintext, then the turn is moved by the request bytes it carries
/// (a plaintext request's method read where one may begin: a `HEAD` has no response body).
#[inline(always)]
fn client_segment<const INGRESS: bool, const H2: u8>(
    ctx: &SkBuffContext,
    conn: &mut ConnState,
    c: counters::Counters<INGRESS>,
    segment: &packet::Segment,
    (payload, walked): (&packet::SegmentPayload, &Walked),
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
    let head = walked.plaintext
        && segment.payload_len >= 4
        && conn.turn.may_begin_request()
        && payload.bytes_at(0, 4).is_some_and(is_head_request);
    if INGRESS && H2 == H2_LOOP {
        // What this vantage point receives may arrive on two CPUs at once (`exchange.rs`).
        let at = u64::from(segment.seq) | u64::from(len) << 32;
        let ack = u64::from(segment.ack) | u64::from(segment.has_ack) << 32;
        exchange::received_by_exchange(|last| {
            exchange::ra_client_turn(ctx.as_ptr().cast(), at, ack, u64::from(head), last)
        });
        return TurnDelta::default();
    }
    conn.turn.on_client_segment(segment.seq, len, ack, head)
}

/// A segment from the server, its records walked (`walked`): the turn moved by the response
/// bytes it carries, and on a plaintext connection by what their HTTP/1.1 framing tells
/// (walked as `H2` says the build steps: in one loop, in a loop of fixed bound, or not at all
/// in the build for kernels that refuse both).
#[inline(always)]
fn server_segment<const INGRESS: bool, const H2: u8>(
    ctx: &SkBuffContext,
    conn: &mut ConnState,
    segment: &packet::Segment,
    payload: &packet::SegmentPayload,
    walked: &Walked,
) -> TurnDelta {
    if !(walked.plaintext || walked.message) {
        return TurnDelta::default();
    }
    let at = (segment.seq, segment.payload_len);
    let expected = conn.turn.expected();
    let framed = match H2 {
        _ if !walked.plaintext => Framed::default(),
        H2_LOOP => http1::walk_response::<true>(conn, at, payload, expected),
        H2_STEPS => http1::walk_response::<false>(conn, at, payload, expected),
        _ => Framed::default(),
    };
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
    if INGRESS && H2 == H2_LOOP {
        // What this vantage point receives may arrive on two CPUs at once (`exchange.rs`).
        let at = u64::from(segment.seq) | u64::from(segment.payload_len) << 32;
        let start = u64::from(start.to_u8()) | u64::from(segment.push) << 8;
        let framed = u64::from(framed.to_bits());
        exchange::received_by_exchange(|last| {
            exchange::ra_server_turn(ctx.as_ptr().cast(), at, start, framed, last)
        });
        return TurnDelta::default();
    }
    conn.turn.on_server_segment(
        segment.seq,
        segment.payload_len,
        segment.push,
        (start, framed),
    )
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
/// request that came with the handshake and was the preface is withdrawn. With `H2_OFF`, an
/// HTTP/2 connection is not counted at all (and counted as left out, once).
#[inline(always)]
fn streams_or_turns<const INGRESS: bool, const H2: u8>(
    ctx: &SkBuffContext,
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
    // A segment ahead of the client's first bytes (one of them lost, or reordered) cannot
    // tell what the connection is: it waits for them, parked as ahead of the walk (see
    // `FrameStream::expect_first`).
    if sender == Sender::Client
        && segment.payload_len > 0
        && !conn.client_frames.is_detected()
        && !conn.client_frames.is_ahead(segment.seq)
        && conn.client_frames.detect(segment.seq, payload, protocol) == Detected::Http2
    {
        // SAFETY: the helper reads the context's socket.
        conn.h2_connection = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
        let withdrawn = conn.turn.on_early_bytes_not_a_request();
        // SAFETY: `c` is this CPU's copy of a live map value.
        unsafe { c.apply(&withdrawn) };
        if H2 == H2_OFF {
            counters::probe_stat(&PROBE_STATS, ProbeStat::Http2ConnectionsLeftOut);
        }
    }
    // Taken for HTTP/2 before the client's first bytes were looked at (see above), the
    // server's bytes before them are not: a server that speaks first is not HTTP/2.
    if conn.client_frames.is_http2()
        && (sender == Sender::Client || conn.client_frames.is_detected())
    {
        if H2 != H2_OFF {
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

/// Count what a segment of an HTTP/2 connection, sent by `sender`, did to its streams, its
/// frames walked as `H2` says: true if the walk paused (walking in steps), to go on in the
/// next program.
#[inline(always)]
fn http2_segment<const H2: u8>(
    conn: &mut ConnState,
    c: *mut EndpointCounters,
    segment: &packet::Segment,
    payload: &packet::SegmentPayload,
    sender: Sender,
) -> bool {
    let at = (segment.seq, segment.payload_len);
    let source = steps::Source::Packet(payload.offset());
    walk_in_steps::<_, H2>(payload.ctx(), conn, c, (at, source), payload, sender)
}

/// `ra_ingress_more` and `ra_egress_more`: walk the segment again from where its walk paused,
/// and on in the next program if it pauses again; after a received one, the parked segments.
/// The walk of what a vantage point receives is given back here at the chain's end, by the
/// socket's cookie, even if the connection's state is gone.
#[inline(always)]
fn walk_rest<const INGRESS: bool>(ctx: &SkBuffContext) {
    let skb = ctx.as_ptr().cast::<__sk_buff>();
    // SAFETY: the context's socket field, a plain load.
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return;
    }
    if let Some(conn) = tracked(sk) {
        // SAFETY: `conn` points at the socket's live state.
        let conn = unsafe { &mut *conn };
        let segment = packet::parse_tcp(ctx);
        if let Some(c) = live_counters::<INGRESS>(conn)
            && segment.parsed
        {
            let payload = packet::SegmentPayload::new(ctx, segment.payload_offset);
            let sender = sender_of(conn, INGRESS);
            if http2_segment::<H2_STEPS>(conn, c.values(), &segment, &payload, sender) {
                steps::walk_more::<INGRESS>(ctx);
                cut(conn, sender);
            }
            if INGRESS && parking::any_parked(sk) {
                parking::walk_parked_next(ctx);
            }
        }
    }
    if INGRESS {
        // SAFETY: the helper reads the context's socket.
        walk_lock::give_back(unsafe { bpf_get_socket_cookie(ctx.as_ptr()) });
    }
}

/// Parked segments of a tracked HTTP/2 connection, walked one per run: the ingress program
/// tail-calls this one after a segment, and it calls itself while one more continues where
/// the walk has got to. Never attached; reached only by tail calls, always on the CPU that
/// holds the connection's walk (`walk_lock`), which the last of the chain gives back.
#[cgroup_skb(ingress)]
fn ra_ingress_parked(ctx: SkBuffContext) -> i32 {
    walk_parked::<H2_LOOP>(&ctx);
    1
}

/// `ra_ingress_parked` of the build that walks in steps: a parked segment whose walk pauses
/// is put back in its place, and the next program of the chain walks on from the pause.
#[cgroup_skb(ingress)]
fn ra_parked_step(ctx: SkBuffContext) -> i32 {
    walk_parked::<H2_STEPS>(&ctx);
    1
}

/// The body of `ra_ingress_parked` and `ra_parked_step`, walking as `H2` says.
#[inline(always)]
fn walk_parked<const H2: u8>(ctx: &SkBuffContext) {
    let skb = ctx.as_ptr().cast::<__sk_buff>();
    // SAFETY: the context's socket field, a plain load.
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return;
    }
    let conn = tracked(sk);
    if let Some(conn) = conn {
        // SAFETY: `conn` points at the socket's live state.
        let conn = unsafe { &mut *conn };
        if let Some(c) = live_counters::<true>(conn)
            && let Some(places) = parking::places(sk, false)
            && walk_one_parked::<H2>(ctx, conn, places, c.values(), sender_of(conn, true))
        {
            // Returns only at the chain's end.
            parking::walk_parked_next(ctx);
        }
    }
    // SAFETY: the helper reads the context's socket.
    walk_lock::give_back(unsafe { bpf_get_socket_cookie(ctx.as_ptr()) });
}

/// Walk the segment parked in `places` of `conn` that continues where the walk of `sender`'s
/// bytes has got to, counting what it did: true if there was one. One whose walk paused goes
/// back in its place, to be found again by the byte the walk paused at.
#[inline(always)]
fn walk_one_parked<const H2: u8>(
    ctx: &SkBuffContext,
    conn: &mut ConnState,
    places: &mut ParkedPlaces,
    c: *mut EndpointCounters,
    sender: Sender,
) -> bool {
    let Some(at) = conn.frames(sender).walked_to() else {
        return false;
    };
    let Some((parked, payload)) = parking::take(conn.h2_connection, places, at) else {
        return false;
    };
    let at = ((parked.seq, parked.len), steps::Source::Parked(parked.seq));
    let paused = walk_in_steps::<_, H2>(ctx, conn, c, at, &payload, sender);
    if paused {
        parking::put_back(places, parked);
    } else {
        parking::release(conn.h2_connection, parked.seq);
    }
    true
}

/// Walk the TLS records of one segment sent by `sender` (the other direction's framing flags
/// tell the TLS 1.3 handshake apart), counting a segment whose framing is lost.
///
/// Generic over the payload, as the walk it calls is: the compiler inlines functions in the
/// order of their symbol names, and a generic function's name keeps this one ahead of the TLS
/// walk's own methods, as it was when it stood at the crate root. Not generic, it sorts after
/// them, and the segment programs come out a few instructions different.
#[inline(always)]
fn walk_records<P: Payload>(
    conn: &mut ConnState,
    segment: &packet::Segment,
    payload: &P,
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
