//! The agent as proxies and operators meet it: the real binary, its real eBPF programs, real
//! backends on loopback, and its Unix socket and metrics endpoint.

use std::{
    io::{BufRead, BufReader, Read, Write},
    os::unix::net::UnixStream,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use retry_after_protocol::{
    ErrorCode, HealthResponse, QueryResponse, Request, Response,
    policy::{
        FallbackReason, PolicyConstants, QueueDepth, QueueDepthSource, RetryAfterPolicy, Rung,
        Signals,
    },
};
use retry_after_testkit::{
    AgentProcess,
    http::{HttpClient, HttpServer, ServerOptions, Workers},
};

/// A `RETRY-AFTER` answer, parsed.
fn answer(line: &str) -> QueryResponse {
    match Response::parse(line) {
        Ok(Response::RetryAfter(answer)) => answer,
        other => panic!("not an answer: {line:?} ({other:?})"),
    }
}

/// A `HEALTH` answer, parsed.
fn health(line: &str) -> HealthResponse {
    match Response::parse(line) {
        Ok(Response::Health(health)) => health,
        other => panic!("not a health line: {line:?} ({other:?})"),
    }
}

/// A metric sample's value from a text exposition; panics if it is missing.
fn sample(metrics: &str, name_and_labels: &str) -> f64 {
    retry_after_testkit::sample(metrics, name_and_labels)
        .unwrap_or_else(|| panic!("no sample {name_and_labels}"))
}

/// A computed service whose replica (2 at a time) queues and rejects itself.
fn computed_service(name: &str, backend: &str, extra: &str) -> String {
    format!(
        "[[service]]\nname = \"{name}\"\nrejected_at = \"replica\"\nbackends = [{{ address = \"{backend}\", max_ongoing_requests = 2 }}]\n[service.backpressure]\nretry_after_policy = \"router_queue_drain_rate\"\nwarm_after_s = 0.4\njitter = 0.0\n{extra}\n"
    )
}

fn query(service: &str) -> String {
    Request::Query {
        service,
        queue_depth: None,
        backoff_streak: None,
    }
    .to_string()
}

#[test]
fn a_fresh_agent_answers_static_then_none_until_warm() {
    let agent = AgentProcess::start(
        "",
        &(computed_service("with-static", "127.0.0.1:1", "retry_after_s = 7")
            + &computed_service("without-static", "127.0.0.1:2", "")),
    );
    let a = answer(&agent.request(&query("with-static")).unwrap());
    assert_eq!(
        (a.seconds, a.millis, a.rung),
        (Some(7), Some(7000), Rung::Static)
    );
    assert_eq!(a.reason, Some(FallbackReason::DrainNotWarm));
    let a = answer(&agent.request(&query("without-static")).unwrap());
    assert_eq!((a.seconds, a.rung), (None, Rung::None));
}

#[test]
fn the_computed_value_follows_an_overloaded_backend_up_and_back_down() {
    // A backend with 2 workers taking 200 ms each: it drains 10 requests per second.
    let backend = HttpServer::start(
        "127.0.0.1:0",
        ServerOptions {
            response_body: 100,
            workers: Some(Workers::new(2)),
            service_time: Duration::from_millis(200),
            ..Default::default()
        },
    );
    let addr = backend.addr();
    let agent = AgentProcess::start(
        "",
        &computed_service("api", &addr.to_string(), "retry_after_s = 1"),
    );

    // Load: `clients` keep-alive connections, each sending the next request when answered.
    let clients = Arc::new(AtomicUsize::new(30));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..30)
        .map(|i| {
            let (clients, stop) = (clients.clone(), stop.clone());
            thread::spawn(move || {
                let mut client = HttpClient::connect(addr);
                while !stop.load(Ordering::SeqCst) {
                    if i < clients.load(Ordering::SeqCst) {
                        client.exchange(10);
                    } else {
                        thread::sleep(Duration::from_millis(20));
                    }
                }
            })
        })
        .collect();

    // Heavy: 30 in flight, 2 served at a time, 28 queued beyond capacity, drain 10/s:
    // 28 / 10 × (1 + 0.25 × occupancy 1) = 3.5 → 4 s. Once the answer is computed, the
    // agent's answers over three seconds are held to the load's truth: the queue the clients
    // keep (each has one request outstanding but for the moment between an answer and its
    // next request), the drain the backend counted itself, and the policy's value for them.
    wait_for_answer(&agent, &query("api"), Duration::from_secs(20), |a| {
        a.rung == Rung::Computed && a.seconds.unwrap() > 1
    });
    let answered = |b: &HttpServer| b.answered.load(Ordering::SeqCst);
    let (started, answered_before) = (Instant::now(), answered(&backend));
    let mut answers = Vec::new();
    while started.elapsed() < Duration::from_secs(3) {
        answers.push(answer(&agent.request(&query("api")).unwrap()));
        thread::sleep(Duration::from_millis(100));
    }
    let drain = (answered(&backend) - answered_before) as f64 / started.elapsed().as_secs_f64();
    let truth = Signals {
        queue_depth: Some(QueueDepth {
            depth: 28,
            source: QueueDepthSource::BeyondCapacity,
        }),
        occupancy: Some(1.0),
        ..Signals::proxy_queue(28, drain)
    };
    let constants = PolicyConstants {
        jitter: 0.0,
        ..PolicyConstants::default()
    };
    let expected = RetryAfterPolicy::RouterQueueDrainRate
        .compute(&truth, &constants)
        .map(|c| c.base_s.ceil() as u64)
        .expect("the policy's value for the load");
    let told: Vec<String> = answers
        .iter()
        .map(|a| {
            let drain_used = a.drain_rate.unwrap_or(f64::NAN);
            format!("{:?} s {:?} @ {drain_used:.2}/s", a.seconds, a.queue_depth)
        })
        .collect();
    let line = format!(
        "backend drained {drain:.2}/s, the policy's value {expected} s; answers (s, depth, drain): {}",
        told.join(", ")
    );
    eprintln!("{line}");
    for a in &answers {
        assert_eq!(a.rung, Rung::Computed, "{line}");
        assert_eq!(
            a.queue_depth_source,
            Some(QueueDepthSource::BeyondCapacity),
            "{line}"
        );
        let depth = a.queue_depth.unwrap();
        assert!((25..=28).contains(&depth), "the clients' queue, 28: {line}");
        let drain_used = a.drain_rate.unwrap();
        assert!(
            (drain_used - drain).abs() <= 0.1 * drain,
            "the backend's own drain: {line}"
        );
        assert_eq!(
            a.seconds,
            Some(expected),
            "the policy's value for the load: {line}"
        );
    }

    // Light: 3 clients, at most 1 queued: the value comes down to the minimum.
    clients.store(3, Ordering::SeqCst);
    wait_for_answer(&agent, &query("api"), Duration::from_secs(20), |a| {
        a.rung == Rung::Computed && a.seconds == Some(1) && a.queue_depth <= Some(1)
    });

    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.join().unwrap();
    }
}

