//! The agent against a real LLM engine's own counts: vLLM's CPU engine (`testkit::engine`)
//! with a batch of 8, driven past it by closed-loop clients (`tests/clients/engine_clients.py`),
//! streamed and not. vLLM's `/metrics` is the truth: `vllm:num_requests_waiting` (its queue),
//! `…_running` (its batch) and `…_request_success_total` (finished). The agent watches the
//! engine's port; its reading of the server side, taken just before each scrape, is held to
//! the scrape. Then open-loop clients at 1.7 times what the engine completes, streamed and
//! not, with the agent's own process watching the port as services in replica scope: its
//! depth and drain each second against vLLM's waiting and completions, and its answers. Last,
//! with the same engine, the OpenAI SDK streaming through nginx and HAProxy in front of it
//! (`llm_gateway`).
//!
//! What the kernel cannot tell apart: a request the server has read but not yet handed to the
//! engine (its API server tokenizes and queues it first), or one in prefill (scheduled, its
//! first token not out), has no body byte yet, so the agent counts it waiting where vLLM
//! counts it running or not at all; and vLLM's gauges are those of its last step. So the
//! agent never sees less queue than vLLM (at every reading), and sees the same within 10% or 2
//! at most readings: the target is every reading, and it is not met (docs/evaluation.md).

use std::{
    process::Command,
    thread,
    time::{Duration, Instant},
};

use retry_after_common::{EndpointCounters, Side};
use retry_after_estimator::endpoint::Endpoint;
use retry_after_testkit::{
    AgentProcess, AttachedProbe, SETTLE,
    engine::{Vllm, VllmCounts},
    engine_load::{self, Second, completion_rate, drain_of_completions},
    free_port, quiet,
};

/// The engine's batch (`--max-num-seqs`).
const BATCH: u32 = 8;
/// Clients at once: three times the batch, so that two thirds of them wait.
const CLIENTS: u32 = 24;
/// Tokens an answer.
const TOKENS: u32 = 32;
/// How far the agent's waiting (and in flight) may be from vLLM's: 10% of vLLM's, or 2.
fn within(agent: u64, engine: f64) -> bool {
    (agent as f64 - engine).abs() <= (engine * 0.1).max(2.0)
}

/// A guard, not the target: the share of readings at which the agent's waiting (and in
/// flight) is within 10% or 2 of vLLM's. The target is every reading; measured 0.59 to 0.97
/// (0.59: streamed waiting, this test alone after its engine had waited 138 s for the quiet
/// lock, 2026-12-07; 0.97 and 0.75 the same day; 0.69 whole answers' in flight in a fresh
/// clone's run, 2026-12-06; every miss the agent above vLLM: requests the API server held
/// before the engine took them, or vLLM's gauges a step late).
const AGREES_GUARD: f64 = 0.5;

/// One reading: the agent's counters of the engine's port, then vLLM's own counts.
struct Reading {
    agent: EndpointCounters,
    engine: VllmCounts,
}

/// Run the clients (`stream` or whole answers) for `seconds`, reading the agent and the
/// engine every half second from the third second on; their totals and the readings.
fn run(engine: &Vllm, probe: &AttachedProbe, stream: bool, seconds: u64) -> (String, Vec<Reading>) {
    let endpoint = Endpoint::from(engine.addr());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/engine_clients.py");
    let clients = Command::new("python3")
        .arg(script)
        .arg(engine.addr().to_string())
        .arg("closed")
        .args([CLIENTS.to_string(), seconds.to_string(), TOKENS.to_string()])
        .arg(if stream { "stream" } else { "whole" })
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs the engine's clients");
    let start = Instant::now();
    thread::sleep(Duration::from_secs(3));
    let mut readings = Vec::new();
    while start.elapsed() < Duration::from_secs(seconds - 1) {
        let agent = probe.counters(endpoint, Side::Server).counters;
        readings.push(Reading {
            agent,
            engine: engine.counts(),
        });
        thread::sleep(Duration::from_millis(500));
    }
    let out = clients.wait_with_output().expect("the clients finish");
    assert!(out.status.success(), "{out:?}");
    (
        String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        readings,
    )
}

/// The share of `readings` where `agrees` holds, printed with what each side saw.
fn share(readings: &[Reading], what: &str, agrees: impl Fn(&Reading) -> bool) -> f64 {
    let held = readings.iter().filter(|r| agrees(r)).count();
    for r in readings {
        println!(
            "{what}: agent in flight {} waiting {} | vLLM running {} waiting {}",
            r.agent.in_flight(),
            r.agent.waiting(),
            r.engine.running,
            r.engine.waiting
        );
    }
    held as f64 / readings.len() as f64
}

