//! Request/response turn-taking on one TCP connection.
//!
//! The kernel shows us TCP segments, not requests. A request/response protocol (HTTP/1.x,
//! Redis, memcached) takes turns: the client sends a request, the server answers, and only then
//! does the client send the next one. So, per connection:
//!
//! * a **request starts** with the first new client→server payload byte after the previous
//!   response (or on a fresh connection);
//! * a **response completes** at its last byte where its framing tells it (an HTTP/1.x
//!   response walked by [`crate::http1`]: the caller passes what the walk found, and a
//!   response whose body ends at the close completes at the close); else when its turn is
//!   over: the client sends the next request, the connection closes, or the connection goes
//!   quiet: the client acknowledges every server→client byte of the turn, and the last of them
//!   carried PSH (TCP sets it on the segment that ends each write, so an ACK that catches up
//!   with a response the server is still writing does not end the turn). A response ended so
//!   while its framing was not known is counted as **inferred** as well.
//!
//! A response whose status line says the request was turned away (`HTTP/1.x 429` or `503`,
//! read by the caller from the response's first bytes) is counted as completed and
//! **rejected** as soon as its write ends (a segment with PSH), without waiting for the
//! client's acknowledgement: a client rejected in microseconds on a keep-alive connection would
//! otherwise stay "in flight" until its next request, and make a queue of what was turned
//! away. A rejection is not drained work.
//!
//! The same segments are seen from both ends (server: requests in, responses out; client: the
//! reverse), so both vantage points reach the same counts. Retransmitted bytes are recognised
//! by sequence number and never start a second turn.
//!
//! **Concurrency.** The two directions of one connection are seen by two programs (ingress and
//! egress) that may run at the same time on two CPUs, or nest on one (a send interrupted by a
//! receive). So the state is two 64-bit words with one writer each: [`Turn::client`] is
//! written only by client→server segments, [`Turn::server`] only by server→client segments.
//! Each event reads the other word once, whole, and writes its own once, whole; the phase is
//! derived from both. No update can be lost to the other direction. (The close is the one
//! event that writes the client word from elsewhere; it comes after both directions are done.)
//! One direction's segments can themselves be received on two CPUs at once; the kernel
//! program stores the receiving direction's word by compare and exchange where it can
//! (`ebpf/src/exchange.rs`), moving a copy of the turn.
//!
//! Where this falls short: pipelined requests (several sent before the first answer) count as
//! one turn; multiplexed protocols (HTTP/2, gRPC) interleave streams on one connection and
//! count as one long turn per burst; a streamed response whose framing is not known (inside
//! TLS, another protocol) and that pauses long enough for the client to acknowledge everything
//! sent so far completes at that pause, and later chunks of it are not counted again.
//!
//! This module is plain integer code so the eBPF programs can run it and host tests can check
//! it.

use core::ptr::{read_volatile, write_volatile};

use crate::{http1, seq_after};

/// No request is open.
pub const PHASE_IDLE: u8 = 0;
/// A request is arriving or being processed; no response byte yet.
pub const PHASE_REQUEST: u8 = 1;
/// Response bytes are flowing.
pub const PHASE_RESPONSE: u8 = 2;

/// Client word: `request_end` holds a sequence number.
const HAVE_REQUEST_END: u8 = 1;
/// Client word: the open request began with bytes that came with the handshake, and no client
/// segment has been seen since: they may yet turn out to be a TLS ClientHello.
const EARLY_REQUEST: u8 = 2;
/// Client word: the open request is a `HEAD` (its response has no body).
const REQUEST_HEAD: u8 = 4;
/// Server word: the highest response byte so far ended a write (its segment carried PSH).
const RESPONSE_PUSHED: u8 = 1;
/// Server word: `response_end` holds the end of an earlier response (or interim response).
const HAVE_RESPONSE_END: u8 = 2;
/// Server word: the current response is a rejection (429 or 503).
const RESPONSE_REJECTED: u8 = 4;
/// Server word: the current response was counted as completed already (a rejection when its
/// write ended, any response at its framed end); its turn's end counts nothing more.
const RESPONSE_COUNTED: u8 = 8;
/// Server word: the current response's end is known from its framing and has not come: the
/// quiet rule does not end it.
const RESPONSE_FRAMED: u8 = 16;
/// Server word: the current response's first body byte went by (it streams).
const BODY_BEGUN: u8 = 32;
/// Server word: the current response's framing ended it past a gap in its data that the walk
/// passed over ([`http1::Framed::ends_at_ack`]): it completes, as framed, once the client
/// acknowledges its last byte.
const RESPONSE_ENDS_AT_ACK: u8 = 64;

