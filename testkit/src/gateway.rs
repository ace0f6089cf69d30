//! The layout LLM users run: the official OpenAI SDK streaming (`stream=True`, its default two
//! retries) through nginx or HAProxy, neither capping a server's concurrency, in front of one
//! vLLM engine that queues what it cannot batch. The proxy sheds load (nginx: `limit_req` at
//! the engine's capacity, forwarding at once; HAProxy: past a number of requests on the
//! backend), the real agent answers for it (proxy scope, the proxy's listener as `frontend`,
//! `replica_queue = "waiting"`), and the clients obey what they are told.
//!
//! The truth is what no one here wrote: vLLM's own `/metrics` each second, the SDK's own
//! record (its waits, as it logs them, and each call's outcome), and the proxy's counters.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use crate::{
    AgentProcess, Launch,
    engine::Vllm,
    engine_load::{Second, completion_rate},
    kept_returns::{
        KEPT_RETURNS, ProxyCounts, Record, clairvoyant_p99, haproxy_kept_frontend_when,
        openai_clients, quantile,
    },
    proxies::{
        Haproxy, NGINX_LUA_MODULES, Nginx, haproxy_frontend_rejecting_when, nginx_lua_package_path,
    },
};

/// The proxy in front of the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proxy {
    /// nginx with the Lua integration: `limit_req` at the engine's capacity, `nodelay`.
    Nginx,
    /// HAProxy with the Lua integration: rejecting past [`Load::room`] requests on the
    /// backend, its server without `maxconn`.
    Haproxy,
}

/// What the clients are told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// A static `Retry-After` of this many seconds, as an operator would pick.
    Static(u32),
    /// A policy of the agent's, by its configuration name.
    Policy(&'static str),
}

impl Answer {
    /// The `[service.backpressure]` lines.
    fn backpressure(self) -> String {
        match self {
            Self::Static(s) => format!("retry_after_policy = \"static\"\nretry_after_s = {s}\n"),
            Self::Policy("kept_returns") => KEPT_RETURNS.to_owned(),
            Self::Policy(p) => format!("retry_after_policy = \"{p}\"\nretry_after_s = 5\n"),
        }
    }

    fn keeps(self) -> bool {
        self == Self::Policy("kept_returns")
    }

    /// The answer's name in a table.
    pub fn name(self) -> String {
        match self {
            Self::Static(s) => format!("static {s} s"),
            Self::Policy(p) => p.to_owned(),
        }
    }
}

/// One run: the proxy, the answer and the clients' seed.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub proxy: Proxy,
    pub answer: Answer,
    pub seed: u64,
}

impl Layout {
    /// The agent's (and the proxy's) name of the run's service.
    pub fn service(&self) -> String {
        let proxy = match self.proxy {
            Proxy::Nginx => "nginx",
            Proxy::Haproxy => "haproxy",
        };
        let answer = match self.answer {
            Answer::Static(s) => format!("static{s}"),
            Answer::Policy(p) => p.replace('_', "-"),
        };
        format!("gw-{proxy}-{answer}")
    }
}

/// The load every run of a series shares.
#[derive(Clone, Copy, Debug)]
pub struct Load {
    /// The engine's batch (`--max-num-seqs`).
    pub batch: u32,
    /// What the engine completes a second with its batch full (`engine_load::capacity`).
    pub capacity: f64,
    /// Tokens an answer.
    pub tokens: u32,
    /// Arrivals, as a multiple of `capacity`.
    pub overload: f64,
    /// How long clients keep arriving.
    pub seconds: u32,
}

impl Load {
    /// Requests the proxy lets the engine hold, its batch and a queue of two batches: HAProxy's
    /// bound on the backend, nginx's burst plus the batch.
    pub fn room(&self) -> u32 {
        3 * self.batch
    }

    /// What a place in the batch takes per answer, with the batch full.
    fn service_time(&self) -> Duration {
        Duration::from_secs_f64(f64::from(self.batch) / self.capacity)
    }
}

/// The answers a series compares: static values an operator could pick, the proposal's policy,
/// and the agent's two that place each client.
pub const ANSWERS: [Answer; 5] = [
    Answer::Static(1),
    Answer::Static(5),
    Answer::Policy("router_queue_drain_rate"),
    Answer::Policy("scheduled_returns"),
    Answer::Policy("kept_returns"),
];

