//! Kept returns through real proxies: the distribution's HAProxy running
//! integrations/haproxy/retry_after.lua and nginx (two workers, LuaJIT) running
//! integrations/nginx/retry_after_nginx.lua, both over integrations/lua/retry_after_tickets.lua, the real
//! agent with `retry_after_policy = "kept_returns"`, real replicas on loopback, and real urllib3
//! clients (`tests/clients/kept_returns_clients.py`) that honour Retry-After, each with a key of
//! its own: an `X-Api-Key` header, or a cookie jar keeping the proxy's signed return cookie.
//!
//! Every run is measured against the clairvoyant bound of its own arrivals (first come, first
//! served over the fleet's request places, as `eval/src/bound.rs` serves its clients): nearly
//! every retry is admitted at its place, no client gives up, the p99 time to success stays
//! within 1.5× the bound's, and the proxy's own counters (HAProxy's stats; nginx's access log
//! and stub_status) agree with the clients' record. The runs go on at once (separate
//! replicas, ports and frontends) as one scenario of `one_agent`, beside the suite's other long
//! load runs under the same agent.
//!
//! The Lua book under LuaJIT (nginx's interpreter) is checked against the Rust answers too.

use std::{net::SocketAddr, path::PathBuf, process::Command, time::Duration};

use retry_after_testkit::{
    AgentProcess, free_port,
    http::HttpServer,
    kept_returns::{
        Book, CAPACITY, KEPT_RETURNS, Keep, PLACES, REPLICAS, Record, SERVICE_TIME, Spec,
        agent_service, capped_replica, clairvoyant_p99, haproxy_frontend, kept_clients, key_kind,
        nginx_http, nginx_logged, proxies_secret, quantile,
    },
    proxies::{Haproxy, NGINX_LUA_MODULES, Nginx},
    run_ok,
};

use crate::one_agent::Scenario;

fn integrations() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../integrations")
}

#[test]
fn the_lua_ticket_book_answers_as_the_rust_one_under_luajit() {
    let vectors =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../policy/tests/ticket_vectors.tsv");
    let text = run_ok(
        Command::new("luajit")
            .arg(integrations().join("lua/check_tickets.lua"))
            .arg(&vectors),
    );
    eprintln!("{}", text.trim());
    let lines = std::fs::read_to_string(&vectors)
        .expect("the ticket vectors")
        .lines()
        .count();
    assert!(
        text.contains(&format!("{lines} ticket vectors agree (LuaJIT")),
        "{text}"
    );
}

/// The clients of `spec` against `front`, to their end.
fn clients(spec: Spec, front: SocketAddr) -> Record {
    kept_clients(
        &format!("http://{front}/"),
        spec.load * CAPACITY,
        spec.seconds,
        spec.seed,
        spec.keep,
    )
}

/// A run's figures: the clients' record, the bound's p99, the proxy's counters.
#[derive(Debug)]
struct Figures {
    spec: Spec,
    record: Record,
    bound_p99: f64,
    proxy_2xx: u64,
    proxy_4xx: u64,
    book: Book,
}

impl Figures {
    fn p99(&self) -> f64 {
        quantile(&self.record.times, 0.99)
    }

    /// One line to quote.
    fn describe(&self) -> String {
        let r = &self.record;
        format!(
            "{} ({:?}, {:.1}x for {} s): {} clients, {:.1}% of {} retries admitted, {} gave up, {} errors; p99 to success {:.1} s, the bound's {:.1} s ({:.2}x); proxy 2xx {} 4xx {} (clients: {} succeeded, {} answered 429); agent: {}",
            self.spec.name,
            self.spec.keep,
            self.spec.load,
            self.spec.seconds,
            r.clients,
            100.0 * r.admitted_share(),
            r.retries,
            r.gave_up,
            r.errors,
            self.p99(),
            self.bound_p99,
            self.p99() / self.bound_p99,
            self.proxy_2xx,
            self.proxy_4xx,
            r.succeeded,
            r.answered_429,
            self.book.describe(),
        )
    }

    /// What every run must show.
    fn check(&self) {
        let r = &self.record;
        let line = self.describe();
        assert_eq!(r.errors, 0, "{line}");
        assert!(r.retries > 50, "the load overloads: {line}");
        assert_eq!(r.gave_up, 0, "{line}: {}", r.gave_up_story());
        assert!(r.admitted_share() >= 0.95, "{line}");
        assert!(self.p99() <= 1.5 * self.bound_p99, "{line}");
        assert_eq!(self.proxy_2xx, r.succeeded, "{line}");
        r.agrees_with_the_proxy(self.proxy_2xx, self.proxy_4xx, &line);
        // In the runs so far all but a few rejections are places, and all but a few retries
        // admitted at them.
        self.book.accounts_for(r, &line);
        assert!(
            self.book.not_kept_share(r) <= 0.01,
            "nearly every rejection a place kept: {line}"
        );
    }
}

/// The runs: each key kind at 1.5× for 20 s and 1.3× for two minutes.
const HAPROXY_RUNS: [Spec; 4] = [
    Spec {
        name: "ha_key_short",
        keep: Keep::Header,
        load: 1.5,
        seconds: 20,
        seed: 11,
    },
    Spec {
        name: "ha_key_long",
        keep: Keep::Header,
        load: 1.3,
        seconds: 120,
        seed: 12,
    },
    Spec {
        name: "ha_cookie_short",
        keep: Keep::Cookie,
        load: 1.5,
        seconds: 20,
        seed: 13,
    },
    Spec {
        name: "ha_cookie_long",
        keep: Keep::Cookie,
        load: 1.3,
        seconds: 120,
        seed: 14,
    },
];

