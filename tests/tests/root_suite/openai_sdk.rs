//! The official OpenAI Python SDK as the client (`tests/clients/openai_clients.py`): each
//! client calls `chat.completions.create` once, with the SDK's own retries (`max_retries` 2,
//! its default), against OpenAI-compatible replicas on loopback behind the distribution's
//! HAProxy (integrations/haproxy/retry_after.lua) and nginx (integrations/nginx/
//! retry_after_nginx.lua, two workers, `limit_req`), the real agent answering with
//! `scheduled_returns`, at 1.5× the fleet's capacity for 20 s.
//!
//! Each proxy runs twice at once: with `retry-after-ms` beside `Retry-After` (the default) and
//! with it switched off (`RETRY_AFTER_MS_HEADER off`, `retry_after_ms = false`). The SDK reads
//! `retry-after-ms` first: its own log of the waits it chose shows which header it obeyed
//! (milliseconds: waits within the second; seconds: whole seconds). Printed side by side:
//! admitted share of retries, clients giving up, p99 time to success against the clairvoyant
//! bound of the same arrivals; the proxies' own counters (HAProxy's stats, nginx's access log
//! and stub_status) must agree with the SDK's record. A scenario of `one_agent`, beside the
//! suite's other long load runs under the same agent.

use std::net::SocketAddr;

use retry_after_testkit::kept_returns::{
    CAPACITY, PLACES, ProxyCounts, QUEUE_LIMIT, REPLICAS, Record, SERVICE_TIME, agent_service,
    clairvoyant_p99, openai_clients,
};
use retry_after_testkit::{
    AgentProcess, free_port,
    http::{HttpServer, Workers},
    proxies::{Haproxy, NGINX_LUA_MODULES, Nginx, NginxStatus, nginx_lua_package_path},
};

use crate::one_agent::Scenario;
use retry_after_testkit::proxies::haproxy_frontend_rejecting_at;

/// Load, as a multiple of the fleet's capacity, and for how long.
const LOAD: f64 = 1.5;
const SECONDS: u32 = 20;

/// The share of the SDK's waits within a second, with `retry-after-ms`, below which a run
/// fails: a guard under the 83–90% measured (docs/integrations/haproxy.md). The rest are whole
/// seconds the agent answered itself: the static `retry_after_s` before the drain is warm.
const WITHIN_THE_SECOND_GUARD: f64 = 0.7;

/// One run: a proxy, with or without `retry-after-ms`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Proxy {
    Haproxy,
    Nginx,
}

#[derive(Clone, Copy, Debug)]
struct Run {
    name: &'static str,
    proxy: Proxy,
    millis: bool,
    seed: u64,
}

const RUNS: [Run; 4] = [
    Run {
        name: "haproxy_ms",
        proxy: Proxy::Haproxy,
        millis: true,
        seed: 41,
    },
    Run {
        name: "haproxy_s",
        proxy: Proxy::Haproxy,
        millis: false,
        seed: 41,
    },
    Run {
        name: "nginx_ms",
        proxy: Proxy::Nginx,
        millis: true,
        seed: 43,
    },
    Run {
        name: "nginx_s",
        proxy: Proxy::Nginx,
        millis: false,
        seed: 43,
    },
];

/// A replica answering chat completions, with `PLACES` requests at a time (nginx does not cap
/// a server's concurrency; HAProxy's `maxconn` does the same in front of it).
fn chat_replica() -> HttpServer {
    HttpServer::chat_replica(SERVICE_TIME, &Workers::new(PLACES))
}

/// The `[service.backpressure]` lines of every run's service.
const SCHEDULED_RETURNS: &str = "retry_after_policy = \"scheduled_returns\"\nretry_after_s = 5\n";

