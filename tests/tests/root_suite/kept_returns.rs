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
        Book, CAPACITY, KEPT_RETURNS, Keep, PLACES, ProxyCounts, REPLICAS, Record, SERVICE_TIME,
        Spec, agent_service, capped_replica, clairvoyant_p99, haproxy_frontend, kept_clients,
        key_kind, nginx_http, proxies_secret, quantile,
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
pub(crate) struct Figures {
    spec: Spec,
    record: Record,
    bound_p99: f64,
    /// The proxy's own counts (HAProxy's stats, nginx's access log).
    proxy: ProxyCounts,
    book: Book,
}

impl Figures {
    fn p99(&self) -> f64 {
        quantile(&self.record.times, 0.99)
    }

    /// Attempts a client made, on average.
    fn attempts_per_client(&self) -> f64 {
        let r = &self.record;
        (r.clients + r.retries) as f64 / r.clients.max(1) as f64
    }

    /// One line to quote.
    fn describe(&self) -> String {
        let r = &self.record;
        format!(
            "{} ({:?}, {:.1}x for {} s): {}; {:.2} attempts a client; proxy {} requests, 2xx {} 4xx {} (clients: {} answered 429, other answers {:?}); agent: {}",
            self.spec.name,
            self.spec.keep,
            self.spec.load,
            self.spec.seconds,
            r.summary(self.bound_p99),
            self.attempts_per_client(),
            self.proxy.requests,
            self.proxy.answered_2xx,
            self.proxy.answered_4xx,
            r.answered_429,
            r.other_answers,
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
        assert_eq!(self.proxy.answered_2xx, r.succeeded, "{line}");
        r.agrees_with_the_proxy(self.proxy, &line);
        // The book gave every rejection a place and accounts for every rejection and every
        // admitted retry.
        self.book.accounts_for(r, &line);
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

/// Three minutes at 1.5× by key, with the clamp at 60 s (`_60`) and at 120 s (`_120`), the same
/// arrivals side by side: the overload's backlog puts places up to about 90 s away.
const HAPROXY_CLAMPS: [Spec; 2] = [
    Spec {
        name: "ha_long_60",
        keep: Keep::Header,
        load: 1.5,
        seconds: 180,
        seed: 31,
    },
    Spec {
        name: "ha_long_120",
        keep: Keep::Header,
        load: 1.5,
        seconds: 180,
        seed: 31,
    },
];

/// The same through nginx.
const NGINX_CLAMPS: [Spec; 2] = [
    Spec {
        name: "ngx_long_60",
        keep: Keep::Header,
        load: 1.5,
        seconds: 180,
        seed: 33,
    },
    Spec {
        name: "ngx_long_120",
        keep: Keep::Header,
        load: 1.5,
        seconds: 180,
        seed: 33,
    },
];

/// A run's `max_retry_after_s`: 120 for the runs named `…_120`, else the default.
fn clamp_by_name(spec: &Spec) -> Option<u64> {
    spec.name.ends_with("_120").then_some(120)
}

/// The clamp at 60 and at 120 s side by side ([`HAPROXY_CLAMPS`], [`NGINX_CLAMPS`], in that
/// order): told their place as it is, urllib3's clients (which wait up to 6 h) are admitted at
/// their first return and ask fewer times; told 60 s, those placed further come back early.
fn check_clamps_side_by_side(figures: &[Figures]) {
    for pair in figures.chunks(2) {
        let (at_60, at_120) = (&pair[0], &pair[1]);
        for f in pair {
            let (r, line) = (&f.record, f.describe());
            assert_eq!(r.errors, 0, "{line}");
            assert!(r.retries > 50, "the load overloads: {line}");
            assert_eq!(r.gave_up, 0, "{line}: {}", r.gave_up_story());
            assert!(f.p99() <= 1.5 * f.bound_p99, "{line}");
            r.agrees_with_the_proxy(f.proxy, &line);
            // Early returns are the 60 s clamp's (placed further, told 60): not bounded here.
            f.book.places_every_rejection(&line);
            f.book.accounts_for_rejections(r, &line);
            f.book.accounts_for_admitted_retries(r, &line);
        }
        let line = format!("{}\n{}", at_60.describe(), at_120.describe());
        assert!(at_120.record.admitted_share() >= 0.95, "{line}");
        assert!(
            at_120.record.admitted_share() > at_60.record.admitted_share(),
            "{line}"
        );
        assert!(
            at_120.attempts_per_client() < at_60.attempts_per_client(),
            "{line}"
        );
    }
}

/// Runs at once, each with its replicas and frontend, one HAProxy and one nginx (two workers)
/// for them; a scenario of `one_agent`: [`HAPROXY_RUNS`] and [`NGINX_RUNS`] (`new`), or the
/// clamp at 60 and 120 s side by side in a three-minute overload (`past_a_minute`).
pub(crate) struct KeptReturnsThroughProxies {
    name: &'static str,
    /// Through HAProxy (the runs after them go through nginx).
    haproxy_runs: &'static [Spec],
    /// Each run's `max_retry_after_s`, if not the default 60.
    clamp: fn(&Spec) -> Option<u64>,
    /// What the runs must show, each and together.
    check: fn(&[Figures]),
    runs: Vec<Spec>,
    replicas: Vec<Vec<HttpServer>>,
    fronts: Vec<SocketAddr>,
}

impl KeptReturnsThroughProxies {
    pub(crate) fn new() -> Self {
        Self::with(
            "kept_returns",
            &HAPROXY_RUNS,
            &NGINX_RUNS,
            |_| None,
            |figures| figures.iter().for_each(Figures::check),
        )
    }

    /// Three minutes at 1.5× through HAProxy and nginx, by key, with the clamp at 60 s and at
    /// 120 s (the same arrivals side by side).
    pub(crate) fn past_a_minute() -> Self {
        Self::with(
            "kept_past_a_minute",
            &HAPROXY_CLAMPS,
            &NGINX_CLAMPS,
            clamp_by_name,
            check_clamps_side_by_side,
        )
    }

    fn with(
        name: &'static str,
        haproxy_runs: &'static [Spec],
        nginx_runs: &'static [Spec],
        clamp: fn(&Spec) -> Option<u64>,
        check: fn(&[Figures]),
    ) -> Self {
        let runs: Vec<Spec> = haproxy_runs.iter().chain(nginx_runs).copied().collect();
        let replicas = (0..runs.len())
            .map(|i| {
                let nginx = i >= haproxy_runs.len();
                (0..REPLICAS).map(|_| capped_replica(nginx)).collect()
            })
            .collect();
        let fronts = runs.iter().map(|_| free_port()).collect();
        Self {
            name,
            haproxy_runs,
            clamp,
            check,
            runs,
            replicas,
            fronts,
        }
    }

    /// Whether run `i` goes through nginx (the runs after HAProxy's).
    fn is_nginx(&self, i: usize) -> bool {
        i >= self.haproxy_runs.len()
    }
}

impl Scenario for KeptReturnsThroughProxies {
    fn name(&self) -> &'static str {
        self.name
    }

    fn services(&self) -> String {
        self.runs
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                let clamp = (self.clamp)(spec)
                    .map_or(String::new(), |s| format!("max_retry_after_s = {s}\n"));
                agent_service(
                    spec.name,
                    &self.replicas[i],
                    self.is_nginx(i).then_some(self.fronts[i]),
                    &format!("{KEPT_RETURNS}{clamp}"),
                )
            })
            .collect()
    }

