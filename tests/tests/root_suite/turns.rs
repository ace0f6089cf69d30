//! Request/response turns counted exactly, with the real programs attached and real HTTP/1.1
//! traffic on loopback.

use std::thread;

use retry_after_common::Side;
use retry_after_estimator::endpoint::Endpoint;
use retry_after_testkit::{
    AttachedProbe, SETTLE,
    http::{HttpClient, HttpServer, ServerOptions, exchange_once},
};

#[test]
fn ten_keep_alive_connections_of_a_hundred_turns_each() {
    let server = HttpServer::start(
        "127.0.0.1:0",
        ServerOptions {
            response_body: 300,
            ..Default::default()
        },
    );
    let endpoint = Endpoint::from(server.addr());
    let probe = AttachedProbe::watching(&[endpoint]);

    let clients: Vec<_> = (0..10)
        .map(|_| {
            let addr = server.addr();
            thread::spawn(move || {
                let mut client = HttpClient::connect(addr);
                for _ in 0..100 {
                    assert_eq!(client.exchange(50), 300);
                }
                // Dropping the client closes the connection.
            })
        })
        .collect();
    for client in clients {
        client.join().unwrap();
    }

    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(
            endpoint,
            side,
            SETTLE,
            "1000 turns on 10 connections",
            |s| s.counters.connections_closed == 10 && s.counters.responses_completed == 1000,
        );
        let c = seen.counters;
        assert_eq!(c.connections_opened, 10, "{side:?}: {c:?}");
        assert_eq!(c.connections_closed, 10, "{side:?}: {c:?}");
        assert_eq!(c.requests_started, 1000, "{side:?}: {c:?}");
        assert_eq!(c.responses_completed, 1000, "{side:?}: {c:?}");
        assert_eq!(c.requests_abandoned, 0, "{side:?}: {c:?}");
        // Every response is HTTP/1.1 with a Content-Length: each ended at its last byte, its
        // body begun and ended, none inferred.
        assert_eq!(
            (c.responses_inferred, c.bodies_begun, c.bodies_ended),
            (0, 1000, 1000),
            "{side:?}: {c:?}"
        );
    }
}

#[test]
fn two_hundred_connection_per_request_exchanges() {
    let server = HttpServer::start(
        "127.0.0.1:0",
        ServerOptions {
            response_body: 100,
            ..Default::default()
        },
    );
    let endpoint = Endpoint::from(server.addr());
    let probe = AttachedProbe::watching(&[endpoint]);

    for _ in 0..200 {
        exchange_once(server.addr(), 10);
    }

    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "200 one-shot connections", |s| {
            s.counters.connections_closed == 200
        });
        let c = seen.counters;
        assert_eq!(
            (
                c.connections_opened,
                c.connections_closed,
                c.requests_started,
                c.responses_completed
            ),
            (200, 200, 200, 200),
            "{side:?}: {c:?}"
        );
        assert_eq!(c.requests_abandoned, 0, "{side:?}: {c:?}");
    }
}

#[test]
fn bodies_spanning_many_segments_count_once_per_turn() {
    const REQUEST_BODY: usize = 96 * 1024;
    const RESPONSE_BODY: usize = 256 * 1024;
    const TURNS: u64 = 20;
    let server = HttpServer::start(
        "127.0.0.1:0",
        ServerOptions {
            response_body: RESPONSE_BODY,
            ..Default::default()
        },
    );
    let endpoint = Endpoint::from(server.addr());
    let probe = AttachedProbe::watching(&[endpoint]);

    let mut client = HttpClient::connect(server.addr());
    for _ in 0..TURNS {
        assert_eq!(client.exchange(REQUEST_BODY), RESPONSE_BODY);
    }
    let request_bytes = client.bytes_sent as u64;
    // Each response is written in one call: head and body.
    let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {RESPONSE_BODY}\r\n\r\n");
    let response_bytes = TURNS * (head.len() + RESPONSE_BODY) as u64;
    drop(client);

    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "20 turns with large bodies", |s| {
            s.counters.connections_closed == 1
        });
        let c = seen.counters;
        assert_eq!(c.requests_started, TURNS, "{side:?}: {c:?}");
        assert_eq!(c.responses_completed, TURNS, "{side:?}: {c:?}");
        assert_eq!(
            c.request_bytes, request_bytes,
            "{side:?}: every request byte, once"
        );
        // Response bytes sent after a turn completed early are not counted (see
        // docs/kernel-observation.md): never more than were written, and never none.
        assert!(
            c.response_bytes > 0 && c.response_bytes <= response_bytes,
            "{side:?}: response bytes {} of {response_bytes}",
            c.response_bytes
        );
        eprintln!(
            "{side:?}: response bytes {} of {response_bytes}",
            c.response_bytes
        );
        assert_eq!(c.requests_abandoned, 0, "{side:?}: {c:?}");
    }
}

#[test]
fn ipv6_loopback_counts_like_ipv4() {
    let server = HttpServer::start(
        "[::1]:0",
        ServerOptions {
            response_body: 10,
            ..Default::default()
        },
    );
    let endpoint = Endpoint::from(server.addr());
    let probe = AttachedProbe::watching(&[endpoint]);

    let mut client = HttpClient::connect(server.addr());
    for _ in 0..25 {
        client.exchange(5);
    }
    drop(client);
    exchange_once(server.addr(), 5);

    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "26 turns over ::1", |s| {
            s.counters.connections_closed == 2
        });
        let c = seen.counters;
        assert_eq!(
            (
                c.connections_opened,
                c.requests_started,
                c.responses_completed
            ),
            (2, 26, 26),
            "{side:?}: {c:?}"
        );
    }
}
