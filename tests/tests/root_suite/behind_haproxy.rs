//! The answer behind a real proxy: the distribution's HAProxy with `maxconn 2` per server in
//! front of two slow replicas on loopback, wrk as the clients, HAProxy's own stats socket as
//! the truth of its queue.
//!
//! The layout the proposal was written for: the proxy caps concurrency per replica, so the
//! replicas never hold more than their capacity and the queue is in the proxy. With the
//! proxy's listener declared (`frontend`), the agent sees that queue and divides it by the
//! proxy's own (client-side) completions; without it, no kernel source can see the queue and
//! the answer is the static rung, saying why.

use std::{
    thread,
    time::{Duration, Instant},
};

use retry_after_protocol::{
    QueryResponse, Request, Response,
    policy::{FallbackReason, QueueDepthSource, Rung},
};
use retry_after_testkit::{
    AgentProcess, TestCgroup, free_port,
    http::{HttpServer, ServerOptions},
    proxies::{Haproxy, Wrk},
};

/// Each replica takes 250 ms per request; HAProxy lets 2 at a time into each.
const SERVICE_TIME: Duration = Duration::from_millis(250);
const SLOTS_PER_REPLICA: u64 = 2;
const REPLICAS: u64 = 2;
/// wrk connections, each with one request outstanding at a time.
const CLIENTS: u64 = 60;

/// How far the agent's depth may be from HAProxy's own `qcur` read beside it, and from the
/// queue by hand: a tolerance, the two being read a moment apart while the queue moves (16
/// requests a second leave it, and as many enter).
const DEPTH_TOLERANCE: u64 = 6;
/// How far the agent's mean drain may be from wrk's own rate over the run (its EWMA warms
/// from the run's start) and from the fleet's capacity by hand (wrk's rate itself wanders).
const DRAIN_TOLERANCE_WRK: f64 = 0.1;
const DRAIN_TOLERANCE_BY_HAND: f64 = 0.15;

fn replica() -> HttpServer {
    HttpServer::start(
        "127.0.0.1:0",
        ServerOptions {
            response_body: 200,
            service_time: SERVICE_TIME,
            ..Default::default()
        },
    )
}

fn haproxy_sections(frontend: std::net::SocketAddr, replicas: &[&HttpServer]) -> String {
    let servers: String = replicas
        .iter()
        .enumerate()
        .map(|(i, r)| format!("    server r{i} {} maxconn {SLOTS_PER_REPLICA}\n", r.addr()))
        .collect();
    format!(
        "frontend fe\n    bind {frontend}\n    default_backend replicas\n\
         backend replicas\n    balance roundrobin\n{servers}"
    )
}

fn service(name: &str, replicas: &[&HttpServer], frontend: Option<std::net::SocketAddr>) -> String {
    let backends: Vec<String> = replicas
        .iter()
        .map(|r| {
            format!(
                "{{ address = \"{}\", max_ongoing_requests = {SLOTS_PER_REPLICA} }}",
                r.addr()
            )
        })
        .collect();
    let frontend = frontend.map_or(String::new(), |f| format!("frontend = \"{f}\"\n"));
    format!(
        "[[service]]\nname = \"{name}\"\n{frontend}backends = [{}]\n[service.backpressure]\n\
         retry_after_policy = \"router_queue_drain_rate\"\nretry_after_s = 7\njitter = 0.0\n",
        backends.join(", ")
    )
}

fn query(agent: &AgentProcess, service: &str, queue_depth: Option<u64>) -> QueryResponse {
    let request = Request::Query {
        service,
        queue_depth,
        backoff_streak: None,
    };
    let line = agent.request(&request.to_string()).unwrap();
    match Response::parse(&line) {
        Ok(Response::RetryAfter(answer)) => answer,
        other => panic!("{request}: {line} ({other:?})"),
    }
}

