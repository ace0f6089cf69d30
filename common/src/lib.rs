//! Types shared by the eBPF programs and the agent, and the request/response turn state
//! machine that both sides agree on.
//!
//! Everything here is `#![no_std]`, `#[repr(C)]` and free of pointers, so the same bytes mean
//! the same thing in a BPF map and in the agent. With the `user` feature the types implement
//! `aya::Pod`, which lets the agent read and write them through aya's map API.

#![no_std]

pub mod h2;
pub mod http1;
pub mod tls;
pub mod turn;
mod vocabulary;

use core::ptr::{read_volatile, write_volatile};

/// True if sequence number `a` is after `b`, modulo 2^32 (RFC 793 comparison).
#[inline(always)]
pub const fn seq_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

/// The bit flags of a walk over one direction's bytes (TLS records, HTTP/2 frames), read and
/// written in memory every time: kept in a register across a walk's loop, each combination of
/// known bits would be a separate state for the eBPF verifier, and the loop would exceed its
/// budget.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WalkFlags(pub u8);

impl WalkFlags {
    /// The flags now.
    #[inline(always)]
    pub fn get(&self) -> u8 {
        // SAFETY: an aligned read of this value's own field.
        unsafe { read_volatile(&raw const self.0) }
    }

    /// Set `bits`.
    #[inline(always)]
    pub fn set(&mut self, bits: u8) {
        let flags = self.get() | bits;
        // SAFETY: an aligned write of this value's own field.
        unsafe { write_volatile(&raw mut self.0, flags) }
    }

    /// Clear `bits`.
    #[inline(always)]
    pub fn clear(&mut self, bits: u8) {
        let flags = self.get() & !bits;
        // SAFETY: an aligned write of this value's own field.
        unsafe { write_volatile(&raw mut self.0, flags) }
    }

    /// Where a segment of bytes `seq..end` resumes a walk that has walked to `next_seq`
    /// while its `framed` bit is set (its place known). A gap loses the place; a walk
    /// without one is framed anew at a segment that `begins_with_header` (asked only then).
    #[inline(always)]
    pub fn resume(
        &mut self,
        framed: u8,
        next_seq: u32,
        (seq, end): (u32, u32),
        begins_with_header: impl FnOnce() -> bool,
    ) -> Resume {
        if self.get() & framed != 0 {
            if !seq_after(end, next_seq) {
                return Resume::Walked;
            }
            if !seq_after(seq, next_seq) {
                return Resume::At(next_seq.wrapping_sub(seq));
            }
            self.clear(framed);
        }
        if begins_with_header() {
            Resume::Reframe
        } else {
            Resume::Lost
        }
    }
}

/// Where a segment's new bytes begin in a walk ([`WalkFlags::resume`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// Every byte was walked before: a retransmission.
    Walked,
    /// At this offset into the segment, the walk's place known.
    At(u32),
    /// The walk's place is lost, and the segment does not begin with a header.
    Lost,
    /// The walk's place was lost and the segment begins with a header: framed anew at its
    /// start.
    Reframe,
}

/// Reads bytes of the payload of the segment being walked (by the TLS record walk and the
/// HTTP/2 frame walk), by offset from its first byte.
pub trait Payload {
    /// The five bytes at `offset`, if the segment has them.
    fn header_at(&self, offset: u32) -> Option<[u8; 5]>;
    /// The nine bytes at `offset` (an HTTP/2 frame header), if the segment has them.
    fn frame_header_at(&self, offset: u32) -> Option<[u8; 9]>;
    /// The `n` bytes (1 to 4) at `offset`, big-endian, if the segment has them.
    fn bytes_at(&self, offset: u32, n: u32) -> Option<u32>;

    /// The `n` bytes (1 to 8) at `offset`, first in the array's first place (the rest zero),
    /// if the segment has them: the HTTP/1.1 framing walk's reads.
    #[inline(always)]
    fn word_at(&self, offset: u32, n: u32) -> Option<[u8; 8]> {
        word_in_halves(self, offset, n)
    }
}

