//! Request/response turn-taking on one TCP connection.
//!
//! The kernel shows us TCP segments, not requests. A request/response protocol (HTTP/1.x,
//! Redis, memcached) takes turns: the client sends a request, the server answers, and only then
//! does the client send the next one. So, per connection:
//!
//! * a **request starts** with the first new client→server payload byte after the previous
//!   response (or on a fresh connection);
//! * a **response completes** when its turn is over: the client sends the next request, the
//!   connection closes, or the connection goes quiet: the client acknowledges every
//!   server→client byte of the turn, and the last of them carried PSH (TCP sets it on the
//!   segment that ends each write, so an ACK that catches up with a response the server is
//!   still writing does not end the turn).
//!
//! The same segments are seen from both ends (server: requests in, responses out; client: the
//! reverse), so both vantage points reach the same counts. Retransmitted bytes are recognised
//! by sequence number and never start a second turn.
//!
//! Where this falls short: pipelined requests (several sent before the first answer) count as
//! one turn; multiplexed protocols (HTTP/2, gRPC) interleave streams on one connection and
//! count as one long turn per burst; a streamed response that pauses long enough for the
//! client to acknowledge everything sent so far completes at that pause, and later chunks of
//! it are not counted again.
//!
//! This module is plain integer code so the eBPF programs can run it and host tests can check
//! it.

/// No request is open.
pub const PHASE_IDLE: u8 = 0;
/// A request is arriving or being processed; no response byte yet.
pub const PHASE_REQUEST: u8 = 1;
/// Response bytes are flowing.
pub const PHASE_RESPONSE: u8 = 2;

const HAVE_REQUEST_END: u8 = 1;
/// The highest response byte so far ended a write (its segment carried PSH).
const RESPONSE_PUSHED: u8 = 2;
/// `response_end` holds the end of an earlier response (or interim response).
const HAVE_RESPONSE_END: u8 = 4;

/// The turn state of one connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Turn {
    /// One of `PHASE_IDLE`, `PHASE_REQUEST`, `PHASE_RESPONSE`.
    pub phase: u8,
    /// Bit flags (whether `request_end` is set).
    pub flags: u8,
    /// Always zero.
    pub pad: u16,
    /// Sequence number just past the highest client→server byte seen.
    pub request_end: u32,
    /// Sequence number just past the highest server→client byte of the current response.
    pub response_end: u32,
}

/// What one event did to the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TurnDelta {
    /// Requests started by this event (0 or 1).
    pub started: u8,
    /// Responses completed by this event (0 or 1).
    pub completed: u8,
    /// Requests abandoned by this event (0 or 1).
    pub abandoned: u8,
    /// New client→server payload bytes.
    pub request_bytes: u32,
    /// Server→client payload bytes counted toward a response.
    pub response_bytes: u32,
}

/// True if sequence number `a` is after `b`, modulo 2^32 (RFC 793 comparison).
#[inline(always)]
pub const fn seq_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

impl Turn {
    /// A client→server segment: `len` payload bytes at `seq`, and the acknowledgement number
    /// it carries (`None` if the ACK flag is clear).
    #[inline(always)]
    pub fn on_client_segment(&mut self, seq: u32, len: u32, ack: Option<u32>) -> TurnDelta {
        let mut delta = TurnDelta::default();
        if len > 0 {
            self.on_request_payload(seq, len, &mut delta);
        }
        if let Some(ack) = ack {
            self.on_response_ack(ack, &mut delta);
        }
        delta
    }

    /// A server→client segment: `len` payload bytes at `seq`; `push` if it carried PSH;
    /// `interim` if its payload begins an interim (1xx) HTTP response, which answers a request
    /// without ending its turn (`100 Continue`, `103 Early Hints`).
    #[inline(always)]
    pub fn on_server_segment(
        &mut self,
        seq: u32,
        len: u32,
        push: bool,
        interim: bool,
    ) -> TurnDelta {
        let mut delta = TurnDelta::default();
        if len == 0 {
            return delta;
        }
        let end = seq.wrapping_add(len);
        match self.phase {
            // Every byte was sent before: a retransmitted tail of the previous response, which
            // must not begin this request's response.
            PHASE_REQUEST
                if self.flags & HAVE_RESPONSE_END != 0 && !seq_after(end, self.response_end) => {}
            // An interim response: its bytes are passed over, the request stays open.
            PHASE_REQUEST if interim => {
                self.response_end = end;
                self.flags |= HAVE_RESPONSE_END;
            }
            PHASE_REQUEST => {
                let new = if self.flags & HAVE_RESPONSE_END != 0 {
                    end.wrapping_sub(self.response_end).min(len)
                } else {
                    len
                };
                self.phase = PHASE_RESPONSE;
                self.response_end = end;
                self.flags |= HAVE_RESPONSE_END;
                self.set_pushed(push);
                delta.response_bytes = new;
            }
            PHASE_RESPONSE if seq_after(end, self.response_end) => {
                delta.response_bytes = end.wrapping_sub(self.response_end).min(len);
                self.response_end = end;
                self.set_pushed(push);
            }
            // Retransmitted response bytes, or server bytes outside a turn (a greeting, or the
            // tail of a response that already completed at a pause): nothing to count.
            _ => {}
        }
        delta
    }

