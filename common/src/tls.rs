//! TLS record framing: which bytes of an encrypted connection are requests and responses.
//!
//! On a TLS connection every byte is a record: a 5-byte header (content type, version,
//! length) and a body. Only application-data records (content type 23) carry requests and
//! responses; handshake flights, change-cipher-spec, alerts (close_notify among them) and
//! session tickets are not turns. So each direction of a connection walks its records
//! ([`RecordStream`]), headers split across segments included, and the turn state machine is
//! fed only the segments that carry *message bytes*: bytes of an application-data record that
//! is a request or a response.
//!
//! TLS 1.3 encrypts more than data under content type 23, and two rules sort that out:
//!
//! * the server's encrypted handshake (EncryptedExtensions … Finished) comes before the
//!   client's first application-data record; application-data records the server sends before
//!   the client sent any are handshake ([`HANDSHAKE_IN_APP_DATA`]), and the client's first
//!   application-data record after such a flight is its Finished: neither is a turn;
//! * an application-data record shorter than [`MIN_MESSAGE_RECORD_LEN`] carries no request or
//!   response: it is an encrypted alert (close_notify is 19 bytes: 2 of alert, 1 of inner
//!   content type, 16 of tag) or a key update.
//!
//! Session tickets after the handshake are application-data records in TLS 1.3. Server records
//! before the client's first request are never a response; tickets sent after the first request
//! arrived begin its response, which completes it at the same count (one request, one
//! response), a little early.
//!
//! A stream is taken for TLS if its first payload (the first this probe sees) begins with a
//! record header; a plaintext protocol is never mistaken for it (an HTTP request or response
//! starts with a letter). A gap in the sequence (a segment lost before this host) loses the
//! framing; the stream is framed again at the next segment that starts with a header, and the
//! segments in between are counted as unframed.
//!
//! Plain integer code, shared by the eBPF programs and the host tests; the bytes are read
//! through [`Payload`].

use crate::{Payload, Resume, WalkFlags};

/// Content type of a handshake record.
pub const CONTENT_HANDSHAKE: u8 = 22;
/// Content type of an application-data record.
pub const CONTENT_APPLICATION_DATA: u8 = 23;
/// Bytes in a record header.
pub const HEADER_LEN: u32 = 5;
/// The largest record body allowed (TLS 1.2: 2^14 + 2048 of ciphertext).
pub const MAX_RECORD_LEN: u32 = 16_384 + 2_048;
/// Application-data records shorter than this are alerts or key updates, not messages.
pub const MIN_MESSAGE_RECORD_LEN: u32 = 25;
/// Record headers read per segment at most (a 64 KiB send of 16 KiB records has five); a
/// segment with more loses the framing until a later segment starts with a header.
pub const MAX_RECORDS_PER_SEGMENT: u32 = 16;

/// The stream's first payload was looked at.
const DETECTED: u8 = 1;
/// ... and it began with a TLS record header.
const TLS: u8 = 2;
/// `next_seq` is a known position of the record stream.
const FRAMED: u8 = 4;
/// The current record's bytes are message bytes.
const MESSAGE: u8 = 8;
/// The stream has carried an application-data record.
const APP_DATA_SEEN: u8 = 16;
/// Server stream: application-data records came before the client's first one: the
/// encrypted handshake of TLS 1.3.
pub const HANDSHAKE_IN_APP_DATA: u8 = 32;
/// Client stream: it has carried a request record.
const REQUEST_SEEN: u8 = 64;
/// The segment being walked has carried message bytes (cleared at the end of each walk).
const SEGMENT_HAS_MESSAGE: u8 = 128;

/// Which end of the connection sent a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sender {
    /// Client→server: requests.
    Client,
    /// Server→client: responses.
    Server,
}

/// The record framing of one direction of a connection. Written only by the segments of that
/// direction; the other direction reads `flags`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecordStream {
    /// Sequence number just past the bytes walked so far.
    pub next_seq: u32,
    /// The first bytes of a header that ended a segment (`held_len` of them, big-endian).
    pub held: u32,
    /// Body bytes of the current record still to come.
    pub left: u16,
    /// How many header bytes `held` holds (0 to 4).
    pub held_len: u8,
    /// Bit flags (`HANDSHAKE_IN_APP_DATA` is the public one).
    pub flags: WalkFlags,
}