/// HAProxy for one run, as integrations/haproxy/haproxy.cfg sets it up.
fn haproxy(run: &Run, agent: &AgentProcess, front: SocketAddr, replicas: &[HttpServer]) -> Haproxy {
    let servers: Vec<&HttpServer> = replicas.iter().collect();
    Haproxy::start_with_lua(
        &agent.socket,
        &[
            ("RETRY_AFTER_SERVICES", &format!("{0}:be_{0}", run.name)),
            ("RETRY_AFTER_STATIC", "5"),
            (
                "RETRY_AFTER_MS_HEADER",
                if run.millis { "on" } else { "off" },
            ),
        ],
        &haproxy_frontend_rejecting_at(run.name, front, QUEUE_LIMIT, &servers),
    )
}

/// nginx for one run, as docs/integrations/nginx.md sets it up: `limit_req` at the fleet's
/// capacity with the queue bound as its burst, `stamp` on its rejections.
fn nginx(
    run: &Run,
    agent: &AgentProcess,
    front: SocketAddr,
    replicas: &[HttpServer],
    logs: &std::path::Path,
) -> Nginx {
    let name = run.name;
    let servers: String = replicas
        .iter()
        .map(|r| format!("server {}; ", r.addr()))
        .collect();
    let http = format!(
        "lua_package_path \"{}\";\n\
         lua_shared_dict retry_after 1m;\n\
         init_worker_by_lua_block {{ require(\"retry_after_nginx\").start({{ services = {{ \"{name}\" }}, socket = \"{}\", retry_after_ms = {} }}) }}\n\
         log_format statuses \"$status\";\n\
         limit_req_zone $server_name zone={name}:1m rate={CAPACITY}r/s;\n\
         upstream up_{name} {{ {servers}keepalive 16; }}\n\
         server {{\n  listen {front};\n  server_name {name};\n  access_log {}/{name}.log statuses;\n\
         \x20 location / {{\n    limit_req zone={name} burst={QUEUE_LIMIT};\n    limit_req_status 429;\n\
         \x20   proxy_http_version 1.1;\n    proxy_set_header Connection \"\";\n    proxy_pass http://up_{name};\n\
         \x20   header_filter_by_lua_block {{ require(\"retry_after_nginx\").stamp(\"{name}\") }}\n  }}\n}}\n",
        nginx_lua_package_path(),
        agent.socket.display(),
        run.millis,
        logs.display(),
    );
    Nginx::start_with(
        &format!("{NGINX_LUA_MODULES}worker_processes 2;\n"),
        &http,
        None,
    )
}

/// The SDK's clients of `run` against `front`, to their end, and the waits the SDK chose.
fn clients(run: &Run, front: SocketAddr) -> (Record, Vec<f64>) {
    let url = format!("http://{front}/v1");
    let out = openai_clients(&url, LOAD * CAPACITY, SECONDS, run.seed, &[]);
    let waits: serde_json::Value = serde_json::from_str(out.trim()).expect("the clients' record");
    let waits = waits["waits_s"]
        .as_array()
        .expect("waits_s")
        .iter()
        .map(|w| w.as_f64().unwrap())
        .collect();
    (Record::parse(&out), waits)
}

/// A run's figures: the SDK's record, the waits it chose, the bound's p99, the proxy's counters.
struct Figures {
    run: Run,
    record: Record,
    waits: Vec<f64>,
    bound_p99: f64,
    /// The proxy's own counts (HAProxy's stats, nginx's access log).
    proxy: ProxyCounts,
}

impl Figures {
    /// The share of the SDK's waits that were not whole seconds.
    fn within_the_second(&self) -> f64 {
        let fractional = self.waits.iter().filter(|w| w.fract() != 0.0).count();
        fractional as f64 / self.waits.len().max(1) as f64
    }

    fn describe(&self) -> String {
        let r = &self.record;
        format!(
            "{} (retry-after-ms {}): {}; {:.0}% of the SDK's {} waits within the second; proxy {} requests, 2xx {} 4xx {} (SDK: {} answered 200, {} answered 429)",
            self.run.name,
            if self.run.millis { "on" } else { "off" },
            r.summary(self.bound_p99),
            100.0 * self.within_the_second(),
            self.waits.len(),
            self.proxy.requests,
            self.proxy.answered_2xx,
            self.proxy.answered_4xx,
            r.answered_200,
            r.answered_429,
        )
    }

