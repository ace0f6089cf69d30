//! HTTP/2 streams counted from the kernel, against software no one here wrote and its own
//! counters: h2load (nghttp2) against the distribution's nginx serving cleartext HTTP/2, with
//! stub_status as the truth; many concurrent streams on each connection, keep-alive and new
//! connections, answers and rejections (429 spelled out by nginx's HPACK encoder). And a
//! grpcio server with grpcio clients (`tests/clients/grpc_calls.py`), unary and
//! server-streaming calls and RESOURCE_EXHAUSTED (trailers-only) rejections, on a connection
//! opened before it was watched and on new ones, with the server's own counts as the truth.
//! And grpcio clients with a retry policy against a server answering through
//! `retry_after_grpc.RetryPushback`: grpc's own retry trace shows the agent's
//! `grpc-retry-pushback-ms` waited out.

use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use retry_after_agent::kernel::{KernelFeature, ProbeOptions, ProgramSet, WatchOptions};
use retry_after_common::{EndpointCounters, ProbeStat, Protocol, Side};
use retry_after_estimator::endpoint::Endpoint;
use retry_after_protocol::{Response, policy::Rung};
use retry_after_testkit::{
    AgentProcess, AttachedProbe, SETTLE, free_port,
    netns::{self, HostPair},
    proxies::{Haproxy, Nginx, NginxStatus},
    run_ok,
};

/// Requests nginx received between two readings of stub_status (the later reading is itself
/// one request).
fn requests_between(before: NginxStatus, after: NginxStatus) -> u64 {
    after.requests - before.requests - 1
}

/// `h2load -n requests -c clients -m streams url` (cleartext HTTP/2, prior knowledge); every
/// request must be answered (h2load counts a 4xx as done and failed, a 2xx as succeeded): its
/// summary line is returned.
fn h2load(url: &str, requests: u32, clients: u32, streams: u32) -> String {
    h2load_with(Command::new("h2load"), url, requests, clients, streams)
}

/// [`h2load`], run as `command` (in a network namespace, say).
fn h2load_with(
    mut command: Command,
    url: &str,
    requests: u32,
    clients: u32,
    streams: u32,
) -> String {
    let out = run_ok(command.args([
        "-n",
        &requests.to_string(),
        "-c",
        &clients.to_string(),
        "-m",
        &streams.to_string(),
        url,
    ]));
    let summary = out
        .lines()
        .find(|l| l.starts_with("requests:"))
        .unwrap_or_else(|| panic!("h2load printed no summary:\n{out}"))
        .to_owned();
    assert!(
        summary.contains(&format!("{requests} done")) && summary.contains(" 0 errored"),
        "h2load: {summary}"
    );
    summary
}

/// The loads of [`h2load_streams_are_counted_exactly_on_both_sides`]:
/// connections × streams at once on each, up to what a proxy's backend connections carry.
const STREAM_LOADS: [(u32, u32); 4] = [(8, 64), (4, 128), (2, 500), (1, 1000)];

/// The server blocks of an nginx listening on `addr` for [`h2load_cells`]: up to 1,000
/// streams at once on a connection; `/` answers 3 bytes, `/kb` 3 KB, `/busy` 429.
fn h2c_server(addr: std::net::SocketAddr) -> String {
    let body = "x".repeat(3000);
    format!(
        "  server {{ listen {addr} http2; http2_max_concurrent_streams 1000; \
         keepalive_requests 1000000; location / {{ return 200 \"ok\\n\"; }} \
         location /kb {{ return 200 \"{body}\"; }} \
         location /busy {{ return 429 \"busy\\n\"; }} }}"
    )
}