    fn run(&self, agent: &AgentProcess) {
        let (runs, replicas, fronts) = (&self.runs, &self.replicas, &self.fronts);
        let (shared, secret) = proxies_secret();
        let names: Vec<String> = self
            .haproxy_runs
            .iter()
            .map(|s| format!("{0}:be_{0}", s.name))
            .collect();
        let keep: Vec<String> = self
            .haproxy_runs
            .iter()
            .map(|s| format!("{}={}", s.name, key_kind(s)))
            .collect();
        let haproxy = (!self.haproxy_runs.is_empty()).then(|| {
            Haproxy::start_with_lua(
                &agent.socket,
                &[
                    ("RETRY_AFTER_SERVICES", &names.join(",")),
                    ("RETRY_AFTER_STATIC", "5"),
                    ("RETRY_AFTER_KEEP", &keep.join(",")),
                    ("RETRY_AFTER_SECRET_FILE", &secret.display().to_string()),
                ],
                &self
                    .haproxy_runs
                    .iter()
                    .zip(fronts)
                    .zip(replicas)
                    .map(|((spec, front), r)| haproxy_frontend(spec.name, *front, r))
                    .collect::<String>(),
            )
        });
        let nginx_runs: Vec<(Spec, SocketAddr, &[HttpServer])> = (self.haproxy_runs.len()
            ..runs.len())
            .map(|i| (runs[i], fronts[i], replicas[i].as_slice()))
            .collect();
        let nginx = (!nginx_runs.is_empty()).then(|| {
            Nginx::start_with(
                &format!("{NGINX_LUA_MODULES}worker_processes 2;\n"),
                &nginx_http(&nginx_runs, &agent.socket, &secret, shared.path(), ""),
                None,
            )
        });
        let nginx_before = nginx.as_ref().map(Nginx::status);
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
        let nginx_after = nginx.as_ref().map(Nginx::status);
        let figures: Vec<Figures> = runs
            .iter()
            .zip(records)
            .enumerate()
            .map(|(i, (spec, record))| {
                let proxy = if self.is_nginx(i) {
                    ProxyCounts::nginx_logged(shared.path(), spec.name)
                } else {
                    let haproxy = haproxy.as_ref().expect("HAProxy runs the HAProxy runs");
                    ProxyCounts::haproxy(|field| {
                        haproxy.stat(&format!("fe_{}", spec.name), "FRONTEND", field)
                    })
                };
                Figures {
                    spec: *spec,
                    bound_p99: clairvoyant_p99(&record.arrivals, REPLICAS * PLACES, SERVICE_TIME),
                    proxy,
                    book: Book::read(&metrics, spec.name),
                    record,
                }
            })
            .collect();
        for f in &figures {
            eprintln!("{}", f.describe());
        }
        // stub_status counted every attempt of nginx's clients (and the one read before).
        if let (Some(before), Some(after)) = (nginx_before, nginx_after) {
            let nginx_attempts: u64 = figures[self.haproxy_runs.len()..]
                .iter()
                .map(|f| f.record.clients + f.record.retries)
                .sum();
            let counted = after.requests - before.requests - 1;
            eprintln!(
                "nginx stub_status: {counted} requests during the runs, the clients made {nginx_attempts} attempts"
            );
            assert_eq!(counted, nginx_attempts);
        }
        (self.check)(&figures);
    }
}