/// What one segment of a stream carries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Walked {
    /// The stream is not TLS: every payload byte counts, as on a plaintext connection.
    pub plaintext: bool,
    /// Some of the segment's new bytes are message bytes (requests or responses).
    pub message: bool,
    /// The framing was lost at this segment, or is still lost: its records are unknown.
    pub unframed: bool,
    /// This segment showed the stream to be TLS (its first payload, a record header).
    pub found_tls: bool,
}

/// True if `h` is the header of a handshake record (a ClientHello begins with one).
#[inline(always)]
pub const fn is_handshake_header(h: [u8; 5]) -> bool {
    h[0] == CONTENT_HANDSHAKE && is_record_header(h)
}

/// True if `h` is a TLS record header (SSL 3.0 to TLS 1.3 record versions, a known content
/// type, a length within bounds).
#[inline(always)]
pub const fn is_record_header(h: [u8; 5]) -> bool {
    let len = u16::from_be_bytes([h[3], h[4]]) as u32;
    h[0] >= 20 && h[0] <= 23 && h[1] == 3 && h[2] <= 4 && len <= MAX_RECORD_LEN
}

/// What became of a record header held from an earlier segment.
enum HeldHeader {
    /// Completed and its record begun; the walk goes on at this position.
    Begun(u32),
    /// Still incomplete: the segment ended first.
    Waiting,
    /// Not a record header (or unreadable): the framing is lost.
    Lost,
}

impl RecordStream {
    /// True once the stream was found to be TLS.
    #[inline(always)]
    pub fn is_tls(&self) -> bool {
        self.flags.get() & TLS != 0
    }

    /// Walk the records of one segment: `len` payload bytes at `seq` sent by `sender`;
    /// `peer_flags` is the other direction's `flags`.
    #[inline(always)]
    pub fn walk<P: Payload>(
        &mut self,
        seq: u32,
        len: u32,
        payload: &P,
        sender: Sender,
        peer_flags: u8,
    ) -> Walked {
        let mut walked = Walked::default();
        if len == 0 || !self.detect(seq, payload, &mut walked) {
            return walked;
        }
        let end = seq.wrapping_add(len);
        let Some(mut pos) = self.resume_at(seq, end, payload, &mut walked) else {
            return walked;
        };
        if self.held_len > 0 {
            match self.finish_held_header(pos, len, payload, sender, peer_flags) {
                HeldHeader::Begun(after) => pos = after,
                HeldHeader::Waiting => {
                    self.next_seq = end;
                    return walked;
                }
                HeldHeader::Lost => return self.lose_framing(walked),
            }
        }
        if !self.walk_records(pos, len, payload, sender, peer_flags) {
            return self.lose_framing(walked);
        }
        self.next_seq = end;
        self.took_message(walked)
    }

    /// At the stream's first payload, decide whether it is TLS (it begins with a record
    /// header). False when there is nothing to walk: the stream is plaintext.
    #[inline(always)]
    fn detect<P: Payload>(&mut self, seq: u32, payload: &P, walked: &mut Walked) -> bool {
        if self.flags.get() & DETECTED == 0 {
            self.flags.set(DETECTED);
            if !payload.header_at(0).is_some_and(is_record_header) {
                walked.plaintext = true;
                return false;
            }
            self.flags.set(TLS);
            walked.found_tls = true;
            self.frame_at(seq);
        } else if self.flags.get() & TLS == 0 {
            walked.plaintext = true;
            return false;
        }
        true
    }