/// [`Payload::word_at`] by two reads of [`Payload::bytes_at`] (the one read there is when the
/// `n` bytes are fewer than eight).
#[inline(always)]
pub fn word_in_halves<P: Payload + ?Sized>(payload: &P, offset: u32, n: u32) -> Option<[u8; 8]> {
    let head = n.min(4);
    let first = payload.bytes_at(offset, head)? << (8 * (4 - head));
    let second = if n > 4 {
        payload.bytes_at(offset + 4, n - 4)? << (8 * (8 - n))
    } else {
        0
    };
    let [a, b, c, d] = first.to_be_bytes();
    let [e, f, g, h] = second.to_be_bytes();
    Some([a, b, c, d, e, f, g, h])
}

/// Name of the map of watched endpoints: [`EndpointKey`] → [`WatchValue`].
pub const WATCHED_ENDPOINTS_MAP: &str = "WATCHED_ENDPOINTS";
/// Name of the per-CPU counters array, indexed by [`counter_index`] → [`EndpointCounters`].
pub const ENDPOINT_COUNTERS_MAP: &str = "ENDPOINT_COUNTERS";
/// Name of the array of current watch generations, indexed by watch slot (0 = slot free).
pub const SLOT_GENERATIONS_MAP: &str = "SLOT_GENERATIONS";
/// Name of the bitmap of watched ports: [`WATCHED_PORT_WORDS`] `u64` words, bit `port % 64` of
/// word `port / 64` set while some watched endpoint has that port.
pub const WATCHED_PORTS_MAP: &str = "WATCHED_PORTS";
/// Words in [`WATCHED_PORTS_MAP`] (65,536 ports).
pub const WATCHED_PORT_WORDS: u32 = 1024;
/// Name of the per-CPU array of probe-wide counters, indexed by [`ProbeStat`].
pub const PROBE_STATS_MAP: &str = "PROBE_STATS";
/// Name of the settings map: what the agent switched off for the running kernel
/// (`Array<u32>` indexed by [`Setting`]).
pub const SETTINGS_MAP: &str = "SETTINGS";

/// An entry of [`SETTINGS_MAP`]; 0 is the default behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Setting {
    /// Not 0: connections established before they were watched are not adopted (their
    /// closes could not be seen: the kernel cannot run the `tcp_destroy_sock` program).
    AdoptionOff = 0,
}

/// Number of slots in [`SETTINGS_MAP`].
pub const SETTINGS_LEN: u32 = 1;

/// How many endpoints can be watched at once.
pub const MAX_WATCHED_ENDPOINTS: u32 = 1_024;

/// A watched backend endpoint.
///
/// `addr` is an IPv6 address; IPv4 addresses are stored IPv4-mapped (`::ffff:a.b.c.d`), which
/// is also how the kernel reports IPv4 peers of dual-stack sockets. An all-zero `addr` is a
/// port-only wildcard: it matches that port on any address. `port` is in host byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointKey {
    /// IPv6 or IPv4-mapped address, network byte order; all zero for "any address".
    pub addr: [u8; 16],
    /// TCP port, host byte order.
    pub port: u16,
    /// Always zero (explicit padding, so keys compare byte for byte).
    pub pad: u16,
}

impl EndpointKey {
    /// An endpoint from an IPv6 (or IPv4-mapped) address and a port.
    pub const fn new(addr: [u8; 16], port: u16) -> Self {
        Self { addr, port, pad: 0 }
    }

    /// An endpoint from an IPv4 address (network byte order octets) and a port.
    pub const fn from_ipv4(octets: [u8; 4], port: u16) -> Self {
        let [a, b, c, d] = octets;
        Self::new([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, b, c, d], port)
    }

    /// The port-only wildcard for `port`: matches every address.
    pub const fn any_address(port: u16) -> Self {
        Self::new([0; 16], port)
    }

    /// True for a port-only wildcard.
    pub const fn is_wildcard(&self) -> bool {
        let mut i = 0;
        while i < 16 {
            if self.addr[i] != 0 {
                return false;
            }
            i += 1;
        }
        true
    }
}

