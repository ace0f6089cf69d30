//! The end-to-end evaluation: computed against static `Retry-After`, on real sockets.
//!
//! Every run puts the same pieces on loopback: replica servers ([`replica`]), the reference
//! rejecting proxy ([`proxy`]) in front of them, the real agent watching the replicas from the
//! kernel and answering the proxy through the client library, and open-loop clients
//! ([`load`]). A run is one [`Scenario`] under one [`Policy`]; [`run`] runs it and
//! [`report`] turns the attempts into the figures, the table and the plots.

pub mod load;

pub mod report;
pub mod run;

use std::time::Duration;

use load::{Behaviour, Phase};
use retry_after_reference_proxy::HeaderPolicy;
use retry_after_testkit::replica::{ReplicaSpec, ServiceTime};

/// What the rejecting proxy tells clients, and how the clients behave.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Policy {
    /// No header; clients back off exponentially with jitter (the status quo).
    NoHeader,
    /// A fixed `Retry-After` of this many seconds; clients honour it.
    Static(u64),
    /// Computed, with the saturation factor's weights at zero (the proposal revision's form).
    ComputedSimple,
    /// Computed with the proposal's default constants.
    ComputedDefaults,
    /// Computed with the defaults, the proxy counting the clients it has told to come back and
    /// that are not due yet as part of its queue (a candidate change, not the proposal's).
    ComputedRetryBacklog,
}

impl Policy {
    /// Every policy, by name (`--policy`).
    pub const EVERY: [Policy; 7] = [
        Policy::NoHeader,
        Policy::Static(1),
        Policy::Static(5),
        Policy::Static(30),
        Policy::ComputedSimple,
        Policy::ComputedDefaults,
        Policy::ComputedRetryBacklog,
    ];

    /// The six policies of the evaluation, in table order.
    pub const ALL: [Policy; 6] = [
        Policy::NoHeader,
        Policy::Static(1),
        Policy::Static(5),
        Policy::Static(30),
        Policy::ComputedSimple,
        Policy::ComputedDefaults,
    ];

    /// A short name for tables and files.
    pub fn name(&self) -> String {
        match self {
            Policy::NoHeader => "no header".to_owned(),
            Policy::Static(s) => format!("static {s} s"),
            Policy::ComputedSimple => "computed, w1=w2=0".to_owned(),
            Policy::ComputedDefaults => "computed, defaults".to_owned(),
            Policy::ComputedRetryBacklog => "computed + retry backlog".to_owned(),
        }
    }

    /// How the proxy's rejections are answered.
    pub fn header(&self) -> HeaderPolicy {
        match self {
            Policy::NoHeader => HeaderPolicy::None,
            Policy::ComputedRetryBacklog => HeaderPolicy::FromAgentWithRetryBacklog,
            _ => HeaderPolicy::FromAgent,
        }
    }

    /// How the clients behave.
    pub fn behaviour(&self) -> Behaviour {
        match self {
            Policy::NoHeader => Behaviour::Backoff,
            _ => Behaviour::HonourRetryAfter,
        }
    }

    /// The `[service.backpressure]` lines of the agent's configuration. Computed policies fall
    /// back to a static 5 s (the ladder's middle rung) while the drain rate is not known.
    pub fn backpressure(&self) -> String {
        let common = "status_code = 429\n";
        match self {
            Policy::NoHeader => format!("{common}retry_after_policy = \"static\"\n"),
            Policy::Static(s) => {
                format!("{common}retry_after_policy = \"static\"\nretry_after_s = {s}\n")
            }
            Policy::ComputedSimple => format!(
                "{common}retry_after_policy = \"router_queue_drain_rate\"\nretry_after_s = 5\noccupancy_weight = 0.0\nbackoff_weight = 0.0\n"
            ),
            Policy::ComputedDefaults | Policy::ComputedRetryBacklog => format!(
                "{common}retry_after_policy = \"router_queue_drain_rate\"\nretry_after_s = 5\n"
            ),
        }
    }
}