    fn check(&self) {
        let r = &self.record;
        let line = self.describe();
        assert_eq!(r.errors, 0, "{line}");
        assert!(r.retries > 50, "the load overloads: {line}");
        r.has_every_client(&line);
        // Which header the SDK obeyed: with retry-after-ms it waits within the second (the
        // agent places each client there); with Retry-After alone, whole seconds only.
        if self.run.millis {
            assert!(
                self.within_the_second() >= WITHIN_THE_SECOND_GUARD,
                "guard: {line}"
            );
        } else {
            assert_eq!(self.within_the_second(), 0.0, "{line}");
        }
        r.agrees_with_the_proxy(self.proxy, &line);
    }
}

/// The four runs of [`RUNS`] at once, each with its replicas, frontend and proxy; a scenario
/// of `one_agent`.
pub(crate) struct OpenAiSdkBehindProxies {
    replicas: Vec<Vec<HttpServer>>,
    fronts: Vec<SocketAddr>,
}

impl OpenAiSdkBehindProxies {
    pub(crate) fn new() -> Self {
        Self {
            replicas: RUNS
                .iter()
                .map(|_| (0..REPLICAS).map(|_| chat_replica()).collect())
                .collect(),
            fronts: RUNS.iter().map(|_| free_port()).collect(),
        }
    }
}

impl Scenario for OpenAiSdkBehindProxies {
    fn name(&self) -> &'static str {
        "openai_sdk"
    }

    fn services(&self) -> String {
        RUNS.iter()
            .zip(&self.replicas)
            .zip(&self.fronts)
            .map(|((run, r), front)| {
                // nginx's listener is the frontend whose queue the agent reads; HAProxy gives
                // its own queue to the Lua.
                let frontend = (run.proxy == Proxy::Nginx).then_some(*front);
                agent_service(run.name, r, frontend, SCHEDULED_RETURNS)
            })
            .collect()
    }

    fn run(&self, agent: &AgentProcess) {
        let (replicas, fronts) = (&self.replicas, &self.fronts);
        let logs = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            logs.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        enum Running {
            Haproxy(Haproxy),
            Nginx(Nginx, NginxStatus),
        }
        let proxies: Vec<Running> = RUNS
            .iter()
            .enumerate()
            .map(|(i, run)| match run.proxy {
                Proxy::Haproxy => Running::Haproxy(haproxy(run, agent, fronts[i], &replicas[i])),
                Proxy::Nginx => {
                    let nginx = nginx(run, agent, fronts[i], &replicas[i], logs.path());
                    let before = nginx.status();
                    Running::Nginx(nginx, before)
                }
            })
            .collect();
        let records: Vec<(Record, Vec<f64>)> = std::thread::scope(|s| {
            let running: Vec<_> = RUNS
                .iter()
                .zip(fronts)
                .map(|(run, front)| s.spawn(move || clients(run, *front)))
                .collect();
            running.into_iter().map(|r| r.join().unwrap()).collect()
        });
        let figures: Vec<Figures> = RUNS
            .iter()
            .zip(records)
            .zip(&proxies)
            .map(|((run, (record, waits)), proxy)| {
                let counts = match proxy {
                    Running::Haproxy(h) => ProxyCounts::haproxy(|field| {
                        h.stat(&format!("fe_{}", run.name), "FRONTEND", field)
                    }),
                    Running::Nginx(n, before) => {
                        // stub_status counted every attempt (and the one read before).
                        let during = n.status().requests - before.requests - 1;
                        assert_eq!(during, record.clients + record.retries, "{}", run.name);
                        ProxyCounts::nginx_logged(logs.path(), run.name)
                    }
                };
                Figures {
                    run: *run,
                    bound_p99: clairvoyant_p99(&record.arrivals, REPLICAS * PLACES, SERVICE_TIME),
                    record,
                    waits,
                    proxy: counts,
                }
            })
            .collect();
        for f in &figures {
            eprintln!("{}", f.describe());
        }
        for f in &figures {
            f.check();
        }
    }
}