/// Value of a watched endpoint: where its counters live, and under which generation.
///
/// The agent gives every watch a slot (an index into the counters array, so the per-segment
/// path does array lookups only) and a generation that is new on every add. A connection
/// remembers both; it counts only while `SLOT_GENERATIONS[slot]` still holds its generation,
/// so a connection opened under an earlier watch stops counting instead of resuming mid-turn.
///
/// `client_cgroup`, when not zero, scopes the client side: only connections opened by sockets
/// of that cgroup v2 (or of its descendants) count, so other processes on the node that talk
/// to the same backend change nothing. Its id is compared with the socket's ancestor at
/// `client_cgroup_level`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WatchValue {
    /// Index of the watch's counters (see [`counter_index`]).
    pub slot: u32,
    /// Never zero for a live watch; never reused.
    pub generation: u32,
    /// cgroup v2 id whose sockets alone count on the client side; 0: every socket.
    pub client_cgroup: u64,
    /// Depth of `client_cgroup` below the root of the hierarchy (the root is level 0).
    pub client_cgroup_level: u32,
    /// What the endpoint's connections speak: `Protocol as u32`.
    pub protocol: u32,
}

/// What a watched endpoint's connections speak, which decides how requests are counted on
/// them: turns (HTTP/1.x and other request/response protocols, [`turn`]) or HTTP/2 streams
/// ([`h2`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// Each connection tells: HTTP/2 when its client's first payload is the HTTP/2 preface (or,
    /// adopted mid-stream, a frame header); turns otherwise.
    #[default]
    Auto = 0,
    /// Turns, always.
    Http1 = 1,
    /// HTTP/2 streams, always (plaintext connections; see [`h2`] for TLS).
    Http2 = 2,
    /// HTTP/2 streams carrying gRPC: a trailers-only response is a rejection as well.
    Grpc = 3,
}

impl Protocol {
    /// Every protocol, in order.
    pub const ALL: [Protocol; 4] = [
        Protocol::Auto,
        Protocol::Http1,
        Protocol::Http2,
        Protocol::Grpc,
    ];

    /// The protocol stored as `value` (as in [`WatchValue::protocol`]); `Auto` for anything
    /// unknown.
    pub const fn from_u32(value: u32) -> Self {
        match value {
            1 => Protocol::Http1,
            2 => Protocol::Http2,
            3 => Protocol::Grpc,
            _ => Protocol::Auto,
        }
    }

    /// Lower-case name, as in the configuration.
    pub const fn as_str(self) -> &'static str {
        match self {
            Protocol::Auto => "auto",
            Protocol::Http1 => "http1",
            Protocol::Http2 => "http2",
            Protocol::Grpc => "grpc",
        }
    }

    /// True if connections may be HTTP/2 (everything but `Http1`).
    pub const fn may_be_http2(self) -> bool {
        !matches!(self, Protocol::Http1)
    }
}

/// Index into the counters array of a watch slot's counters from one side, the copy `writer`
/// updates. The counts of a slot and side are the sum of both copies over every CPU.
pub const fn counter_index(slot: u32, side: Side, writer: CounterWriter) -> u32 {
    (slot * 2 + side as u32) * 2 + writer as u32
}

/// Entries in [`ENDPOINT_COUNTERS_MAP`]: every slot, side and [`CounterWriter`].
pub const ENDPOINT_COUNTER_ENTRIES: u32 = MAX_WATCHED_ENDPOINTS * 4;

/// Which programs update a copy of an endpoint's counters. Each slot and side has one copy for
/// each, so that the ingress program, which runs on every received segment, adds without
/// atomic instructions.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CounterWriter {
    /// Every program but the ingress one: a send in process context can be interrupted (or,
    /// on a preemptible kernel, preempted) by another program on its CPU, so these add
    /// atomically.
    Any = 0,
    /// The ingress program alone. The kernel runs it with bottom halves disabled, from the TCP
    /// receive path, so it never nests with itself on one CPU: its adds are plain.
    Ingress = 1,
}

impl CounterWriter {
    /// Both copies.
    pub const ALL: [CounterWriter; 2] = [CounterWriter::Any, CounterWriter::Ingress];
}

/// From which end of a connection the kernel sees it.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Side {
    /// The watched endpoint is a local listener; connections are accepted here.
    Server = 0,
    /// The watched endpoint is remote; a local process opened the connection to it.
    Client = 1,
}

impl Side {
    /// Both sides, server first.
    pub const ALL: [Side; 2] = [Side::Server, Side::Client];

    /// Lower-case name, as used in metrics labels and logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            Side::Server => "server",
            Side::Client => "client",
        }
    }
}

