//! The kernel's counts against the distribution's nginx and its own counters (stub_status),
//! with ab (one connection per request) and wrk (keep-alive) as traffic: on a plain listener,
//! on a `deferred` one (TCP_DEFER_ACCEPT: the request comes with the handshake), over TLS 1.2
//! and TLS 1.3 (handshakes, session tickets and close_notify are not requests), with TCP Fast
//! Open (the request in the SYN), with the keep-alive connections opened before the probe
//! attached, and with the programs attached to nginx's cgroup only.

use std::{net::SocketAddr, process::Command, thread, time::Duration};

use retry_after_agent::kernel::{
    KernelFeature, ProbeOptions, ProgramSet, WatchOptions, cgroup_scope,
};
use retry_after_common::{ProbeStat, Side};
use retry_after_estimator::endpoint::Endpoint;
use retry_after_testkit::{
    AttachedProbe, SETTLE, TestCgroup, free_port,
    http::{HttpClient, HttpServer, ServerOptions},
    proxies::{Nginx, NginxStatus, Wrk, command_in, self_signed_certificate},
};

/// `ab -n requests -c concurrency url`, with `-f protocol` for TLS; every request must succeed.
fn ab(url: &str, tls_protocol: Option<&str>, requests: u32, concurrency: u32) {
    let mut command = Command::new("ab");
    command.args([
        "-q",
        "-n",
        &requests.to_string(),
        "-c",
        &concurrency.to_string(),
    ]);
    if let Some(protocol) = tls_protocol {
        command.args(["-f", protocol]);
    }
    let out = command
        .arg(url)
        .output()
        .expect("ab is installed (./dev setup installs apache2-utils)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("Failed requests:        0"),
        "{text}"
    );
}

/// nginx's counts of the traffic between two readings (each reading is one connection and
/// one request of its own, counted by the later one).
fn traffic(before: NginxStatus, after: NginxStatus) -> NginxStatus {
    NginxStatus {
        accepts: after.accepts - before.accepts - 1,
        requests: after.requests - before.requests - 1,
    }
}

/// A TLS version, as nginx's `ssl_protocols` and ab's `-f` name it.
#[derive(Clone, Copy)]
struct Tls {
    nginx: &'static str,
    ab: &'static str,
}

const TLS_1_2: Tls = Tls {
    nginx: "TLSv1.2",
    ab: "TLS1.2",
};
const TLS_1_3: Tls = Tls {
    nginx: "TLSv1.3",
    ab: "TLS1.3",
};

/// ab then wrk against nginx listening with `listen` options, over `tls` if given: the
/// kernel's counts on both sides equal nginx's own.
fn check(listen: &str, tls: Option<Tls>) {
    check_with(listen, tls, &ProbeOptions::default());
}

/// What the oldest kernels users run lack (5.10: no `bpf_loop`, no socket storage from
/// tracing programs), switched off here as there.
const OLDER_KERNEL: [KernelFeature; 2] =
    [KernelFeature::BpfLoop, KernelFeature::TracingSocketStorage];

