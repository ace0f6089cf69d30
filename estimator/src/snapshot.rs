//! What the agent reads from the kernel on each tick: the estimator's only input from the
//! kernel side.

use std::time::Instant;

use retry_after_common::{EndpointCounters, PROBE_STATS_LEN, ProbeStat, Side};

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

/// Probe-wide counters of data the programs could not handle, one per [`ProbeStat`].
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct ProbeStats([u64; PROBE_STATS_LEN as usize]);

impl ProbeStats {
    /// The counts, one per [`ProbeStat`] in its order.
    pub const fn new(counts: [u64; PROBE_STATS_LEN as usize]) -> Self {
        Self(counts)
    }

    /// The count of one statistic.
    pub const fn get(&self, stat: ProbeStat) -> u64 {
        self.0[stat as usize]
    }

    /// Every statistic with its count, in order.
    pub fn iter(&self) -> impl Iterator<Item = (ProbeStat, u64)> + '_ {
        ProbeStat::ALL.iter().map(|stat| (*stat, self.get(*stat)))
    }
}

impl std::fmt::Debug for ProbeStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.iter().map(|(stat, count)| (stat.as_str(), count)))
            .finish()
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
