//! The estimate: from kernel snapshots to a Retry-After value per service.
//!
//! Pure and deterministic: no I/O, no clock and no randomness of its own. Time arrives as the
//! `Instant` of each snapshot or query, randomness through [`Jitter`]. Nothing here knows of
//! eBPF or sockets; it reads [`Snapshot`]s, which are plain numbers.
//!
//! Per service, each tick: the drain rate EWMA is fed the backends' completed responses
//! ([`drain_rate`]), the judge follows earlier suggestions forward ([`judge`]). Per rejection:
//! the queue depth is taken from the best source ([`queue_depth`]), the policy computes
//! ([`policy`]), and the fallback ladder, jitter and clamp produce the header
//! ([`retry_after`]).

pub mod drain_rate;
pub mod judge;
pub mod policy;
pub mod queue_depth;
pub mod retry_after;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use retry_after_common::Side;

pub use self::{
    drain_rate::DrainRate,
    judge::{Judge, JudgeStats},
    policy::{PolicyConstants, RetryAfterPolicy, Signals},
    queue_depth::{BackendLoad, QueueDepthSource, ServiceLoad},
    retry_after::{Jitter, RetryAfter, Rung},
};
use crate::{
    config::{Config, ServiceConfig},
    endpoint::Endpoint,
    snapshot::Snapshot,
};

/// How long the judge follows a suggestion before calling its queue undrained.
pub const JUDGE_HORIZON: Duration = Duration::from_secs(600);
/// How many distinct suggestions the judge follows at once, per service.
pub const JUDGE_CAPACITY: usize = 4096;

/// What a proxy may tell the agent when it asks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Query {
    /// The proxy's own queue depth for the service, if it knows it.
    pub queue_depth: Option<u64>,
    /// The proxy's current placement backoff streak.
    pub backoff_streak: Option<u32>,
}

/// Everything that shapes one service's estimate, resolved from its configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceSettings {
    /// Service name.
    pub name: String,
    /// The policy.
    pub policy: RetryAfterPolicy,
    /// Its constants.
    pub constants: PolicyConstants,
    /// The static value and fallback.
    pub static_retry_after_s: Option<u64>,
    /// The status code rejections carry.
    pub status_code: u16,
    /// The proxy's queue limit.
    pub max_queued_requests: Option<u64>,
    /// Backends and their `max_ongoing_requests`.
    pub backends: Vec<(Endpoint, Option<u64>)>,
    /// The proxy's listener, if on this node.
    pub frontend: Option<Endpoint>,
    /// The tick interval (a proxy-supplied depth is used by the judge for two of them).
    pub tick_interval: Duration,
}

impl ServiceSettings {
    /// Resolve a validated service configuration.
    pub fn from_config(service: &ServiceConfig, tick_interval: Duration) -> Self {
        let backpressure = &service.backpressure;
        Self {
            name: service.name.clone(),
            policy: backpressure.policy(),
            constants: backpressure.constants(),
            static_retry_after_s: backpressure.retry_after_s,
            status_code: backpressure.status_code,
            max_queued_requests: service.max_queued_requests,
            backends: service
                .backends
                .iter()
                .map(|b| (b.endpoint(), b.max_ongoing_requests))
                .collect(),
            frontend: service.frontend_endpoint(),
            tick_interval,
        }
    }
}

/// The estimate of one service.
#[derive(Clone, Debug)]
pub struct ServiceEstimator {
    settings: ServiceSettings,
    drain: DrainRate,
    judge: Judge,
    load: ServiceLoad,
    proxy_depth: Option<(Instant, u64)>,
}

impl ServiceEstimator {
    /// A cold estimator.
    pub fn new(settings: ServiceSettings) -> Self {
        let c = &settings.constants;
        Self {
            drain: DrainRate::new(
                c.alpha,
                c.warm_after_intervals,
                Duration::from_secs_f64(c.cold_after_s.max(0.0)),
            ),
            judge: Judge::new(settings.max_queued_requests, JUDGE_HORIZON, JUDGE_CAPACITY),
            load: ServiceLoad::default(),
            proxy_depth: None,
            settings,
        }
    }

    /// The settings.
    pub fn settings(&self) -> &ServiceSettings {
        &self.settings
    }

    /// Feed one tick's snapshot. Returns the suggestions the judge settled: (observed /
    /// suggested, count).
    pub fn observe(&mut self, snapshot: &Snapshot) -> Vec<(f64, u64)> {
        let load = self.load_from(snapshot);
        self.observe_load(snapshot.taken_at, load)
    }

    /// What a subscriber needs to answer rejections itself until the next tick: the computed
    /// base (from the agent's queue depth, before jitter and clamp) and the terms to redo it
    /// with the proxy's own depth and streak.
    pub fn push(&self, seq: u64) -> retry_after_protocol::EstimatePush {
        let s = &self.settings;
        let c = &s.constants;
        let signals = self.signals(Query::default());
        let computed = s.policy.compute(&signals, c);
        retry_after_protocol::EstimatePush {
            service: s.name.clone(),
            seq,
            base_ms: computed.map(|c| (c.base_s * 1000.0).round().min(u64::MAX as f64) as u64),
            jitter: c.jitter,
            min_s: c.min_retry_after_s,
            max_s: c.max_retry_after_s,
            static_s: s.static_retry_after_s,
            status_code: s.status_code,
            queue_depth: signals.queue_depth,
            // Only a computing policy lets the proxy compute with its own depth.
            drain_rate: computed.and(signals.drain_rate),
            occupancy_factor: c.occupancy_factor(signals.occupancy),
            backoff_weight: c.backoff_weight,
            backoff_saturation: c.backoff_streak_saturation,
        }
    }