/// [`check`] with the probe attached with `options`.
fn check_with(listen: &str, tls: Option<Tls>, options: &ProbeOptions) {
    let port = free_port();
    let (scheme, listen_tls, server_tls) = match tls {
        Some(tls) => {
            let (cert, key) = self_signed_certificate();
            (
                "https",
                " ssl",
                format!(
                    "ssl_certificate {}; ssl_certificate_key {}; ssl_protocols {};",
                    cert.display(),
                    key.display(),
                    tls.nginx
                ),
            )
        }
        None => ("http", "", String::new()),
    };
    // Each request's end, nginx's own record: answered, or reset by its client first (wrk's
    // last requests when it stops).
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("ended.log");
    let nginx = Nginx::start(&format!(
        "  log_format ended '$status';\n  server {{ listen {port}{listen}{listen_tls}; \
         {server_tls} keepalive_requests 100000; access_log {} ended; \
         location / {{ return 200 \"ok\\n\"; }} }}",
        log.display()
    ));
    let endpoint = Endpoint::from(port);
    let mut probe = AttachedProbe::attach_with(options);
    probe.watch(endpoint);
    let url = format!("{scheme}://{port}/");
    let before = nginx.status();
    ab(&url, tls.map(|t| t.ab), 500, 10);
    Wrk::start_url(&url, 1, 10, 2).finish();
    let truth = traffic(before, nginx.status());
    assert!(truth.requests > 1000, "{truth:?}");
    // The log holds every request of this server (the status readings are another's), each
    // written at its end: a reset one when nginx sees the close, a moment after wrk's end.
    let deadline = std::time::Instant::now() + SETTLE;
    let (answered, reset) = loop {
        let (answered, reset) = Nginx::endings(&log);
        if answered + reset == truth.requests || std::time::Instant::now() > deadline {
            break (answered, reset);
        }
        thread::sleep(Duration::from_millis(50));
    };
    eprintln!("{listen:?} {scheme}: nginx counted {truth:?}, {answered} answered, {reset} reset");
    assert_eq!(
        answered + reset,
        truth.requests,
        "nginx's log and its stub_status"
    );
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "nginx's own counts", |s| {
            s.counters.requests_started == truth.requests
                && s.counters.responses_completed == answered
                && s.counters.requests_abandoned == reset
                && s.counters.connections_opened == truth.accepts
                && s.counters.connections_closed == truth.accepts
        });
        let c = seen.counters;
        assert_eq!(
            (
                c.requests_started,
                c.responses_completed,
                c.requests_abandoned
            ),
            (truth.requests, answered, reset),
            "{side:?}: {c:?}"
        );
        assert_eq!(
            (c.connections_opened, c.connections_closed),
            (truth.accepts, truth.accepts),
            "{side:?}: {c:?}"
        );
    }
    assert_eq!(probe.read().probe.get(ProbeStat::TlsSegmentsUnframed), 0);
}

#[test]
fn plain_http_turns_equal_nginx_stub_status() {
    check("", None);
}

#[test]
fn a_deferred_listener_loses_no_first_request() {
    check(" deferred", None);
}

#[test]
fn tls_1_2_turns_equal_nginx_stub_status() {
    check("", Some(TLS_1_2));
}

#[test]
fn tls_1_3_turns_equal_nginx_stub_status() {
    check("", Some(TLS_1_3));
}

#[test]
fn tls_1_3_on_a_deferred_listener_turns_equal_nginx_stub_status() {
    check(" deferred", Some(TLS_1_3));
}

/// The build an older kernel runs, walking HTTP/2 frames in steps and without adoption, counts
/// plain and TLS turns exactly as the full build does.
#[test]
fn without_the_features_older_kernels_lack_plain_and_tls_turns_equal_nginx_stub_status() {
    let options = ProbeOptions {
        without: OLDER_KERNEL.to_vec(),
        ..ProbeOptions::default()
    };
    check_with("", None, &options);
    check_with("", Some(TLS_1_3), &options);
    let probe = AttachedProbe::attach_with(&options);
    let support = probe.kernel_support();
    assert_eq!(support.programs(), ProgramSet::Http2InSteps);
    assert!(
        support.http2_in_steps.is_some() && support.adoption_off.is_some(),
        "{support:?}"
    );
}

/// Without socket storage for tracing programs no close of an adopted connection could be
/// seen, so a pool opened before the probe is left out, as said, rather than counted open
/// forever; the connections opened after it are counted.
#[test]
fn without_tracing_socket_storage_a_pool_opened_before_the_probe_is_left_out() {
    let (nginx, port, mut pool) = nginx_and_a_pool_used_before_watching();
    let endpoint = Endpoint::from(port);
    let mut probe = AttachedProbe::attach_with(&ProbeOptions {
        without: vec![KernelFeature::TracingSocketStorage],
        ..ProbeOptions::default()
    });
    probe.watch(endpoint);
    assert_eq!(probe.kernel_support().programs(), ProgramSet::Full);
    thread::sleep(Duration::from_millis(100));
    for _ in 0..10 {
        for client in &mut pool {
            client.exchange(0);
        }
    }
    let before = nginx.status();
    ab(&format!("http://{port}/"), None, 200, 4);
    let truth = traffic(before, nginx.status());
    assert_eq!(truth.requests, 200);
    for side in [Side::Server, Side::Client] {
        probe.wait_for(endpoint, side, SETTLE, "ab's, not the pool's", |s| {
            s.counters.requests_started == truth.requests
                && s.counters.connections_opened == truth.accepts
                && s.counters.connections_closed == truth.accepts
        });
    }
    assert_eq!(probe.read().probe.get(ProbeStat::ConnectionsAdopted), 0);
}

