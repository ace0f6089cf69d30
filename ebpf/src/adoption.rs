//! Adoption: tracking, from the segment path, a connection whose established callback was not
//! seen (open before it was watched, or a client whose first response overtook the callback),
//! and noting the first bytes that reach a watched listener with the handshake.

use aya_ebpf::{
    EbpfContext,
    bindings::{
        __sk_buff, BPF_TCP_ESTABLISHED, BPF_TCP_LISTEN, BPF_TCP_SYN_RECV, BPF_TCP_SYN_SENT,
        bpf_sock,
    },
    helpers::{bpf_sk_fullsock, bpf_tcp_sock},
    programs::SkBuffContext,
};
use retry_after_common::{ConnState, ProbeStat, Setting, Side, WatchValue, turn::TurnDelta};

use crate::{
    addresses::{addresses, endpoint_of},
    counters,
    lifecycle::count_opened,
    maps::{
        EARLY_FIRST_FLIGHT, EARLY_NOT_A_REQUEST, EARLY_OTHER, EARLY_PAYLOADS, HandshakePeer,
        MADE_AT_SEGMENT, PROBE_STATS, Stored, matching_watch, setting, store,
    },
    packet, parking,
};

/// Start tracking a connection that was established before it was watched (a proxy's
/// connection pool, open before the agent started): at the first request it carries, that
/// is, at a client→server segment with payload on an established socket of a watched
/// endpoint. Its close is seen by `ra_destroy`. `None` if it is not to be tracked.
///
/// Also a server-side connection whose request arrives before the established callback has
/// run: the segment completing the handshake made the socket and is still being processed on
/// one CPU (the socket in SYN_RECV, the callback to come) while the request's segment passes
/// this program on another. The callback then finds neither bytes counted nor a note, and the
/// request would be missed; it is started here, and the callback finds the connection tracked
/// (and asks for its close, as for any connection it sees).
///
/// Also a client-side connection whose first response arrives before the established callback
/// has run: TCP Fast Open, the request in the SYN. While the connecting socket is busy in the
/// sender's own call, the SYN-ACK and the response wait in its backlog, and this program sees
/// the response on a socket still in SYN_SENT; or the SYN-ACK is being processed on another
/// CPU, the socket already ESTABLISHED but the callback not run yet. Either way the request is
/// started here and the response counted; the callback finds the connection tracked.
#[inline(always)]
pub(crate) fn adopt(
    ctx: &SkBuffContext,
    ingress: bool,
    segment: &packet::Segment,
) -> Option<*mut ConnState> {
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
    if state != BPF_TCP_ESTABLISHED && state != BPF_TCP_SYN_SENT && state != BPF_TCP_SYN_RECV {
        return None;
    }
    let mut found = Adoption {
        watch: WatchValue::default(),
        side: Side::Server,
        request_end: 0,
        request_in_syn: false,
        open_before: false,
    };
    if !adoption(ctx, full, state, ingress, &mut found) {
        return None;
    }
    adopt_as(full, &found)
}

/// A connection `adopt` is to track: its watch, seen from `side`, where the request that went
/// in its SYN ends (`request_in_syn`), and whether it was open before it was watched (counted
/// as adopted) rather than made a moment ago, its callback still to come.
struct Adoption {
    watch: WatchValue,
    side: Side,
    request_end: u32,
    request_in_syn: bool,
    open_before: bool,
}

/// Whether a full socket `full` in `state` (ESTABLISHED, SYN_SENT or SYN_RECV) is to be
/// adopted at this segment, and as what (into `found`). A function of its own, as is `adopt_as`: called one
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
    let mut open_before = false;
    let request_end = if side == Side::Server && ingress && state == BPF_TCP_SYN_RECV {
        // The request overtook the established callback, which will ask for the close even
        // where adoption is off (see `adopt`).
        None
    } else if (side == Side::Server) == ingress {
        if state != BPF_TCP_ESTABLISHED || setting(Setting::AdoptionOff) != 0 {
            return false;
        }
        open_before = true;
        None
    } else if side == Side::Client && state != BPF_TCP_SYN_RECV {
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
        open_before,
    };
    true
}

/// Start tracking the full socket `full` as `found` says: its state, or `None` if the kernel
/// could not allocate it.
#[inline(never)]
fn adopt_as(full: *mut bpf_sock, found: &Adoption) -> Option<*mut ConnState> {
    let mut conn = ConnState::new(&found.watch, found.side);
    if found.request_in_syn {
        // The request went in the SYN: it ends where the sent bytes end.
        conn.turn.on_early_request(found.request_end, 0);
    }
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
    if found.open_before {
        counters::probe_stat(&PROBE_STATS, ProbeStat::ConnectionsAdopted);
    }
    // What the early request counted, made after the helpers' calls rather than kept across
    // them: kept, it took this function's stack past what 5.10 and 6.1 allow a chain of
    // calls (512 bytes, each frame rounded up to 32).
    let early_delta = TurnDelta {
        started: u16::from(found.request_in_syn),
        ..TurnDelta::default()
    };
    count_opened(&conn, &early_delta);
    Some(state)
}

/// A segment with payload reached a watched listener: it completes a handshake (or is a SYN
/// with data) and carries the client's first bytes. Note the client, and whether the bytes
/// begin a TLS ClientHello or the HTTP/2 preface (`EARLY_PAYLOADS`). A segment that begins
/// with the preface (the first flight: the preface and the frames sent with it) is parked for
/// the connection established next to walk; one that cannot be is counted as unwalked.
#[inline(never)]
fn note_early_payload(ctx: &SkBuffContext, segment: &packet::Segment, local_port: u16) {
    let Some((addr, port)) = packet::source(ctx, segment) else {
        return;
    };
    let peer = HandshakePeer {
        addr,
        port,
        local_port,
    };
    let kind = match ctx.load::<[u8; 5]>(segment.payload_offset as usize) {
        Ok(first) if first == *b"PRI *" => {
            if parking::park_first_flight(ctx, segment, peer.first_flight_id()) {
                EARLY_FIRST_FLIGHT
            } else {
                counters::probe_stat(&PROBE_STATS, ProbeStat::Http2FirstFlightsUnwalked);
                EARLY_NOT_A_REQUEST
            }
        }
        Ok(first) if retry_after_common::tls::is_handshake_header(first) => EARLY_NOT_A_REQUEST,
        _ => EARLY_OTHER,
    };
    let _ = EARLY_PAYLOADS.insert(&peer, &kind, 0);
}
