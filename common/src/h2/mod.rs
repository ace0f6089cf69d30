//! HTTP/2 streams on one TCP connection, counted from the frames both ends send.
//!
//! HTTP/2 (and gRPC, which runs on it) multiplexes requests as streams on one connection, so
//! the turns of [`crate::turn`] mean nothing there. Each direction instead walks its 9-byte
//! frame headers ([`FrameStream`]), headers split across segments included, as the TLS record
//! walk does, and the frames move the connection's [`Streams`]:
//!
//! * a request **starts** with the client's HEADERS frame on a new stream (a client stream id
//!   above every one before it; a later HEADERS on the same stream is its trailers);
//! * it **completes** with the server's HEADERS or DATA frame carrying END_STREAM on it, or
//!   with the server's RST_STREAM; a client's RST_STREAM (a cancel) **abandons** it;
//! * the server's GOAWAY abandons the open streams above its last stream id (the server did
//!   not and will not process them), and the connection's close abandons what is left;
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
//! (`PRI * HTTP/2.0…`); one adopted mid-stream (open before it was watched) when its first
//! payload seen has the shape of a frame header (see [`plausible_frame_header`]), or always
//! on an endpoint set to [`Protocol::Http2`] or [`Protocol::Grpc`]. A stream whose framing is
//! lost (a gap, or more than [`MAX_FRAMES_PER_SEGMENT`] frames in one segment) is framed again
//! at the next segment that begins with a plausible frame header.
//!
//! **Concurrency.** Each [`FrameStream`] is written by its own direction only, like the turn's
//! words. The open-stream bits are changed by both (the client opens, either end closes), so
//! each change is an atomic fetch-and-modify ([`FrameOps`]): the one event that finds a
//! stream's bit set counts its end, exactly once, whichever CPU sees it first.
//! [`Streams::next_index`] is written by client segments only. The words of streams beyond
//! the window have their bits set by client segments and cleared atomically by either.
//!
//! Bounds: the last [`STREAM_WINDOW`] client streams are tracked by index, in the stream window
//! ([`Streams`], of its own module: a stream is opened, ended, or ended with all those above
//! it); one pushed out of the window while open is still counted in flight until its end
//! comes or is given up. A segment that arrives before the bytes ahead of it (reordered on the
//! way, or after a loss) leaves a [`Hole`]: the walk frames anew at the segment, and walks the
//! bytes from the place it saved when they come; one hole per connection at a time. Over TLS
//! the frames are encrypted and nothing here applies.

mod streams;

pub use streams::{EPOCH, STREAM_WINDOW, Streams};

use crate::{
    Payload, Protocol, Resume, WalkFlags,
    tls::{Sender, is_record_header},
    turn::TurnDelta,
};

/// Bytes of the client's connection preface, `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`.
pub const PREFACE_LEN: u32 = 24;
/// Bytes of a frame header.
pub const FRAME_HEADER_LEN: u32 = 9;
/// Frame headers read per segment at most; a segment with more loses the framing until a
/// later segment starts with a frame header.
pub const MAX_FRAMES_PER_SEGMENT: u32 = 512;
/// The largest frame payload a peer may send before the other raises its limit
/// (SETTINGS_MAX_FRAME_SIZE's initial value), used to judge a frame header's shape.
pub const DEFAULT_MAX_FRAME_LEN: u32 = 16_384;

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const GOAWAY: u8 = 0x7;
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

/// What the frame walk needs from where it runs: atomic read-modify-writes of the open-stream
/// bits, which both directions change, and a bounded loop. The eBPF programs implement them
/// with BPF atomic instructions and `bpf_loop` (whose body the verifier checks once, where an
/// unrolled loop of this many frames would exceed its budget).
pub trait FrameOps {
    /// Clear `mask` in `*word` atomically; the bits `*word` held before.
    ///
    /// # Safety
    /// `word` must point at a live, aligned `u64`.
    unsafe fn fetch_clear(word: *mut u64, mask: u64) -> u64;
    /// Set `bits` in `*word` atomically.
    ///
    /// # Safety
    /// As [`FrameOps::fetch_clear`].
    unsafe fn set(word: *mut u64, bits: u64);
    /// Run `body` up to `n` times, until it returns false.
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
    /// Always zero (explicit padding).
    pub pad: u16,
}

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
    pub pad: [u8; 5],
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
    /// Streams forgotten at this segment: pushed out of the window while open.
    pub forgotten: u16,
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

    /// The stream index of a client-initiated stream (odd id), or `None`.
    #[inline(always)]
    const fn client_stream(&self) -> Option<u32> {
        if self.stream & 1 == 1 {
            Some(self.stream >> 1)
        } else {
            None
        }
    }
}

