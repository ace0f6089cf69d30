//! The watch set: only watched endpoints count, and it can change while the agent runs.

use retry_after_common::{EndpointCounters, Side};
use retry_after_estimator::endpoint::Endpoint;
use retry_after_testkit::{
    AttachedProbe, SETTLE,
    http::{HttpClient, HttpServer, ServerOptions, exchange_once},
};

fn server(bind: &str) -> HttpServer {
    HttpServer::start(
        bind,
        ServerOptions {
            response_body: 10,
            ..Default::default()
        },
    )
}

#[test]
fn traffic_to_an_unwatched_port_changes_no_counter() {
    let watched = server("127.0.0.1:0");
    let unwatched = server("127.0.0.1:0");
    let endpoint = Endpoint::from(watched.addr());
    let probe = AttachedProbe::watching(&[endpoint]);

    let mut client = HttpClient::connect(unwatched.addr());
    for _ in 0..20 {
        client.exchange(10);
    }
    drop(client);
    exchange_once(unwatched.addr(), 10);
    std::thread::sleep(std::time::Duration::from_millis(300));

    let snapshot = probe.read();
    assert_eq!(
        snapshot.endpoints.len(),
        2,
        "only the watched endpoint, both sides"
    );
    for side in [Side::Server, Side::Client] {
        let seen = snapshot.endpoint(&endpoint, side).unwrap();
        assert_eq!(seen.counters, EndpointCounters::default(), "{side:?}");
    }
    assert!(
        snapshot
            .endpoint(&Endpoint::from(unwatched.addr()), Side::Server)
            .is_none()
    );
}

#[test]
fn endpoints_added_and_removed_at_run_time_take_effect_at_once() {
    let first = server("127.0.0.1:0");
    let second = server("127.0.0.1:0");
    let (a, b) = (Endpoint::from(first.addr()), Endpoint::from(second.addr()));
    let mut probe = AttachedProbe::watching(&[a]);

    // Add b while running: its connections from now on count.
    probe.watch(b);
    for _ in 0..10 {
        exchange_once(second.addr(), 10);
    }
    let seen = probe.wait_for(b, Side::Server, SETTLE, "b counted after watch", |s| {
        s.counters.connections_closed == 10
    });
    assert_eq!(
        (
            seen.counters.requests_started,
            seen.counters.responses_completed
        ),
        (10, 10)
    );

    // A connection opened while a is watched...
    let mut old = HttpClient::connect(first.addr());
    for _ in 0..3 {
        old.exchange(10);
    }
    probe.wait_for(a, Side::Server, SETTLE, "a counted", |s| {
        s.counters.responses_completed == 3
    });

    // ...stops counting when a is removed, and when a is watched again it does not resume
    // with its old state: it is adopted afresh at its next request, like any connection older
    // than the watch.
    probe.unwatch(a);
    assert!(
        probe.read().endpoint(&a, Side::Server).is_none(),
        "counters dropped"
    );
    probe.watch(a);
    for _ in 0..5 {
        old.exchange(10);
    }
    let mut new = HttpClient::connect(first.addr());
    for _ in 0..4 {
        new.exchange(10);
    }
    drop(new);
    drop(old);
    let seen = probe.wait_for(a, Side::Server, SETTLE, "a counted afresh", |s| {
        s.counters.connections_closed == 2
    });
    let c = seen.counters;
    assert_eq!(
        (
            c.connections_opened,
            c.requests_started,
            c.responses_completed
        ),
        (2, 9, 9),
        "the old connection's 5 requests from its adoption, the new one's 4: {c:?}"
    );

    // Remove b: its further traffic is not counted anywhere.
    probe.unwatch(b);
    exchange_once(second.addr(), 10);
    let snapshot = probe.read();
    assert!(snapshot.endpoint(&b, Side::Server).is_none());
    assert_eq!(snapshot.endpoints.len(), 2);
}

#[test]
fn a_port_wildcard_counts_ipv4_and_ipv6_connections() {
    // A dual-stack listener serves both loopback addresses on one port.
    let dual = server("[::]:0");
    let port = dual.addr().port();
    let wildcard: Endpoint = format!("*:{port}").parse().unwrap();
    let probe = AttachedProbe::watching(&[wildcard]);

    exchange_once(format!("127.0.0.1:{port}").parse().unwrap(), 10);
    exchange_once(format!("[::1]:{port}").parse().unwrap(), 10);
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(
            wildcard,
            side,
            SETTLE,
            "v4 and v6 under one wildcard",
            |s| s.counters.connections_closed == 2,
        );
        assert_eq!(
            (
                seen.counters.requests_started,
                seen.counters.responses_completed
            ),
            (2, 2),
            "{side:?}"
        );
    }
}
