//! HTTP/1.1 response framing: where a response ends, as HTTP/1.1 says it ends.
//!
//! The turn of [`crate::turn`] infers a response's end from the connection going quiet (the
//! client has acknowledged every byte sent, and the last one ended a write). That is wrong for
//! a response that pauses: an LLM engine sends its headers at once, then nothing while the
//! request waits for a slot, then a token at a time. So the server→client bytes of a plaintext
//! connection are walked ([`ResponseFraming`]) and a response ends where RFC 9112 §6.3 says:
//!
//! * after its head, for a response to a `HEAD` request, a `1xx` (interim: the final response
//!   follows), `204` or `304`;
//! * after `Content-Length` bytes of body;
//! * after the last chunk and its trailers, for `Transfer-Encoding: chunked` (the last coding);
//! * at the close, for a body with neither (or another final coding): the walk then says the
//!   response is open until the connection closes.
//!
//! The head is read a byte at a time (up to eight bytes a step), so a header cut by a segment
//! boundary anywhere is read on at the next segment; bodies and chunk data are skipped by
//! length without reading them. Retransmitted bytes are walked once, by sequence number.
//!
//! A **gap** (a segment ahead of bytes not seen: a loss whose retransmission comes after the
//! segments behind it, or a reordering) that lies within a body's or a chunk's data is passed
//! over by length: its bytes are data the walk would skip unread, so it knows where the
//! segment ahead stands and walks it. What the walk then finds still counts, except the
//! response's end, which the client has not received while the gap is open: a response that
//! ends after a gap passed over ends when the client acknowledges its last byte
//! ([`Framed::ends_at_ack`]; the turn holds it until then). Any other gap (within a head, a
//! chunk-size line or trailers, or over a body's end) holds the segments ahead back, unwalked,
//! until its bytes come; the bytes held back are then passed over as the next gap, where they
//! are data. Where neither can be done (`ResponseFraming::pass_gap` says when), a head that is not
//! HTTP/1.x, a protocol switch (`101`) or a malformed length loses the framing: the response is
//! then ended by the turn's quiet rule, and counted as *inferred*. The walk frames again at the
//! next response whose first segment begins with `HTTP/1.`.
//!
//! The walk also tells when a response's first **body** byte goes by (the first byte of a
//! chunk's data, or of a body with a length or delimited by the close): an engine that sends
//! its headers before it schedules the request sends no body byte until it does.
//!
//! Written by server→client segments only, like [`crate::turn::Turn::server`]. Plain integer
//! code, shared by the eBPF programs and the host tests; the bytes are read through
//! [`Payload`].

use crate::{Payload, Resume, WalkFlags};

/// At a response's first byte (or the next head after an interim response).
const START: u8 = 0;
/// In the status line: `at` bytes of it read (up to [`STATUS_LINE_READ`]).
const STATUS_LINE: u8 = 1;
/// At the first byte of a header line (or of the empty line that ends the head).
const LINE_START: u8 = 2;
/// Matching a header name: `at` bytes matched, [`NAME_IS_LENGTH`] says which name.
const NAME: u8 = 3;
/// In a `Content-Length` value: the digits read so far in `left`.
const LENGTH_VALUE: u8 = 4;
/// In a `Transfer-Encoding` value: `at` bytes of `chunked` matched in the current coding.
const CODING_VALUE: u8 = 5;
/// In a header line of no interest, until its line feed.
const SKIP_LINE: u8 = 6;
/// After the carriage return of the empty line that ends the head.
const HEAD_END: u8 = 7;
/// In a body of known length: `left` bytes to go.
const BODY: u8 = 8;
/// In a chunk-size line's hex digits: the size so far in `left`, `at` digits read.
const CHUNK_SIZE: u8 = 9;
/// In a chunk-size line after its digits (extensions, white space), until its line feed.
const CHUNK_EXT: u8 = 10;
/// In a chunk's data: `left` bytes to go.
const CHUNK_DATA: u8 = 11;
/// After a chunk's data, its CRLF: `at` bytes of it read.
const CHUNK_DATA_END: u8 = 12;
/// At the first byte of a trailer line (or of the empty line that ends the message).
const TRAILER_START: u8 = 13;
/// In a trailer line, until its line feed.
const TRAILER_SKIP: u8 = 14;
/// After the carriage return of the empty line that ends the trailers.
const TRAILER_END: u8 = 15;
/// In a body delimited by the close.
const UNTIL_CLOSE: u8 = 16;
/// The framing is lost until the next response that begins with a status line.
const LOST: u8 = 17;

/// `next_seq` is a known position of the stream.
const FRAMED: u8 = 1;
/// A response is being walked (its head begun, its end not yet reached).
const IN_RESPONSE: u8 = 2;
/// The header name being matched is `Content-Length` (else `Transfer-Encoding`).
const NAME_IS_LENGTH: u8 = 4;
/// The head has a valid `Content-Length`, in `left`.
const HAS_LENGTH: u8 = 8;
/// The head's last transfer coding is `chunked`.
const CHUNKED: u8 = 16;
/// The head has a transfer coding whose last is not `chunked`: the body ends at the close.
const OTHER_FRAMING: u8 = 32;
/// The response's first body byte was walked.
const BODY_BEGAN: u8 = 64;
/// The response answers a `HEAD` request: it has no body, whatever its head says.
const NO_BODY: u8 = 128;

/// `gaps`: a gap within the response's data was passed over; its end waits for the client's
/// acknowledgement.
const GAP_PASSED: u8 = 1;
/// `gaps`: segments ahead of a gap that could not be passed over are held back (not walked)
/// until the gap's bytes come.
const GAP_WAITING: u8 = 2;
/// `gaps`: the response waited for a gap: the bytes held back meanwhile were not walked, so
/// until the walk passes over them (the next gap) a gap that cannot be passed over loses the
/// framing.
const GAP_WAITED: u8 = 4;

/// Segments held back for one gap at most: past them the gap is taken as never coming (the
/// walk's place is stale) and the framing is lost.
const MAX_HELD: u8 = 255;

