//! The kernel's counts against the distribution's nginx and its own counters (stub_status),
//! with ab (one connection per request) and wrk (keep-alive) as traffic: on a plain listener,
//! on a `deferred` one (TCP_DEFER_ACCEPT: the request comes with the handshake), and with the
//! keep-alive connections opened before the probe attached.

use std::{process::Command, thread, time::Duration};

use retry_after_agent::endpoint::Endpoint;
use retry_after_common::Side;
use retry_after_integration_tests::{
    AttachedProbe, SETTLE, free_port,
    proxies::{Nginx, NginxStatus, Wrk},
};

fn ab(target: std::net::SocketAddr, requests: u32, concurrency: u32) {
    let out = Command::new("ab")
        .args([
            "-q",
            "-n",
            &requests.to_string(),
            "-c",
            &concurrency.to_string(),
        ])
        .arg(format!("http://{target}/"))
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

fn check(listen: &str) {
    let port = free_port();
    let nginx = Nginx::start(&format!(
        "  server {{ listen {port}{listen}; keepalive_requests 100000; location / {{ return 200 \"ok\\n\"; }} }}"
    ));
    let endpoint = Endpoint::from(port);
    let probe = AttachedProbe::watching(&[endpoint]);
    let before = nginx.status();
    ab(port, 500, 10);
    Wrk::start(port, 1, 10, 2).finish();
    let truth = traffic(before, nginx.status());
    eprintln!("{listen:?}: nginx counted {truth:?}");
    assert!(truth.requests > 1000, "{truth:?}");
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "nginx's own counts", |s| {
            s.counters.requests_started == truth.requests
                && s.counters.connections_opened == truth.accepts
                && s.counters.connections_closed == truth.accepts
        });
        let c = seen.counters;
        assert_eq!(
            c.responses_completed + c.requests_abandoned,
            c.requests_started,
            "{side:?}: {c:?}"
        );
        assert_eq!(seen.in_flight(), 0, "{side:?}");
    }
}

#[test]
fn plain_http_turns_equal_nginx_stub_status() {
    check("");
}

#[test]
fn a_deferred_listener_loses_no_first_request() {
    check(" deferred");
}

#[test]
fn keepalive_connections_opened_before_the_probe_are_counted_from_their_next_request() {
    let port = free_port();
    let nginx = Nginx::start(&format!(
        "  server {{ listen {port}; keepalive_requests 100000; keepalive_timeout 60s; location / {{ return 200 \"ok\\n\"; }} }}"
    ));
    let endpoint = Endpoint::from(port);
    // A client pool of ten connections, used before anything watches.
    let mut pool: Vec<_> = (0..10)
        .map(|_| retry_after_integration_tests::http::HttpClient::connect(port))
        .collect();
    for client in &mut pool {
        client.exchange(0);
    }
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
