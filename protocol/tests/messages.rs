//! Every message prints as documented and parses back to itself.

use proptest::prelude::*;
use retry_after_protocol::{
    ErrorCode, EstimatePush, HealthResponse, MAX_LINE_LEN, MAX_REPORT_COUNT, MAX_SERVICE_NAME_LEN,
    ProtocolError, QueryResponse, Report, Request, Response, StatusResponse,
    policy::{
        FallbackReason, OverloadRule, PolicyConstants, PromisedReturns, QueueDepth,
        QueueDepthSource, RetryAfterPolicy, Rung, TicketOutcome,
    },
};

#[test]
fn parses_every_request() {
    assert_eq!(
        Request::parse(b"QUERY chat queue_depth=12 backoff_streak=3"),
        Ok(Request::Query {
            service: "chat",
            queue_depth: Some(12),
            backoff_streak: Some(3)
        })
    );
    assert_eq!(
        Request::parse(b"QUERY chat\r"),
        Ok(Request::Query {
            service: "chat",
            queue_depth: None,
            backoff_streak: None
        })
    );
    assert_eq!(
        Request::parse(b"SUBSCRIBE chat"),
        Ok(Request::Subscribe { service: "chat" })
    );
    assert_eq!(
        Request::parse(b"REPORT chat admitted=40 rejected=7 queue_depth=12"),
        Ok(Request::Report(Report {
            service: "chat",
            admitted: 40,
            rejected: 7,
            queue_depth: Some(12),
            ..Report::default()
        }))
    );
    assert_eq!(Request::parse(b"HEALTH"), Ok(Request::Health));
    assert_eq!(
        Request::parse(b"STATUS"),
        Ok(Request::Status { service: None })
    );
    assert_eq!(
        Request::parse(b"STATUS chat"),
        Ok(Request::Status {
            service: Some("chat")
        })
    );
    let Ok(Request::Report(kept)) =
        Request::parse(b"REPORT chat admitted=3 rejected=1 tickets=issued:4,early:2,expired:1")
    else {
        panic!("a report with tickets");
    };
    let tickets: Vec<(TicketOutcome, u64)> = kept.tickets().collect();
    assert_eq!(
        tickets,
        vec![
            (TicketOutcome::Issued, 4),
            (TicketOutcome::Early, 2),
            (TicketOutcome::Expired, 1)
        ]
    );
    for bad in [
        "tickets=issued",
        "tickets=lost:3",
        "tickets=issued:x",
        "tickets=issued:1,",
    ] {
        let line = format!("REPORT chat admitted=1 rejected=1 {bad}");
        let e = Request::parse(line.as_bytes()).unwrap_err();
        assert!(e.to_string().contains("issued:3"), "{bad}: {e}");
    }
    let Ok(Request::Report(none)) =
        Request::parse(b"REPORT chat admitted=3 rejected=1 handed_out=none")
    else {
        panic!("a report");
    };
    assert_eq!(
        (none.handed_out, none.handed_out().count()),
        (Some("none"), 0)
    );
    let line = b"REPORT chat admitted=3 rejected=10 handed_out=c3:5,c4:2,s5:2,c300:1";
    let Ok(Request::Report(report)) = Request::parse(line) else {
        panic!("a report");
    };
    let handed: Vec<(Rung, u64, u64)> = report
        .handed_out()
        .map(|h| (h.rung, h.seconds, h.count))
        .collect();
    assert_eq!(
        handed,
        vec![
            (Rung::Computed, 3, 5),
            (Rung::Computed, 4, 2),
            (Rung::Static, 5, 2),
            (Rung::Computed, 300, 1)
        ]
    );
}

