//! HTTP/2 streams on one TCP connection, counted from the frames both ends send.
//!
//! HTTP/2 (and gRPC, which runs on it) multiplexes requests as streams on one connection, so
//! the turns of [`crate::turn`] mean nothing there. Each direction instead walks its 9-byte
//! frame headers ([`FrameStream`]), headers split across segments included, as the TLS record
//! walk does, and the frames open and end the connection's streams ([`StreamTable`]):
//!
//! * a request **starts** with the client's HEADERS frame on a new stream (a client stream id
//!   above every one before it; a later HEADERS on the same stream is its trailers);
//! * it **waits** until the server's first DATA frame on it, then **streams** (a gRPC
//!   server-streaming call, an LLM engine's tokens): headers alone do not count, as an engine
//!   sends them before it schedules the request; the stream table sums the wait for the time
//!   to first body byte;
//! * it **completes** with the server's HEADERS or DATA frame carrying END_STREAM on it, or
//!   with the server's RST_STREAM; a client's RST_STREAM (a cancel) **abandons** it;
//! * the connection's close abandons what is left (the streams above a server's GOAWAY among
//!   them: it did not and will not process them);
//! * in flight = open streams.
//!
//! A response is a **rejection** when its HEADERS frame begins with `:status` 429 or 503
//! spelled out (HPACK literal with the static name `:status`: nginx, HAProxy and most
//! encoders write these so; one that indexes a repeated 429 in its dynamic table is counted as
//! served from the second on). A rejection completes at that frame, as an HTTP/1.x rejection
//! completes when its write ends. A RST_STREAM of REFUSED_STREAM (the server did not process
//! the stream, the client may retry it) is one too. On a [`Protocol::Grpc`] endpoint, a
//! trailers-only response (the stream's one HEADERS frame, `:status` 200 and END_STREAM: how
//! gRPC answers a call with an error and no message, RESOURCE_EXHAUSTED and UNAVAILABLE among
//! them) is a rejection as well.
//!
//! A connection is HTTP/2 when its client's first payload is the connection preface
//! (`PRI * HTTP/2.0…`; where the first byte is known, the payload that holds it, see
//! [`FrameStream::expect_first`]); one adopted mid-stream (open before it was watched) when
//! its first payload seen has the shape of a frame header (see [`plausible_frame_header`]), or always
//! on an endpoint set to [`Protocol::Http2`] or [`Protocol::Grpc`]. A stream whose framing is
//! lost (a segment that overtook bytes and begins inside a frame) is framed again at the next
//! segment that begins with a plausible frame header. Every frame of a segment is walked,
//! however many: the loop runs as many times as the segment could hold frame headers.
//!
//! **Concurrency.** Each [`FrameStream`] is written by its own direction only, like the turn's
//! words; the client's holds the highest stream id opened ([`FrameStream::max_stream`]). The
//! open streams are entries of a table that both directions change ([`StreamTable`], of its
//! own module): the one event that removes a stream's entry counts its end, exactly once,
//! whichever CPU sees it first.
//!
//! Bounds: none per connection. Every open stream is an entry of the stream table, whose size
//! bounds them all; a stream that finds it full is counted as untracked, not started.
//!
//! **Order.** A segment that arrives before the bytes ahead of it (reordered on the way, or
//! after a loss) is parked by the programs where they can ([`Parked`], of its own module) and
//! walked once those bytes have been. One that cannot be parked leaves a [`Hole`]: the walk
//! frames anew at the segment, and walks the bytes from the place it saved when they come;
//! one hole per connection at a time. Over TLS the frames are encrypted and nothing here
//! applies.

mod parked;
mod streams;

pub use parked::{
    PARK_SCRATCH_MAP, PARKED_BYTES, PARKED_MAP, PARKED_MAX_AGE_NS, PARKED_PER_CONNECTION, ParkKey,
    Parked, ParkedBytes, ParkedPlaces,
};
pub use streams::{
    BODIES_MAP, CLOSED_ENTRIES, CLOSED_MAP, DEFAULT_MAX_STREAMS, Ended, Opened, STREAMS_MAP,
    StreamEntry, StreamKey, StreamTable,
};

use crate::{
    Payload, Protocol, Resume, WalkFlags,
    tls::{Sender, is_record_header},
    turn::TurnDelta,
};

/// Bytes of the client's connection preface, `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`.
pub const PREFACE_LEN: u32 = 24;
/// Bytes of a frame header.
pub const FRAME_HEADER_LEN: u32 = 9;
/// The largest frame payload a peer may send before the other raises its limit
/// (SETTINGS_MAX_FRAME_SIZE's initial value), used to judge a frame header's shape.
pub const DEFAULT_MAX_FRAME_LEN: u32 = 16_384;

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
/// The highest frame type of RFC 9113 (CONTINUATION).
const LAST_FRAME_TYPE: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// RST_STREAM error code: the stream was not processed.
const REFUSED_STREAM: u32 = 0x7;
/// HPACK: the static table's `:status 200`, indexed.
const STATUS_200_INDEXED: u8 = 0x88;

/// Client stream: its first payload was looked at.
const DETECTED: u8 = 1;
/// Client stream: ... and the connection is HTTP/2.
const HTTP2: u8 = 2;
/// `next_seq` is a known position of the frame stream.
const FRAMED: u8 = 4;
/// Client stream: the connection is TLS (its first payload, a record header).
const ENCRYPTED: u8 = 8;

/// What the frame walk needs from where it runs: a loop whose count is known only at run
/// time. The eBPF programs run it with `bpf_loop` (whose body the verifier checks once, where
/// an unrolled loop would exceed its budget); on kernels without `bpf_loop`, with a loop of a
/// fixed bound, which may stop before the segment's last frame: the walk then pauses
/// ([`FrameWalk::paused`]) and goes on when the same segment is walked again.
pub trait FrameOps {
    /// Run `body` up to `n` times, until it returns false; a bounded loop may stop sooner.
    fn repeat<F: FnMut() -> bool>(n: u32, body: F);
}

/// The frame walk of one direction of a connection. Written only by that direction's
/// segments; the server's reads the client's `flags` (whether the connection is HTTP/2).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameStream {
    /// Sequence number just past the bytes walked so far.
    pub next_seq: u32,
    /// Payload bytes of the current frame (or of the preface) still to come.
    pub left: u32,
    /// The first bytes of a frame header that ended a segment (`held_len` of them,
    /// big-endian, across `held_high` and `held_low`).
    pub held_high: u32,
    /// The low word of the held bytes.
    pub held_low: u32,
    /// How many header bytes are held (0 to 8).
    pub held_len: u8,
    /// Bit flags.
    pub flags: WalkFlags,
    /// The server's walk: a response's HEADERS frame whose segment ended before the first
    /// bytes of its header block, which tell a rejection: `CUT_*` bits (0: none), the bytes
    /// already read in `held_low` (no frame header is held meanwhile), the stream in
    /// `max_stream`. Read on at the next bytes walked.
    pub status_cut: u16,
    /// The client's walk: the highest stream id it opened (a HEADERS on a stream id not above
    /// it is trailers, or a stream seen before). The server's: the stream of `status_cut`.
    pub max_stream: u32,
}

/// `status_cut`: bytes still to skip before the header block (the pad length and the
/// priority fields, 0 to 6).
const CUT_SKIP: u16 = 0x7;
/// `status_cut`: the shift of how many of the block's first 5 bytes are read (0 to 4).
const CUT_HAVE_SHIFT: u16 = 3;
/// `status_cut`: the frame had END_STREAM.
const CUT_END_STREAM: u16 = 1 << 6;
/// `status_cut`: ... and its stream was ended at it (counted completed, not rejected).
const CUT_ENDED: u16 = 1 << 7;
/// `status_cut`: a status is cut (set whenever the others may all be 0).
const CUT_PENDING: u16 = 1 << 8;
/// Bytes of a header block that tell a rejection (see [`is_rejection_status`]).
const STATUS_BYTES: u32 = 5;

/// The bytes of one direction that a later segment overtook (a gap in the sequence): the
/// walk's place where they begin, saved, so that when they arrive they are walked from it.
/// One per connection state: only the direction a vantage point receives can arrive out of
/// order (what it sends passes its programs in order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hole {
    /// The walk's place at the hole's first byte (its `next_seq`).
    pub place: FrameStream,
    /// Sequence number of the segment that overtook the hole: where the walk framed anew.
    pub end: u32,
    /// [`HOLE_NONE`], [`HOLE_OPEN`] or [`HOLE_FILLING`].
    pub state: u8,
    /// The direction: `Sender as u8`.
    pub sender: u8,
    /// 1 when a hole still open was given up for a new one (its bytes' frames are lost),
    /// until the segment's walk reports it.
    pub given_up: u8,
    /// Always zero (explicit padding).
    pub pad: u8,
}