/// Status-line bytes read: `HTTP/1.x NNN`; the rest of the line is skipped.
const STATUS_LINE_READ: u8 = 12;
/// The largest chunk size read (2^28 − 1): a larger one loses the framing.
const MAX_CHUNK_SIZE: u32 = 0x0fff_ffff;
/// Bytes a scanning step reads at most.
pub const STEP_BYTES: u32 = 8;
/// Steps a segment's walk takes at most (the host's loop; the kernel's is bounded by its
/// own); a segment with more loses the framing.
pub const MAX_STEPS: u32 = 8_192;

/// The response framing of a connection's server→client bytes. Written by those segments only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResponseFraming {
    /// Sequence number just past the bytes walked.
    pub next_seq: u32,
    /// Body or chunk bytes to go; the length or chunk size being read.
    pub left: u32,
    /// The status code read from the current head.
    pub status: u16,
    /// One of the states above.
    pub state: u8,
    /// A count within the state (status-line bytes, name bytes matched, hex digits).
    pub at: u8,
    /// Bit flags.
    pub flags: WalkFlags,
    /// Not 0: the head's `Content-Length` is not one number (or comes twice), which loses
    /// the framing unless the body is chunked.
    pub bad_length: u8,
    /// What gaps did to the current response (see the module docs): bits `GAP_PASSED`,
    /// `GAP_WAITING`, `GAP_WAITED`.
    pub gaps: u8,
    /// Segments held back while the walk waits for a gap's bytes (at most 255).
    pub held: u8,
}

/// What walking one segment told of the response it carries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Framed {
    /// A final response ended within the segment.
    pub ended: bool,
    /// A final response ended within the segment, after a gap in its data that the walk passed
    /// over: it ends when the client acknowledges its last byte (by then the gap is filled).
    pub ends_at_ack: bool,
    /// The response's first body byte is in the segment.
    pub body_began: bool,
    /// After the segment, a response is open whose end the framing will tell (at its last
    /// byte, or at the close): the quiet turn must not end it.
    pub open: bool,
    /// The framing was lost at this segment, or is still lost.
    pub lost: bool,
}

impl Framed {
    /// The five answers as bits of one byte, for a call that takes only integers.
    #[inline(always)]
    pub const fn to_bits(self) -> u8 {
        self.ended as u8
            | (self.ends_at_ack as u8) << 1
            | (self.body_began as u8) << 2
            | (self.open as u8) << 3
            | (self.lost as u8) << 4
    }

    /// The answers [`Framed::to_bits`] packed.
    #[inline(always)]
    pub const fn from_bits(bits: u8) -> Self {
        Self {
            ended: bits & 1 != 0,
            ends_at_ack: bits & 2 != 0,
            body_began: bits & 4 != 0,
            open: bits & 8 != 0,
            lost: bits & 16 != 0,
        }
    }
}

/// The response the caller's turn expects the segment to carry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Expected {
    /// A request is waiting for its response's first byte: a response may begin here.
    pub begins: bool,
    /// That request is a `HEAD`: its response has no body.
    pub head: bool,
}

/// True if `first` (a request's first four bytes, big-endian) begin a `HEAD` request.
#[inline(always)]
pub const fn is_head_request(first: u32) -> bool {
    first == u32::from_be_bytes(*b"HEAD")
}

/// True if `first` (a payload's first four bytes, or its first bytes and then zeros) begin an
/// HTTP/1.x status line.
#[inline(always)]
const fn is_status_line(first: u32) -> bool {
    let http = u32::from_be_bytes(*b"HTTP");
    first == http
        || first == http & 0xffff_ff00
        || first == http & 0xffff_0000
        || first == http & 0xff00_0000
}

/// `b` in lower case, if it is an ASCII letter.
#[inline(always)]
const fn lower(b: u8) -> u8 {
    if b >= b'A' && b <= b'Z' { b + 32 } else { b }
}

/// The value of `b` as a hex digit, if it is one.
#[inline(always)]
const fn hex(b: u8) -> Option<u32> {
    match b {
        b'0'..=b'9' => Some((b - b'0') as u32),
        b'a'..=b'f' => Some((b - b'a' + 10) as u32),
        b'A'..=b'F' => Some((b - b'A' + 10) as u32),
        _ => None,
    }
}

impl ResponseFraming {
    /// The server's first byte will be at `seq` (a connection tracked from its handshake): the
    /// walk knows its place before the first response, so a first segment that arrives after
    /// the segments behind it is waited for like any other.
    #[inline(always)]
    pub fn expect_first(&mut self, seq: u32) {
        self.next_seq = seq;
        self.flags.set(FRAMED);
    }

    /// True once the framing is lost (until the next response that begins with a status
    /// line).
    #[inline(always)]
    pub fn is_lost(&self) -> bool {
        self.state == LOST
    }

    /// True while a response is open whose end the framing will tell.
    #[inline(always)]
    pub fn is_open(&self) -> bool {
        self.flags.get() & IN_RESPONSE != 0 && self.state != LOST
    }

    /// Walk one server→client segment: `len` payload bytes at `seq`, read through `payload`,
    /// `expected` as the turn says.
    pub fn walk<P: Payload>(
        &mut self,
        seq: u32,
        len: u32,
        payload: &P,
        expected: Expected,
    ) -> Framed {
        let mut framed = Framed::default();
        let Some(mut pos) = self.begin(seq, len, payload, expected, &mut framed) else {
            return self.after(framed);
        };
        let mut steps = 0;
        while pos < len && self.state != LOST {
            if steps == MAX_STEPS {
                self.lose();
                break;
            }
            pos += self.step(payload, pos, len - pos, &mut framed);
            steps += 1;
        }
        self.next_seq = seq.wrapping_add(len);
        self.after(framed)
    }

