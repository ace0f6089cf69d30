//! What each request does: one function per command, each returning the one line that answers
//! it. Subscriptions keep state on the connection, so `connection.rs` handles their bookkeeping
//! and calls [`push`] here.

use std::time::Instant;

use rand::{Rng, RngExt};

use crate::shared::Shared;
use retry_after_estimator::Query;
use retry_after_protocol::{
    ErrorCode, EstimatePush, ProtocolError, QueryResponse, Report, Response,
};

/// `QUERY`: one answer, drawn with its own jitter and recorded for the judge.
pub fn query(shared: &Shared, service: &str, query: Query, rng: &mut impl Rng) -> Response {
    let started = Instant::now();
    let jitter_draw = rng.random::<f64>();
    let answer = shared.estimator().service_mut(service).map(|s| {
        (
            s.answer_and_record(Instant::now(), query, jitter_draw),
            s.settings().status_code,
        )
    });
    let Some((answer, status_code)) = answer else {
        return unknown_service(service);
    };
    shared.metrics().record_answers(service, &answer, 1);
    shared.metrics().record_query_duration(started.elapsed());
    Response::RetryAfter(QueryResponse::new(&answer, status_code))
}

/// `REPORT`: what the proxy did since `from` (`None`: the connection's first report, since a
/// time the agent does not know).
pub fn report(shared: &Shared, from: Option<Instant>, report: &Report<'_>) -> Response {
    let answer = shared
        .estimator()
        .service_mut(report.service)
        .map(|s| s.report(from, Instant::now(), report));
    let Some(answer) = answer else {
        return unknown_service(report.service);
    };
    shared
        .metrics()
        .record_answers(report.service, &answer, report.rejected);
    shared.metrics().record_report(report);
    Response::Ok
}

/// `HEALTH`.
pub fn health(shared: &Shared, connections: usize) -> Response {
    Response::Health(shared.health(connections))
}

/// `STATUS`: `service`'s numbers for people (`None`: the first service's), naming the next.
pub fn status(shared: &Shared, service: Option<&str>) -> Response {
    match shared.estimator().status(service) {
        Some(status) => Response::Status(status),
        None => unknown_service(service.unwrap_or("")),
    }
}

/// The estimate pushed to a subscriber of `service`, or `None` if it is not configured.
pub fn push(shared: &Shared, service: &str, seq: u64) -> Option<EstimatePush> {
    shared.estimator().service(service).map(|s| s.push(seq))
}

/// The error for a service that is not configured.
pub fn unknown_service(service: &str) -> Response {
    Response::Err(ProtocolError::new(
        ErrorCode::UnknownService,
        format!("no service {service:?} is configured"),
    ))
}
