//! The real-socket run: a scenario under a policy, on loopback, with the real agent watching
//! the replicas from the kernel, the reference proxies in front and open-loop clients.
//!
//! One proxy: several proxies sharing replicas need replicas that hold their own
//! `max_ongoing_requests`, which the replica servers do not (each proxy would fill every
//! replica to its cap); scenarios with more proxies run in the simulator ([`crate::sim`]),
//! where the replicas hold their cap and each proxy has an agent of its own.

use std::{
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use rand::{RngExt, SeedableRng, rngs::StdRng};
use retry_after_policy::{KeptReturnsSettings, KeyHasher};
use retry_after_reference_proxy::{
    Keeping, KeyFrom, Proxy, ProxyConfig, REPORT_EVERY, RETURN_COOKIE,
};
use retry_after_testkit::{AGENT_TICK_MS, AgentProcess, replica::Replica};

use crate::{
    load::{CLIENT_KEY_HEADER, DEADLINE_HEADER, Load, arrivals},
    policy::{Deadlines, KeptBy, Policy, SERVICE},
    record::{JudgeFigures, RunResult},
    scenario::{EventKind, Scenario},
    seeds,
};

/// How long a run waits after its schedule for clients still waiting to retry.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(40);
/// How often idle capacity is sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// The arrivals of `scenario` with `seed`, each with its client's behaviour drawn from the
/// mix: the same in the real run and the simulator.
pub fn clients(scenario: &Scenario, seed: u64) -> Vec<(Duration, crate::load::Behaviour)> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x00c1_e775);
    arrivals(&scenario.phases, seed)
        .into_iter()
        .map(|at| (at, scenario.behaviour(rng.random())))
        .collect()
}