/// One segment's frame walk in progress: what its steps read, and what they found.
struct Walking<'a, P> {
    streams: &'a mut Streams,
    payload: &'a P,
    at: At,
    sender: Sender,
    protocol: Protocol,
    walk: FrameWalk,
    /// What the last step said (see `FrameStream::next_frame`).
    outcome: Option<bool>,
}

/// Where a frame's payload begins within the segment being walked.
#[derive(Clone, Copy)]
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
        pad: 0,
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
    pub fn walk<P: Payload, A: FrameOps>(
        &mut self,
        hole: &mut Hole,
        streams: &mut Streams,
        segment: FrameSegment<'_, P>,
    ) -> FrameWalk {
        let mut walk = FrameWalk::default();
        if segment.len == 0 {
            return walk;
        }
        // Nothing the hole decides before the walk is kept outside the two (the verifier
        // then checks the walk once, not once for each way the hole went).
        hole.enter(self, segment.seq, segment.sender);
        self.walk_segment::<P, A>(streams, &segment, &mut walk);
        hole.leave(self, &mut walk);
        walk
    }

    /// [`FrameStream::walk`] of the segment, without the hole.
    #[inline(always)]
    fn walk_segment<P: Payload, A: FrameOps>(
        &mut self,
        streams: &mut Streams,
        segment: &FrameSegment<'_, P>,
        walk: &mut FrameWalk,
    ) {
        let FrameSegment {
            seq,
            len,
            payload,
            sender,
            protocol,
        } = *segment;
        let end = seq.wrapping_add(len);
        let Some(pos) = self.resume_at(seq, end, payload, walk) else {
            return;
        };
        let bytes = len - pos;
        match sender {
            Sender::Client => walk.delta.request_bytes = bytes,
            Sender::Server => walk.delta.response_bytes = bytes,
        }
        let mut seg = Walking {
            streams,
            payload,
            at: At { pos, len },
            sender,
            protocol,
            walk: *walk,
            outcome: None,
        };
        if self.walk_frames::<P, A>(&mut seg) {
            self.next_seq = end;
        } else {
            self.flags.clear(FRAMED);
            seg.walk.unframed = true;
        }
        *walk = seg.walk;
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

    /// From `seg.at.pos`: a header held from the last segment, the rest of the current frame,
    /// then the frames whose headers lie whole in the segment; a header cut by the segment's
    /// end is held. False if the framing is lost.
    #[inline(always)]
    fn walk_frames<P: Payload, A: FrameOps>(&mut self, seg: &mut Walking<P>) -> bool {
        if self.held_len > 0 {
            match self.finish_held_header(seg) {
                Some(Some(header)) => {
                    seg.at.pos += FRAME_HEADER_LEN - self.held_len as u32;
                    self.hold(0, 0);
                    if !self.begin_frame::<P, A>(seg, header) {
                        return false;
                    }
                }
                Some(None) => return true,
                None => return false,
            }
        }
        A::repeat(MAX_FRAMES_PER_SEGMENT + 1, || {
            seg.outcome = self.next_frame::<P, A>(seg);
            seg.outcome.is_none()
        });
        // Still frames to go after the last one read: too many for one segment.
        seg.outcome == Some(true)
    }

    /// One step of the walk: the rest of the current frame as far as the segment goes, then
    /// the next frame header if the segment holds it whole (one cut by its end is held).
    /// `None`: go on; `Some(true)`: the segment is walked; `Some(false)`: the framing is lost.
    #[inline(always)]
    fn next_frame<P: Payload, A: FrameOps>(&mut self, seg: &mut Walking<P>) -> Option<bool> {
        let at = &mut seg.at;
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
        if !self.begin_frame::<P, A>(seg, header) {
            return Some(false);
        }
        None
    }

    /// Complete a header begun at the end of the last segment with the bytes at
    /// `seg.at.pos`: `Some(Some(header))` when complete, `Some(None)` when the segment ended
    /// first (the bytes are held), `None` if unreadable.
    #[inline(always)]
    fn finish_held_header<P: Payload>(&mut self, seg: &Walking<P>) -> Option<Option<[u8; 9]>> {
        let have = self.held_len as u32;
        let need = FRAME_HEADER_LEN - have;
        let n = need.min(seg.at.len - seg.at.pos);
        let bytes = read_be(seg.payload, seg.at.pos, n)?;
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
    fn begin_frame<P: Payload, A: FrameOps>(
        &mut self,
        seg: &mut Walking<P>,
        header: [u8; 9],
    ) -> bool {
        let frame = Frame::parse(header);
        if frame.kind > LAST_FRAME_TYPE && frame.len > DEFAULT_MAX_FRAME_LEN {
            // Neither a known frame nor one of ordinary size: not a frame header.
            return false;
        }
        self.left = frame.len;
        match seg.sender {
            Sender::Client => client_frame::<A>(seg.streams, frame, &mut seg.walk),
            Sender::Server => server_frame::<P, A>(seg, frame),
        }
        true
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
        self.flags.set(FRAMED);
    }
}

/// A frame from the client: HEADERS may open a stream, RST_STREAM abandons one.
#[inline(always)]
fn client_frame<A: FrameOps>(streams: &mut Streams, frame: Frame, walk: &mut FrameWalk) {
    let Some(index) = frame.client_stream() else {
        return;
    };
    match frame.kind {
        HEADERS => streams.open::<A>(index, &mut walk.delta, &mut walk.forgotten),
        RST_STREAM if streams.close::<A>(index) => walk.delta.abandoned += 1,
        _ => {}
    }
}

/// A frame from the server: END_STREAM or RST_STREAM completes a stream, a rejection's
/// HEADERS completes it at once, GOAWAY abandons the streams above its last stream id.
#[inline(always)]
fn server_frame<P: Payload, A: FrameOps>(seg: &mut Walking<P>, frame: Frame) {
    let (at, payload) = (seg.at, seg.payload);
    if frame.kind == GOAWAY {
        if let Some(last) = read_be(payload, at.pos, 4) {
            let last = last as u32 & 0x7fff_ffff;
            seg.walk.delta.abandoned += seg.streams.close_from::<A>(last.div_ceil(2));
        }
        return;
    }
    let Some(index) = frame.client_stream() else {
        return;
    };
    let end_stream = frame.flags & END_STREAM != 0;
    let rejected = match frame.kind {
        HEADERS => response_rejected(frame, at, payload, seg.protocol),
        RST_STREAM => read_be(payload, at.pos, 4) == Some(u64::from(REFUSED_STREAM)),
        _ => false,
    };
    let ends = match frame.kind {
        HEADERS | DATA => end_stream || rejected,
        RST_STREAM => true,
        _ => false,
    };
    if ends && seg.streams.close::<A>(index) {
        seg.walk.delta.completed += 1;
        seg.walk.delta.rejected += u16::from(rejected);
    }
}

/// Whether a server's HEADERS frame turns its request away (see the module docs), read from
/// the start of its header block if the segment holds it.
#[inline(always)]
fn response_rejected<P: Payload>(frame: Frame, at: At, payload: &P, protocol: Protocol) -> bool {
    let mut start = at.pos;
    if frame.flags & PADDED != 0 {
        start += 1;
    }
    if frame.flags & PRIORITY != 0 {
        start += 5;
    }
    if start >= at.len {
        return false;
    }
    if payload.bytes_at(start, 1) == Some(u32::from(STATUS_200_INDEXED)) {
        return matches!(protocol, Protocol::Grpc) && frame.flags & END_STREAM != 0;
    }
    start + 5 <= at.len && payload.header_at(start).is_some_and(is_rejection_status)
}

impl Hole {
    /// No hole.
    pub const NONE: Self = Self {
        place: FrameStream::NEW,
        end: 0,
        state: HOLE_NONE,
        sender: 0,
        given_up: 0,
        pad: [0; 5],
    };

    /// Before `walk`'s segment (at `seq`, from `sender`) is walked: if it brings the hole's
    /// bytes, swap the hole's place in for the walk; if it overtakes bytes not seen, save the
    /// walk's place there (an older hole still open is given up: its bytes' frames are lost).
    /// A segment that fills the hole and runs on past its end walks again what lies past it:
    /// the counts do not change for it (a stream starts and ends once), only the bytes do.
    #[inline(always)]
    fn enter(&mut self, walk: &mut FrameStream, seq: u32, sender: Sender) {
        let ours = self.sender == sender as u8;
        if self.state == HOLE_OPEN && ours && seq == self.place.next_seq {
            core::mem::swap(&mut self.place, walk);
            self.state = HOLE_FILLING;
        } else if walk.is_framed() && crate::turn::seq_after(seq, walk.next_seq) {
            *self = Self {
                place: *walk,
                end: seq,
                state: HOLE_OPEN,
                sender: sender as u8,
                given_up: u8::from(self.state == HOLE_OPEN),
                pad: [0; 5],
            };
        }
    }

    /// After the segment: a hole being filled swaps the walk back. Filled up to its end, it
    /// closes; the walk framed anew there was right if the hole's bytes end between two
    /// frames, and is counted unframed otherwise (as is a hole whose bytes lost the framing,
    /// and one given up before).
    #[inline(always)]
    fn leave(&mut self, walk: &mut FrameStream, seen: &mut FrameWalk) {
        if self.given_up != 0 {
            self.given_up = 0;
            seen.unframed = true;
        }
        if self.state != HOLE_FILLING {
            return;
        }
        core::mem::swap(&mut self.place, walk);
        let filled = !crate::turn::seq_after(self.end, self.place.next_seq);
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

    /// The host tests run one direction at a time: plain read-modify-writes.
    struct Plain;

    impl FrameOps for Plain {
        unsafe fn fetch_clear(word: *mut u64, mask: u64) -> u64 {
            // SAFETY: as the trait requires.
            unsafe {
                let old = *word;
                *word = old & !mask;
                old
            }
        }
        unsafe fn set(word: *mut u64, bits: u64) {
            // SAFETY: as the trait requires.
            unsafe { *word |= bits }
        }
        fn repeat<F: FnMut() -> bool>(n: u32, mut body: F) {
            for _ in 0..n {
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
        streams: Streams,
        protocol: Protocol,
        client_seq: u32,
        server_seq: u32,
        started: u32,
        completed: u32,
        rejected: u32,
        abandoned: u32,
        unframed: u32,
        forgotten: u32,
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
            self.forgotten += u32::from(w.forgotten);
            w
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
                w = self.client.walk::<_, Plain>(
                    &mut self.hole,
                    &mut self.streams,
                    FrameSegment {
                        seq: self.client_seq,
                        len,
                        payload: &Bytes(bytes),
                        sender: Sender::Client,
                        protocol: self.protocol,
                    },
                );
            }
            self.client_seq = self.client_seq.wrapping_add(len);
            (detected, self.add(w))
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
            let w = self.server.walk::<_, Plain>(
                &mut self.hole,
                &mut self.streams,
                FrameSegment {
                    seq,
                    len: bytes.len() as u32,
                    payload: &Bytes(bytes),
                    sender: Sender::Server,
                    protocol: self.protocol,
                },
            );
            self.add(w)
        }

        fn open(&self) -> u32 {
            self.started - self.completed - self.abandoned
        }

        fn close(&mut self) {
            let d = self.streams.on_close::<Plain>();
            self.abandoned += u32::from(d.abandoned);
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
        // GOAWAY with last stream 7: 9 and 11 were not processed.
        c.server_sends(&frame(GOAWAY, 0, 0, &[0, 0, 0, 7, 0, 0, 0, 0]));
        assert_eq!((c.abandoned, c.open()), (3, 1));
        c.close();
        assert_eq!((c.abandoned, c.open()), (4, 0));
    }

    #[test]
    fn streams_open_past_the_window_stay_in_flight_until_their_ends() {
        let mut c = Conn::default();
        c.start();
        // Four streams stay open while 200 more come and go: pushed out of the window, they
        // are no longer known by index but still in flight.
        c.client_sends(&[request(1), request(3), request(5), request(7)].concat());
        for i in 4..204u32 {
            let id = 2 * i + 1;
            c.client_sends(&request(id));
            c.server_sends(&response(id, END_STREAM, &[0x88]));
        }
        assert_eq!(
            (c.started, c.completed, c.forgotten, c.open()),
            (204, 200, 0, 4)
        );
        // Their late ends count, whatever order they come in: one answered, one a rejection,
        // one cancelled by the client.
        c.server_sends(&response(5, END_STREAM, &[0x88]));
        c.server_sends(&response(1, 0, &[0x48, 0x03, b'4', b'2', b'9']));
        c.client_sends(&frame(RST_STREAM, 0, 7, &[0, 0, 0, 8]));
        assert_eq!(
            (c.completed, c.rejected, c.abandoned, c.open()),
            (202, 1, 1, 1)
        );
        // A jump in stream ids forgets nothing that was not open.
        c.client_sends(&request(411));
        assert_eq!((c.started, c.forgotten, c.open()), (205, 0, 2));
        // The close abandons the one beyond the window and the one in it.
        c.close();
        assert_eq!((c.completed, c.abandoned, c.open()), (202, 3, 0));
        // Ends after that find none to take.
        c.server_sends(&response(3, END_STREAM, &[0x88]));
        assert_eq!(c.completed, 202);
    }

    /// `n` requests answered at once, from stream `*id` on.
    fn answered(c: &mut Conn, id: &mut u32, n: u32) {
        for _ in 0..n {
            c.client_sends(&request(*id));
            c.server_sends(&response(*id, END_STREAM, &[0x88]));
            *id += 2;
        }
    }

    #[test]
    fn a_stream_beyond_the_window_whose_end_never_comes_is_forgotten_epochs_later() {
        let mut c = Conn::default();
        c.start();
        c.client_sends(&request(1));
        let mut id = 3;
        // Out of the window at index 128 (in epoch 0): still in flight through epoch 1.
        answered(&mut c, &mut id, 2046);
        assert_eq!((c.forgotten, c.open()), (0, 1));
        // Into epoch 2: given up.
        answered(&mut c, &mut id, 1);
        assert_eq!((c.forgotten, c.abandoned, c.open()), (1, 1, 0));
        c.server_sends(&response(1, END_STREAM, &[0x88]));
        assert_eq!(c.completed, 2047);
        // A jump of stream ids over two epochs gives up both words.
        c.client_sends(&[request(id), request(id + 2)].concat());
        id += 4;
        answered(&mut c, &mut id, 200);
        assert_eq!((c.forgotten, c.open()), (1, 2));
        c.client_sends(&request(id + 20_000));
        assert_eq!((c.forgotten, c.abandoned, c.open()), (3, 3, 1));
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
    fn too_many_frames_in_one_segment_lose_the_framing() {
        let mut c = Conn::default();
        c.start();
        let pings = |n: u32| {
            (0..n)
                .flat_map(|_| frame(0x6, 0, 0, &[0; 8]))
                .collect::<Vec<u8>>()
        };
        assert!(!c.client_sends(&pings(MAX_FRAMES_PER_SEGMENT)).1.unframed);
        assert!(
            c.client_sends(&pings(MAX_FRAMES_PER_SEGMENT + 1))
                .1
                .unframed
        );
        // Framed again at the next segment.
        c.client_sends(&request(1));
        assert_eq!(c.started, 1);
    }
}
