//! What the agent reads from the kernel on each tick: the estimator's only input from the
//! kernel side.

use std::time::Instant;

use retry_after_common::{EndpointCounters, Side};

use crate::endpoint::Endpoint;

/// The counters of one watched endpoint seen from one side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointSnapshot {
    /// The watched endpoint.
    pub endpoint: Endpoint,
    /// Server side (a local listener) or client side (connections this node opened).
    pub side: Side,
    /// Exact counters since the endpoint was watched (summed over CPUs).
    pub counters: EndpointCounters,
    /// Server side: connections waiting in the accept queues of listeners serving this
    /// endpoint (`None` if they could not be read this tick). Client side: `None` (the remote
    /// backlog cannot be seen from here).
    pub accept_backlog: Option<u32>,
}

impl EndpointSnapshot {
    /// Requests begun and not yet answered or abandoned.
    pub fn in_flight(&self) -> u64 {
        self.counters.in_flight()
    }
}

/// Probe-wide counters of data the programs could not handle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProbeStats {
    /// Watched connections that could not be tracked (the kernel could not allocate their
    /// state).
    pub connections_untracked: u64,
    /// Watched connections whose close is not reported (state callback refused).
    pub state_callback_refused: u64,
    /// Segments of tracked connections whose headers could not be read.
    pub packets_unparsed: u64,
    /// Segments of tracked connections whose headers had to be copied out (slow path).
    pub headers_copied: u64,
    /// Client-side connections to scoped endpoints opened outside the scope (not counted).
    pub connections_out_of_scope: u64,
    /// Connections established before they were watched, tracked from their next request.
    pub connections_adopted: u64,
    /// Requests on untracked connections that could not be adopted (no memory for their
    /// state).
    pub adoptions_refused: u64,
    /// Segments of TLS connections whose record framing was lost (their turns are not seen).
    pub tls_segments_unframed: u64,
    /// Segments of HTTP/2 connections whose frame walk was lost (their streams are not seen).
    pub http2_segments_unframed: u64,
    /// HTTP/2 streams given up beyond their connection's stream window (counted abandoned,
    /// their end not counted).
    pub http2_streams_forgotten: u64,
    /// HTTP/2 connections left out: the kernel cannot run the programs that count streams.
    pub http2_connections_left_out: u64,
}

impl ProbeStats {
    /// Every counter with its name (the `kind` label of `retry_after_probe_problems`).
    pub fn named(&self) -> [(&'static str, u64); 11] {
        [
            ("connections_untracked", self.connections_untracked),
            ("state_callback_refused", self.state_callback_refused),
            ("packets_unparsed", self.packets_unparsed),
            ("headers_copied", self.headers_copied),
            ("connections_out_of_scope", self.connections_out_of_scope),
            ("connections_adopted", self.connections_adopted),
            ("adoptions_refused", self.adoptions_refused),
            ("tls_segments_unframed", self.tls_segments_unframed),
            ("http2_segments_unframed", self.http2_segments_unframed),
            ("http2_streams_forgotten", self.http2_streams_forgotten),
            (
                "http2_connections_left_out",
                self.http2_connections_left_out,
            ),
        ]
    }
}

/// Every watched endpoint, both sides, read at one moment.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// When the counters were read.
    pub taken_at: Instant,
    /// One entry per watched endpoint and side.
    pub endpoints: Vec<EndpointSnapshot>,
    /// Probe-wide counters.
    pub probe: ProbeStats,
    /// Why listener backlogs are missing from this snapshot, if they are.
    pub backlog_error: Option<String>,
}

impl Snapshot {
    /// The counters of `endpoint` from `side`, if it is watched.
    pub fn endpoint(&self, endpoint: &Endpoint, side: Side) -> Option<&EndpointSnapshot> {
        self.endpoints
            .iter()
            .find(|snapshot| snapshot.endpoint == *endpoint && snapshot.side == side)
    }
}