/// Which build of the agent answers a series.
#[derive(Clone, Debug)]
pub enum AgentBuild {
    /// This tree's: responses end at their framing, and the depth is what waits inside the
    /// engine (`replica_queue = "waiting"`).
    Current,
    /// An earlier build at this path, from before HTTP/1.1 responses were walked to their end:
    /// a response ends at its quiet turn (docs/kernel-observation.md), and its services have
    /// no `replica_queue` (it knows none), so the depth is the listener's in flight beyond the
    /// proxy's to the engine.
    QuietTurn(PathBuf),
}

impl AgentBuild {
    /// The build in a table's title.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Current => "the agent: responses end at their framing",
            Self::QuietTurn(_) => {
                "the agent before the framing walk: responses end at the quiet turn"
            }
        }
    }

    /// The service lines this build is configured with beyond those every build shares.
    fn depth_lines(&self) -> &'static str {
        match self {
            Self::Current => "replica_queue = \"waiting\"\n",
            Self::QuietTurn(_) => "",
        }
    }

    fn launch(&self) -> Launch {
        Launch {
            binary: match self {
                Self::Current => None,
                Self::QuietTurn(path) => Some(path.clone()),
            },
            ..Launch::default()
        }
    }
}

/// The agent's services for `layouts`, each on the listener in `fronts` at the same index,
/// over `engine`, as `build` is configured.
pub fn agent_services(
    layouts: &[Layout],
    fronts: &[SocketAddr],
    engine: &Vllm,
    build: &AgentBuild,
) -> String {
    layouts
        .iter()
        .zip(fronts)
        .map(|(layout, front)| {
            format!(
                "[[service]]\nname = \"{}\"\nfrontend = \"{front}\"\n{}backends = [{{ address = \"{}\" }}]\n[service.backpressure]\n{}",
                layout.service(),
                build.depth_lines(),
                engine.addr(),
                layout.answer.backpressure()
            )
        })
        .collect()
}

/// What a run's proxy is set up from: the layout and load, its listener, the engine behind it,
/// the agent it asks, and a file its workers can read (kept returns' secret).
struct Stage<'a> {
    layout: &'a Layout,
    load: &'a Load,
    front: SocketAddr,
    engine: &'a Vllm,
    agent: &'a AgentProcess,
    secret: &'a Path,
}

/// A proxy of a run, its counters read at its end.
enum Running {
    Haproxy(Haproxy),
    /// nginx (kept running while the run lasts) and the directory of its access log.
    Nginx {
        _running: Nginx,
        logs: tempfile::TempDir,
    },
}

impl Running {
    /// Start the proxy of `stage`.
    fn start(stage: &Stage<'_>) -> Self {
        match stage.layout.proxy {
            Proxy::Haproxy => Self::Haproxy(haproxy(stage)),
            Proxy::Nginx => {
                let logs = tempfile::tempdir().unwrap();
                std::fs::set_permissions(
                    logs.path(),
                    std::os::unix::fs::PermissionsExt::from_mode(0o777),
                )
                .unwrap();
                let http = nginx_http(stage, logs.path());
                let main = format!("{NGINX_LUA_MODULES}worker_processes 2;\n");
                Self::Nginx {
                    _running: Nginx::start_with(&main, &http, None),
                    logs,
                }
            }
        }
    }

    /// The proxy's own counts of the run.
    fn counts(&self, service: &str) -> ProxyCounts {
        match self {
            Self::Haproxy(h) => {
                ProxyCounts::haproxy(|f| h.stat(&format!("fe_{service}"), "FRONTEND", f))
            }
            Self::Nginx { logs, .. } => ProxyCounts::nginx_logged(logs.path(), service),
        }
    }
}