/// No hole.
pub const HOLE_NONE: u8 = 0;
/// A hole waits for its bytes.
pub const HOLE_OPEN: u8 = 1;
/// Its bytes are being walked: the direction's walk and the hole's place are swapped.
pub const HOLE_FILLING: u8 = 2;

/// One segment to walk: `len` payload bytes at `seq`, sent by `sender`, on an endpoint of
/// `protocol`.
pub struct FrameSegment<'a, P> {
    /// Sequence number of the payload's first byte.
    pub seq: u32,
    /// Payload bytes.
    pub len: u32,
    /// The payload.
    pub payload: &'a P,
    /// Who sent it.
    pub sender: Sender,
    /// What the endpoint is declared to speak.
    pub protocol: Protocol,
}

impl<P> Clone for FrameSegment<'_, P> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<P> Copy for FrameSegment<'_, P> {}

/// What a connection's client's first payload says it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Detected {
    /// Request/response turns ([`crate::turn`]).
    Turns,
    /// HTTP/2: streams, counted from its frames.
    Http2,
    /// TLS: its frames, if it carries HTTP/2, are encrypted.
    Tls,
}

/// What one segment's frames did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrameWalk {
    /// The framing was lost at this segment, or is still lost.
    pub unframed: bool,
    /// Streams not counted at this segment: opened when the stream table was full.
    pub untracked: u16,
    /// The walk's loop ran out of steps within the segment: its place is saved there (between
    /// a frame header and its payload), and walking the same segment again goes on from it.
    /// Only a bounded [`FrameOps`] pauses.
    pub paused: bool,
    /// What the frames did to the counters.
    pub delta: TurnDelta,
}

/// True if `h` has the shape of an HTTP/2 frame header: a payload within the default frame
/// size, a frame type of RFC 9113, the reserved bit clear. No HTTP/1.x request (a letter) or
/// TLS record (content type 20 to 23) begins so.
#[inline(always)]
pub const fn plausible_frame_header(h: [u8; 9]) -> bool {
    let len = u32::from_be_bytes([0, h[0], h[1], h[2]]);
    len <= DEFAULT_MAX_FRAME_LEN && h[3] <= LAST_FRAME_TYPE && h[5] & 0x80 == 0
}

/// True if `first`, the start of a response's header block, is `:status` 429 or 503 spelled
/// out: an HPACK literal (with, without or never indexing) of static name 8, three digits raw
/// or Huffman-coded.
#[inline(always)]
pub const fn is_rejection_status(first: [u8; 5]) -> bool {
    let literal = first[0] == 0x48 || first[0] == 0x08 || first[0] == 0x18;
    if !literal {
        return false;
    }
    let digits = [first[2], first[3], first[4]];
    match first[1] {
        0x03 => matches!(digits, [b'4', b'2', b'9'] | [b'5', b'0', b'3']),
        // Huffman: "429" and "503" (17 bits each, padded with ones).
        0x83 => matches!(digits, [0x68, 0x4f, 0x7f] | [0x6c, 0x0c, 0xff]),
        _ => false,
    }
}

/// A frame header's fields.
#[derive(Clone, Copy)]
struct Frame {
    len: u32,
    kind: u8,
    flags: u8,
    stream: u32,
}

impl Frame {
    #[inline(always)]
    const fn parse(h: [u8; 9]) -> Self {
        Self {
            len: u32::from_be_bytes([0, h[0], h[1], h[2]]),
            kind: h[3],
            flags: h[4],
            stream: u32::from_be_bytes([h[5] & 0x7f, h[6], h[7], h[8]]),
        }
    }

    /// True if the frame is on a client-initiated stream (odd id).
    #[inline(always)]
    const fn on_client_stream(&self) -> bool {
        self.stream & 1 == 1
    }
}

/// One segment's frame walk in progress: what its steps read, and where they are.
struct Walking<'a, 'w, P, T> {
    streams: &'a T,
    payload: &'a P,
    w: &'w mut SegmentWalk,
}

/// A segment's walk between its steps: where it is in the segment, and what it found so far.
/// [`FrameStream::walk`] takes the steps in one loop; on a kernel without `bpf_loop` the walk
/// waits in a map between steps, each taken by a function the verifier checks once.
#[derive(Clone, Copy, Debug)]
pub struct SegmentWalk {
    /// The segment's sequence number.
    seq: u32,
    /// Where the walk is in the segment, and its length.
    at: At,
    sender: Sender,
    protocol: Protocol,
    /// The walk has a place in the segment (not a retransmission, not unframed).
    walking: bool,
    /// What the last step said (see `FrameStream::next_frame`): `None` while steps remain.
    outcome: Option<bool>,
    walk: FrameWalk,
}

impl SegmentWalk {
    /// True while a step remains.
    #[inline(always)]
    pub fn is_stepping(&self) -> bool {
        self.walking && self.outcome.is_none()
    }

    /// The most steps the rest of the segment can take: each step but the last reads a whole
    /// frame header, so a loop of this many ends with the segment.
    #[inline(always)]
    pub fn steps(&self) -> u32 {
        (self.at.len - self.at.pos) / FRAME_HEADER_LEN + 1
    }

    /// What the segment's frames did (complete once the walk has ended).
    #[inline(always)]
    pub fn did(&self) -> &FrameWalk {
        &self.walk
    }

    /// The segment's bytes cannot be read where the steps look for them: the framing is
    /// lost, as for a segment that cannot be walked.
    #[inline(always)]
    pub fn lose(&mut self) {
        self.outcome = Some(false);
    }
}

/// Where a frame's payload begins within the segment being walked.
#[derive(Clone, Copy, Debug)]
struct At {
    /// Offset of the frame's first payload byte from the segment's first byte.
    pos: u32,
    /// The segment's payload length.
    len: u32,
}

impl FrameStream {
    /// A direction not walked yet.
    pub const NEW: Self = Self {
        next_seq: 0,
        left: 0,
        held_high: 0,
        held_low: 0,
        held_len: 0,
        flags: WalkFlags(0),
        status_cut: 0,
        max_stream: 0,
    };

    /// True once the connection was found to be HTTP/2 (read on the client's stream).
    #[inline(always)]
    pub fn is_http2(&self) -> bool {
        self.flags.get() & HTTP2 != 0
    }

    /// True once the client's first payload was looked at ([`FrameStream::detect`]).
    #[inline(always)]
    pub fn is_detected(&self) -> bool {
        self.flags.get() & DETECTED != 0
    }

    /// True if the client's first payload was a TLS record: the frames, if any, are
    /// encrypted.
    #[inline(always)]
    pub fn is_encrypted(&self) -> bool {
        self.flags.get() & ENCRYPTED != 0
    }

    /// At the client's first payload (at `seq`), decide what the connection is, on an
    /// endpoint of `protocol`: HTTP/2 for the preface (or a frame header, or always on an
    /// endpoint set to HTTP/2 or gRPC), TLS for a record header, turns otherwise. Once per
    /// connection, on the client's stream.
    #[inline(always)]
    pub fn detect<P: Payload>(&mut self, seq: u32, payload: &P, protocol: Protocol) -> Detected {
        self.flags.set(DETECTED);
        // What [`FrameStream::expect_first`] supposed is kept only by an HTTP/2 connection,
        // framed anew below.
        self.flags.clear(FRAMED | HTTP2);
        if payload.header_at(0).is_some_and(is_record_header) {
            self.flags.set(ENCRYPTED);
            return Detected::Tls;
        }
        let preface = payload.header_at(0) == Some(*b"PRI *")
            && payload.bytes_at(5, 4) == Some(u32::from_be_bytes(*b" HTT"));
        let framed = preface
            || matches!(protocol, Protocol::Http2 | Protocol::Grpc)
            || payload
                .frame_header_at(0)
                .is_some_and(plausible_frame_header);
        if !framed {
            return Detected::Turns;
        }
        self.flags.set(HTTP2);
        self.frame_at(seq);
        if preface {
            self.left = PREFACE_LEN;
        }
        Detected::Http2
    }

    /// Walk the frames of one segment of an HTTP/2 connection. A segment that overtakes
    /// bytes not seen yet leaves a `hole` (the walk's place saved there, the walk framed anew
    /// at the segment); the segment that brings those bytes is walked from the saved place.
    #[inline(always)]
    pub fn walk<P: Payload, A: FrameOps, T: StreamTable>(
        &mut self,
        hole: &mut Hole,
        streams: &T,
        segment: FrameSegment<'_, P>,
    ) -> SegmentWalk {
        let mut w = self.begin_walk(hole, streams, segment);
        if w.is_stepping() {
            A::repeat(w.steps(), || self.step(&mut w, segment.payload, streams));
        }
        self.end_walk(hole, &mut w);
        w
    }

