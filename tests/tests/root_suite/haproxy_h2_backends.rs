//! The layout a proxy's node runs: wrk's 300 keep-alive HTTP/1.1 connections into HAProxy,
//! HAProxy carrying them to nginx over HTTP/2 (`proto h2`: a few backend connections with
//! hundreds of streams each), the agent watching nginx's port from both ends. The proxy's own
//! vantage point is the client side (HAProxy's backend connections), and its completions are
//! the drain the agent answers with: every stream must be counted there as nginx counted it,
//! and the drain must be wrk's rate. Two backends: nginx answering at once (many small frames
//! in a segment) and nginx proxying to replicas of 0.2 s (few streams ending at a time).
//!
//! The truth is nginx's: stub_status for the requests it received, its access log for how
//! each ended (499: the client, HAProxy, reset the stream before the answer, which happens to
//! the requests in flight when wrk stops), and wrk's own total for the rate.

use std::{
    net::SocketAddr,
    thread,
    time::{Duration, Instant},
};

use retry_after_testkit::{
    AgentProcess, SETTLE, endpoint_total, free_port,
    http::HttpServer,
    proxies::{Haproxy, Nginx, Wrk},
    sample,
};

/// wrk's connections into HAProxy, and the run's length in seconds.
const CLIENTS: u32 = 300;
const SECONDS: u32 = 16;
/// How long the load runs before the drain is sampled (for 6 s).
const WARM_UP: Duration = Duration::from_secs(9);
/// The drain's EWMA weight of one second (the agent's default `alpha`, the proposal's).
const ALPHA: f64 = 0.3;

/// The share the agent's drain may differ from wrk's rate by, while it was sampled.
const DRAIN_TOLERANCE: f64 = 0.05;

/// One vantage point's counts of nginx's endpoint, from the agent's metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    started: u64,
    completed: u64,
    abandoned: u64,
}

impl Counts {
    /// The counts of `endpoint` on `side` (`server` or `client`) in the agent's `metrics`.
    fn read(metrics: &str, endpoint: SocketAddr, side: &str) -> Self {
        Self {
            started: endpoint_total(metrics, "requests_started", endpoint, side),
            completed: endpoint_total(metrics, "responses_completed", endpoint, side),
            abandoned: endpoint_total(metrics, "requests_abandoned", endpoint, side),
        }
    }
}

/// nginx's `location /`: answer at once, or pass to `replica` (HTTP/1.1, kept alive).
fn nginx_servers(addr: SocketAddr, log: &std::path::Path, replica: Option<SocketAddr>) -> String {
    let (upstream, location) = match replica {
        Some(replica) => (
            format!("  upstream replicas {{ server {replica}; keepalive 512; }}\n"),
            "proxy_pass http://replicas; proxy_http_version 1.1; \
             proxy_set_header Connection \"\";"
                .to_owned(),
        ),
        None => (String::new(), "return 200 \"ok\\n\";".to_owned()),
    };
    format!(
        "{upstream}  log_format ended '$status';\n  server {{ listen {addr} http2; \
         http2_max_concurrent_streams 512; keepalive_requests 10000000; \
         access_log {} ended; location / {{ {location} }} }}",
        log.display()
    )
}

/// The agent's service `name`: nginx's port, counted by HTTP/2 streams, rejected at the proxy
/// (so its drain is the client side's completions: HAProxy's).
fn service(name: &str, nginx: SocketAddr) -> String {
    format!(
        "[[service]]\nname = \"{name}\"\nprotocol = \"http2\"\nbackends = [{{ address = \"{nginx}\" }}]\n\
         [service.backpressure]\nretry_after_policy = \"router_queue_drain_rate\"\n"
    )
}

/// One layout: wrk through HAProxy to nginx (`nginx_addr`) over h2, nginx passing to
/// `replica` if given, watched as the agent's service `label`.
struct Layout {
    label: &'static str,
    nginx_addr: SocketAddr,
    replica: Option<SocketAddr>,
}