#[test]
fn every_bad_line_gets_its_code() {
    let code = |line: &[u8]| Request::parse(line).unwrap_err().code;
    assert_eq!(code(b""), ErrorCode::BadRequest);
    assert_eq!(code(b"QUERY"), ErrorCode::BadRequest);
    assert_eq!(code(b"QUERY  chat"), ErrorCode::BadRequest);
    assert_eq!(code(b"\x00\xff\x13binary"), ErrorCode::BadRequest);
    assert_eq!(code("QUERY caf\u{e9}".as_bytes()), ErrorCode::BadRequest);
    assert_eq!(code(b"query chat"), ErrorCode::UnknownCommand);
    assert_eq!(code(b"DELETE everything"), ErrorCode::UnknownCommand);
    assert_eq!(code(b"QUERY chat queue_depth=-1"), ErrorCode::BadArgument);
    assert_eq!(
        code(b"QUERY chat queue_depth=1 queue_depth=2"),
        ErrorCode::BadArgument
    );
    assert_eq!(
        code(b"QUERY chat backoff_streak=99999999999"),
        ErrorCode::BadArgument
    );
    assert_eq!(code(b"QUERY chat color=red"), ErrorCode::BadArgument);
    assert_eq!(code(b"REPORT chat admitted=1"), ErrorCode::BadArgument);
    assert_eq!(
        code(b"REPORT chat admitted=1 rejected=2 queue_depth"),
        ErrorCode::BadArgument
    );
    assert_eq!(code(b"HEALTH now"), ErrorCode::BadArgument);
    for handed_out in [
        "x3:1",
        "c3",
        "c:1",
        "c3:1,",
        "c3:-1",
        "c+3:1",
        "c3:10000001",
        "c301:1",
        "c18446744073709551615:1",
    ] {
        let line = format!("REPORT chat admitted=1 rejected=1 handed_out={handed_out}");
        assert_eq!(code(line.as_bytes()), ErrorCode::BadArgument, "{line}");
    }
    assert_eq!(
        code(b"REPORT chat admitted=1 rejected=10000001"),
        ErrorCode::BadArgument
    );
    assert_eq!(code(&[b'A'; MAX_LINE_LEN + 1]), ErrorCode::LineTooLong);
    let long_name = format!("QUERY {}", "s".repeat(MAX_SERVICE_NAME_LEN + 1));
    assert_eq!(code(long_name.as_bytes()), ErrorCode::BadRequest);
}

#[test]
fn errors_are_one_printable_line() {
    let e = ProtocolError::new(ErrorCode::BadArgument, "x\ny\u{7}z");
    assert_eq!(e.to_string(), "ERR bad_argument x?y?z");
    assert_eq!(
        Response::parse("ERR unknown_service no service \"x\" is configured"),
        Ok(Response::Err(ProtocolError::new(
            ErrorCode::UnknownService,
            "no service \"x\" is configured"
        )))
    );
}

