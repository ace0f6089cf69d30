//! The estimate: from kernel snapshots to a Retry-After value per service, and the
//! configuration it runs with ([`config`]).
//!
//! Pure and deterministic: no I/O, no clock and no randomness of its own (the one read is
//! [`config::Config::from_file`]'s of the configuration file). This crate depends on neither aya nor
//! tokio and has no build script, so the compiler holds that; the daemon (`retry-after-agent`),
//! the simulator, the fuzzers and the benchmark use it alike. Time arrives as the
//! `Instant` of each snapshot or query, the jitter as a uniform draw. Nothing here knows of
//! eBPF or sockets; it reads [`Snapshot`]s, which are plain numbers. The formula, the ladder
//! and the rounding are the `retry-after-policy` crate's, shared with the client library.
//!
//! Per service, each tick: the load is read in the service's scope ([`load`]: the proxy's own
//! queue over this node's client-side completions, or the replicas' queue over their
//! server-side completions), the drain-rate EWMA is fed ([`drain_rate`]) and the judge follows
//! earlier answers forward ([`judge`]). Per rejection: the signals are gathered and the
//! policy's ladder answers.

pub mod arrivals;
pub mod config;
pub mod drain_rate;
pub mod endpoint;
pub mod judge;
pub mod load;
pub mod returns;
pub mod snapshot;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use retry_after_common::Side;
pub use retry_after_policy::{
    Answer, FallbackReason, PolicyConstants, QueueDepth, QueueDepthSource, RetryAfterPolicy, Rung,
    Signals,
};
use retry_after_protocol::{EstimatePush, Report, StatusResponse};

pub use self::{
    drain_rate::{DrainRate, DrainRateConstants},
    judge::{Judge, JudgeStats, RATIO_BUCKETS, RungStats, Settled},
    load::{BackendLoad, RejectedAt, ReplicaQueue, ServiceLoad, SideLoad},
    returns::Returns,
};
use crate::{endpoint::Endpoint, snapshot::Snapshot};

/// How long the judge follows an answer before calling its queue undrained.
pub const JUDGE_HORIZON: Duration = Duration::from_secs(600);
/// How many answer groups the judge follows at once, per service. Answers are grouped per
/// tick by rung, value and depth, so this holds 10,000 rejections a second with room to spare.
pub const JUDGE_CAPACITY: usize = 16_384;

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
    /// Where its requests are queued and rejected.
    pub rejected_at: RejectedAt,
    /// How the queue inside its replicas is read.
    pub replica_queue: ReplicaQueue,
    /// The policy.
    pub policy: RetryAfterPolicy,
    /// The formula's constants.
    pub constants: PolicyConstants,
    /// The drain-rate EWMA's constants.
    pub drain: DrainRateConstants,
    /// The static value and fallback.
    pub retry_after_s: Option<u64>,
    /// The status code rejections carry.
    pub status_code: u16,
    /// Backends and their `max_ongoing_requests`.
    pub backends: Vec<(Endpoint, Option<u64>)>,
    /// The proxy's listener, if on this node.
    pub frontend: Option<Endpoint>,
}

impl ServiceSettings {
    /// True if no kernel source can see this service's queue: only a depth passed by the
    /// proxy lets it compute (`check` warns about such a service).
    pub fn queue_needs_proxy_depth(&self) -> bool {
        // The load's own rule, asked of an idle service with this shape.
        let idle = ServiceLoad {
            rejected_at: self.rejected_at,
            replica_queue: self.replica_queue,
            backends: self
                .backends
                .iter()
                .map(|(_, max_ongoing_requests)| BackendLoad {
                    max_ongoing_requests: *max_ongoing_requests,
                    ..BackendLoad::default()
                })
                .collect(),
            frontend_in_flight: self.frontend.map(|_| 0),
        };
        idle.queue_depth(None).is_none()
    }
}

/// The estimate of one service.
#[derive(Clone, Debug)]
pub struct ServiceEstimator {
    settings: ServiceSettings,
    drain: DrainRate,
    judge: Judge,
    load: ServiceLoad,
    returns: Returns,
    /// The latest instant seen (a tick, a query or a report): the "now" of the schedule.
    now: Option<Instant>,
}

impl ServiceEstimator {
    /// A cold estimator.
    pub fn new(settings: ServiceSettings) -> Self {
        Self {
            drain: DrainRate::new(settings.drain),
            judge: Judge::new(JUDGE_HORIZON, JUDGE_CAPACITY),
            load: ServiceLoad {
                rejected_at: settings.rejected_at,
                replica_queue: settings.replica_queue,
                ..ServiceLoad::default()
            },
            returns: Returns::default(),
            now: None,
            settings,
        }
    }

    /// The settings.
    pub fn settings(&self) -> &ServiceSettings {
        &self.settings
    }

    /// Feed one tick's snapshot. Returns the answer groups the judge settled.
    pub fn observe(&mut self, snapshot: &Snapshot) -> Vec<Settled> {
        let load = self.load_from(snapshot);
        self.observe_load(snapshot.taken_at, load)
    }