/// Wait (at most 12 s) until the service's answer is computed: the drain rate is warm.
fn wait_until_computed(agent: &AgentProcess, service: &str) {
    let deadline = Instant::now() + Duration::from_secs(12);
    loop {
        let answer = query(agent, service, None);
        if answer.rung == Rung::Computed {
            return;
        }
        assert!(Instant::now() < deadline, "never warm: {answer}");
        thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn with_the_frontend_the_answer_is_the_proxys_queue_over_its_drain_and_without_it_static() {
    let (r1, r2) = (replica(), replica());
    let frontend = free_port();
    let agent = AgentProcess::start(
        "",
        &(service("seen", &[&r1, &r2], Some(frontend)) + &service("unseen", &[&r1, &r2], None)),
    );
    let haproxy = Haproxy::start(&haproxy_sections(frontend, &[&r1, &r2]), None);
    let wrk = Wrk::start(frontend, 2, CLIENTS as u32, 16);

    // By hand: 4 slots of 250 ms drain 16/s; 60 outstanding minus 4 in service = 56 queued in
    // HAProxy; occupancy 4/4 = 1, so the factor is 1 + 0.25 = 1.25:
    // 56 / 16 × 1.25 = 4.375 → 5 s.
    let drain = (REPLICAS * SLOTS_PER_REPLICA) as f64 / SERVICE_TIME.as_secs_f64();
    let queued = CLIENTS - REPLICAS * SLOTS_PER_REPLICA;
    let by_hand = (queued as f64 / drain * 1.25).ceil() as u64;

    wait_until_computed(&agent, "seen");
    thread::sleep(Duration::from_secs(2));
    let mut drains = Vec::new();
    for _ in 0..6 {
        let seen = query(&agent, "seen", None);
        let haproxy_queue = haproxy.stat("replicas", "BACKEND", "qcur");
        assert_eq!(seen.rung, Rung::Computed, "{seen}");
        assert_eq!(
            seen.queue_depth_source,
            Some(QueueDepthSource::Frontend),
            "{seen}"
        );
        let depth = seen.queue_depth.unwrap();
        assert!(
            depth.abs_diff(haproxy_queue) <= DEPTH_TOLERANCE
                && depth.abs_diff(queued) <= DEPTH_TOLERANCE,
            "depth {depth}: HAProxy's own queue {haproxy_queue}, by hand {queued}"
        );
        let seconds = seen.seconds.unwrap();
        assert!(
            seconds.abs_diff(by_hand) <= 1,
            "{seconds} s against {by_hand} s by hand: {seen}"
        );
        drains.push(seen.drain_rate.unwrap());
        eprintln!(
            "seen: {seconds} s, depth {depth} (HAProxy qcur {haproxy_queue}), drain {:.2}/s",
            seen.drain_rate.unwrap()
        );

        let unseen = query(&agent, "unseen", None);
        assert_eq!(
            (unseen.seconds, unseen.rung, unseen.reason),
            (Some(7), Rung::Static, Some(FallbackReason::QueueInvisible)),
            "no frontend, no depth from the proxy: {unseen}"
        );
        // The proxy's own depth makes it computable: 56 / 16 × 1.25 again.
        let told = query(&agent, "unseen", Some(queued));
        assert_eq!(told.rung, Rung::Computed, "{told}");
        assert!(told.seconds.unwrap().abs_diff(by_hand) <= 1, "{told}");
        thread::sleep(Duration::from_millis(500));
    }
    let totals = wrk.finish();
    let wrk_rate = totals.requests as f64 / totals.seconds;
    let mean_drain = drains.iter().sum::<f64>() / drains.len() as f64;
    eprintln!("drain: agent {mean_drain:.2}/s, wrk {wrk_rate:.2}/s, by hand {drain}/s");
    assert!(
        (mean_drain - wrk_rate).abs() <= DRAIN_TOLERANCE_WRK * wrk_rate
            && (mean_drain - drain).abs() <= DRAIN_TOLERANCE_BY_HAND * drain,
        "agent drain {mean_drain:.2}/s, wrk's {wrk_rate:.2}/s, by hand {drain}/s"
    );
}

#[test]
fn the_drain_is_this_proxys_own_throughput_when_another_caller_shares_the_replicas() {
    let cgroup = TestCgroup::create("retry-after-test-proxy");
    let (r1, r2) = (replica(), replica());
    let frontend = free_port();
    let scoped = service("api", &[&r1, &r2], Some(frontend)).replace(
        "[[service]]\n",
        &format!(
            "[[service]]\nproxy_cgroup = \"{}\"\n",
            cgroup.path().display()
        ),
    );
    let agent = AgentProcess::start("", &scoped);
    let haproxy = Haproxy::start(
        &haproxy_sections(frontend, &[&r1, &r2]),
        Some(cgroup.path()),
    );
    // The proxy's clients, and a second caller on this node that goes to a replica directly
    // (another process, in another cgroup): 10 connections × 4/s = 40 more completions a
    // second at the replicas, none of them this proxy's.
    let through_proxy = Wrk::start(frontend, 1, 30, 14);
    let other_caller = Wrk::start(r1.addr(), 1, 10, 14);

    wait_until_computed(&agent, "api");
    thread::sleep(Duration::from_secs(3));
    let mut drains = Vec::new();
    for _ in 0..6 {
        let answer = query(&agent, "api", None);
        assert_eq!(answer.rung, Rung::Computed, "{answer}");
        drains.push(answer.drain_rate.unwrap());
        thread::sleep(Duration::from_millis(500));
    }
    let metrics = agent.metrics();
    let proxy = through_proxy.finish();
    let other = other_caller.finish();
    let proxy_rate = proxy.requests as f64 / proxy.seconds;
    let other_rate = other.requests as f64 / other.seconds;
    let drain = drains.iter().sum::<f64>() / drains.len() as f64;
    eprintln!(
        "drain {drain:.2}/s; this proxy's wrk {proxy_rate:.2}/s; the other caller's {other_rate:.2}/s"
    );
    assert!(other_rate > 30.0, "the other caller ran: {other_rate}/s");
    assert!(
        (drain - proxy_rate).abs() <= DRAIN_TOLERANCE_WRK * proxy_rate,
        "the drain follows this proxy ({proxy_rate:.2}/s), not the replicas' total \
         ({:.2}/s): {drain:.2}/s",
        proxy_rate + other_rate
    );
    let out_of_scope = retry_after_testkit::sample(
        &metrics,
        "retry_after_probe_problems{kind=\"connections_out_of_scope\"}",
    )
    .expect("the out-of-scope series");
    assert!(
        out_of_scope >= 10.0,
        "the other caller's 10 connections: {out_of_scope}"
    );
    drop(haproxy);
    drop(cgroup);
}