    /// The start of [`FrameStream::walk`]: the hole entered, the walk's place in the segment
    /// found, a header held from the last segment completed. Then [`FrameStream::step`] while
    /// it says so, and [`FrameStream::end_walk`].
    #[inline(always)]
    pub fn begin_walk<P: Payload, T: StreamTable>(
        &mut self,
        hole: &mut Hole,
        streams: &T,
        segment: FrameSegment<'_, P>,
    ) -> SegmentWalk {
        let FrameSegment {
            seq,
            len,
            payload,
            sender,
            protocol,
        } = segment;
        let mut w = SegmentWalk {
            seq,
            at: At { pos: 0, len },
            sender,
            protocol,
            walking: false,
            outcome: None,
            walk: FrameWalk::default(),
        };
        if len == 0 {
            return w;
        }
        // Nothing the hole decides before the walk is kept outside the two (the verifier
        // then checks the walk once, not once for each way the hole went).
        hole.enter(self, (seq, len), sender);
        let Some(pos) = self.resume_at(seq, seq.wrapping_add(len), payload, &mut w.walk) else {
            return w;
        };
        w.walking = true;
        w.at.pos = pos;
        // The bytes from here to the end; a walk that pauses takes back what it did not walk.
        match sender {
            Sender::Client => w.walk.delta.request_bytes = len - pos,
            Sender::Server => w.walk.delta.response_bytes = len - pos,
        }
        if self.held_len > 0 {
            let mut seg = Walking {
                streams,
                payload,
                w: &mut w,
            };
            seg.w.outcome = self.finish_held(&mut seg);
        }
        w
    }

    /// One step of a walk begun by [`FrameStream::begin_walk`]: the rest of the current frame
    /// as far as the segment goes, then the next frame header. True while there are more.
    #[inline(always)]
    pub fn step<P: Payload, T: StreamTable>(
        &mut self,
        w: &mut SegmentWalk,
        payload: &P,
        streams: &T,
    ) -> bool {
        let mut seg = Walking {
            streams,
            payload,
            w,
        };
        seg.w.outcome = self.next_frame::<P, T>(&mut seg);
        seg.w.outcome.is_none()
    }

    /// The end of a walk: the walk's place saved (the segment's end, or where the steps ran
    /// out), the bytes counted, the hole left. What the segment's frames did is then
    /// [`SegmentWalk::did`].
    #[inline(always)]
    pub fn end_walk(&mut self, hole: &mut Hole, w: &mut SegmentWalk) {
        if w.walking {
            match w.outcome {
                Some(true) => self.next_seq = w.seq.wrapping_add(w.at.len),
                Some(false) => {
                    self.flags.clear(FRAMED);
                    w.walk.unframed = true;
                }
                None => {
                    // Paused: the bytes after the pause are not this walk's.
                    self.next_seq = w.seq.wrapping_add(w.at.pos);
                    w.walk.paused = true;
                    let rest = w.at.len - w.at.pos;
                    match w.sender {
                        Sender::Client => w.walk.delta.request_bytes -= rest,
                        Sender::Server => w.walk.delta.response_bytes -= rest,
                    }
                }
            }
        }
        // The hole was entered if the segment has bytes.
        if w.at.len != 0 {
            hole.leave(self, &mut w.walk, w.sender);
        }
    }

    /// The client's first byte will be at `seq` (a connection tracked from its handshake, on
    /// the side that receives the client's bytes, of an endpoint that may speak HTTP/2):
    /// until its first payload is looked at ([`FrameStream::detect`], to be handed that
    /// byte's segment, not one that arrived ahead of it: [`FrameStream::is_ahead`]), the
    /// connection is taken for HTTP/2 framed there, so that a segment ahead of it is parked
    /// like any segment ahead of the walk. `detect` says what it is.
    #[inline(always)]
    pub fn expect_first(&mut self, seq: u32) {
        self.next_seq = seq;
        self.flags.set(HTTP2 | FRAMED);
    }

    /// True if a segment at `seq` would leave a gap: the walk knows its place, and `seq` is
    /// past it (bytes before it have not arrived). Such a segment is parked where the
    /// programs can (see [`Parked`]) and walked once the gap fills.
    #[inline(always)]
    pub fn is_ahead(&self, seq: u32) -> bool {
        self.is_framed() && crate::seq_after(seq, self.next_seq)
    }

    /// The sequence number just past the bytes walked so far, if the walk knows its place.
    #[inline(always)]
    pub fn walked_to(&self) -> Option<u32> {
        self.is_framed().then_some(self.next_seq)
    }

    /// The rest of a segment whose walk paused will not be walked (on a kernel without
    /// `bpf_loop`, its chain of tail calls ran out): the place is lost, and found again at
    /// the next segment that begins with a frame header.
    #[inline(always)]
    pub fn lose_place(&mut self) {
        self.flags.clear(FRAMED);
    }

    /// True while `next_seq` is a known position of the frame stream.
    #[inline(always)]
    fn is_framed(&self) -> bool {
        self.flags.get() & FRAMED != 0
    }

    /// True if the walk stands between two frames: nothing of a frame left, no header held.
    #[inline(always)]
    fn between_frames(&self) -> bool {
        self.is_framed() && self.left == 0 && self.held_len == 0
    }

    /// Where the segment's new bytes begin, framing anew at its start when the framing was
    /// lost (or a gap loses it now). `None` when there is nothing to walk: a retransmission,
    /// or a segment that does not begin with a frame header while unframed.
    #[inline(always)]
    fn resume_at<P: Payload>(
        &mut self,
        seq: u32,
        end: u32,
        payload: &P,
        walk: &mut FrameWalk,
    ) -> Option<u32> {
        let place = self.flags.resume(FRAMED, self.next_seq, (seq, end), || {
            payload
                .frame_header_at(0)
                .is_some_and(plausible_frame_header)
        });
        match place {
            Resume::Walked => None,
            Resume::At(pos) => Some(pos),
            Resume::Lost => {
                walk.unframed = true;
                None
            }
            Resume::Reframe => {
                self.frame_at(seq);
                Some(0)
            }
        }
    }

    /// A header held from the last segment, completed with the bytes at `seg.w.at.pos`, and
    /// its frame begun: `None` to step on, `Some(true)` if the segment ended first (the bytes
    /// are held), `Some(false)` if the framing is lost.
    #[inline(always)]
    fn finish_held<P: Payload, T: StreamTable>(
        &mut self,
        seg: &mut Walking<'_, '_, P, T>,
    ) -> Option<bool> {
        match self.finish_held_header(seg) {
            Some(Some(header)) => {
                seg.w.at.pos += FRAME_HEADER_LEN - self.held_len as u32;
                self.hold(0, 0);
                (!self.begin_frame::<P, T>(seg, header)).then_some(false)
            }
            Some(None) => Some(true),
            None => Some(false),
        }
    }

    /// One step of the walk: the rest of the current frame as far as the segment goes, then
    /// the next frame header if the segment holds it whole (one cut by its end is held).
    /// `None`: go on; `Some(true)`: the segment is walked; `Some(false)`: the framing is lost.
    #[inline(always)]
    fn next_frame<P: Payload, T: StreamTable>(
        &mut self,
        seg: &mut Walking<'_, '_, P, T>,
    ) -> Option<bool> {
        if self.status_cut != 0 {
            self.read_cut_status(seg);
        }
        let at = &mut seg.w.at;
        let take = self.left.min(at.len - at.pos);
        at.pos += take;
        self.left -= take;
        let rest = at.len - at.pos;
        if rest == 0 {
            return Some(true);
        }
        if rest < FRAME_HEADER_LEN {
            let Some(bytes) = read_be(seg.payload, at.pos, rest) else {
                return Some(false);
            };
            self.hold(bytes, rest);
            return Some(true);
        }
        let Some(header) = seg.payload.frame_header_at(at.pos) else {
            return Some(false);
        };
        at.pos += FRAME_HEADER_LEN;
        if !self.begin_frame::<P, T>(seg, header) {
            return Some(false);
        }
        None
    }

    /// Complete a header begun at the end of the last segment with the bytes at
    /// `seg.at.pos`: `Some(Some(header))` when complete, `Some(None)` when the segment ended
    /// first (the bytes are held), `None` if unreadable.
    #[inline(always)]
    fn finish_held_header<P: Payload, T>(
        &mut self,
        seg: &Walking<'_, '_, P, T>,
    ) -> Option<Option<[u8; 9]>> {
        let have = self.held_len as u32;
        let need = FRAME_HEADER_LEN - have;
        let n = need.min(seg.w.at.len - seg.w.at.pos);
        let bytes = read_be(seg.payload, seg.w.at.pos, n)?;
        if n < need {
            self.hold(self.held() << (8 * n) | bytes, have + n);
            return Some(None);
        }
        let mut header = [0u8; 9];
        let mut k = 0;
        while k < 9 {
            header[k as usize] = if k < have {
                (self.held() >> (8 * (have - 1 - k))) as u8
            } else {
                (bytes >> (8 * (need - 1 - (k - have)))) as u8
            };
            k += 1;
        }
        Some(Some(header))
    }