/// nginx keeping connections alive, and a client pool of ten connections to it, each used
/// once before anything watches.
fn nginx_and_a_pool_used_before_watching() -> (Nginx, SocketAddr, Vec<HttpClient>) {
    let port = free_port();
    let nginx = Nginx::start(&format!(
        "  server {{ listen {port}; keepalive_requests 100000; keepalive_timeout 60s; location / {{ return 200 \"ok\\n\"; }} }}"
    ));
    let mut pool: Vec<_> = (0..10).map(|_| HttpClient::connect(port)).collect();
    for client in &mut pool {
        client.exchange(0);
    }
    (nginx, port, pool)
}

#[test]
fn keepalive_connections_opened_before_the_probe_are_counted_from_their_next_request() {
    let (nginx, port, mut pool) = nginx_and_a_pool_used_before_watching();
    let endpoint = Endpoint::from(port);
    let probe = AttachedProbe::watching(&[endpoint]);
    thread::sleep(Duration::from_millis(100));
    let before = nginx.status();
    for _ in 0..100 {
        for client in &mut pool {
            client.exchange(0);
        }
    }
    let after = nginx.status();
    let requests = after.requests - before.requests - 1;
    assert_eq!(requests, 1000);
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "1000 on the adopted pool", |s| {
            s.counters.requests_started == requests && s.counters.responses_completed == requests
        });
        assert_eq!(seen.counters.connections_opened, 10, "{side:?}");
    }
}

#[test]
fn attached_to_nginxs_cgroup_only_its_sockets_are_seen_and_other_traffic_runs_no_program() {
    let cgroup = TestCgroup::create("retry-after-test-replica");
    let port = free_port();
    let nginx = Nginx::start_in(
        &format!(
            "  server {{ listen {port}; keepalive_requests 100000; location / {{ return 200 \"ok\\n\"; }} }}"
        ),
        Some(cgroup.path()),
    );
    // A second server, in this test's own cgroup (outside the attachment), watched as well.
    let outside = HttpServer::start("127.0.0.1:0", ServerOptions::default());
    let (inside_endpoint, outside_endpoint) =
        (Endpoint::from(port), Endpoint::from(outside.addr()));
    let mut probe = AttachedProbe::attach_with(&ProbeOptions {
        attach_to: vec![cgroup.path().to_path_buf()],
        ..ProbeOptions::default()
    });
    probe.watch(inside_endpoint);
    probe.watch(outside_endpoint);
    let stats =
        aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("enable BPF run-time stats");
    let socket_program_runs = |probe: &AttachedProbe| -> u64 {
        probe
            .probe
            .program_run_stats()
            .iter()
            .filter(|s| s.name != "ra_destroy")
            .map(|s| s.run_count)
            .sum()
    };

    // Traffic outside the attached cgroup: the socket programs never run.
    let before = socket_program_runs(&probe);
    let outside_requests = Wrk::start(outside.addr(), 1, 10, 2).finish().requests;
    assert!(outside_requests > 1000, "{outside_requests}");
    assert_eq!(
        socket_program_runs(&probe) - before,
        0,
        "runs for traffic outside"
    );

    // Traffic to nginx, inside: its server side is counted exactly; the clients (ab, wrk) are
    // outside, so no client side is seen.
    let url = format!("http://{port}/");
    let truth_before = nginx.status();
    ab(&url, None, 300, 10);
    Wrk::start_url(&url, 1, 10, 2).finish();
    let truth = traffic(truth_before, nginx.status());
    assert!(truth.requests > 1000, "{truth:?}");
    assert!(
        socket_program_runs(&probe) - before > truth.requests,
        "runs for nginx's sockets"
    );
    let seen = probe.wait_for(
        inside_endpoint,
        Side::Server,
        SETTLE,
        "nginx's own counts",
        |s| {
            s.counters.requests_started == truth.requests
                && s.counters.responses_completed == truth.requests
                && s.counters.connections_closed == truth.accepts
        },
    );
    assert_eq!(seen.counters.connections_opened, truth.accepts);
    assert_eq!(seen.counters.requests_abandoned, 0);
    for (endpoint, side) in [
        (inside_endpoint, Side::Client),
        (outside_endpoint, Side::Server),
        (outside_endpoint, Side::Client),
    ] {
        let c = probe.counters(endpoint, side).counters;
        assert_eq!(
            (c.connections_opened, c.requests_started),
            (0, 0),
            "{endpoint} {side:?}"
        );
    }
    drop(stats);
    drop(nginx);
    drop(cgroup);
}

