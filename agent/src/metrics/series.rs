//! The agent's series, in four groups, each made and registered by [`Series`].

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};
use retry_after_common::EndpointCounter;
use retry_after_estimator::RATIO_BUCKETS;

use super::WeightedHistogramVec;

/// Labels of the per-endpoint series.
const ENDPOINT: [&str; 2] = ["endpoint", "side"];
/// Label of the per-service series.
const SERVICE: [&str; 1] = ["service"];
/// Labels of the per-service, per-rung series.
const SERVICE_RUNG: [&str; 2] = ["service", "rung"];
/// Buckets of the suggested delays, in seconds.
const DELAY_BUCKETS: [f64; 9] = [1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0, 60.0];

/// Makes series and registers them. Every name, help and label here is fixed, valid and unique,
/// so neither step can fail at run time.
pub(super) struct Series<'a>(pub(super) &'a Registry);

impl Series<'_> {
    fn register<T: prometheus::core::Collector + Clone + 'static>(
        &self,
        made: prometheus::Result<T>,
    ) -> T {
        let series = made.expect("a valid metric name and labels");
        self.0
            .register(Box::new(series.clone()))
            .expect("unique metric names");
        series
    }

    fn int_gauges(&self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.register(IntGaugeVec::new(Opts::new(name, help), labels))
    }

    fn gauges(&self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        self.register(GaugeVec::new(Opts::new(name, help), labels))
    }

    fn counters(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.register(IntCounterVec::new(Opts::new(name, help), labels))
    }

    fn int_gauge(&self, name: &str, help: &str) -> IntGauge {
        self.register(IntGauge::new(name, help))
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.register(IntCounter::new(name, help))
    }

    fn histogram(&self, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
        self.register(Histogram::with_opts(
            HistogramOpts::new(name, help).buckets(buckets),
        ))
    }

    fn weighted(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        buckets: Vec<f64>,
    ) -> WeightedHistogramVec {
        self.register(Ok(WeightedHistogramVec::new(name, help, labels, buckets)))
    }
}

/// What the kernel programs saw: per endpoint, and of the probe and its ticks.
pub(super) struct KernelSeries {
    /// One per [`EndpointCounter`], in its order.
    pub(super) endpoint_counters: [IntCounterVec; EndpointCounter::ALL.len()],
    pub(super) endpoint_in_flight: IntGaugeVec,
    /// The requests in flight by phase: waiting for their first body byte, streaming.
    pub(super) endpoint_waiting: IntGaugeVec,
    pub(super) endpoint_streaming: IntGaugeVec,
    pub(super) endpoint_accept_backlog: IntGaugeVec,
    pub(super) probe_problems: IntGaugeVec,
    pub(super) kernel_feature: IntGaugeVec,
    pub(super) tick_errors: IntCounterVec,
    pub(super) tick_duration: Histogram,
    pub(super) ticks: IntCounter,
}

impl KernelSeries {
    pub(super) fn new(s: &Series) -> Self {
        Self {
            endpoint_counters: std::array::from_fn(|i| {
                let counter = EndpointCounter::ALL[i];
                let name = format!("retry_after_endpoint_{}_total", counter.as_str());
                s.counters(&name, endpoint_counter_help(counter), &ENDPOINT)
            }),
            endpoint_in_flight: s.int_gauges("retry_after_endpoint_requests_in_flight", "Requests begun and not yet answered or abandoned.", &ENDPOINT),
            endpoint_waiting: s.int_gauges("retry_after_endpoint_requests_waiting", "Of the requests in flight, those whose response's first body byte has not gone by (queued in the server, or answered without streaming).", &ENDPOINT),
            endpoint_streaming: s.int_gauges("retry_after_endpoint_requests_streaming", "Of the requests in flight, those whose response's body has begun.", &ENDPOINT),
            endpoint_accept_backlog: s.int_gauges("retry_after_endpoint_accept_backlog", "Connections waiting in the accept queues of listeners serving the endpoint.", &["endpoint"]),
            probe_problems: s.int_gauges("retry_after_probe_problems", "Things the kernel programs could not observe, since start.", &["kind"]),
            kernel_feature: s.int_gauges("retry_after_kernel_feature", "1 if the running kernel has a feature some programs need, 0 if what needs it is switched off (probed at start).", &["feature"]),
            tick_errors: s.counters("retry_after_tick_errors_total", "Ticks whose kernel read failed in part (listener backlogs) or whole (counters), by kind.", &["kind"]),
            tick_duration: s.histogram("retry_after_tick_duration_seconds", "Time to read the kernel counters and update the estimates.", vec![1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2]),
            ticks: s.counter("retry_after_ticks_total", "Counter reads since start."),
        }
    }
}

/// Each service's estimate after the last tick: its signals and why it fell back.
pub(super) struct ServiceSeries {
    pub(super) drain_rate: GaugeVec,
    pub(super) drain_rate_warm: IntGaugeVec,
    pub(super) queue_depth: IntGaugeVec,
    pub(super) queue_depth_source: IntGaugeVec,
    pub(super) occupancy: GaugeVec,
    pub(super) saturation_factor: GaugeVec,
    pub(super) fallback_reason: IntGaugeVec,
    pub(super) arrival_rate: GaugeVec,
    pub(super) returns_promised: IntGaugeVec,
    pub(super) returns_dropped: IntCounterVec,
}