/// HAProxy for `layout`: its server without `maxconn`, rejecting past [`Load::room`] requests
/// on the backend (`be_conn`), its service named without a backend (HAProxy has no queue of
/// its own here: the depth is the agent's).
fn haproxy(stage: &Stage<'_>) -> Haproxy {
    let name = stage.layout.service();
    let full = format!("be_conn(be_{name}) ge {}", stage.load.room());
    let servers = format!("    server engine {}\n", stage.engine.addr());
    let keep = format!("{name}=header:authorization");
    let secret = stage.secret.display().to_string();
    let mut settings = vec![
        ("RETRY_AFTER_SERVICES", name.as_str()),
        ("RETRY_AFTER_STATIC", "5"),
    ];
    let sections = if stage.layout.answer.keeps() {
        settings.extend([
            ("RETRY_AFTER_KEEP", keep.as_str()),
            ("RETRY_AFTER_SECRET_FILE", secret.as_str()),
        ]);
        haproxy_kept_frontend_when(&name, stage.front, &full, "", &servers)
    } else {
        haproxy_frontend_rejecting_when(&name, stage.front, &full, &servers)
    };
    Haproxy::start_with_lua(&stage.agent.socket, &settings, &sections)
}

/// nginx's http block for `layout`: `limit_req` at the engine's capacity with a burst of two
/// batches, `nodelay` (forwarded at once: the queue is the engine's), responses not buffered
/// (each token goes on as it comes), `stamp` on its rejections; with kept returns, `admit`
/// before `limit_req`, keyed by the client's `Authorization`.
fn nginx_http(stage: &Stage<'_>, logs: &Path) -> String {
    let name = stage.layout.service();
    let front = stage.front;
    let burst = stage.load.room() - stage.load.batch;
    let per_minute = (stage.load.capacity * 60.0).round().max(1.0);
    let (keep, tickets, admit) = if stage.layout.answer.keeps() {
        (
            format!(
                ", keep = {{ [\"{name}\"] = {{ key = \"header:authorization\", max_queued = {burst} }} }}, secret_file = \"{}\"",
                stage.secret.display()
            ),
            "lua_shared_dict retry_after_tickets 8m;\n",
            format!(
                "    rewrite_by_lua_block {{ require(\"retry_after_nginx\").admit(\"{name}\") }}\n"
            ),
        )
    } else {
        (String::new(), "", String::new())
    };
    format!(
        "lua_package_path \"{}\";\n\
         lua_shared_dict retry_after 1m;\n{tickets}\
         init_worker_by_lua_block {{ require(\"retry_after_nginx\").start({{ services = {{ \"{name}\" }}, socket = \"{}\"{keep} }}) }}\n\
         log_format statuses \"$status\";\n\
         limit_req_zone $retry_after_limit zone={name}:1m rate={per_minute}r/m;\n\
         upstream engine {{ server {}; keepalive 64; }}\n\
         server {{\n  listen {front};\n  server_name {name};\n  access_log {}/{name}.log statuses;\n\
         \x20 location / {{\n    set $retry_after_limit $server_name;\n{admit}\
         \x20   limit_req zone={name} burst={burst} nodelay;\n    limit_req_status 429;\n\
         \x20   proxy_http_version 1.1;\n    proxy_set_header Connection \"\";\n\
         \x20   proxy_buffering off;\n    proxy_read_timeout 300s;\n    proxy_pass http://engine;\n\
         \x20   header_filter_by_lua_block {{ require(\"retry_after_nginx\").stamp(\"{name}\") }}\n  }}\n}}\n",
        nginx_lua_package_path(),
        stage.agent.socket.display(),
        stage.engine.addr(),
        logs.display(),
    )
}

/// What a run shows.
pub struct Figures {
    pub layout: Layout,
    /// The SDK's record.
    pub record: Record,
    /// Clients rejected at least once, and those of them admitted at their first return.
    pub rejected_clients: u64,
    pub admitted_at_first_return: u64,
    /// Each wait the SDK chose: when it began (seconds since the epoch) and how long it was.
    pub waits: Vec<(f64, f64)>,
    /// The readings, a second apart, from the first arrival until the engine was idle.
    pub seconds: Vec<Second>,
    /// The clairvoyant bound's p99 time to success for the same arrivals.
    pub bound_p99: f64,
    /// The proxy's own counts.
    pub proxy: ProxyCounts,
}