    /// A frame header was read (its payload begins at `seg.at.pos`): act on the frame, and
    /// skip its payload. False if it is not a frame header.
    #[inline(always)]
    fn begin_frame<P: Payload, T: StreamTable>(
        &mut self,
        seg: &mut Walking<'_, '_, P, T>,
        header: [u8; 9],
    ) -> bool {
        let frame = Frame::parse(header);
        if frame.kind > LAST_FRAME_TYPE && frame.len > DEFAULT_MAX_FRAME_LEN {
            // Neither a known frame nor one of ordinary size: not a frame header.
            return false;
        }
        self.left = frame.len;
        match seg.w.sender {
            Sender::Client => self.client_frame(seg.streams, frame, &mut seg.w.walk),
            Sender::Server => self.server_frame(seg, frame),
        }
        true
    }

    /// A frame from the client: a HEADERS on a stream id above every one before opens a
    /// stream (a later one on the same stream is its trailers), RST_STREAM abandons one.
    #[inline(always)]
    fn client_frame<T: StreamTable>(&mut self, streams: &T, frame: Frame, walk: &mut FrameWalk) {
        if !frame.on_client_stream() {
            return;
        }
        match frame.kind {
            HEADERS if frame.stream > self.max_stream => {
                self.max_stream = frame.stream;
                match streams.open(frame.stream) {
                    Opened::New => walk.delta.started += 1,
                    Opened::Known => {}
                    Opened::Full => walk.untracked += 1,
                }
            }
            RST_STREAM => {
                let ended = streams.end(frame.stream);
                walk.delta.abandoned += u16::from(ended != Ended::NotOpen);
                walk.delta.bodies_ended += u16::from(ended == Ended::Streaming);
            }
            _ => {}
        }
    }

    /// The held header bytes.
    #[inline(always)]
    fn held(&self) -> u64 {
        u64::from(self.held_high) << 32 | u64::from(self.held_low)
    }

    /// Hold `len` header bytes, `bytes` (big-endian).
    #[inline(always)]
    fn hold(&mut self, bytes: u64, len: u32) {
        self.held_high = (bytes >> 32) as u32;
        self.held_low = bytes as u32;
        self.held_len = len as u8;
    }

    /// Start framing at a segment that begins with a frame header (or the preface).
    #[inline(always)]
    fn frame_at(&mut self, seq: u32) {
        self.next_seq = seq;
        self.left = 0;
        self.hold(0, 0);
        self.status_cut = 0;
        self.flags.set(FRAMED);
    }

    /// A frame from the server: its first DATA frame with a payload begins a stream's body,
    /// END_STREAM or RST_STREAM completes a stream, a rejection's HEADERS completes it at
    /// once (its body, if any, then begins nothing). (A GOAWAY's unprocessed streams stay open until the
    /// close, which follows it, abandons them.) A HEADERS whose segment ends before the first
    /// bytes of its block is told a rejection or not at the next bytes walked.
    #[inline(always)]
    fn server_frame<P: Payload, T: StreamTable>(
        &mut self,
        seg: &mut Walking<'_, '_, P, T>,
        frame: Frame,
    ) {
        let (at, payload) = (seg.w.at, seg.payload);
        if !frame.on_client_stream() {
            return;
        }
        let end_stream = frame.flags & END_STREAM != 0;
        let start = block_start(frame, at.pos);
        let block = frame.len.saturating_sub(start - at.pos);
        let cut = frame.kind == HEADERS && block > 0 && start + block.min(STATUS_BYTES) > at.len;
        let rejected = match frame.kind {
            HEADERS if !cut => response_rejected(frame, at, payload, seg.w.protocol),
            RST_STREAM => read_be(payload, at.pos, 4) == Some(u64::from(REFUSED_STREAM)),
            _ => false,
        };
        let ends = match frame.kind {
            HEADERS | DATA => end_stream || rejected,
            RST_STREAM => true,
            _ => false,
        };
        let walk = &mut seg.w.walk;
        if frame.kind == DATA && frame.len > 0 && seg.streams.begin_body(frame.stream) {
            walk.delta.bodies_begun += 1;
        }
        let ended = if ends {
            seg.streams.end(frame.stream)
        } else {
            Ended::NotOpen
        };
        if ended != Ended::NotOpen {
            walk.delta.completed += 1;
            walk.delta.rejected += u16::from(rejected);
            walk.delta.bodies_ended += u16::from(ended == Ended::Streaming);
        }
        let ended = ended != Ended::NotOpen;
        if cut {
            // Read from the frame's payload on, by the next steps (this segment's last, then
            // the next segment's first).
            self.held_low = 0;
            self.max_stream = frame.stream;
            self.status_cut = CUT_PENDING
                | ((start - at.pos) as u16 & CUT_SKIP)
                | if end_stream { CUT_END_STREAM } else { 0 }
                | if ended { CUT_ENDED } else { 0 };
        }
    }

    /// Read on a status cut by the end of a segment (`status_cut`) with the bytes at
    /// `seg.w.at.pos`, where the frame's payload goes on: once its first bytes are read (or
    /// the block ends), a rejection is counted (and its stream ended, if the HEADERS did not
    /// end it); bytes that end first are kept, and the status stays cut.
    #[inline(always)]
    fn read_cut_status<P: Payload, T: StreamTable>(&mut self, seg: &mut Walking<'_, '_, P, T>) {
        let cut = self.status_cut;
        let skip = u32::from(cut & CUT_SKIP);
        let mut have = u32::from(cut >> CUT_HAVE_SHIFT & 0x7);
        let at = seg.w.at;
        let here = at.len - at.pos;
        // What is left of the block's first bytes, within what is left of the frame.
        let wanted = (STATUS_BYTES - have).min(self.left.saturating_sub(skip));
        let n = wanted.min(here.saturating_sub(skip));
        let Some(more) = read_be(seg.payload, at.pos + skip, n) else {
            self.status_cut = 0;
            return;
        };
        let bytes = u64::from(self.held_low) << (8 * n) | more;
        have += n;
        if n < wanted {
            // Not all here: what is left to skip and what was read wait for the next bytes.
            self.held_low = bytes as u32;
            self.status_cut = cut & !(CUT_SKIP | 0x7 << CUT_HAVE_SHIFT)
                | (skip.saturating_sub(here) as u16 & CUT_SKIP)
                | (have as u16) << CUT_HAVE_SHIFT;
            return;
        }
        self.status_cut = 0;
        let rejected = block_rejects(bytes, have, cut & CUT_END_STREAM != 0, seg.w.protocol);
        if !rejected {
            return;
        }
        let walk = &mut seg.w.walk;
        if cut & CUT_ENDED != 0 {
            walk.delta.rejected += 1;
        } else if cut & CUT_END_STREAM == 0 {
            let ended = seg.streams.end(self.max_stream);
            walk.delta.completed += u16::from(ended != Ended::NotOpen);
            walk.delta.rejected += u16::from(ended != Ended::NotOpen);
            walk.delta.bodies_ended += u16::from(ended == Ended::Streaming);
        }
    }
}

/// Whether a server's HEADERS frame turns its request away (see the module docs), read from
/// the start of its header block as far as the segment holds it.
#[inline(always)]
fn response_rejected<P: Payload>(frame: Frame, at: At, payload: &P, protocol: Protocol) -> bool {
    let start = block_start(frame, at.pos);
    let have = at.len.saturating_sub(start).min(STATUS_BYTES);
    read_be(payload, start, have)
        .is_some_and(|bytes| block_rejects(bytes, have, frame.flags & END_STREAM != 0, protocol))
}

/// Whether the first `have` bytes of a response's header block (`bytes`, big-endian, up to
/// [`STATUS_BYTES`]) turn its request away: `:status` 429 or 503 spelled out (all five
/// read), or on a gRPC endpoint the indexed `:status` 200 of a trailers-only answer
/// (`end_stream`). Fewer bytes than tell it: not a rejection.
#[inline(always)]
fn block_rejects(bytes: u64, have: u32, end_stream: bool, protocol: Protocol) -> bool {
    if have == 0 {
        return false;
    }
    // Left-aligned in five bytes.
    let all = (bytes << (8 * (STATUS_BYTES - have))).to_be_bytes();
    let first = [all[3], all[4], all[5], all[6], all[7]];
    if first[0] == STATUS_200_INDEXED {
        return matches!(protocol, Protocol::Grpc) && end_stream;
    }
    have == STATUS_BYTES && is_rejection_status(first)
}

