//! Ray Serve streaming as an LLM engine served by serve.llm streams (`/stream` of
//! `tests/clients/serve_apps.py`): one replica at serve.llm's default `max_ongoing_requests`
//! (1e9, so Serve neither queues nor rejects), the queue inside the replica, its headers at
//! once, then server-sent events. `ray_serve`'s test runs this with its Serve and its agent
//! (service `serve-stream`, `replica_queue = "waiting"`). The truth is the replica's own record
//! of each stream (arrived, first event, ended) and curl's success.

use std::{
    net::SocketAddr,
    process::{Child, Command},
    thread,
    time::{Duration, Instant},
};

use retry_after_protocol::{Response, policy::QueueDepthSource};
use retry_after_testkit::{AgentProcess, endpoint_total, run_stdout, sample};

use crate::streamed_responses::{curl, finish, unix_now};

/// Streams sent at once; the replica's places and each stream's length once it has one
/// (serve_apps.py: STREAM_SLOTS, STREAM_WAIT + STREAM_TOKENS × STREAM_GAP): 16 streams are
/// served four by four over about 10 s, 12 waiting at first.
const STREAMS: u64 = 16;
const SLOTS: u64 = 4;
const STREAM_S: f64 = 2.5;

/// How long before a reading the state it shows may be: the agent reads the kernel once a tick
/// (1 s here), and Serve's proxy stands between the port and the replica's clock.
const STALE_S: f64 = 1.2;
/// And after: the replica's record of an arrival or a first event comes a little after the
/// kernel saw it go by.
const EARLY_S: f64 = 0.2;

/// A guard: the share of readings within the replica's truth (waiting, and in flight).
const HELD_GUARD: f64 = 0.85;

/// How far the agent's mean time to first body byte may be from the replica's: the hops
/// through Serve's proxy.
const WAIT_TOLERANCE_S: f64 = 0.15;

/// What the agent showed at one moment: (waiting, in flight) at Serve's port.
struct Reading {
    at: f64,
    waiting: u64,
    in_flight: u64,
}

/// One stream as the replica recorded it (Unix seconds).
struct Served {
    arrived: f64,
    first: f64,
    ended: f64,
}

pub(crate) fn serve_streams_wait_then_stream_as_its_replica_says(
    serve: SocketAddr,
    agent: &AgentProcess,
) {
    let before = agent.metrics();
    let url = format!("http://{serve}/stream/v1/completions");
    let clients: Vec<Child> = (0..STREAMS)
        .map(|_| curl(&url, &["-N", "-d", "{}"]))
        .collect();
    let (readings, answers) = read_while_streaming(serve, agent);
    finish(clients);
    let after = settled(agent, serve, &before);
    let served = served(serve);
    assert_eq!(
        served.len() as u64,
        STREAMS,
        "the replica served every stream"
    );

    let total = |metrics: &str, name: &str| endpoint_total(metrics, name, serve, "server");
    let delta = |name: &str| total(&after, name) - total(&before, name);
    let counted = [
        "requests_started",
        "responses_completed",
        "responses_inferred",
        "bodies_begun",
        "bodies_ended",
    ]
    .map(delta);
    println!(
        "Serve's streams at its port: {counted:?} (started, completed, inferred, begun, ended)"
    );
    assert_eq!(counted, [STREAMS, STREAMS, 0, STREAMS, STREAMS]);

    let held = hold(&readings, &served);
    println!(
        "Serve's streams: {held} of {} readings within the replica's waiting and in flight",
        readings.len()
    );
    assert!(
        held as f64 >= HELD_GUARD * readings.len() as f64,
        "guard: {held} held"
    );
    assert!(
        readings.iter().any(|r| r.waiting >= STREAMS - SLOTS - 1),
        "the agent saw the queue inside the replica"
    );
    check_answers(&answers, &served);

    let wait_us = delta("first_byte_wait_microseconds") as f64;
    let mean = wait_us / 1e6 / STREAMS as f64;
    let truth = served.iter().map(|s| s.first - s.arrived).sum::<f64>() / STREAMS as f64;
    println!(
        "Serve's streams: mean time to first body byte {mean:.3} s, the replica's {truth:.3} s"
    );
    assert!((mean - truth).abs() <= WAIT_TOLERANCE_S);
}