/// One engine for both: it takes about 50 s to start. `./dev test` starts this test niced
/// beside the lanes, so the engine starts there; its load waits for a quiet machine.
#[test]
fn the_agent_sees_the_engine_queue_and_drain_as_vllm_counts_them() {
    let started = Instant::now();
    let engine = Vllm::start(free_port(), BATCH);
    let up = started.elapsed();
    let waited = quiet::wait_for_quiet();
    println!("vLLM up in {up:.1?}, then {waited:.1?} waiting for a quiet machine");
    closed_loop_is_read_as_vllm_counts_it(&engine);
    let capacity = open_loop_past_the_engine_s_capacity_is_read_as_vllm_counts_it(&engine);
    crate::llm_gateway::the_sdk_streaming_through_proxies_comes_back_when_the_engine_has_room(
        &engine, BATCH, capacity,
    );
}

/// Closed-loop clients, three a place in the batch, read by a probe of the test's own.
fn closed_loop_is_read_as_vllm_counts_it(engine: &Vllm) {
    let endpoint = Endpoint::from(engine.addr());
    let probe = AttachedProbe::watching(&[endpoint]);
    let before = engine.counts();
    let (streamed, readings) = run(engine, &probe, true, 15);
    println!("streamed: {streamed}");
    // The queue: what waits for its first token, as vLLM's scheduler counts it.
    let waiting = share(&readings, "streamed", |r| {
        within(r.agent.waiting(), r.engine.waiting)
    });
    let in_flight = share(&readings, "streamed", |r| {
        within(r.agent.in_flight(), r.engine.waiting + r.engine.running)
    });
    assert!(
        readings.iter().any(|r| r.engine.waiting >= 8.0),
        "the engine was never loaded past its batch"
    );
    // Drain: every request vLLM finished, counted at its answer's last byte (the agent also
    // counts each scrape of /metrics, one a reading, and the one before the run).
    let after = engine.counts();
    let c = probe
        .wait_for(endpoint, Side::Server, SETTLE, "every answer ended", |s| {
            s.in_flight() == 0
        })
        .counters;
    let scrapes = readings.len() as u64 + 2;
    let finished = (after.finished - before.finished) as u64;
    assert_eq!(c.responses_served(), finished + scrapes, "{c:?}");
    assert_eq!(
        (c.responses_inferred, c.requests_abandoned),
        (0, 0),
        "{c:?}"
    );
    println!("streamed: waiting agreed {waiting:.2}, in flight {in_flight:.2}");
    for r in &readings {
        assert!(
            r.agent.waiting() as f64 >= r.engine.waiting - 2.0,
            "the agent saw less queue than vLLM: {} < {}",
            r.agent.waiting(),
            r.engine.waiting
        );
    }
    assert!(
        waiting >= AGREES_GUARD,
        "waiting agreed at {waiting:.2} of readings"
    );
    assert!(
        in_flight >= AGREES_GUARD,
        "in flight agreed at {in_flight:.2} of readings"
    );

    // Whole answers: they wait until their last byte, so only in flight is held.
    let (whole, readings) = run(engine, &probe, false, 8);
    println!("whole: {whole}");
    let in_flight = share(&readings, "whole", |r| {
        within(r.agent.in_flight(), r.engine.waiting + r.engine.running)
    });
    println!("whole: in flight agreed {in_flight:.2}");
    assert!(
        in_flight >= AGREES_GUARD,
        "in flight agreed at {in_flight:.2} of readings"
    );
}

/// Answers of the open-loop runs, in tokens: long enough that the engine completes far fewer
/// a second than the clients can send.
const OPEN_TOKENS: u32 = 256;
/// Arrivals in the open-loop runs: this many times what the engine completes with its batch
/// full (measured at the start of the test: closed-loop clients, two a place in the batch).
const OVERLOAD: f64 = 1.7;
/// How long the arrivals last.
const OPEN_SECONDS: u64 = 10;

/// The agent's services of the engine's port, in replica scope, without jitter: `chat` reads
/// the queue as what waits for a first body byte (no capacity), `chat-whole` as what is in
/// flight beyond the batch (for answers that are not streamed).
fn engine_services(engine: &Vllm) -> String {
    let service = |name: &str, queue: &str, capacity: &str| {
        format!(
            "[[service]]\nname = \"{name}\"\nrejected_at = \"replica\"\nreplica_queue = \"{queue}\"\nbackends = [{{ address = \"{}\"{capacity} }}]\n[service.backpressure]\nretry_after_policy = \"router_queue_drain_rate\"\nretry_after_s = 5\njitter = 0.0\n",
            engine.addr()
        )
    };
    service("chat", "waiting", "")
        + &service(
            "chat-whole",
            "beyond_capacity",
            &format!(", max_ongoing_requests = {BATCH}"),
        )
}