/// How a response begins, as its first bytes (an HTTP/1.x status line) tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseStart {
    /// Anything else: a final response, or bytes that are not an HTTP/1.x status line.
    Other,
    /// An interim response (`1xx`): it answers without ending the turn (`100 Continue`,
    /// `103 Early Hints`).
    Interim,
    /// A final response turning the request away: `429 Too Many Requests` or
    /// `503 Service Unavailable`.
    Rejection,
}

/// The status line's first 12 bytes a caller must read to classify a response.
pub const STATUS_LINE_PREFIX: usize = 12;

/// What the first bytes of a response say it is (`HTTP/1.1 429`, `HTTP/1.0 100`, …).
#[inline(always)]
pub const fn response_start(first: [u8; STATUS_LINE_PREFIX]) -> ResponseStart {
    let http1 = first[0] == b'H'
        && first[1] == b'T'
        && first[2] == b'T'
        && first[3] == b'P'
        && first[4] == b'/'
        && first[5] == b'1'
        && first[6] == b'.'
        && (first[7] == b'1' || first[7] == b'0')
        && first[8] == b' ';
    if !http1 {
        return ResponseStart::Other;
    }
    match [first[9], first[10], first[11]] {
        [b'1', _, _] => ResponseStart::Interim,
        [b'4', b'2', b'9'] | [b'5', b'0', b'3'] => ResponseStart::Rejection,
        _ => ResponseStart::Other,
    }
}

/// What the client→server direction knows, packed into [`Turn::client`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ClientWord {
    /// Sequence number just past the highest client→server byte seen.
    request_end: u32,
    /// Requests started on this connection, modulo 256.
    requests: u8,
    /// Requests whose turn ended (answered or abandoned), modulo 256: `requests` or one less.
    ended: u8,
    flags: u8,
}

/// What the server→client direction knows, packed into [`Turn::server`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ServerWord {
    /// Sequence number just past the highest server→client byte of the current response.
    response_end: u32,
    /// The request (its number in `ClientWord::requests`) the latest response answers.
    answered: u8,
    flags: u8,
}

impl ClientWord {
    const fn unpack(w: u64) -> Self {
        Self {
            request_end: w as u32,
            requests: (w >> 32) as u8,
            ended: (w >> 40) as u8,
            flags: (w >> 48) as u8,
        }
    }

    const fn pack(self) -> u64 {
        self.request_end as u64
            | (self.requests as u64) << 32
            | (self.ended as u64) << 40
            | (self.flags as u64) << 48
    }
}

impl ServerWord {
    const fn unpack(w: u64) -> Self {
        Self {
            response_end: w as u32,
            answered: (w >> 32) as u8,
            flags: (w >> 40) as u8,
        }
    }

    const fn pack(self) -> u64 {
        self.response_end as u64 | (self.answered as u64) << 32 | (self.flags as u64) << 40
    }
}

/// The phase both words describe together.
const fn phase_of(c: ClientWord, s: ServerWord) -> u8 {
    if c.requests == c.ended {
        PHASE_IDLE
    } else if s.answered == c.requests {
        PHASE_RESPONSE
    } else {
        PHASE_REQUEST
    }
}

/// The turn state of one connection: one word per direction, each with a single writer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Turn {
    /// Written by client→server segments only (packed request end, counts and flags).
    pub client: u64,
    /// Written by server→client segments only (packed response end, answer and flags).
    pub server: u64,
}

/// What one event did to the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TurnDelta {
    /// Requests started by this event (0 or 1 for a turn; on HTTP/2, the streams a segment
    /// opened).
    pub started: u16,
    /// Responses completed by this event (0 or 1).
    pub completed: u16,
    /// Of those, rejections (0 or 1): the response was a 429 or a 503.
    pub rejected: u16,
    /// Requests abandoned by this event (0 or 1).
    pub abandoned: u16,
    /// Requests started earlier and withdrawn by this event (0 or 1): the bytes that came with
    /// the handshake were a TLS ClientHello, not a request.
    pub withdrawn: u16,
    /// Of the responses completed, those whose end was inferred (0 or 1): their framing was
    /// not known, and the turn's end (quiet, next request, close) ended them.
    pub inferred: u16,
    /// Responses whose first body byte went by in this event (0 or 1): their request stopped
    /// waiting and began to stream.
    pub bodies_begun: u16,
    /// Of the responses completed (or cut by the close), those whose body had begun (0 or 1).
    pub bodies_ended: u16,
    /// New client→server payload bytes.
    pub request_bytes: u32,
    /// Server→client payload bytes counted toward a response.
    pub response_bytes: u32,
}

