//! Queue depth, from the best source available at the moment of the estimate.
//!
//! In order of preference:
//! 1. **proxy**: the depth the querying proxy passes: it knows its own queue exactly;
//! 2. **frontend**: requests in flight at the proxy's listener minus requests this node has in
//!    flight to the backends: the proxy's queue, seen from the kernel;
//! 3. **beyond_capacity**: requests in flight beyond each backend's `max_ongoing_requests`,
//!    plus connections waiting in the backends' accept queues (needs every backend's limit);
//! 4. **in_flight**: all requests in flight at the backends (an upper bound on the queue).

use std::fmt;

/// Load of one backend at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendLoad {
    /// Requests in flight at the backend (from the vantage point that sees most of its work).
    pub in_flight: u64,
    /// Requests this node has in flight to the backend (client side).
    pub client_in_flight: u64,
    /// Responses the backend has completed, in total (same vantage point as `in_flight`).
    pub completed_total: u64,
    /// Requests the backend serves at once, if configured.
    pub max_ongoing_requests: Option<u64>,
    /// Connections waiting in the backend's accept queue, if it listens on this node.
    pub accept_backlog: Option<u64>,
}

/// Load of one service at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceLoad {
    /// Its backends.
    pub backends: Vec<BackendLoad>,
    /// Requests in flight at the proxy's listener, if a frontend is configured.
    pub frontend_in_flight: Option<u64>,
}

impl ServiceLoad {
    /// Responses completed by all backends, in total.
    pub fn completed_total(&self) -> u64 {
        self.backends.iter().map(|b| b.completed_total).sum()
    }

    /// Requests in flight at all backends.
    pub fn in_flight(&self) -> u64 {
        self.backends.iter().map(|b| b.in_flight).sum()
    }

    /// Σ max_ongoing_requests, if every backend has one.
    pub fn capacity(&self) -> Option<u64> {
        if self.backends.is_empty() {
            return None;
        }
        self.backends
            .iter()
            .map(|b| b.max_ongoing_requests)
            .sum::<Option<u64>>()
    }

    /// min(1, in flight / capacity), or `None` when capacity is unknown.
    pub fn occupancy(&self) -> Option<f64> {
        let capacity = self.capacity().filter(|c| *c > 0)?;
        Some((self.in_flight() as f64 / capacity as f64).min(1.0))
    }

    /// The queue depth from the best source (see the module docs), with the source used.
    pub fn queue_depth(&self, from_proxy: Option<u64>) -> (u64, QueueDepthSource) {
        if let Some(depth) = from_proxy {
            return (depth, QueueDepthSource::Proxy);
        }
        if let Some(frontend) = self.frontend_in_flight {
            let forwarded: u64 = self.backends.iter().map(|b| b.client_in_flight).sum();
            return (
                frontend.saturating_sub(forwarded),
                QueueDepthSource::Frontend,
            );
        }
        if self.capacity().is_some() {
            let beyond: u64 = self
                .backends
                .iter()
                .map(|b| {
                    b.in_flight
                        .saturating_sub(b.max_ongoing_requests.unwrap_or(u64::MAX))
                        + b.accept_backlog.unwrap_or(0)
                })
                .sum();
            return (beyond, QueueDepthSource::BeyondCapacity);
        }
        (self.in_flight(), QueueDepthSource::InFlight)
    }
}

/// Where a queue depth came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QueueDepthSource {
    /// Passed by the querying proxy.
    Proxy,
    /// Frontend in flight minus backend in flight.
    Frontend,
    /// In flight beyond each backend's capacity, plus accept backlogs.
    BeyondCapacity,
    /// Total in flight at the backends.
    InFlight,
}

impl QueueDepthSource {
    /// Every source, best first.
    pub const ALL: [QueueDepthSource; 4] = [
        Self::Proxy,
        Self::Frontend,
        Self::BeyondCapacity,
        Self::InFlight,
    ];

    /// Name used in the protocol, metrics and logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Proxy => "proxy",
            Self::Frontend => "frontend",
            Self::BeyondCapacity => "beyond_capacity",
            Self::InFlight => "in_flight",
        }
    }
}

impl fmt::Display for QueueDepthSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(in_flight: u64, max: Option<u64>, backlog: Option<u64>) -> BackendLoad {
        BackendLoad {
            in_flight,
            client_in_flight: in_flight,
            completed_total: 0,
            max_ongoing_requests: max,
            accept_backlog: backlog,
        }
    }

    #[test]
    fn the_proxy_depth_wins() {
        let load = ServiceLoad {
            backends: vec![backend(50, Some(8), None)],
            frontend_in_flight: Some(90),
        };
        assert_eq!(load.queue_depth(Some(3)), (3, QueueDepthSource::Proxy));
    }

    #[test]
    fn frontend_minus_what_was_forwarded() {
        let load = ServiceLoad {
            backends: vec![backend(8, Some(8), None), backend(6, Some(8), None)],
            frontend_in_flight: Some(40),
        };
        assert_eq!(load.queue_depth(None), (26, QueueDepthSource::Frontend));
        let load = ServiceLoad {
            frontend_in_flight: Some(10),
            ..load
        };
        assert_eq!(load.queue_depth(None), (0, QueueDepthSource::Frontend));
    }

    #[test]
    fn beyond_capacity_plus_backlog_when_every_limit_is_known() {
        let load = ServiceLoad {
            backends: vec![backend(11, Some(8), Some(2)), backend(5, Some(8), None)],
            frontend_in_flight: None,
        };
        // (11 − 8) + 2 + 0 = 5
        assert_eq!(
            load.queue_depth(None),
            (5, QueueDepthSource::BeyondCapacity)
        );
        assert_eq!(load.occupancy(), Some(1.0));
    }

    #[test]
    fn total_in_flight_otherwise() {
        let load = ServiceLoad {
            backends: vec![backend(11, Some(8), None), backend(5, None, None)],
            frontend_in_flight: None,
        };
        assert_eq!(load.queue_depth(None), (16, QueueDepthSource::InFlight));
        assert_eq!(load.occupancy(), None, "capacity unknown: the term drops");
    }

    #[test]
    fn occupancy_by_hand() {
        let load = ServiceLoad {
            backends: vec![backend(3, Some(8), None), backend(3, Some(8), None)],
            frontend_in_flight: None,
        };
        assert_eq!(load.occupancy(), Some(6.0 / 16.0));
    }
}