    /// Feed one tick's service load (what [`ServiceEstimator::observe`] derives from a
    /// snapshot). Returns the suggestions the judge settled: (observed / suggested, count).
    pub fn observe_load(&mut self, at: Instant, load: ServiceLoad) -> Vec<(f64, u64)> {
        let completed = load.completed_total();
        self.drain.observe(at, completed, load.in_flight());
        let fresh_proxy_depth = self.proxy_depth.filter(|(when, _)| {
            at.saturating_duration_since(*when) <= self.settings.tick_interval * 2
        });
        let depth = load.queue_depth(fresh_proxy_depth.map(|(_, d)| d)).0;
        self.load = load;
        self.judge.observe(at, depth, completed)
    }

    /// The signals for a rejection now.
    pub fn signals(&self, query: Query) -> Signals {
        let (queue_depth, queue_depth_source) = self.load.queue_depth(query.queue_depth);
        Signals {
            queue_depth,
            queue_depth_source,
            drain_rate: self.drain.rate(),
            occupancy: self.load.occupancy(),
            backoff_streak: query.backoff_streak.unwrap_or(0),
        }
    }

    /// The Retry-After for a rejection at `at`; never fails. The suggestion is recorded for
    /// the judge.
    pub fn estimate(&mut self, at: Instant, query: Query, jitter: &mut impl Jitter) -> RetryAfter {
        if let Some(depth) = query.queue_depth {
            self.proxy_depth = Some((at, depth));
        }
        let s = &self.settings;
        let answer = retry_after::retry_after(
            s.policy,
            &s.constants,
            s.static_retry_after_s,
            self.signals(query),
            jitter,
        );
        if let Some(seconds) = answer.seconds {
            self.judge.record(
                at,
                answer.signals.queue_depth,
                self.load.completed_total(),
                seconds,
            );
        }
        answer
    }

    /// The drain rate EWMA, whether warm or not (for metrics).
    pub fn drain_rate_ewma(&self) -> f64 {
        self.drain.ewma()
    }

    /// The judge's running results.
    pub fn judge(&self) -> &JudgeStats {
        self.judge.stats()
    }

    /// The latest service load.
    pub fn load(&self) -> &ServiceLoad {
        &self.load
    }

    /// Per backend, the vantage point that sees most of its work: the side with more completed
    /// responses (server side on a tie). Completed totals take the larger of the two sides,
    /// which keeps them monotonic even if the preferred side changes.
    fn load_from(&self, snapshot: &Snapshot) -> ServiceLoad {
        let backends = self
            .settings
            .backends
            .iter()
            .map(|(endpoint, max_ongoing_requests)| {
                let server = snapshot.endpoint(endpoint, Side::Server);
                let client = snapshot.endpoint(endpoint, Side::Client);
                let completed = |side: Option<&crate::snapshot::EndpointSnapshot>| {
                    side.map_or(0, |s| s.counters.responses_completed)
                };
                let preferred = if completed(client) > completed(server) {
                    client
                } else {
                    server
                };
                BackendLoad {
                    in_flight: preferred.map_or(0, |s| s.in_flight()),
                    client_in_flight: client.map_or(0, |s| s.in_flight()),
                    completed_total: completed(server).max(completed(client)),
                    max_ongoing_requests: *max_ongoing_requests,
                    accept_backlog: server.and_then(|s| s.accept_backlog).map(u64::from),
                }
            })
            .collect();
        let frontend_in_flight = self.settings.frontend.map(|frontend| {
            snapshot
                .endpoint(&frontend, Side::Server)
                .map_or(0, |s| s.in_flight())
        });
        ServiceLoad {
            backends,
            frontend_in_flight,
        }
    }
}

/// The estimators of every configured service.
#[derive(Clone, Debug)]
pub struct Estimator {
    services: BTreeMap<String, ServiceEstimator>,
}

impl Estimator {
    /// One cold estimator per configured service.
    pub fn from_config(config: &Config) -> Self {
        let tick = config.agent.tick_interval();
        Self {
            services: config
                .services
                .iter()
                .map(|s| {
                    (
                        s.name.clone(),
                        ServiceEstimator::new(ServiceSettings::from_config(s, tick)),
                    )
                })
                .collect(),
        }
    }

    /// Feed one tick's snapshot to every service. Returns, per service, the suggestions its
    /// judge settled: (observed / suggested, count).
    pub fn observe(&mut self, snapshot: &Snapshot) -> Vec<(String, Vec<(f64, u64)>)> {
        self.services
            .iter_mut()
            .map(|(name, service)| (name.clone(), service.observe(snapshot)))
            .collect()
    }

    /// One service's estimator.
    pub fn service(&self, name: &str) -> Option<&ServiceEstimator> {
        self.services.get(name)
    }

    /// One service's estimator, to estimate with.
    pub fn service_mut(&mut self, name: &str) -> Option<&mut ServiceEstimator> {
        self.services.get_mut(name)
    }

    /// Every service, by name.
    pub fn services(&self) -> impl Iterator<Item = (&str, &ServiceEstimator)> {
        self.services.iter().map(|(name, s)| (name.as_str(), s))
    }
}
