//! One run: a scenario under a policy, on loopback, with the real agent.

use std::{
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use super::{
    Policy, Scenario,
    load::{Attempt, Load, arrivals},
};
use retry_after_reference_proxy::{Proxy, ProxyConfig, Rejection};
use retry_after_testkit::{AgentProcess, replica::Replica};

/// Attempts a client makes at most.
pub const MAX_ATTEMPTS: u32 = 8;
/// How long a run waits after its schedule for clients still waiting to retry.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(40);
/// How often idle capacity is sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// What one run produced.
#[derive(Clone, Debug)]
pub struct RunResult {
    /// The scenario's name.
    pub scenario: &'static str,
    /// The policy.
    pub policy: Policy,
    /// Every attempt of every client.
    pub attempts: Vec<Attempt>,
    /// Clients that arrived (warm-up included).
    pub clients: usize,
    /// Clients that arrived during the warm-up (not measured).
    pub warm_up_clients: usize,
    /// Length of the warm-up.
    pub warm_up: Duration,
    /// Length of the measured schedule, seconds.
    pub measured_s: f64,
    /// Replica-seconds of idle capacity while at least one measured client waited to retry.
    pub idle_replica_s_while_waiting: f64,
    /// Clients still unfinished when the run ended.
    pub unfinished: usize,
    /// The agent's metrics at the end of the run.
    pub agent_metrics: String,
    /// The proxy's access log (one line per rejection).
    pub access_log: Vec<Rejection>,
}

/// Run `scenario` under `policy`; `seed` fixes the arrivals, the service times and every
/// random draw of the proxy and the clients; `progress` is told the share done, now and then.
pub fn run(
    scenario: &Scenario,
    policy: Policy,
    seed: u64,
    mut progress: impl FnMut(f64),
) -> RunResult {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let replicas: Vec<Replica> = runtime.block_on(async {
        let mut replicas = Vec::new();
        for (i, spec) in scenario.replicas.iter().enumerate() {
            replicas.push(
                Replica::start(*spec, seed.wrapping_add(1 + i as u64))
                    .await
                    .expect("start a replica"),
            );
        }
        replicas
    });
    let backends: Vec<String> = replicas
        .iter()
        .map(|r| {
            format!(
                "{{ address = \"{}\", max_ongoing_requests = {} }}",
                r.addr(),
                scenario.max_ongoing_requests
            )
        })
        .collect();
    let service = format!(
        "[[service]]\nname = \"eval\"\nmax_queued_requests = {}\nbackends = [{}]\n[service.backpressure]\n{}",
        scenario.max_queued_requests,
        backends.join(", "),
        policy.backpressure()
    );
    let agent = AgentProcess::start("", &service);
    let arrivals = arrivals(&scenario.phases, seed);
    let warm_up = scenario.warm_up();
    let warm_up_clients = arrivals.iter().take_while(|&&t| t < warm_up).count();
    let (load, idle, proxy) = runtime.block_on(async {
        let proxy = Proxy::start(
            ProxyConfig {
                service: "eval".to_owned(),
                replicas: replicas
                    .iter()
                    .map(|r| (r.addr(), scenario.max_ongoing_requests))
                    .collect(),
                max_queued_requests: scenario.max_queued_requests,
                status_code: 429,
                header: policy.header(),
                seed,
                record_rejections: true,
            },
            &agent.socket,
        )
        .await
        .expect("start the proxy");
        let load = Load::start(
            proxy.addr(),
            arrivals,
            policy.behaviour(),
            MAX_ATTEMPTS,
            seed,
        );
        let length = scenario.length();
        let mut idle = 0.0;
        let mut ticker = tokio::time::interval(SAMPLE_EVERY);
        let mut stopped = false;
        let mut last_report = Instant::now();
        loop {
            ticker.tick().await;
            let elapsed = load.started().elapsed();
            if let Some((index, at)) = scenario.stop_replica
                && !stopped
                && elapsed >= at
            {
                replicas[index].stop();
                stopped = true;
            }
            if elapsed >= warm_up && load.waiting.load(Ordering::Relaxed) > 0 {
                idle += SAMPLE_EVERY.as_secs_f64() * proxy.idle_replicas();
            }
            if last_report.elapsed() >= Duration::from_millis(500) {
                last_report = Instant::now();
                progress((elapsed.as_secs_f64() / (length + DRAIN_LIMIT).as_secs_f64()).min(1.0));
            }
            if elapsed >= length && load.finished() || elapsed >= length + DRAIN_LIMIT {
                break;
            }
        }
        (load, idle, proxy)
    });
    // The proxy reports every 200 ms: let the last counts reach the agent before its metrics
    // are read.
    std::thread::sleep(Duration::from_millis(600));
    let attempts = load.attempts();
    let result = RunResult {
        scenario: scenario.name,
        policy,
        clients: load.clients(),
        warm_up_clients,
        warm_up,
        measured_s: (scenario.length() - warm_up).as_secs_f64(),
        idle_replica_s_while_waiting: idle,
        unfinished: load.unfinished(),
        agent_metrics: agent.metrics(),
        access_log: proxy.rejections(),
        attempts,
    };
    drop(proxy);
    drop(load);
    runtime.shutdown_timeout(Duration::from_secs(1));
    drop(replicas);
    drop(agent);
    result
}