/// Where the header block of a HEADERS frame whose payload begins at `pos` begins: past its
/// pad length and its priority fields, if it has them.
#[inline(always)]
fn block_start(frame: Frame, pos: u32) -> u32 {
    let mut start = pos;
    if frame.flags & PADDED != 0 {
        start += 1;
    }
    if frame.flags & PRIORITY != 0 {
        start += 5;
    }
    start
}

impl Hole {
    /// No hole.
    pub const NONE: Self = Self {
        place: FrameStream::NEW,
        end: 0,
        state: HOLE_NONE,
        sender: 0,
        given_up: 0,
        pad: 0,
    };

    /// Before `walk`'s segment (`len` bytes at `seq`, from `sender`) is walked: if it brings
    /// the hole's next bytes (it holds the byte at the hole's place: it begins there, or a
    /// paused walk or a retransmission cut differently began before it), swap the hole's
    /// place in for the walk; if it overtakes bytes not seen, save the walk's place there (an
    /// older hole still open is given up: its bytes' frames are lost). A segment that fills
    /// the hole and runs on past its end walks again what lies past it: the counts do not
    /// change for it (a stream starts and ends once), only the bytes do.
    #[inline(always)]
    fn enter(&mut self, walk: &mut FrameStream, (seq, len): (u32, u32), sender: Sender) {
        let ours = self.sender == sender as u8;
        let at = self.place.next_seq;
        let holds_place = !crate::seq_after(seq, at) && crate::seq_after(seq.wrapping_add(len), at);
        if self.state == HOLE_OPEN && ours && holds_place {
            core::mem::swap(&mut self.place, walk);
            self.state = HOLE_FILLING;
        } else if walk.is_framed() && crate::seq_after(seq, walk.next_seq) {
            *self = Self {
                place: *walk,
                end: seq,
                state: HOLE_OPEN,
                sender: sender as u8,
                given_up: u8::from(self.state == HOLE_OPEN),
                pad: 0,
            };
        }
    }

    /// After the segment: a hole being filled swaps the walk back. Filled up to its end, it
    /// closes; the walk framed anew there was right if the hole's bytes end between two
    /// frames, and is counted unframed otherwise (as is a hole whose bytes lost the framing,
    /// and one given up before).
    /// Only the walk of the hole's own direction (`sender`) leaves it: the other direction's,
    /// on another CPU, must not take the hole's place for its own walk.
    #[inline(always)]
    fn leave(&mut self, walk: &mut FrameStream, seen: &mut FrameWalk, sender: Sender) {
        if self.sender != sender as u8 {
            return;
        }
        if self.given_up != 0 {
            self.given_up = 0;
            seen.unframed = true;
        }
        if self.state != HOLE_FILLING {
            return;
        }
        core::mem::swap(&mut self.place, walk);
        let filled = !crate::seq_after(self.end, self.place.next_seq);
        let at_end = self.place.next_seq == self.end;
        if !self.place.is_framed() || (at_end && !self.place.between_frames()) {
            seen.unframed = true;
            *self = Self::NONE;
        } else if filled {
            *self = Self::NONE;
        } else {
            self.state = HOLE_OPEN;
        }
    }
}

