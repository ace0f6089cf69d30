//! The kernel's counts against the distribution's nginx and its own counters (stub_status),
//! with ab (one connection per request) and wrk (keep-alive) as traffic: on a plain listener,
//! on a `deferred` one (TCP_DEFER_ACCEPT: the request comes with the handshake), over TLS 1.2
//! and TLS 1.3 (handshakes, session tickets and close_notify are not requests), and with the
//! keep-alive connections opened before the probe attached.

use std::{process::Command, thread, time::Duration};

use retry_after_agent::endpoint::Endpoint;
use retry_after_common::Side;
use retry_after_integration_tests::{
    AttachedProbe, SETTLE, free_port,
    proxies::{Nginx, NginxStatus, Wrk, self_signed_certificate},
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
    let nginx = Nginx::start(&format!(
        "  server {{ listen {port}{listen}{listen_tls}; {server_tls} keepalive_requests 100000; location / {{ return 200 \"ok\\n\"; }} }}"
    ));
    let endpoint = Endpoint::from(port);
    let probe = AttachedProbe::watching(&[endpoint]);
    let url = format!("{scheme}://{port}/");
    let before = nginx.status();
    ab(&url, tls.map(|t| t.ab), 500, 10);
    Wrk::start_url(&url, 1, 10, 2).finish();
    let truth = traffic(before, nginx.status());
    eprintln!("{listen:?} {scheme}: nginx counted {truth:?}");
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
    assert_eq!(probe.read().probe.tls_segments_unframed, 0);
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