/// Run `layout` under `agent`: both vantage points of nginx's port count what nginx received
/// and how it ended, exactly, and the agent's drain (sampled while the load runs) is within
/// [`DRAIN_TOLERANCE`] of wrk's rate meanwhile. What failed is returned, with what was
/// measured.
fn run(agent: &AgentProcess, layout: &Layout) -> Result<String, String> {
    let Layout {
        label,
        nginx_addr,
        replica,
    } = *layout;
    let frontend = free_port();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let nginx = Nginx::start(&nginx_servers(nginx_addr, &log, replica));
    let haproxy = Haproxy::start(
        &format!(
            "frontend fe\n    bind {frontend}\n    default_backend be\n\
             backend be\n    http-reuse always\n    server n1 {nginx_addr} proto h2\n"
        ),
        None,
    );
    let before = nginx.status();
    // What the drain is held to: the proposal's EWMA (0.3 a second) of wrk's own rate, as
    // HAProxy answered it, half a second at a time from wrk's start (seeded by the first
    // half second, as the agent seeds by its first interval), read at each of 12 samples of
    // the agent's drain half a second apart once the seed weighs under 4%. Not wrk's whole
    // run's mean: the rate moves by tenths within seconds on this machine, and an average
    // follows it late.
    let answers = || (Instant::now(), haproxy.stat("fe", "FRONTEND", "hrsp_2xx"));
    let mut last = answers();
    let wrk = Wrk::start(frontend, 2, CLIENTS, SECONDS);
    let series = format!("retry_after_service_drain_rate_per_second{{service=\"{label}\"}}");
    let (mut reference, mut seeded) = (0.0, false);
    let (mut drains, mut references) = (Vec::new(), Vec::new());
    let warm = WARM_UP.as_millis() / 500;
    for i in 0..warm + 12 {
        thread::sleep(Duration::from_millis(500));
        let now = answers();
        let dt = (now.0 - last.0).as_secs_f64();
        let rate = (now.1 - last.1) as f64 / dt;
        reference = if seeded {
            reference + (1.0 - (1.0 - ALPHA).powf(dt)) * (rate - reference)
        } else {
            rate
        };
        seeded |= rate > 0.0;
        last = now;
        if i >= warm
            && let Some(drain) = sample(&agent.metrics(), &series)
        {
            drains.push(drain);
            references.push(reference);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let wrk_ewma = mean(&references);
    let totals = wrk.finish();
    let wrk_rate = totals.requests as f64 / totals.seconds;
    // Everything HAProxy had in flight when wrk stopped is answered or reset, and logged.
    thread::sleep(Duration::from_secs(2));
    // A reading of stub_status is a request of its own.
    let received = nginx.status().requests - before.requests - 1;
    let (answered, reset) = Nginx::endings(&log);
    let truth = Counts {
        started: received,
        completed: answered,
        abandoned: reset,
    };
    let deadline = Instant::now() + SETTLE;
    let (server, client) = loop {
        let metrics = agent.metrics();
        let seen = (
            Counts::read(&metrics, nginx_addr, "server"),
            Counts::read(&metrics, nginx_addr, "client"),
        );
        if seen == (truth, truth) || Instant::now() > deadline {
            break seen;
        }
        thread::sleep(Duration::from_millis(200));
    };
    let drain = mean(&drains);
    let measured = format!(
        "{label}: wrk {} requests in {:.2} s ({wrk_rate:.0}/s); HAProxy: {} backend connections, \
         {} reuses; nginx: {received} received, {answered} answered, {reset} reset; \
         nginx's side {server:?}; HAProxy's side {client:?}; the agent's drain {drain:.0}/s \
         ({} samples; the same EWMA of wrk's answers {wrk_ewma:.0}/s)",
        totals.requests,
        totals.seconds,
        haproxy.stat("be", "n1", "connect"),
        haproxy.stat("be", "n1", "reuse"),
        drains.len()
    );
    let exact = (server, client) == (truth, truth);
    let drained = drains.len() >= 10 && (drain - wrk_ewma).abs() <= DRAIN_TOLERANCE * wrk_ewma;
    if exact && drained {
        Ok(measured)
    } else {
        Err(format!(
            "{measured}\n  exact on both sides: {exact}; drain within {DRAIN_TOLERANCE} of wrk's: {drained} {drains:?}"
        ))
    }
}

/// Both layouts at once under one agent (two services): nginx answering at once (tens of
/// thousands of streams a second on four connections, segments of hundreds of frames), and
/// nginx passing to a replica taking 0.2 s a request (300 streams in flight, ending a few at
/// a time).
#[test]
fn wrk_through_haproxys_h2_backends_is_counted_exactly_on_both_sides_and_drains_at_wrks_rate() {
    let replica = HttpServer::replica(Duration::from_millis(200));
    let layouts = [
        Layout {
            label: "fast",
            nginx_addr: free_port(),
            replica: None,
        },
        Layout {
            label: "slow",
            nginx_addr: free_port(),
            replica: Some(replica.addr()),
        },
    ];
    let services: String = layouts
        .iter()
        .map(|l| service(l.label, l.nginx_addr))
        .collect();
    let agent = AgentProcess::start("", &services);
    let outcomes: Vec<Result<String, String>> = thread::scope(|scope| {
        let runs: Vec<_> = layouts
            .iter()
            .map(|layout| scope.spawn(|| run(&agent, layout)))
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    for outcome in &outcomes {
        match outcome {
            Ok(measured) | Err(measured) => eprintln!("{measured}"),
        }
    }
    let failed: Vec<&String> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    assert!(failed.is_empty(), "{failed:?}");
}