/// Connections the kernel accepted with data in the SYN (`TcpExt: TCPFastOpenPassive` of
/// /proc/net/netstat).
fn fast_open_passive() -> u64 {
    let text = std::fs::read_to_string("/proc/net/netstat").unwrap();
    let rows: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| l.starts_with("TcpExt:"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    let i = rows[0]
        .iter()
        .position(|n| *n == "TCPFastOpenPassive")
        .unwrap();
    rows[1][i].parse().unwrap()
}

/// Sets `net.ipv4.tcp_fastopen` for the test and puts the old value back at the end.
struct FastOpenSysctl(String);

impl FastOpenSysctl {
    const PATH: &str = "/proc/sys/net/ipv4/tcp_fastopen";

    fn enable_client_and_server() -> Self {
        let old = std::fs::read_to_string(Self::PATH).unwrap();
        std::fs::write(Self::PATH, "3").expect("set net.ipv4.tcp_fastopen (tests run as root)");
        Self(old)
    }
}

impl Drop for FastOpenSysctl {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, self.0.trim());
    }
}

/// A client of Python's socket module that sends each request in the SYN (`MSG_FASTOPEN`), one
/// connection per request; prints how many got a 200.
const FAST_OPEN_CLIENT: &str = r#"
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
ok = 0
for _ in range(n):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.sendto(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
             socket.MSG_FASTOPEN, ("127.0.0.1", port))
    data = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    s.close()
    ok += data.startswith(b"HTTP/1.1 200")
print(ok)
"#;

/// nginx with `listen … fastopen=256`, and `FAST_OPEN_CLIENT` sending 300 requests each in the
/// SYN of its own connection, from `client_cgroup` if given, to which the client side is then
/// scoped: the kernel's counts on both sides equal nginx's own.
fn check_fast_open(client_cgroup: Option<&TestCgroup>) {
    let _sysctl = FastOpenSysctl::enable_client_and_server();
    let port = free_port();
    let nginx = Nginx::start(&format!(
        "  server {{ listen {port} fastopen=256; location / {{ return 200 \"ok\\n\"; }} }}"
    ));
    let endpoint = Endpoint::from(port);
    let mut probe = AttachedProbe::attach();
    let scope = client_cgroup.map(|cgroup| {
        let root = retry_after_agent::kernel::find_cgroup2_root().unwrap();
        cgroup_scope(&root, cgroup.path()).unwrap()
    });
    probe
        .probe
        .watch_with(
            endpoint,
            WatchOptions {
                client_scope: scope,
                ..WatchOptions::default()
            },
        )
        .expect("watch the endpoint");
    let before = nginx.status();
    let passive_before = fast_open_passive();
    let port_arg = port.port().to_string();
    let out = retry_after_testkit::run_ok(&mut command_in(
        client_cgroup.map(TestCgroup::path),
        "python3",
        ["-c", FAST_OPEN_CLIENT, &port_arg, "300"],
    ));
    assert_eq!(out.trim(), "300", "every request answered");
    let passive_after = fast_open_passive();
    let truth = traffic(before, nginx.status());
    let in_syn = passive_after - passive_before;
    eprintln!("nginx counted {truth:?}; {in_syn} connections opened with data in the SYN");
    // The first connection fetches the cookie; the rest carry their request in the SYN.
    assert!(in_syn >= 290, "TCP Fast Open was not used: {in_syn}");
    assert_eq!(truth.requests, 300);
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "nginx's own counts", |s| {
            s.counters.requests_started == truth.requests
                && s.counters.responses_completed == truth.requests
                && s.counters.connections_closed == truth.accepts
        });
        assert_eq!(seen.counters.requests_abandoned, 0, "{side:?}");
    }
}

#[test]
fn requests_in_the_syn_tcp_fast_open_equal_nginx_stub_status() {
    check_fast_open(None);
}

#[test]
fn requests_in_the_syn_from_a_scoped_client_equal_nginx_stub_status() {
    let cgroup = TestCgroup::create("retry-after-test-fastopen-client");
    check_fast_open(Some(&cgroup));
}