#[test]
fn responses_print_as_documented() {
    let r = QueryResponse {
        seconds: Some(4),
        millis: Some(3500),
        rung: Rung::Computed,
        reason: None,
        status_code: 429,
        queue_depth: Some(14),
        queue_depth_source: Some(QueueDepthSource::Proxy),
        drain_rate: Some(4.0),
        occupancy: None,
        saturation_factor: Some(1.0),
    };
    assert_eq!(
        r.to_string(),
        "RETRY-AFTER 4 millis=3500 rung=computed reason=none status_code=429 queue_depth=14 queue_depth_source=proxy drain_rate=4 occupancy=none saturation_factor=1"
    );
    let push = EstimatePush {
        service: "chat".into(),
        seq: 7,
        retry_after_policy: RetryAfterPolicy::RouterQueueDrainRate,
        status_code: 503,
        retry_after_s: Some(5),
        queue_depth: Some(QueueDepth {
            depth: 10,
            source: QueueDepthSource::Frontend,
        }),
        drain_rate: Some(50.0 / 3.0),
        occupancy: Some(1.0),
        arrival_rate: Some(2.5),
        returns: PromisedReturns::from_bins([0, 3, 0, 12]),
        overload_age_s: Some(4.5),
        constants: PolicyConstants::default(),
        base_ms: Some(750),
        reason: None,
    };
    assert_eq!(
        push.to_string(),
        "ESTIMATE chat seq=7 retry_after_policy=router_queue_drain_rate status_code=503 retry_after_s=5 queue_depth=10 queue_depth_source=frontend drain_rate=16.666666666666668 occupancy=1 arrival_rate=2.5 returns=0,3,0,12 overload_rule=latest_with_room overload_age_s=4.5 overload_horizon_factor=none occupancy_weight=0.25 backoff_weight=0.25 backoff_streak_saturation=5 jitter=0.2 min_retry_after_s=1 max_retry_after_s=60 base_ms=750 reason=none"
    );
    // The longest schedule fits a response line.
    let full = EstimatePush {
        service: "s".repeat(retry_after_protocol::MAX_SERVICE_NAME_LEN),
        returns: PromisedReturns::from_bins([u32::MAX; retry_after_protocol::policy::RETURN_BINS]),
        ..push.clone()
    };
    assert!(full.to_string().len() < retry_after_protocol::MAX_RESPONSE_LEN);
    assert_eq!(EstimatePush::parse(&full.to_string()), Ok(full));
    let status = StatusResponse {
        service: "chat".into(),
        retry_after_policy: RetryAfterPolicy::ScheduledReturns,
        seconds: Some(5),
        millis: Some(4350),
        rung: Rung::Computed,
        reason: None,
        queue_depth: Some(QueueDepth {
            depth: 12,
            source: QueueDepthSource::BeyondCapacity,
        }),
        drain_rate: Some(16.0),
        arrival_rate: None,
        returns_promised: 40,
        admission_judged: 1204,
        admitted_share: Some(0.91),
        next: Some("search".into()),
    };
    assert_eq!(
        status.to_string(),
        "STATUS chat retry_after_policy=scheduled_returns seconds=5 millis=4350 rung=computed reason=none queue_depth=12 queue_depth_source=beyond_capacity drain_rate=16 arrival_rate=none returns_promised=40 admission_judged=1204 admitted_share=0.91 next=search"
    );
    // The longest status fits a response line.
    let longest = StatusResponse {
        service: "s".repeat(retry_after_protocol::MAX_SERVICE_NAME_LEN),
        next: Some("n".repeat(retry_after_protocol::MAX_SERVICE_NAME_LEN)),
        seconds: Some(u64::MAX),
        millis: Some(u64::MAX),
        queue_depth: status.queue_depth.map(|q| QueueDepth {
            depth: u64::MAX,
            ..q
        }),
        drain_rate: Some(f64::MIN_POSITIVE / 3.0),
        arrival_rate: Some(-f64::MAX),
        returns_promised: u64::MAX,
        admission_judged: u64::MAX,
        admitted_share: Some(1.0 / 3.0),
        reason: Some(FallbackReason::EstimateUnusable),
        ..status.clone()
    };
    assert!(longest.to_string().len() < retry_after_protocol::MAX_RESPONSE_LEN);
    // A schedule is counts only, at most one per bin.
    for bad in ["returns=1,,2", "returns=-1", "returns=1.5", "returns="] {
        let line = format!("{push} {bad}");
        assert!(EstimatePush::parse(&line).is_err(), "{bad}");
    }
    // A newer agent's extra fields are skipped.
    let extra = format!("{push} future_field=3");
    assert_eq!(EstimatePush::parse(&extra), Ok(push));
}

fn service() -> impl Strategy<Value = String> {
    "[a-z0-9._-]{1,20}"
}

fn finite() -> impl Strategy<Value = f64> {
    prop_oneof![
        0.0..1e6f64,
        Just(0.0),
        Just(1.0 / 3.0),
        any::<f64>().prop_filter("finite", |v| v.is_finite())
    ]
}