/// The same loads through nginx: its `limit_req` at the fleet's capacity is the queue, the
/// Lua book in a shared dictionary keeps the places for both workers.
const NGINX_RUNS: [Spec; 4] = [
    Spec {
        name: "ngx_key_short",
        keep: Keep::Header,
        load: 1.5,
        seconds: 20,
        seed: 21,
    },
    Spec {
        name: "ngx_key_long",
        keep: Keep::Header,
        load: 1.3,
        seconds: 120,
        seed: 22,
    },
    Spec {
        name: "ngx_cookie_short",
        keep: Keep::Cookie,
        load: 1.5,
        seconds: 20,
        seed: 23,
    },
    Spec {
        name: "ngx_cookie_long",
        keep: Keep::Cookie,
        load: 1.3,
        seconds: 120,
        seed: 24,
    },
];

/// The runs of [`HAPROXY_RUNS`] and [`NGINX_RUNS`] at once, each with its replicas and
/// frontend, one HAProxy and one nginx (two workers) for them; a scenario of `one_agent`.
pub(crate) struct KeptReturnsThroughProxies {
    runs: Vec<Spec>,
    replicas: Vec<Vec<HttpServer>>,
    fronts: Vec<SocketAddr>,
}

impl KeptReturnsThroughProxies {
    pub(crate) fn new() -> Self {
        let runs: Vec<Spec> = HAPROXY_RUNS.iter().chain(&NGINX_RUNS).copied().collect();
        let replicas = (0..runs.len())
            .map(|i| (0..REPLICAS).map(|_| capped_replica(is_nginx(i))).collect())
            .collect();
        let fronts = runs.iter().map(|_| free_port()).collect();
        Self {
            runs,
            replicas,
            fronts,
        }
    }
}

/// Whether run `i` goes through nginx (the runs after HAProxy's).
fn is_nginx(i: usize) -> bool {
    i >= HAPROXY_RUNS.len()
}

impl Scenario for KeptReturnsThroughProxies {
    fn name(&self) -> &'static str {
        "kept_returns"
    }

    fn services(&self) -> String {
        self.runs
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                agent_service(
                    spec.name,
                    &self.replicas[i],
                    is_nginx(i).then_some(self.fronts[i]),
                    KEPT_RETURNS,
                )
            })
            .collect()
    }

    fn run(&self, agent: &AgentProcess) {
        let (runs, replicas, fronts) = (&self.runs, &self.replicas, &self.fronts);
        let (shared, secret) = proxies_secret();
        let names: Vec<String> = HAPROXY_RUNS
            .iter()
            .map(|s| format!("{0}:be_{0}", s.name))
            .collect();
        let keep: Vec<String> = HAPROXY_RUNS
            .iter()
            .map(|s| format!("{}={}", s.name, key_kind(s)))
            .collect();
        let haproxy = Haproxy::start_with_lua(
            &agent.socket,
            &[
                ("RETRY_AFTER_SERVICES", &names.join(",")),
                ("RETRY_AFTER_STATIC", "5"),
                ("RETRY_AFTER_KEEP", &keep.join(",")),
                ("RETRY_AFTER_SECRET_FILE", &secret.display().to_string()),
            ],
            &HAPROXY_RUNS
                .iter()
                .zip(fronts)
                .zip(replicas)
                .map(|((spec, front), r)| haproxy_frontend(spec.name, *front, r))
                .collect::<String>(),
        );
        let nginx_runs: Vec<(Spec, SocketAddr, &[HttpServer])> = (HAPROXY_RUNS.len()..runs.len())
            .map(|i| (runs[i], fronts[i], replicas[i].as_slice()))
            .collect();
        let nginx = Nginx::start_with(
            &format!("{NGINX_LUA_MODULES}worker_processes 2;\n"),
            &nginx_http(&nginx_runs, &agent.socket, &secret, shared.path(), ""),
            None,
        );
        let nginx_before = nginx.status();
        let records: Vec<Record> = std::thread::scope(|s| {
            let running: Vec<_> = runs
                .iter()
                .zip(fronts)
                .map(|(spec, front)| s.spawn(move || clients(*spec, *front)))
                .collect();
            running.into_iter().map(|r| r.join().unwrap()).collect()
        });
        // The last report reaches the agent within a second or two.
        std::thread::sleep(Duration::from_secs(3));
        let metrics = agent.metrics();
        let nginx_after = nginx.status();
        let figures: Vec<Figures> = runs
            .iter()
            .zip(records)
            .enumerate()
            .map(|(i, (spec, record))| {
                let (proxy_2xx, proxy_4xx) = if is_nginx(i) {
                    nginx_logged(shared.path(), spec.name)
                } else {
                    let stat =
                        |field| haproxy.stat(&format!("fe_{}", spec.name), "FRONTEND", field);
                    (stat("hrsp_2xx"), stat("hrsp_4xx"))
                };
                Figures {
                    spec: *spec,
                    bound_p99: clairvoyant_p99(&record.arrivals, REPLICAS * PLACES, SERVICE_TIME),
                    proxy_2xx,
                    proxy_4xx,
                    book: Book::read(&metrics, spec.name),
                    record,
                }
            })
            .collect();
        for f in &figures {
            eprintln!("{}", f.describe());
        }
        // stub_status counted every attempt of nginx's clients (and the one read before).
        let nginx_attempts: u64 = figures[HAPROXY_RUNS.len()..]
            .iter()
            .map(|f| f.record.clients + f.record.retries)
            .sum();
        eprintln!(
            "nginx stub_status: {} requests during the runs, the clients made {nginx_attempts} attempts",
            nginx_after.requests - nginx_before.requests - 1
        );
        assert_eq!(
            nginx_after.requests - nginx_before.requests - 1,
            nginx_attempts
        );
        for f in &figures {
            f.check();
        }
    }
}