impl ServiceSeries {
    pub(super) fn new(s: &Series) -> Self {
        Self {
            drain_rate: s.gauges("retry_after_service_drain_rate_per_second", "EWMA of responses completed per second across the service's backends.", &SERVICE),
            drain_rate_warm: s.int_gauges("retry_after_service_drain_rate_warm", "1 when the drain rate is warm enough to compute with.", &SERVICE),
            queue_depth: s.int_gauges("retry_after_service_queue_depth", "Queue depth from the best kernel source in the service's scope, at the last tick (absent while no source can see the queue).", &SERVICE),
            queue_depth_source: s.int_gauges("retry_after_service_queue_depth_source", "1 for the source the queue depth came from at the last tick (\"none\": the queue is invisible).", &["service", "source"]),
            occupancy: s.gauges("retry_after_service_occupancy_ratio", "Requests in flight in the service's scope over fleet capacity (absent when capacity is unknown).", &SERVICE),
            saturation_factor: s.gauges("retry_after_service_saturation_factor", "1 + w1·occupancy (the backoff term depends on each query).", &SERVICE),
            fallback_reason: s.int_gauges("retry_after_service_fallback_reason", "1 for the reason the agent's own answer (no proxy depth) is not computed, at the last tick; all 0 when it is.", &["service", "reason"]),
            arrival_rate: s.gauges("retry_after_service_arrival_rate_per_second", "Fresh arrivals per second (reported requests less the returns among them), absent while no proxy reports.", &SERVICE),
            returns_promised: s.int_gauges("retry_after_service_returns_promised", "Clients told to come back whose time has not come yet (the scheduled_returns schedule).", &SERVICE),
            returns_dropped: s.counters("retry_after_service_returns_dropped_total", "Promised returns the schedule could not hold.", &SERVICE),
        }
    }
}

/// The answers given and reported, and the judge of what they did.
pub(super) struct AnswerSeries {
    pub(super) suggested_delay: WeightedHistogramVec,
    pub(super) rung: IntCounterVec,
    pub(super) fallbacks: IntCounterVec,
    pub(super) judge_admitted_ratio: GaugeVec,
    pub(super) judge_observed_over_suggested: WeightedHistogramVec,
    pub(super) judge_dropped: IntCounterVec,
    pub(super) proxy_requests: IntCounterVec,
    pub(super) proxy_retries: IntCounterVec,
    pub(super) tickets: IntCounterVec,
}

impl AnswerSeries {
    pub(super) fn new(s: &Series) -> Self {
        Self {
            suggested_delay: s.weighted("retry_after_suggested_delay_seconds", "Retry-After values answered: to queries, and the rejections proxies report (weighted by their count).", &SERVICE_RUNG, DELAY_BUCKETS.to_vec()),
            rung: s.counters("retry_after_ladder_rung_total", "Answers by fallback ladder rung: queries, and reported rejections.", &SERVICE_RUNG),
            fallbacks: s.counters("retry_after_fallback_total", "Answers that were not computed, by reason: queries, and reported rejections.", &["service", "reason"]),
            judge_admitted_ratio: s.gauges("retry_after_judge_admitted_ratio", "Share of judged answers after which a retry at the suggested time was admitted, from what the proxies reported they did then.", &SERVICE_RUNG),
            judge_observed_over_suggested: s.weighted("retry_after_judge_observed_over_suggested_ratio", "Observed time for the queue of an answer to drain (completions after the answer) over the suggested delay.", &SERVICE_RUNG, RATIO_BUCKETS.to_vec()),
            judge_dropped: s.counters("retry_after_judge_dropped_total", "Answers the judge could not follow (too many waiting).", &SERVICE),
            proxy_requests: s.counters("retry_after_proxy_requests_total", "Requests the proxies reported admitting or rejecting.", &["service", "outcome"]),
            proxy_retries: s.counters("retry_after_proxy_retries_total", "Retries after a Retry-After that the proxies reported admitting or rejecting (where they can tell).", &["service", "outcome"]),
            tickets: s.counters("retry_after_tickets_total", "What became of the places the proxies keep (kept returns), as they reported it: issued, honoured, early, expired, refused, replayed.", &["service", "outcome"]),
        }
    }
}

/// The proxy socket and the metrics endpoint themselves.
pub(super) struct SocketSeries {
    pub(super) socket_connections: IntGauge,
    pub(super) socket_write_timeouts: IntCounter,
    pub(super) http_refused: IntCounter,
    pub(super) queries: IntCounterVec,
    pub(super) query_errors: IntCounterVec,
    pub(super) query_duration: Histogram,
}

impl SocketSeries {
    pub(super) fn new(s: &Series) -> Self {
        Self {
            socket_connections: s.int_gauge("retry_after_socket_connections", "Open connections on the proxy socket."),
            socket_write_timeouts: s.counter("retry_after_socket_write_timeouts_total", "Proxy-socket connections ended because the peer did not read an answer within agent.client_write_timeout_ms."),
            http_refused: s.counter("retry_after_metrics_connections_refused_total", "Metrics-endpoint connections closed at once because the connection limit was reached."),
            queries: s.counters("retry_after_queries_total", "Requests received on the proxy socket, by command.", &["command"]),
            query_errors: s.counters("retry_after_query_errors_total", "Error lines sent on the proxy socket, by code.", &["code"]),
            query_duration: s.histogram("retry_after_query_duration_seconds", "Time to answer a QUERY, from its line read to its answer written.", vec![1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2]),
        }
    }
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
        EndpointCounter::ResponsesInferred => {
            "Of the completed responses, those whose end was inferred from the connection going quiet, the next request or the close, their framing unread (TLS, another protocol, a gap)."
        }
        EndpointCounter::BodiesBegun => {
            "Responses whose first body byte went by: their request stopped waiting and streams."
        }
        EndpointCounter::BodiesEnded => {
            "Of the responses completed or cut by the close, those whose body had begun."
        }
        EndpointCounter::FirstByteWaitMicroseconds => {
            "Microseconds from each request's first byte to its response's first body byte, summed over the bodies begun: over bodies_begun, the mean time to first body byte."
        }
    }
}
