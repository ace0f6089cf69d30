//! The open streams of HTTP/2 connections: one entry per (connection, stream) in a table
//! shared by every connection, from the stream's HEADERS to its end.
//!
//! A connection has no limit of its own on how many streams it holds open: the table's size
//! ([`STREAMS_MAP`], set by the agent from its configuration) bounds them all together. The
//! walk ([`super::FrameStream`]) asks the table two things, through [`StreamTable`]: open a
//! stream (a client's HEADERS on a stream id above every one before it) and end one (the
//! server's END_STREAM, RST_STREAM or rejection, or the client's RST_STREAM). Removing an entry
//! succeeds once, whichever direction (and CPU) tries first, so each end is counted exactly
//! once. A stream that finds the table full is not counted at all (neither started nor ended)
//! and is counted as untracked instead: never silently miscounted.
//!
//! What the walk does not end, the agent does ([`StreamEntry::opened_ns`] and
//! [`CLOSED_MAP`]): the streams of a connection that closed with streams open (a GOAWAY's
//! unprocessed streams among them) are abandoned at the agent's next tick, and a stream open
//! longer than the configured timeout is abandoned and counted as expired.

/// The stream table, by the name the programs and the agent share.
pub const STREAMS_MAP: &str = "H2_STREAMS";
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
    /// The vantage point: `Side as u16`.
    pub side: u16,
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

/// The open streams of one connection, as the walk changes them. Both directions of a
/// connection may call these at once from two CPUs: an implementation's `end` must remove the
/// entry atomically, true for the one call that removed it.
pub trait StreamTable {
    /// Open stream `stream`.
    fn open(&self, stream: u32) -> Opened;
    /// End stream `stream`: true if it was open and this call ended it.
    fn end(&self, stream: u32) -> bool;
}

#[cfg(test)]
pub(crate) mod host {
    //! A stream table for the host tests: a set behind a cell, with a size.

    extern crate std;
    use core::cell::RefCell;
    use std::collections::BTreeSet;

    use super::{Opened, StreamTable};

    /// The open streams of one connection, at most `capacity`.
    #[derive(Debug, Default)]
    pub struct HostStreams {
        pub open: RefCell<BTreeSet<u32>>,
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

        fn end(&self, stream: u32) -> bool {
            self.open.borrow_mut().remove(&stream)
        }
    }
}
