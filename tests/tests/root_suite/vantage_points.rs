//! The client-side view (connections this host opens to a watched endpoint) agrees with the
//! server-side view (the watched listener) of the same traffic.

use std::thread;

use retry_after_common::Side;
use retry_after_estimator::endpoint::Endpoint;
use retry_after_testkit::{
    AttachedProbe, SETTLE,
    http::{HttpClient, HttpServer, ServerOptions, exchange_once},
};

#[test]
fn client_side_counts_match_server_side_counts() {
    let server = HttpServer::start(
        "127.0.0.1:0",
        ServerOptions {
            response_body: 5000,
            ..Default::default()
        },
    );
    let endpoint = Endpoint::from(server.addr());
    let probe = AttachedProbe::watching(&[endpoint]);

    // A mix: keep-alive connections, one-shot connections, large and small bodies.
    let workers: Vec<_> = (0..4)
        .map(|worker| {
            let addr = server.addr();
            thread::spawn(move || {
                let mut client = HttpClient::connect(addr);
                for turn in 0..30 {
                    let body = if (turn + worker) % 7 == 0 {
                        80_000
                    } else {
                        200
                    };
                    client.exchange(body);
                }
                let once: usize = (0..5).map(|_| exchange_once(addr, 1000)).sum();
                client.bytes_sent + once
            })
        })
        .collect();
    let bytes_sent: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();

    let server_side = probe.wait_for(endpoint, Side::Server, SETTLE, "server side settled", |s| {
        s.counters.connections_closed == 24
    });
    let client_side = probe.wait_for(endpoint, Side::Client, SETTLE, "client side settled", |s| {
        s.counters.connections_closed == 24
    });
    let (s, c) = (server_side.counters, client_side.counters);
    // The server side against the clients' and the server's own counts; then the client side
    // against it, field by field.
    assert_eq!(s.connections_opened, 24);
    assert_eq!(s.requests_started, 4 * 35);
    assert_eq!(
        s.responses_completed,
        server.answered.load(std::sync::atomic::Ordering::SeqCst) as u64,
        "the server's own count of answers"
    );
    assert_eq!(s.requests_abandoned, 0);
    assert_eq!(
        s.request_bytes, bytes_sent as u64,
        "the clients' own count of bytes"
    );
    assert_eq!(
        (
            s.connections_opened,
            s.connections_closed,
            s.requests_started,
            s.responses_completed,
            s.requests_abandoned,
            s.request_bytes
        ),
        (
            c.connections_opened,
            c.connections_closed,
            c.requests_started,
            c.responses_completed,
            c.requests_abandoned,
            c.request_bytes
        ),
        "server {s:?} vs client {c:?}"
    );
}
