//! The kernel matrix: the agent on Debian's own kernels — 5.10 (bullseye), 6.1 (bookworm),
//! 6.12 (trixie), pinned in `testkit/src/kernels.rs` and unpacked by `./dev setup` — each
//! booted under QEMU with this machine's root filesystem (`retry_after_testkit::vm`).
//!
//! Inside each machine, this test binary runs its own ignored test
//! [`guest_side_of_the_kernel_matrix`]: `retry-after-agent check`, then the agent started,
//! then exact-count runs against the distribution's nginx on the guest's loopback, with
//! nginx's stub_status as the truth and the agent's Prometheus counters as the count: ab
//! (one request per connection), ab -k and wrk over plain HTTP/1.1 and over TLS, curl
//! fetching slow bodies (a `Content-Length`, and chunked by gzip, at `limit_rate`: they
//! pause, and must end at their last byte; no plain HTTP/1.1 response is inferred), and
//! h2load over cleartext HTTP/2 (4 connections of 16 streams, one of 1,000, and 8 of 100 to
//! a `deferred` listener, each first flight coming with its handshake); then two servers
//! shaped like an LLM engine (headers at once, a wait for a slot, then a stream of events),
//! one HTTP/1.1 (`stream_server.py`, curl reading server-sent events) and one gRPC
//! (`grpc_calls.py serve-engine`, server-streaming calls on one connection), their own
//! records the truth. Every body is counted begun and ended once. It prints one JSON object
//! per line after [`MARK`]; the host side reads them back, prints a table per kernel and
//! asserts what each kernel must do.