    /// Where the segment's new bytes begin, framing anew at its start when the framing was
    /// lost (or a gap lost it now). `None` when there is nothing to walk: a retransmission, or
    /// a segment that does not begin with a record header while unframed.
    #[inline(always)]
    fn resume_at<P: Payload>(
        &mut self,
        seq: u32,
        end: u32,
        payload: &P,
        walked: &mut Walked,
    ) -> Option<u32> {
        let place = self.flags.resume(FRAMED, self.next_seq, (seq, end), || {
            payload.header_at(0).is_some_and(is_record_header)
        });
        match place {
            Resume::Walked => None,
            Resume::At(pos) => Some(pos),
            Resume::Lost => {
                walked.unframed = true;
                None
            }
            Resume::Reframe => {
                self.frame_at(seq);
                Some(0)
            }
        }
    }

    /// Complete a header begun at the end of an earlier segment with the bytes at `pos`.
    #[inline(always)]
    fn finish_held_header<P: Payload>(
        &mut self,
        pos: u32,
        len: u32,
        payload: &P,
        sender: Sender,
        peer_flags: u8,
    ) -> HeldHeader {
        let need = HEADER_LEN - self.held_len as u32;
        let n = need.min(len - pos);
        let Some(bytes) = payload.bytes_at(pos, n) else {
            return HeldHeader::Lost;
        };
        let acc = (self.held as u64) << (8 * n) | bytes as u64;
        if n < need {
            self.held = acc as u32;
            self.held_len += n as u8;
            return HeldHeader::Waiting;
        }
        self.held = 0;
        self.held_len = 0;
        let b = acc.to_be_bytes();
        if !self.begin_record([b[3], b[4], b[5], b[6], b[7]], sender, peer_flags) {
            return HeldHeader::Lost;
        }
        HeldHeader::Begun(pos + n)
    }

    /// From `pos`: the rest of the current record's body, then the records whose headers lie
    /// whole in the segment; a header cut by the segment's end is held. False if the framing
    /// is lost.
    #[inline(always)]
    fn walk_records<P: Payload>(
        &mut self,
        mut pos: u32,
        len: u32,
        payload: &P,
        sender: Sender,
        peer_flags: u8,
    ) -> bool {
        let mut records = 0;
        loop {
            // The rest of the current record's body, as far as this segment goes.
            let take = (self.left as u32).min(len - pos);
            if take > 0 && self.flags.get() & MESSAGE != 0 {
                self.flags.set(SEGMENT_HAS_MESSAGE);
            }
            pos += take;
            self.left -= take as u16;
            let rest = len - pos;
            if rest == 0 {
                return true;
            }
            if rest < HEADER_LEN {
                // A header cut by the end of the segment: hold its first bytes.
                let Some(bytes) = payload.bytes_at(pos, rest) else {
                    return false;
                };
                self.held = bytes;
                self.held_len = rest as u8;
                return true;
            }
            if records == MAX_RECORDS_PER_SEGMENT {
                return false;
            }
            records += 1;
            let Some(header) = payload.header_at(pos) else {
                return false;
            };
            pos += HEADER_LEN;
            if !self.begin_record(header, sender, peer_flags) {
                return false;
            }
        }
    }

    /// The framing is lost at this segment.
    #[inline(always)]
    fn lose_framing(&mut self, mut walked: Walked) -> Walked {
        self.flags.clear(FRAMED);
        walked.unframed = true;
        self.took_message(walked)
    }

    /// `walked`, with whether the segment carried message bytes (noted in the flags as the
    /// walk went, and cleared for the next segment).
    #[inline(always)]
    fn took_message(&mut self, mut walked: Walked) -> Walked {
        walked.message = self.flags.get() & SEGMENT_HAS_MESSAGE != 0;
        self.flags.clear(SEGMENT_HAS_MESSAGE);
        walked
    }

    /// A record header was read: start its record. False if it is not a header.
    #[inline(always)]
    fn begin_record(&mut self, header: [u8; 5], sender: Sender, peer_flags: u8) -> bool {
        if !is_record_header(header) {
            return false;
        }
        self.left = u16::from_be_bytes([header[3], header[4]]);
        if self.is_message(header[0], self.left as u32, sender, peer_flags) {
            self.flags.set(MESSAGE);
        } else {
            self.flags.clear(MESSAGE);
        }
        true
    }