    /// Where the segment's new bytes begin, with the response it may begin set up: `None`
    /// when there is nothing to walk (no payload, a retransmission, the framing lost).
    #[inline(always)]
    pub fn begin<P: Payload>(
        &mut self,
        seq: u32,
        len: u32,
        payload: &P,
        expected: Expected,
        framed: &mut Framed,
    ) -> Option<u32> {
        if len == 0 {
            return None;
        }
        let end = seq.wrapping_add(len);
        // As much of `HTTP` as the segment holds (a first segment may be shorter).
        let first = len.min(4);
        let begins_with_status = || {
            expected.begins
                && payload
                    .bytes_at(0, first)
                    .is_some_and(|b| is_status_line(b << (8 * (4 - first))))
        };
        if !self.pass_gap((seq, end), expected, begins_with_status) {
            return None;
        }
        let pos = match self
            .flags
            .resume(FRAMED, self.next_seq, (seq, end), begins_with_status)
        {
            Resume::Walked => return None,
            Resume::At(pos) => pos,
            Resume::Lost => {
                self.lose();
                0
            }
            Resume::Reframe => {
                self.frame_at(seq);
                0
            }
        };
        // A response that begins with a status line where the walk is not at a response's
        // start (lost, or a previous body it took to end at the close): framed anew there.
        if pos == 0 && self.state != START && begins_with_status() {
            self.frame_at(seq);
        }
        if expected.begins && self.state == START && self.flags.get() & IN_RESPONSE == 0 {
            self.flags.set(IN_RESPONSE);
            if expected.head {
                self.flags.set(NO_BODY);
            }
        }
        if self.state == LOST {
            self.next_seq = end;
            framed.lost = true;
            return None;
        }
        Some(pos)
    }

    /// A segment of bytes `seq..end`, where a gap may open: false to hold it back unwalked. A gap within
    /// the data being walked (a body's, or the current chunk's) is passed over: its bytes are
    /// taken as skipped, the walk goes on at the segment, and the response's end is marked to
    /// wait for the client's acknowledgement. Any other gap holds the segments ahead of it
    /// back until its bytes come (a lost head: what follows it is body, passed over once the
    /// head is read), unless what was held back before is not passed yet, a new request's
    /// response is awaited while this one is open, the segment begins a response, or
    /// [`MAX_HELD`] are held: then [`WalkFlags::resume`] loses the place.
    #[inline(always)]
    fn pass_gap(
        &mut self,
        (seq, end): (u32, u32),
        expected: Expected,
        begins_with_status: impl FnOnce() -> bool,
    ) -> bool {
        let gaps = self.gaps;
        if self.flags.get() & FRAMED == 0 || !crate::seq_after(seq, self.next_seq) {
            // The gap's bytes came: the walk goes on from them.
            if gaps & GAP_WAITING != 0 && crate::seq_after(end, self.next_seq) {
                self.gaps = gaps & !GAP_WAITING | GAP_WAITED;
                self.held = 0;
            }
            return true;
        }
        let gap = seq.wrapping_sub(self.next_seq);
        match self.state {
            BODY | CHUNK_DATA if gap < self.left => self.left -= gap,
            UNTIL_CLOSE => {}
            LOST => return true,
            // A new request's response while the last one is open: the gap came unseen.
            _ if expected.begins && self.flags.get() & IN_RESPONSE != 0 => return true,
            _ if gaps & GAP_WAITED == 0 && self.held < MAX_HELD && !begins_with_status() => {
                self.gaps = gaps | GAP_WAITING;
                self.held += 1;
                return false;
            }
            _ => return true,
        }
        self.next_seq = seq;
        // What was held back, if anything, is passed: a later gap may be waited for again.
        self.gaps = (gaps | GAP_PASSED) & !GAP_WAITED;
        true
    }

    /// One step of the walk at `pos`, with `rest` bytes of the segment left: a skip over body
    /// bytes, or up to [`STEP_BYTES`] bytes of a head, chunk line or trailer read. Returns the
    /// bytes walked (at least one).
    #[inline(always)]
    pub fn step<P: Payload>(
        &mut self,
        payload: &P,
        pos: u32,
        rest: u32,
        framed: &mut Framed,
    ) -> u32 {
        match self.state {
            BODY | CHUNK_DATA | UNTIL_CLOSE => self.skip(rest, framed),
            LOST => rest,
            _ => self.scan(payload, pos, rest.min(STEP_BYTES), framed),
        }
    }

    /// What the walk says once the segment is walked.
    #[inline(always)]
    pub fn after(&self, mut framed: Framed) -> Framed {
        framed.open = self.is_open();
        framed.lost |= self.state == LOST;
        framed
    }

    /// The segment's bytes are walked to `end` (the kernel's steps end here).
    #[inline(always)]
    pub fn walked_to(&mut self, end: u32) {
        self.next_seq = end;
    }

    /// Skip body bytes: up to `rest` of them, as many as the body or chunk has left.
    #[inline(always)]
    fn skip(&mut self, rest: u32, framed: &mut Framed) -> u32 {
        if self.flags.get() & BODY_BEGAN == 0 {
            self.flags.set(BODY_BEGAN);
            framed.body_began = true;
        }
        if self.state == UNTIL_CLOSE {
            return rest;
        }
        let n = rest.min(self.left);
        self.left -= n;
        if self.left == 0 {
            if self.state == BODY {
                self.end_message(framed);
            } else {
                self.state = CHUNK_DATA_END;
                self.at = 0;
            }
        }
        n
    }

    /// Read up to `n` bytes (1 to [`STEP_BYTES`]) at `pos`, a byte at a time, stopping after
    /// a byte that begins a body, chunk data or a lost framing.
    #[inline(always)]
    fn scan<P: Payload>(&mut self, payload: &P, pos: u32, n: u32, framed: &mut Framed) -> u32 {
        let Some(bytes) = payload.word_at(pos, n) else {
            self.lose();
            return n;
        };
        // The bytes are taken from a register by shifts, not read from the stack by index
        // (the verifiers of 5.10 and 6.1 refused a read past the eight bytes on a path that
        // cannot be taken). The count is hidden from the optimizer, which knows `n` is at most
        // eight and would drop the bound the verifier needs to see the loop end; and the
        // walk's fields are read from memory for each byte, not carried over from the one
        // before: known, the verifier would follow every way through the bytes apart.
        // (The count is 64 bits wide: the verifier follows a whole register through the
        // stack, not a half.)
        let word = u64::from_be_bytes(bytes);
        let mut i: u64 = 0;
        loop {
            let at = core::hint::black_box(i);
            if at >= u64::from(STEP_BYTES) || at >= u64::from(n) {
                return at as u32;
            }
            core::hint::black_box(&mut *self);
            self.byte((word >> (56 - 8 * at)) as u8, framed);
            i = at + 1;
            if matches!(self.state, BODY | CHUNK_DATA | UNTIL_CLOSE | LOST) {
                return i as u32;
            }
        }
    }