vocabulary! {
/// The counters of [`EndpointCounters`], one entry a field; each is exported as the metric
/// `retry_after_endpoint_<name>_total`.
pub enum EndpointCounter {
    /// [`EndpointCounters::connections_opened`].
    ConnectionsOpened => "connections_opened",
    /// [`EndpointCounters::connections_closed`].
    ConnectionsClosed => "connections_closed",
    /// [`EndpointCounters::requests_started`].
    RequestsStarted => "requests_started",
    /// [`EndpointCounters::responses_completed`].
    ResponsesCompleted => "responses_completed",
    /// [`EndpointCounters::responses_rejected`].
    ResponsesRejected => "responses_rejected",
    /// [`EndpointCounters::requests_abandoned`].
    RequestsAbandoned => "requests_abandoned",
    /// [`EndpointCounters::request_bytes`].
    RequestBytes => "request_bytes",
    /// [`EndpointCounters::response_bytes`].
    ResponseBytes => "response_bytes",
    /// [`EndpointCounters::responses_inferred`].
    ResponsesInferred => "responses_inferred",
    /// [`EndpointCounters::bodies_begun`].
    BodiesBegun => "bodies_begun",
    /// [`EndpointCounters::bodies_ended`].
    BodiesEnded => "bodies_ended",
    /// [`EndpointCounters::first_byte_wait_ns`], in whole microseconds.
    FirstByteWaitMicroseconds => "first_byte_wait_microseconds",
}
}

/// Exact, monotonically increasing counters of one endpoint from one side (one copy per CPU in
/// the map; the agent sums them).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EndpointCounters {
    /// Connections accepted (server side) or opened (client side) while watched.
    pub connections_opened: u64,
    /// Of those, connections that have closed.
    pub connections_closed: u64,
    /// Request turns begun: first client→server payload after the previous response.
    pub requests_started: u64,
    /// Request turns whose server→client payload completed (see [`turn`]).
    pub responses_completed: u64,
    /// Of those, rejections: responses whose status line was 429 or 503.
    pub responses_rejected: u64,
    /// Request turns ended by the connection closing before any response byte.
    pub requests_abandoned: u64,
    /// Client→server payload bytes (new bytes only; retransmissions are not counted).
    pub request_bytes: u64,
    /// Server→client payload bytes seen during response turns.
    pub response_bytes: u64,
    /// Of the responses completed, those whose end was inferred from the turn (quiet, next
    /// request, close) because their framing could not be read (inside TLS, another protocol,
    /// a gap); the rest ended at their last byte as HTTP/1.1 or HTTP/2 frames it.
    pub responses_inferred: u64,
    /// Responses whose first body byte went by: their request stopped waiting and streams
    /// (HTTP/1.1 responses whose framing is read; HTTP/2 streams at their first DATA frame).
    pub bodies_begun: u64,
    /// Of the responses completed or cut by the close, those whose body had begun.
    pub bodies_ended: u64,
    /// The waits of the bodies begun, summed: from each request's first byte (an HTTP/2
    /// stream's HEADERS) to its response's first body byte, in nanoseconds. Over
    /// `bodies_begun`, the mean time to first body byte.
    pub first_byte_wait_ns: u64,
}

impl EndpointCounters {
    /// The value of one counter.
    pub const fn get(&self, counter: EndpointCounter) -> u64 {
        match counter {
            EndpointCounter::ConnectionsOpened => self.connections_opened,
            EndpointCounter::ConnectionsClosed => self.connections_closed,
            EndpointCounter::RequestsStarted => self.requests_started,
            EndpointCounter::ResponsesCompleted => self.responses_completed,
            EndpointCounter::ResponsesRejected => self.responses_rejected,
            EndpointCounter::RequestsAbandoned => self.requests_abandoned,
            EndpointCounter::RequestBytes => self.request_bytes,
            EndpointCounter::ResponseBytes => self.response_bytes,
            EndpointCounter::ResponsesInferred => self.responses_inferred,
            EndpointCounter::BodiesBegun => self.bodies_begun,
            EndpointCounter::BodiesEnded => self.bodies_ended,
            EndpointCounter::FirstByteWaitMicroseconds => self.first_byte_wait_ns / 1_000,
        }
    }