/// Query until `done` holds, or panic with the last answer.
fn wait_for_answer(
    agent: &AgentProcess,
    request: &str,
    timeout: Duration,
    done: impl Fn(&QueryResponse) -> bool,
) -> QueryResponse {
    let deadline = Instant::now() + timeout;
    loop {
        let line = answer(&agent.request(request).unwrap());
        if done(&line) {
            return line;
        }
        assert!(
            Instant::now() < deadline,
            "not reached within {timeout:?}; last answer {line}"
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// A raw connection to the socket.
struct Raw {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Raw {
    fn connect(agent: &AgentProcess) -> Self {
        let stream = UnixStream::connect(&agent.socket).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        Self {
            reader: BufReader::new(stream.try_clone().unwrap()),
            stream,
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).unwrap();
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).unwrap();
        assert!(n > 0, "the agent closed the connection");
        assert!(line.ends_with('\n'), "one whole line: {line:?}");
        line.trim_end().to_owned()
    }

    fn still_usable(&mut self) {
        self.send(format!("{}\n", Request::Health).as_bytes());
        health(&self.line());
    }

    fn error(&mut self) -> ErrorCode {
        match Response::parse(&self.line()) {
            Ok(Response::Err(error)) => error.code,
            other => panic!("not an error line: {other:?}"),
        }
    }
}

#[test]
fn bad_lines_get_one_error_line_and_the_connection_stays_usable() {
    let agent = AgentProcess::start("", &computed_service("api", "127.0.0.1:1", ""));
    let mut raw = Raw::connect(&agent);
    let mut binary: Vec<u8> = (0u8..=255).filter(|b| *b != b'\n').collect();
    binary.push(b'\n');
    let cases: Vec<(Vec<u8>, ErrorCode)> = vec![
        (b"\n".to_vec(), ErrorCode::BadRequest),
        (b"QUERY\n".to_vec(), ErrorCode::BadRequest),
        (binary, ErrorCode::BadRequest),
        (b"FROBNICATE api\n".to_vec(), ErrorCode::UnknownCommand),
        (
            b"QUERY api queue_depth=lots\n".to_vec(),
            ErrorCode::BadArgument,
        ),
        (b"REPORT api admitted=3\n".to_vec(), ErrorCode::BadArgument),
        (b"QUERY nosuch\n".to_vec(), ErrorCode::UnknownService),
        (b"SUBSCRIBE nosuch\n".to_vec(), ErrorCode::UnknownService),
        (
            b"REPORT nosuch admitted=1 rejected=1\n".to_vec(),
            ErrorCode::UnknownService,
        ),
        (
            [vec![b'Q'; 100_000], b"\n".to_vec()].concat(),
            ErrorCode::LineTooLong,
        ),
    ];
    for (bytes, code) in cases {
        raw.send(&bytes);
        assert_eq!(
            raw.error(),
            code,
            "{:?}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(40)])
        );
        raw.still_usable();
    }
    // A line split across writes is one request.
    raw.send(b"QUE");
    thread::sleep(Duration::from_millis(200));
    raw.send(b"RY api queue_depth=3\n");
    answer(&raw.line());
    // A report is acknowledged.
    raw.send(b"REPORT api admitted=3 rejected=1 queue_depth=2\n");
    assert_eq!(Response::parse(&raw.line()), Ok(Response::Ok));
    // The agent survived it all, and counted the errors.
    let metrics = agent.metrics();
    assert_eq!(
        sample(
            &metrics,
            "retry_after_query_errors_total{code=\"line_too_long\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(
            &metrics,
            "retry_after_query_errors_total{code=\"bad_request\"}"
        ),
        3.0
    );
}

#[test]
fn a_thousand_idle_connections_are_shed_without_harming_a_working_client() {
    let agent = AgentProcess::start(
        "max_clients = 64\nclient_idle_timeout_ms = 60000",
        &computed_service("api", "127.0.0.1:1", "retry_after_s = 2"),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (stop, answered) = (stop.clone(), answered.clone());
        let mut raw = Raw::connect(&agent);
        // A working client: it has asked before the flood begins.
        let request = format!("{}\n", query("api"));
        raw.send(request.as_bytes());
        assert_eq!(answer(&raw.line()).seconds, Some(2));
        thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                raw.send(request.as_bytes());
                let line = raw.line();
                assert_eq!(answer(&line).seconds, Some(2), "{line}");
                answered.fetch_add(1, Ordering::SeqCst);
                thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let mut idle: Vec<UnixStream> = (0..1000)
        .map(|_| UnixStream::connect(&agent.socket).unwrap())
        .collect();
    thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    worker.join().expect("the working client got every answer");
    assert!(answered.load(Ordering::SeqCst) > 10);
    // At most 64 are held; the others were told why and closed.
    let held = agent.health().connections;
    assert!(held <= 64, "{held} held");
    let mut shed = 0;
    for stream in &mut idle {
        stream
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let mut text = String::new();
        if stream.read_to_string(&mut text).is_ok() {
            assert!(
                matches!(Response::parse(text.lines().next().unwrap_or("")), Ok(Response::Err(e)) if e.code == ErrorCode::Idle),
                "{text:?}"
            );
            shed += 1;
        }
    }
    assert!(shed >= 1000 - 64, "{shed} shed");
}

#[test]
fn a_peer_whose_uid_is_not_allowed_is_refused() {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let agent = AgentProcess::start(
        &format!("allowed_uids = [{}]", uid + 4242),
        &computed_service("api", "127.0.0.1:1", "retry_after_s = 2"),
    );
    let mut raw = Raw::connect(&agent);
    let line = raw.line();
    assert!(
        matches!(Response::parse(&line), Ok(Response::Err(e)) if e.code == ErrorCode::Denied),
        "{line}"
    );
    assert!(line.contains(&uid.to_string()), "{line}");
    let mut rest = String::new();
    assert_eq!(
        raw.reader.read_to_string(&mut rest).unwrap(),
        0,
        "closed after refusing"
    );
}

#[test]
fn the_client_library_answers_through_an_agent_restart() {
    let mut agent = AgentProcess::start(
        "",
        &computed_service("api", "127.0.0.1:1", "retry_after_s = 9\nstatus_code = 503"),
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let _guard = runtime.enter();
    let subscription = retry_after_client::Subscription::spawn(
        &agent.socket,
        "api",
        retry_after_client::ClientOptions {
            retry_after_s: Some(3),
            status_code: 429,
            stale_after: Duration::from_secs(1),
            reconnect_min: Duration::from_millis(50),
            reconnect_max: Duration::from_millis(200),
        },
    );
    let mut rng = rand::rng();
    let from_agent = |s: &retry_after_client::Subscription, rng: &mut _| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.retry_after(rng).seconds != Some(9) {
            assert!(Instant::now() < deadline, "no estimate from the agent");
            thread::sleep(Duration::from_millis(20));
        }
    };
    from_agent(&subscription, &mut rng);

    agent.kill();
    // From memory while fresh: the agent's value (its static 9 s).
    assert_eq!(subscription.retry_after(&mut rng).seconds, Some(9));
    // Once stale: the client's own static value.
    thread::sleep(Duration::from_millis(1300));
    let decision = subscription.retry_after(&mut rng);
    assert_eq!(
        (decision.seconds, decision.rung, decision.status_code),
        (Some(3), Rung::Static, 503),
        "once stale: this client's static value, with the service's status"
    );

    // A new agent (which finds the dead one's socket file in its way) is picked up unasked.
    agent.restart();
    from_agent(&subscription, &mut rng);
    assert!(subscription.age().unwrap() < Duration::from_secs(1));
}

/// The promised returns in the agent's push for `service`, as a subscriber receives them.
fn promised_in_push(agent: &AgentProcess, service: &str) -> u64 {
    let line = agent.request(&format!("SUBSCRIBE {service}")).unwrap();
    match Response::parse(&line) {
        Ok(Response::Estimate(push)) => push.returns.total(),
        other => panic!("not an estimate: {line} ({other:?})"),
    }
}

#[test]
fn an_agent_restart_loses_the_schedule_and_the_proxies_next_reports_rebuild_it() {
    let mut agent = AgentProcess::start(
        "",
        "[[service]]\nname = \"api\"\nbackends = [{ address = \"127.0.0.1:1\" }]\n[service.backpressure]\nretry_after_policy = \"scheduled_returns\"\nretry_after_s = 5\n",
    );
    let report = |agent: &AgentProcess| {
        let ok = agent
            .request("REPORT api admitted=4 rejected=40 handed_out=c20:30,c40:10")
            .unwrap();
        assert_eq!(ok, "OK");
    };
    // What a proxy handed out, and what the agent answers itself, are both promised returns.
    report(&agent);
    assert_eq!(promised_in_push(&agent, "api"), 40);
    let answer = answer(&agent.request("QUERY api queue_depth=3").unwrap());
    assert_eq!(
        (answer.seconds, answer.rung),
        (Some(5), Rung::Static),
        "not warm: the fallback"
    );
    assert_eq!(promised_in_push(&agent, "api"), 41);
    // A tick later the operator sees them too (a wait, not a bound: a busy machine may be slow).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let promised = sample(
            &agent.metrics(),
            "retry_after_service_returns_promised{service=\"api\"}",
        );
        if promised == 41.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the metric says {promised} promised returns after 30 s; the push says {}",
            promised_in_push(&agent, "api")
        );
        thread::sleep(Duration::from_millis(100));
    }

    // A restart loses the schedule; the proxy's next report (one interval later) rebuilds it.
    agent.restart();
    assert_eq!(promised_in_push(&agent, "api"), 0);
    report(&agent);
    assert_eq!(promised_in_push(&agent, "api"), 40);
    let metrics = agent.metrics();
    assert_eq!(
        sample(
            &metrics,
            "retry_after_service_returns_dropped_total{service=\"api\"}"
        ),
        0.0
    );
}

#[test]
fn metrics_parse_and_carry_every_series() {
    let backend = HttpServer::start("127.0.0.1:0", ServerOptions::default());
    let agent = AgentProcess::start(
        "",
        &computed_service("api", &backend.addr().to_string(), "retry_after_s = 2"),
    );
    for _ in 0..3 {
        agent.request("QUERY api queue_depth=4").unwrap();
    }
    // A proxy reports 5 rejections (and 7 admissions): answers too, counted by rung.
    assert_eq!(
        agent
            .request("REPORT api admitted=7 rejected=5 retry_admitted=2")
            .unwrap(),
        "OK"
    );
    agent.request("HEALTH").unwrap();
    thread::sleep(Duration::from_millis(500));
    let text = agent.metrics();
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text format");
    let names: std::collections::BTreeSet<_> =
        scrape.samples.iter().map(|s| s.metric.as_str()).collect();
    for series in [
        "retry_after_endpoint_connections_opened_total",
        "retry_after_endpoint_connections_closed_total",
        "retry_after_endpoint_requests_started_total",
        "retry_after_endpoint_responses_completed_total",
        "retry_after_endpoint_responses_rejected_total",
        "retry_after_endpoint_requests_abandoned_total",
        "retry_after_endpoint_request_bytes_total",
        "retry_after_endpoint_response_bytes_total",
        "retry_after_endpoint_requests_in_flight",
        "retry_after_endpoint_accept_backlog",
        "retry_after_service_drain_rate_per_second",
        "retry_after_service_drain_rate_warm",
        "retry_after_service_queue_depth",
        "retry_after_service_queue_depth_source",
        "retry_after_service_saturation_factor",
        "retry_after_service_occupancy_ratio",
        "retry_after_service_fallback_reason",
        "retry_after_suggested_delay_seconds",
        "retry_after_ladder_rung_total",
        "retry_after_fallback_total",
        "retry_after_judge_observed_over_suggested_ratio",
        "retry_after_judge_dropped_total",
        "retry_after_proxy_requests_total",
        "retry_after_proxy_retries_total",
        "retry_after_socket_connections",
        "retry_after_queries_total",
        "retry_after_query_duration_seconds",
        "retry_after_tick_duration_seconds",
        "retry_after_ticks_total",
        "retry_after_probe_problems",
    ] {
        assert!(names.contains(series), "{series} missing from /metrics");
    }
    assert_eq!(
        sample(
            &text,
            "retry_after_ladder_rung_total{rung=\"static\",service=\"api\"}"
        ),
        8.0,
        "3 queries and 5 reported rejections"
    );
    assert_eq!(
        sample(
            &text,
            "retry_after_fallback_total{reason=\"drain_not_warm\",service=\"api\"}"
        ),
        8.0
    );
    assert_eq!(
        sample(&text, "retry_after_queries_total{command=\"query\"}"),
        3.0
    );
    assert_eq!(
        sample(
            &text,
            "retry_after_suggested_delay_seconds_count{rung=\"static\",service=\"api\"}"
        ),
        8.0
    );
    assert_eq!(
        sample(
            &text,
            "retry_after_proxy_requests_total{outcome=\"admitted\",service=\"api\"}"
        ),
        7.0
    );
    assert_eq!(
        sample(
            &text,
            "retry_after_proxy_retries_total{outcome=\"admitted\",service=\"api\"}"
        ),
        2.0
    );
}

#[test]
fn the_query_command_asks_like_a_proxy() {
    let agent = AgentProcess::start(
        "",
        &computed_service("api", "127.0.0.1:1", "retry_after_s = 6"),
    );
    let out = std::process::Command::new(retry_after_testkit::agent_binary())
        .args(["query", "api", "--queue-depth", "3", "--socket"])
        .arg(&agent.socket)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8(out.stdout).unwrap();
    let a = answer(line.trim_end());
    assert_eq!((a.seconds, a.queue_depth), (Some(6), Some(3)), "{line}");
    let out = std::process::Command::new(retry_after_testkit::agent_binary())
        .args(["query", "nosuch", "--socket"])
        .arg(&agent.socket)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ERR unknown_service"));
}

/// `retry-after-agent check --config FILE`: success and standard output.
fn check(config: &std::path::Path) -> (bool, String) {
    let out = std::process::Command::new(retry_after_testkit::agent_binary())
        .args(["check", "--config"])
        .arg(config)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn check_names_the_bad_field_and_value() {
    let dir = std::env::temp_dir().join(format!("retry-after-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("bad.toml");
    std::fs::write(
        &config,
        "[[service]]\nname = \"api\"\nbackends = [{ address = \"*:80\" }]\n[service.backpressure]\nretry_after_policy = \"auto\"\n",
    )
    .unwrap();
    let (ok, text) = check(&config);
    assert!(!ok, "{text}");
    assert!(
        text.contains("MISSING configuration")
            && text.contains("service[0].backpressure.retry_after_policy")
            && text.contains("\"auto\""),
        "{text}"
    );
    // `run` refuses the same file before attaching anything.
    let out = std::process::Command::new(retry_after_testkit::agent_binary())
        .args(["run", "--config"])
        .arg(&config)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("retry_after_policy"));

    // A computing service whose queue no kernel source can see: valid, but warned about.
    std::fs::write(
        &config,
        "[agent]\nsocket_path = \"/tmp/retry-after-check/agent.sock\"\n[[service]]\nname = \"api\"\nbackends = [{ address = \"*:80\" }]\n[service.backpressure]\nretry_after_policy = \"router_queue_drain_rate\"\nretry_after_s = 5\n",
    )
    .unwrap();
    let (ok, text) = check(&config);
    assert!(ok, "{text}");
    assert!(
        text.contains("WARN    service api: no frontend") && text.contains("queue_invisible"),
        "{text}"
    );
    // It says which policy a service uses, and recommends scheduled_returns otherwise.
    assert!(
        text.contains(
            "NOTE    service api: policy router_queue_drain_rate; scheduled_returns is recommended"
        ),
        "{text}"
    );
    std::fs::write(
        &config,
        "[agent]\nsocket_path = \"/tmp/retry-after-check/agent.sock\"\n[[service]]\nname = \"api\"\nfrontend = \"127.0.0.1:8000\"\nbackends = [{ address = \"*:80\" }]\n[service.backpressure]\nretry_after_policy = \"scheduled_returns\"\noverload_rule = \"latest\"\n",
    )
    .unwrap();
    let (ok, text) = check(&config);
    assert!(ok, "{text}");
    assert!(
        text.contains("ok      service api: policy scheduled_returns (overload_rule latest)")
            && text.contains("ok      service api: Retry-After within 1 to 60 s")
            && !text.contains("NOTE"),
        "{text}"
    );
    // A service keeping returns may tell places up to its horizon; check names the clamp.
    std::fs::write(
        &config,
        "[agent]\nsocket_path = \"/tmp/retry-after-check/agent.sock\"\n[[service]]\nname = \"api\"\nfrontend = \"127.0.0.1:8000\"\nbackends = [{ address = \"*:80\" }]\n[service.backpressure]\nretry_after_policy = \"kept_returns\"\nmax_retry_after_s = 120\n",
    )
    .unwrap();
    let (ok, text) = check(&config);
    assert!(
        ok && text.contains(
            "NOTE    service api: Retry-After within 1 to 120 s: places up to 120 s away are told as they are"
        ),
        "{text}"
    );
    // A bad overload rule is named with its field.
    std::fs::write(
        &config,
        "[[service]]\nname = \"api\"\nbackends = [{ address = \"*:80\" }]\n[service.backpressure]\nretry_after_policy = \"scheduled_returns\"\noverload_rule = \"soon\"\n",
    )
    .unwrap();
    let (ok, text) = check(&config);
    assert!(
        !ok && text.contains("service[0].backpressure.overload_rule") && text.contains("\"soon\""),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all("/tmp/retry-after-check");
}
