//! A service's load at one moment, and the rule that keeps the queue and its drain in one
//! scope.
//!
//! The proposal divides *own* queue by *own* drain. Where the rejection happens decides which:
//!
//! * **proxy** (`rejected_at = "proxy"`, the default): the proxy on this node queues and
//!   rejects. Its queue is the depth it passes in its query, else its listener's requests in
//!   flight minus the requests it has in flight to the backends (the frontend), plus those of
//!   its requests a backend holds beyond its `max_ongoing_requests` (waiting inside a replica
//!   that queues: a proxy that does not cap concurrency per server, as open-source nginx, hands
//!   its queue on to the replicas). Its drain is
//!   this node's **client-side** completions to the service's backends: what this proxy got
//!   served, not what the replicas served to every caller.
//! * **replica** (`rejected_at = "replica"`): the replicas queue and reject (the proposal's
//!   revision runs the policy "at the router or the replica, whichever rejects"). Their queue
//!   is what waits inside them; their drain is their **server-side** completions.
//!
//! What waits inside a replica is read as its `replica_queue` says: the requests in flight
//! beyond its `max_ongoing_requests` (`beyond_capacity`, the default), or the requests whose
//! response's first body byte has not gone by (`waiting`): an LLM engine sends its headers at
//! once and its first token when it schedules the request, so what waits for a body is its
//! queue, whatever its batch holds (bounded by its KV cache as well as by its
//! `max_num_seqs`), with no capacity configured. It cannot tell a request that waits from
//! one that runs without streaming (a non-streamed answer waits until its whole body), nor
//! see the framing inside TLS.
//!
//! When no source can see the queue (a proxy that caps concurrency per replica keeps the
//! backends' in-flight at or below capacity, so with no frontend and no depth from the proxy
//! the queue is upstream and invisible), there is no depth: the ladder falls to the static
//! rung with the reason `queue_invisible`. A computed value from a depth of zero would say
//! "1 s" in exactly the overload the proposal was written for.

use retry_after_policy::{QueueDepth, QueueDepthSource};

retry_after_policy::names! {
    /// Where a service's requests are queued and rejected (`rejected_at` in the configuration).
    #[derive(Default)]
    RejectedAt, "rejection site" {
        /// The proxy on this node (client-side completions drain its queue).
        #[default]
        Proxy = "proxy",
        /// The replicas on this node (server-side completions drain their queues).
        Replica = "replica",
    }
}

retry_after_policy::names! {
    /// How the queue inside a service's replicas is read (`replica_queue` in the
    /// configuration).
    #[derive(Default)]
    ReplicaQueue, "replica queue" {
        /// The requests in flight beyond each replica's `max_ongoing_requests` (none where it
        /// is not configured).
        #[default]
        BeyondCapacity = "beyond_capacity",
        /// The requests in flight whose response's first body byte has not gone by.
        Waiting = "waiting",
    }
}

/// One backend seen from one side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SideLoad {
    /// Requests in flight.
    pub in_flight: u64,
    /// Of those, the requests whose response's first body byte has not gone by.
    pub waiting: u64,
    /// Responses completed, in total since the endpoint was watched.
    pub completed_total: u64,
}

/// Load of one backend at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendLoad {
    /// Seen from this node's outbound connections to it (its callers on this node).
    pub client: SideLoad,
    /// Seen from its own listener on this node (all its callers).
    pub server: SideLoad,
    /// Requests the backend serves at once, if configured.
    pub max_ongoing_requests: Option<u64>,
}

/// Load of one service at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceLoad {
    /// Where its queue is.
    pub rejected_at: RejectedAt,
    /// How the queue inside its replicas is read.
    pub replica_queue: ReplicaQueue,
    /// Its backends.
    pub backends: Vec<BackendLoad>,
    /// Requests in flight at the proxy's listener, if a frontend is configured.
    pub frontend_in_flight: Option<u64>,
}

impl ServiceLoad {
    fn side(&self, backend: &BackendLoad) -> SideLoad {
        match self.rejected_at {
            RejectedAt::Proxy => backend.client,
            RejectedAt::Replica => backend.server,
        }
    }