    /// A request arrived before the connection was tracked: in the segment that completed the
    /// handshake (TCP_DEFER_ACCEPT, a lost third ACK), or in the SYN (TCP Fast Open). `end` is
    /// the sequence number just past what has been received so far, which may be none of the
    /// request's bytes yet when they are queued after the handshake completes.
    #[inline(always)]
    pub fn on_early_request(&mut self, end: u32, bytes: u32) -> TurnDelta {
        let mut delta = TurnDelta::default();
        if self.phase != PHASE_IDLE {
            return delta;
        }
        self.phase = PHASE_REQUEST;
        self.flags |= HAVE_REQUEST_END;
        self.request_end = end;
        delta.started = 1;
        delta.request_bytes = bytes;
        delta
    }

    /// The connection closed (the socket reached TCP_CLOSE).
    #[inline(always)]
    pub fn on_close(&mut self) -> TurnDelta {
        let mut delta = TurnDelta::default();
        match self.phase {
            PHASE_REQUEST => delta.abandoned = 1,
            PHASE_RESPONSE => delta.completed = 1,
            _ => {}
        }
        self.phase = PHASE_IDLE;
        delta
    }

    #[inline(always)]
    fn on_request_payload(&mut self, seq: u32, len: u32, delta: &mut TurnDelta) {
        let end = seq.wrapping_add(len);
        let new_bytes = if self.flags & HAVE_REQUEST_END == 0 {
            len
        } else if seq_after(end, self.request_end) {
            end.wrapping_sub(self.request_end).min(len)
        } else {
            // Every byte of this segment was seen before: a retransmission.
            return;
        };
        self.flags |= HAVE_REQUEST_END;
        self.request_end = end;
        delta.request_bytes = new_bytes;
        match self.phase {
            PHASE_IDLE => {
                self.phase = PHASE_REQUEST;
                delta.started = 1;
            }
            PHASE_RESPONSE => {
                self.phase = PHASE_REQUEST;
                delta.completed = 1;
                delta.started = 1;
            }
            // More of the same request (or a pipelined one: see the module docs).
            _ => {}
        }
    }

    #[inline(always)]
    fn set_pushed(&mut self, push: bool) {
        if push {
            self.flags |= RESPONSE_PUSHED;
        } else {
            self.flags &= !RESPONSE_PUSHED;
        }
    }