/// The agent's gauges at Serve's port every 250 ms while the streams are served, and its
/// answers for `serve-stream` (with their moment) while a queue waits.
fn read_while_streaming(
    serve: SocketAddr,
    agent: &AgentProcess,
) -> (Vec<Reading>, Vec<(f64, String)>) {
    let start = Instant::now();
    let length = Duration::from_secs_f64((STREAMS / SLOTS) as f64 * STREAM_S + 1.0);
    let gauge = |metrics: &str, name: &str| {
        sample(
            metrics,
            &format!(
                "retry_after_endpoint_requests_{name}{{endpoint=\"{serve}\",side=\"server\"}}"
            ),
        )
        .unwrap_or(0.0) as u64
    };
    let (mut readings, mut answers) = (Vec::new(), Vec::new());
    while start.elapsed() < length {
        let metrics = agent.metrics();
        readings.push(Reading {
            at: unix_now(),
            waiting: gauge(&metrics, "waiting"),
            in_flight: gauge(&metrics, "in_flight"),
        });
        if (1.5..6.0).contains(&start.elapsed().as_secs_f64()) {
            answers.push((unix_now(), agent.request("QUERY serve-stream").unwrap()));
        }
        thread::sleep(Duration::from_millis(250));
    }
    (readings, answers)
}

/// The agent's metrics once it has counted every stream's end at Serve's port (within 10 s).
fn settled(agent: &AgentProcess, serve: SocketAddr, before: &str) -> String {
    let completed = |metrics: &str| endpoint_total(metrics, "responses_completed", serve, "server");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = agent.metrics();
        if completed(&metrics) >= completed(before) + STREAMS || Instant::now() > deadline {
            return metrics;
        }
        thread::sleep(Duration::from_millis(250));
    }
}

/// The replica's record of the streams it served.
fn served(serve: SocketAddr) -> Vec<Served> {
    let out = run_stdout(
        Command::new("curl")
            .args(["-sS", "--fail"])
            .arg(format!("http://{serve}/stream/served")),
    );
    let records: Vec<[f64; 3]> = serde_json::from_str(out.trim()).expect("the replica's record");
    records
        .into_iter()
        .map(|[arrived, first, ended]| Served {
            arrived,
            first,
            ended,
        })
        .collect()
}

/// The replica's (waiting, in flight) at `t`.
fn truth(served: &[Served], t: f64) -> (u64, u64) {
    let count = |f: &dyn Fn(&Served) -> bool| served.iter().filter(|s| f(s)).count() as u64;
    (
        count(&|s: &Served| s.arrived <= t && t < s.first),
        count(&|s: &Served| s.arrived <= t && t < s.ended),
    )
}

/// The replica's (waiting, in flight) over the moments a reading at `t` may show, each as its
/// least and most.
fn truth_around(served: &[Served], t: f64) -> [(u64, u64); 2] {
    let moments = (0..=28).map(|i| t - STALE_S + f64::from(i) * (STALE_S + EARLY_S) / 28.0);
    let truths: Vec<(u64, u64)> = moments.map(|m| truth(served, m)).collect();
    let range = |f: fn(&(u64, u64)) -> u64| {
        let values = truths.iter().map(f);
        (values.clone().min().unwrap(), values.max().unwrap())
    };
    [range(|t| t.0), range(|t| t.1)]
}

/// How many readings show a waiting and an in flight the replica had around their moment.
fn hold(readings: &[Reading], served: &[Served]) -> usize {
    readings
        .iter()
        .filter(|r| {
            let [waiting, in_flight] = truth_around(served, r.at);
            (waiting.0..=waiting.1).contains(&r.waiting)
                && (in_flight.0..=in_flight.1).contains(&r.in_flight)
        })
        .count()
}

/// The agent's answers for `serve-stream` read the queue as what waits for a first body byte,
/// a depth the replica had around the moment asked.
fn check_answers(answers: &[(f64, String)], served: &[Served]) {
    let mut with_depth = 0;
    for (at, line) in answers {
        let Ok(Response::RetryAfter(answer)) = Response::parse(line) else {
            panic!("not an answer: {line}");
        };
        let Some(depth) = answer.queue_depth else {
            continue; // not computing yet (the drain warms)
        };
        assert_eq!(
            answer.queue_depth_source,
            Some(QueueDepthSource::Waiting),
            "{line}"
        );
        let [waiting, _] = truth_around(served, *at);
        assert!(
            (waiting.0..=waiting.1).contains(&depth),
            "{line}: the replica's waiting {waiting:?}"
        );
        with_depth += 1;
    }
    println!(
        "Serve's streams: {with_depth} of {} answers with a depth, each the replica's",
        answers.len()
    );
    assert!(with_depth > 0, "no answer had a depth: {answers:?}");
}