fn query_response() -> impl Strategy<Value = QueryResponse> {
    (
        (
            prop::option::of(any::<u64>()),
            prop::option::of(any::<u64>()),
            prop::sample::select(Rung::ALL),
        ),
        prop::option::of(prop::sample::select(FallbackReason::ALL)),
        any::<u16>(),
        prop::option::of((any::<u64>(), prop::sample::select(QueueDepthSource::ALL))),
        (
            prop::option::of(finite()),
            prop::option::of(finite()),
            prop::option::of(finite()),
        ),
    )
        .prop_map(
            |((seconds, millis, rung), reason, status_code, queue, (drain, occ, sat))| {
                QueryResponse {
                    seconds,
                    millis,
                    rung,
                    reason,
                    status_code,
                    queue_depth: queue.map(|q| q.0),
                    queue_depth_source: queue.map(|q| q.1),
                    drain_rate: drain,
                    occupancy: occ,
                    saturation_factor: sat,
                }
            },
        )
}

fn push() -> impl Strategy<Value = EstimatePush> {
    (
        (
            service(),
            any::<u64>(),
            prop::sample::select(RetryAfterPolicy::ALL.to_vec()),
            any::<u16>(),
            prop::option::of(any::<u64>()),
        ),
        prop::option::of((any::<u64>(), prop::sample::select(QueueDepthSource::ALL))),
        (
            prop::option::of(finite()),
            prop::option::of(finite()),
            prop::option::of(finite()),
            prop::collection::vec(any::<u32>(), 0..64),
            (prop::option::of(finite()), prop::option::of(finite())),
        ),
        (
            prop::sample::select(OverloadRule::ALL.to_vec()),
            finite(),
            finite(),
            any::<u32>(),
            finite(),
            any::<u64>(),
            any::<u64>(),
        ),
        (
            prop::option::of(any::<u64>()),
            prop::option::of(prop::sample::select(FallbackReason::ALL)),
        ),
    )
        .prop_map(
            |(
                (service, seq, retry_after_policy, status_code, retry_after_s),
                queue,
                (drain_rate, occupancy, arrival_rate, returns, (overload_age_s, horizon)),
                (overload_rule, w1, w2, b, jitter, min, max),
                (base_ms, reason),
            )| EstimatePush {
                service,
                seq,
                retry_after_policy,
                status_code,
                retry_after_s,
                queue_depth: queue.map(|(depth, source)| QueueDepth { depth, source }),
                drain_rate,
                occupancy,
                arrival_rate,
                returns: PromisedReturns::from_bins(returns),
                overload_age_s,
                constants: PolicyConstants {
                    backoff_streak_saturation: b,
                    occupancy_weight: w1,
                    backoff_weight: w2,
                    jitter,
                    min_retry_after_s: min,
                    max_retry_after_s: max,
                    overload_rule,
                    overload_horizon_factor: horizon,
                },
                base_ms,
                reason,
            },
        )
}

fn health() -> impl Strategy<Value = HealthResponse> {
    (
        any::<u64>(),
        any::<u64>(),
        prop::option::of(any::<u64>()),
        any::<usize>(),
        any::<usize>(),
        any::<usize>(),
    )
        .prop_map(
            |(uptime_s, ticks, last_tick_ms, services, endpoints, connections)| HealthResponse {
                uptime_s,
                ticks,
                last_tick_ms,
                services,
                endpoints,
                connections,
            },
        )
}

