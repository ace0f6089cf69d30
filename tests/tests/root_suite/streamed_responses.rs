//! Responses that end where HTTP/1.1 says they end, however long they pause, held to nginx's
//! own access log: bodies with a `Content-Length` and chunked ones sent slowly
//! (`limit_rate`), responses without a body (`HEAD`, 204, 304), and streams shaped like an
//! LLM engine's (headers at once, then nothing while the request waits for a slot, then
//! events a tenth of a second apart) proxied by nginx. At every reading of the counters taken
//! away from any request's start or end, the requests in flight equal those nginx's log
//! shows open at that moment; before, a response was taken as complete at its first pause.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use retry_after_agent::kernel::{KernelFeature, ProbeOptions};
use retry_after_common::{EndpointCounters, Side};
use retry_after_estimator::endpoint::Endpoint;
use retry_after_testkit::{
    AttachedProbe, SETTLE, free_port,
    netns::{self, HostPair},
    proxies::Nginx,
    run_ok,
};

/// How far a reading must be from any request's start or end, and from any stream's first
/// event, to be held to the log: nginx logs in milliseconds, and a reading takes a few.
const MARGIN: f64 = 0.05;

/// The access log's format: the end (Unix seconds), the duration, the method, the status.
const LOG_FORMAT: &str = "log_format timed '$msec $request_time $request_method $status';";

/// One request as nginx logged it.
#[derive(Clone, Copy, Debug)]
struct Logged {
    start: f64,
    end: f64,
    head: bool,
    status: u16,
}

impl Logged {
    /// The requests of nginx's access log at `log`.
    fn read(log: &Path) -> Vec<Logged> {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        text.lines()
            .map(|line| {
                let words: Vec<&str> = line.split_whitespace().collect();
                let end: f64 = words[0].parse().unwrap();
                let took: f64 = words[1].parse().unwrap();
                Logged {
                    start: end - took,
                    end,
                    head: words[2] == "HEAD",
                    status: words[3].parse().unwrap(),
                }
            })
            .collect()
    }

    /// True if the response has a body: not to a HEAD, not a 204 or 304.
    fn has_body(&self) -> bool {
        !self.head && self.status != 204 && self.status != 304
    }

    /// True if the request was open at `t`.
    fn open_at(&self, t: f64) -> bool {
        self.start <= t && t < self.end
    }
}

/// The counters of one endpoint and side, read at a moment (Unix seconds).
struct Reading {
    at: f64,
    counters: EndpointCounters,
}

/// Now, in Unix seconds.
pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Read `endpoint`'s counters from `side` every 50 ms while `running` says the load goes on.
fn readings(
    probe: &AttachedProbe,
    endpoint: Endpoint,
    side: Side,
    mut running: impl FnMut() -> bool,
) -> Vec<Reading> {
    let mut seen = Vec::new();
    while running() {
        let before = unix_now();
        let counters = probe.counters(endpoint, side).counters;
        seen.push(Reading {
            at: (before + unix_now()) / 2.0,
            counters,
        });
        thread::sleep(Duration::from_millis(50));
    }
    seen
}

/// Hold every reading taken at least [`MARGIN`] away from the events in `moments` to the
/// truth at its moment: (in flight, streaming) by `truth`. Returns how many were held.
fn hold_readings(
    readings: &[Reading],
    moments: &[f64],
    truth: impl Fn(f64) -> (u64, u64),
) -> usize {
    let mut held = 0;
    for reading in readings {
        if moments.iter().any(|m| (m - reading.at).abs() < MARGIN) {
            continue;
        }
        let c = &reading.counters;
        let (in_flight, streaming) = truth(reading.at);
        assert_eq!(
            (c.in_flight(), c.streaming()),
            (in_flight, streaming),
            "(in flight, streaming) at {:.3}: {c:?}",
            reading.at
        );
        held += 1;
    }
    held
}

/// `curl` fetching `url` with `args`, its output thrown away; it must succeed.
pub(crate) fn curl(url: &str, args: &[&str]) -> Child {
    Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "--fail"])
        .args(args)
        .arg(url)
        .spawn()
        .expect("curl is installed (./dev setup installs it)")
}