    /// One byte of a head, chunk line or trailer.
    #[inline(always)]
    fn byte(&mut self, b: u8, framed: &mut Framed) {
        match self.state {
            START => self.start_byte(b),
            STATUS_LINE => self.status_byte(b),
            LINE_START => self.line_start(b, framed),
            NAME => self.name_byte(b),
            LENGTH_VALUE => self.length_byte(b),
            CODING_VALUE => self.coding_byte(b),
            SKIP_LINE => self.skip_line(b, LINE_START),
            HEAD_END if b == b'\n' => self.head_done(framed),
            CHUNK_SIZE => self.size_byte(b),
            CHUNK_EXT if b == b'\n' => self.size_done(),
            CHUNK_EXT => {}
            CHUNK_DATA_END => self.data_end_byte(b),
            TRAILER_START => self.trailer_start(b, framed),
            TRAILER_SKIP => self.skip_line(b, TRAILER_START),
            TRAILER_END if b == b'\n' => self.end_message(framed),
            _ => self.lose(),
        }
    }

    /// The first byte of a head: a new response's (or the final one after an interim).
    #[inline(always)]
    fn start_byte(&mut self, b: u8) {
        if b != b'H' {
            return self.lose();
        }
        self.flags
            .clear(HAS_LENGTH | CHUNKED | OTHER_FRAMING | BODY_BEGAN);
        self.flags.set(IN_RESPONSE);
        self.bad_length = 0;
        self.state = STATUS_LINE;
        self.at = 1;
        self.status = 0;
        self.left = 0;
    }

    /// A status-line byte: `HTTP/1.x NNN`, the code read, the rest skipped.
    #[inline(always)]
    fn status_byte(&mut self, b: u8) {
        let at = self.at;
        if at >= STATUS_LINE_READ {
            return self.skip_line(b, LINE_START);
        }
        self.at = at + 1;
        let fits = match at {
            1 => b == b'T',
            2 => b == b'T',
            3 => b == b'P',
            4 => b == b'/',
            5 => b == b'1',
            6 => b == b'.',
            7 => b.is_ascii_digit(),
            8 => b == b' ',
            _ => b.is_ascii_digit(),
        };
        if !fits {
            return self.lose();
        }
        if at >= 9 {
            self.status = self.status * 10 + (b - b'0') as u16;
        }
    }

    /// The first byte of a header line: a name of interest begins, the head ends, or the
    /// line is skipped.
    #[inline(always)]
    fn line_start(&mut self, b: u8, framed: &mut Framed) {
        match lower(b) {
            b'\r' => self.state = HEAD_END,
            b'\n' => self.head_done(framed),
            b'c' => self.match_name(true),
            b't' => self.match_name(false),
            _ => self.state = SKIP_LINE,
        }
    }

    /// Begin matching `Content-Length` (`length`) or `Transfer-Encoding`.
    #[inline(always)]
    fn match_name(&mut self, length: bool) {
        if length {
            self.flags.set(NAME_IS_LENGTH);
        } else {
            self.flags.clear(NAME_IS_LENGTH);
        }
        self.state = NAME;
        self.at = 1;
    }

    /// A byte of a header name being matched, or the colon after it.
    #[inline(always)]
    fn name_byte(&mut self, b: u8) {
        const LENGTH: &[u8; 14] = b"content-length";
        const CODING: &[u8; 17] = b"transfer-encoding";
        let length = self.flags.get() & NAME_IS_LENGTH != 0;
        let at = self.at as usize;
        let (name_len, expected) = if length {
            (LENGTH.len(), LENGTH.get(at).copied())
        } else {
            (CODING.len(), CODING.get(at).copied())
        };
        if at == name_len && b == b':' {
            self.begin_value(length);
        } else if expected == Some(lower(b)) {
            self.at += 1;
        } else {
            self.skip_line(b, LINE_START);
        }
    }

    /// The value of `Content-Length` (`length`) or `Transfer-Encoding` begins.
    #[inline(always)]
    fn begin_value(&mut self, length: bool) {
        self.at = 0;
        if length {
            // A second Content-Length is not followed (RFC 9112 allows one that repeats the
            // first; it is rare enough to infer the end instead).
            if self.flags.get() & HAS_LENGTH != 0 {
                self.bad_length = 1;
            }
            self.flags.set(HAS_LENGTH);
            self.state = LENGTH_VALUE;
            self.left = 0;
        } else {
            self.state = CODING_VALUE;
        }
    }

    /// A byte of a `Content-Length` value: digits, white space, the line's end.
    #[inline(always)]
    fn length_byte(&mut self, b: u8) {
        match b {
            b'0'..=b'9' => match self.left.checked_mul(10) {
                Some(v) if v <= u32::MAX - (b - b'0') as u32 => {
                    self.left = v + (b - b'0') as u32;
                    self.at = 1;
                }
                _ => self.bad_length = 1,
            },
            b' ' | b'\t' | b'\r' => {}
            b'\n' => {
                if self.at == 0 {
                    self.bad_length = 1;
                }
                self.state = LINE_START;
            }
            _ => self.bad_length = 1,
        }
    }