    /// Responses completed that were not rejections: the work drained.
    pub const fn responses_served(&self) -> u64 {
        self.responses_completed
            .wrapping_sub(self.responses_rejected)
    }

    /// Requests begun and not yet answered or abandoned.
    pub const fn in_flight(&self) -> u64 {
        self.requests_started
            .saturating_sub(self.responses_completed)
            .saturating_sub(self.requests_abandoned)
    }

    /// Of the requests in flight, those whose response's body has begun: streaming.
    pub const fn streaming(&self) -> u64 {
        let streaming = self.bodies_begun.saturating_sub(self.bodies_ended);
        if streaming < self.in_flight() {
            streaming
        } else {
            self.in_flight()
        }
    }

    /// Of the requests in flight, those still waiting for their response's first body byte
    /// (queued inside the server, or running without streaming).
    pub const fn waiting(&self) -> u64 {
        self.in_flight() - self.streaming()
    }

    /// Field-wise sum, used to add up per-CPU copies. Wrapping: a CPU's copy of
    /// `requests_started` can go below zero when a start counted on another CPU is withdrawn
    /// there (see [`turn::TurnDelta::withdrawn`]); the sum over all CPUs is exact.
    pub const fn add(&self, other: &Self) -> Self {
        Self {
            connections_opened: self
                .connections_opened
                .wrapping_add(other.connections_opened),
            connections_closed: self
                .connections_closed
                .wrapping_add(other.connections_closed),
            requests_started: self.requests_started.wrapping_add(other.requests_started),
            responses_completed: self
                .responses_completed
                .wrapping_add(other.responses_completed),
            responses_rejected: self
                .responses_rejected
                .wrapping_add(other.responses_rejected),
            requests_abandoned: self
                .requests_abandoned
                .wrapping_add(other.requests_abandoned),
            request_bytes: self.request_bytes.wrapping_add(other.request_bytes),
            response_bytes: self.response_bytes.wrapping_add(other.response_bytes),
            responses_inferred: self
                .responses_inferred
                .wrapping_add(other.responses_inferred),
            bodies_begun: self.bodies_begun.wrapping_add(other.bodies_begun),
            bodies_ended: self.bodies_ended.wrapping_add(other.bodies_ended),
            first_byte_wait_ns: self
                .first_byte_wait_ns
                .wrapping_add(other.first_byte_wait_ns),
        }
    }
}

/// Per-connection state, held in the socket's own local storage (so it is freed with the
/// socket, and a socket whose memory is reused starts without it).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnState {
    /// The watch slot whose counters this connection feeds (below
    /// [`MAX_WATCHED_ENDPOINTS`]).
    pub slot: u16,
    /// The vantage point: `Side as u8`.
    pub side: u8,
    /// What the watch says the connection speaks: `Protocol as u8`.
    pub protocol: u8,
    /// The watch generation the connection was opened under.
    pub generation: u32,
    /// Who stored this state (a program path on one CPU; 0 until stored), so that a program
    /// that asks the kernel to store a state, and is handed one, knows whether it is its own
    /// or one stored from another CPU a moment before.
    pub maker: u16,
    /// The level `scope_cgroup` is compared at (a cgroup's depth).
    pub scope_level: u8,
    /// Always zero (explicit padding).
    pub pad: u8,
    /// When the open request's first byte was seen, in microseconds of `bpf_ktime_get_ns`
    /// (wrapping every 71 minutes; a wait is the wrapping difference): its response's first
    /// body byte adds the wait since to `first_byte_wait_ns`. Written by client→server
    /// segments only. 0: not timed.
    pub request_us: u32,
    /// The request/response turn of this connection.
    pub turn: turn::Turn,
    /// TLS record framing of the client→server bytes (written by those segments only).
    pub client_records: tls::RecordStream,
    /// TLS record framing of the server→client bytes (written by those segments only).
    pub server_records: tls::RecordStream,
    /// While not zero, the connection is not counted yet: its first segment tells whether its
    /// socket belongs to this cgroup (at `scope_level`); if not, it is forgotten.
    pub scope_cgroup: u64,
    /// HTTP/2 frame walk of the client→server bytes (written by those segments only).
    pub client_frames: h2::FrameStream,
    /// HTTP/2 frame walk of the server→client bytes (written by those segments only).
    pub server_frames: h2::FrameStream,
    /// The HTTP/2 connection's id in the stream table (the socket's cookie; 0 until the
    /// connection is known to be HTTP/2).
    pub h2_connection: u64,
    /// How many of its streams the table holds, as the programs count them (the agent's
    /// removals are not subtracted): a close with none skips the close notice.
    pub h2_open: u64,
    /// The entry its next stream is given in the table (its watch, its side; the open time
    /// is set as the stream opens). Written by client segments only, which alone open
    /// streams; kept here so the walk's loop builds no value on its stack.
    pub h2_entry: h2::StreamEntry,
    /// The bytes a segment overtook, in the direction this vantage point receives.
    pub hole: h2::Hole,
    /// HTTP/1.1 response framing of the server→client bytes of a plaintext connection counted
    /// by turns (written by those segments only).
    pub server_framing: http1::ResponseFraming,
}