/// One setup of replicas and load.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Short name (files, tables).
    pub name: &'static str,
    /// What it models, in a line.
    pub title: &'static str,
    /// The replicas.
    pub replicas: Vec<ReplicaSpec>,
    /// Requests each replica takes at once (the proxy's cap).
    pub max_ongoing_requests: usize,
    /// The proxy's queue bound.
    pub max_queued_requests: usize,
    /// The arrival schedule. The first phase is a warm-up whose clients are not measured.
    pub phases: Vec<Phase>,
    /// Stop this replica at this time from the start, if set.
    pub stop_replica: Option<(usize, Duration)>,
}

impl Scenario {
    /// Requests per second the replicas complete when all are busy.
    pub fn capacity(&self) -> f64 {
        self.replicas
            .iter()
            .map(|r| self.max_ongoing_requests as f64 / r.mean_service_time().as_secs_f64())
            .sum()
    }

    /// Length of the warm-up phase.
    pub fn warm_up(&self) -> Duration {
        Duration::from_secs_f64(self.phases[0].seconds)
    }

    /// Length of the whole schedule.
    pub fn length(&self) -> Duration {
        Duration::from_secs_f64(self.phases.iter().map(|p| p.seconds).sum())
    }
}

/// The five scenarios. `seconds` is the length of the measured part of each (the warm-up is
/// 5 s more); rates are set as multiples of each scenario's capacity.
pub fn scenarios(seconds: f64) -> Vec<Scenario> {
    let exponential = ReplicaSpec {
        service_time: ServiceTime::Exponential(Duration::from_millis(100)),
        slowdown: 1.0,
        chunks: 0,
    };
    let heavy = |slowdown| ReplicaSpec {
        service_time: ServiceTime::HeavyTailed {
            median: Duration::from_millis(80),
            sigma: 0.8,
        },
        slowdown,
        chunks: 0,
    };
    let streaming = ReplicaSpec {
        service_time: ServiceTime::Fixed(Duration::from_secs(3)),
        slowdown: 1.0,
        chunks: 15,
    };
    let with_rates = |mut s: Scenario, multiples: &[(f64, f64)]| {
        let capacity = s.capacity();
        s.phases = std::iter::once(Phase {
            seconds: 5.0,
            rate: 0.5 * capacity,
        })
        .chain(multiples.iter().map(|&(share, multiple)| Phase {
            seconds: share * seconds,
            rate: multiple * capacity,
        }))
        .collect();
        s
    };
    let base = |name, title, replicas: Vec<ReplicaSpec>, max_ongoing| Scenario {
        name,
        title,
        replicas,
        max_ongoing_requests: max_ongoing,
        max_queued_requests: 32,
        phases: Vec::new(),
        stop_replica: None,
    };
    vec![
        with_rates(
            base(
                "steady-overload",
                "steady overload at 1.5× capacity; 4 replicas, exponential service times (mean 100 ms)",
                vec![exponential; 4],
                4,
            ),
            &[(1.0, 1.5)],
        ),
        with_rates(
            base(
                "mixed-speed",
                "mixed hardware: 2 replicas at 1×, 2 at 3× slower, heavy-tailed service times; 1.5× capacity",
                vec![heavy(1.0), heavy(1.0), heavy(3.0), heavy(3.0)],
                4,
            ),
            &[(1.0, 1.5)],
        ),
        with_rates(
            base(
                "burst-then-drain",
                "0.8× capacity, a 5× burst for a fifth of the run, then 0.5× while it drains",
                vec![exponential; 4],
                4,
            ),
            &[(0.3, 0.8), (0.2, 5.0), (0.5, 0.5)],
        ),
        {
            let mut s = with_rates(
                base(
                    "replica-lost",
                    "1.2× capacity; one of 4 replicas stops for good a third of the way in",
                    vec![exponential; 4],
                    4,
                ),
                &[(1.0, 1.2)],
            );
            s.stop_replica = Some((0, Duration::from_secs_f64(5.0 + seconds / 3.0)));
            s
        },
        with_rates(
            base(
                "streaming",
                "long streamed responses (3 s in 15 chunks, like token streaming); 1.5× capacity",
                vec![streaming; 4],
                8,
            ),
            &[(1.0, 1.5)],
        ),
    ]
}