/// One load of [`h2load_cells`]: the path, requests, connections and streams at once.
type Load = (&'static str, u32, u32, u32);

/// Run each of `loads` with `run` (url, requests, connections, streams) against `nginx`
/// (serving [`h2c_server`] on `endpoint`), each counted from zero; assert that both vantage
/// points started and completed what nginx's stub_status counted, none abandoned, none in
/// flight, `/busy`'s 429s exactly the rejections. The table of what each cell counted is
/// printed.
fn h2load_cells(
    nginx: &Nginx,
    probe: &mut AttachedProbe,
    endpoint: Endpoint,
    loads: &[Load],
    run: impl Fn(&str, u32, u32, u32),
) {
    let mut table = Vec::new();
    let mut failures = Vec::new();
    for &(path, requests, connections, streams) in loads {
        let before = nginx.status();
        run(
            &format!("http://{endpoint}{path}"),
            requests,
            connections,
            streams,
        );
        let total = requests_between(before, nginx.status());
        assert_eq!(total, u64::from(requests), "nginx's own count");
        let rejected = if path == "/busy" { total } else { 0 };
        let (server, client) = both_sides_settle(probe, endpoint, (total, rejected));
        let cell = format!(
            "{connections} x {streams} {path}: nginx {total} ({rejected} rejected); nginx's side \
             {}/{} ({} rejected, {} abandoned, bodies {}/{}); h2load's side {}/{} ({} rejected, \
             {} abandoned, bodies {}/{}); {:?}",
            server.requests_started,
            server.responses_completed,
            server.responses_rejected,
            server.requests_abandoned,
            server.bodies_begun,
            server.bodies_ended,
            client.requests_started,
            client.responses_completed,
            client.responses_rejected,
            client.requests_abandoned,
            client.bodies_begun,
            client.bodies_ended,
            probe.read().probe
        );
        // Every answer nginx serves here has a body (a rejection's ends its stream at its
        // HEADERS): each served stream streamed once, and none streams still.
        let exact = |c: &EndpointCounters| {
            c.requests_started == total
                && c.responses_completed == total
                && c.responses_rejected == rejected
                && c.requests_abandoned == 0
                && c.bodies_begun == total - rejected
                && c.bodies_ended == c.bodies_begun
        };
        if !(exact(&server) && exact(&client)) {
            failures.push(cell.clone());
        }
        table.push(cell);
        // The next load is held to its own count.
        probe.unwatch(endpoint);
        probe.watch(endpoint);
    }
    eprintln!("{}", table.join("\n"));
    assert!(failures.is_empty(), "cells off:\n{}", failures.join("\n"));
    let problems = probe.read().probe;
    for stat in [
        ProbeStat::Http2StreamsUntracked,
        ProbeStat::Http2StreamsExpired,
        ProbeStat::Http2BodiesUntracked,
    ] {
        assert_eq!(problems.get(stat), 0, "{problems:?}");
    }
}

/// Wait until both vantage points of `endpoint` have ended every stream they started (none
/// in flight) and nginx's side holds `total` completed with `rejected` rejections, or the
/// settle runs out: what each side counted then (h2load closes its connections, so a stream
/// whose end was missed is abandoned, not left in flight).
fn both_sides_settle(
    probe: &AttachedProbe,
    endpoint: Endpoint,
    (total, rejected): (u64, u64),
) -> (EndpointCounters, EndpointCounters) {
    let deadline = std::time::Instant::now() + SETTLE;
    loop {
        let (server, client) = (
            probe.counters(endpoint, Side::Server).counters,
            probe.counters(endpoint, Side::Client).counters,
        );
        let settled = server.responses_completed == total
            && server.responses_rejected == rejected
            && client.requests_started == total
            && client.in_flight() == 0;
        if settled || std::time::Instant::now() > deadline {
            return (server, client);
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// nginx over cleartext HTTP/2 ([`h2c_server`]), h2load as the client: for each of
/// [`STREAM_LOADS`], with bodies of 3 bytes and of 3 KB, 40,000 requests; then 3,000 answered
/// 429. Both vantage points count every stream nginx's stub_status counted, exactly; h2load's
/// side receives nginx's segments out of order, and on two CPUs at once, on loopback: they are
/// walked by one CPU at a time, parked when ahead and walked in order.
#[test]
fn h2load_streams_are_counted_exactly_on_both_sides() {
    let addr = free_port();
    let nginx = Nginx::start(&h2c_server(addr));
    let endpoint = Endpoint::from(addr);
    let mut probe = AttachedProbe::watching(&[endpoint]);
    let loads: Vec<Load> = ["/", "/kb"]
        .into_iter()
        .flat_map(|path| STREAM_LOADS.map(|(c, m)| (path, 40_000, c, m)))
        .chain([("/busy", 3_000, 6, 32)])
        .collect();
    h2load_cells(&nginx, &mut probe, endpoint, &loads, |url, n, c, m| {
        h2load(url, n, c, m);
    });
}

/// The same between two test hosts (network namespaces made for the test, joined by a veth
/// pair), nginx on one and h2load on the other, with 1% of the packets each end receives lost
/// and 1% of those it sends duplicated (nftables): every loss is retransmitted after the
/// segments behind it have arrived, so both directions arrive out of order, and duplicates
/// arrive twice. Both vantage points count exactly what nginx's stub_status counted.
#[test]
fn h2load_between_hosts_losing_and_duplicating_segments_is_counted_exactly() {
    let loads: Vec<Load> = ["/", "/kb"]
        .into_iter()
        .flat_map(|path| [(path, 20_000, 4, 128), (path, 20_000, 1, 1000)])
        .chain([("/busy", 2_000, 4, 32)])
        .collect();
    let hosts = h2load_cells_between_hosts(&loads);
    for ns in [&hosts.server, &hosts.client] {
        let rules = HostPair::ruleset(ns);
        let (arrived_out_of_order, ofo) = HostPair::arrived_out_of_order(ns);
        eprintln!("{ns}:\n{rules}{ofo}");
        assert!(
            !rules.contains("counter packets 0 "),
            "every rule lost or duplicated packets:\n{rules}"
        );
        // h2load's end must have received nginx's segments out of order (what the test is
        // for); nginx's may or may not, as h2load's requests come in few segments at a time.
        assert!(
            *ns != hosts.client || arrived_out_of_order.is_some_and(|n| n > 0),
            "segments arrived out of order at {ns}:\n{ofo}"
        );
    }
}

/// [`h2load_between_hosts_losing_and_duplicating_segments_is_counted_exactly`]'s cell with the
/// most segments in flight on a connection (4 × 128 streams, 3 KB bodies: nginx's sends
/// nest with the receive path's softirqs), twelve times over one agent: under the same loss and
/// duplication, every cell exact on both vantage points (why this cell: docs/kernel-observation.md).
#[test]
fn h2load_between_hosts_the_cell_that_stopped_twelve_times_is_counted_exactly() {
    let loads: Vec<Load> = (0..12).map(|_| ("/kb", 20_000, 4, 128)).collect();
    h2load_cells_between_hosts(&loads);
}

/// [`h2load_cells`] of `loads` between two test hosts, 1% of what each end receives lost and
/// 1% of what it sends duplicated, nginx on one and h2load on the other: the hosts, for what
/// their ends counted.
fn h2load_cells_between_hosts(loads: &[Load]) -> HostPair {
    let hosts = HostPair::new();
    hosts.lose_and_duplicate(10, 10);
    let addr = std::net::SocketAddr::from((netns::SERVER_ADDR, 18_080));
    let nginx = Nginx::start_in_netns(&h2c_server(addr), &hosts.server);
    let endpoint = Endpoint::from(addr);
    let mut probe = AttachedProbe::watching(&[endpoint]);
    h2load_cells(&nginx, &mut probe, endpoint, loads, |url, n, c, m| {
        h2load_with(HostPair::command(&hosts.client, "h2load"), url, n, c, m);
    });
    hosts
}

/// nginx listening with TCP_DEFER_ACCEPT (`listen … deferred`, as production configurations
/// often do): each connection's first flight (the preface and the 100 HEADERS h2load sends
/// before it has nginx's SETTINGS) completes the handshake and reaches the listener before the
/// connection exists, as it does when the handshake's last ACK is lost. It is parked there and
/// walked by the established callback: both vantage points count every stream nginx's
/// stub_status counted, with the build that walks in one loop and the one that walks in
/// steps (kernels without `bpf_loop`), and no first flight is left unwalked.
#[test]
fn a_first_flight_that_comes_with_the_handshake_is_walked_and_counted_exactly() {
    let addr = free_port();
    let nginx = Nginx::start(&format!(
        "  server {{ listen {addr} deferred http2; http2_max_concurrent_streams 1000; \
         keepalive_requests 1000000; location / {{ return 200 \"ok\\n\"; }} \
         location /busy {{ return 429 \"busy\\n\"; }} }}"
    ));
    let endpoint = Endpoint::from(addr);
    let loads: [Load; 3] = [
        ("/", 2_000, 4, 100),
        ("/", 2_000, 40, 100),
        ("/busy", 400, 8, 50),
    ];
    for (without, programs) in [
        (vec![], ProgramSet::Full),
        (vec![KernelFeature::BpfLoop], ProgramSet::Http2InSteps),
    ] {
        let mut probe = AttachedProbe::attach_with(&ProbeOptions {
            without,
            ..ProbeOptions::default()
        });
        assert_eq!(probe.kernel_support().programs(), programs);
        probe.watch(endpoint);
        h2load_cells(&nginx, &mut probe, endpoint, &loads, |url, n, c, m| {
            h2load(url, n, c, m);
        });
        let problems = probe.read().probe;
        assert_eq!(
            problems.get(ProbeStat::Http2FirstFlightsUnwalked),
            0,
            "{:?}: {problems:?}",
            probe.kernel_support().programs()
        );
    }
}

/// Where the kernel has no `bpf_loop` (before 5.17: Ubuntu 22.04's 5.15, Debian 11's 5.10),
/// the build that walks frames in steps runs (`bpf_loop` switched off here as there): each
/// step a call of a global function, 2,048 a program and on in the next by a tail call, the
/// walker taken by a map entry. The same loads as [`h2load_streams_are_counted_exactly_on_both_sides`]
/// at the concurrencies that put thousands of frames in a segment, counted exactly on both
/// vantage points, none cut short.
#[test]
fn without_bpf_loop_http2_streams_are_walked_in_steps_and_counted_exactly() {
    let addr = free_port();
    let nginx = Nginx::start(&h2c_server(addr));
    let endpoint = Endpoint::from(addr);
    let mut probe = AttachedProbe::attach_with(&ProbeOptions {
        without: vec![KernelFeature::BpfLoop],
        ..ProbeOptions::default()
    });
    probe.watch(endpoint);
    assert_eq!(probe.kernel_support().programs(), ProgramSet::Http2InSteps);
    let loads: Vec<Load> = ["/", "/kb"]
        .into_iter()
        .flat_map(|path| [(path, 40_000, 4, 128), (path, 40_000, 1, 1_000)])
        .chain([("/busy", 3_000, 6, 32)])
        .collect();
    h2load_cells(&nginx, &mut probe, endpoint, &loads, |url, n, c, m| {
        h2load(url, n, c, m);
    });
    let problems = probe.read().probe;
    for stat in [ProbeStat::Http2WalksCut, ProbeStat::Http2ConnectionsLeftOut] {
        assert_eq!(problems.get(stat), 0, "{problems:?}");
    }
}

/// HAProxy in front, speaking HTTP/2 to h2load and to nginx (`proto h2`: HAProxy multiplexes
/// the requests of all its clients onto a few server connections, up to 1,000 streams at once
/// on each, and one h2load connection holds 1,000 at once), with HAProxy's frontend and nginx
/// both watched: each counts what its own counters say it answered, on both vantage points, nginx's 429s passing through HAProxy (re-encoded by
/// HAProxy's HPACK encoder) and HAProxy's own `return status 429` the rejections: exactly.
#[test]
fn haproxy_speaking_h2_to_nginx_is_counted_at_both_hops() {
    let (nginx_addr, frontend) = (free_port(), free_port());
    let nginx = Nginx::start(&format!(
        "  server {{ listen {nginx_addr} http2; http2_max_concurrent_streams 1000; \
         keepalive_requests 100000; location / {{ return 200 \"ok\\n\"; }} \
         location /busy {{ return 429 \"busy\\n\"; }} }}"
    ));
    // 1,000 streams at once on a client's connection (HAProxy's default is 100); towards
    // nginx, HAProxy fills a connection up to nginx's SETTINGS_MAX_CONCURRENT_STREAMS.
    let haproxy = Haproxy::start_with_global(
        "    tune.h2.max-concurrent-streams 1000\n",
        &format!(
            "frontend fe\n    bind {frontend} proto h2\n\
             \x20   http-request return status 429 content-type text/plain string \"shed\\n\" if {{ path_beg /shed }}\n\
             \x20   default_backend be\n\
             backend be\n    server n1 {nginx_addr} proto h2\n"
        ),
        None,
    );
    let (front, back) = (Endpoint::from(frontend), Endpoint::from(nginx_addr));
    let probe = AttachedProbe::watching(&[front, back]);
    let (nginx_before, front_before) = (nginx.status(), haproxy.stat("fe", "FRONTEND", "req_tot"));
    let url = |path: &str| format!("http://{frontend}{path}");
    eprintln!("{}", h2load(&url("/"), 6000, 4, 64));
    eprintln!("{}", h2load(&url("/"), 6000, 1, 1000));
    eprintln!("{}", h2load(&url("/"), 2000, 100, 4));
    eprintln!("{}", h2load(&url("/busy"), 2000, 6, 32));
    eprintln!("{}", h2load(&url("/shed"), 1000, 6, 32));
    let passed = requests_between(nginx_before, nginx.status());
    let answered = haproxy.stat("fe", "FRONTEND", "req_tot") - front_before;
    let shed = haproxy.stat("fe", "FRONTEND", "intercepted");
    eprintln!(
        "HAProxy: {} connections to nginx opened, {} reuses, for {passed} requests",
        haproxy.stat("be", "n1", "connect"),
        haproxy.stat("be", "n1", "reuse")
    );
    assert_eq!(
        (passed, answered, shed),
        (16_000, 17_000, 1_000),
        "their own counts"
    );
    let expected = [(back, passed, 2_000), (front, answered, 3_000)];
    for (endpoint, total, _) in expected {
        for side in [Side::Server, Side::Client] {
            probe.wait_for(endpoint, side, SETTLE, "the proxies' own counts", |s| {
                s.counters.requests_started == total
            });
        }
    }
    // Ends still to be seen arrive within the settle; a lost one never does.
    thread::sleep(Duration::from_secs(1));
    let problems = probe.read().probe;
    eprintln!("{problems:?}");
    for (endpoint, total, rejected) in expected {
        for side in [Side::Server, Side::Client] {
            let c = probe.counters(endpoint, side).counters;
            eprintln!("{endpoint} {side:?}: {c:?}");
            let seen = (
                c.responses_completed,
                c.responses_rejected,
                c.requests_abandoned,
            );
            assert_eq!(
                seen,
                (total, rejected, 0),
                "{endpoint} {side:?}: {c:?} with {problems:?}"
            );
            assert_eq!(c.in_flight(), 0, "{endpoint} {side:?}: {c:?}");
        }
    }
    for stat in [
        ProbeStat::Http2StreamsUntracked,
        ProbeStat::Http2StreamsExpired,
        ProbeStat::Http2BodiesUntracked,
    ] {
        assert_eq!(problems.get(stat), 0, "{problems:?}");
    }
}

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The gRPC test script.
fn grpc_calls() -> PathBuf {
    repo().join("tests/clients/grpc_calls.py")
}

/// The grpcio server, until dropped.
struct GrpcServer {
    child: Child,
    stats_port: u16,
}

impl GrpcServer {
    /// The plain server (`serve`).
    fn start(port: u16, stats_port: u16) -> Self {
        Self::run(
            &["serve", &port.to_string(), &stats_port.to_string()],
            stats_port,
        )
    }

    /// The server whose rejections carry the agent's pushback (`serve-pushback`).
    fn with_pushback(port: u16, stats_port: u16, agent: &AgentProcess, service: &str) -> Self {
        let (port, stats) = (port.to_string(), stats_port.to_string());
        let socket = agent.socket.display().to_string();
        Self::run(
            &["serve-pushback", &port, &stats, &socket, service],
            stats_port,
        )
    }

    /// The script's server `args` (a serve command and its arguments), its stats on
    /// `stats_port`.
    fn run(args: &[&str], stats_port: u16) -> Self {
        let mut child = Command::new("python3")
            .arg(grpc_calls())
            .args(args)
            .env("PYTHONPATH", repo().join("integrations/python"))
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 with grpcio (./dev setup installs it)");
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "serving", "the gRPC server did not start");
        Self { child, stats_port }
    }

    /// The server's own counts (asked on its unwatched port), as the JSON line it answers.
    fn stats(&self) -> String {
        run_ok(
            Command::new("python3")
                .arg(grpc_calls())
                .args(["stats", &self.stats_port.to_string()]),
        )
    }

    /// The plain server's own counts: unary, stream, rejected.
    fn counts(&self) -> (u64, u64, u64) {
        calls_of(&self.stats())
    }
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The count `key` of a JSON line the script printed.
fn count_in(json: &str, key: &str) -> u64 {
    let at = json
        .find(&format!("\"{key}\": "))
        .unwrap_or_else(|| panic!("no {key} in {json}"));
    json[at + key.len() + 4..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// The unary, stream and rejected counts of a JSON line the script printed.
fn calls_of(json: &str) -> (u64, u64, u64) {
    let count = |key| count_in(json, key);
    (count("unary"), count("stream"), count("rejected"))
}

/// A grpcio client whose connection is open (one call made) and waits to go on.
struct HeldClient {
    child: Child,
    stdout: BufReader<ChildStdout>,
}

impl HeldClient {
    fn open(port: u16, unary: u32, streams: u32, rejects: u32) -> Self {
        let mut child = Command::new("python3")
            .arg(grpc_calls())
            .args(["call", &port.to_string()])
            .args([unary, streams, rejects].map(|n| n.to_string()))
            .arg("--hold")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "the gRPC client did not connect");
        Self { child, stdout }
    }

    /// Make the calls; the client's own counts.
    fn go(mut self) -> (u64, u64, u64) {
        self.child.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert!(
            self.child.wait().unwrap().success(),
            "the gRPC client failed"
        );
        calls_of(&line)
    }
}

/// Watch `endpoint` as a gRPC service (a trailers-only answer is a rejection).
fn watch_as_grpc(probe: &mut AttachedProbe, endpoint: Endpoint) {
    probe
        .probe
        .watch_with(
            endpoint,
            WatchOptions {
                protocol: Protocol::Grpc,
                ..WatchOptions::default()
            },
        )
        .expect("watch the gRPC endpoint");
}

/// Both vantage points of `endpoint` started and completed `total` calls, `rejected` of them
/// rejections, none abandoned and none in flight (waiting for the counts to arrive).
fn both_sides_count_the_calls(
    probe: &AttachedProbe,
    endpoint: Endpoint,
    (total, rejected): (u64, u64),
) {
    for side in [Side::Server, Side::Client] {
        let c = probe
            .wait_for(endpoint, side, SETTLE, "the server's own counts", |s| {
                s.counters.requests_started == total && s.counters.responses_completed == total
            })
            .counters;
        eprintln!("{side:?}: {c:?}");
        assert_eq!(c.responses_rejected, rejected, "{side:?}: {c:?}");
        assert_eq!(c.requests_abandoned, 0, "{side:?}: {c:?}");
        // A moment later nothing more is counted: no stream counted twice.
        std::thread::sleep(Duration::from_millis(500));
        let later = probe.counters(endpoint, side).counters;
        assert_eq!(later, c, "{side:?}");
    }
}

/// grpcio's server and clients on an endpoint watched as gRPC: every call a stream started
/// and completed, server-streaming calls once each, RESOURCE_EXHAUSTED answers (trailers-only)
/// the rejections; on a connection opened before the endpoint was watched (adopted at its
/// next frames) and on new connections (the preface), from both vantage points.
#[test]
fn grpc_calls_are_streams_and_resource_exhausted_is_a_rejection() {
    let (addr, stats) = (free_port(), free_port());
    let server = GrpcServer::start(addr.port(), stats.port());
    let endpoint = Endpoint::from(addr);
    let mut probe = AttachedProbe::attach();
    // A connection open before the watch.
    let held = HeldClient::open(addr.port(), 300, 40, 60);
    let before = server.counts();
    watch_as_grpc(&mut probe, endpoint);
    let adopted = held.go();
    assert_eq!(adopted, (300, 40, 60), "the held client's own counts");
    // New connections, one after another and side by side.
    let clients: Vec<Child> = (0..4)
        .map(|_| {
            Command::new("python3")
                .arg(grpc_calls())
                .args(["call", &addr.port().to_string(), "200", "20", "30"])
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut client in clients {
        assert!(client.wait().unwrap().success(), "a gRPC client failed");
    }
    let after = server.counts();
    let (unary, streamed, rejected) = (after.0 - before.0, after.1 - before.1, after.2 - before.2);
    assert_eq!(
        (unary, streamed, rejected),
        (1100, 120, 180),
        "the server's own counts"
    );
    both_sides_count_the_calls(&probe, endpoint, (unary + streamed + rejected, rejected));
    let problems = probe.read().probe;
    // The one connection open before the watch, adopted at both its ends (the client's and
    // the server's sockets are both on this node).
    assert_eq!(
        problems.get(ProbeStat::ConnectionsAdopted),
        2,
        "{problems:?}"
    );
    for stat in [
        ProbeStat::Http2SegmentsUnframed,
        ProbeStat::Http2StreamsUntracked,
        ProbeStat::Http2StreamsExpired,
    ] {
        assert_eq!(problems.get(stat), 0, "{problems:?}");
    }
    drop(server);
}

/// One grpcio channel holding 1,000 calls at once (a channel carries all of a client's calls,
/// and grpcio's server sets no limit on the streams of a connection): 2,000 unary calls, 900
/// turned away with RESOURCE_EXHAUSTED and 100 server-streaming calls, in waves of 1,000,
/// each sent whole before any of its answers is read. Both vantage points count what the
/// server's own counts say, exactly, and what the client's own record says.
#[test]
fn grpc_a_thousand_calls_at_once_on_one_channel_are_counted_exactly() {
    let (addr, stats) = (free_port(), free_port());
    let server = GrpcServer::start(addr.port(), stats.port());
    let endpoint = Endpoint::from(addr);
    let mut probe = AttachedProbe::attach();
    watch_as_grpc(&mut probe, endpoint);
    let before = server.counts();
    let client = run_ok(Command::new("python3").arg(grpc_calls()).args([
        "call",
        &addr.port().to_string(),
        "2000",
        "100",
        "900",
        "--wave",
        "1000",
    ]));
    let line = client.lines().last().unwrap_or_default();
    assert_eq!(calls_of(line), (2000, 100, 900), "the client's own counts");
    let after = server.counts();
    let served = (after.0 - before.0, after.1 - before.1, after.2 - before.2);
    assert_eq!(served, (2000, 100, 900), "the server's own counts");
    both_sides_count_the_calls(&probe, endpoint, (3000, 900));
    let problems = probe.read().probe;
    for stat in [
        ProbeStat::Http2SegmentsUnframed,
        ProbeStat::Http2StreamsUntracked,
        ProbeStat::Http2StreamsExpired,
        ProbeStat::Http2WalksContended,
    ] {
        assert_eq!(problems.get(stat), 0, "{problems:?}");
    }
    drop(server);
}

/// grpcio clients whose retry policy retries RESOURCE_EXHAUSTED, against a grpcio server that
/// turns calls away through `retry_after_grpc.RetryPushback`, with the agent watching the
/// server: the rejections carry `grpc-retry-pushback-ms` with the agent's value, and grpc's
/// own retry trace shows the client waiting it out.
#[test]
fn grpc_clients_wait_out_the_pushback_the_agent_computes() {
    let (addr, stats) = (free_port(), free_port());
    let agent = AgentProcess::start("", &pushback_service(addr, "replica"));
    let server = GrpcServer::with_pushback(addr.port(), stats.port(), &agent, "calls");
    // A first load warms the estimate; the second is judged, with the agent's own answers
    // asked meanwhile.
    RetryingClients::run(addr.port(), RetryingClients::WARMING);
    let answers = AgentAnswers::ask(&agent, "calls");
    let with = RetryingClients::run(addr.port(), RetryingClients::JUDGED);
    let (low, high) = answers.range();
    eprintln!("server: {}", server.stats().trim());
    with.assert_pushbacks_computed(low, high);
    // The same load with the agent stopped: no hint (once the held estimate is stale), the
    // clients' own backoff (0.1 s to 1 s), for comparison.
    agent.stop();
    thread::sleep(Duration::from_secs(6));
    let without = RetryingClients::run(addr.port(), RetryingClients::JUDGED);
    assert!(without.pushbacks.is_empty(), "a hint with no agent");
    eprintln!(
        "without the agent: {}; with it: {}",
        without.counts, with.counts
    );
    assert!(
        with.failed() < without.failed(),
        "the hint helped no client: with it {}, without {}",
        with.counts,
        without.counts
    );
}

/// HAProxy in front of a grpcio server (`proto h2` on both sides, `maxconn 4` on the server),
/// turning calls away itself once 8 wait in its queue: `lua.retry_after_grpc` of
/// `integrations/haproxy/retry_after.lua` answers them trailers-only with `grpc-status` 8
/// (RESOURCE_EXHAUSTED) and `grpc-retry-pushback-ms`. grpc's own retry
/// trace shows grpcio clients waiting out the agent's values; with the agent stopped, the
/// Lua's static value (9 s) instead. Which of the two served these clients better is printed,
/// not asserted: it is a question for the evaluation (docs/evaluation.md), not for this
/// test of the integration.
#[test]
fn haproxy_answers_grpc_rejections_with_the_agent_pushback() {
    let (grpc, stats, frontend) = (free_port(), free_port(), free_port());
    let agent = AgentProcess::start("", &pushback_service(grpc, "proxy"));
    let server = GrpcServer::run(
        &[
            "serve-work",
            &grpc.port().to_string(),
            &stats.port().to_string(),
        ],
        stats.port(),
    );
    let haproxy = Haproxy::start_with_lua(
        &agent.socket,
        &[
            ("RETRY_AFTER_SERVICES", "calls:be_calls"),
            ("RETRY_AFTER_STATIC", "9"),
            ("RETRY_AFTER_STALE_MS", "1500"),
        ],
        &format!(
            "frontend fe_calls\n    bind {frontend} proto h2\n\
             \x20   http-request set-var(txn.reject) bool(true) if {{ queue(be_calls) ge 8 }}\n\
             \x20   acl reject var(txn.reject) -m bool\n\
             \x20   http-request lua.retry_after calls if reject\n\
             \x20   http-request use-service lua.retry_after_grpc if reject\n\
             \x20   http-request lua.retry_after_admitted calls\n\
             \x20   default_backend be_calls\n\
             backend be_calls\n    server g1 {grpc} proto h2 maxconn 4\n"
        ),
    );
    RetryingClients::run(frontend.port(), RetryingClients::WARMING);
    let turned_away = || haproxy.stat("fe_calls", "FRONTEND", "intercepted");
    // The agent's answers for the queue HAProxy turns calls away at.
    let answers = AgentAnswers::ask(&agent, "calls queue_depth=8");
    let before = turned_away();
    let with = RetryingClients::run(frontend.port(), RetryingClients::JUDGED);
    let with_turned_away = turned_away() - before;
    let (low, high) = answers.range();
    eprintln!("server: {}", server.stats().trim());
    with.assert_pushbacks_computed(low, high);
    agent.stop();
    thread::sleep(Duration::from_secs(3));
    let before = turned_away();
    let fallback = RetryingClients::run(frontend.port(), RetryingClients::JUDGED);
    for (name, run, rejected) in [
        ("the agent's pushback", &with, with_turned_away),
        (
            "agent stopped, static 9 s",
            &fallback,
            turned_away() - before,
        ),
    ] {
        eprintln!(
            "{name}: {} in {:.1} s, HAProxy turned {rejected} calls away, {} of {} retries \
             after a pushback admitted",
            run.counts,
            run.elapsed.as_secs_f64(),
            run.retries.0,
            run.retries.1
        );
    }
    assert!(
        !fallback.pushbacks.is_empty() && fallback.pushbacks.iter().all(|&ms| ms == 9_000),
        "the Lua's static value once the agent stopped: {:?}",
        fallback.pushbacks
    );
}

/// The agent's service for the pushback tests: one gRPC backend at `addr` taking 4 calls at
/// once, rejected at `rejected_at`, `scheduled_returns` clamped at 10 s (static 9 s).
fn pushback_service(addr: std::net::SocketAddr, rejected_at: &str) -> String {
    format!(
        "[[service]]\nname = \"calls\"\nrejected_at = \"{rejected_at}\"\nprotocol = \"grpc\"\n\
         backends = [{{ address = \"{addr}\", max_ongoing_requests = 4 }}]\n\
         [service.backpressure]\nretry_after_policy = \"scheduled_returns\"\nretry_after_s = 9\njitter = 0.0\n\
         max_retry_after_s = {}\n",
        PUSHBACK_CLAMP_MS / 1000
    )
}

/// The pushback service's clamp (`max_retry_after_s`), in milliseconds.
const PUSHBACK_CLAMP_MS: u64 = 10_000;

/// One load of `grpc_calls.py retrying` (20 calls at once) with grpc's retry trace on.
struct RetryingClients {
    /// The clients' own counts, as the JSON line they printed.
    counts: String,
    /// The pushbacks grpc's trace says the clients waited out, in milliseconds.
    pushbacks: Vec<u64>,
    /// Of the attempts after a pushback: admitted, and all.
    retries: (usize, usize),
    /// How long the whole load took.
    elapsed: Duration,
}

impl RetryingClients {
    /// The calls judged: enough that the queue stays full for a while.
    const JUDGED: u32 = 300;
    /// The calls that warm the agent's drain rate first (a few seconds of completions).
    const WARMING: u32 = 100;

    /// `calls` calls to `port`, to their end.
    fn run(port: u16, calls: u32) -> Self {
        let started = std::time::Instant::now();
        let out = Command::new("python3")
            .arg(grpc_calls())
            .args(["retrying", &port.to_string(), &calls.to_string(), "20"])
            .env("GRPC_TRACE", "retry")
            .env("GRPC_VERBOSITY", "debug")
            .output()
            .unwrap();
        let elapsed = started.elapsed();
        let trace = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{trace}");
        let pushbacks = trace
            .lines()
            .filter_map(|l| l.split("server push-back: retry in ").nth(1))
            .map(|rest| rest.trim_end_matches(" ms").parse().unwrap())
            .collect();
        Self {
            counts: String::from_utf8_lossy(&out.stdout).trim().to_owned(),
            pushbacks,
            retries: retries_after_pushback(&trace),
            elapsed,
        }
    }

    fn failed(&self) -> u64 {
        count_in(&self.counts, "failed")
    }

    /// The pushbacks waited out are the agent's values: computed ones (not its static 9 s),
    /// within the range it answered (`low..=high` ms) and its clamp (10 s), and some retry
    /// after one was admitted. scheduled_returns moves them from moment to moment and with
    /// the returns the proxy promised itself, so they are held to the range, not one answer.
    fn assert_pushbacks_computed(&self, low: u64, high: u64) {
        let (admitted, retried) = self.retries;
        eprintln!(
            "clients: {} in {:?}; {} retries waited out a pushback of {:?} ms, {admitted} of \
             {retried} then admitted; the agent answered {low}..{high} ms",
            self.counts,
            self.elapsed,
            self.pushbacks.len(),
            (self.pushbacks.iter().min(), self.pushbacks.iter().max()),
        );
        assert!(
            !self.pushbacks.is_empty(),
            "no pushback in grpc's retry trace"
        );
        // The answers were sampled every 200 ms, the pushbacks stamped from every answer the
        // agent gave: one may lie above the highest sample, up to the clamp.
        assert!(
            self.pushbacks
                .iter()
                .all(|&ms| (low..=PUSHBACK_CLAMP_MS).contains(&ms)),
            "pushbacks {:?} outside the agent's answers from {low} (sampled up to {high}) to its \
             clamp",
            self.pushbacks
        );
        assert!(
            self.pushbacks.iter().filter(|&&ms| ms != 9_000).count() * 2 > self.pushbacks.len(),
            "mostly the static value: {:?}",
            self.pushbacks
        );
        assert!(admitted > 0, "{admitted} of {retried}");
    }
}

/// The agent's computed answers to `QUERY <service>`, asked every 200 ms until read.
struct AgentAnswers {
    asking: Arc<AtomicBool>,
    thread: thread::JoinHandle<Vec<u64>>,
}

impl AgentAnswers {
    fn ask(agent: &AgentProcess, service: &str) -> Self {
        let asking = Arc::new(AtomicBool::new(true));
        let (flag, socket, query) = (
            asking.clone(),
            agent.socket.clone(),
            format!("QUERY {service}"),
        );
        let thread = thread::spawn(move || {
            let mut millis = Vec::new();
            while flag.load(Ordering::SeqCst) {
                if let Ok(line) = agent_request(&socket, &query)
                    && let Ok(Response::RetryAfter(a)) = Response::parse(&line)
                    && a.rung == Rung::Computed
                {
                    millis.push(a.millis.unwrap());
                }
                thread::sleep(Duration::from_millis(200));
            }
            millis
        });
        Self { asking, thread }
    }

    /// Stop asking: the lowest and highest answer, in milliseconds.
    fn range(self) -> (u64, u64) {
        self.asking.store(false, Ordering::SeqCst);
        let millis = self.thread.join().unwrap();
        let low = *millis.iter().min().expect("computed answers");
        (low, *millis.iter().max().unwrap())
    }
}

/// Of the attempts that came after a pushback, in grpc's retry trace (each call's attempts in
/// order: `calld=… call finished, status=… server_pushback=…`), how many succeeded, and how
/// many there were.
fn retries_after_pushback(trace: &str) -> (usize, usize) {
    let mut calls: std::collections::HashMap<&str, Vec<(bool, bool)>> = Default::default();
    for line in trace
        .lines()
        .filter(|l| l.contains("call finished, status="))
    {
        let Some(call) = line
            .split("calld=")
            .nth(1)
            .and_then(|r| r.split(' ').next())
        else {
            continue;
        };
        let ok = line.contains("status=OK");
        let pushed = !line.contains("server_pushback=N/A");
        calls.entry(call).or_default().push((ok, pushed));
    }
    let mut counts = (0, 0);
    for attempts in calls.values() {
        for pair in attempts.windows(2) {
            if pair[0].1 {
                counts.1 += 1;
                counts.0 += usize::from(pair[1].0);
            }
        }
    }
    counts
}

/// One request line to the agent at `socket`, and its answer.
fn agent_request(socket: &Path, line: &str) -> std::io::Result<String> {
    let mut stream = std::os::unix::net::UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(format!("{line}\n").as_bytes())?;
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer)?;
    Ok(answer.trim_end().to_owned())
}
