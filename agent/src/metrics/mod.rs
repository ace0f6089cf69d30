//! Prometheus metrics, and the small HTTP endpoint that serves them.
//!
//! Names follow Prometheus conventions (`retry_after_` prefix, base units, `_total` on
//! counters). docs/metrics.md lists every series. Kernel counters are monotonic per watch; they
//! are exported as counters advanced by the difference since the last tick.

mod http;
mod series;
mod weighted;

pub use self::http::{MAX_CONNECTIONS as MAX_HTTP_CONNECTIONS, serve};

use std::{collections::HashMap, net::SocketAddr, time::Duration};

use prometheus::{Encoder, Registry, TextEncoder};
use retry_after_common::{EndpointCounter, EndpointCounters};
use tokio::net::TcpListener;

use self::series::{AnswerSeries, KernelSeries, Series, ServiceSeries, SocketSeries};

pub use self::weighted::WeightedHistogramVec;
use retry_after_estimator::{
    snapshot::Snapshot,
    {
        Answer, Estimator, FallbackReason, JudgeStats, QueueDepthSource, Rung, ServiceEstimator,
        Signals,
    },
};
use retry_after_protocol::{ErrorCode, Report};

/// Every metric of the agent.
pub struct Metrics {
    registry: Registry,
    kernel: KernelSeries,
    service: ServiceSeries,
    answers: AnswerSeries,
    socket: SocketSeries,
    last_counters: std::sync::Mutex<HashMap<(String, &'static str), EndpointCounters>>,
    last_judge_dropped: std::sync::Mutex<HashMap<String, u64>>,
    last_returns_dropped: std::sync::Mutex<HashMap<String, u64>>,
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
        let series = Series(&registry);
        Self {
            kernel: KernelSeries::new(&series),
            service: ServiceSeries::new(&series),
            answers: AnswerSeries::new(&series),
            socket: SocketSeries::new(&series),
            registry,
            last_counters: std::sync::Mutex::new(HashMap::new()),
            last_judge_dropped: std::sync::Mutex::new(HashMap::new()),
            last_returns_dropped: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// Record which kernel features the programs found at start (name, present).
    pub fn record_kernel_features<'a>(&self, features: impl IntoIterator<Item = (&'a str, bool)>) {
        for (feature, present) in features {
            self.kernel
                .kernel_feature
                .with_label_values(&[feature])
                .set(i64::from(present));
        }
    }