/// Wait for every client; each must have succeeded.
pub(crate) fn finish(clients: Vec<Child>) {
    for mut client in clients {
        assert!(client.wait().unwrap().success(), "a curl client failed");
    }
}

/// A directory of files for nginx listening on `addr` to serve: `big` (256 KiB of text, which
/// gzip compresses).
fn site(addr: std::net::SocketAddr) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("retry-after-site-{}", addr.port()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let line = "data: {\"token\": \"a few words of an answer\"}\n";
    std::fs::write(dir.join("big"), line.repeat(256 * 1024 / line.len())).unwrap();
    dir
}

#[test]
fn slow_bodies_of_every_framing_end_at_their_last_byte_as_nginx_logs_them() {
    slow_bodies(ProbeOptions::default());
}

#[test]
fn without_bpf_loop_slow_bodies_are_walked_in_steps_and_end_at_their_last_byte() {
    slow_bodies(without_bpf_loop());
}

/// The probe of a kernel without `bpf_loop` (before 5.17), on this one: the build that walks
/// in steps, which takes up to 64 steps of a segment's framing.
fn without_bpf_loop() -> ProbeOptions {
    ProbeOptions {
        without: vec![KernelFeature::BpfLoop],
        ..ProbeOptions::default()
    }
}

/// Slow bodies of every framing, nginx's log as the truth, read through a probe attached with
/// `options`.
fn slow_bodies(options: ProbeOptions) {
    let addr = free_port();
    let root = site(addr);
    let log = root.join("access.log");
    let nginx = Nginx::start(&format!(
        "{LOG_FORMAT}\n  server {{ listen {addr}; root {root}; access_log {log} timed;\n  \
         location /slow {{ alias {root}/big; limit_rate 96k; }}\n  \
         location /gzip {{ alias {root}/big; default_type text/plain; gzip on; gzip_types *; \
         gzip_comp_level 1; limit_rate 16k; }}\n  \
         location = /nothing {{ return 204; }} }}",
        root = root.display(),
        log = log.display(),
    ));
    let endpoint = Endpoint::from(addr);
    let mut probe = AttachedProbe::attach_with(&options);
    probe.watch(endpoint);
    let base = format!("http://{addr}");
    let start = Instant::now();
    let mut clients = Vec::new();
    for i in 0..12 {
        // Slow bodies (about 2.7 s, in bursts) with a length, and chunked ones (gzip).
        clients.push(curl(&format!("{base}/slow"), &[]));
        if i % 2 == 0 {
            clients.push(curl(&format!("{base}/gzip"), &["--compressed"]));
        }
        // No body: HEAD, 204, and 304 (If-Modified-Since the file's own time).
        clients.push(curl(&format!("{base}/big"), &["-I"]));
        clients.push(curl(&format!("{base}/nothing"), &[]));
        clients.push(curl(
            &format!("{base}/big"),
            &["-z", &format!("{}/big", root.display())],
        ));
        thread::sleep(Duration::from_millis(250));
    }
    let server = readings(&probe, endpoint, Side::Server, || {
        start.elapsed() < Duration::from_secs(8)
    });
    finish(clients);
    drop(nginx);

    let logged = Logged::read(&log);
    let requests = logged.len() as u64;
    assert_eq!(requests, 12 * 4 + 6, "nginx logged every request");
    let bodies = logged.iter().filter(|l| l.has_body()).count() as u64;
    assert_eq!(bodies, 12 + 6);
    let moments: Vec<f64> = logged.iter().flat_map(|l| [l.start, l.end]).collect();
    let held = hold_readings(&server, &moments, |t| {
        let open = logged.iter().filter(|l| l.open_at(t)).count() as u64;
        // Every body here begins within a millisecond of its head: what is open streams.
        (open, open)
    });
    println!(
        "slow bodies: {held} of {} readings held to nginx's log",
        server.len()
    );
    assert!(held >= 40, "only {held} of {} readings held", server.len());
    for side in [Side::Server, Side::Client] {
        let c = probe
            .wait_for(endpoint, side, SETTLE, "every request ended", |s| {
                s.counters.responses_completed == requests
            })
            .counters;
        assert_eq!(
            (
                c.requests_started,
                c.requests_abandoned,
                c.responses_inferred
            ),
            (requests, 0, 0),
            "{side:?}: {c:?}"
        );
        assert_eq!(
            (c.bodies_begun, c.bodies_ended),
            (bodies, bodies),
            "{side:?}: {c:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn engine_shaped_streams_wait_then_stream_then_end_as_nginx_and_the_server_say() {
    engine_streams(ProbeOptions::default());
}

#[test]
fn without_bpf_loop_engine_shaped_streams_are_walked_in_steps() {
    engine_streams(without_bpf_loop());
}

/// Streams shaped like an engine's behind nginx, nginx's log and the server's first events as
/// the truth, read through a probe attached with `options`.
fn engine_streams(options: ProbeOptions) {
    // Four slots; each stream waits half a second once it has one, then sends 20 events a
    // tenth of a second apart: twelve at once are served four by four over about 7.5 s.
    let upstream = free_port();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/stream_server.py");
    let mut server = Command::new("python3")
        .arg(&script)
        .args([&upstream.port().to_string(), "4", "0.5", "20", "0.1"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs the stream server");
    let addr = free_port();
    let log = std::env::temp_dir().join(format!("retry-after-streams-{}.log", addr.port()));
    let _ = std::fs::remove_file(&log);
    let nginx = Nginx::start(&format!(
        "{LOG_FORMAT}\n  server {{ listen {addr}; access_log {log} timed;\n  \
         location / {{ proxy_pass http://{upstream}; proxy_http_version 1.1; \
         proxy_buffering off; proxy_read_timeout 60s; }} }}",
        log = log.display(),
    ));
    let (front, engine) = (Endpoint::from(addr), Endpoint::from(upstream));
    let mut probe = AttachedProbe::attach_with(&options);
    probe.watch(front);
    probe.watch(engine);
    wait_until_listening(upstream);
    let start = Instant::now();
    let clients: Vec<Child> = (0..12)
        .map(|_| {
            curl(
                &format!("http://{addr}/v1/completions"),
                &["-N", "-d", "{}"],
            )
        })
        .collect();
    let at_front = readings(&probe, front, Side::Server, || {
        start.elapsed() < Duration::from_secs(9)
    });
    finish(clients);
    drop(nginx);
    server.kill().unwrap();
    // Each stream's first event and its request's arrival, as the server saw them.
    let served: Vec<(f64, f64)> = BufReader::new(server.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| {
            let (first, arrived) = l.strip_prefix("first ")?.split_once(' ')?;
            Some((first.parse().unwrap(), arrived.parse().unwrap()))
        })
        .collect();
    let firsts: Vec<f64> = served.iter().map(|s| s.0).collect();
    let _ = server.wait();

    let logged = Logged::read(&log);
    assert_eq!(
        (logged.len(), firsts.len()),
        (12, 12),
        "nginx and the server saw 12 streams"
    );
    // The first events in the order they went out, matched to the streams nginx logged in
    // the order they ended: every stream lasts as long, so they end in the order they began.
    let mut firsts = firsts;
    firsts.sort_by(f64::total_cmp);
    let mut ends: Vec<f64> = logged.iter().map(|l| l.end).collect();
    ends.sort_by(f64::total_cmp);
    let moments: Vec<f64> = logged
        .iter()
        .flat_map(|l| [l.start, l.end])
        .chain(firsts.iter().copied())
        .collect();
    let held = hold_readings(&at_front, &moments, |t| {
        let open = logged.iter().filter(|l| l.open_at(t)).count() as u64;
        let streaming = firsts
            .iter()
            .zip(&ends)
            .filter(|(first, end)| **first <= t && t < **end)
            .count() as u64;
        (open, streaming)
    });
    println!(
        "streams: {held} of {} readings held to nginx's log",
        at_front.len()
    );
    assert!(
        held >= 60,
        "only {held} of {} readings held",
        at_front.len()
    );
    // The time to first body byte, on average: at nginx's listener from nginx's starts, at
    // the server's from its requests' arrivals, to the server's first events.
    let mut starts: Vec<f64> = logged.iter().map(|l| l.start).collect();
    starts.sort_by(f64::total_cmp);
    let at_front = mean_wait(&starts, &firsts);
    let arrivals: Vec<f64> = served.iter().map(|s| s.1).collect();
    let at_engine = mean_wait(&arrivals, &served.iter().map(|s| s.0).collect::<Vec<_>>());
    for (endpoint, side, truth) in [
        (front, Side::Server, at_front),
        (front, Side::Client, at_front),
        (engine, Side::Server, at_engine),
    ] {
        let c = probe
            .wait_for(endpoint, side, SETTLE, "12 streams ended", |s| {
                s.counters.responses_completed == 12
            })
            .counters;
        assert_eq!(
            (
                c.requests_started,
                c.responses_inferred,
                c.bodies_begun,
                c.bodies_ended
            ),
            (12, 0, 12, 12),
            "{endpoint} {side:?}: {c:?}"
        );
        assert_first_byte_wait(&c, truth, &format!("{endpoint} {side:?}"));
    }
}

/// How far the agent's mean time to first body byte may be from the truth's: the log's
/// milliseconds, and the hops between nginx, the server and the kernel.
const WAIT_TOLERANCE_S: f64 = 0.05;

/// The mean of `firsts[i] - starts[i]` (seconds).
fn mean_wait(starts: &[f64], firsts: &[f64]) -> f64 {
    assert_eq!(starts.len(), firsts.len());
    let total: f64 = firsts.iter().zip(starts).map(|(f, s)| f - s).sum();
    total / starts.len() as f64
}

/// The counters' mean time to first body byte is within [`WAIT_TOLERANCE_S`] of `truth`.
fn assert_first_byte_wait(c: &EndpointCounters, truth: f64, what: &str) {
    let mean = c.first_byte_wait_ns as f64 / 1e9 / c.bodies_begun.max(1) as f64;
    println!("{what}: mean time to first body byte {mean:.3} s, the truth's {truth:.3} s");
    assert!(
        (mean - truth).abs() <= WAIT_TOLERANCE_S,
        "{what}: mean time to first body byte {mean:.3} s, the truth's {truth:.3} s: {c:?}"
    );
}

#[test]
fn grpc_streams_shaped_like_an_engine_s_wait_then_stream_as_the_server_says() {
    grpc_engine_streams(ProbeOptions::default());
}

#[test]
fn without_bpf_loop_grpc_engine_shaped_streams_are_walked_in_steps() {
    grpc_engine_streams(without_bpf_loop());
}

/// A grpcio server shaped like an engine (`grpc_calls.py serve-engine`: headers at once, then
/// a wait for one of 4 slots and half a second, then 20 messages a tenth of a second apart),
/// 12 server-streaming calls at once on one connection: at every reading away from a call's
/// start, first message or end, the agent's streams in flight and streaming equal the
/// server's own record; every stream's body begun and ended once, both vantage points, and
/// the mean time to first body byte the server's.
fn grpc_engine_streams(options: ProbeOptions) {
    let addr = free_port();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/grpc_calls.py");
    let mut server = Command::new("python3")
        .arg(&script)
        .args([
            "serve-engine",
            &addr.port().to_string(),
            "4",
            "0.5",
            "20",
            "0.1",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs the gRPC server");
    let mut lines = BufReader::new(server.stdout.take().unwrap()).lines();
    assert_eq!(
        lines.next().and_then(Result::ok).as_deref(),
        Some("serving")
    );
    let endpoint = Endpoint::from(addr);
    let mut probe = AttachedProbe::attach_with(&options);
    probe.watch(endpoint);
    let start = Instant::now();
    let client = Command::new("python3")
        .arg(&script)
        .args(["generate", &addr.port().to_string(), "12"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs the gRPC client");
    let at_server = readings(&probe, endpoint, Side::Server, || {
        start.elapsed() < Duration::from_secs(9)
    });
    let out = client.wait_with_output().unwrap();
    assert!(out.status.success(), "the gRPC client failed");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        r#"{"ended": 12, "messages": 240}"#,
        "the client's own record"
    );
    server.kill().unwrap();
    let calls: Vec<[f64; 3]> = lines
        .map_while(Result::ok)
        .filter_map(|l| {
            let t: Vec<f64> = l
                .strip_prefix("call ")?
                .split(' ')
                .map(|w| w.parse().unwrap())
                .collect();
            Some([t[0], t[1], t[2]])
        })
        .collect();
    let _ = server.wait();
    assert_eq!(calls.len(), 12, "the server's own record");
    let moments: Vec<f64> = calls.iter().flatten().copied().collect();
    let held = hold_readings(&at_server, &moments, |t| {
        let open = calls.iter().filter(|c| c[0] <= t && t < c[2]).count() as u64;
        let streaming = calls.iter().filter(|c| c[1] <= t && t < c[2]).count() as u64;
        (open, streaming)
    });
    println!(
        "gRPC streams: {held} of {} readings held to the server's record",
        at_server.len()
    );
    assert!(
        held >= 60,
        "only {held} of {} readings held",
        at_server.len()
    );
    let starts: Vec<f64> = calls.iter().map(|c| c[0]).collect();
    let firsts: Vec<f64> = calls.iter().map(|c| c[1]).collect();
    let truth = mean_wait(&starts, &firsts);
    for side in Side::ALL {
        let c = probe
            .wait_for(endpoint, side, SETTLE, "12 streams ended", |s| {
                s.counters.responses_completed == 12
            })
            .counters;
        assert_eq!(
            (
                c.requests_started,
                c.requests_abandoned,
                c.bodies_begun,
                c.bodies_ended
            ),
            (12, 0, 12, 12),
            "{side:?}: {c:?}"
        );
        assert_first_byte_wait(&c, truth, &format!("gRPC {side:?}"));
    }
}

/// Wait until something listens on `addr` (the stream server starting).
fn wait_until_listening(addr: std::net::SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "the stream server did not start");
        thread::sleep(Duration::from_millis(50));
    }
}

/// Responses of a cell under loss whose end h2load's vantage point may infer (their framing
/// lost) before the run fails; nginx's side, which walks only what it sends, must infer none.
/// Measured on a quiet machine: 0 or 1 of 600 chunked responses, 0 of every other cell, where
/// before gaps were passed over or waited for 15 to 21 chunked responses were
/// (docs/kernel-observation.md, "Gaps"). With two busy loops beside the test, up to 4 chunked
/// and 1 `Content-Length` response: what a client receives can arrive on two CPUs at once,
/// and its framing walk is not serialized ("Counters").
const RECEIVED_INFERRED_GUARD: u64 = 8;

/// One cell of [`http1_bodies_between_hosts_losing_and_duplicating_segments_end_exactly`]:
/// the path, the requests, the connections, and whether its responses have a body.
type BodyCell = (&'static str, u32, u32, bool);

/// The cells: 96 KiB bodies with a `Content-Length` (about 70 segments each), the same file
/// gzip-compressed on the fly (chunked: nginx's gzip sends a chunk per buffer, so chunk sizes
/// fall anywhere in a segment), a 3-byte body, and 204 without one.
const BODY_CELLS: [BodyCell; 4] = [
    ("/length", 600, 8, true),
    ("/chunked", 600, 8, true),
    ("/small", 20_000, 16, true),
    ("/nothing", 20_000, 16, false),
];

/// nginx on one test host (a network namespace made for the test) and h2load speaking
/// HTTP/1.1 on another, joined by a veth pair that loses 1% of what each end receives and
/// duplicates 1% of what it sends (nftables): h2load's end receives nginx's bodies out of
/// order (a lost segment's retransmission after the segments behind it) and twice. For each
/// of [`BODY_CELLS`], both vantage points end every response nginx's stub_status counted at
/// its framing's end (none abandoned; none inferred at nginx's end, at most
/// [`RECEIVED_INFERRED_GUARD`] at h2load's), and begin and end a body for each response that
/// has one (an inferred response's body may go uncounted: its framing was lost before it).
#[test]
fn http1_bodies_between_hosts_losing_and_duplicating_segments_end_exactly() {
    let hosts = HostPair::new();
    hosts.lose_and_duplicate(10, 10);
    let addr = std::net::SocketAddr::from((netns::SERVER_ADDR, 18_081));
    let root = site(addr);
    std::fs::write(root.join("mixed"), incompressible_text(96 * 1024)).unwrap();
    let nginx = Nginx::start_in_netns(
        &format!(
            "  server {{ listen {addr}; root {root}; keepalive_requests 1000000;\n  \
             location = /length {{ alias {root}/mixed; }}\n  \
             location = /chunked {{ alias {root}/mixed; default_type text/plain; gzip on; \
             gzip_types *; gzip_comp_level 1; }}\n  \
             location = /small {{ return 200 \"ok\\n\"; }}\n  \
             location = /nothing {{ return 204; }} }}",
            root = root.display(),
        ),
        &hosts.server,
    );
    let endpoint = Endpoint::from(addr);
    let mut probe = AttachedProbe::watching(&[endpoint]);
    let mut table = Vec::new();
    let mut off = Vec::new();
    for (path, requests, connections, body) in BODY_CELLS {
        let before = nginx.status().requests;
        let summary = run_ok(HostPair::command(&hosts.client, "h2load").args([
            "--h1",
            "-H",
            "accept-encoding: gzip",
            "-n",
            &requests.to_string(),
            "-c",
            &connections.to_string(),
            &format!("http://{addr}{path}"),
        ]));
        assert!(
            summary.contains(&format!("{requests} succeeded")),
            "h2load: {summary}"
        );
        // stub_status counts its own request.
        let total = nginx.status().requests - before - 1;
        assert_eq!(total, u64::from(requests), "nginx's own count");
        let bodies = if body { total } else { 0 };
        let sides = [Side::Server, Side::Client].map(|side| {
            probe
                .wait_for(endpoint, side, SETTLE, "every response ended", |s| {
                    s.counters.responses_completed >= total && s.counters.in_flight() == 0
                })
                .counters
        });
        let exact = |(c, allowed): (&EndpointCounters, u64)| {
            let inferred = c.responses_inferred;
            (
                c.requests_started,
                c.responses_completed,
                c.requests_abandoned,
            ) == (total, total, 0)
                && inferred <= allowed
                && c.bodies_begun == c.bodies_ended
                && (bodies.saturating_sub(inferred)..=bodies).contains(&c.bodies_begun)
        };
        let cell = format!(
            "{path} ({connections} connections): nginx {total}, bodies {bodies}; nginx's side \
             {:?}; h2load's side {:?}",
            sides[0], sides[1]
        );
        if !(exact((&sides[0], 0)) && exact((&sides[1], RECEIVED_INFERRED_GUARD))) {
            off.push(cell.clone());
        }
        table.push(cell);
        probe.unwatch(endpoint);
        probe.watch(endpoint);
    }
    eprintln!("{}", table.join("\n"));
    drop(nginx);
    let rules = HostPair::ruleset(&hosts.client);
    let (arrived_out_of_order, ofo) = HostPair::arrived_out_of_order(&hosts.client);
    eprintln!("{rules}{ofo}");
    assert!(
        !rules.contains("counter packets 0 "),
        "every rule lost or duplicated packets:\n{rules}"
    );
    assert!(
        arrived_out_of_order.is_some_and(|n| n > 0),
        "segments arrived out of order at h2load's end:\n{ofo}"
    );
    assert!(off.is_empty(), "cells off:\n{}", off.join("\n"));
    let _ = std::fs::remove_dir_all(&root);
}

/// `len` bytes of text that gzip shrinks only to about 60% (a seeded xorshift's letters, in
/// lines), so that a chunked body still spans many segments.
fn incompressible_text(len: usize) -> String {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|i| {
            if i % 64 == 63 {
                return '\n';
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect()
}
