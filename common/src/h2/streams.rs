//! The open streams of HTTP/2 connections: one entry per (connection, stream) in a table
//! shared by every connection, from the stream's HEADERS to its end.
//!
//! A connection has no limit of its own on how many streams it holds open: the table's size
//! ([`STREAMS_MAP`], set by the agent from its configuration) bounds them all together. The
//! walk ([`super::FrameStream`]) asks the table three things, through [`StreamTable`]: open a
//! stream (a client's HEADERS on a stream id above every one before it), begin its body (the
//! server's first DATA frame on it: the request stops waiting and streams) and end one (the
//! server's END_STREAM, RST_STREAM or rejection, or the client's RST_STREAM). Removing an entry
//! succeeds once, whichever direction (and CPU) tries first, so each end is counted exactly
//! once. A stream that finds the table full is not counted at all (neither started nor ended)
//! and is counted as untracked instead: never silently miscounted.
//!
//! **Bodies.** A stream whose body has begun has an entry in a second table ([`BODIES_MAP`]),
//! put there by the server's first DATA frame and removed by the stream's end. Both are
//! removals and insertions that succeed once, so the two directions agree without atomics of
//! their own (none that fetch on 5.10): the end removes the stream, then its body entry, and
//! counts the body ended if that removal succeeded; the first DATA frame inserts the body
//! entry, then looks for the stream: still open, the body is counted begun; ended meanwhile,
//! it takes its entry back, and counts the body begun only if the end took it first (and so
//! counted it ended). Every interleaving counts a body begun and ended both, or neither.
//!
//! What the walk does not end, the agent does ([`StreamEntry::opened_ns`] and
//! [`CLOSED_MAP`]): the streams of a connection that closed with streams open (a GOAWAY's
//! unprocessed streams among them) are abandoned at the agent's next tick, and a stream open
//! longer than the configured timeout is abandoned and counted as expired.

/// The stream table, by the name the programs and the agent share.
pub const STREAMS_MAP: &str = "H2_STREAMS";
/// The open streams whose body has begun (the server's first DATA frame on them went by), by
/// the name the programs and the agent share: [`StreamKey`] to 0. Sized as the stream table.
pub const BODIES_MAP: &str = "H2_BODIES";
/// Connections that closed with streams open, for the agent to abandon them: connection id
/// to close time (`bpf_ktime_get_ns`).
pub const CLOSED_MAP: &str = "H2_CLOSED";
/// Entries of [`CLOSED_MAP`]: closes waiting for the agent's next tick.
pub const CLOSED_ENTRIES: u32 = 16_384;
/// The stream table's size where the configuration does not set one.
pub const DEFAULT_MAX_STREAMS: u32 = 65_536;

/// The key of one open stream: its connection (the socket's cookie, unique while the system
/// runs) and its stream id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StreamKey {
    /// The connection's id ([`crate::ConnState::h2_connection`]).
    pub connection: u64,
    /// The stream id (odd: a client's).
    pub stream: u32,
    /// Always zero (explicit padding).
    pub pad: u32,
}

/// What the table holds of an open stream: when it opened, and whose counters it feeds.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamEntry {
    /// When its HEADERS was seen (`bpf_ktime_get_ns`, the monotonic clock).
    pub opened_ns: u64,
    /// The watch generation of its connection.
    pub generation: u32,
    /// The watch slot of its connection (below [`crate::MAX_WATCHED_ENDPOINTS`]).
    pub slot: u16,
    /// The vantage point: `Side as u8`.
    pub side: u8,
    /// 1 once the server's first DATA frame on it went by (written by the server's walk only,
    /// so that later DATA frames skip the body table); [`BODIES_MAP`] is what counts.
    pub body: u8,
}

/// What opening a stream did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opened {
    /// It is now open: one request started.
    New,
    /// It was open already (a retransmitted HEADERS after an adoption): nothing.
    Known,
    /// The table is full: not counted, and counted as untracked.
    Full,
}

/// What ending a stream did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// It was not open (ended already, by the other direction or the agent, or never
    /// tracked): nothing.
    NotOpen,
    /// Ended by this call, before its first body byte.
    Waiting,
    /// Ended by this call, its body begun.
    Streaming,
}

/// The open streams of one connection, as the walk changes them. Both directions of a
/// connection may call these at once from two CPUs: an implementation's `end` must remove the
/// entry atomically, and say so for the one call that removed it (see the module's
/// "Bodies" for `begin_body`).
pub trait StreamTable {
    /// Open stream `stream`.
    fn open(&self, stream: u32) -> Opened;
    /// Stream `stream`'s first body byte went by (called for each of the server's DATA frames
    /// with a payload): true if it is open and this call is the first to see its body. The
    /// table counts the wait since it opened (the time to first body byte) itself.
    fn begin_body(&self, stream: u32) -> bool;
    /// End stream `stream`.
    fn end(&self, stream: u32) -> Ended;
}

#[cfg(test)]
pub(crate) mod host {
    //! A stream table for the host tests: a set behind a cell, with a size.

    extern crate std;
    use core::cell::RefCell;
    use std::collections::BTreeSet;

    use super::{Ended, Opened, StreamTable};

    /// The open streams of one connection, at most `capacity`, and those whose body began.
    #[derive(Debug, Default)]
    pub struct HostStreams {
        pub open: RefCell<BTreeSet<u32>>,
        pub bodies: RefCell<BTreeSet<u32>>,
        pub capacity: Option<usize>,
    }

    impl StreamTable for HostStreams {
        fn open(&self, stream: u32) -> Opened {
            let mut open = self.open.borrow_mut();
            if open.contains(&stream) {
                Opened::Known
            } else if self.capacity.is_some_and(|c| open.len() >= c) {
                Opened::Full
            } else {
                open.insert(stream);
                Opened::New
            }
        }

        fn begin_body(&self, stream: u32) -> bool {
            self.open.borrow().contains(&stream) && self.bodies.borrow_mut().insert(stream)
        }

        fn end(&self, stream: u32) -> Ended {
            if !self.open.borrow_mut().remove(&stream) {
                Ended::NotOpen
            } else if self.bodies.borrow_mut().remove(&stream) {
                Ended::Streaming
            } else {
                Ended::Waiting
            }
        }
    }
}
