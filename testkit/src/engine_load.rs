//! An engine under load, a second at a time: what the agent says of a service (its depth and
//! drain gauges, its answer to a proxy's `QUERY`) beside what vLLM counts, and the rates made
//! of vLLM's own counts that the agent's figures are held to.

use std::{
    path::Path,
    process::Command,
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use crate::{
    AgentProcess,
    engine::{Vllm, VllmCounts},
    sample,
};

/// One reading under load: what the agent says of a service, then vLLM's counts.
#[derive(Clone, Copy, Debug)]
pub struct Second {
    /// Seconds since the load began.
    pub at: f64,
    /// The wall clock then, seconds since the epoch (the clients' records use it).
    pub epoch: f64,
    /// The agent's `queue_depth` gauge (none: no source sees the queue).
    pub depth: Option<f64>,
    /// The agent's drain rate, completions a second.
    pub drain: f64,
    /// The agent's answer to a proxy's QUERY, in milliseconds (none: no answer computed).
    pub answer_ms: Option<f64>,
    /// vLLM's counts, read just after the agent's.
    pub engine: VllmCounts,
}

impl Second {
    /// Read the agent's `service`, then `engine`, `start` being when the load began.
    pub fn read(agent: &AgentProcess, service: &str, engine: &Vllm, start: Instant) -> Self {
        let metrics = agent.metrics();
        let gauge = |name: &str| sample(&metrics, &format!("{name}{{service=\"{service}\"}}"));
        let answer = agent
            .request(&format!("QUERY {service}"))
            .unwrap_or_default();
        let millis = answer
            .split_whitespace()
            .find_map(|f| f.strip_prefix("millis="))
            .and_then(|m| m.parse().ok());
        let computed = answer.contains("rung=computed");
        Self {
            at: start.elapsed().as_secs_f64(),
            epoch: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs_f64(),
            depth: gauge("retry_after_service_queue_depth"),
            drain: gauge("retry_after_service_drain_rate_per_second").unwrap_or(0.0),
            answer_ms: millis.filter(|_| computed),
            engine: engine.counts(),
        }
    }
}

impl Second {
    /// The reading in a table's row: seconds; the agent's depth, drain and answer; vLLM's
    /// waiting and running.
    pub fn describe(&self) -> String {
        format!(
            "{:5.1} | {:?} {:.2} {:?} | {} {}",
            self.at,
            self.depth,
            self.drain,
            self.answer_ms,
            self.engine.waiting,
            self.engine.running
        )
    }
}

/// vLLM's completions a second over the `window` readings before reading `i` (none that
/// early).
pub fn completion_rate(seconds: &[Second], i: usize, window: usize) -> Option<f64> {
    let before = seconds.get(i.checked_sub(window)?)?;
    let now = &seconds[i];
    Some((now.engine.finished - before.engine.finished) / (now.at - before.at))
}

/// The proposal's drain rate (an EWMA of completions a second, `alpha` 0.3 a second, seeded
/// by the first interval, as `estimator/src/drain_rate.rs` computes it) of vLLM's own
/// completions at each reading, plus `scrapes_a_reading` requests the reader makes of the
/// engine that the agent counts too: what the agent's drain should be if its counts are
/// vLLM's. (Completions come in batches: a window's plain rate swings further than 5% from
/// one second to the next.)
pub fn drain_of_completions(seconds: &[Second], scrapes_a_reading: f64) -> Vec<Option<f64>> {
    let mut average: Option<f64> = None;
    let mut drains = vec![None];
    for pair in seconds.windows(2) {
        let dt = pair[1].at - pair[0].at;
        let finished = pair[1].engine.finished - pair[0].engine.finished;
        let rate = (finished + scrapes_a_reading) / dt;
        let weight = 1.0 - (1.0 - 0.3f64).powf(dt);
        average = Some(match average {
            Some(a) => a + weight * (rate - a),
            None => rate,
        });
        drains.push(average);
    }
    drains
}

/// What `engine` completes a second of `tokens`-token answers with its batch of `batch` full:
/// closed-loop clients, two a place in the batch, for 8 s (tests/clients/engine_clients.py),
/// counted by vLLM.
pub fn capacity(engine: &Vllm, batch: u32, tokens: u32) -> f64 {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/clients/engine_clients.py");
    let before = engine.counts().finished;
    let start = Instant::now();
    let out = Command::new("python3")
        .arg(script)
        .arg(engine.addr().to_string())
        .args(["closed", &(2 * batch).to_string(), "8", &tokens.to_string()])
        .arg("stream")
        .output()
        .expect("python3 runs the engine's clients");
    assert!(out.status.success(), "{out:?}");
    (engine.counts().finished - before) / start.elapsed().as_secs_f64()
}