impl ResponseStart {
    /// The start as a number, for a call that takes only integers.
    #[inline(always)]
    pub const fn to_u8(self) -> u8 {
        self as u8
    }

    /// The start [`ResponseStart::to_u8`] numbered (anything unknown: `Other`).
    #[inline(always)]
    pub const fn from_u8(n: u8) -> Self {
        match n {
            1 => Self::Interim,
            2 => Self::Rejection,
            _ => Self::Other,
        }
    }
}

impl Turn {
    #[inline(always)]
    fn load(&self) -> (ClientWord, ServerWord) {
        // SAFETY: plain aligned reads of this value's own fields; volatile so each word is read
        // once, whole, even while the other direction writes its word.
        unsafe {
            (
                ClientWord::unpack(read_volatile(&raw const self.client)),
                ServerWord::unpack(read_volatile(&raw const self.server)),
            )
        }
    }

    #[inline(always)]
    fn store_client(&mut self, c: ClientWord) {
        // SAFETY: an aligned write of this value's own field, whole.
        unsafe { write_volatile(&raw mut self.client, c.pack()) }
    }

    #[inline(always)]
    fn store_server(&mut self, s: ServerWord) {
        // SAFETY: an aligned write of this value's own field, whole.
        unsafe { write_volatile(&raw mut self.server, s.pack()) }
    }

    /// One of `PHASE_IDLE`, `PHASE_REQUEST`, `PHASE_RESPONSE`.
    #[inline(always)]
    pub fn phase(&self) -> u8 {
        let (c, s) = self.load();
        phase_of(c, s)
    }

    /// True if a client segment now could begin a request (none is open, or a response is
    /// flowing): only then is its first bytes' method asked for.
    #[inline(always)]
    pub fn may_begin_request(&self) -> bool {
        self.phase() != PHASE_REQUEST
    }

    /// What a server segment now may carry, for the response framing walk: the first bytes
    /// of an open request's response, and whether that request is a `HEAD`.
    #[inline(always)]
    pub fn expected(&self) -> http1::Expected {
        let (c, s) = self.load();
        http1::Expected {
            begins: phase_of(c, s) == PHASE_REQUEST,
            head: c.flags & REQUEST_HEAD != 0,
        }
    }

    /// A client→server segment: `len` payload bytes at `seq`, and the acknowledgement number
    /// it carries (`None` if the ACK flag is clear); `head`: its first bytes are `HEAD `
    /// (asked only where a request may begin, see [`Turn::may_begin_request`]).
    #[inline(always)]
    pub fn on_client_segment(
        &mut self,
        seq: u32,
        len: u32,
        ack: Option<u32>,
        head: bool,
    ) -> TurnDelta {
        let mut delta = TurnDelta::default();
        let (mut c, s) = self.load();
        let before = c;
        if len > 0 {
            on_request_payload(&mut c, s, seq, len, &mut delta);
            if delta.started != 0 {
                c.flags = if head {
                    c.flags | REQUEST_HEAD
                } else {
                    c.flags & !REQUEST_HEAD
                };
            }
        }
        c.flags &= !EARLY_REQUEST;
        if let Some(ack) = ack {
            // The whole response acknowledged, and its last byte ended a write: the turn is over
            // (a response whose framing tells its end is not ended by a pause). One that its
            // framing ended past a gap ends at this acknowledgement, whatever the write.
            let quiet = s.flags & RESPONSE_PUSHED != 0 && s.flags & RESPONSE_FRAMED == 0;
            if phase_of(c, s) == PHASE_RESPONSE
                && (quiet || s.flags & RESPONSE_ENDS_AT_ACK != 0)
                && !seq_after(s.response_end, ack)
            {
                c.ended = c.requests;
                complete(&mut delta, s);
            }
        }
        if c != before {
            self.store_client(c);
        }
        delta
    }

