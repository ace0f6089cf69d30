//! The first flight of an HTTP/2 connection that came with its handshake: the client's
//! preface and the frames sent with it (h2load sends a hundred HEADERS before it has the
//! server's SETTINGS), which reach the listener before the connection exists (TCP_DEFER_ACCEPT,
//! TCP Fast Open, a lost third ACK). The ingress program parks it under an id of the client's
//! (`parking::park_first_flight`); the established callback walks it here, before the state is
//! stored: nothing of the connection is sent or walked before the server has read it.

use retry_after_common::{ConnState, ProbeStat, Protocol, h2::Detected, tls::Sender};

use crate::{
    counters,
    h2_walk::{H2_LOOP, H2_OFF, cut, walk_taking_steps},
    maps::{PROBE_STATS, live_counters},
    parking, steps,
};

/// Make `conn` (not stored yet), whose socket's cookie is `cookie`, HTTP/2 from the preface
/// that begins its first flight, parked under `id` at `seq`: framed there, to be walked by
/// [`walk`] once stored. A flight not found (the map dropped it) is counted as unwalked, and
/// the connection is told apart at its next segment as any other.
#[inline(always)]
pub(crate) fn detect(conn: &mut ConnState, cookie: u64, (id, seq): (u64, u32)) {
    let Some(payload) = parking::parked_payload(id, seq) else {
        counters::probe_stat(&PROBE_STATS, ProbeStat::Http2FirstFlightsUnwalked);
        return;
    };
    let protocol = Protocol::from_u32(u32::from(conn.protocol));
    if protocol.may_be_http2()
        && conn.client_frames.detect(seq, &payload, protocol) == Detected::Http2
    {
        conn.h2_connection = cookie;
    }
}

/// Walk the first flight parked under `id` at `seq` for `conn`, made HTTP/2 by [`detect`], as
/// `H2` says (`segments.rs`): moved to the connection's own key first (the steps read parked
/// bytes by it), its streams counted, the parked bytes dropped. One walked in steps that
/// runs out of them is counted as cut; one that cannot be moved (the map full), as unwalked.
#[inline(always)]
pub(crate) fn walk<const H2: u8>(conn: &mut ConnState, (id, seq): (u64, u32)) {
    let connection = conn.h2_connection;
    if connection == 0 || conn.client_frames.walked_to() != Some(seq) {
        parking::release(id, seq);
        return;
    }
    let moved = parking::move_parked((id, connection), seq);
    parking::release(id, seq);
    let Some(payload) = moved else {
        counters::probe_stat(&PROBE_STATS, ProbeStat::Http2FirstFlightsUnwalked);
        return;
    };
    let len = payload.bytes_len();
    if H2 == H2_OFF {
        counters::probe_stat(&PROBE_STATS, ProbeStat::Http2ConnectionsLeftOut);
    } else if let Some(c) = live_counters::<false>(conn) {
        let at = ((seq, len), steps::Source::Parked(seq));
        let paused = walk_taking_steps(conn, c.values(), at, &payload, Sender::Client, |level| {
            if H2 == H2_LOOP {
                steps::take_parked_steps::<true>(level);
            } else {
                steps::take_parked_steps::<false>(level);
            }
        });
        if paused {
            cut(conn, Sender::Client);
        }
    }
    parking::release(connection, seq);
}