/// Python's http.client over its ssl module (OpenSSL): `POOL` keep-alive HTTPS connections,
/// one request each, then "ready"; after a line on stdin, `ROUNDS` more requests on each, then
/// "done".
const TLS_POOL_CLIENT: &str = r#"
import http.client, ssl, sys
port, pool, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
context = ssl._create_unverified_context()
conns = [http.client.HTTPSConnection("127.0.0.1", port, context=context) for _ in range(pool)]
def get(c):
    c.request("GET", "/")
    r = c.getresponse()
    r.read()
    assert r.status == 200
for c in conns:
    get(c)
print("ready", flush=True)
sys.stdin.readline()
for _ in range(rounds):
    for c in conns:
        get(c)
print("done", flush=True)
"#;

#[test]
fn tls_keepalive_connections_opened_before_the_probe_are_counted_from_their_next_request() {
    use std::io::{BufRead, BufReader, Write};
    let port = free_port();
    let (cert, key) = self_signed_certificate();
    let nginx = Nginx::start(&format!(
        "  server {{ listen {port} ssl; ssl_certificate {}; ssl_certificate_key {}; keepalive_requests 100000; keepalive_timeout 60s; location / {{ return 200 \"ok\\n\"; }} }}",
        cert.display(),
        key.display()
    ));
    let endpoint = Endpoint::from(port);
    let mut client = Command::new("python3")
        .args(["-c", TLS_POOL_CLIENT])
        .args([port.port().to_string(), "10".into(), "100".into()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    let mut lines = BufReader::new(client.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "ready");
    let probe = AttachedProbe::watching(&[endpoint]);
    thread::sleep(Duration::from_millis(100));
    let before = nginx.status();
    writeln!(client.stdin.as_mut().unwrap(), "go").unwrap();
    assert_eq!(lines.next().unwrap().unwrap(), "done");
    let requests = nginx.status().requests - before.requests - 1;
    assert_eq!(requests, 1000);
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "1000 on the adopted pool", |s| {
            s.counters.requests_started == requests && s.counters.responses_completed == requests
        });
        assert_eq!(seen.counters.connections_opened, 10, "{side:?}");
    }
    drop(client.stdin.take());
    let _ = client.wait();
    assert_eq!(probe.read().probe.get(ProbeStat::TlsSegmentsUnframed), 0);
}

/// nginx answering some requests 200 and turning others away (429, 503), on new connections
/// (ab) and keep-alive ones (wrk): every response completes a turn, and exactly the 429s and
/// 503s are counted as rejections, from both vantage points.
#[test]
fn rejections_429_and_503_are_counted_apart_from_served_responses() {
    let port = free_port();
    let nginx = Nginx::start(&format!(
        "  server {{ listen {port}; keepalive_requests 100000; location / {{ return 200 \"ok\\n\"; }} location /busy {{ return 429 \"busy\\n\"; }} location /down {{ return 503 \"down\\n\"; }} }}"
    ));
    let endpoint = Endpoint::from(port);
    let probe = AttachedProbe::watching(&[endpoint]);
    // Served, rejected, served again, with a reading of nginx's counters between each.
    let before = nginx.status();
    ab(&format!("http://{port}/"), None, 300, 10);
    let after_served = nginx.status();
    ab(&format!("http://{port}/busy"), None, 200, 10);
    ab(&format!("http://{port}/down"), None, 100, 10);
    Wrk::start_url(&format!("http://{port}/busy"), 1, 4, 2).finish();
    let after_rejected = nginx.status();
    Wrk::start_url(&format!("http://{port}/"), 1, 4, 2).finish();
    let rejections = traffic(after_served, after_rejected).requests;
    let served =
        traffic(before, after_served).requests + traffic(after_rejected, nginx.status()).requests;
    let total = served + rejections;
    eprintln!("nginx counted {served} served and {rejections} rejected");
    assert!(rejections > 300 && served > 300, "{served} {rejections}");
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "nginx's own counts", |s| {
            s.counters.requests_started == total && s.counters.responses_completed == total
        });
        let c = seen.counters;
        eprintln!("{side:?}: {c:?}");
        assert_eq!(c.responses_rejected, rejections, "{side:?}: {c:?}");
        assert_eq!(c.responses_served(), served, "{side:?}");
    }
}