    /// A server→client segment: `len` payload bytes at `seq`; `push` if it carried PSH;
    /// `start`: what its payload's first bytes say, where they could begin this request's
    /// response ([`ResponseStart::Other`] where the caller did not look); `framed`: what the
    /// response framing walk found in it (the default where the framing is not read).
    #[inline(always)]
    pub fn on_server_segment(
        &mut self,
        seq: u32,
        len: u32,
        push: bool,
        (start, framed): (ResponseStart, http1::Framed),
    ) -> TurnDelta {
        let mut delta = TurnDelta::default();
        if len == 0 {
            return delta;
        }
        let (c, mut s) = self.load();
        let end = seq.wrapping_add(len);
        match phase_of(c, s) {
            // Every byte was sent before: a retransmitted tail of the previous response, which
            // must not begin this request's response.
            PHASE_REQUEST
                if s.flags & HAVE_RESPONSE_END != 0 && !seq_after(end, s.response_end) =>
            {
                return delta;
            }
            // An interim response: its bytes are passed over, the request stays open (unless
            // the final response's end or body came in the same segment).
            PHASE_REQUEST
                if matches!(start, ResponseStart::Interim)
                    && !framed.ended
                    && !framed.body_began =>
            {
                s.response_end = end;
                s.flags |= HAVE_RESPONSE_END;
            }
            PHASE_REQUEST => {
                delta.response_bytes = if s.flags & HAVE_RESPONSE_END != 0 {
                    end.wrapping_sub(s.response_end).min(len)
                } else {
                    len
                };
                s.answered = c.requests;
                s.response_end = end;
                s.flags |= HAVE_RESPONSE_END;
                s.flags = with_push(s.flags, push) & !RESPONSE_OWN;
                if matches!(start, ResponseStart::Rejection) {
                    s.flags |= RESPONSE_REJECTED;
                }
                follow(&mut s, framed, &mut delta);
            }
            PHASE_RESPONSE if seq_after(end, s.response_end) => {
                delta.response_bytes = end.wrapping_sub(s.response_end).min(len);
                s.response_end = end;
                s.flags = with_push(s.flags, push);
                follow(&mut s, framed, &mut delta);
            }
            // Bytes of this response sent before (a retransmission, or the bytes of a gap the
            // framing waited for): what its walk found in them still counts (a head read late:
            // the body began, the end is known), their bytes do not.
            // Stored only if it changed: a retransmission may pass on another CPU while a new
            // segment stores the word, which a stale copy written back would undo.
            PHASE_RESPONSE => {
                let before = s;
                follow(&mut s, framed, &mut delta);
                if s == before {
                    return delta;
                }
            }
            // Server bytes outside a turn (a greeting, or the tail of a response that already
            // completed at a pause): nothing to count.
            _ => return delta,
        }
        self.store_server(s);
        delta
    }

    /// A request arrived before the connection was tracked: in the segment that completed the
    /// handshake (TCP_DEFER_ACCEPT, a lost third ACK), or in the SYN (TCP Fast Open). `end` is
    /// the sequence number just past what has been received so far, which may be none of the
    /// request's bytes yet when they are queued after the handshake completes.
    #[inline(always)]
    pub fn on_early_request(&mut self, end: u32, bytes: u32) -> TurnDelta {
        let mut delta = TurnDelta::default();
        let (mut c, s) = self.load();
        if phase_of(c, s) != PHASE_IDLE {
            return delta;
        }
        c.requests = c.requests.wrapping_add(1);
        c.flags |= HAVE_REQUEST_END | EARLY_REQUEST;
        c.request_end = end;
        self.store_client(c);
        delta.started = 1;
        delta.request_bytes = bytes;
        delta
    }

    /// The client's first segment since a request came with the handshake shows that those
    /// bytes were no request of turns: a TLS ClientHello, or the HTTP/2 connection preface. The
    /// request is withdrawn (called before that segment is fed to
    /// [`Turn::on_client_segment`]).
    #[inline(always)]
    pub fn on_early_bytes_not_a_request(&mut self) -> TurnDelta {
        let (c, s) = self.load();
        if c.flags & EARLY_REQUEST == 0 || phase_of(c, s) != PHASE_REQUEST {
            return TurnDelta::default();
        }
        self.withdraw_early_request(c)
    }

    /// Take back the request that `on_early_request` started (`c`: the client word now).
    #[inline(always)]
    fn withdraw_early_request(&mut self, mut c: ClientWord) -> TurnDelta {
        c.requests = c.requests.wrapping_sub(1);
        c.flags &= !EARLY_REQUEST;
        self.store_client(c);
        TurnDelta {
            withdrawn: 1,
            ..TurnDelta::default()
        }
    }

    /// The connection closed (the socket reached TCP_CLOSE). `server_tls`: the server's bytes
    /// were TLS records, so a request that came with the handshake and was never followed by
    /// another client segment was a ClientHello, and is withdrawn rather than abandoned.
    #[inline(always)]
    pub fn on_close(&mut self, server_tls: bool) -> TurnDelta {
        let mut delta = TurnDelta::default();
        let (mut c, s) = self.load();
        match phase_of(c, s) {
            PHASE_REQUEST if server_tls && c.flags & EARLY_REQUEST != 0 => {
                return self.withdraw_early_request(c);
            }
            PHASE_REQUEST => delta.abandoned = 1,
            PHASE_RESPONSE => complete(&mut delta, s),
            _ => return delta,
        }
        c.ended = c.requests;
        self.store_client(c);
        delta
    }
}

