//! Requests in flight, abandoned requests and accept backlogs, read from the real programs while
//! real requests wait on loopback.

use std::{net::TcpListener, sync::Arc, time::Duration};

use retry_after_common::Side;
use retry_after_estimator::endpoint::Endpoint;
use retry_after_testkit::{
    AttachedProbe, SETTLE,
    http::{Gate, HttpClient, HttpServer, ServerOptions},
};

#[test]
fn a_slow_server_holding_requests_shows_them_in_flight_until_it_answers() {
    const HELD: u64 = 7;
    let gate = Arc::new(Gate::default());
    let server = HttpServer::start(
        "127.0.0.1:0",
        ServerOptions {
            response_body: 2000,
            gate: Some(gate.clone()),
            ..Default::default()
        },
    );
    let endpoint = Endpoint::from(server.addr());
    let probe = AttachedProbe::watching(&[endpoint]);

    let mut clients: Vec<_> = (0..HELD)
        .map(|_| HttpClient::connect(server.addr()))
        .collect();
    for client in &mut clients {
        client.send(100, false);
    }
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "7 held requests", |s| {
            s.in_flight() == HELD
        });
        assert_eq!(seen.counters.requests_started, HELD, "{side:?}");
        assert_eq!(seen.counters.responses_completed, 0, "{side:?}");
    }
    assert_eq!(
        gate.arrived.load(std::sync::atomic::Ordering::SeqCst) as u64,
        HELD
    );

    gate.open();
    for client in &mut clients {
        assert_eq!(client.receive(), 2000);
    }
    // The connections stay open and idle: every response is complete once acknowledged.
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "held requests answered", |s| {
            s.in_flight() == 0
        });
        assert_eq!(seen.counters.responses_completed, HELD, "{side:?}");
        assert_eq!(seen.counters.connections_closed, 0, "{side:?}: still open");
    }
    drop(clients);
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "connections closed", |s| {
            s.counters.connections_closed == HELD
        });
        assert_eq!(
            seen.counters.responses_completed, HELD,
            "{side:?}: no second completion"
        );
    }
}

#[test]
fn a_request_closed_without_an_answer_is_abandoned_not_completed() {
    let server = HttpServer::start(
        "127.0.0.1:0",
        ServerOptions {
            hang_up: true,
            ..Default::default()
        },
    );
    let endpoint = Endpoint::from(server.addr());
    let probe = AttachedProbe::watching(&[endpoint]);

    for _ in 0..3 {
        let mut client = HttpClient::connect(server.addr());
        client.send(10, false);
        client.wait_for_close();
    }
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "3 hung-up requests", |s| {
            s.counters.connections_closed == 3
        });
        let c = seen.counters;
        assert_eq!(
            (
                c.requests_started,
                c.responses_completed,
                c.requests_abandoned
            ),
            (3, 0, 3),
            "{side:?}: {c:?}"
        );
    }
}

#[test]
fn connections_waiting_to_be_accepted_show_as_backlog_and_their_requests_as_in_flight() {
    // A listener whose application never calls accept().
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = Endpoint::from(listener.local_addr().unwrap());
    let probe = AttachedProbe::watching(&[endpoint]);

    let mut clients: Vec<_> = (0..5)
        .map(|_| HttpClient::connect(listener.local_addr().unwrap()))
        .collect();
    for client in clients.iter_mut().take(3) {
        client.send(64, false);
    }
    let seen = probe.wait_for(
        endpoint,
        Side::Server,
        SETTLE,
        "5 unaccepted connections",
        |s| s.accept_backlog == Some(5) && s.in_flight() == 3,
    );
    assert_eq!(seen.counters.connections_opened, 5);
    assert_eq!(seen.counters.requests_started, 3);
    assert_eq!(
        probe.counters(endpoint, Side::Client).accept_backlog,
        None,
        "a remote backlog cannot be seen from the client side"
    );
    drop(clients);
    drop(listener);
    std::thread::sleep(Duration::from_millis(100));
    let seen = probe.wait_for(endpoint, Side::Server, SETTLE, "listener gone", |s| {
        s.accept_backlog == Some(0)
    });
    assert_eq!(seen.in_flight(), 0, "{seen:?}");
}
