//! Segments of the direction a vantage point receives that arrived ahead of a gap, parked by
//! the programs until it fills and then walked in order: the types the programs and the agent
//! share for it.

/// A segment of the direction a vantage point receives that arrived ahead of bytes not seen
/// yet, kept whole (by the programs, in a map keyed by connection and `seq`) until the gap
/// fills, then walked in its place: out of order on arrival, in order to the walk.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Parked {
    /// Sequence number of its first byte.
    pub seq: u32,
    /// Its payload bytes; 0: the place is free.
    pub len: u32,
}

/// Runs of segments one connection may have parked at once ([`ParkedPlaces`]; a segment
/// that continues a run is added to it); one more arriving ahead of another gap before the
/// gap fills is walked as it comes (counted as not parked).
pub const PARKED_PER_CONNECTION: usize = 32;

/// Where a connection's parked segments are: a place each, found by any byte it holds (a
/// retransmission cut differently still meets them). Kept in the socket's own storage, apart
/// from [`crate::ConnState`], made at the connection's first parked segment.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParkedPlaces {
    /// The places; a free one has `len` 0.
    pub places: [Parked; PARKED_PER_CONNECTION],
}
/// Bytes one parked segment holds at most (a segment of 64 KiB: TSO's largest); a larger one
/// is not parked.
pub const PARKED_BYTES: u32 = 65_536;

/// The parked segments, by the name the programs and the agent share: [`ParkKey`] to
/// [`ParkedBytes`]. The agent drops those parked longer than [`PARKED_MAX_AGE_NS`] (a gap
/// that never filled: the connection closed, or its walk lost its place).
pub const PARKED_MAP: &str = "H2_PARKED";
/// How long a segment may stay parked before the agent drops it.
pub const PARKED_MAX_AGE_NS: u64 = 10_000_000_000;
/// One buffer per possible CPU that a segment is copied into before the parking map takes it
/// (the agent sizes it to the CPUs).
pub const PARK_SCRATCH_MAP: &str = "H2_PARK_SCRATCH";

/// A parked segment's key: its connection and its first byte's sequence number.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParkKey {
    /// The connection's id ([`crate::ConnState::h2_connection`]).
    pub connection: u64,
    /// Sequence number of the segment's first byte.
    pub seq: u32,
    /// Always zero (explicit padding).
    pub pad: u32,
}

/// A parked segment: when it was parked, and its bytes, with room past them for the widest
/// read at the last offset (the verifier sees a read's offset only as masked).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ParkedBytes {
    /// When it was parked (`bpf_ktime_get_ns`).
    pub parked_ns: u64,
    /// Payload bytes held.
    pub len: u32,
    /// Always zero (explicit padding).
    pub pad: u32,
    /// The payload.
    pub bytes: [u8; PARKED_BYTES as usize + 16],
}