    /// Record a tick: the snapshot, the estimates and judges after it, and how long it took.
    pub fn record_tick(&self, snapshot: &Snapshot, estimator: &Estimator, took: Duration) {
        self.kernel.ticks.inc();
        self.kernel.tick_duration.observe(took.as_secs_f64());
        self.record_endpoints(snapshot);
        for (stat, value) in snapshot.probe.iter() {
            self.kernel
                .probe_problems
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
            for (counter, metric) in EndpointCounter::ALL
                .iter()
                .zip(&self.kernel.endpoint_counters)
            {
                let (now, before) = (e.counters.get(*counter), last.get(*counter));
                // A watch added anew starts from zero: so does its series.
                metric
                    .with_label_values(&[endpoint.as_str(), side])
                    .inc_by(now.saturating_sub(before));
            }
            self.kernel
                .endpoint_in_flight
                .with_label_values(&[endpoint.as_str(), side])
                .set(e.in_flight() as i64);
            let labels = [endpoint.as_str(), side];
            let (waiting, streaming) = (e.counters.waiting(), e.counters.streaming());
            self.kernel
                .endpoint_waiting
                .with_label_values(&labels)
                .set(waiting as i64);
            self.kernel
                .endpoint_streaming
                .with_label_values(&labels)
                .set(streaming as i64);
            if let Some(backlog) = e.accept_backlog {
                self.kernel
                    .endpoint_accept_backlog
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
        self.service
            .saturation_factor
            .with_label_values(&[name])
            .set(constants.saturation_factor(signals.occupancy, 0));
        self.service
            .drain_rate
            .with_label_values(&[name])
            .set(service.drain_rate_ewma());
        self.record_judge(name, service.judge());
        for outcome in ["admitted", "rejected"] {
            self.answers
                .proxy_requests
                .with_label_values(&[name, outcome]);
            self.answers
                .proxy_retries
                .with_label_values(&[name, outcome]);
        }
        self.record_schedule(name, &signals, service.returns_dropped());
    }

    /// The signals of a service's own answer, and why it is not computed.
    fn record_signals(&self, name: &str, signals: &Signals, own_reason: Option<FallbackReason>) {
        self.service
            .drain_rate_warm
            .with_label_values(&[name])
            .set(i64::from(signals.drain_rate.is_some()));
        match signals.queue_depth {
            Some(queue) => self
                .service
                .queue_depth
                .with_label_values(&[name])
                .set(queue.depth as i64),
            None => {
                let _ = self.service.queue_depth.remove_label_values(&[name]);
            }
        }
        let source = signals.queue_depth.map(|q| q.source);
        for candidate in QueueDepthSource::ALL {
            self.service
                .queue_depth_source
                .with_label_values(&[name, candidate.as_str()])
                .set(i64::from(source == Some(*candidate)));
        }
        self.service
            .queue_depth_source
            .with_label_values(&[name, "none"])
            .set(i64::from(source.is_none()));
        for reason in FallbackReason::ALL {
            self.service
                .fallback_reason
                .with_label_values(&[name, reason.as_str()])
                .set(i64::from(own_reason == Some(*reason)));
            self.answers
                .fallbacks
                .with_label_values(&[name, reason.as_str()]);
        }
        match signals.occupancy {
            Some(occupancy) => self
                .service
                .occupancy
                .with_label_values(&[name])
                .set(occupancy),
            None => {
                let _ = self.service.occupancy.remove_label_values(&[name]);
            }
        }
    }

    /// What a service's judge has settled so far.
    fn record_judge(&self, name: &str, judge: &JudgeStats) {
        for rung in Rung::ALL {
            self.answers.rung.with_label_values(&[name, rung.as_str()]);
            let Some(stats) = judge.rung(*rung) else {
                continue;
            };
            let labels = [name, rung.as_str()];
            self.answers.suggested_delay.touch(&labels);
            self.answers.judge_observed_over_suggested.set(
                &labels,
                &stats.ratio_counts,
                stats.ratio_sum,
            );
            if let Some(share) = stats.admitted_share() {
                self.answers
                    .judge_admitted_ratio
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
        self.answers
            .judge_dropped
            .with_label_values(&[name])
            .inc_by(judge.dropped.saturating_sub(before));
    }

    /// The schedule of promised returns and the fresh arrivals of one service.
    fn record_schedule(&self, name: &str, signals: &Signals, dropped: u64) {
        match signals.arrival_rate {
            Some(rate) => self
                .service
                .arrival_rate
                .with_label_values(&[name])
                .set(rate),
            None => {
                let _ = self.service.arrival_rate.remove_label_values(&[name]);
            }
        }
        self.service
            .returns_promised
            .with_label_values(&[name])
            .set(i64::try_from(signals.promised.total()).unwrap_or(i64::MAX));
        let before = self
            .last_returns_dropped
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(name.to_owned(), dropped)
            .unwrap_or(0);
        self.service
            .returns_dropped
            .with_label_values(&[name])
            .inc_by(dropped.saturating_sub(before));
    }

    /// Record answers given for a service: one per query, or the rejections of a report.
    pub fn record_answers(&self, service: &str, answer: &Answer, weight: u64) {
        let rung = answer.rung.as_str();
        self.answers
            .rung
            .with_label_values(&[service, rung])
            .inc_by(weight);
        if let Some(reason) = answer.reason {
            self.answers
                .fallbacks
                .with_label_values(&[service, reason.as_str()])
                .inc_by(weight);
        }
        if let Some(seconds) = answer.seconds {
            self.answers
                .suggested_delay
                .observe(&[service, rung], seconds as f64, weight);
        }
    }

    /// Record how long a QUERY took to answer.
    pub fn record_query_duration(&self, took: Duration) {
        self.socket.query_duration.observe(took.as_secs_f64());
    }

    /// Record what a proxy reported it did.
    pub fn record_report(&self, report: &Report<'_>) {
        let service = report.service;
        for (outcome, requests, retries) in [
            ("admitted", report.admitted, report.retry_admitted),
            ("rejected", report.rejected, report.retry_rejected),
        ] {
            self.answers
                .proxy_requests
                .with_label_values(&[service, outcome])
                .inc_by(requests);
            self.answers
                .proxy_retries
                .with_label_values(&[service, outcome])
                .inc_by(retries.unwrap_or(0));
        }
        for (outcome, count) in report.tickets() {
            self.answers
                .tickets
                .with_label_values(&[service, outcome.as_str()])
                .inc_by(count);
        }
    }

    /// Count a request by command.
    pub fn record_request(&self, command: &str) {
        self.socket.queries.with_label_values(&[command]).inc();
    }

    /// Count an error line.
    pub fn record_error(&self, code: ErrorCode) {
        self.socket
            .query_errors
            .with_label_values(&[code.as_str()])
            .inc();
    }

    /// Count a metrics connection refused at the connection limit.
    pub fn record_http_refused(&self) {
        self.socket.http_refused.inc();
    }

    /// Count a failed kernel read in a tick (`backlogs` or `counters`).
    pub fn record_tick_error(&self, kind: &str) {
        self.kernel.tick_errors.with_label_values(&[kind]).inc();
    }

    /// Count a connection ended by its write deadline.
    pub fn record_write_timeout(&self) {
        self.socket.socket_write_timeouts.inc();
    }

    /// Set the number of open socket connections.
    pub fn set_connections(&self, connections: usize) {
        self.socket.socket_connections.set(connections as i64);
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