// Every field is accounted for: no implicit padding, so the map value has no undefined bytes.
// 192 bytes: the programs build one on their stack, whose frames the verifier holds to 512
// bytes in all (a frame a byte larger took `adopt_as` and `ra_ingress` past it on 6.1).
const _: () = assert!(core::mem::size_of::<ConnState>() == 192);

impl ConnState {
    /// The open request's first byte was seen at `now_ns` (`bpf_ktime_get_ns`): start its
    /// wait for a first body byte.
    #[inline(always)]
    pub fn time_request(&mut self, now_ns: u64) {
        // 0 means not timed: a start that falls on it is a microsecond later.
        self.request_us = ((now_ns / 1_000) as u32).max(1);
    }

    /// The open request's response's first body byte was seen at `now_ns`: the request's
    /// wait for it, in nanoseconds (microseconds' precision), if its start was timed.
    #[inline(always)]
    pub fn first_byte_wait_ns(&self, now_ns: u64) -> Option<u64> {
        (self.request_us != 0)
            .then(|| u64::from(((now_ns / 1_000) as u32).wrapping_sub(self.request_us)) * 1_000)
    }

    /// The HTTP/2 frame walk of the bytes `sender` sends.
    #[inline(always)]
    pub fn frames(&self, sender: tls::Sender) -> &h2::FrameStream {
        match sender {
            tls::Sender::Client => &self.client_frames,
            tls::Sender::Server => &self.server_frames,
        }
    }

    /// The frame walk of `sender`'s bytes, to change.
    pub fn frames_mut(&mut self, sender: tls::Sender) -> &mut h2::FrameStream {
        match sender {
            tls::Sender::Client => &mut self.client_frames,
            tls::Sender::Server => &mut self.server_frames,
        }
    }

    /// A connection of `watch` seen from `side`, between turns. A client side whose watch is
    /// scoped to a cgroup starts unresolved (`scope_cgroup` set): its first segment decides.
    pub const fn new(watch: &WatchValue, side: Side) -> Self {
        Self {
            slot: watch.slot as u16,
            side: side as u8,
            protocol: watch.protocol as u8,
            generation: watch.generation,
            maker: 0,
            scope_level: watch.client_cgroup_level as u8,
            pad: 0,
            request_us: 0,
            turn: turn::Turn {
                client: 0,
                server: 0,
            },
            client_records: tls::RecordStream {
                next_seq: 0,
                held: 0,
                left: 0,
                held_len: 0,
                flags: WalkFlags(0),
            },
            server_records: tls::RecordStream {
                next_seq: 0,
                held: 0,
                left: 0,
                held_len: 0,
                flags: WalkFlags(0),
            },
            scope_cgroup: match side {
                Side::Client => watch.client_cgroup,
                Side::Server => 0,
            },
            client_frames: h2::FrameStream::NEW,
            server_frames: h2::FrameStream::NEW,
            h2_connection: 0,
            h2_open: 0,
            h2_entry: h2::StreamEntry {
                opened_ns: 0,
                generation: watch.generation,
                slot: watch.slot as u16,
                side: side as u8,
                body: 0,
            },
            hole: h2::Hole::NONE,
            server_framing: http1::ResponseFraming {
                next_seq: 0,
                left: 0,
                status: 0,
                state: 0,
                at: 0,
                flags: WalkFlags(0),
                bad_length: 0,
                gaps: 0,
                held: 0,
            },
        }
    }
}