/// The server word's flags that belong to one response, cleared as the next begins.
const RESPONSE_OWN: u8 =
    RESPONSE_REJECTED | RESPONSE_COUNTED | RESPONSE_FRAMED | BODY_BEGUN | RESPONSE_ENDS_AT_ACK;

/// The current response's turn ends: it completes, unless it was counted already (a rejection
/// when its write ended, a response at its framed end); inferred unless its framing was known.
#[inline(always)]
fn complete(delta: &mut TurnDelta, s: ServerWord) {
    if s.flags & RESPONSE_COUNTED != 0 {
        return;
    }
    delta.completed = 1;
    delta.rejected = u16::from(s.flags & RESPONSE_REJECTED != 0);
    delta.inferred = u16::from(s.flags & (RESPONSE_FRAMED | RESPONSE_ENDS_AT_ACK) == 0);
    delta.bodies_ended = u16::from(s.flags & BODY_BEGUN != 0);
}

/// A segment of the current response, with what its framing walk found (`framed`): its first
/// body byte; its end, counted here; whether its end is still to come. A rejection whose
/// framing is not known completes when its write ends (PSH).
#[inline(always)]
fn follow(s: &mut ServerWord, framed: http1::Framed, delta: &mut TurnDelta) {
    if framed.body_began && s.flags & BODY_BEGUN == 0 {
        s.flags |= BODY_BEGUN;
        delta.bodies_begun = 1;
    }
    if framed.ended {
        complete(
            delta,
            ServerWord {
                flags: s.flags | RESPONSE_FRAMED,
                ..*s
            },
        );
        s.flags = (s.flags | RESPONSE_COUNTED) & !RESPONSE_FRAMED;
        return;
    }
    if framed.ends_at_ack {
        s.flags = (s.flags | RESPONSE_ENDS_AT_ACK) & !RESPONSE_FRAMED;
        return;
    }
    s.flags = if framed.open {
        s.flags | RESPONSE_FRAMED
    } else {
        s.flags & !RESPONSE_FRAMED
    };
    let ended_otherwise = RESPONSE_COUNTED | RESPONSE_FRAMED | RESPONSE_ENDS_AT_ACK;
    if s.flags & (RESPONSE_REJECTED | RESPONSE_PUSHED | ended_otherwise)
        == RESPONSE_REJECTED | RESPONSE_PUSHED
    {
        complete(delta, *s);
        s.flags |= RESPONSE_COUNTED;
    }
}

#[inline(always)]
const fn with_push(flags: u8, push: bool) -> u8 {
    if push {
        flags | RESPONSE_PUSHED
    } else {
        flags & !RESPONSE_PUSHED
    }
}