    /// A byte of a `Transfer-Encoding` value: is its last coding `chunked`?
    #[inline(always)]
    fn coding_byte(&mut self, b: u8) {
        const CHUNKED_NAME: &[u8; 7] = b"chunked";
        let at = self.at as usize;
        match b {
            b',' => self.at = 0,
            b' ' | b'\t' | b'\r' => {}
            b'\n' => {
                if at == CHUNKED_NAME.len() {
                    self.flags.set(CHUNKED);
                    self.flags.clear(OTHER_FRAMING);
                } else {
                    self.flags.clear(CHUNKED);
                    self.flags.set(OTHER_FRAMING);
                }
                self.state = LINE_START;
            }
            _ if CHUNKED_NAME.get(at).copied() == Some(lower(b)) => self.at += 1,
            _ => self.at = u8::MAX,
        }
    }

    /// A byte of a line skipped: at its line feed, the state `next`.
    #[inline(always)]
    fn skip_line(&mut self, b: u8, next: u8) {
        self.state = if b == b'\n' {
            next
        } else if next == LINE_START {
            SKIP_LINE
        } else {
            TRAILER_SKIP
        };
    }

    /// The head is read: what follows it, by RFC 9112 §6.3.
    #[inline(always)]
    fn head_done(&mut self, framed: &mut Framed) {
        let flags = self.flags.get();
        let status = self.status;
        if status / 100 == 1 {
            // 101 switches to another protocol; another 1xx is followed by the final head.
            if status == 101 {
                return self.lose();
            }
            self.state = START;
        } else if flags & NO_BODY != 0 || status == 204 || status == 304 {
            self.end_message(framed);
        } else if flags & CHUNKED != 0 {
            self.state = CHUNK_SIZE;
            self.at = 0;
            self.left = 0;
        } else if flags & OTHER_FRAMING != 0 {
            self.state = UNTIL_CLOSE;
        } else if self.bad_length != 0 {
            self.lose();
        } else if flags & HAS_LENGTH != 0 && self.left == 0 {
            self.end_message(framed);
        } else if flags & HAS_LENGTH != 0 {
            self.state = BODY;
        } else {
            self.state = UNTIL_CLOSE;
        }
    }

    /// A byte of a chunk-size line's digits.
    #[inline(always)]
    fn size_byte(&mut self, b: u8) {
        match hex(b) {
            Some(d) if self.left <= MAX_CHUNK_SIZE >> 4 => {
                self.left = self.left << 4 | d;
                self.at = 1;
            }
            Some(_) => self.lose(),
            None if self.at == 0 => self.lose(),
            None if b == b'\n' => self.size_done(),
            None if matches!(b, b';' | b' ' | b'\t' | b'\r') => self.state = CHUNK_EXT,
            None => self.lose(),
        }
    }

    /// A chunk-size line is read: the chunk's data, or the trailers after the last chunk.
    #[inline(always)]
    fn size_done(&mut self) {
        self.state = if self.left == 0 {
            TRAILER_START
        } else {
            CHUNK_DATA
        };
    }

    /// A byte of the CRLF after a chunk's data.
    #[inline(always)]
    fn data_end_byte(&mut self, b: u8) {
        match (self.at, b) {
            (0, b'\r') => self.at = 1,
            (_, b'\n') => {
                self.state = CHUNK_SIZE;
                self.at = 0;
                self.left = 0;
            }
            _ => self.lose(),
        }
    }

    /// The first byte of a trailer line, or of the empty line that ends the message.
    #[inline(always)]
    fn trailer_start(&mut self, b: u8, framed: &mut Framed) {
        match b {
            b'\r' => self.state = TRAILER_END,
            b'\n' => self.end_message(framed),
            _ => self.state = TRAILER_SKIP,
        }
    }

    /// A final response ended: the next byte begins the next response.
    #[inline(always)]
    fn end_message(&mut self, framed: &mut Framed) {
        if self.gaps & GAP_PASSED != 0 {
            framed.ends_at_ack = true;
        } else {
            framed.ended = true;
        }
        self.gaps = 0;
        self.state = START;
        self.flags.clear(IN_RESPONSE | NO_BODY | BODY_BEGAN);
    }

    /// The walk could not take every step the segment needed (the kernel's bound): the
    /// framing is lost.
    #[inline(always)]
    pub fn give_up(&mut self) {
        self.lose();
    }

    /// The framing is lost.
    #[inline(always)]
    fn lose(&mut self) {
        self.state = LOST;
        self.gaps = 0;
        self.held = 0;
        self.flags.clear(IN_RESPONSE | NO_BODY | BODY_BEGAN);
    }

