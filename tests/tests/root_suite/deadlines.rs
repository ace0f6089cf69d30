//! Clients with a deadline through HAProxy and nginx keeping returns: a request that says how
//! long it may wait (`x-request-timeout`, read by integrations/haproxy/retry_after.lua as
//! `RETRY_AFTER_DEADLINE_HEADER` and by integrations/nginx/retry_after_nginx.lua as
//! `deadline_header`) is given no place further than that; it is told the seconds to the place
//! it would have had and `x-should-retry: false`. The clients are the official
//! OpenAI Python SDK (`tests/clients/openai_clients.py --keyed --deadline`): every second
//! client may wait 4 s; the SDK obeys `x-should-retry` by itself. 1.5× the fleet's capacity
//! for 20 s pushes the places past 4 s within seconds.
//!
//! The truth: the SDK's record (each client's outcome, the waits it chose, the headers of the
//! rejection it stopped on), HAProxy's frontend counters and nginx's access log, and each
//! book's count of places beyond a deadline as the Lua reports it to the agent. A scenario of
//! `one_agent`.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use retry_after_testkit::{
    AgentProcess, free_port,
    http::{HttpServer, Workers},
    kept_returns::{
        KEPT_RETURNS, Keep, ProxyCounts, Record, Spec, agent_service_with, clairvoyant_p99,
        haproxy_frontend_with, nginx_http, openai_clients, proxies_secret, tickets,
    },
    proxies::{Haproxy, NGINX_LUA_MODULES, Nginx},
};

use crate::one_agent::Scenario;

/// Load, as a multiple of the fleet's capacity, and for how long.
const LOAD: f64 = 1.5;
const SECONDS: u32 = 20;

/// The fleet: replicas, request places each, time per request.
const REPLICAS: usize = 4;
const PLACES: usize = 4;
const SERVICE_TIME: Duration = Duration::from_secs(1);
/// Requests a second the fleet completes: testkit's `CAPACITY`, which nginx's `limit_req`
/// holds it to.
const CAPACITY: f64 = (REPLICAS * PLACES) as f64 / 1.0;

/// The seconds the clients with a deadline may wait, and which of them have one.
const DEADLINE_S: u64 = 4;
const DEADLINE_EVERY: u32 = 2;

/// What the clients with a deadline saw, from the same record.
struct DeadlineRecord {
    clients: u64,
    succeeded: u64,
    times: Vec<f64>,
    waits: Vec<f64>,
    told_not_to_retry: u64,
    stopped_with_retries_left: u64,
    others_told_not_to_retry: u64,
}

impl DeadlineRecord {
    fn parse(out: &str) -> Self {
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("the clients' record");
        let d = &v["deadline_clients"];
        let count = |key: &str| d[key].as_u64().unwrap_or_else(|| panic!("{key} in {out}"));
        let list = |key: &str| -> Vec<f64> {
            d[key]
                .as_array()
                .unwrap_or_else(|| panic!("{key} in {out}"))
                .iter()
                .filter_map(serde_json::Value::as_f64)
                .collect()
        };
        Self {
            clients: count("clients"),
            succeeded: count("succeeded"),
            times: list("time_to_success_s"),
            waits: list("waits_s"),
            told_not_to_retry: count("told_not_to_retry"),
            stopped_with_retries_left: count("stopped_with_retries_left"),
            others_told_not_to_retry: count("others_told_not_to_retry"),
        }
    }

    fn describe(&self) -> String {
        let longest = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        format!(
            "{} clients with a {DEADLINE_S} s deadline: {} succeeded (the longest in {:.1} s), \
             {} told not to retry ({} of them with retries left), the longest wait told {:.1} s; \
             {} clients without a deadline told not to retry",
            self.clients,
            self.succeeded,
            longest(&self.times),
            self.told_not_to_retry,
            self.stopped_with_retries_left,
            longest(&self.waits),
            self.others_told_not_to_retry,
        )
    }
}

/// Which proxy a run goes through.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Proxy {
    Haproxy,
    Nginx,
}

/// One run: its proxy, its own fleet (4 replicas of 4 places, 1 s a request) and listener.
struct Run {
    proxy: Proxy,
    name: &'static str,
    seed: u64,
    replicas: Vec<HttpServer>,
    bind: SocketAddr,
}

impl Run {
    fn new(proxy: Proxy, name: &'static str, seed: u64) -> Self {
        let workers: Vec<Arc<Workers>> = (0..REPLICAS).map(|_| Workers::new(PLACES)).collect();
        let replicas = workers
            .iter()
            .map(|w| HttpServer::chat_replica(SERVICE_TIME, w))
            .collect();
        Self {
            proxy,
            name,
            seed,
            replicas,
            bind: free_port(),
        }
    }

    fn servers(&self) -> Vec<SocketAddr> {
        self.replicas.iter().map(HttpServer::addr).collect()
    }

    /// The SDK's clients, every [`DEADLINE_EVERY`]th with its deadline, to their end.
    fn clients(&self) -> String {
        let (deadline, every) = (DEADLINE_S.to_string(), DEADLINE_EVERY.to_string());
        openai_clients(
            &format!("http://{}/v1", self.bind),
            LOAD * CAPACITY,
            SECONDS,
            self.seed,
            &[
                "--keyed",
                "--deadline",
                &deadline,
                "--deadline-every",
                &every,
            ],
        )
    }