vocabulary! {
/// Probe-wide counters, one slot each in [`PROBE_STATS_MAP`]; each name is a `kind` of the
/// `retry_after_probe_problems` metric.
pub enum ProbeStat {
    /// A watched connection could not be tracked (the kernel could not allocate its state).
    ConnectionsUntracked => "connections_untracked",
    /// A watched connection did not accept the state callback flag; its close is then seen
    /// by the `tcp_destroy_sock` tracepoint only.
    StateCallbackRefused => "state_callback_refused",
    /// Packets of tracked connections whose headers could not be read.
    PacketsUnparsed => "packets_unparsed",
    /// Packets of tracked connections whose headers were not in the linear buffer and had to
    /// be copied out (the slow path).
    HeadersCopied => "headers_copied",
    /// Client-side connections to a scoped endpoint opened by a socket outside the scope's
    /// cgroup: not counted, by design.
    ConnectionsOutOfScope => "connections_out_of_scope",
    /// Connections established before they were watched, tracked from their next request.
    ConnectionsAdopted => "connections_adopted",
    /// Requests on untracked established connections that could not be adopted because the
    /// kernel could not allocate their state (counted per attempt: once per such request).
    AdoptionsRefused => "adoptions_refused",
    /// Segments of TLS connections whose record framing was lost (a gap in the sequence, or
    /// more records in one segment than are read): their requests or responses are not seen
    /// until a segment starts with a record header again.
    TlsSegmentsUnframed => "tls_segments_unframed",
    /// Segments of HTTP/2 connections whose frame walk was lost (a segment that overtook
    /// bytes and begins inside a frame, or a hole that could not be walked into place): their
    /// streams' starts and ends are not seen until a segment starts with a frame header again.
    Http2SegmentsUnframed => "http2_segments_unframed",
    /// HTTP/2 streams not counted because the stream table ([`h2::STREAMS_MAP`]) was full
    /// when they opened: neither started nor ended.
    Http2StreamsUntracked => "http2_streams_untracked",
    /// HTTP/2 streams the agent abandoned because they were open longer than its stream
    /// timeout (the kernel's slot stays 0; the agent adds its own count).
    Http2StreamsExpired => "http2_streams_expired",
    /// HTTP/2 connections that closed with streams open when the close notices
    /// ([`h2::CLOSED_MAP`]) were full: their streams are abandoned when they expire.
    Http2ClosesUnnoted => "http2_closes_unnoted",
    /// Segments of HTTP/2 connections that arrived ahead of a gap and could not be parked
    /// (larger than [`h2::PARKED_BYTES`], or no room in the parking map): walked as they
    /// came, which may lose the framing (`http2_segments_unframed`).
    Http2SegmentsNotParked => "http2_segments_not_parked",
    /// HTTP/2 connections left out: the kernel refused every build of the programs that
    /// count streams, so their requests are not counted.
    Http2ConnectionsLeftOut => "http2_connections_left_out",
    /// Segments of HTTP/2 connections walked while another CPU was still walking the same
    /// direction's bytes after the wait for it ran out: the two walks may lose the framing
    /// (`http2_segments_unframed`).
    Http2WalksContended => "http2_walks_contended",
    /// HTTP/2 connections whose client's first flight (the preface, and the streams it opens
    /// with it) reached the listener with the handshake, before the connection existed:
    /// under TCP_DEFER_ACCEPT or Fast Open, or when the handshake's last ACK was lost. The
    /// streams that flight opened are not counted.
    Http2FirstFlightsUnwalked => "http2_first_flights_unwalked",
    /// Segments of HTTP/2 connections whose frames outlasted the chain of tail calls that
    /// walks them on kernels without `bpf_loop` (2,048 frames a program, 33 programs a chain,
    /// shared with the parked segments walked after it): the rest of the segment is not
    /// walked, and the walk's place is found again at the next segment that begins with a
    /// frame header (`http2_segments_unframed`).
    Http2WalksCut => "http2_walks_cut",
    /// HTTP/2 streams whose first body byte went by when the body table
    /// ([`h2::BODIES_MAP`], sized as the stream table) was full: they count as waiting until
    /// they end.
    Http2BodiesUntracked => "http2_bodies_untracked",
    /// Segments of one connection's direction received on two CPUs at once, whose turn was
    /// moved again more often than the ingress program tries (`exchange.rs`): its word was
    /// then stored over the other CPU's, which may lose a start or an end.
    TurnsContended => "turns_contended",
}
}

