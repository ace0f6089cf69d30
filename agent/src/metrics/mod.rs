//! Prometheus metrics, and the small HTTP endpoint that serves them.
//!
//! Names follow Prometheus conventions (`retry_after_` prefix, base units, `_total` on
//! counters). docs/metrics.md lists every series. Kernel counters are monotonic per watch; they
//! are exported as counters advanced by the difference since the last tick.

mod http;
mod weighted;

pub use self::http::{MAX_CONNECTIONS as MAX_HTTP_CONNECTIONS, serve};

use std::{collections::HashMap, net::SocketAddr, time::Duration};

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};
use retry_after_common::{EndpointCounter, EndpointCounters};
use tokio::net::TcpListener;

pub use self::weighted::WeightedHistogramVec;
use retry_after_estimator::{
    snapshot::Snapshot,
    {
        Answer, Estimator, FallbackReason, JudgeStats, QueueDepthSource, RATIO_BUCKETS, Rung,
        ServiceEstimator, Signals,
    },
};
use retry_after_protocol::{ErrorCode, Report};

/// Every metric of the agent.
pub struct Metrics {
    registry: Registry,
    /// One per [`EndpointCounter`], in its order.
    endpoint_counters: [IntCounterVec; EndpointCounter::ALL.len()],
    endpoint_in_flight: IntGaugeVec,
    endpoint_accept_backlog: IntGaugeVec,
    probe_problems: IntGaugeVec,
    kernel_feature: IntGaugeVec,
    drain_rate: GaugeVec,
    drain_rate_warm: IntGaugeVec,
    queue_depth: IntGaugeVec,
    queue_depth_source: IntGaugeVec,
    occupancy: GaugeVec,
    saturation_factor: GaugeVec,
    fallback_reason: IntGaugeVec,
    suggested_delay: WeightedHistogramVec,
    rung: IntCounterVec,
    fallbacks: IntCounterVec,
    judge_admitted_ratio: GaugeVec,
    judge_observed_over_suggested: WeightedHistogramVec,
    judge_dropped: IntCounterVec,
    arrival_rate: GaugeVec,
    returns_promised: IntGaugeVec,
    returns_dropped: IntCounterVec,
    proxy_requests: IntCounterVec,
    proxy_retries: IntCounterVec,
    socket_connections: IntGauge,
    socket_write_timeouts: IntCounter,
    http_refused: IntCounter,
    tick_errors: IntCounterVec,
    queries: IntCounterVec,
    query_errors: IntCounterVec,
    query_duration: Histogram,
    tick_duration: Histogram,
    ticks: IntCounter,
    last_counters: std::sync::Mutex<HashMap<(String, &'static str), EndpointCounters>>,
    last_judge_dropped: std::sync::Mutex<HashMap<String, u64>>,
    last_returns_dropped: std::sync::Mutex<HashMap<String, u64>>,
}

/// The help text of the metric `retry_after_endpoint_<name>_total` of each endpoint counter.
const fn endpoint_counter_help(counter: EndpointCounter) -> &'static str {
    match counter {
        EndpointCounter::ConnectionsOpened => {
            "Connections accepted (server side) or opened (client side) to the endpoint."
        }
        EndpointCounter::ConnectionsClosed => "Connections to the endpoint that closed.",
        EndpointCounter::RequestsStarted => "Request turns begun on connections to the endpoint.",
        EndpointCounter::ResponsesCompleted => "Request turns whose response completed.",
        EndpointCounter::ResponsesRejected => {
            "Of the completed responses, rejections (status 429 or 503): not counted as drained work."
        }
        EndpointCounter::RequestsAbandoned => {
            "Request turns ended by close before any response byte."
        }
        EndpointCounter::RequestBytes => "Client-to-server payload bytes.",
        EndpointCounter::ResponseBytes => "Server-to-client payload bytes within response turns.",
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// All series, registered, at zero.
    pub fn new() -> Self {
        let registry = Registry::new();
        /// A series made and registered: its name and labels are fixed here, valid and unique,
        /// so neither step can fail at run time.
        fn reg<T: prometheus::core::Collector + Clone + 'static>(
            r: &Registry,
            m: prometheus::Result<T>,
        ) -> T {
            let m = m.expect("a valid metric name and labels");
            r.register(Box::new(m.clone()))
                .expect("unique metric names");
            m
        }
        let endpoint = ["endpoint", "side"];
        let service = ["service"];
        let delay_buckets = vec![1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0, 60.0];
        let service_rung = ["service", "rung"];
        Self {
            endpoint_counters: std::array::from_fn(|i| {
                let counter = EndpointCounter::ALL[i];
                let name = format!("retry_after_endpoint_{}_total", counter.as_str());
                let opts = Opts::new(name, endpoint_counter_help(counter));
                reg(&registry, IntCounterVec::new(opts, &endpoint))
            }),
            endpoint_in_flight: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "retry_after_endpoint_requests_in_flight",
                        "Requests begun and not yet answered or abandoned.",
                    ),
                    &endpoint,
                ),
            ),
            endpoint_accept_backlog: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "retry_after_endpoint_accept_backlog",
                        "Connections waiting in the accept queues of listeners serving the endpoint.",
                    ),
                    &["endpoint"],
                ),
            ),
            probe_problems: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "retry_after_probe_problems",
                        "Things the kernel programs could not observe, since start.",
                    ),
                    &["kind"],
                ),
            ),
            kernel_feature: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "retry_after_kernel_feature",
                        "1 if the running kernel has a feature some programs need, 0 if what needs it is switched off (probed at start).",
                    ),
                    &["feature"],
                ),
            ),
            drain_rate: reg(
                &registry,
                GaugeVec::new(
                    Opts::new(
                        "retry_after_service_drain_rate_per_second",
                        "EWMA of responses completed per second across the service's backends.",
                    ),
                    &service,
                ),
            ),
            drain_rate_warm: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "retry_after_service_drain_rate_warm",
                        "1 when the drain rate is warm enough to compute with.",
                    ),
                    &service,
                ),
            ),
            queue_depth: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "retry_after_service_queue_depth",
                        "Queue depth from the best kernel source in the service's scope, at the last tick (absent while no source can see the queue).",
                    ),
                    &service,
                ),
            ),
            queue_depth_source: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "retry_after_service_queue_depth_source",
                        "1 for the source the queue depth came from at the last tick (\"none\": the queue is invisible).",
                    ),
                    &["service", "source"],
                ),
            ),
            occupancy: reg(
                &registry,
                GaugeVec::new(
                    Opts::new(
                        "retry_after_service_occupancy_ratio",
                        "Requests in flight in the service's scope over fleet capacity (absent when capacity is unknown).",
                    ),
                    &service,
                ),
            ),
            saturation_factor: reg(
                &registry,
                GaugeVec::new(
                    Opts::new(
                        "retry_after_service_saturation_factor",
                        "1 + w1·occupancy (the backoff term depends on each query).",
                    ),
                    &service,
                ),
            ),
            fallback_reason: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "retry_after_service_fallback_reason",
                        "1 for the reason the agent's own answer (no proxy depth) is not computed, at the last tick; all 0 when it is.",
                    ),
                    &["service", "reason"],
                ),
            ),
            suggested_delay: reg(
                &registry,
                Ok(WeightedHistogramVec::new(
                    "retry_after_suggested_delay_seconds",
                    "Retry-After values answered: to queries, and the rejections proxies report (weighted by their count).",
                    &service_rung,
                    delay_buckets,
                )),
            ),
            rung: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "retry_after_ladder_rung_total",
                        "Answers by fallback ladder rung: queries, and reported rejections.",
                    ),
                    &service_rung,
                ),
            ),
            fallbacks: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "retry_after_fallback_total",
                        "Answers that were not computed, by reason: queries, and reported rejections.",
                    ),
                    &["service", "reason"],
                ),
            ),
            judge_admitted_ratio: reg(
                &registry,
                GaugeVec::new(
                    Opts::new(
                        "retry_after_judge_admitted_ratio",
                        "Share of judged answers after which a retry at the suggested time was admitted, from what the proxies reported they did then.",
                    ),
                    &service_rung,
                ),
            ),
            judge_observed_over_suggested: reg(
                &registry,
                Ok(WeightedHistogramVec::new(
                    "retry_after_judge_observed_over_suggested_ratio",
                    "Observed time for the queue of an answer to drain (completions after the answer) over the suggested delay.",
                    &service_rung,
                    RATIO_BUCKETS.to_vec(),
                )),
            ),
            judge_dropped: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "retry_after_judge_dropped_total",
                        "Answers the judge could not follow (too many waiting).",
                    ),
                    &service,
                ),
            ),
            arrival_rate: reg(
                &registry,
                GaugeVec::new(
                    Opts::new(
                        "retry_after_service_arrival_rate_per_second",
                        "Fresh arrivals per second (reported requests less the returns due), absent while no proxy reports.",
                    ),
                    &service,
                ),
            ),
            returns_promised: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "retry_after_service_returns_promised",
                        "Clients told to come back whose time has not come yet (the scheduled_returns schedule).",
                    ),
                    &service,
                ),
            ),
            returns_dropped: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "retry_after_service_returns_dropped_total",
                        "Promised returns the schedule could not hold.",
                    ),
                    &service,
                ),
            ),
            proxy_requests: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "retry_after_proxy_requests_total",
                        "Requests the proxies reported admitting or rejecting.",
                    ),
                    &["service", "outcome"],
                ),
            ),
            proxy_retries: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "retry_after_proxy_retries_total",
                        "Retries after a Retry-After that the proxies reported admitting or rejecting (where they can tell).",
                    ),
                    &["service", "outcome"],
                ),
            ),
            socket_connections: reg(
                &registry,
                IntGauge::new(
                    "retry_after_socket_connections",
                    "Open connections on the proxy socket.",
                ),
            ),
            http_refused: reg(
                &registry,
                IntCounter::new(
                    "retry_after_metrics_connections_refused_total",
                    "Metrics-endpoint connections closed at once because the connection limit was reached.",
                ),
            ),
            tick_errors: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "retry_after_tick_errors_total",
                        "Ticks whose kernel read failed in part (listener backlogs) or whole (counters), by kind.",
                    ),
                    &["kind"],
                ),
            ),
            socket_write_timeouts: reg(
                &registry,
                IntCounter::new(
                    "retry_after_socket_write_timeouts_total",
                    "Proxy-socket connections ended because the peer did not read an answer within agent.client_write_timeout_ms.",
                ),
            ),
            queries: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "retry_after_queries_total",
                        "Requests received on the proxy socket, by command.",
                    ),
                    &["command"],
                ),
            ),
            query_errors: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "retry_after_query_errors_total",
                        "Error lines sent on the proxy socket, by code.",
                    ),
                    &["code"],
                ),
            ),
            query_duration: reg(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "retry_after_query_duration_seconds",
                        "Time to answer a QUERY, from its line read to its answer written.",
                    )
                    .buckets(vec![
                        1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2,
                    ]),
                ),
            ),
            tick_duration: reg(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "retry_after_tick_duration_seconds",
                        "Time to read the kernel counters and update the estimates.",
                    )
                    .buckets(vec![1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2]),
                ),
            ),
            ticks: reg(
                &registry,
                IntCounter::new("retry_after_ticks_total", "Counter reads since start."),
            ),
            registry,
            last_counters: std::sync::Mutex::new(HashMap::new()),
            last_judge_dropped: std::sync::Mutex::new(HashMap::new()),
            last_returns_dropped: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// Record which kernel features the programs found at start (name, present).
    pub fn record_kernel_features<'a>(&self, features: impl IntoIterator<Item = (&'a str, bool)>) {
        for (feature, present) in features {
            self.kernel_feature
                .with_label_values(&[feature])
                .set(i64::from(present));
        }
    }

    /// Record a tick: the snapshot, the estimates and judges after it, and how long it took.
    pub fn record_tick(&self, snapshot: &Snapshot, estimator: &Estimator, took: Duration) {
        self.ticks.inc();
        self.tick_duration.observe(took.as_secs_f64());
        self.record_endpoints(snapshot);
        for (stat, value) in snapshot.probe.iter() {
            self.probe_problems
                .with_label_values(&[stat.as_str()])
                .set(value as i64);
        }
        for (name, service) in estimator.services() {
            self.record_service(name, service);
        }
    }

    /// Every watched endpoint's counters (advanced by their difference since the last tick),
    /// requests in flight and accept backlog.
    fn record_endpoints(&self, snapshot: &Snapshot) {
        let mut last_counters = self
            .last_counters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for e in &snapshot.endpoints {
            let endpoint = e.endpoint.to_string();
            let side = e.side.as_str();
            let last = last_counters
                .insert((endpoint.clone(), side), e.counters)
                .unwrap_or_default();
            for (counter, metric) in EndpointCounter::ALL.iter().zip(&self.endpoint_counters) {
                let (now, before) = (e.counters.get(*counter), last.get(*counter));
                // A watch added anew starts from zero: so does its series.
                metric
                    .with_label_values(&[endpoint.as_str(), side])
                    .inc_by(now.saturating_sub(before));
            }
            self.endpoint_in_flight
                .with_label_values(&[endpoint.as_str(), side])
                .set(e.in_flight() as i64);
            if let Some(backlog) = e.accept_backlog {
                self.endpoint_accept_backlog
                    .with_label_values(&[endpoint.as_str()])
                    .set(i64::from(backlog));
            }
        }
    }

    /// One service's estimate after the tick: its signals, its own answer, its judge.
    fn record_service(&self, name: &str, service: &ServiceEstimator) {
        let own = service.own_answer();
        let signals = own.signals;
        self.record_signals(name, &signals, own.reason);
        let constants = &service.settings().constants;
        self.saturation_factor
            .with_label_values(&[name])
            .set(constants.saturation_factor(signals.occupancy, 0));
        self.drain_rate
            .with_label_values(&[name])
            .set(service.drain_rate_ewma());
        self.record_judge(name, service.judge());
        for outcome in ["admitted", "rejected"] {
            self.proxy_requests.with_label_values(&[name, outcome]);
            self.proxy_retries.with_label_values(&[name, outcome]);
        }
        self.record_schedule(name, &signals, service.returns_dropped());
    }

    /// The signals of a service's own answer, and why it is not computed.
    fn record_signals(&self, name: &str, signals: &Signals, own_reason: Option<FallbackReason>) {
        self.drain_rate_warm
            .with_label_values(&[name])
            .set(i64::from(signals.drain_rate.is_some()));
        match signals.queue_depth {
            Some(queue) => self
                .queue_depth
                .with_label_values(&[name])
                .set(queue.depth as i64),
            None => {
                let _ = self.queue_depth.remove_label_values(&[name]);
            }
        }
        let source = signals.queue_depth.map(|q| q.source);
        for candidate in QueueDepthSource::ALL {
            self.queue_depth_source
                .with_label_values(&[name, candidate.as_str()])
                .set(i64::from(source == Some(*candidate)));
        }
        self.queue_depth_source
            .with_label_values(&[name, "none"])
            .set(i64::from(source.is_none()));
        for reason in FallbackReason::ALL {
            self.fallback_reason
                .with_label_values(&[name, reason.as_str()])
                .set(i64::from(own_reason == Some(*reason)));
            self.fallbacks.with_label_values(&[name, reason.as_str()]);
        }
        match signals.occupancy {
            Some(occupancy) => self.occupancy.with_label_values(&[name]).set(occupancy),
            None => {
                let _ = self.occupancy.remove_label_values(&[name]);
            }
        }
    }

    /// What a service's judge has settled so far.
    fn record_judge(&self, name: &str, judge: &JudgeStats) {
        for rung in Rung::ALL {
            self.rung.with_label_values(&[name, rung.as_str()]);
            let Some(stats) = judge.rung(*rung) else {
                continue;
            };
            let labels = [name, rung.as_str()];
            self.suggested_delay.touch(&labels);
            self.judge_observed_over_suggested
                .set(&labels, &stats.ratio_counts, stats.ratio_sum);
            if let Some(share) = stats.admitted_share() {
                self.judge_admitted_ratio
                    .with_label_values(&labels)
                    .set(share);
            }
        }
        let before = self
            .last_judge_dropped
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(name.to_owned(), judge.dropped)
            .unwrap_or(0);
        self.judge_dropped
            .with_label_values(&[name])
            .inc_by(judge.dropped.saturating_sub(before));
    }

    /// The schedule of promised returns and the fresh arrivals of one service.
    fn record_schedule(&self, name: &str, signals: &Signals, dropped: u64) {
        match signals.arrival_rate {
            Some(rate) => self.arrival_rate.with_label_values(&[name]).set(rate),
            None => {
                let _ = self.arrival_rate.remove_label_values(&[name]);
            }
        }
        self.returns_promised
            .with_label_values(&[name])
            .set(i64::try_from(signals.promised.total()).unwrap_or(i64::MAX));
        let before = self
            .last_returns_dropped
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(name.to_owned(), dropped)
            .unwrap_or(0);
        self.returns_dropped
            .with_label_values(&[name])
            .inc_by(dropped.saturating_sub(before));
    }

    /// Record answers given for a service: one per query, or the rejections of a report.
    pub fn record_answers(&self, service: &str, answer: &Answer, weight: u64) {
        let rung = answer.rung.as_str();
        self.rung.with_label_values(&[service, rung]).inc_by(weight);
        if let Some(reason) = answer.reason {
            self.fallbacks
                .with_label_values(&[service, reason.as_str()])
                .inc_by(weight);
        }
        if let Some(seconds) = answer.seconds {
            self.suggested_delay
                .observe(&[service, rung], seconds as f64, weight);
        }
    }

    /// Record how long a QUERY took to answer.
    pub fn record_query_duration(&self, took: Duration) {
        self.query_duration.observe(took.as_secs_f64());
    }

    /// Record what a proxy reported it did.
    pub fn record_report(&self, report: &Report<'_>) {
        let service = report.service;
        for (outcome, requests, retries) in [
            ("admitted", report.admitted, report.retry_admitted),
            ("rejected", report.rejected, report.retry_rejected),
        ] {
            self.proxy_requests
                .with_label_values(&[service, outcome])
                .inc_by(requests);
            self.proxy_retries
                .with_label_values(&[service, outcome])
                .inc_by(retries.unwrap_or(0));
        }
    }

    /// Count a request by command.
    pub fn record_request(&self, command: &str) {
        self.queries.with_label_values(&[command]).inc();
    }

    /// Count an error line.
    pub fn record_error(&self, code: ErrorCode) {
        self.query_errors.with_label_values(&[code.as_str()]).inc();
    }

    /// Count a metrics connection refused at the connection limit.
    pub fn record_http_refused(&self) {
        self.http_refused.inc();
    }

    /// Count a failed kernel read in a tick (`backlogs` or `counters`).
    pub fn record_tick_error(&self, kind: &str) {
        self.tick_errors.with_label_values(&[kind]).inc();
    }

    /// Count a connection ended by its write deadline.
    pub fn record_write_timeout(&self) {
        self.socket_write_timeouts.inc();
    }

    /// Set the number of open socket connections.
    pub fn set_connections(&self, connections: usize) {
        self.socket_connections.set(connections as i64);
    }

    /// The text exposition of every series.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buffer)
            .expect("text encoding does not fail");
        String::from_utf8(buffer).expect("text exposition is UTF-8")
    }
}