    #[inline(always)]
    fn on_response_ack(&mut self, ack: u32, delta: &mut TurnDelta) {
        if self.phase == PHASE_RESPONSE
            && self.flags & RESPONSE_PUSHED != 0
            && !seq_after(self.response_end, ack)
        {
            self.phase = PHASE_IDLE;
            delta.completed = 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ACK: Option<u32> = Some(0);

    #[test]
    fn a_retransmitted_tail_of_the_previous_response_does_not_end_the_next_turn() {
        let mut t = Turn::default();
        t.on_client_segment(100, 50, ACK);
        t.on_server_segment(1000, 200, true, false);
        assert_eq!(t.on_client_segment(150, 0, Some(1200)).completed, 1);
        // The next request, then a spurious retransmission of the old response's last bytes.
        assert_eq!(t.on_client_segment(150, 40, Some(1200)).started, 1);
        assert_eq!(
            t.on_server_segment(1100, 100, true, false),
            TurnDelta::default()
        );
        assert_eq!(t.phase, PHASE_REQUEST, "still waiting for its own response");
        // The client's ACK covers the old bytes: that must not complete the new turn.
        assert_eq!(
            t.on_client_segment(190, 0, Some(1200)),
            TurnDelta::default()
        );
        // The real response; an overlapping start counts only its new bytes.
        let d = t.on_server_segment(1150, 150, true, false);
        assert_eq!((d.response_bytes, t.phase), (100, PHASE_RESPONSE));
        assert_eq!(t.on_client_segment(190, 0, Some(1300)).completed, 1);
    }

    #[test]
    fn a_request_that_came_with_the_handshake_starts_the_first_turn() {
        let mut t = Turn::default();
        // Established with the first segment's data not yet queued: received up to 101.
        assert_eq!(t.on_early_request(101, 0).started, 1);
        // The rest of that request, and a retransmission of its start: no second turn.
        assert_eq!(
            t.on_client_segment(101, 60, ACK),
            TurnDelta {
                request_bytes: 60,
                ..TurnDelta::default()
            }
        );
        assert_eq!(t.on_client_segment(101, 60, ACK), TurnDelta::default());
        t.on_server_segment(5000, 300, true, false);
        assert_eq!(t.on_client_segment(161, 0, Some(5300)).completed, 1);
        // The next request on the same connection is an ordinary turn.
        assert_eq!(t.on_client_segment(161, 40, Some(5300)).started, 1);
    }

    #[test]
    fn an_interim_response_does_not_complete_the_turn() {
        let mut t = Turn::default();
        // Expect: 100-continue: headers, then "100 Continue", then the body, then the answer.
        assert_eq!(t.on_client_segment(100, 80, ACK).started, 1);
        assert_eq!(
            t.on_server_segment(1000, 25, true, true),
            TurnDelta::default()
        );
        assert_eq!(
            t.on_client_segment(180, 0, Some(1025)),
            TurnDelta::default()
        );
        let d = t.on_client_segment(180, 500, Some(1025));
        assert_eq!((d.started, d.completed, d.request_bytes), (0, 0, 500));
        let d = t.on_server_segment(1025, 300, true, false);
        assert_eq!((d.response_bytes, t.phase), (300, PHASE_RESPONSE));
        assert_eq!(t.on_client_segment(680, 0, Some(1325)).completed, 1);
    }

    #[test]
    fn one_turn_completes_when_the_response_is_acknowledged() {
        let mut t = Turn::default();
        let d = t.on_client_segment(100, 50, ACK);
        assert_eq!((d.started, d.completed, d.request_bytes), (1, 0, 50));
        assert_eq!(t.phase, PHASE_REQUEST);
        let d = t.on_server_segment(1000, 200, true, false);
        assert_eq!((d.started, d.completed, d.response_bytes), (0, 0, 200));
        // An ACK short of the end keeps the turn open.
        let d = t.on_client_segment(150, 0, Some(1100));
        assert_eq!(d, TurnDelta::default());
        let d = t.on_client_segment(150, 0, Some(1200));
        assert_eq!(d.completed, 1);
        assert_eq!(t.phase, PHASE_IDLE);
    }

    #[test]
    fn an_ack_that_catches_up_mid_write_does_not_end_the_turn() {
        let mut t = Turn::default();
        t.on_client_segment(0, 10, None);
        // The first 64 KiB of a larger write, without PSH, acknowledged in full.
        t.on_server_segment(0, 65536, false, false);
        assert_eq!(t.on_client_segment(10, 0, Some(65536)).completed, 0);
        // The rest of the write ends with PSH; its ACK ends the turn.
        t.on_server_segment(65536, 1000, true, false);
        assert_eq!(t.on_client_segment(10, 0, Some(66536)).completed, 1);
    }

    #[test]
    fn next_request_completes_the_previous_response() {
        let mut t = Turn::default();
        t.on_client_segment(0, 10, None);
        t.on_server_segment(0, 10, true, false);
        // The next request carries an ACK of the whole response; it counts once.
        let d = t.on_client_segment(10, 10, Some(10));
        assert_eq!((d.started, d.completed), (1, 1));
        assert_eq!(t.phase, PHASE_REQUEST);
    }

    #[test]
    fn multi_segment_request_and_response_count_once() {
        let mut t = Turn::default();
        let mut started = 0;
        let mut completed = 0;
        for i in 0..5u32 {
            let d = t.on_client_segment(i * 1000, 1000, Some(0));
            started += d.started;
        }
        for i in 0..5u32 {
            let d = t.on_server_segment(i * 1000, 1000, i == 4, false);
            completed += d.completed;
            let d = t.on_client_segment(5000, 0, Some(i * 1000 + 500));
            completed += d.completed;
        }
        let d = t.on_client_segment(5000, 0, Some(5000));
        completed += d.completed;
        assert_eq!((started, completed), (1, 1));
    }

    #[test]
    fn retransmitted_request_bytes_do_not_start_a_turn() {
        let mut t = Turn::default();
        t.on_client_segment(0, 100, None);
        t.on_server_segment(0, 10, true, false);
        let d = t.on_client_segment(0, 100, None);
        assert_eq!(d, TurnDelta::default());
        assert_eq!(t.phase, PHASE_RESPONSE);
        // Partly new bytes: only the new ones count, and they start a turn.
        let d = t.on_client_segment(50, 100, None);
        assert_eq!((d.started, d.completed, d.request_bytes), (1, 1, 50));
    }

    #[test]
    fn close_ends_the_open_turn() {
        let mut t = Turn::default();
        t.on_client_segment(0, 1, None);
        assert_eq!(t.on_close().abandoned, 1);
        let mut t = Turn::default();
        t.on_client_segment(0, 1, None);
        t.on_server_segment(0, 1, true, false);
        assert_eq!(t.on_close().completed, 1);
        let mut t = Turn::default();
        assert_eq!(t.on_close(), TurnDelta::default());
    }

    #[test]
    fn sequence_numbers_wrap() {
        let mut t = Turn::default();
        t.on_client_segment(u32::MAX - 5, 10, None);
        let d = t.on_server_segment(u32::MAX - 1, 4, true, false);
        assert_eq!(d.response_bytes, 4);
        assert_eq!(t.on_client_segment(4, 0, Some(2)).completed, 1);
        assert!(seq_after(3, u32::MAX));
        assert!(!seq_after(u32::MAX, 3));
    }

    #[test]
    fn server_bytes_outside_a_turn_are_ignored() {
        let mut t = Turn::default();
        assert_eq!(
            t.on_server_segment(0, 100, true, false),
            TurnDelta::default()
        );
        assert_eq!(t.phase, PHASE_IDLE);
    }
}