    /// Check what the clients recorded (`out`) against the proxy's own counts and the book's
    /// count of places beyond a deadline.
    fn check(&self, out: &str, proxy: ProxyCounts, beyond: f64) {
        let record = Record::parse(out);
        let deadlines = DeadlineRecord::parse(out);
        let bound = clairvoyant_p99(&record.arrivals, REPLICAS * PLACES, SERVICE_TIME);
        let line = format!(
            "{}: {}; {}; the book's beyond_deadline {beyond}; the proxy's {proxy:?}",
            self.name,
            record.summary(bound),
            deadlines.describe(),
        );
        eprintln!("{line}");
        assert_eq!(record.errors, 0, "{line}");
        record.has_every_client(&line);
        record.agrees_with_the_proxy(proxy, &line);
        // The overload put places past the deadline, and each client whose place lay past it
        // was told so: the SDK stopped there, with retries left, as `x-should-retry: false`
        // asks; the book counted each of them, and no client without a deadline was told it.
        assert!(deadlines.told_not_to_retry >= 10, "{line}");
        assert_eq!(
            deadlines.stopped_with_retries_left, deadlines.told_not_to_retry,
            "{line}"
        );
        assert_eq!(beyond, deadlines.told_not_to_retry as f64, "{line}");
        assert_eq!(deadlines.others_told_not_to_retry, 0, "{line}");
        // No client with a deadline was told to wait past it.
        assert!(
            deadlines.waits.iter().all(|&w| w <= DEADLINE_S as f64),
            "{line}"
        );
        // The places given were kept: every retry admitted at its first return.
        assert!(record.admitted_share() >= 0.95, "{line}");
    }
}

/// The same clients through HAProxy and through nginx, each reading the deadline header. A
/// scenario of `one_agent`.
pub(crate) struct ClientsWithADeadline {
    runs: [Run; 2],
}

impl ClientsWithADeadline {
    pub(crate) fn new() -> Self {
        Self {
            runs: [
                Run::new(Proxy::Haproxy, "deadlines_haproxy", 61),
                Run::new(Proxy::Nginx, "deadlines_nginx", 62),
            ],
        }
    }
}

impl Scenario for ClientsWithADeadline {
    fn name(&self) -> &'static str {
        "deadlines"
    }

    fn services(&self) -> String {
        self.runs
            .iter()
            .map(|run| {
                let backends: Vec<(SocketAddr, usize)> =
                    run.servers().into_iter().map(|a| (a, PLACES)).collect();
                // nginx's listener is the frontend whose queue the agent reads; HAProxy gives
                // its backend's queue itself.
                let frontend = (run.proxy == Proxy::Nginx).then_some(run.bind);
                agent_service_with(run.name, &backends, frontend, KEPT_RETURNS)
            })
            .collect()
    }

    fn run(&self, agent: &AgentProcess) {
        let (shared, secret) = proxies_secret();
        let [haproxy_run, nginx_run] = &self.runs;
        let name = haproxy_run.name;
        let haproxy = Haproxy::start_with_lua(
            &agent.socket,
            &[
                ("RETRY_AFTER_SERVICES", &format!("{name}:be_{name}")),
                ("RETRY_AFTER_STATIC", "5"),
                ("RETRY_AFTER_KEEP", &format!("{name}=header:authorization")),
                ("RETRY_AFTER_SECRET_FILE", &secret.display().to_string()),
                ("RETRY_AFTER_DEADLINE_HEADER", "x-request-timeout"),
            ],
            &haproxy_frontend_with(name, haproxy_run.bind, &haproxy_run.servers(), PLACES),
        );
        let spec = Spec {
            name: nginx_run.name,
            keep: Keep::Authorization,
            load: LOAD,
            seconds: SECONDS,
            seed: nginx_run.seed,
        };
        let nginx = Nginx::start_with(
            &format!("{NGINX_LUA_MODULES}worker_processes 2;\n"),
            &nginx_http(
                &[(spec, nginx_run.bind, nginx_run.replicas.as_slice())],
                &agent.socket,
                &secret,
                shared.path(),
                "deadline_header = \"x-request-timeout\", ",
            ),
            None,
        );
        let outs: Vec<String> = std::thread::scope(|s| {
            let running: Vec<_> = self
                .runs
                .iter()
                .map(|run| s.spawn(move || run.clients()))
                .collect();
            running.into_iter().map(|r| r.join().unwrap()).collect()
        });
        // The last report reaches the agent within a second or two.
        std::thread::sleep(Duration::from_secs(3));
        let metrics = agent.metrics();
        let counts = [
            ProxyCounts::haproxy(|field| haproxy.stat(&format!("fe_{name}"), "FRONTEND", field)),
            ProxyCounts::nginx_logged(shared.path(), nginx_run.name),
        ];
        drop(nginx);
        for ((run, out), counts) in self.runs.iter().zip(&outs).zip(counts) {
            run.check(out, counts, tickets(&metrics, run.name, "beyond_deadline"));
        }
    }
}
