//! The HAProxy integration end to end: the distribution's HAProxy running
//! integrations/haproxy/retry_after.lua, the real agent, real replicas on loopback, wrk as the
//! load. Every rejection must carry an integer Retry-After within the clamp, and beside it
//! `retry-after-ms` saying the same time (rounded up in its unit); the value follows
//! the load (a longer queue, a longer value); once the agent is stopped the rejections carry
//! the static value, and the computed one again after it restarts, with no rejection left
//! without a header in between. Real urllib3 clients through it, told static 5 s or
//! `scheduled_returns`, run as a scenario of `one_agent` ([`Urllib3ThroughHaproxy`]).

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use retry_after_protocol::{Response, policy::Rung};
use retry_after_testkit::{
    AgentProcess, free_port,
    http::HttpServer,
    proxies::{Haproxy, Wrk},
    rejections::{PROBE_WAIT, median, outage, prober, values},
    sample,
};

use retry_after_testkit::kept_returns::agent_service;

use crate::one_agent::Scenario;
use retry_after_testkit::proxies::haproxy_frontend_rejecting_at;

/// HAProxy's own fallback: the computed values here stay far below it (31 s would take a drain
/// under 2/s against a queue of 50).
const LUA_STATIC: u64 = 31;

fn replica() -> HttpServer {
    HttpServer::replica(Duration::from_millis(250))
}

fn service(name: &str, replicas: &[&HttpServer]) -> String {
    let backends: Vec<String> = replicas
        .iter()
        .map(|r| format!("{{ address = \"{}\", max_ongoing_requests = 2 }}", r.addr()))
        .collect();
    format!(
        "[[service]]\nname = \"{name}\"\nbackends = [{}]\n[service.backpressure]\nretry_after_policy = \"router_queue_drain_rate\"\nretry_after_s = 7\njitter = 0.0\n",
        backends.join(", ")
    )
}