    /// Start framing at a segment that begins with a record header.
    #[inline(always)]
    fn frame_at(&mut self, seq: u32) {
        self.next_seq = seq;
        self.left = 0;
        self.held = 0;
        self.held_len = 0;
        self.flags.set(FRAMED);
    }

    /// Whether a record of `content_type` and `len` body bytes just begun is a message, with
    /// the TLS 1.3 handshake rules of the module docs.
    #[inline(always)]
    fn is_message(&mut self, content_type: u8, len: u32, sender: Sender, peer_flags: u8) -> bool {
        if content_type != CONTENT_APPLICATION_DATA {
            return false;
        }
        let first = self.flags.get() & APP_DATA_SEEN == 0;
        self.flags.set(APP_DATA_SEEN);
        match sender {
            // Before the client's first request: handshake (before its Finished) or session
            // tickets (after it), not a response.
            Sender::Server if peer_flags & REQUEST_SEEN == 0 => {
                if peer_flags & APP_DATA_SEEN == 0 {
                    self.flags.set(HANDSHAKE_IN_APP_DATA);
                }
                false
            }
            Sender::Client if first && peer_flags & HANDSHAKE_IN_APP_DATA != 0 => false,
            Sender::Client if len >= MIN_MESSAGE_RECORD_LEN => {
                self.flags.set(REQUEST_SEEN);
                true
            }
            _ => len >= MIN_MESSAGE_RECORD_LEN,
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;
    use crate::{
        http1::Framed,
        test_bytes::Bytes,
        turn::{ResponseStart, Turn},
    };

    fn record(content_type: u8, len: usize) -> Vec<u8> {
        let mut r = std::vec![content_type, 3, 3, (len >> 8) as u8, len as u8];
        r.resize(5 + len, 0xab);
        r
    }

    /// A connection fed segment by segment, as the eBPF programs feed it.
    #[derive(Default)]
    struct Conn {
        turn: Turn,
        client: RecordStream,
        server: RecordStream,
        client_seq: u32,
        server_seq: u32,
        started: u32,
        completed: u32,
        unframed: u32,
    }

    impl Conn {
        fn client_sends(&mut self, bytes: &[u8]) {
            let len = bytes.len() as u32;
            let w = self.client.walk(
                self.client_seq,
                len,
                &Bytes(bytes),
                Sender::Client,
                self.server.flags.get(),
            );
            self.unframed += w.unframed as u32;
            if w.found_tls {
                self.started -= self.turn.on_early_bytes_not_a_request().withdrawn as u32;
            }
            let counted = if w.plaintext || w.message { len } else { 0 };
            let d =
                self.turn
                    .on_client_segment(self.client_seq, counted, Some(self.server_seq), false);
            self.started += d.started as u32;
            self.completed += d.completed as u32;
            self.client_seq += len;
        }

        fn server_sends(&mut self, bytes: &[u8]) {
            let len = bytes.len() as u32;
            let w = self.server.walk(
                self.server_seq,
                len,
                &Bytes(bytes),
                Sender::Server,
                self.client.flags.get(),
            );
            self.unframed += w.unframed as u32;
            if w.plaintext || w.message {
                self.turn.on_server_segment(
                    self.server_seq,
                    len,
                    true,
                    (ResponseStart::Other, Framed::default()),
                );
            }
            self.server_seq += len;
        }

        /// The client acknowledges everything.
        fn client_acks(&mut self) {
            let d = self
                .turn
                .on_client_segment(self.client_seq, 0, Some(self.server_seq), false);
            self.completed += d.completed as u32;
        }

        fn close(&mut self) {
            let d = self.turn.on_close(self.server.is_tls());
            self.completed += d.completed as u32;
            self.started -= d.withdrawn as u32;
        }
    }

    fn tls13_handshake(c: &mut Conn) {
        c.client_sends(&record(22, 300)); // ClientHello
        let mut flight = record(22, 90); // ServerHello
        flight.extend(record(20, 1)); // change_cipher_spec (compatibility)
        flight.extend(record(23, 2000)); // EncryptedExtensions, Certificate, ...
        flight.extend(record(23, 53)); // Finished
        c.server_sends(&flight);
        c.client_acks();
        let mut finished = record(20, 1);
        finished.extend(record(23, 53));
        c.client_sends(&finished);
    }

    #[test]
    fn tls13_handshake_tickets_and_close_notify_are_not_turns() {
        let mut c = Conn::default();
        tls13_handshake(&mut c);
        // Two session tickets, then three requests, then close_notify both ways.
        c.server_sends(&[record(23, 200), record(23, 200)].concat());
        c.client_acks();
        for _ in 0..3 {
            c.client_sends(&record(23, 120));
            c.server_sends(&record(23, 900));
            c.client_acks();
        }
        c.client_sends(&record(23, 19));
        c.server_sends(&record(23, 19));
        c.client_acks();
        c.close();
        assert_eq!((c.started, c.completed, c.unframed), (3, 3, 0));
    }

    #[test]
    fn tls13_request_right_behind_finished_and_tickets_after_it() {
        // The client's Finished and request in one segment; the server's tickets go out after
        // the request arrived, then the response.
        let mut c = Conn::default();
        c.client_sends(&record(22, 300));
        c.server_sends(&[record(22, 90), record(23, 2000), record(23, 53)].concat());
        c.client_sends(&[record(20, 1), record(23, 53), record(23, 150)].concat());
        c.server_sends(&[record(23, 200), record(23, 200)].concat());
        c.server_sends(&record(23, 700));
        c.client_acks();
        c.close();
        assert_eq!((c.started, c.completed), (1, 1));
    }

    #[test]
    fn tls13_client_hello_with_the_handshake_is_one_turn_with_its_request() {
        // TCP_DEFER_ACCEPT: the ClientHello came with the handshake and opened a turn before the
        // connection was tracked; the tickets that follow the client's Finished must not answer
        // it, the request continues it.
        let mut c = Conn::default();
        c.started += c.turn.on_early_request(0, 300).started as u32;
        c.client_seq = 305;
        c.server_sends(&[record(22, 90), record(23, 2000), record(23, 53)].concat());
        c.client_acks();
        c.client_sends(&[record(20, 1), record(23, 53)].concat());
        c.server_sends(&[record(23, 200), record(23, 200)].concat());
        c.client_acks();
        c.client_sends(&record(23, 150));
        c.server_sends(&record(23, 700));
        c.client_acks();
        c.close();
        assert_eq!((c.started, c.completed), (1, 1));
        // A connection that closes after the server's first flight: no request at all.
        let mut c = Conn::default();
        c.started += c.turn.on_early_request(0, 300).started as u32;
        c.client_seq = 305;
        c.server_sends(&[record(22, 90), record(23, 2000), record(23, 53)].concat());
        c.close();
        assert_eq!((c.started, c.completed), (0, 0));
    }

    #[test]
    fn tls12_handshake_and_alerts_are_not_turns() {
        let mut c = Conn::default();
        c.client_sends(&record(22, 250));
        c.server_sends(&[record(22, 90), record(22, 1800), record(22, 4)].concat());
        c.client_sends(&[record(22, 70), record(20, 1), record(22, 40)].concat());
        c.server_sends(&[record(22, 200), record(20, 1), record(22, 40)].concat());
        c.client_acks();
        for _ in 0..2 {
            c.client_sends(&record(23, 140));
            c.server_sends(&record(23, 600));
            c.client_acks();
        }
        c.client_sends(&record(21, 26));
        c.close();
        assert_eq!((c.started, c.completed, c.unframed), (2, 2, 0));
    }

    #[test]
    fn headers_split_across_segments_keep_the_framing() {
        let mut c = Conn::default();
        tls13_handshake(&mut c);
        // A response of three records cut into segments at awkward places: inside a header
        // (after 1, 3 and 4 of its bytes) and inside bodies.
        let response = [record(23, 3000), record(23, 100), record(23, 40)].concat();
        c.client_sends(&record(23, 120));
        for cut in [
            &response[..3006],
            &response[3006..3008],
            &response[3008..3050],
            &response[3050..3108],
            &response[3108..3111],
            &response[3111..],
        ] {
            c.server_sends(cut);
        }
        c.client_acks();
        // The next request begins with a header cut after one byte.
        let request = record(23, 80);
        c.client_sends(&request[..1]);
        c.client_sends(&request[1..]);
        c.server_sends(&record(23, 300));
        c.client_acks();
        assert_eq!((c.started, c.completed, c.unframed), (2, 2, 0));
        assert_eq!(c.server.left, 0);
    }

    #[test]
    fn retransmitted_records_are_walked_once() {
        let mut s = RecordStream::default();
        let seg = [record(23, 100), record(23, 30)].concat();
        let peer = APP_DATA_SEEN | REQUEST_SEEN;
        let w = s.walk(1000, seg.len() as u32, &Bytes(&seg), Sender::Server, peer);
        assert!(w.message);
        // The same bytes again: nothing new.
        let w = s.walk(1000, seg.len() as u32, &Bytes(&seg), Sender::Server, peer);
        assert_eq!(w, Walked::default());
        // A segment overlapping the end of the last one: only its new part is walked.
        let next = record(23, 60);
        let overlap = [&seg[seg.len() - 10..], &next[..]].concat();
        let at = 1000 + seg.len() as u32 - 10;
        let w = s.walk(
            at,
            overlap.len() as u32,
            &Bytes(&overlap),
            Sender::Server,
            peer,
        );
        assert!(w.message && !w.unframed);
        assert_eq!(s.left, 0);
    }

    #[test]
    fn plaintext_is_not_taken_for_tls() {
        let mut s = RecordStream::default();
        let get = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        let w = s.walk(0, get.len() as u32, &Bytes(get), Sender::Client, 0);
        assert!(w.plaintext && !s.is_tls());
        // Later segments stay plaintext, whatever they hold.
        let rec = record(23, 100);
        let w = s.walk(100, rec.len() as u32, &Bytes(&rec), Sender::Client, 0);
        assert!(w.plaintext);
    }

    #[test]
    fn a_gap_loses_the_framing_until_a_segment_starts_with_a_header() {
        let mut s = RecordStream::default();
        let peer = APP_DATA_SEEN | REQUEST_SEEN;
        let rec = record(23, 1000);
        s.walk(0, 500, &Bytes(&rec[..500]), Sender::Server, peer);
        // Bytes 500..700 never seen; 700.. arrives.
        let w = s.walk(700, 305, &Bytes(&rec[700..]), Sender::Server, peer);
        assert!(w.unframed && !w.message);
        let next = record(23, 100);
        let w = s.walk(5000, next.len() as u32, &Bytes(&next), Sender::Server, peer);
        assert!(w.message && !w.unframed);
    }

    #[test]
    fn a_connection_adopted_mid_stream_is_framed_at_its_next_request() {
        // The probe first sees a request record: no handshake rules apply.
        let mut c = Conn {
            client_seq: 77_000,
            server_seq: 900_000,
            ..Conn::default()
        };
        c.client_sends(&record(23, 200));
        c.server_sends(&record(23, 2000));
        c.client_acks();
        assert_eq!((c.started, c.completed), (1, 1));
    }

    #[test]
    fn too_many_records_in_one_segment_lose_the_framing() {
        let mut s = RecordStream::default();
        let many: Vec<u8> = (0..MAX_RECORDS_PER_SEGMENT + 1)
            .flat_map(|_| record(23, 30))
            .collect();
        let w = s.walk(0, many.len() as u32, &Bytes(&many), Sender::Client, 0);
        assert!(w.unframed);
        let exact: Vec<u8> = (0..MAX_RECORDS_PER_SEGMENT)
            .flat_map(|_| record(23, 30))
            .collect();
        let mut s = RecordStream::default();
        let w = s.walk(0, exact.len() as u32, &Bytes(&exact), Sender::Client, 0);
        assert!(w.message && !w.unframed);
    }
}