    /// Responses completed in this scope, in total: what drains the queue.
    pub fn completed_total(&self) -> u64 {
        self.backends
            .iter()
            .map(|b| self.side(b).completed_total)
            .sum()
    }

    /// Requests in flight to the backends in this scope.
    pub fn in_flight(&self) -> u64 {
        self.backends.iter().map(|b| self.side(b).in_flight).sum()
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

    /// min(1, in flight / capacity) in this scope, or `None` when capacity is unknown.
    pub fn occupancy(&self) -> Option<f64> {
        let capacity = self.capacity().filter(|c| *c > 0)?;
        Some((self.in_flight() as f64 / capacity as f64).min(1.0))
    }

    /// What waits inside the replicas in this scope, as `replica_queue` reads it: requests in
    /// flight beyond each backend's `max_ongoing_requests` (none where it is not configured),
    /// or requests whose first body byte has not gone by.
    fn inside_replicas(&self) -> u64 {
        self.backends
            .iter()
            .map(|b| match self.replica_queue {
                ReplicaQueue::BeyondCapacity => self
                    .side(b)
                    .in_flight
                    .saturating_sub(b.max_ongoing_requests.unwrap_or(u64::MAX)),
                ReplicaQueue::Waiting => self.side(b).waiting,
            })
            .sum()
    }

    /// The queue, from the best source that can see it in this scope (see the module docs);
    /// `None` when none can.
    pub fn queue_depth(&self, from_proxy: Option<u64>) -> Option<QueueDepth> {
        let (depth, source) = match (from_proxy, self.rejected_at) {
            (Some(depth), _) => (depth, QueueDepthSource::Proxy),
            (None, RejectedAt::Proxy) => {
                let frontend = self.frontend_in_flight?;
                (
                    frontend.saturating_sub(self.in_flight()) + self.inside_replicas(),
                    QueueDepthSource::Frontend,
                )
            }
            (None, RejectedAt::Replica) => match self.replica_queue {
                ReplicaQueue::BeyondCapacity => {
                    self.capacity()?;
                    (self.inside_replicas(), QueueDepthSource::BeyondCapacity)
                }
                ReplicaQueue::Waiting => (self.inside_replicas(), QueueDepthSource::Waiting),
            },
        };
        Some(QueueDepth { depth, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(client: (u64, u64), server: (u64, u64), max: Option<u64>) -> BackendLoad {
        let side = |(in_flight, completed_total)| SideLoad {
            in_flight,
            waiting: 0,
            completed_total,
        };
        BackendLoad {
            client: side(client),
            server: side(server),
            max_ongoing_requests: max,
        }
    }

    fn depth(load: &ServiceLoad, from_proxy: Option<u64>) -> Option<(u64, QueueDepthSource)> {
        load.queue_depth(from_proxy).map(|q| (q.depth, q.source))
    }

    #[test]
    fn the_proxy_depth_wins_in_either_scope() {
        for rejected_at in [RejectedAt::Proxy, RejectedAt::Replica] {
            let load = ServiceLoad {
                rejected_at,
                replica_queue: ReplicaQueue::BeyondCapacity,
                backends: vec![backend((2, 0), (50, 0), Some(8))],
                frontend_in_flight: Some(90),
            };
            assert_eq!(depth(&load, Some(3)), Some((3, QueueDepthSource::Proxy)));
        }
    }

    #[test]
    fn proxy_scope_frontend_minus_forwarded_over_client_side_completions() {
        // Two replicas, each also serving other callers on this node (server side sees more).
        let load = ServiceLoad {
            rejected_at: RejectedAt::Proxy,
            replica_queue: ReplicaQueue::BeyondCapacity,
            backends: vec![
                backend((2, 100), (8, 400), Some(8)),
                backend((2, 100), (8, 300), Some(8)),
            ],
            frontend_in_flight: Some(30),
        };
        assert_eq!(depth(&load, None), Some((26, QueueDepthSource::Frontend)));
        assert_eq!(load.completed_total(), 200, "own drain: client side only");
        assert_eq!(load.in_flight(), 4);
        assert_eq!(load.occupancy(), Some(4.0 / 16.0));
    }

    #[test]
    fn proxy_scope_counts_its_requests_a_replica_queues_beyond_its_places() {
        // nginx forwards 12 and 7 to replicas of 8 places each, which queue the rest: 4 wait
        // inside the first, and 3 more at nginx itself.
        let load = ServiceLoad {
            rejected_at: RejectedAt::Proxy,
            replica_queue: ReplicaQueue::BeyondCapacity,
            backends: vec![
                backend((12, 100), (12, 100), Some(8)),
                backend((7, 100), (7, 100), Some(8)),
            ],
            frontend_in_flight: Some(22),
        };
        assert_eq!(depth(&load, None), Some((7, QueueDepthSource::Frontend)));
        let uncapped = ServiceLoad {
            backends: vec![
                backend((12, 0), (12, 0), None),
                backend((7, 0), (7, 0), None),
            ],
            ..load
        };
        assert_eq!(
            depth(&uncapped, None),
            Some((3, QueueDepthSource::Frontend))
        );
    }

    #[test]
    fn proxy_scope_without_a_frontend_cannot_see_the_queue() {
        // A proxy capping concurrency at 2 per replica: in flight never exceeds capacity.
        let load = ServiceLoad {
            rejected_at: RejectedAt::Proxy,
            replica_queue: ReplicaQueue::BeyondCapacity,
            backends: vec![
                backend((2, 10), (2, 10), Some(2)),
                backend((2, 10), (2, 10), Some(2)),
            ],
            frontend_in_flight: None,
        };
        assert_eq!(depth(&load, None), None);
    }

    #[test]
    fn waiting_reads_the_queue_inside_engines_without_a_capacity() {
        // Two engines that send their headers at once: 30 and 12 in flight, of which 22 and 4
        // have had no body byte yet (they wait for a slot); no max_ongoing_requests known.
        let side = |in_flight, waiting| SideLoad {
            in_flight,
            waiting,
            completed_total: 50,
        };
        let backend = |in_flight, waiting| BackendLoad {
            client: side(in_flight, waiting),
            server: side(in_flight, waiting),
            max_ongoing_requests: None,
        };
        let replicas = ServiceLoad {
            rejected_at: RejectedAt::Replica,
            replica_queue: ReplicaQueue::Waiting,
            backends: vec![backend(30, 22), backend(12, 4)],
            frontend_in_flight: None,
        };
        assert_eq!(
            depth(&replicas, None),
            Some((26, QueueDepthSource::Waiting))
        );
        let beyond = ServiceLoad {
            replica_queue: ReplicaQueue::BeyondCapacity,
            ..replicas.clone()
        };
        assert_eq!(
            depth(&beyond, None),
            None,
            "no capacity: beyond it is unknown"
        );
        // Behind nginx (no cap per server): its own 5 queued, then what waits in the engines.
        let proxy = ServiceLoad {
            rejected_at: RejectedAt::Proxy,
            frontend_in_flight: Some(47),
            ..replicas
        };
        assert_eq!(depth(&proxy, None), Some((31, QueueDepthSource::Frontend)));
    }

    #[test]
    fn replica_scope_beyond_capacity_over_server_side_completions() {
        let load = ServiceLoad {
            rejected_at: RejectedAt::Replica,
            replica_queue: ReplicaQueue::BeyondCapacity,
            backends: vec![
                backend((0, 0), (11, 70), Some(8)),
                backend((0, 0), (5, 30), Some(8)),
            ],
            frontend_in_flight: None,
        };
        // (11 − 8) + 0 = 3; unaccepted connections' requests are already in flight.
        assert_eq!(
            depth(&load, None),
            Some((3, QueueDepthSource::BeyondCapacity))
        );
        assert_eq!(load.completed_total(), 100);
        assert_eq!(load.occupancy(), Some(1.0));
        let unknown = ServiceLoad {
            backends: vec![
                backend((0, 0), (11, 0), Some(8)),
                backend((0, 0), (5, 0), None),
            ],
            ..load
        };
        assert_eq!(depth(&unknown, None), None, "capacity unknown: invisible");
        assert_eq!(unknown.occupancy(), None);
    }
}