    /// Frame anew at `seq`, a response's first byte.
    #[inline(always)]
    fn frame_at(&mut self, seq: u32) {
        self.next_seq = seq;
        self.state = START;
        self.at = 0;
        self.left = 0;
        self.gaps = 0;
        self.held = 0;
        self.flags.clear(IN_RESPONSE | NO_BODY | BODY_BEGAN);
        self.flags.set(FRAMED);
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::{vec, vec::Vec};

    use super::*;
    use crate::test_bytes::Bytes;

    const LENGTH: &[u8] = b"HTTP/1.1 200 OK\r\nServer: t\r\nContent-Length: 5\r\n\r\nhello";
    const CHUNKED: &[u8] = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
        5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Trailer: 1\r\n\r\n";
    const SSE_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
        transfer-encoding: chunked\r\n\r\n";

    /// A stream walked segment by segment from sequence number `seq`.
    struct Stream {
        framing: ResponseFraming,
        seq: u32,
    }

    impl Stream {
        fn new() -> Self {
            Self {
                framing: ResponseFraming::default(),
                seq: 1_000,
            }
        }

        /// Walk `bytes` as the next segment; `begins`: a request awaits its response.
        fn send(&mut self, bytes: &[u8], begins: bool, head: bool) -> Framed {
            let framed = self.resend(self.seq, bytes, begins, head);
            self.seq = self.seq.wrapping_add(bytes.len() as u32);
            framed
        }

        fn resend(&mut self, seq: u32, bytes: &[u8], begins: bool, head: bool) -> Framed {
            let expected = Expected { begins, head };
            self.framing
                .walk(seq, bytes.len() as u32, &Bytes(bytes), expected)
        }
    }

    /// Walk `message` cut at `cuts` (offsets), the first segment beginning the response:
    /// the index of the segment where it ended, if any, and of the one with its first body
    /// byte.
    fn walk_cut(message: &[u8], cuts: &[usize], head: bool) -> (Option<usize>, Option<usize>) {
        let mut stream = Stream::new();
        let mut bounds = vec![0];
        bounds.extend_from_slice(cuts);
        bounds.push(message.len());
        let (mut ended, mut began) = (None, None);
        for (i, w) in bounds.windows(2).enumerate() {
            let framed = stream.send(&message[w[0]..w[1]], i == 0, head);
            assert!(!framed.lost, "lost at segment {i} of {cuts:?}");
            if framed.ended {
                assert_eq!(ended, None, "ended twice, cut at {cuts:?}");
                ended = Some(i);
            }
            if framed.body_began {
                assert_eq!(began, None, "body began twice, cut at {cuts:?}");
                began = Some(i);
            }
            assert_eq!(
                framed.open,
                ended.is_none(),
                "open at segment {i} of {cuts:?}"
            );
        }
        (ended, began)
    }

    #[test]
    fn a_response_ends_at_its_last_byte_wherever_a_segment_cuts_it() {
        for message in [LENGTH, CHUNKED] {
            let last = message.len();
            assert_eq!(walk_cut(message, &[], false).0, Some(0));
            for cut in 1..last {
                assert_eq!(walk_cut(message, &[cut], false).0, Some(1), "cut at {cut}");
                for second in cut + 1..last {
                    let (ended, _) = walk_cut(message, &[cut, second], false);
                    assert_eq!(ended, Some(2), "cut at {cut} and {second}");
                }
            }
        }
    }

    #[test]
    fn a_byte_a_segment_ends_at_the_last_byte_and_the_body_begins_at_its_first() {
        let head_len = LENGTH.len() - 5;
        let cuts: Vec<usize> = (1..LENGTH.len()).collect();
        assert_eq!(
            walk_cut(LENGTH, &cuts, false),
            (Some(LENGTH.len() - 1), Some(head_len))
        );
        let cuts: Vec<usize> = (1..CHUNKED.len()).collect();
        let first_data = CHUNKED.windows(5).position(|w| w == b"hello").unwrap();
        assert_eq!(
            walk_cut(CHUNKED, &cuts, false),
            (Some(CHUNKED.len() - 1), Some(first_data))
        );
    }

    #[test]
    fn a_stream_stays_open_through_its_pauses_until_the_last_chunk() {
        let mut stream = Stream::new();
        let framed = stream.send(SSE_HEAD, true, false);
        assert!(framed.open && !framed.body_began && !framed.ended);
        let first = stream.send(b"14\r\ndata: {\"role\":\"x\"}\n\n\r\n", false, false);
        assert!(first.open && first.body_began && !first.ended);
        for _ in 0..40 {
            let token = stream.send(b"f\r\ndata: {\"t\":1}\n\n\r\n", false, false);
            assert!(token.open && !token.body_began && !token.ended);
        }
        let done = stream.send(b"e\r\ndata: [DONE]\n\n\r\n", false, false);
        assert!(done.open && !done.ended);
        let last = stream.send(b"0\r\n\r\n", false, false);
        assert!(!last.open && last.ended);
    }

    #[test]
    fn responses_without_a_body_end_at_their_head() {
        for (message, head) in [
            (&b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n"[..], true),
            (b"HTTP/1.1 204 No Content\r\nServer: t\r\n\r\n", false),
            (
                b"HTTP/1.1 304 Not Modified\r\nContent-Length: 30\r\n\r\n",
                false,
            ),
            (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", false),
            (b"HTTP/1.1 200 OK\nContent-Length: 0\n\n", false),
        ] {
            for cut in 1..message.len() {
                assert_eq!(
                    walk_cut(message, &[cut], head),
                    (Some(1), None),
                    "cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn an_interim_response_is_passed_over_to_the_final_one() {
        let mut message = b"HTTP/1.1 100 Continue\r\n\r\n".to_vec();
        message.extend_from_slice(LENGTH);
        for cut in 1..message.len() {
            assert_eq!(walk_cut(&message, &[cut], false).0, Some(1), "cut at {cut}");
        }
    }

    #[test]
    fn names_are_matched_in_any_case_and_the_last_coding_decides() {
        let chunked = b"HTTP/1.1 200 OK\r\ntRANSFER-eNCODING: gzip, Chunked \r\n\r\n0\r\n\r\n";
        assert_eq!(walk_cut(chunked, &[], false).0, Some(0));
        let length = b"HTTP/1.1 200 OK\r\nCONTENT-LENGTH:  3\r\n\r\nabc";
        assert_eq!(walk_cut(length, &[], false).0, Some(0));
        // Chunked comes before Content-Length.
        let both =
            b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        assert_eq!(walk_cut(both, &[], false).0, Some(0));
        // Neither name, though alike.
        let alike = b"HTTP/1.1 200 OK\r\nContent-Lengthy: 3\r\nTransfer: chunked\r\n\r\nabc";
        let mut stream = Stream::new();
        let framed = stream.send(alike, true, false);
        assert!(
            framed.open && !framed.ended,
            "a body without length ends at the close"
        );
    }

    #[test]
    fn bodies_delimited_by_the_close_stay_open() {
        for message in [
            &b"HTTP/1.0 200 OK\r\nServer: t\r\n\r\nsome body"[..],
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nxyz",
        ] {
            let mut stream = Stream::new();
            let framed = stream.send(message, true, false);
            assert!(framed.open && framed.body_began && !framed.ended && !framed.lost);
            let more = stream.send(b"more", false, false);
            assert!(more.open && !more.ended);
        }
    }

    #[test]
    fn keep_alive_responses_follow_one_another() {
        let mut stream = Stream::new();
        for _ in 0..3 {
            assert!(stream.send(LENGTH, true, false).ended);
            assert!(stream.send(CHUNKED, true, false).ended);
            assert!(
                stream
                    .send(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n", true, true)
                    .ended
            );
        }
    }

    #[test]
    fn retransmitted_bytes_are_walked_once() {
        let mut stream = Stream::new();
        let start = stream.seq;
        let (head, body) = LENGTH.split_at(LENGTH.len() - 3);
        assert!(stream.send(head, true, false).open);
        // The head again, then the whole response again, cut elsewhere.
        assert!(stream.resend(start, head, false, false).open);
        let whole = stream.resend(start, LENGTH, false, false);
        assert!(whole.ended && !whole.open);
        stream.seq = start.wrapping_add(LENGTH.len() as u32);
        let again = stream.resend(start.wrapping_add(head.len() as u32), body, false, false);
        assert_eq!(again, Framed::default());
    }

    #[test]
    fn a_gap_that_never_fills_is_given_up_at_the_next_response() {
        let mut stream = Stream::new();
        assert!(stream.send(SSE_HEAD, true, false).open);
        stream.seq += 10;
        // Ahead of a gap in a chunk-size line: held back, the response still open.
        let ahead = stream.send(b"f\r\ndata: {\"t\":1}\n\n\r\n", false, false);
        assert!(ahead.open && !ahead.lost && !ahead.body_began, "{ahead:?}");
        assert!(stream.send(b"0\r\n\r\n", false, false).open);
        // The next request's response: the gap is given up, the walk framed anew there.
        stream.seq += 100;
        let next = stream.send(LENGTH, true, false);
        assert!(next.ended && !next.lost, "{next:?}");
        // Sequence numbers wrap within a response.
        let mut wrapping = Stream::new();
        wrapping.seq = u32::MAX - 3;
        assert!(wrapping.send(LENGTH, true, false).ended);
    }

    #[test]
    fn a_gap_within_a_body_or_a_chunk_is_passed_over_and_its_end_waits_for_the_ack() {
        // Content-Length: the gap in the body; chunked: the gap in the first chunk's data.
        for (message, gap_at) in [(LENGTH, LENGTH.len() - 4), (CHUNKED, 57)] {
            let mut stream = Stream::new();
            let (head, rest) = message.split_at(gap_at);
            assert!(stream.send(head, true, false).open);
            let gap_seq = stream.seq;
            stream.seq += 2;
            let ahead = stream.send(&rest[2..], false, false);
            assert!(
                ahead.ends_at_ack && !ahead.ended && !ahead.lost && !ahead.open,
                "{ahead:?}"
            );
            // The retransmission of the gap is walked once: nothing more.
            let filled = stream.resend(gap_seq, &rest[..2], false, false);
            assert_eq!(filled, Framed::default());
            // The next response is framed as usual.
            let next = stream.send(LENGTH, true, false);
            assert!(next.ended && !next.ends_at_ack);
        }
    }

    #[test]
    fn segments_ahead_of_a_lost_head_wait_for_it_and_its_body_is_passed_over() {
        let message = b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n0123456789abcdefghij";
        let head_and_some = 44;
        let mut stream = Stream::new();
        assert!(stream.send(LENGTH, true, false).ended);
        let start = stream.seq;
        // The first segment is lost; two segments of body arrive ahead of it, held back.
        stream.seq += head_and_some as u32;
        let held = stream.send(&message[head_and_some..50], true, false);
        assert_eq!(held, Framed::default());
        assert_eq!(
            stream.send(&message[50..55], true, false),
            Framed::default()
        );
        // The lost segment comes: its head is read and its body begins.
        let late = stream.resend(start, &message[..head_and_some], true, false);
        assert!(late.open && late.body_began && !late.lost, "{late:?}");
        // What was held back is passed over; the end waits for the ack.
        let last = stream.send(&message[55..], false, false);
        assert!(last.ends_at_ack && !last.lost, "{last:?}");
    }

    #[test]
    fn a_connection_s_first_response_whose_first_segment_is_lost_is_waited_for() {
        let message = b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n0123456789abcdefghij";
        let mut stream = Stream::new();
        stream.framing.expect_first(stream.seq);
        let start = stream.seq;
        stream.seq += 44;
        assert_eq!(
            stream.send(&message[44..50], true, false),
            Framed::default()
        );
        let late = stream.resend(start, &message[..44], true, false);
        assert!(late.open && late.body_began && !late.lost, "{late:?}");
        let last = stream.send(&message[50..], false, false);
        assert!(last.ends_at_ack && !last.lost, "{last:?}");
    }

    #[test]
    fn a_second_gap_that_cannot_be_passed_over_loses_the_framing() {
        let mut stream = Stream::new();
        assert!(stream.send(SSE_HEAD, true, false).open);
        let gap_seq = stream.seq;
        stream.seq += 4;
        let held = stream.send(b"data", false, false);
        assert!(held.open && !held.lost && !held.body_began, "{held:?}");
        // The gap fills with a chunk whose size line the walk reads; the bytes held back
        // were not walked: the next gap, in a chunk-size line, loses the framing.
        let filled = stream.resend(gap_seq, b"2\r\nab", false, false);
        assert!(filled.open && filled.body_began, "{filled:?}");
        stream.seq = gap_seq + 6 + 10;
        assert!(stream.send(b"\r\n0\r\n\r\n", false, false).lost);
    }

    #[test]
    fn a_gap_over_a_body_s_end_holds_what_follows_until_it_fills() {
        let mut stream = Stream::new();
        let (head, body) = LENGTH.split_at(LENGTH.len() - 5);
        assert!(stream.send(head, true, false).open);
        let gap_seq = stream.seq;
        stream.seq += body.len() as u32;
        // Bytes after the body's end, ahead of the gap that holds it: held back.
        let ahead = stream.send(b"HTTP/1.1 200 OK\r\n", false, false);
        assert!(ahead.open && !ahead.lost && !ahead.ended, "{ahead:?}");
        // The gap fills: the response ends there, framed.
        let filled = stream.resend(gap_seq, body, false, false);
        assert!(filled.ended && !filled.ends_at_ack, "{filled:?}");
    }

    #[test]
    fn what_is_not_http_or_not_framed_loses_the_framing() {
        for message in [
            &b"+PONG\r\n"[..],
            b"HTTP/2.0 200 OK\r\n\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 5x\r\n\r\nhello",
            b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\nhello",
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffff0\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n",
        ] {
            let mut stream = Stream::new();
            let framed = stream.send(message, true, false);
            assert!(framed.lost && !framed.open && !framed.ended, "{message:?}");
            // The next response frames again.
            assert!(stream.send(LENGTH, true, false).ended, "{message:?}");
        }
    }

    #[test]
    fn a_segment_of_many_chunks_is_walked_whole() {
        let mut message = SSE_HEAD.to_vec();
        for _ in 0..1_000 {
            message.extend_from_slice(b"3\r\nabc\r\n");
        }
        message.extend_from_slice(b"0\r\n\r\n");
        assert_eq!(walk_cut(&message, &[], false), (Some(0), Some(0)));
    }

    /// A connection as the kernel programs feed it: requests in, responses walked and fed to
    /// the turn, the client's acknowledgements.
    struct Conn {
        turn: crate::turn::Turn,
        server: Stream,
        client_seq: u32,
        counted: crate::turn::TurnDelta,
    }

    impl Conn {
        fn new() -> Self {
            Self {
                turn: crate::turn::Turn::default(),
                server: Stream::new(),
                client_seq: 7,
                counted: crate::turn::TurnDelta::default(),
            }
        }

        fn add(&mut self, d: crate::turn::TurnDelta) {
            let c = &mut self.counted;
            c.started += d.started;
            c.completed += d.completed;
            c.rejected += d.rejected;
            c.abandoned += d.abandoned;
            c.inferred += d.inferred;
            c.bodies_begun += d.bodies_begun;
            c.bodies_ended += d.bodies_ended;
        }

        fn request(&mut self, bytes: &[u8]) {
            let head = self.turn.may_begin_request() && bytes.starts_with(b"HEAD ");
            let d = self.turn.on_client_segment(
                self.client_seq,
                bytes.len() as u32,
                Some(self.server.seq),
                head,
            );
            self.client_seq += bytes.len() as u32;
            self.add(d);
        }

        /// The server sends `bytes` (`walk`: its framing is read), the client acknowledges.
        fn respond(&mut self, bytes: &[u8], walk: bool) {
            let seq = self.server.seq;
            let expected = self.turn.expected();
            let framed = if walk {
                self.server.send(bytes, expected.begins, expected.head)
            } else {
                self.server.seq += bytes.len() as u32;
                Framed::default()
            };
            let start = match bytes.get(..crate::turn::STATUS_LINE_PREFIX) {
                Some(first) if expected.begins => {
                    crate::turn::response_start(first.try_into().unwrap())
                }
                _ => crate::turn::ResponseStart::Other,
            };
            let d = self
                .turn
                .on_server_segment(seq, bytes.len() as u32, true, (start, framed));
            self.add(d);
            let ack = self
                .turn
                .on_client_segment(self.client_seq, 0, Some(self.server.seq), false);
            self.add(ack);
        }
    }

    #[test]
    fn a_streamed_response_completes_at_its_last_chunk_however_long_it_pauses() {
        let mut conn = Conn::new();
        conn.request(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n");
        conn.respond(SSE_HEAD, true);
        assert_eq!(
            (conn.counted.completed, conn.counted.bodies_begun),
            (0, 0),
            "waiting"
        );
        for _ in 0..10 {
            conn.respond(b"f\r\ndata: {\"t\":1}\n\n\r\n", true);
        }
        assert_eq!(
            (conn.counted.completed, conn.counted.bodies_begun),
            (0, 1),
            "streaming"
        );
        conn.respond(b"0\r\n\r\n", true);
        let c = conn.counted;
        assert_eq!(
            (c.started, c.completed, c.inferred, c.bodies_ended),
            (1, 1, 0, 1)
        );
        // The next request on the connection counts nothing more for this one.
        conn.request(b"GET / HTTP/1.1\r\n\r\n");
        assert_eq!((conn.counted.started, conn.counted.completed), (2, 1));
    }

    #[test]
    fn unframed_responses_end_at_the_quiet_turn_and_are_inferred() {
        let mut conn = Conn::new();
        conn.request(b"POST / HTTP/1.1\r\n\r\n");
        conn.respond(SSE_HEAD, false);
        let c = conn.counted;
        assert_eq!((c.completed, c.inferred, c.bodies_begun), (1, 1, 0));
        conn.request(b"PING\r\n");
        conn.respond(b"+PONG\r\n", true);
        assert_eq!((conn.counted.completed, conn.counted.inferred), (2, 2));
    }

    #[test]
    fn a_framed_rejection_and_a_head_response_complete_at_their_end() {
        let mut conn = Conn::new();
        conn.request(b"GET / HTTP/1.1\r\n\r\n");
        conn.respond(
            b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 4\r\n\r\n",
            true,
        );
        assert_eq!(conn.counted.completed, 0, "its body is still to come");
        conn.respond(b"full", true);
        assert_eq!((conn.counted.completed, conn.counted.rejected), (1, 1));
        conn.request(b"HEAD / HTTP/1.1\r\n\r\n");
        conn.respond(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n", true);
        // The rejection's body began (and ended); the HEAD response has none.
        let c = conn.counted;
        assert_eq!(
            (c.completed, c.rejected, c.inferred, c.bodies_begun),
            (2, 1, 0, 1)
        );
    }

    #[test]
    fn a_body_delimited_by_the_close_completes_at_the_close_framed() {
        let mut conn = Conn::new();
        conn.request(b"GET / HTTP/1.0\r\n\r\n");
        conn.respond(b"HTTP/1.0 200 OK\r\n\r\npart", true);
        conn.respond(b" and more", true);
        assert_eq!(conn.counted.completed, 0);
        let d = conn.turn.on_close(false);
        conn.add(d);
        let c = conn.counted;
        assert_eq!(
            (c.completed, c.inferred, c.bodies_begun, c.bodies_ended),
            (1, 0, 1, 1)
        );
    }

    #[test]
    fn head_requests_are_known_by_their_first_bytes() {
        assert!(is_head_request(u32::from_be_bytes(*b"HEAD")));
        assert!(!is_head_request(u32::from_be_bytes(*b"GET ")));
    }
}