use std::{
    fs,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use retry_after_testkit::{
    agent_binary, endpoint_total, free_port,
    proxies::{Nginx, NginxStatus, Wrk, self_signed_certificate},
    vm,
};
use serde_json::{Value, json};

/// The prefix of the guest side's report lines.
const MARK: &str = "KERNEL-MATRIX ";
/// The guest side's test, as the host runs it inside a machine.
const GUEST_TEST: &str = "kernel_matrix::guest_side_of_the_kernel_matrix";
/// Set in the machines' environment: the guest side runs only where it is set.
const GUEST_ENV: &str = "RETRY_AFTER_KERNEL_MATRIX_GUEST";
/// How long one kernel's machine may run.
const MACHINE_TIMEOUT: Duration = Duration::from_secs(900);

// ---------------------------------------------------------------------------------------
// Inside the machine.
// ---------------------------------------------------------------------------------------

/// The guest side: run inside each machine by the host side below, never on the host.
#[test]
#[ignore = "runs inside the kernel matrix's virtual machines"]
fn guest_side_of_the_kernel_matrix() {
    assert!(
        std::env::var_os(GUEST_ENV).is_some(),
        "{GUEST_TEST} runs inside the kernel matrix's virtual machines only (the kernel_* \
         tests start them)"
    );
    guest::run();
}

mod guest {
    use super::*;

    /// The three listeners of the guest's nginx.
    struct Ports {
        plain: SocketAddr,
        /// Slow bodies: a `Content-Length` and chunked, sent at `limit_rate`.
        streamed: SocketAddr,
        tls: SocketAddr,
        h2c: SocketAddr,
        /// Cleartext HTTP/2 with TCP_DEFER_ACCEPT: each connection's first flight comes with
        /// its handshake, and is walked by the established callback.
        h2c_deferred: SocketAddr,
        /// The engine-shaped HTTP/1.1 server (`stream_server.py`), no nginx in front.
        engine_sse: SocketAddr,
        /// The engine-shaped gRPC server (`grpc_calls.py serve-engine`).
        engine_grpc: SocketAddr,
    }

    /// Print one report line.
    fn emit(value: Value) {
        println!("{MARK}{value}");
    }

    /// Everything, reported line by line.
    pub fn run() {
        let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        emit(json!({"kind": "kernel", "release": release.trim()}));
        let ports = Ports {
            plain: free_port(),
            streamed: free_port(),
            tls: free_port(),
            h2c: free_port(),
            h2c_deferred: free_port(),
            engine_sse: free_port(),
            engine_grpc: free_port(),
        };
        let nginx = start_nginx(&ports);
        let dir = std::env::temp_dir().join("kernel-matrix-agent");
        fs::create_dir_all(&dir).expect("create the agent's directory");
        let metrics = free_port();
        let config = write_config(&dir, &ports, metrics);
        emit(check(&config));
        let log = dir.join("agent.log");
        let (mut agent, report) = start_agent(&config, &log, metrics);
        let started = report["started"] == json!(true);
        emit(report);
        if started {
            for run in runs(&ports) {
                emit(count(&nginx, metrics, &run, &mut agent));
            }
        }
        let exit_code = match agent.try_wait() {
            Ok(Some(status)) => Some(status.code().unwrap_or(-1)),
            _ => None,
        };
        let text = scrape(metrics).unwrap_or_default();
        emit(json!({
            "kind": "after",
            "running": exit_code.is_none(),
            "exit_code": exit_code,
            "features": labelled(&text, "retry_after_kernel_feature", "feature"),
            "tick_errors": labelled(&text, "retry_after_tick_errors_total", "kind"),
            "probe_problems": labelled(&text, "retry_after_probe_problems", "kind"),
            "log": abbreviate(&fs::read_to_string(&log).unwrap_or_default()),
        }));
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
        let _ = agent.wait();
        emit(json!({"kind": "done"}));
    }

    /// nginx with a plain HTTP/1.1 listener, one of slow bodies, a TLS one and two cleartext
    /// HTTP/2 ones (one deferred).
    fn start_nginx(ports: &Ports) -> Nginx {
        let (cert, key) = self_signed_certificate();
        let ok = "keepalive_requests 100000; location / { return 200 \"ok\\n\"; }";
        let site = std::env::temp_dir().join("kernel-matrix-site");
        fs::create_dir_all(&site).expect("create the site's directory");
        let line = "data: {\"token\": \"a few words of an answer\"}\n";
        fs::write(site.join("big"), line.repeat(64 * 1024 / line.len())).expect("write a body");
        let slow = format!(
            "root {site}; location /slow {{ alias {site}/big; limit_rate 64k; }} \
             location /gzip {{ alias {site}/big; default_type text/plain; gzip on; \
             gzip_types *; gzip_comp_level 1; limit_rate 4k; }}",
            site = site.display()
        );
        Nginx::start(&format!(
            "  server {{ listen {plain}; {ok} }}\n  server {{ listen {streamed}; {slow} }}\n  \
             server {{ listen {tls} ssl; \
             ssl_certificate {cert}; ssl_certificate_key {key}; {ok} }}\n  server {{ listen \
             {h2c} http2; http2_max_concurrent_streams 1000; {ok} }}\n  server {{ listen \
             {deferred} deferred http2; {ok} }}",
            plain = ports.plain,
            streamed = ports.streamed,
            tls = ports.tls,
            h2c = ports.h2c,
            deferred = ports.h2c_deferred,
            cert = cert.display(),
            key = key.display(),
        ))
    }

    /// The agent's configuration: a service per listener.
    fn write_config(dir: &Path, ports: &Ports, metrics: SocketAddr) -> PathBuf {
        let service = |name: &str, addr: SocketAddr| {
            format!(
                "[[service]]\nname = \"{name}\"\nbackends = [{{ address = \"{addr}\" }}]\n\
                 [service.backpressure]\nretry_after_policy = \"scheduled_returns\"\n"
            )
        };
        let config = format!(
            "[agent]\ntick_interval_ms = 200\nsocket_path = {:?}\nmetrics_listen = \
             \"{metrics}\"\n\n{}{}{}{}{}{}{}",
            dir.join("agent.sock"),
            service("plain", ports.plain),
            service("streamed", ports.streamed),
            service("tls", ports.tls),
            service("h2c", ports.h2c),
            service("h2c_deferred", ports.h2c_deferred),
            service("engine_sse", ports.engine_sse),
            service("engine_grpc", ports.engine_grpc),
        );
        let path = dir.join("agent.toml");
        fs::write(&path, config).expect("write the agent's configuration");
        path
    }

    /// `retry-after-agent check`: its exit status and output.
    fn check(config: &Path) -> Value {
        let start = Instant::now();
        let out = Command::new(agent_binary())
            .args(["check", "--config"])
            .arg(config)
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .output()
            .expect("run retry-after-agent check");
        let output = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        json!({
            "kind": "check",
            "exit_code": out.status.code(),
            "seconds": start.elapsed().as_secs_f64(),
            "output": abbreviate(&output),
        })
    }

    /// Start `retry-after-agent run`, its log in `log`; wait until its metrics answer, or it
    /// exits, or two minutes pass (the verifier is slow on an emulated CPU).
    fn start_agent(config: &Path, log: &Path, metrics: SocketAddr) -> (Child, Value) {
        let start = Instant::now();
        let log_file = fs::File::create(log).expect("create the agent's log");
        let mut child = Command::new(agent_binary())
            .args(["run", "--config"])
            .arg(config)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("start retry-after-agent run");
        let deadline = start + Duration::from_secs(120);
        let mut exit_code = None;
        let mut serving = false;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                exit_code = Some(status.code().unwrap_or(-1));
                break;
            }
            if scrape(metrics).is_some() {
                serving = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let seconds = start.elapsed().as_secs_f64();
        let log_text = fs::read_to_string(log).unwrap_or_default();
        let report = json!({
            "kind": "agent",
            "started": serving,
            "seconds": seconds,
            "exit_code": exit_code,
            "log": abbreviate(&log_text),
        });
        (child, report)
    }

    /// A traffic run.
    pub struct Run {
        protocol: &'static str,
        tool: &'static str,
        endpoint: SocketAddr,
        url: String,
    }

    /// Every run, in order.
    fn runs(ports: &Ports) -> Vec<Run> {
        let run = |protocol, tool, endpoint: SocketAddr, scheme: &str| Run {
            protocol,
            tool,
            endpoint,
            url: format!("{scheme}://{endpoint}/"),
        };
        vec![
            run("http1", "ab", ports.plain, "http"),
            run("http1", "ab -k", ports.plain, "http"),
            run("http1", "wrk", ports.plain, "http"),
            run("http1", "curl streamed", ports.streamed, "http"),
            run("tls", "ab", ports.tls, "https"),
            run("tls", "ab -k", ports.tls, "https"),
            run("tls", "wrk", ports.tls, "https"),
            run("http2", "h2load", ports.h2c, "http"),
            run("http2", "h2load -m 1000", ports.h2c, "http"),
            run("http2", "h2load deferred", ports.h2c_deferred, "http"),
            run("http1", "engine sse", ports.engine_sse, "http"),
            run("http2", "engine grpc", ports.engine_grpc, "http"),
        ]
    }

    /// Run the tool; the truth's count of it (nginx's, or an engine-shaped server's own)
    /// beside the agent's, on both vantage points.
    fn count(nginx: &Nginx, metrics: SocketAddr, run: &Run, agent: &mut Child) -> Value {
        let before_agent = counters(metrics, run.endpoint);
        let (tool, truth, truth_by) = if run.tool.starts_with("engine") {
            let (tool, served) = engine(run);
            (tool, served, "server")
        } else {
            let before = nginx.status();
            let tool = drive(run);
            (tool, requests_between(before, nginx.status()), "nginx")
        };
        let (server, client) = settle(metrics, run.endpoint, &before_agent, truth, agent);
        // Both vantage points started and completed what the truth counted: an abandoned
        // request is a miss, not an allowance. Plain HTTP/1.1 responses end at their last
        // byte as their framing says: none inferred. Every response here has a body but the
        // HEADs of the slow bodies' run, and inside TLS none is seen: each body begun and
        // ended once.
        let framed = run.protocol != "http1" || server.inferred + client.inferred == 0;
        let bodies = match (run.protocol, run.tool) {
            ("tls", _) => 0,
            (_, "curl streamed") => truth.saturating_sub(STREAMED_HEADS),
            _ => truth,
        };
        let exact = [server, client].iter().all(|side| {
            side.started == truth
                && side.completed == truth
                && side.abandoned == 0
                && side.bodies_begun == bodies
                && side.bodies_ended == bodies
        }) && framed;
        json!({
            "kind": "count",
            "protocol": run.protocol,
            "tool": run.tool,
            "tool_ok": tool.ok,
            "tool_summary": tool.summary,
            "tool_done": tool.done,
            "tool_runs": tool.runs,
            "truth": truth,
            "truth_by": truth_by,
            "bodies": bodies,
            "server": server.to_json(),
            "client": client.to_json(),
            "exact": exact,
        })
    }

    /// The `HEAD`s among the slow bodies' fetches (`curl_streamed`): no body.
    const STREAMED_HEADS: u64 = 4;

    /// Streams the engine-shaped runs send at once.
    const ENGINE_STREAMS: u32 = 8;

    /// An engine-shaped run: its server started on the run's port (4 slots, a wait of 0.2 s,
    /// then 10 events 0.05 s apart), `ENGINE_STREAMS` clients at once, to their end; what the
    /// clients said, and the streams the server's own record holds.
    fn engine(run: &Run) -> (Tool, u64) {
        let clients = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients");
        let port = run.endpoint.port().to_string();
        let mut server = Command::new("python3");
        match run.tool {
            "engine sse" => server.arg(clients.join("stream_server.py")).arg(&port),
            _ => server
                .arg(clients.join("grpc_calls.py"))
                .args(["serve-engine", &port]),
        };
        let Ok(mut server) = server
            .args(["4", "0.2", "10", "0.05"])
            .stdout(Stdio::piped())
            .spawn()
        else {
            return (failed("cannot start the engine-shaped server"), 0);
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(run.endpoint).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let tool = match run.tool {
            "engine sse" => curl_all((0..ENGINE_STREAMS).map(|_| {
                let mut curl = Command::new("curl");
                curl.args(["-sS", "-N", "-o", "/dev/null", "--fail", "-d", "{}"])
                    .arg(&run.url);
                curl
            })),
            _ => {
                let mut generate = Command::new("python3");
                generate.arg(clients.join("grpc_calls.py")).args([
                    "generate",
                    &port,
                    &ENGINE_STREAMS.to_string(),
                ]);
                grpc_generate(&mut generate)
            }
        };
        let _ = server.kill();
        let mut record = String::new();
        if let Some(mut out) = server.stdout.take() {
            let _ = out.read_to_string(&mut record);
        }
        let _ = server.wait();
        let served = record
            .lines()
            .filter(|l| l.starts_with("first ") || l.starts_with("call "))
            .count();
        (tool, served as u64)
    }

    /// A tool that could not run.
    fn failed(why: &str) -> Tool {
        Tool {
            ok: false,
            summary: why.to_owned(),
            done: None,
            runs: 1,
        }
    }

    /// `grpc_calls.py generate`: its record of the calls that ended.
    fn grpc_generate(command: &mut Command) -> Tool {
        let Ok(out) = command.output() else {
            return failed("cannot run grpc_calls.py generate");
        };
        let line = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let done = serde_json::from_str::<Value>(&line)
            .ok()
            .and_then(|v| v["ended"].as_u64());
        Tool {
            ok: out.status.success(),
            summary: line,
            done,
            runs: 1,
        }
    }

    /// Requests nginx received between two readings (the later reading is one of its own).
    fn requests_between(before: NginxStatus, after: NginxStatus) -> u64 {
        after.requests - before.requests - 1
    }

    /// Run the tool of `run` to its end: whether it succeeded, and its summary line.
    fn drive(run: &Run) -> Tool {
        match run.tool {
            "wrk" => wrk(&run.url),
            "curl streamed" => curl_streamed(&run.url),
            "h2load" => tool(
                Command::new("h2load").args(["-n", "2000", "-c", "4", "-m", "16", &run.url]),
                "requests:",
            ),
            // Each connection's first flight (the preface and 100 HEADERS) with its handshake.
            "h2load deferred" => tool(
                Command::new("h2load").args(["-n", "2000", "-c", "8", "-m", "100", &run.url]),
                "requests:",
            ),
            // A thousand streams at once on one connection: segments of thousands of frames,
            // which the build without `bpf_loop` walks over several programs.
            "h2load -m 1000" => tool(
                Command::new("h2load").args(["-n", "20000", "-c", "1", "-m", "1000", &run.url]),
                "requests:",
            ),
            ab => {
                let requests = if run.protocol == "tls" && ab == "ab" {
                    "500"
                } else {
                    "2000"
                };
                let mut command = Command::new("ab");
                command.args(["-q", "-n", requests, "-c", "10"]);
                if ab == "ab -k" {
                    command.arg("-k");
                }
                tool(command.arg(&run.url), "Complete requests:")
            }
        }
    }

    /// wrk for 2 s, run again (up to [`WRK_RUNS`] times) while a run completes nothing: the
    /// machine runs niced beside the lanes, and a CI run starved it through a whole TLS run (0
    /// requests in 6.93 s of wrk's 2 s, nginx's count 0 too, the machine 211 s where 91 s is
    /// usual). Each run may leave up to [`WRK_CONNECTIONS`] requests unanswered at its end.
    fn wrk(url: &str) -> Tool {
        let mut summaries = Vec::new();
        for _ in 0..WRK_RUNS {
            let totals = Wrk::start_url(url, 1, WRK_CONNECTIONS, 2).finish();
            summaries.push(format!("{totals:?}"));
            if totals.requests > 0 {
                return Tool {
                    ok: true,
                    summary: summaries.join(", then "),
                    done: Some(totals.requests),
                    runs: summaries.len() as u32,
                };
            }
        }
        Tool {
            ok: false,
            summary: summaries.join(", then "),
            done: Some(0),
            runs: WRK_RUNS,
        }
    }

    /// curl fetching slow bodies at once: 8 with a `Content-Length` (64 KiB at 64 KiB/s, in
    /// bursts), 4 chunked (gzip, at 4 KiB/s) and `STREAMED_HEADS` `HEAD`s; each must succeed.
    fn curl_streamed(url: &str) -> Tool {
        let fetch = |path: &str, args: &[&str]| {
            let mut curl = Command::new("curl");
            curl.args(["-sS", "-o", "/dev/null", "--fail"])
                .args(args)
                .arg(format!("{url}{path}"));
            curl
        };
        curl_all(
            (0..8)
                .map(|_| fetch("slow", &[]))
                .chain((0..4).map(|_| fetch("gzip", &["--compressed"])))
                .chain((0..STREAMED_HEADS).map(|_| fetch("slow", &["-I"]))),
        )
    }

    /// Run every curl of `fetches` at once; each must succeed.
    fn curl_all(fetches: impl Iterator<Item = Command>) -> Tool {
        let clients: Vec<_> = fetches.map(|mut curl| curl.spawn()).collect();
        let total = clients.len();
        let done = clients
            .into_iter()
            .filter_map(Result::ok)
            .filter_map(|mut child| child.wait().ok())
            .filter(|status| status.success())
            .count();
        Tool {
            ok: done == total,
            summary: format!("{done} of {total} curl fetches succeeded"),
            done: Some(done as u64),
            runs: 1,
        }
    }

    /// wrk's connections in the matrix's runs.
    pub const WRK_CONNECTIONS: u32 = 10;

    /// The most runs of wrk for one line of the matrix (see [`wrk`]).
    const WRK_RUNS: u32 = 3;

    /// What a load tool said of its run.
    pub struct Tool {
        /// It exited successfully.
        ok: bool,
        /// Its summary line.
        summary: String,
        /// Requests it completed, by its own count (ab's "Complete requests", h2load's
        /// "succeeded", wrk's total), if it said.
        done: Option<u64>,
        /// Times it ran (wrk may run again: see [`wrk`]); the truth counts every run.
        runs: u32,
    }

    /// Run a load tool: whether it succeeded, its line starting with `summary`, and the count
    /// of requests it completed read from that line.
    fn tool(command: &mut Command, summary: &str) -> Tool {
        let Ok(out) = command.output() else {
            return Tool {
                ok: false,
                summary: format!("cannot run {command:?}"),
                done: None,
                runs: 1,
            };
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(summary))
            .unwrap_or("no summary")
            .trim()
            .to_owned();
        Tool {
            ok: out.status.success(),
            done: completed_by_tool(&line),
            summary: line,
            runs: 1,
        }
    }

    /// Requests completed, from ab's `Complete requests: N` or h2load's `requests: … N
    /// succeeded, …`.
    fn completed_by_tool(line: &str) -> Option<u64> {
        if let Some(n) = line.strip_prefix("Complete requests:") {
            return n.trim().parse().ok();
        }
        let words: Vec<&str> = line.split([' ', ',']).filter(|w| !w.is_empty()).collect();
        words
            .windows(2)
            .find(|w| w[1] == "succeeded")
            .and_then(|w| w[0].parse().ok())
    }

    /// One vantage point's counters of an endpoint, as the metrics report them.
    #[derive(Clone, Copy, Debug, Default)]
    pub struct Side {
        started: u64,
        completed: u64,
        abandoned: u64,
        /// Of the completed, those whose end was inferred, their framing not read.
        inferred: u64,
        /// Responses whose body began, and of those the ones that ended.
        bodies_begun: u64,
        bodies_ended: u64,
    }

    impl Side {
        fn since(self, before: Side) -> Side {
            Side {
                started: self.started.saturating_sub(before.started),
                completed: self.completed.saturating_sub(before.completed),
                abandoned: self.abandoned.saturating_sub(before.abandoned),
                inferred: self.inferred.saturating_sub(before.inferred),
                bodies_begun: self.bodies_begun.saturating_sub(before.bodies_begun),
                bodies_ended: self.bodies_ended.saturating_sub(before.bodies_ended),
            }
        }

        fn to_json(self) -> Value {
            json!({"started": self.started, "completed": self.completed,
                   "abandoned": self.abandoned, "inferred": self.inferred,
                   "bodies_begun": self.bodies_begun, "bodies_ended": self.bodies_ended})
        }
    }

    /// Server and client side counters of `endpoint` now (zero while not reported).
    fn counters(metrics: SocketAddr, endpoint: SocketAddr) -> (Side, Side) {
        let text = scrape(metrics).unwrap_or_default();
        let side = |side: &str| Side {
            started: endpoint_total(&text, "requests_started", endpoint, side),
            completed: endpoint_total(&text, "responses_completed", endpoint, side),
            abandoned: endpoint_total(&text, "requests_abandoned", endpoint, side),
            inferred: endpoint_total(&text, "responses_inferred", endpoint, side),
            bodies_begun: endpoint_total(&text, "bodies_begun", endpoint, side),
            bodies_ended: endpoint_total(&text, "bodies_ended", endpoint, side),
        };
        (side("server"), side("client"))
    }

    /// Wait (up to 15 s, while the agent runs) until the agent's counts since `before` reach
    /// `truth` and hold; the last counts seen.
    fn settle(
        metrics: SocketAddr,
        endpoint: SocketAddr,
        before: &(Side, Side),
        truth: u64,
        agent: &mut Child,
    ) -> (Side, Side) {
        let deadline = Instant::now() + Duration::from_secs(15);
        let read = || {
            let (server, client) = counters(metrics, endpoint);
            (server.since(before.0), client.since(before.1))
        };
        let done = |(s, c): &(Side, Side)| {
            s.started >= truth && c.started >= truth && s.completed + s.abandoned >= s.started
        };
        loop {
            let seen = read();
            let exited = !matches!(agent.try_wait(), Ok(None));
            if done(&seen) || exited || Instant::now() > deadline {
                // One more tick or two: a count that overshoots shows.
                std::thread::sleep(Duration::from_millis(500));
                return read();
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Every series of `metric` (one label, `label`) in the scraped `text`: label value → value.
    fn labelled(text: &str, metric: &str, label: &str) -> Value {
        let prefix = format!("{metric}{{{label}=\"");
        let series: serde_json::Map<String, Value> = text
            .lines()
            .filter_map(|line| line.strip_prefix(&prefix))
            .filter_map(|rest| {
                let (name, rest) = rest.split_once('"')?;
                let value: f64 = rest.rsplit(' ').next()?.parse().ok()?;
                Some((name.to_owned(), json!(value)))
            })
            .collect();
        Value::Object(series)
    }

    /// GET /metrics from the agent on loopback; the body.
    fn scrape(metrics: SocketAddr) -> Option<String> {
        let mut stream = TcpStream::connect_timeout(&metrics, Duration::from_secs(2)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
            .ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let (head, body) = response.split_once("\r\n\r\n")?;
        head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
    }

    /// `text`, or its beginning and end if it is long (a verifier log can be megabytes).
    fn abbreviate(text: &str) -> String {
        const KEEP: usize = 12_000;
        if text.len() <= 2 * KEEP {
            return text.to_owned();
        }
        let head = text.get(..text.floor_char_boundary(KEEP)).unwrap_or("");
        let tail_from = text.ceil_char_boundary(text.len() - KEEP);
        let tail = text.get(tail_from..).unwrap_or("");
        format!(
            "{head}\n[… {} bytes left out …]\n{tail}",
            text.len() - 2 * KEEP
        )
    }
}

// ---------------------------------------------------------------------------------------
// On the host.
// ---------------------------------------------------------------------------------------

/// What the guest side reported for one kernel.
struct Report {
    kernel: &'static vm::Kernel,
    run: vm::GuestRun,
    lines: Vec<Value>,
}

impl Report {
    /// The one line of `kind`.
    fn line(&self, kind: &str) -> &Value {
        self.lines
            .iter()
            .find(|l| l["kind"] == kind)
            .unwrap_or_else(|| {
                panic!(
                    "kernel {}: no {kind} line\n{}",
                    self.kernel.name,
                    self.dump()
                )
            })
    }

    /// The count lines.
    fn counts(&self) -> impl Iterator<Item = &Value> {
        self.lines.iter().filter(|l| l["kind"] == "count")
    }

    /// The count line of `protocol` and `tool`.
    fn count(&self, protocol: &str, tool: &str) -> &Value {
        self.counts()
            .find(|l| l["protocol"] == protocol && l["tool"] == tool)
            .unwrap_or_else(|| {
                panic!(
                    "kernel {}: no count of {protocol} with {tool}\n{}",
                    self.kernel.name,
                    self.dump()
                )
            })
    }

    /// The guest's whole output and console, for a failure's message.
    fn dump(&self) -> String {
        format!(
            "--- guest output ---\n{}\n--- console ---\n{}",
            self.run.output, self.run.console
        )
    }

    /// `check`'s output.
    fn check_output(&self) -> &str {
        self.line("check")["output"].as_str().unwrap_or("")
    }
}

/// Boot `name`'s machine, run the guest side in it, read its report back and print it.
fn matrix_run(name: &str) -> Report {
    let kernel = vm::kernel(name).unwrap_or_else(|| panic!("no kernel {name} in the matrix"));
    let exe = std::env::current_exe().expect("this test binary's path");
    let exe = exe.to_string_lossy();
    let command = [
        exe.as_ref(),
        "--ignored",
        "--exact",
        GUEST_TEST,
        "--nocapture",
        "--test-threads=1",
    ];
    let options = vm::Options {
        timeout: MACHINE_TIMEOUT,
        env: vec![(GUEST_ENV.to_owned(), kernel.name.to_owned())],
        ..vm::Options::default()
    };
    let run = vm::run_with(kernel, &command, &options).unwrap_or_else(|error| {
        panic!(
            "kernel {} ({}): {error}\n(the matrix needs `./dev setup`: QEMU, busybox-static and \
             the pinned kernels)",
            kernel.name, kernel.release
        )
    });
    let lines = run
        .output
        .lines()
        .filter_map(|l| l.strip_prefix(MARK))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let report = Report { kernel, run, lines };
    print_table(&report);
    report
}

/// The per-kernel table: times, check, agent start, counts beside nginx's.
fn print_table(report: &Report) {
    let k = report.kernel;
    println!(
        "\n=== kernel {} ({}, Debian {} {}) ===",
        k.name, k.release, k.suite, k.version
    );
    println!(
        "boot {:.1} s, machine {:.1} s in all, guest side exited {}",
        report.run.boot.as_secs_f64(),
        report.run.wall.as_secs_f64(),
        report.run.exit_code
    );
    for line in &report.lines {
        match line["kind"].as_str() {
            Some("check") => println!(
                "check: exit {} in {:.1} s",
                line["exit_code"],
                line["seconds"].as_f64().unwrap_or(0.0)
            ),
            Some("agent") => println!(
                "agent: started {} in {:.1} s (exit {})",
                line["started"],
                line["seconds"].as_f64().unwrap_or(0.0),
                line["exit_code"]
            ),
            Some("count") => {
                let n = |v: &Value| v.as_u64().unwrap_or(0);
                println!(
                    "{:<6} {:<15} tool {:>6}  {:<6} {:>6}  server {:>6}/{:>6}  client {:>6}/{:>6}  inferred {}/{}  bodies {} {}/{} {}/{}  {}",
                    line["protocol"].as_str().unwrap_or(""),
                    line["tool"].as_str().unwrap_or(""),
                    n(&line["tool_done"]),
                    line["truth_by"].as_str().unwrap_or(""),
                    n(&line["truth"]),
                    n(&line["server"]["started"]),
                    n(&line["server"]["completed"]),
                    n(&line["client"]["started"]),
                    n(&line["client"]["completed"]),
                    n(&line["server"]["inferred"]),
                    n(&line["client"]["inferred"]),
                    n(&line["bodies"]),
                    n(&line["server"]["bodies_begun"]),
                    n(&line["server"]["bodies_ended"]),
                    n(&line["client"]["bodies_begun"]),
                    n(&line["client"]["bodies_ended"]),
                    if line["exact"] == true {
                        "exact"
                    } else if n(&line["server"]["started"]) + n(&line["client"]["started"]) == 0 {
                        "not counted"
                    } else {
                        "NOT EXACT"
                    }
                )
            }
            Some("after") => println!(
                "agent still running after the runs: {} (exit {})\nkernel features: {}\ntick errors: {}\nprobe problems: {}",
                line["running"],
                line["exit_code"],
                line["features"],
                line["tick_errors"],
                line["probe_problems"]
            ),
            _ => {}
        }
    }
    let trouble = report.lines.iter().any(|l| {
        (l["kind"] == "agent" && l["started"] != true)
            || (l["kind"] == "after" && l["running"] != true)
            || (l["kind"] == "count" && l["exact"] != true)
    });
    if trouble {
        println!("--- check ---\n{}", report.check_output());
        let log = report.lines.iter().rev().find_map(|l| l["log"].as_str());
        println!("--- agent log ---\n{}", log.unwrap_or(""));
    }
}

/// The guest side finished, `check` passed, the agent started and stayed up.
fn assert_starts(report: &Report) {
    let name = report.kernel.name;
    assert_eq!(
        report.run.exit_code,
        0,
        "kernel {name}: the guest side failed\n{}",
        report.dump()
    );
    report.line("done");
    assert_eq!(
        report.line("check")["exit_code"],
        0,
        "kernel {name}: check failed:\n{}",
        report.check_output()
    );
    let agent = report.line("agent");
    assert_eq!(
        agent["started"],
        true,
        "kernel {name}: the agent did not start:\n{}",
        agent["log"].as_str().unwrap_or("")
    );
    let after = report.line("after");
    assert_eq!(
        after["running"], true,
        "kernel {name}: the agent did not stay up"
    );
    // Every tick read the counters and the listeners' backlogs.
    let tick_errors = after["tick_errors"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    assert!(
        tick_errors.values().all(|v| v.as_f64() == Some(0.0)),
        "kernel {name}: ticks failed: {tick_errors:?}"
    );
}

/// The agent's `retry_after_kernel_feature` series, as the guest side last read them: every
/// feature listed, `missing` at 0, the others at 1.
fn assert_features(report: &Report, missing: &[&str]) {
    let features = &report.line("after")["features"];
    for feature in ["bpf_loop", "tracing_socket_storage", "cgroup_links"] {
        let want = if missing.contains(&feature) { 0.0 } else { 1.0 };
        assert_eq!(
            features[feature].as_f64(),
            Some(want),
            "kernel {}: {feature} in {features}",
            report.kernel.name
        );
    }
}

/// Every run of `protocol` counted exactly, each tool succeeding with real traffic.
fn assert_exact(report: &Report, protocol: &str, tools: &[&str]) {
    for tool in tools {
        let line = report.count(protocol, tool);
        let what = format!(
            "kernel {}: {protocol} with {tool}: {line}",
            report.kernel.name
        );
        assert_eq!(line["tool_ok"], true, "{what}");
        // The truth (nginx, or an engine-shaped server) counted what the tool completed (wrk
        // stops mid-request on its connections at the end of each run: those reach nginx
        // too), and the agent what the truth counted.
        let nginx = line["truth"].as_u64().expect("the truth's count");
        let done = line["tool_done"].as_u64().expect("the tool's own count");
        if *tool == "wrk" {
            let runs = line["tool_runs"].as_u64().expect("the tool's runs");
            assert!(
                (done..=done + runs * u64::from(guest::WRK_CONNECTIONS)).contains(&nginx),
                "{what}"
            );
        } else {
            assert_eq!(nginx, done, "{what}");
        }
        assert!(done > 0, "{what}");
        assert_eq!(line["exact"], true, "{what}");
    }
}

const HTTP1_TOOLS: [&str; 5] = ["ab", "ab -k", "wrk", "curl streamed", "engine sse"];
const TLS_TOOLS: [&str; 3] = ["ab", "ab -k", "wrk"];
const H2_TOOLS: [&str; 4] = ["h2load", "h2load -m 1000", "h2load deferred", "engine grpc"];

/// `check` says that HTTP/2 is not counted on this kernel (the agent's words: adjust here if
/// they change).
fn check_reports_http2_not_counted(check_output: &str) -> bool {
    check_output.contains("HTTP/2 streams not counted")
}

/// A kernel on which everything is counted exactly: HTTP/1.1, TLS and HTTP/2.
fn assert_everything_exact(name: &str) {
    let report = matrix_run(name);
    assert_starts(&report);
    assert!(
        !check_reports_http2_not_counted(report.check_output()),
        "kernel {name}: check says HTTP/2 is not counted:\n{}",
        report.check_output()
    );
    assert_features(&report, &[]);
    assert_exact(&report, "http1", &HTTP1_TOOLS);
    assert_exact(&report, "tls", &TLS_TOOLS);
    assert_exact(&report, "http2", &H2_TOOLS);
}

#[test]
fn kernel_6_12_starts_attaches_and_counts_everything_exactly() {
    assert_everything_exact("6.12");
}

#[test]
fn kernel_6_1_starts_attaches_and_counts_everything_exactly() {
    assert_everything_exact("6.1");
}

/// Debian 11's 5.10 has no `bpf_loop`: the build that walks HTTP/2 frames in steps runs, and
/// counts h2load's streams as exactly as the full build does.
#[test]
fn kernel_5_10_counts_http1_tls_and_http2_in_steps_exactly() {
    let report = matrix_run("5.10");
    assert_starts(&report);
    assert_exact(&report, "http1", &HTTP1_TOOLS);
    assert_exact(&report, "tls", &TLS_TOOLS);
    assert!(
        !check_reports_http2_not_counted(report.check_output())
            && report
                .check_output()
                .contains("HTTP/2 frames walked in steps"),
        "kernel 5.10: check does not say that HTTP/2 frames are walked in steps:\n{}",
        report.check_output()
    );
    assert_features(&report, &["bpf_loop", "tracing_socket_storage"]);
    assert_exact(&report, "http2", &H2_TOOLS);
    let problems = &report.line("after")["probe_problems"];
    for kind in [
        "http2_connections_left_out",
        "http2_walks_cut",
        "http2_first_flights_unwalked",
    ] {
        assert_eq!(
            problems[kind].as_f64(),
            Some(0.0),
            "kernel 5.10: {problems}"
        );
    }
}