/// Run `layout` under `load`: the proxy on `front`, the SDK's streaming clients through it to
/// their end, the agent's service and vLLM read every second until the engine is idle.
pub fn run(
    engine: &Vllm,
    agent: &AgentProcess,
    layout: Layout,
    front: SocketAddr,
    load: &Load,
    secret: &Path,
) -> Figures {
    let service = layout.service();
    let stage = Stage {
        layout: &layout,
        load,
        front,
        engine,
        agent,
        secret,
    };
    let proxy = Running::start(&stage);
    let url = format!("http://{front}/v1");
    let rate = load.overload * load.capacity;
    let mut options = vec![
        "--stream".to_owned(),
        "--tokens".to_owned(),
        load.tokens.to_string(),
        "--model".to_owned(),
        "tiny-llama".to_owned(),
    ];
    if layout.answer.keeps() {
        options.push("--keyed".to_owned());
    }
    let (seed, seconds) = (layout.seed, load.seconds);
    let clients = thread::spawn(move || {
        let options: Vec<&str> = options.iter().map(String::as_str).collect();
        openai_clients(&url, rate, seconds, seed, &options)
    });
    let start = Instant::now();
    let mut readings = Vec::new();
    while !clients.is_finished()
        || readings
            .last()
            .is_some_and(|s: &Second| s.engine.waiting + s.engine.running > 0.0)
    {
        thread::sleep(Duration::from_secs(1));
        readings.push(Second::read(agent, &service, engine, start));
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "{service}: the run did not end"
        );
    }
    let out = clients.join().expect("the SDK's clients");
    figures(layout, load, &out, readings, proxy.counts(&service))
}

/// A run's figures from the SDK's record `out`.
fn figures(
    layout: Layout,
    load: &Load,
    out: &str,
    seconds: Vec<Second>,
    proxy: ProxyCounts,
) -> Figures {
    let record = Record::parse(out);
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("the clients' record");
    let count = |key: &str| v[key].as_u64().unwrap_or_else(|| panic!("{key} in {out}"));
    let waits = v["waiting_epoch_s"]
        .as_array()
        .expect("waiting_epoch_s")
        .iter()
        .map(|w| {
            let (from, to) = (w[0].as_f64().unwrap(), w[1].as_f64().unwrap());
            (from, to - from)
        })
        .collect();
    let bound_p99 = clairvoyant_p99(&record.arrivals, load.batch as usize, load.service_time());
    Figures {
        layout,
        rejected_clients: count("rejected_clients"),
        admitted_at_first_return: count("admitted_at_first_return"),
        record,
        waits,
        seconds,
        bound_p99,
        proxy,
    }
}

impl Figures {
    /// The share of rejected clients admitted at their first return.
    pub fn first_return_share(&self) -> f64 {
        self.admitted_at_first_return as f64 / self.rejected_clients.max(1) as f64
    }

    /// p99 time to success over the bound's.
    pub fn p99_over_bound(&self) -> f64 {
        quantile(&self.record.times, 0.99) / self.bound_p99
    }

    /// Each wait the SDK chose over the time vLLM's queue then took to drain (its waiting over
    /// its completion rate of the 5 s before, at the first reading after the rejection), where
    /// a batch or more waited: sorted.
    pub fn waits_over_drain_time(&self, batch: u32) -> Vec<f64> {
        let mut ratios: Vec<f64> = self
            .waits
            .iter()
            .filter_map(|&(at, wait)| {
                let i = self.seconds.iter().position(|s| s.epoch >= at)?;
                let s = &self.seconds[i];
                let rate = completion_rate(&self.seconds, i, 5).filter(|r| *r > 0.0)?;
                (s.engine.waiting >= f64::from(batch)).then(|| wait / (s.engine.waiting / rate))
            })
            .collect();
        ratios.sort_by(f64::total_cmp);
        ratios
    }

    /// Place-seconds of the engine's batch left idle while clients waited to come back: at each
    /// reading, the free places (the batch less vLLM's running and waiting), as many as
    /// clients were then waiting, for the second until the next reading; and that over the
    /// batch's place-seconds from the first reading to the last.
    pub fn idle_while_waiting(&self, batch: u32) -> (f64, f64) {
        let mut idle = 0.0;
        for pair in self.seconds.windows(2) {
            let s = &pair[0];
            let free = (f64::from(batch) - s.engine.running - s.engine.waiting).max(0.0);
            let waiting = self
                .waits
                .iter()
                .filter(|&&(at, wait)| at <= s.epoch && s.epoch < at + wait)
                .count() as f64;
            idle += free.min(waiting) * (pair[1].at - s.at);
        }
        let span = match (self.seconds.first(), self.seconds.last()) {
            (Some(a), Some(b)) => b.at - a.at,
            _ => 0.0,
        };
        (idle, idle / (f64::from(batch) * span).max(1e-9))
    }