    /// Feed one tick's service load (what [`ServiceEstimator::observe`] derives from a
    /// snapshot). Returns the answer groups the judge settled.
    pub fn observe_load(&mut self, at: Instant, load: ServiceLoad) -> Vec<Settled> {
        let completed = load.completed_total();
        self.drain.observe(at, completed, load.in_flight());
        self.returns.tick(at, self.drain.rate());
        self.advance(at);
        self.load = load;
        self.judge.observe(at, completed)
    }

    /// The signals for a rejection now.
    pub fn signals(&self, query: Query) -> Signals {
        Signals {
            queue_depth: self.load.queue_depth(query.queue_depth),
            drain_rate: self.drain.rate(),
            occupancy: self.load.occupancy(),
            backoff_streak: query.backoff_streak.unwrap_or(0),
            arrival_rate: self.now.and_then(|now| self.returns.arrival_rate(now)),
            promised: self
                .now
                .map_or_else(Default::default, |now| self.returns.ahead(now)),
            overload_age_s: self.now.and_then(|now| self.returns.overload_age_s(now)),
        }
    }

    /// The ladder's answer for `query` with `jitter_draw`, without recording it.
    pub fn answer(&self, query: Query, jitter_draw: f64) -> Answer {
        let s = &self.settings;
        retry_after_policy::answer(
            s.policy,
            &s.constants,
            s.retry_after_s,
            self.signals(query),
            jitter_draw,
        )
    }

    /// The agent's own answer now: its own view of the queue, no streak, no jitter (what
    /// pushes, metrics and logs describe). Recorded nowhere.
    pub fn own_answer(&self) -> Answer {
        self.answer(Query::default(), 0.5)
    }

    /// The Retry-After for a rejection at `at` (`jitter_draw`: a uniform draw from [0, 1) for the
    /// jitter), as [`ServiceEstimator::answer`], then recorded: for the judge, and as a
    /// promised return in the schedule. Never fails.
    pub fn answer_and_record(&mut self, at: Instant, query: Query, jitter_draw: f64) -> Answer {
        self.advance(at);
        let answer = self.answer(query, jitter_draw);
        self.judge_answer(at, &answer, 1);
        if let Some(seconds) = answer.seconds {
            self.returns.promise(at, seconds, 1);
        }
        answer
    }

    /// Move the schedule's present to `at`, if later.
    fn advance(&mut self, at: Instant) {
        if self.now.is_none_or(|now| at > now) {
            self.now = Some(at);
        }
    }

    /// A proxy's report of what it did since `from` (`None`: since a time the agent does not
    /// know, as for the first report on a connection, which may carry what an earlier
    /// connection could not send): its admissions and rejections are the evidence of what a
    /// retry met, and its rejections are judged as answers. Where the
    /// report says which values it handed out (`handed_out`), those are judged, whatever the
    /// proxy computed them from; otherwise the answer it would have computed from the
    /// subscription (its depth and streak, without jitter). Returns that answer.
    pub fn report(&mut self, from: Option<Instant>, at: Instant, report: &Report<'_>) -> Answer {
        self.advance(at);
        self.schedule_reported(from, at, report);
        let answer = self.answer(
            Query {
                queue_depth: report.queue_depth,
                backoff_streak: report.backoff_streak,
            },
            0.5,
        );
        if report.handed_out.is_some() {
            if let Some(queue) = answer.signals.queue_depth {
                for h in report.handed_out() {
                    self.judge
                        .record(at, h.rung, h.seconds, queue.depth, h.count);
                }
            }
        } else {
            self.judge_answer(at, &answer, report.rejected);
        }
        // What a retry met: the proxy's retries where it tells them apart and had some in
        // the interval, else all its requests.
        let (admitted, rejected) = match (report.retry_admitted, report.retry_rejected) {
            (Some(a), Some(r)) if a + r > 0 => (a, r),
            _ => (report.admitted, report.rejected),
        };
        self.judge
            .report_outcome(from.unwrap_or(at), at, admitted, rejected);
        answer
    }

    /// A report's requests are arrivals (its retries, where it tells them, returns among
    /// them), and the values it handed out are returns due, counted from the middle of the
    /// interval they were handed out in.
    fn schedule_reported(&mut self, from: Option<Instant>, at: Instant, report: &Report<'_>) {
        let retries = match (report.retry_admitted, report.retry_rejected) {
            (Some(a), Some(r)) => Some(a.saturating_add(r)),
            _ => None,
        };
        self.returns.reported(
            from,
            at,
            report.admitted.saturating_add(report.rejected),
            retries,
        );
        let handed_out_at = from.map_or(at, |from| from + at.saturating_duration_since(from) / 2);
        for h in report.handed_out() {
            self.returns.promise(handed_out_at, h.seconds, h.count);
        }
    }

    fn judge_answer(&mut self, at: Instant, answer: &Answer, weight: u64) {
        if let (Some(seconds), Some(queue)) = (answer.seconds, answer.signals.queue_depth) {
            self.judge
                .record(at, answer.rung, seconds, queue.depth, weight);
        }
    }