/// Number of slots in [`PROBE_STATS_MAP`].
pub const PROBE_STATS_LEN: u32 = ProbeStat::ALL.len() as u32;

/// The payload of a segment in the host tests: a byte slice.
#[cfg(test)]
pub(crate) mod test_bytes {
    /// A segment's payload.
    pub struct Bytes<'a>(pub &'a [u8]);

    impl Bytes<'_> {
        fn array<const N: usize>(&self, offset: u32) -> Option<[u8; N]> {
            let o = offset as usize;
            self.0.get(o..o + N).map(|s| s.try_into().unwrap())
        }
    }

    impl super::Payload for Bytes<'_> {
        fn header_at(&self, offset: u32) -> Option<[u8; 5]> {
            self.array(offset)
        }
        fn frame_header_at(&self, offset: u32) -> Option<[u8; 9]> {
            self.array(offset)
        }
        fn bytes_at(&self, offset: u32, n: u32) -> Option<u32> {
            assert!((1..=4).contains(&n));
            let o = offset as usize;
            let s = self.0.get(o..o + n as usize)?;
            Some(s.iter().fold(0, |acc, &b| acc << 8 | b as u32))
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    use super::*;

    // SAFETY: #[repr(C)], only integers and explicit padding fields, and
    // every bit pattern is a valid value.
    unsafe impl aya::Pod for EndpointKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for WatchValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for EndpointCounters {}
    // SAFETY: as above.
    unsafe impl aya::Pod for ConnState {}
    // SAFETY: as above.
    unsafe impl aya::Pod for h2::StreamKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for h2::StreamEntry {}
    // SAFETY: as above.
    unsafe impl aya::Pod for h2::ParkKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for h2::ParkedBytes {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each entry's index is its place in `all`, and no two entries share a name.
    fn assert_indexed_and_named<T: Copy>(
        all: &[T],
        index: fn(T) -> usize,
        name: fn(T) -> &'static str,
    ) {
        for (i, entry) in all.iter().enumerate() {
            assert_eq!(index(*entry), i, "{}", name(*entry));
            assert!(
                all[..i].iter().all(|e| name(*e) != name(*entry)),
                "{}",
                name(*entry)
            );
        }
    }

    #[test]
    fn each_vocabulary_lists_every_entry_once_in_index_order_with_a_name_of_its_own() {
        assert_indexed_and_named(ProbeStat::ALL, |s| s as usize, ProbeStat::as_str);
        assert_eq!(PROBE_STATS_LEN as usize, ProbeStat::ALL.len());
        assert_indexed_and_named(
            EndpointCounter::ALL,
            |c| c as usize,
            EndpointCounter::as_str,
        );
        // One entry a field of EndpointCounters, each read by its own entry.
        let fields = core::mem::size_of::<EndpointCounters>() / core::mem::size_of::<u64>();
        assert_eq!(EndpointCounter::ALL.len(), fields);
        const FIELDS: usize = core::mem::size_of::<EndpointCounters>() / 8;
        // Each field holds its entry's index + 1, in the field's unit (the wait is kept in
        // nanoseconds and read in microseconds).
        let unit = |i: usize| match EndpointCounter::ALL[i] {
            EndpointCounter::FirstByteWaitMicroseconds => 1_000,
            _ => 1,
        };
        let mut counters = [0u64; FIELDS];
        for (i, value) in counters.iter_mut().enumerate() {
            *value = (i as u64 + 1) * unit(i);
        }
        // SAFETY: EndpointCounters is #[repr(C)] of u64 fields only, the array's layout.
        let read: EndpointCounters = unsafe { core::mem::transmute(counters) };
        for counter in EndpointCounter::ALL {
            assert_eq!(
                read.get(*counter),
                *counter as u64 + 1,
                "{}",
                counter.as_str()
            );
        }
    }
}