    /// The run in a table's row: proxy, answer, clients, gave up, errors, admitted at first
    /// return, waits over the queue's drain time (median, share in [1, 1.5]), p99 over the
    /// bound, idle place-seconds while clients waited.
    pub fn row(&self, batch: u32) -> String {
        let r = &self.record;
        let ratios = self.waits_over_drain_time(batch);
        let within = ratios.iter().filter(|x| (1.0..=1.5).contains(*x)).count();
        let (idle, idle_share) = self.idle_while_waiting(batch);
        format!(
            "| {:?} | {} | {} | {} | {} | {} of {} ({:.0}%) | {:.2} ({} of {}) | {:.1} s / {:.1} s ({:.2}x) | {:.1} ({:.1}%) |",
            self.layout.proxy,
            self.layout.answer.name(),
            r.clients,
            r.gave_up,
            r.errors,
            self.admitted_at_first_return,
            self.rejected_clients,
            100.0 * self.first_return_share(),
            quantile(&ratios, 0.5),
            within,
            ratios.len(),
            quantile(&r.times, 0.99),
            self.bound_p99,
            self.p99_over_bound(),
            idle,
            100.0 * idle_share,
        )
    }

    /// The readings, a line each: seconds since the first arrival; the agent's depth, drain
    /// and answer; vLLM's waiting, running and completions a second over the 5 s before; the
    /// waits the SDK began since the reading before, and their median.
    pub fn readings(&self) -> String {
        let mut lines = format!(
            "{}: second | agent depth, drain, answer ms | vLLM waiting, running, completions/s | SDK waits\n",
            self.layout.service()
        );
        for (i, s) in self.seconds.iter().enumerate() {
            let before = i
                .checked_sub(1)
                .map_or(f64::NEG_INFINITY, |b| self.seconds[b].epoch);
            let mut told: Vec<f64> = self
                .waits
                .iter()
                .filter(|&&(at, _)| before <= at && at < s.epoch)
                .map(|&(_, wait)| wait)
                .collect();
            told.sort_by(f64::total_cmp);
            lines.push_str(&format!(
                "{} {:?} | {} told, median {:.2} s\n",
                s.describe(),
                completion_rate(&self.seconds, i, 5),
                told.len(),
                quantile(&told, 0.5),
            ));
        }
        lines
    }

    /// The table's head for [`Figures::row`].
    pub fn head() -> &'static str {
        "| proxy | answer | clients | gave up | errors | admitted at first return | wait / queue's drain time, median (in [1, 1.5]) | p99 to success / bound | idle place-s while clients waited |\n|---|---|---:|---:|---:|---:|---:|---:|---:|"
    }

    /// The SDK's record agrees with the proxy's own counts, and no client is lost.
    pub fn check_counts(&self) {
        let line = format!(
            "{}: {}",
            self.layout.service(),
            self.record.summary(self.bound_p99)
        );
        assert_eq!(self.record.errors, 0, "{line}");
        self.record.has_every_client(&line);
        self.record.agrees_with_the_proxy(self.proxy, &line);
    }
}

/// Run `layouts` one after another under `load`, one agent of `build` answering for all of
/// them (a service each, on a listener of its own): their figures, each row printed as it
/// ends.
pub fn series(engine: &Vllm, layouts: &[Layout], load: &Load, build: &AgentBuild) -> Vec<Figures> {
    let fronts: Vec<SocketAddr> = layouts.iter().map(|_| crate::free_port()).collect();
    let agent = AgentProcess::start_with(
        &crate::proxies::nginx_workers_may_connect(),
        &agent_services(layouts, &fronts, engine, build),
        build.launch(),
    );
    let (_shared, secret) = crate::kept_returns::proxies_secret();
    println!("{}:\n{}", build.name(), Figures::head());
    layouts
        .iter()
        .zip(&fronts)
        .map(|(layout, front)| {
            let figures = run(engine, &agent, *layout, *front, load, &secret);
            println!("{}", figures.row(load.batch));
            figures
        })
        .collect()
}