#[inline(always)]
fn on_request_payload(
    c: &mut ClientWord,
    s: ServerWord,
    seq: u32,
    len: u32,
    delta: &mut TurnDelta,
) {
    let end = seq.wrapping_add(len);
    let new_bytes = if c.flags & HAVE_REQUEST_END == 0 {
        len
    } else if seq_after(end, c.request_end) {
        end.wrapping_sub(c.request_end).min(len)
    } else {
        // Every byte of this segment was seen before: a retransmission.
        return;
    };
    let phase = phase_of(*c, s);
    c.flags |= HAVE_REQUEST_END;
    c.request_end = end;
    delta.request_bytes = new_bytes;
    match phase {
        PHASE_IDLE => {
            c.requests = c.requests.wrapping_add(1);
            delta.started = 1;
        }
        PHASE_RESPONSE => {
            c.ended = c.requests;
            c.requests = c.requests.wrapping_add(1);
            complete(delta, s);
            delta.started = 1;
        }
        // More of the same request (or a pipelined one: see the module docs).
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http1::Framed;

    const ACK: Option<u32> = Some(0);

    #[test]
    fn a_framing_survives_its_bits_and_a_response_start_its_number() {
        for bits in 0..32 {
            assert_eq!(Framed::from_bits(bits).to_bits(), bits);
        }
        for start in [
            ResponseStart::Other,
            ResponseStart::Interim,
            ResponseStart::Rejection,
        ] {
            assert_eq!(ResponseStart::from_u8(start.to_u8()), start);
        }
    }

    #[test]
    fn a_response_framed_to_its_end_past_a_gap_completes_at_the_client_s_ack_as_framed() {
        let mut t = Turn::default();
        t.on_client_segment(100, 50, ACK, false);
        let streaming = Framed {
            body_began: true,
            open: true,
            ..Framed::default()
        };
        let first = t.on_server_segment(1000, 200, true, (ResponseStart::Other, streaming));
        assert_eq!(first.bodies_begun, 1);
        let ahead = Framed {
            ends_at_ack: true,
            ..Framed::default()
        };
        assert_eq!(
            t.on_server_segment(1300, 100, true, (ResponseStart::Other, ahead)),
            TurnDelta {
                response_bytes: 100,
                ..TurnDelta::default()
            }
        );
        // The gap (1200..1300) is not acknowledged yet: the response is still open.
        assert_eq!(t.on_client_segment(150, 0, Some(1200), false).completed, 0);
        let done = t.on_client_segment(150, 0, Some(1400), false);
        assert_eq!(
            (done.completed, done.inferred, done.bodies_ended),
            (1, 0, 1)
        );
    }

    #[test]
    fn a_retransmitted_tail_of_the_previous_response_does_not_end_the_next_turn() {
        let mut t = Turn::default();
        t.on_client_segment(100, 50, ACK, false);
        t.on_server_segment(1000, 200, true, (ResponseStart::Other, Framed::default()));
        assert_eq!(t.on_client_segment(150, 0, Some(1200), false).completed, 1);
        // The next request, then a spurious retransmission of the old response's last bytes.
        assert_eq!(t.on_client_segment(150, 40, Some(1200), false).started, 1);
        assert_eq!(
            t.on_server_segment(1100, 100, true, (ResponseStart::Other, Framed::default())),
            TurnDelta::default()
        );
        assert_eq!(
            t.phase(),
            PHASE_REQUEST,
            "still waiting for its own response"
        );
        // The client's ACK covers the old bytes: that must not complete the new turn.
        assert_eq!(
            t.on_client_segment(190, 0, Some(1200), false),
            TurnDelta::default()
        );
        // The real response; an overlapping start counts only its new bytes.
        let d = t.on_server_segment(1150, 150, true, (ResponseStart::Other, Framed::default()));
        assert_eq!((d.response_bytes, t.phase()), (100, PHASE_RESPONSE));
        assert_eq!(t.on_client_segment(190, 0, Some(1300), false).completed, 1);
    }

    #[test]
    fn a_request_that_came_with_the_handshake_starts_the_first_turn() {
        let mut t = Turn::default();
        // Established with the first segment's data not yet queued: received up to 101.
        assert_eq!(t.on_early_request(101, 0).started, 1);
        // The rest of that request, and a retransmission of its start: no second turn.
        assert_eq!(
            t.on_client_segment(101, 60, ACK, false),
            TurnDelta {
                request_bytes: 60,
                ..TurnDelta::default()
            }
        );
        assert_eq!(
            t.on_client_segment(101, 60, ACK, false),
            TurnDelta::default()
        );
        t.on_server_segment(5000, 300, true, (ResponseStart::Other, Framed::default()));
        assert_eq!(t.on_client_segment(161, 0, Some(5300), false).completed, 1);
        // The next request on the same connection is an ordinary turn.
        assert_eq!(t.on_client_segment(161, 40, Some(5300), false).started, 1);
    }

    #[test]
    fn an_interim_response_does_not_complete_the_turn() {
        let mut t = Turn::default();
        // Expect: 100-continue: headers, then "100 Continue", then the body, then the answer.
        assert_eq!(t.on_client_segment(100, 80, ACK, false).started, 1);
        assert_eq!(
            t.on_server_segment(1000, 25, true, (ResponseStart::Interim, Framed::default())),
            TurnDelta::default()
        );
        assert_eq!(
            t.on_client_segment(180, 0, Some(1025), false),
            TurnDelta::default()
        );
        let d = t.on_client_segment(180, 500, Some(1025), false);
        assert_eq!((d.started, d.completed, d.request_bytes), (0, 0, 500));
        let d = t.on_server_segment(1025, 300, true, (ResponseStart::Other, Framed::default()));
        assert_eq!((d.response_bytes, t.phase()), (300, PHASE_RESPONSE));
        assert_eq!(t.on_client_segment(680, 0, Some(1325), false).completed, 1);
    }

    #[test]
    fn one_turn_completes_when_the_response_is_acknowledged() {
        let mut t = Turn::default();
        let d = t.on_client_segment(100, 50, ACK, false);
        assert_eq!((d.started, d.completed, d.request_bytes), (1, 0, 50));
        assert_eq!(t.phase(), PHASE_REQUEST);
        let d = t.on_server_segment(1000, 200, true, (ResponseStart::Other, Framed::default()));
        assert_eq!((d.started, d.completed, d.response_bytes), (0, 0, 200));
        // An ACK short of the end keeps the turn open.
        let d = t.on_client_segment(150, 0, Some(1100), false);
        assert_eq!(d, TurnDelta::default());
        let d = t.on_client_segment(150, 0, Some(1200), false);
        assert_eq!(d.completed, 1);
        assert_eq!(t.phase(), PHASE_IDLE);
    }

    #[test]
    fn an_ack_that_catches_up_mid_write_does_not_end_the_turn() {
        let mut t = Turn::default();
        t.on_client_segment(0, 10, None, false);
        // The first 64 KiB of a larger write, without PSH, acknowledged in full.
        t.on_server_segment(0, 65536, false, (ResponseStart::Other, Framed::default()));
        assert_eq!(t.on_client_segment(10, 0, Some(65536), false).completed, 0);
        // The rest of the write ends with PSH; its ACK ends the turn.
        t.on_server_segment(65536, 1000, true, (ResponseStart::Other, Framed::default()));
        assert_eq!(t.on_client_segment(10, 0, Some(66536), false).completed, 1);
    }

    #[test]
    fn next_request_completes_the_previous_response() {
        let mut t = Turn::default();
        t.on_client_segment(0, 10, None, false);
        t.on_server_segment(0, 10, true, (ResponseStart::Other, Framed::default()));
        // The next request carries an ACK of the whole response; it counts once.
        let d = t.on_client_segment(10, 10, Some(10), false);
        assert_eq!((d.started, d.completed), (1, 1));
        assert_eq!(t.phase(), PHASE_REQUEST);
    }

    #[test]
    fn multi_segment_request_and_response_count_once() {
        let mut t = Turn::default();
        let mut started = 0;
        let mut completed = 0;
        for i in 0..5u32 {
            let d = t.on_client_segment(i * 1000, 1000, Some(0), false);
            started += d.started;
        }
        for i in 0..5u32 {
            let d = t.on_server_segment(
                i * 1000,
                1000,
                i == 4,
                (ResponseStart::Other, Framed::default()),
            );
            completed += d.completed;
            let d = t.on_client_segment(5000, 0, Some(i * 1000 + 500), false);
            completed += d.completed;
        }
        let d = t.on_client_segment(5000, 0, Some(5000), false);
        completed += d.completed;
        assert_eq!((started, completed), (1, 1));
    }

    #[test]
    fn retransmitted_request_bytes_do_not_start_a_turn() {
        let mut t = Turn::default();
        t.on_client_segment(0, 100, None, false);
        t.on_server_segment(0, 10, true, (ResponseStart::Other, Framed::default()));
        let d = t.on_client_segment(0, 100, None, false);
        assert_eq!(d, TurnDelta::default());
        assert_eq!(t.phase(), PHASE_RESPONSE);
        // Partly new bytes: only the new ones count, and they start a turn.
        let d = t.on_client_segment(50, 100, None, false);
        assert_eq!((d.started, d.completed, d.request_bytes), (1, 1, 50));
    }

    #[test]
    fn close_ends_the_open_turn() {
        let mut t = Turn::default();
        t.on_client_segment(0, 1, None, false);
        assert_eq!(t.on_close(false).abandoned, 1);
        let mut t = Turn::default();
        t.on_client_segment(0, 1, None, false);
        t.on_server_segment(0, 1, true, (ResponseStart::Other, Framed::default()));
        assert_eq!(t.on_close(false).completed, 1);
        let mut t = Turn::default();
        assert_eq!(t.on_close(false), TurnDelta::default());
    }

    #[test]
    fn sequence_numbers_wrap() {
        let mut t = Turn::default();
        t.on_client_segment(u32::MAX - 5, 10, None, false);
        let d = t.on_server_segment(
            u32::MAX - 1,
            4,
            true,
            (ResponseStart::Other, Framed::default()),
        );
        assert_eq!(d.response_bytes, 4);
        assert_eq!(t.on_client_segment(4, 0, Some(2), false).completed, 1);
        assert!(seq_after(3, u32::MAX));
        assert!(!seq_after(u32::MAX, 3));
    }

    #[test]
    fn server_bytes_outside_a_turn_are_ignored() {
        let mut t = Turn::default();
        assert_eq!(
            t.on_server_segment(0, 100, true, (ResponseStart::Other, Framed::default())),
            TurnDelta::default()
        );
        assert_eq!(t.phase(), PHASE_IDLE);
    }

    #[test]
    fn a_rejection_completes_when_its_write_ends_and_is_counted_as_rejected() {
        let mut t = Turn::default();
        // A 429 in two writes: counted at the end of the first (PSH), once; the next request
        // ends its turn without counting it again.
        t.on_client_segment(100, 50, ACK, false);
        let first = t.on_server_segment(
            1000,
            100,
            false,
            (ResponseStart::Rejection, Framed::default()),
        );
        assert_eq!((first.completed, first.rejected), (0, 0));
        let pushed =
            t.on_server_segment(1100, 100, true, (ResponseStart::Other, Framed::default()));
        assert_eq!((pushed.completed, pushed.rejected), (1, 1));
        let more = t.on_server_segment(1200, 10, true, (ResponseStart::Other, Framed::default()));
        assert_eq!((more.completed, more.rejected), (0, 0));
        let next = t.on_client_segment(150, 50, Some(1210), false);
        assert_eq!((next.started, next.completed, next.rejected), (1, 0, 0));
        // A 200 completes at its ACK, as before.
        t.on_server_segment(1210, 100, true, (ResponseStart::Other, Framed::default()));
        let acked = t.on_client_segment(200, 0, Some(1310), false);
        assert_eq!((acked.completed, acked.rejected), (1, 0));
        // A 503 then the close: counted once, at its write.
        t.on_client_segment(200, 50, Some(1310), false);
        let down = t.on_server_segment(
            1310,
            100,
            true,
            (ResponseStart::Rejection, Framed::default()),
        );
        assert_eq!((down.completed, down.rejected), (1, 1));
        assert_eq!(t.on_close(false), TurnDelta::default());
    }

    #[test]
    fn only_an_http1_status_line_of_429_or_503_is_a_rejection() {
        let start = |line: &[u8; 12]| response_start(*line);
        assert_eq!(start(b"HTTP/1.1 429"), ResponseStart::Rejection);
        assert_eq!(start(b"HTTP/1.0 503"), ResponseStart::Rejection);
        assert_eq!(start(b"HTTP/1.1 100"), ResponseStart::Interim);
        assert_eq!(start(b"HTTP/1.1 103"), ResponseStart::Interim);
        for other in [
            b"HTTP/1.1 200",
            b"HTTP/1.1 500",
            b"HTTP/1.1 502",
            b"HTTP/2.0 429",
            b"XTTP/1.1 429",
        ] {
            assert_eq!(
                start(other),
                ResponseStart::Other,
                "{:?}",
                core::str::from_utf8(other)
            );
        }
    }

    #[test]
    fn turns_count_past_256_on_one_connection() {
        let mut t = Turn::default();
        let (mut started, mut completed) = (0u32, 0u32);
        for i in 0..1000u32 {
            let d = t.on_client_segment(i * 10, 10, Some(i * 100), false);
            started += d.started as u32;
            completed += d.completed as u32;
            t.on_server_segment(
                i * 100,
                100,
                true,
                (ResponseStart::Other, Framed::default()),
            );
        }
        completed += t
            .on_client_segment(10_000, 0, Some(100_000), false)
            .completed as u32;
        assert_eq!((started, completed), (1000, 1000));
        assert_eq!(t.phase(), PHASE_IDLE);
    }

    #[test]
    fn each_direction_writes_only_its_own_word() {
        // A pseudo-random mix of events in both directions: a server→client segment never
        // changes the client word, and a client→server segment never changes the server word,
        // so ingress and egress running at once cannot undo each other's update.
        let mut t = Turn::default();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let (mut client_seq, mut server_seq) = (0u32, 0u32);
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x >> 8) as u32 % 3 * 700;
            let before = t;
            if x.is_multiple_of(2) {
                let ack = (x >> 20) as u32 % (server_seq + 1);
                t.on_client_segment(client_seq, len, Some(ack), false);
                client_seq += len;
                assert_eq!(t.server, before.server);
            } else {
                let start = match x % 7 {
                    0 => ResponseStart::Interim,
                    1 => ResponseStart::Rejection,
                    _ => ResponseStart::Other,
                };
                t.on_server_segment(
                    server_seq,
                    len,
                    x.is_multiple_of(3),
                    (start, Framed::default()),
                );
                server_seq += len;
                assert_eq!(t.client, before.client);
            }
        }
    }
}