    /// What a subscriber needs to answer rejections itself until the next tick: the agent's
    /// signals and the policy's constants (see [`EstimatePush::answer`]).
    pub fn push(&self, seq: u64) -> EstimatePush {
        let s = &self.settings;
        let own = self.own_answer();
        EstimatePush {
            service: s.name.clone(),
            seq,
            retry_after_policy: s.policy,
            status_code: s.status_code,
            retry_after_s: s.retry_after_s,
            queue_depth: own.signals.queue_depth,
            drain_rate: own.signals.drain_rate,
            occupancy: own.signals.occupancy,
            arrival_rate: own.signals.arrival_rate,
            returns: own.signals.promised,
            overload_age_s: own.signals.overload_age_s,
            constants: s.constants,
            base_ms: own
                .computed
                .map(|c| (c.base_s * 1000.0).round().min(u64::MAX as f64) as u64),
            reason: own.reason,
        }
    }

    /// Its numbers for people (`STATUS`): the agent's own answer now, the signals, the returns
    /// promised and the judge's admitted share over both rungs; `next` names the service
    /// after it. Recorded nowhere.
    pub fn status(&self, next: Option<String>) -> StatusResponse {
        let own = self.own_answer();
        let judge = self.judge();
        let judged = [&judge.computed, &judge.static_];
        let admission_judged: u64 = judged.iter().map(|r| r.admission_judged).sum();
        let admitted: f64 = judged.iter().map(|r| r.admitted).sum();
        StatusResponse {
            service: self.settings.name.clone(),
            retry_after_policy: self.settings.policy,
            seconds: own.seconds,
            millis: own.millis,
            rung: own.rung,
            reason: own.reason,
            queue_depth: own.signals.queue_depth,
            drain_rate: own.signals.drain_rate,
            arrival_rate: own.signals.arrival_rate,
            returns_promised: own.signals.promised.total(),
            admission_judged,
            admitted_share: (admission_judged > 0).then(|| admitted / admission_judged as f64),
            next,
        }
    }

    /// The drain rate EWMA, whether warm or not (for metrics).
    pub fn drain_rate_ewma(&self) -> f64 {
        self.drain.ewma()
    }

    /// Promised returns that did not fit the schedule, since start (for metrics).
    pub fn returns_dropped(&self) -> u64 {
        self.returns.dropped()
    }

    /// The judge's running results.
    pub fn judge(&self) -> &JudgeStats {
        self.judge.stats()
    }

    /// Answer groups the judge is following now.
    pub fn judge_pending(&self) -> usize {
        self.judge.pending()
    }

    /// The latest service load.
    pub fn load(&self) -> &ServiceLoad {
        &self.load
    }

    /// Both vantage points of every backend, and the frontend, from a snapshot.
    fn load_from(&self, snapshot: &Snapshot) -> ServiceLoad {
        let side = |endpoint: &Endpoint, side: Side| {
            snapshot
                .endpoint(endpoint, side)
                .map_or(SideLoad::default(), |s| SideLoad {
                    in_flight: s.in_flight(),
                    waiting: s.counters.waiting(),
                    completed_total: s.counters.responses_served(),
                })
        };
        ServiceLoad {
            rejected_at: self.settings.rejected_at,
            replica_queue: self.settings.replica_queue,
            backends: self
                .settings
                .backends
                .iter()
                .map(|(endpoint, max_ongoing_requests)| BackendLoad {
                    client: side(endpoint, Side::Client),
                    server: side(endpoint, Side::Server),
                    max_ongoing_requests: *max_ongoing_requests,
                })
                .collect(),
            frontend_in_flight: self
                .settings
                .frontend
                .map(|frontend| side(&frontend, Side::Server).in_flight),
        }
    }
}

/// The estimators of every configured service.
#[derive(Clone, Debug)]
pub struct Estimator {
    services: BTreeMap<String, ServiceEstimator>,
}

impl Estimator {
    /// One cold estimator per service (see `Config::estimator`).
    pub fn new(services: impl IntoIterator<Item = ServiceSettings>) -> Self {
        Self {
            services: services
                .into_iter()
                .map(|settings| (settings.name.clone(), ServiceEstimator::new(settings)))
                .collect(),
        }
    }

    /// Feed one tick's snapshot to every service. Returns, per service, the answer groups its
    /// judge settled.
    pub fn observe(&mut self, snapshot: &Snapshot) -> Vec<(String, Vec<Settled>)> {
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

    /// `STATUS` for `name` (`None`: the first service, by name), naming the service after it;
    /// `None` if there is no such service.
    pub fn status(&self, name: Option<&str>) -> Option<StatusResponse> {
        use std::ops::Bound::{Included, Unbounded};
        let start = name.map_or(Unbounded, Included);
        let mut from = self.services.range::<str, _>((start, Unbounded));
        let (found, service) = from.next()?;
        if name.is_some_and(|n| n != found) {
            return None;
        }
        Some(service.status(from.next().map(|(next, _)| next.clone())))
    }
}