/// Run `scenario` under `policy`; `seed` fixes the arrivals, the service times and every
/// random draw of the proxies and the clients; `progress` is told the share done, now and
/// then.
///
/// # Panics
/// With more than one proxy (see the module's note), or when a piece cannot start.
pub fn run(scenario: &Scenario, policy: Policy, seed: u64, progress: impl FnMut(f64)) -> RunResult {
    assert_eq!(
        scenario.proxies, 1,
        "{}: the real-socket run has one proxy; run scenarios with more in the simulator",
        scenario.name
    );
    assert!(
        scenario.agent_tick == Duration::from_millis(AGENT_TICK_MS)
            && scenario.report_every == REPORT_EVERY,
        "{}: the real-socket run ticks every {AGENT_TICK_MS} ms and reports every {} ms; run \
         scenarios with other intervals in the simulator",
        scenario.name,
        REPORT_EVERY.as_millis()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let replicas = runtime.block_on(start_replicas(scenario, seed));
    let backends: Vec<(String, usize)> = replicas
        .iter()
        .zip(&scenario.replicas)
        .map(|(r, s)| (r.addr().to_string(), s.max_ongoing_requests))
        .collect();
    let agent = AgentProcess::start("", &policy.service_config(&backends));
    let clients = clients(scenario, seed);
    let ignores_header = clients.iter().map(|c| c.1.ignores_header()).collect();
    let warm_up = scenario.warm_up();
    let warm_up_clients = clients.iter().take_while(|c| c.0 < warm_up).count();
    let (load, idle, proxy) = runtime.block_on(async {
        let config = proxy_config(scenario, &replicas, policy, seed);
        let proxy = Proxy::start(config, &agent.socket)
            .await
            .expect("start the proxy");
        for (i, r) in scenario.replicas.iter().enumerate() {
            if !r.present {
                proxy.set_replica_up(i, false);
            }
        }
        let load = Load::start(proxy.addr(), clients, scenario.attempts, seed);
        let idle = follow(scenario, &replicas, &proxy, &load, progress).await;
        (load, idle, proxy)
    });
    // The proxies report every 200 ms: let the last counts reach the agent before its
    // metrics are read.
    std::thread::sleep(Duration::from_millis(600));
    let result = RunResult {
        ignores_header,
        scenario: scenario.name.clone(),
        policy,
        attempts: load.attempts(),
        clients: load.clients(),
        warm_up_clients,
        warm_up,
        measured_s: scenario.measured().as_secs_f64(),
        max_attempts: scenario.attempts,
        idle_replica_s_while_waiting: idle.0,
        idle_replica_s_queued: idle.1,
        unfinished: load.unfinished(),
        judge: judge_from_metrics(&agent.metrics(), policy),
        access_log: proxy.rejections(),
        replicas_served: Some(replicas.iter().map(Replica::served).sum()),
    };
    drop(proxy);
    drop(load);
    runtime.shutdown_timeout(Duration::from_secs(1));
    drop(replicas);
    drop(agent);
    result
}

/// One replica server per replica of the scenario, each with its own seed.
async fn start_replicas(scenario: &Scenario, seed: u64) -> Vec<Replica> {
    let mut replicas = Vec::new();
    for (i, r) in scenario.replicas.iter().enumerate() {
        let replica = Replica::start(r.spec, seeds::replica(seed, i)).await;
        replicas.push(replica.expect("start a replica"));
    }
    replicas
}

/// The reference proxy in front of `replicas`, answering with `policy`'s header.
fn proxy_config(
    scenario: &Scenario,
    replicas: &[Replica],
    policy: Policy,
    seed: u64,
) -> ProxyConfig {
    ProxyConfig {
        service: SERVICE.to_owned(),
        replicas: replicas
            .iter()
            .zip(&scenario.replicas)
            .map(|(r, s)| (r.addr(), s.max_ongoing_requests))
            .collect(),
        max_queued_requests: scenario.max_queued_requests,
        status_code: 429,
        header: policy.header(),
        retry_after_ms: true,
        seed: seeds::proxy(seed, 0),
        record_rejections: true,
        keeping: policy.kept().map(|by| Keeping {
            key_from: match by {
                // One proxy: a key's places have no other proxy to be shared with.
                KeptBy::Key | KeptBy::SharedKey => KeyFrom::Header(CLIENT_KEY_HEADER.to_owned()),
                KeptBy::Cookie => KeyFrom::Cookie(RETURN_COOKIE.to_owned()),
            },
            settings: KeptReturnsSettings::default(),
            hasher: KeyHasher::new(&seed.to_be_bytes()),
            source_header: None,
            deadline_header: matches!(policy, Policy::KeptReturns(_, _, Deadlines::Honoured))
                .then(|| DEADLINE_HEADER.to_owned()),
            max_wait_s: None,
        }),
    }
}

/// Follow the run to its end (every client done after the schedule, or the drain limit):
/// play the scenario's events, sample idle replicas while clients wait, tell `progress`.
/// Returns the idle replica-seconds while clients waited, after the warm-up, and the part of
/// them while requests were queued at the proxy.
async fn follow(
    scenario: &Scenario,
    replicas: &[Replica],
    proxy: &Proxy,
    load: &Load,
    mut progress: impl FnMut(f64),
) -> (f64, f64) {
    let (length, warm_up) = (scenario.length(), scenario.warm_up());
    let (mut idle, mut idle_queued) = (0.0, 0.0);
    let mut ticker = tokio::time::interval(SAMPLE_EVERY);
    let mut events = scenario.events.iter().peekable();
    let mut last_report = Instant::now();
    loop {
        ticker.tick().await;
        let elapsed = load.started().elapsed();
        while let Some(event) = events.next_if(|e| elapsed >= e.at) {
            match event.kind {
                EventKind::LoseReplica(i) => replicas[i].stop(),
                EventKind::AddReplica(i) => proxy.set_replica_up(i, true),
                EventKind::ProxyLeaves(_) | EventKind::ProxyJoins(_) => {
                    unreachable!("one proxy, which cannot leave (the scenario's check)")
                }
            }
        }
        if elapsed >= warm_up && load.waiting.load(Ordering::Relaxed) > 0 {
            let sample = SAMPLE_EVERY.as_secs_f64() * proxy.idle_replicas();
            idle += sample;
            if proxy.queue_depth() > 0 {
                idle_queued += sample;
            }
        }
        if last_report.elapsed() >= Duration::from_millis(500) {
            last_report = Instant::now();
            progress((elapsed.as_secs_f64() / (length + DRAIN_LIMIT).as_secs_f64()).min(1.0));
        }
        if elapsed >= length && load.finished() || elapsed >= length + DRAIN_LIMIT {
            return (idle, idle_queued);
        }
    }
}

/// The judge's figures for `policy`'s rung from the agent's Prometheus text.
pub fn judge_from_metrics(text: &str, policy: Policy) -> JudgeFigures {
    use prometheus_parse::{Scrape, Value};
    let mut figures = JudgeFigures::default();
    let Some(rung) = policy.rung() else {
        return figures;
    };
    let metrics =
        Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("the agent's metrics parse");
    let labelled = |s: &prometheus_parse::Sample| {
        s.labels.get("service") == Some(SERVICE) && s.labels.get("rung") == Some(rung.as_str())
    };
    for s in &metrics.samples {
        match (&s.metric[..], &s.value) {
            ("retry_after_judge_admitted_ratio", Value::Gauge(v)) if labelled(s) => {
                figures.admitted = Some(*v)
            }
            ("retry_after_judge_observed_over_suggested_ratio", Value::Histogram(buckets))
                if labelled(s) =>
            {
                let total = buckets.last().map_or(0.0, |b| b.count);
                let within = buckets
                    .iter()
                    .find(|b| b.less_than == 1.0)
                    .map_or(0.0, |b| b.count);
                figures.drained_in_time = (total > 0.0).then(|| within / total);
            }
            _ => {}
        }
    }
    let reported = |outcome: &str| {
        metrics
            .samples
            .iter()
            .find(|s| {
                s.metric == "retry_after_proxy_requests_total"
                    && s.labels.get("outcome") == Some(outcome)
            })
            .and_then(|s| match s.value {
                Value::Counter(v) | Value::Untyped(v) => Some(v),
                _ => None,
            })
    };
    figures.reported = reported("admitted").zip(reported("rejected"));
    figures
}