#[test]
fn haproxy_rejections_carry_the_computed_value_then_the_static_one_then_the_computed_again() {
    let (r1, r2, r3, r4) = (replica(), replica(), replica(), replica());
    let (short_fe, long_fe) = (free_port(), free_port());
    let mut agent = AgentProcess::start(
        "",
        &(service("short", &[&r1, &r2]) + &service("long", &[&r3, &r4])),
    );
    let haproxy = Haproxy::start_with_lua(
        &agent.socket,
        &[
            ("RETRY_AFTER_SERVICES", "short:be_short,long:be_long"),
            ("RETRY_AFTER_STATIC", &LUA_STATIC.to_string()),
            ("RETRY_AFTER_STALE_MS", "1500"),
            ("RETRY_AFTER_RECONNECT_MAX_MS", "1000"),
        ],
        &(haproxy_frontend_rejecting_at("short", short_fe, 10, &[&r1, &r2])
            + &haproxy_frontend_rejecting_at("long", long_fe, 50, &[&r3, &r4])),
    );
    let load = [
        Wrk::start(short_fe, 1, 80, 60),
        Wrk::start(long_fe, 1, 120, 60),
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let probes = [
        prober(short_fe, "/", PROBE_WAIT, stop.clone()),
        prober(long_fe, "/", PROBE_WAIT, stop.clone()),
    ];
    // What the agent itself answers for HAProxy's queue on a service (10 short, 50 long),
    // once it computes.
    let agent_says = |agent: &AgentProcess, service: &str, depth: u64| {
        let line = agent
            .request(&format!("QUERY {service} queue_depth={depth}"))
            .unwrap();
        match Response::parse(&line) {
            Ok(Response::RetryAfter(a)) if a.rung == Rung::Computed => Some(a.seconds.unwrap()),
            Ok(Response::RetryAfter(_)) => None,
            other => panic!("not an answer: {line} ({other:?})"),
        }
    };
    let outage = outage(&mut agent, |agent| {
        agent_says(agent, "short", 10).zip(agent_says(agent, "long", 50))
    });
    let before_kill = outage.before.1;
    let after_restart = outage.after;
    let metrics = agent.metrics();
    stop.store(true, Ordering::SeqCst);
    let [short, long] = probes.map(|p| p.join().unwrap());
    drop(load);
    drop(haproxy);

    for (name, seen) in [("short", &short), ("long", &long)] {
        assert!(seen.len() > 100, "{name}: {} rejections probed", seen.len());
        for r in seen.iter() {
            assert_eq!(r.status, 429, "{name}: {r:?}");
            let value = r.retry_after.as_deref().unwrap_or_else(|| {
                panic!(
                    "{name}: a rejection without Retry-After: {r:?}, {}",
                    outage.describe(r.at)
                )
            });
            let seconds: u64 = value
                .parse()
                .unwrap_or_else(|_| panic!("{name}: not delta-seconds: {value:?}"));
            assert!((1..=60).contains(&seconds), "{name}: {seconds}");
            assert!(
                r.millis_agree(),
                "{name}: retry-after-ms does not say the Retry-After's time: {r:?}"
            );
        }
    }
    // While the agent computes: 10 queued over 16/s × 1.25 → 1 s; 50 queued → 3.9 → 4 s.
    let computed_short = values(&short, outage.computed);
    let computed_long = values(&long, outage.computed);
    eprintln!("computed: short {computed_short:?}\ncomputed: long {computed_long:?}");
    assert!(
        computed_short
            .iter()
            .chain(&computed_long)
            .all(|v| *v != LUA_STATIC)
    );
    assert!(
        median(computed_long.clone()) > median(computed_short.clone()),
        "a longer queue, a longer value"
    );
    assert!(median(computed_long.clone()).abs_diff(4) <= 1);
    assert!(median(computed_short) <= 2);
    // And it is the agent's answer for that queue, computed in HAProxy from the push.
    assert!(
        median(computed_long).abs_diff(before_kill) <= 1,
        "agent: {before_kill}"
    );
    // Agent gone: HAProxy's own static value, on every rejection.
    let static_short = values(&short, outage.fallback);
    let static_long = values(&long, outage.fallback);
    eprintln!("static: short {static_short:?} long {static_long:?}");
    assert!(!static_short.is_empty() && !static_long.is_empty());
    assert!(
        static_short
            .iter()
            .chain(&static_long)
            .all(|v| *v == LUA_STATIC)
    );
    // Back: computed again, each the restarted agent's own answer for that queue.
    let again_short = values(&short, outage.again);
    let again_long = values(&long, outage.again);
    eprintln!("computed again: short {again_short:?}\ncomputed again: long {again_long:?}");
    assert!(
        again_short
            .iter()
            .chain(&again_long)
            .all(|v| *v != LUA_STATIC)
    );
    assert!(median(again_long.clone()) > median(again_short.clone()));
    assert!(
        median(again_short).abs_diff(after_restart.0) <= 1
            && median(again_long).abs_diff(after_restart.1) <= 1,
        "agent: {after_restart:?}"
    );
    // HAProxy reported what it did.
    let rejected = sample(
        &metrics,
        "retry_after_proxy_requests_total{outcome=\"rejected\",service=\"long\"}",
    )
    .unwrap();
    let admitted = sample(
        &metrics,
        "retry_after_proxy_requests_total{outcome=\"admitted\",service=\"long\"}",
    )
    .unwrap();
    eprintln!("reported to the restarted agent: {admitted} admitted, {rejected} rejected");
    assert!(rejected > 0.0 && admitted > 0.0);
}

/// What the urllib3 clients of `tests/clients/retrying_clients.py` recorded, and HAProxy's own
/// counters for the same run.
#[derive(Debug)]
struct ClientRun {
    clients: u64,
    succeeded: u64,
    gave_up: u64,
    retries: u64,
    retries_admitted: u64,
    p99_to_success_s: f64,
    haproxy_2xx: u64,
    haproxy_4xx: u64,
    /// The judge's admitted share of the computed values HAProxy reported handing out
    /// (`handed_out=c…`), if it reported any.
    judged_computed: Option<f64>,
}

impl ClientRun {
    fn admitted_share(&self) -> f64 {
        self.retries_admitted as f64 / self.retries.max(1) as f64
    }
}

/// The urllib3 clients of `tests/clients/retrying_clients.py` arriving at 1.5× the capacity of
/// two replicas (2 × 2 places, 250 ms: 16/s) for 20 s at `front`, each retrying up to 3 times
/// as urllib3's Retry does, honouring Retry-After: their record as JSON.
fn urllib3_clients(front: SocketAddr) -> String {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("clients/retrying_clients.py");
    retry_after_testkit::run_stdout(
        std::process::Command::new("python3")
            .arg(script)
            .args([
                "--url",
                &format!("http://{front}/"),
                "--rate",
                "24",
                "--seconds",
                "20",
            ])
            .args(["--retries", "3", "--seed", "7"]),
    )
}

/// One run's figures from the clients' record `out`, HAProxy's counters for frontend `name`
/// and the agent's judge.
fn client_run(out: &str, name: &str, haproxy: &Haproxy, metrics: &str) -> ClientRun {
    let record: serde_json::Value = serde_json::from_str(out.trim()).expect("the clients' record");
    let count = |key: &str| {
        record[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} in {out}"))
    };
    let times: Vec<f64> = record["time_to_success_s"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_f64().unwrap())
        .collect();
    assert_eq!(count("errors"), 0, "{out}");
    ClientRun {
        clients: count("clients"),
        succeeded: count("succeeded"),
        gave_up: count("gave_up"),
        retries: count("retries"),
        retries_admitted: count("retries_admitted"),
        p99_to_success_s: times
            .get((times.len() * 99 / 100).min(times.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN),
        haproxy_2xx: haproxy.stat(&format!("fe_{name}"), "FRONTEND", "hrsp_2xx"),
        haproxy_4xx: haproxy.stat(&format!("fe_{name}"), "FRONTEND", "hrsp_4xx"),
        judged_computed: sample(
            metrics,
            &format!("retry_after_judge_admitted_ratio{{rung=\"computed\",service=\"{name}\"}}"),
        ),
    }
}

/// `scheduled_returns` as a hint through HAProxy, urllib3's clients: the share of retries
/// admitted and of answers the agent's judge saw admitted below which the run fails. Guards,
/// under the 87% and 98% measured (2026-12-05); a hint is not kept, so no target is set.
const SCHEDULED_ADMITTED_GUARD: f64 = 0.8;
const JUDGED_ADMITTED_GUARD: f64 = 0.8;

/// The same clients (same seed) through HAProxy and the Lua to two services at once, each
/// with its own replicas and frontend, the agent configured with a policy per service: static
/// 5 s and `scheduled_returns`. Those told `scheduled_returns` get in and fewer give up than
/// those told static 5 s. A scenario of `one_agent`.
pub(crate) struct Urllib3ThroughHaproxy {
    replicas: [[HttpServer; 2]; 2],
    fronts: [SocketAddr; 2],
}

impl Urllib3ThroughHaproxy {
    /// The services, by policy.
    const NAMES: [&str; 2] = ["static_5s", "scheduled"];

    pub(crate) fn new() -> Self {
        Self {
            replicas: [[replica(), replica()], [replica(), replica()]],
            fronts: [free_port(), free_port()],
        }
    }

    /// Both runs' clients to their end, then HAProxy's counters and the agent's judge.
    fn client_runs(&self, agent: &AgentProcess) -> (ClientRun, ClientRun) {
        let haproxy = Haproxy::start_with_lua(
            &agent.socket,
            &[
                (
                    "RETRY_AFTER_SERVICES",
                    "static_5s:be_static_5s,scheduled:be_scheduled",
                ),
                ("RETRY_AFTER_STATIC", "5"),
            ],
            &Self::NAMES
                .iter()
                .zip(&self.fronts)
                .zip(&self.replicas)
                .map(|((name, front), [r1, r2])| {
                    haproxy_frontend_rejecting_at(name, *front, 8, &[r1, r2])
                })
                .collect::<String>(),
        );
        let outs: Vec<String> = std::thread::scope(|s| {
            let running: Vec<_> = self
                .fronts
                .iter()
                .map(|front| s.spawn(move || urllib3_clients(*front)))
                .collect();
            running.into_iter().map(|r| r.join().unwrap()).collect()
        });
        // The last report reaches the agent within a second or two.
        std::thread::sleep(Duration::from_secs(2));
        let metrics = agent.metrics();
        (
            client_run(&outs[0], Self::NAMES[0], &haproxy, &metrics),
            client_run(&outs[1], Self::NAMES[1], &haproxy, &metrics),
        )
    }
}

impl Scenario for Urllib3ThroughHaproxy {
    fn name(&self) -> &'static str {
        "haproxy_lua"
    }

    fn services(&self) -> String {
        let policies = ["static", "scheduled_returns"];
        Self::NAMES
            .iter()
            .zip(&self.replicas)
            .zip(policies)
            .map(|((name, replicas), policy)| {
                let backpressure =
                    format!("retry_after_policy = \"{policy}\"\nretry_after_s = 5\n");
                agent_service(name, replicas, None, &backpressure)
            })
            .collect()
    }

    fn run(&self, agent: &AgentProcess) {
        let (static_5s, scheduled) = self.client_runs(agent);
        for (name, run) in [
            ("static 5 s", &static_5s),
            ("scheduled_returns", &scheduled),
        ] {
            eprintln!(
                "{name}: {:.0}% of retries admitted, {} of {} clients gave up, p99 to success {:.1} s ({run:?})",
                100.0 * run.admitted_share(),
                run.gave_up,
                run.clients,
                run.p99_to_success_s
            );
        }
        for run in [&static_5s, &scheduled] {
            // HAProxy's own counters agree with the clients' record: every attempt answered, the
            // successes as 2xx, every rejection as 4xx.
            assert_eq!(run.haproxy_2xx, run.succeeded, "{run:?}");
            assert_eq!(
                run.haproxy_2xx + run.haproxy_4xx,
                run.clients + run.retries,
                "{run:?}"
            );
            assert!(run.retries > 50, "the load overloads: {run:?}");
        }
        // The Lua computed the values it handed out and reported them (a static answer could pass
        // the shares below too), and the agent's judge saw them mostly admitted; static 5 s
        // handed out none.
        assert!(
            scheduled
                .judged_computed
                .is_some_and(|share| share >= JUDGED_ADMITTED_GUARD),
            "guard: {scheduled:?}"
        );
        assert_eq!(static_5s.judged_computed, None, "{static_5s:?}");
        assert!(
            scheduled.admitted_share() >= SCHEDULED_ADMITTED_GUARD,
            "guard, retries admitted at the suggested time: {:.0}%",
            100.0 * scheduled.admitted_share()
        );
        assert!(
            scheduled.gave_up < static_5s.gave_up,
            "clients giving up: {} with scheduled_returns, {} with static 5 s",
            scheduled.gave_up,
            static_5s.gave_up
        );
    }
}

#[test]
fn the_example_configuration_is_valid_for_the_distributions_haproxy() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../integrations/haproxy");
    let lua = dir.join("retry_after.lua").canonicalize().unwrap();
    let example = std::fs::read_to_string(dir.join("haproxy.cfg")).unwrap();
    assert!(example.contains("/etc/haproxy/retry_after.lua"));
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        config.path(),
        example.replace("/etc/haproxy/retry_after.lua", &lua.display().to_string()),
    )
    .unwrap();
    let out = std::process::Command::new("haproxy")
        .arg("-c")
        .arg("-f")
        .arg(config.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