/// Bind the metrics listener.
///
/// # Errors
/// The address cannot be bound.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

#[cfg(test)]
mod tests {
    use retry_after_common::ProbeStat;

    use super::*;
    use crate::kernel::KernelFeature;

    /// docs/metrics.md, as the operators read it.
    fn metrics_doc() -> String {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md");
        std::fs::read_to_string(path).expect("docs/metrics.md")
    }

    /// The first column of the table under `heading`, without its backticks.
    fn first_column(doc: &str, heading: &str) -> Vec<String> {
        let section = doc
            .split_once(heading)
            .unwrap_or_else(|| panic!("docs/metrics.md has no {heading:?}"))
            .1;
        section
            .lines()
            .skip_while(|line| !line.starts_with('|'))
            .take_while(|line| line.starts_with('|'))
            .skip(2)
            .filter_map(|row| row.split('|').nth(1))
            .map(|cell| cell.trim().trim_matches('`').to_owned())
            .collect()
    }

    #[test]
    fn the_metrics_doc_names_every_counter_of_each_vocabulary_and_no_other() {
        let doc = metrics_doc();
        let kinds: Vec<&str> = ProbeStat::ALL.iter().map(|stat| stat.as_str()).collect();
        assert_eq!(first_column(&doc, "### Probe problem kinds"), kinds);
        let per_endpoint = first_column(&doc, "## Per endpoint");
        let documented: Vec<&String> = per_endpoint
            .iter()
            .filter(|series| series.ends_with("_total"))
            .collect();
        let counters: Vec<String> = EndpointCounter::ALL
            .iter()
            .map(|counter| format!("retry_after_endpoint_{}_total", counter.as_str()))
            .collect();
        assert_eq!(documented, counters.iter().collect::<Vec<_>>());
        let features = doc
            .lines()
            .find(|line| line.starts_with("| `retry_after_kernel_feature{feature}`"))
            .expect("the kernel feature row");
        for feature in KernelFeature::ALL {
            let name = feature.name();
            assert!(features.contains(&format!("`{name}`")), "{name}");
        }
    }
}