/// The `n` bytes (0 to 8) at `pos`, big-endian.
#[inline(always)]
fn read_be<P: Payload>(payload: &P, pos: u32, n: u32) -> Option<u64> {
    if n == 0 {
        return Some(0);
    }
    let first = if n < 4 { n } else { 4 };
    let high = u64::from(payload.bytes_at(pos, first)?);
    if n <= 4 {
        return Some(high);
    }
    let low = u64::from(payload.bytes_at(pos + 4, n - 4)?);
    Some(high << (8 * (n - 4)) | low)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;
    use crate::test_bytes::Bytes;
    use streams::host::HostStreams;

    std::thread_local! {
        /// The steps `Plain` runs at most per call: unbounded, or a bound as a kernel without
        /// `bpf_loop` has (the walk pauses and `Conn` walks the segment again).
        static BOUND: core::cell::Cell<u32> = const { core::cell::Cell::new(u32::MAX) };
        /// Pauses seen since the bound was set.
        static PAUSES: core::cell::Cell<u32> = const { core::cell::Cell::new(0) };
    }

    /// The host tests run one direction at a time: plain read-modify-writes.
    struct Plain;

    impl FrameOps for Plain {
        fn repeat<F: FnMut() -> bool>(n: u32, mut body: F) {
            for _ in 0..n.min(BOUND.get()) {
                if !body() {
                    break;
                }
            }
        }
    }

    const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut f = std::vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        f
    }

    fn settings() -> Vec<u8> {
        frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100])
    }

    /// A request's HEADERS (a made-up HPACK block).
    fn request(stream: u32) -> Vec<u8> {
        frame(
            HEADERS,
            0x4 | END_STREAM,
            stream,
            &[0x82, 0x86, 0x84, 0x41, 0x01, b'x'],
        )
    }

    /// A response's HEADERS beginning with `status` (its HPACK bytes), and its flags.
    fn response(stream: u32, flags: u8, status: &[u8]) -> Vec<u8> {
        let mut block = status.to_vec();
        block.extend([0x5c, 0x01, b'5']);
        frame(HEADERS, 0x4 | flags, stream, &block)
    }

    fn data(stream: u32, flags: u8, len: usize) -> Vec<u8> {
        frame(DATA, flags, stream, &std::vec![0x61; len])
    }

    /// A connection fed segment by segment, as the eBPF programs feed it.
    #[derive(Default)]
    struct Conn {
        client: FrameStream,
        server: FrameStream,
        hole: Hole,
        streams: HostStreams,
        protocol: Protocol,
        client_seq: u32,
        server_seq: u32,
        started: u32,
        completed: u32,
        rejected: u32,
        abandoned: u32,
        unframed: u32,
        untracked: u32,
        bodies_begun: u32,
        bodies_ended: u32,
    }

    impl Conn {
        fn grpc() -> Self {
            Self {
                protocol: Protocol::Grpc,
                ..Self::default()
            }
        }

        fn add(&mut self, w: FrameWalk) -> FrameWalk {
            self.started += u32::from(w.delta.started);
            self.completed += u32::from(w.delta.completed);
            self.rejected += u32::from(w.delta.rejected);
            self.abandoned += u32::from(w.delta.abandoned);
            self.unframed += u32::from(w.unframed);
            self.untracked += u32::from(w.untracked);
            self.bodies_begun += u32::from(w.delta.bodies_begun);
            self.bodies_ended += u32::from(w.delta.bodies_ended);
            w
        }

        /// Streams whose body has begun and not ended.
        fn streaming(&self) -> u32 {
            self.bodies_begun - self.bodies_ended
        }

        /// The client sends `bytes`: what its first payload said the connection is, if this
        /// was it, and what the frames did.
        fn client_sends(&mut self, bytes: &[u8]) -> (Option<Detected>, FrameWalk) {
            let len = bytes.len() as u32;
            let detected = (!self.client.is_detected() && len > 0).then(|| {
                self.client
                    .detect(self.client_seq, &Bytes(bytes), self.protocol)
            });
            let mut w = FrameWalk::default();
            if self.client.is_http2() {
                w = self.walk(Sender::Client, self.client_seq, bytes);
            }
            self.client_seq = self.client_seq.wrapping_add(len);
            (detected, w)
        }

        /// Walk `sender`'s `bytes` at `seq`, again while the walk pauses (as the programs'
        /// chain of tail calls does), counting what every walk did; the walks' outcome.
        fn walk(&mut self, sender: Sender, seq: u32, bytes: &[u8]) -> FrameWalk {
            let mut all = FrameWalk::default();
            loop {
                let frames = match sender {
                    Sender::Client => &mut self.client,
                    Sender::Server => &mut self.server,
                };
                let w = *frames
                    .walk::<_, Plain, _>(
                        &mut self.hole,
                        &self.streams,
                        FrameSegment {
                            seq,
                            len: bytes.len() as u32,
                            payload: &Bytes(bytes),
                            sender,
                            protocol: self.protocol,
                        },
                    )
                    .did();
                self.add(w);
                all.unframed |= w.unframed;
                all.untracked += w.untracked;
                if !w.paused {
                    return all;
                }
                PAUSES.set(PAUSES.get() + 1);
            }
        }

        fn server_sends(&mut self, bytes: &[u8]) -> FrameWalk {
            let len = bytes.len() as u32;
            let w = self.server_sends_at(self.server_seq, bytes);
            self.server_seq = self.server_seq.wrapping_add(len);
            w
        }

        /// The server's `bytes` at `seq`, wherever the last ended (a segment out of order).
        fn server_sends_at(&mut self, seq: u32, bytes: &[u8]) -> FrameWalk {
            assert!(self.client.is_http2());
            self.walk(Sender::Server, seq, bytes)
        }

        fn open(&self) -> u32 {
            self.started - self.completed - self.abandoned
        }

        /// The close: what is still open is abandoned (the agent does it, from the table).
        fn close(&mut self) {
            let open = core::mem::take(&mut *self.streams.open.borrow_mut());
            self.abandoned += open.len() as u32;
            let bodies = core::mem::take(&mut *self.streams.bodies.borrow_mut());
            self.bodies_ended += bodies.intersection(&open).count() as u32;
        }

        /// Preface and SETTINGS both ways.
        fn start(&mut self) {
            let (detected, _) = self.client_sends(&[&PREFACE[..], &settings()].concat());
            assert_eq!(detected, Some(Detected::Http2));
            self.server_sends(&settings());
            self.client_sends(&frame(0x4, 0x1, 0, &[]));
        }
    }

    #[test]
    fn concurrent_streams_start_with_their_headers_and_end_with_end_stream() {
        let mut c = Conn::default();
        c.start();
        // Fifty requests in one segment, answered out of order, some ending on DATA and some
        // on trailers, in segments that mix streams.
        let ids: Vec<u32> = (0..50).map(|i| 2 * i + 1).collect();
        c.client_sends(&ids.iter().flat_map(|&id| request(id)).collect::<Vec<u8>>());
        assert_eq!((c.started, c.open()), (50, 50));
        for chunk in ids.rchunks(7) {
            let mut seg = Vec::new();
            for &id in chunk {
                seg.extend(response(id, 0, &[0x88]));
                if id % 3 == 0 {
                    seg.extend(data(id, 0, 100));
                    seg.extend(response(id, END_STREAM, &[0x40, 0x01, b'g']));
                } else {
                    seg.extend(data(id, END_STREAM, 300));
                }
            }
            c.server_sends(&seg);
        }
        assert_eq!((c.completed, c.rejected, c.open()), (50, 0, 0));
        // A RST_STREAM after the stream ended (a server done before the client) counts nothing.
        c.server_sends(&frame(RST_STREAM, 0, 7, &[0, 0, 0, 0]));
        assert_eq!((c.completed, c.unframed), (50, 0));
    }

    #[test]
    fn frame_headers_cut_anywhere_keep_the_counts_exact() {
        let responses: Vec<u8> = (0..8u32)
            .flat_map(|i| {
                [
                    response(2 * i + 1, 0, &[0x88]),
                    data(2 * i + 1, END_STREAM, 40),
                ]
                .concat()
            })
            .collect();
        for cut in 1..40 {
            let mut c = Conn::default();
            c.start();
            let requests: Vec<u8> = (0..8u32).flat_map(|i| request(2 * i + 1)).collect();
            for piece in requests.chunks(cut) {
                c.client_sends(piece);
            }
            for piece in responses.chunks(cut) {
                c.server_sends(piece);
            }
            assert_eq!((c.started, c.completed, c.unframed), (8, 8, 0), "cut {cut}");
        }
    }

    #[test]
    fn a_spelled_out_429_or_503_is_a_rejection_counted_at_its_headers() {
        let mut c = Conn::default();
        c.start();
        c.client_sends(&[request(1), request(3), request(5), request(7)].concat());
        // 429 raw with indexing, 503 Huffman never indexed; 429 from the dynamic table.
        c.server_sends(&response(1, 0, &[0x48, 0x03, b'4', b'2', b'9']));
        assert_eq!((c.completed, c.rejected), (1, 1));
        c.server_sends(&data(1, END_STREAM, 20));
        c.server_sends(&response(3, END_STREAM, &[0x18, 0x83, 0x6c, 0x0c, 0xff]));
        c.server_sends(&response(5, 0, &[0xbe]));
        c.server_sends(&data(5, END_STREAM, 20));
        // A 500 is an answer, not a rejection.
        c.server_sends(&response(7, END_STREAM, &[0x8e]));
        assert_eq!((c.completed, c.rejected, c.open()), (4, 2, 0));
    }

    #[test]
    fn a_rejection_whose_status_a_segment_boundary_cuts_is_told_at_the_next_bytes() {
        // A 429 with a body, one with END_STREAM, padded and with priority; an answer; a
        // gRPC trailers-only rejection: every cut of their bytes into two segments.
        let padded = frame(HEADERS, 0x4 | PADDED | PRIORITY, 1, &{
            let mut p = std::vec![2, 0, 0, 0, 3, 9];
            p.extend([0x48, 0x03, b'4', b'2', b'9', 0x5c, 0x01, b'5', 0, 0]);
            p
        });
        let cases: [(Vec<u8>, bool, u32); 5] = [
            (
                [
                    response(1, 0, &[0x48, 0x03, b'4', b'2', b'9']),
                    data(1, END_STREAM, 20),
                ]
                .concat(),
                false,
                1,
            ),
            (
                response(1, END_STREAM, &[0x08, 0x03, b'5', b'0', b'3']),
                false,
                1,
            ),
            ([padded, data(1, END_STREAM, 5)].concat(), false, 1),
            (response(1, END_STREAM, &[0x88]), false, 0),
            (response(1, END_STREAM, &[0x88]), true, 1),
        ];
        for (bytes, grpc, rejected) in cases {
            for cut in 1..bytes.len() {
                let mut c = if grpc { Conn::grpc() } else { Conn::default() };
                c.start();
                c.client_sends(&request(1));
                c.server_sends(&bytes[..cut]);
                c.server_sends(&bytes[cut..]);
                c.server_sends(&response(3, END_STREAM, &[0x88]));
                let seen = (c.completed, c.rejected, c.unframed);
                assert_eq!(seen, (1, rejected, 0), "cut at {cut} of {bytes:?}");
            }
            // And a byte a segment.
            let mut c = if grpc { Conn::grpc() } else { Conn::default() };
            c.start();
            c.client_sends(&request(1));
            for byte in &bytes {
                c.server_sends(std::slice::from_ref(byte));
            }
            assert_eq!(
                (c.completed, c.rejected),
                (1, rejected),
                "{bytes:?} a byte at a time"
            );
        }
    }

    #[test]
    fn grpc_trailers_only_is_a_rejection_on_grpc_endpoints_only() {
        for (mut c, rejected) in [(Conn::grpc(), 1), (Conn::default(), 0)] {
            c.start();
            c.client_sends(&[request(1), request(3)].concat());
            // An error answered trailers-only; then a call answered with a message.
            c.server_sends(&response(1, END_STREAM, &[0x88]));
            c.server_sends(&[response(3, 0, &[0x88]), data(3, 0, 12)].concat());
            c.server_sends(&response(3, END_STREAM, &[0x40, 0x0b]));
            assert_eq!((c.completed, c.rejected), (2, rejected));
        }
    }

    #[test]
    fn a_stream_waits_until_its_first_data_frame_then_streams_until_its_end() {
        let mut c = Conn::default();
        c.start();
        c.client_sends(
            &(0..5u32)
                .flat_map(|i| request(2 * i + 1))
                .collect::<Vec<u8>>(),
        );
        // Headers at once for all five, as an engine sends them before it schedules: all wait.
        c.server_sends(
            &(0..5u32)
                .flat_map(|i| response(2 * i + 1, 0, &[0x88]))
                .collect::<Vec<u8>>(),
        );
        assert_eq!((c.open(), c.streaming()), (5, 0));
        // 1 and 3 get their first tokens, 1 several; an empty DATA frame begins nothing.
        c.server_sends(&[data(1, 0, 7), data(3, 0, 5), data(1, 0, 9), data(5, 0, 0)].concat());
        assert_eq!((c.bodies_begun, c.streaming()), (2, 2));
        // 1 ends on its last DATA, 3 on trailers; 7 begins and ends in one frame.
        c.server_sends(
            &[
                data(1, END_STREAM, 3),
                response(3, END_STREAM, &[0x40, 0x0b]),
                data(7, END_STREAM, 4),
            ]
            .concat(),
        );
        assert_eq!(
            (c.completed, c.bodies_begun, c.bodies_ended, c.streaming()),
            (3, 3, 3, 0)
        );
        // 5 streams, then the client cancels it; 9 is answered without a body; a 429's body
        // begins nothing (its headers ended the stream).
        c.client_sends(&request(11));
        c.server_sends(&data(5, 0, 10));
        c.client_sends(&frame(RST_STREAM, 0, 5, &[0, 0, 0, 8]));
        c.server_sends(&response(9, END_STREAM, &[0x88]));
        c.server_sends(
            &[
                response(11, 0, &[0x48, 0x03, b'4', b'2', b'9']),
                data(11, END_STREAM, 6),
            ]
            .concat(),
        );
        assert_eq!(
            (c.abandoned, c.rejected, c.bodies_begun, c.bodies_ended),
            (1, 1, 4, 4)
        );
        // Streams still streaming at the close end with it.
        c.client_sends(&[request(13), request(15)].concat());
        c.server_sends(&[response(13, 0, &[0x88]), data(13, 0, 2)].concat());
        assert_eq!((c.open(), c.streaming()), (2, 1));
        c.close();
        assert_eq!((c.open(), c.streaming(), c.bodies_ended), (0, 0, 5));
    }

    #[test]
    fn frames_cut_anywhere_begin_and_end_bodies_exactly_once() {
        // HEADERS, DATA and DATA with END_STREAM for 20 streams, in one byte stream cut at
        // every offset: every body begins and ends once, whatever the cut.
        let ids: Vec<u32> = (0..20).map(|i| 2 * i + 1).collect();
        let answers: Vec<u8> = ids
            .iter()
            .flat_map(|&id| {
                [
                    response(id, 0, &[0x88]),
                    data(id, 0, 11),
                    data(id, END_STREAM, 3),
                ]
                .concat()
            })
            .collect();
        for cut in 1..answers.len() {
            let mut c = Conn::default();
            c.start();
            c.client_sends(&ids.iter().flat_map(|&id| request(id)).collect::<Vec<u8>>());
            c.server_sends(&answers[..cut]);
            assert!(c.streaming() <= 20);
            c.server_sends(&answers[cut..]);
            assert_eq!(
                (c.completed, c.bodies_begun, c.bodies_ended),
                (20, 20, 20),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn resets_goaway_and_close_end_the_open_streams() {
        let mut c = Conn::default();
        c.start();
        c.client_sends(
            &(0..6u32)
                .flat_map(|i| request(2 * i + 1))
                .collect::<Vec<u8>>(),
        );
        // The client cancels 1; the server refuses 3 (a rejection) and resets 5.
        c.client_sends(&frame(RST_STREAM, 0, 1, &[0, 0, 0, 8]));
        c.server_sends(&frame(RST_STREAM, 0, 3, &[0, 0, 0, 7]));
        c.server_sends(&frame(RST_STREAM, 0, 5, &[0, 0, 0, 2]));
        assert_eq!((c.abandoned, c.completed, c.rejected), (1, 2, 1));
        // GOAWAY with last stream 7: 9 and 11 were not processed, and stay open until the
        // close abandons them with 7.
        c.server_sends(&frame(0x7, 0, 0, &[0, 0, 0, 7, 0, 0, 0, 0]));
        assert_eq!((c.abandoned, c.open()), (1, 3));
        c.close();
        assert_eq!((c.abandoned, c.open()), (4, 0));
    }

    #[test]
    fn any_number_of_streams_stay_open_until_their_ends_whatever_came_between() {
        let mut c = Conn::default();
        c.start();
        // A thousand streams opened in one segment, four of them held while 5,000 more come
        // and go.
        let held: Vec<u32> = (0..1000).map(|i| 2 * i + 1).collect();
        c.client_sends(&held.iter().flat_map(|&id| request(id)).collect::<Vec<u8>>());
        c.server_sends(
            &held[4..]
                .iter()
                .flat_map(|&id| response(id, END_STREAM, &[0x88]))
                .collect::<Vec<u8>>(),
        );
        for i in 1000..6000u32 {
            let id = 2 * i + 1;
            c.client_sends(&request(id));
            c.server_sends(&response(id, END_STREAM, &[0x88]));
        }
        assert_eq!((c.started, c.completed, c.open()), (6000, 5996, 4));
        // Their late ends count, whatever order they come in: one answered, one a rejection,
        // one cancelled by the client.
        c.server_sends(&response(5, END_STREAM, &[0x88]));
        c.server_sends(&response(1, 0, &[0x48, 0x03, b'4', b'2', b'9']));
        c.client_sends(&frame(RST_STREAM, 0, 7, &[0, 0, 0, 8]));
        assert_eq!(
            (c.completed, c.rejected, c.abandoned, c.open()),
            (5998, 1, 1, 1)
        );
        // A jump in stream ids, and trailers on an open stream, open nothing else.
        c.client_sends(&request(40_001));
        c.client_sends(&request(3));
        assert_eq!((c.started, c.open()), (6001, 2));
        c.close();
        assert_eq!((c.completed, c.abandoned, c.open()), (5998, 3, 0));
        // Ends after that find none to take.
        c.server_sends(&response(3, END_STREAM, &[0x88]));
        assert_eq!(c.completed, 5998);
    }

    #[test]
    fn a_stream_that_finds_the_table_full_is_counted_untracked_not_started() {
        let mut c = Conn::default();
        c.streams.capacity = Some(2);
        c.start();
        c.client_sends(&[request(1), request(3), request(5)].concat());
        assert_eq!((c.started, c.untracked, c.open()), (2, 1, 2));
        // Its end finds nothing; the others' ends free room for the next.
        c.server_sends(
            &[1, 3, 5]
                .iter()
                .flat_map(|&id| response(id, END_STREAM, &[0x88]))
                .collect::<Vec<u8>>(),
        );
        c.client_sends(&request(7));
        assert_eq!(
            (c.started, c.completed, c.untracked, c.open()),
            (3, 2, 1, 1)
        );
    }

    /// The responses to streams `ids`, each HEADERS then DATA with END_STREAM.
    fn responses(ids: &[u32]) -> Vec<u8> {
        ids.iter()
            .flat_map(|&id| [response(id, 0, &[0x88]), data(id, END_STREAM, 30)].concat())
            .collect()
    }

    #[test]
    fn a_segment_overtaken_on_the_way_is_walked_when_it_arrives() {
        let mut c = Conn::default();
        c.start();
        let ids: Vec<u32> = (0..10).map(|i| 2 * i + 1).collect();
        c.client_sends(&ids.iter().flat_map(|&id| request(id)).collect::<Vec<u8>>());
        let (a, b, d) = (
            responses(&ids[..2]),
            responses(&ids[2..6]),
            responses(&ids[6..8]),
        );
        let start = c.server_seq;
        let at = |n: usize| start.wrapping_add(n as u32);
        // a, then d (overtaking b), then b in two pieces, then the rest in order.
        c.server_sends_at(at(0), &a);
        c.server_sends_at(at(a.len() + b.len()), &d);
        assert_eq!((c.completed, c.hole.state), (4, HOLE_OPEN));
        c.server_sends_at(at(a.len()), &b[..50]);
        c.server_sends_at(at(a.len() + 50), &b[50..]);
        assert_eq!((c.completed, c.unframed, c.hole.state), (8, 0, HOLE_NONE));
        // A retransmission of what was walked counts nothing.
        c.server_sends_at(at(a.len()), &b);
        c.server_sends_at(at(a.len() + b.len() + d.len()), &responses(&ids[8..]));
        assert_eq!((c.completed, c.unframed, c.open()), (10, 0, 0));
    }

    #[test]
    fn a_hole_whose_bytes_end_inside_a_frame_or_a_second_hole_counts_the_framing_lost() {
        let mut c = Conn::default();
        c.start();
        let ids: Vec<u32> = (0..8).map(|i| 2 * i + 1).collect();
        c.client_sends(&ids.iter().flat_map(|&id| request(id)).collect::<Vec<u8>>());
        let all = responses(&ids);
        let start = c.server_seq;
        let at = |n: usize| start.wrapping_add(n as u32);
        // A segment cut inside a frame overtakes the bytes before it: its start is not a
        // frame header, so nothing is walked; the hole's bytes then end inside a frame.
        let cut = responses(&ids[..2]).len() + 20;
        c.server_sends_at(at(cut), &all[cut..]);
        c.server_sends_at(at(0), &all[..cut]);
        assert_eq!((c.unframed, c.hole.state), (2, HOLE_NONE));
        // The streams whose ends were not walked stay open until the close.
        c.close();
        assert_eq!(c.completed + c.abandoned, 8);

        // Two holes at once: the first is given up.
        let mut c = Conn::default();
        c.start();
        c.client_sends(&ids.iter().flat_map(|&id| request(id)).collect::<Vec<u8>>());
        let start = c.server_seq;
        let at = |n: usize| start.wrapping_add(n as u32);
        let piece = responses(&ids[..2]).len();
        c.server_sends_at(at(piece), &all[piece..2 * piece]);
        c.server_sends_at(at(3 * piece), &all[3 * piece..]);
        assert_eq!(c.unframed, 1);
        c.server_sends_at(at(2 * piece), &all[2 * piece..3 * piece]);
        c.server_sends_at(at(0), &all[..piece]);
        assert_eq!((c.completed, c.unframed, c.open()), (6, 1, 2));
    }

    #[test]
    fn a_connection_adopted_mid_stream_is_taken_for_http2_by_its_frames() {
        let mut c = Conn {
            client_seq: 50_000,
            server_seq: 90_000,
            ..Conn::default()
        };
        let (detected, _) =
            c.client_sends(&[frame(0x8, 0, 0, &[0, 0, 1, 0]), request(41)].concat());
        assert_eq!(detected, Some(Detected::Http2));
        // The server's first segment seen begins mid-frame: unframed until one begins with a
        // header.
        let mut late = data(39, END_STREAM, 100);
        late.drain(..20);
        assert!(c.server_sends(&late).unframed);
        c.server_sends(&response(41, END_STREAM, &[0x88]));
        assert_eq!((c.started, c.completed, c.unframed), (1, 1, 1));
        // HTTP/1.x and TLS are not taken for frames, not even on an endpoint set to HTTP/2.
        let get = &b"GET / HTTP/1.1\r\n\r\n"[..];
        let hello = &[22, 3, 1, 0, 200, 1, 0, 0, 196][..];
        for (first, protocol, is) in [
            (get, Protocol::Auto, Detected::Turns),
            (hello, Protocol::Auto, Detected::Tls),
            (hello, Protocol::Grpc, Detected::Tls),
            (get, Protocol::Http2, Detected::Http2),
        ] {
            let detected = FrameStream::default().detect(0, &Bytes(first), protocol);
            assert_eq!(detected, is);
        }
    }

    #[test]
    fn a_first_byte_expected_holds_back_what_overtakes_it_until_its_segment_says() {
        let first = 7_000u32;
        let mut expecting = FrameStream::default();
        expecting.expect_first(first);
        // Taken for HTTP/2 framed at the first byte: a segment past it is ahead, not detected.
        assert!(expecting.is_http2() && !expecting.is_detected());
        assert!(expecting.is_ahead(first + 1448) && !expecting.is_ahead(first));
        assert_eq!(expecting.walked_to(), Some(first));
        // The first byte's segment says what it is; only HTTP/2 keeps the place.
        let get = &b"GET / HTTP/1.1\r\n\r\n"[..];
        let hello = &[22, 3, 1, 0, 200, 1, 0, 0, 196][..];
        for (bytes, is) in [
            (&PREFACE[..], Detected::Http2),
            (get, Detected::Turns),
            (hello, Detected::Tls),
        ] {
            let mut frames = expecting;
            assert_eq!(frames.detect(first, &Bytes(bytes), Protocol::Auto), is);
            let http2 = is == Detected::Http2;
            assert_eq!(frames.is_http2(), http2);
            assert_eq!(frames.walked_to(), http2.then_some(first));
            assert!(!frames.is_ahead(first + 1448) || http2);
        }
    }

    #[test]
    fn retransmissions_are_walked_once_and_gaps_reframe() {
        let mut c = Conn::default();
        c.start();
        let seg = [request(1), request(3)].concat();
        let at = c.client_seq;
        c.client_sends(&seg);
        c.client_seq = at;
        c.client_sends(&seg);
        assert_eq!(c.started, 2);
        // A gap: the next segment starts a frame, and is framed at once.
        c.client_seq += 1000;
        let (_, w) = c.client_sends(&request(5));
        assert!(!w.unframed);
        assert_eq!(c.started, 3);
    }

    #[test]
    fn a_segment_of_thousands_of_frames_is_walked_whole() {
        let mut c = Conn::default();
        c.start();
        let ids: Vec<u32> = (0..2000).map(|i| 2 * i + 1).collect();
        c.client_sends(&ids.iter().flat_map(|&id| request(id)).collect::<Vec<u8>>());
        // 7,000 frames in one segment: pings, then an answer to every stream.
        let mut seg: Vec<u8> = (0..3000).flat_map(|_| frame(0x6, 0, 0, &[0; 8])).collect();
        seg.extend(
            ids.iter()
                .flat_map(|&id| [response(id, 0, &[0x88]), data(id, END_STREAM, 0)].concat()),
        );
        let w = c.server_sends(&seg);
        assert!(!w.unframed);
        assert_eq!((c.started, c.completed, c.open()), (2000, 2000, 0));
    }

    #[test]
    fn a_walk_whose_loop_runs_out_pauses_and_goes_on_with_the_same_counts() {
        // The tests of the walk again, with a loop of 1, 2 and 7 steps per walk (a kernel
        // without `bpf_loop` walks a bounded number of frames per program).
        for bound in [1, 2, 7] {
            BOUND.set(bound);
            PAUSES.set(0);
            concurrent_streams_start_with_their_headers_and_end_with_end_stream();
            frame_headers_cut_anywhere_keep_the_counts_exact();
            grpc_trailers_only_is_a_rejection_on_grpc_endpoints_only();
            resets_goaway_and_close_end_the_open_streams();
            any_number_of_streams_stay_open_until_their_ends_whatever_came_between();
            a_stream_that_finds_the_table_full_is_counted_untracked_not_started();
            a_segment_overtaken_on_the_way_is_walked_when_it_arrives();
            a_hole_whose_bytes_end_inside_a_frame_or_a_second_hole_counts_the_framing_lost();
            a_connection_adopted_mid_stream_is_taken_for_http2_by_its_frames();
            retransmissions_are_walked_once_and_gaps_reframe();
            a_segment_of_thousands_of_frames_is_walked_whole();
            // 2,000 requests in one segment and 7,000 frames in another paused at least that
            // often.
            assert!(PAUSES.get() > 9_000 / bound, "{bound}: {}", PAUSES.get());
        }
        BOUND.set(u32::MAX);
    }

    #[test]
    fn a_walk_paused_inside_a_hole_goes_on_from_the_hole_s_place() {
        BOUND.set(3);
        let mut c = Conn::default();
        c.start();
        let ids: Vec<u32> = (0..40).map(|i| 2 * i + 1).collect();
        c.client_sends(&ids.iter().flat_map(|&id| request(id)).collect::<Vec<u8>>());
        let all = responses(&ids);
        let start = c.server_seq;
        let at = |n: usize| start.wrapping_add(n as u32);
        let piece = responses(&ids[..10]).len();
        // The second piece overtakes the first; the first, walked three frames at a time,
        // fills the hole in pauses; then the rest.
        c.server_sends_at(at(piece), &all[piece..2 * piece]);
        assert_eq!(c.hole.state, HOLE_OPEN);
        let w = c.server_sends_at(at(0), &all[..piece]);
        assert_eq!((w.unframed, c.hole.state), (false, HOLE_NONE));
        c.server_sends_at(at(2 * piece), &all[2 * piece..]);
        assert_eq!((c.completed, c.unframed, c.open()), (40, 0, 0));
        BOUND.set(u32::MAX);
    }

    #[test]
    fn the_other_direction_leaves_a_hole_being_filled_alone() {
        let mut c = Conn::default();
        c.start();
        let ids: Vec<u32> = (0..10).map(|i| 2 * i + 1).collect();
        c.client_sends(
            &ids[..5]
                .iter()
                .flat_map(|&id| request(id))
                .collect::<Vec<u8>>(),
        );
        let all = responses(&ids[..5]);
        let start = c.server_seq;
        let piece = responses(&ids[..2]).len();
        // The server's second piece overtakes its first: a hole of the server's bytes.
        c.server_sends_at(start.wrapping_add(piece as u32), &all[piece..]);
        assert_eq!(c.hole.state, HOLE_OPEN);
        // The first piece begins to fill it (on one CPU) ...
        let first = &all[..piece];
        let mut w = c.server.begin_walk(
            &mut c.hole,
            &c.streams,
            FrameSegment {
                seq: start,
                len: piece as u32,
                payload: &Bytes(first),
                sender: Sender::Server,
                protocol: c.protocol,
            },
        );
        assert_eq!(c.hole.state, HOLE_FILLING);
        // ... while a client segment is walked whole (on another).
        c.client_sends(
            &ids[5..]
                .iter()
                .flat_map(|&id| request(id))
                .collect::<Vec<u8>>(),
        );
        assert_eq!(
            c.hole.state, HOLE_FILLING,
            "the client's walk left the server's hole alone"
        );
        while w.is_stepping() && c.server.step(&mut w, &Bytes(first), &c.streams) {}
        c.server.end_walk(&mut c.hole, &mut w);
        c.add(*w.did());
        assert_eq!((c.started, c.completed, c.unframed), (10, 5, 0));
        assert_eq!(c.hole.state, HOLE_NONE);
    }
}