/// Send `rate` requests a second (`stream` or whole answers) for [`OPEN_SECONDS`], and
/// read the agent's `service` and the engine every second until the engine is idle again:
/// the clients' totals and the seconds.
fn open_loop(
    engine: &Vllm,
    agent: &AgentProcess,
    (service, rate): (&str, f64),
    stream: bool,
) -> (String, Vec<Second>) {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/engine_clients.py");
    let clients = Command::new("python3")
        .arg(script)
        .arg(engine.addr().to_string())
        .args(["open", &format!("{rate:.2}"), &OPEN_SECONDS.to_string()])
        .arg(OPEN_TOKENS.to_string())
        .arg(if stream { "stream" } else { "whole" })
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs the engine's clients");
    let start = Instant::now();
    let mut seconds = Vec::new();
    loop {
        thread::sleep(Duration::from_secs(1));
        let second = Second::read(agent, service, engine, start);
        let idle = second.engine.waiting + second.engine.running == 0.0;
        seconds.push(second);
        let over = start.elapsed() > Duration::from_secs(OPEN_SECONDS + 2);
        if (over && idle) || start.elapsed() > Duration::from_secs(180) {
            break;
        }
    }
    let out = clients.wait_with_output().expect("the clients finish");
    assert!(out.status.success(), "{out:?}");
    (
        String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        seconds,
    )
}

/// What an open-loop run shows, printed as a table a second a row: the shares of the seconds
/// under load where the agent's depth is within 10% or 2 of vLLM's waiting, and its drain
/// within 5% of the proposal's drain rate of vLLM's completions ([`drain_of_completions`]), and the
/// answers' ratios to the time vLLM's queue then took to drain at vLLM's own rate.
fn open_loop_figures(label: &str, seconds: &[Second]) -> (f64, f64, Vec<f64>) {
    let (mut depth_held, mut drain_held, mut loaded, mut ratios) = (0, 0, 0, Vec::new());
    let drains = drain_of_completions(seconds, 1.0);
    println!(
        "{label}: second | agent depth, drain, answer | vLLM waiting, running, completions/s, drain"
    );
    for (i, s) in seconds.iter().enumerate() {
        let rate = completion_rate(seconds, i, 5);
        println!("{label}: {} {rate:?} {:?}", s.describe(), drains[i]);
        let Some(rate) = rate.filter(|_| s.engine.waiting >= 2.0 * f64::from(BATCH)) else {
            continue;
        };
        loaded += 1;
        let depth = s.depth.unwrap_or(0.0);
        depth_held +=
            usize::from((depth - s.engine.waiting).abs() <= (0.1 * s.engine.waiting).max(2.0));
        let drain = drains[i].unwrap_or(0.0);
        drain_held += usize::from((s.drain - drain).abs() <= 0.05 * drain);
        if let Some(ms) = s.answer_ms {
            ratios.push(ms / 1000.0 / (s.engine.waiting / rate));
        }
    }
    assert!(
        loaded >= 5,
        "{label}: the engine's queue never held two batches for 5 s"
    );
    (
        depth_held as f64 / loaded as f64,
        drain_held as f64 / loaded as f64,
        ratios,
    )
}

/// A guard, not the target (every second): the share of loaded seconds at which the depth is
/// within 10% or 2 of vLLM's waiting (measured 0.92 streamed, 1.00 not: docs/integrations/vllm.md).
const OPEN_DEPTH_GUARD: f64 = 0.75;
/// A guard, not the target (every second): the share of loaded seconds at which the drain is
/// within 5% of the drain rate of vLLM's completions (measured 0.71 streamed, 0.78 not).
const OPEN_DRAIN_GUARD: f64 = 0.5;

/// Open-loop arrivals at [`OVERLOAD`] times the engine's capacity, read by the agent's own
/// process as a proxy would ask it; what the engine completes a second with its batch full.
fn open_loop_past_the_engine_s_capacity_is_read_as_vllm_counts_it(engine: &Vllm) -> f64 {
    let agent = AgentProcess::start("", &engine_services(engine));
    let capacity = engine_load::capacity(engine, BATCH, OPEN_TOKENS);
    println!("the engine completes {capacity:.2} answers a second with its batch full");
    for (service, stream) in [("chat", true), ("chat-whole", false)] {
        let label = if stream {
            "open, streamed"
        } else {
            "open, whole"
        };
        let served = (service, OVERLOAD * capacity);
        let (totals, seconds) = open_loop(engine, &agent, served, stream);
        println!("{label}: {totals}");
        let (depth, drain, mut ratios) = open_loop_figures(label, &seconds);
        ratios.sort_by(f64::total_cmp);
        let within = ratios.iter().filter(|r| (1.0..=1.5).contains(*r)).count();
        println!(
            "{label}: depth held {depth:.2}, drain held {drain:.2}; answers within [1, 1.5] x the queue's drain: {within} of {}, ratios {:.2}..{:.2}, median {:.2}",
            ratios.len(),
            ratios.first().unwrap_or(&0.0),
            ratios.last().unwrap_or(&0.0),
            ratios.get(ratios.len() / 2).unwrap_or(&0.0),
        );
        assert!(
            depth >= OPEN_DEPTH_GUARD,
            "{label}: depth held at {depth:.2}"
        );
        assert!(
            drain >= OPEN_DRAIN_GUARD,
            "{label}: drain held at {drain:.2}"
        );
    }
    capacity
}