fn status() -> impl Strategy<Value = StatusResponse> {
    (
        (
            service(),
            prop::sample::select(RetryAfterPolicy::ALL.to_vec()),
            prop::option::of(any::<u64>()),
            prop::option::of(any::<u64>()),
            prop::sample::select(Rung::ALL),
            prop::option::of(prop::sample::select(FallbackReason::ALL)),
        ),
        prop::option::of((any::<u64>(), prop::sample::select(QueueDepthSource::ALL))),
        (prop::option::of(finite()), prop::option::of(finite())),
        (any::<u64>(), any::<u64>(), prop::option::of(finite())),
        prop::option::of(service()),
    )
        .prop_map(
            |(
                (service, retry_after_policy, seconds, millis, rung, reason),
                queue,
                (drain_rate, arrival_rate),
                (returns_promised, admission_judged, admitted_share),
                next,
            )| StatusResponse {
                service,
                retry_after_policy,
                seconds,
                millis,
                rung,
                reason,
                queue_depth: queue.map(|(depth, source)| QueueDepth { depth, source }),
                drain_rate,
                arrival_rate,
                returns_promised,
                admission_judged,
                admitted_share,
                next,
            },
        )
}

fn response() -> impl Strategy<Value = Response> {
    prop_oneof![
        query_response().prop_map(Response::RetryAfter),
        push().prop_map(|p| Response::Estimate(Box::new(p))),
        health().prop_map(Response::Health),
        status().prop_map(Response::Status),
        Just(Response::Ok),
        (prop::sample::select(ErrorCode::ALL.to_vec()), "[ -~]{0,40}")
            .prop_map(|(code, reason)| Response::Err(ProtocolError::new(code, reason))),
    ]
}

proptest! {
    #[test]
    fn every_response_round_trips(response in response()) {
        let line = response.to_string();
        prop_assert!(!line.contains('\n'));
        prop_assert_eq!(Response::parse(&line), Ok(response));
    }

    #[test]
    fn every_request_round_trips(
        service in service(),
        depth in prop::option::of(any::<u64>()),
        streak in prop::option::of(any::<u32>()),
        counts in (0..=MAX_REPORT_COUNT, 0..=MAX_REPORT_COUNT, prop::option::of(0..=MAX_REPORT_COUNT), prop::option::of(0..=MAX_REPORT_COUNT)),
        handed in prop::collection::vec((any::<bool>(), 0..=60u64, 0..=MAX_REPORT_COUNT), 0..4),
        which in 0..6u8,
    ) {
        let handed_out: Vec<String> = handed
            .iter()
            .map(|(computed, seconds, count)| format!("{}{seconds}:{count}", if *computed { 'c' } else { 's' }))
            .collect();
        let handed_out = handed_out.join(",");
        let request = match which {
            0 => Request::Query { service: &service, queue_depth: depth, backoff_streak: streak },
            1 => Request::Subscribe { service: &service },
            2 => Request::Report(Report {
                service: &service,
                admitted: counts.0,
                rejected: counts.1,
                queue_depth: depth,
                backoff_streak: streak,
                retry_admitted: counts.2,
                retry_rejected: counts.3,
                handed_out: (!handed.is_empty()).then_some(handed_out.as_str()),
                tickets: (counts.0 % 2 == 1).then_some("issued:3,honoured:2,replayed:1"),
            }),
            3 => Request::Health,
            4 => Request::Status { service: None },
            _ => Request::Status { service: Some(&service) },
        };
        let line = request.to_string();
        prop_assert_eq!(Request::parse(line.as_bytes()), Ok(request));
    }

}

// The parsers' fuzz harness, bounded so the test command runs it every time.
proptest! {
    #![proptest_config(ProptestConfig::with_cases(20_000))]

    #[test]
    fn the_request_parser_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let _ = Request::parse(&bytes);
    }

    #[test]
    fn request_like_lines_never_panic_the_parser(
        line in "(QUERY|SUBSCRIBE|REPORT|HEALTH|STATUS|query)( [a-z=0-9\\-]{0,12}){0,8}\r?",
    ) {
        if let Ok(request) = Request::parse(line.as_bytes()) {
            // What parses, prints back to a line that parses to the same request.
            let printed = request.to_string();
            prop_assert_eq!(Request::parse(printed.as_bytes()), Ok(request));
        }
    }

    #[test]
    fn the_response_parser_never_panics(line in "[ -~]{0,300}") {
        let _ = Response::parse(&line);
    }
}
