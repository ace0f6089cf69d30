//! Kernel observation where the kernel's path differs from the plain one, exact on both
//! vantage points: a request that arrives with the handshake (TCP_DEFER_ACCEPT), an interim
//! `100 Continue` response, and a connection map that fills up.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
    os::fd::AsRawFd,
    sync::Arc,
    thread,
};

use retry_after_common::{ProbeStat, Side};
use retry_after_estimator::endpoint::Endpoint;
use retry_after_testkit::{
    AttachedProbe, SETTLE,
    http::{Gate, HttpClient, HttpServer, ServerOptions, exchange_once},
};

/// A loopback listener with TCP_DEFER_ACCEPT: the connection is handed over only when its
/// first data arrives, in the segment that completes the handshake.
fn deferred_listener() -> TcpListener {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let seconds: libc::c_int = 5;
    // SAFETY: setsockopt on a socket we own, with a pointer to a c_int that outlives the call.
    let rc = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            (&raw const seconds).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(
        rc,
        0,
        "TCP_DEFER_ACCEPT: {}",
        std::io::Error::last_os_error()
    );
    listener
}

#[test]
fn a_deferred_accept_listener_counts_every_request_that_came_with_the_handshake() {
    let server = HttpServer::serve(deferred_listener(), ServerOptions::default());
    let endpoint = Endpoint::from(server.addr());
    let probe = AttachedProbe::watching(&[endpoint]);
    // One request per connection: every request is the one that completes a handshake.
    for _ in 0..200 {
        exchange_once(server.addr(), 64);
    }
    // And keep-alive: the first request of each connection came with its handshake.
    for _ in 0..10 {
        let mut client = HttpClient::connect(server.addr());
        for _ in 0..50 {
            client.exchange(32);
        }
    }
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "700 turns", |s| {
            s.counters.requests_started == 700
                && s.counters.responses_completed == 700
                && s.counters.connections_closed == 210
        });
        assert_eq!(seen.counters.connections_opened, 210, "{side:?}");
        assert_eq!(seen.counters.requests_abandoned, 0, "{side:?}");
    }
}

/// A server that answers `Expect: 100-continue` with an interim response, reads the body,
/// then answers for real: `rounds` times on one connection.
fn continue_server(listener: TcpListener, rounds: usize) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut writer = stream;
        for _ in 0..rounds {
            let mut length = 0;
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                if let Some(v) = line.strip_prefix("Content-Length: ") {
                    length = v.trim().parse().unwrap();
                }
                if line == "\r\n" {
                    break;
                }
            }
            writer.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").unwrap();
            let mut body = vec![0u8; length];
            reader.read_exact(&mut body).unwrap();
            writer
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
                .unwrap();
        }
    })
}

#[test]
fn an_interim_100_continue_does_not_count_as_a_response() {
    const ROUNDS: u64 = 20;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let endpoint = Endpoint::from(addr);
    let probe = AttachedProbe::watching(&[endpoint]);
    let server = continue_server(listener, ROUNDS as usize);
    let stream = TcpStream::connect(addr).unwrap();
    stream.set_nodelay(true).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    for _ in 0..ROUNDS {
        writer
            .write_all(b"POST /upload HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 300\r\n\r\n")
            .unwrap();
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        assert_eq!(line, "HTTP/1.1 100 Continue\r\n");
        reader.read_line(&mut line).unwrap();
        // Let the interim response be acknowledged on its own before the body goes.
        thread::sleep(std::time::Duration::from_millis(20));
        writer.write_all(&[b'x'; 300]).unwrap();
        let mut head = String::new();
        while head != "\r\n" {
            head.clear();
            reader.read_line(&mut head).unwrap();
        }
        let mut body = [0u8; 5];
        reader.read_exact(&mut body).unwrap();
    }
    server.join().unwrap();
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "20 turns, no interim ones", |s| {
            s.counters.requests_started == ROUNDS && s.counters.responses_completed == ROUNDS
        });
        assert_eq!(seen.counters.requests_abandoned, 0, "{side:?}");
    }
}

#[test]
fn every_connection_is_tracked_with_no_table_to_fill() {
    // Per-connection state lives in each socket's own storage: no shared table, so nothing to
    // fill, evict or refuse. 400 connections at once (800 sockets, both ends watched), each
    // with a request held by the server: every one is in flight, then every one completes.
    const CONNECTIONS: u64 = 400;
    let gate = Arc::new(Gate::default());
    let server = HttpServer::start(
        "127.0.0.1:0",
        ServerOptions {
            gate: Some(gate.clone()),
            ..Default::default()
        },
    );
    let endpoint = Endpoint::from(server.addr());
    let mut probe = AttachedProbe::attach();
    probe.watch(endpoint);
    let clients: Vec<_> = (0..CONNECTIONS)
        .map(|_| {
            let mut client = HttpClient::connect(server.addr());
            client.send(16, true);
            client
        })
        .collect();
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "every request in flight", |s| {
            s.in_flight() == CONNECTIONS
        });
        assert_eq!(seen.counters.connections_opened, CONNECTIONS, "{side:?}");
    }
    gate.open();
    for mut client in clients {
        client.receive();
        client.wait_for_close();
    }
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "all closed", |s| {
            s.counters.connections_closed == CONNECTIONS
        });
        assert_eq!(seen.counters.requests_abandoned, 0, "{side:?}: {seen:?}");
        assert_eq!(seen.counters.connections_opened, CONNECTIONS, "{side:?}");
        assert_eq!(seen.counters.requests_started, CONNECTIONS, "{side:?}");
        assert_eq!(seen.counters.responses_completed, CONNECTIONS, "{side:?}");
    }
    assert_eq!(probe.read().probe.get(ProbeStat::ConnectionsUntracked), 0);
}

#[test]
fn a_pool_opened_before_the_agent_is_counted_exactly_from_its_next_request() {
    let server = HttpServer::start("127.0.0.1:0", ServerOptions::default());
    let endpoint = Endpoint::from(server.addr());
    // A proxy's pool: ten keep-alive connections, opened and used before anything watches.
    let mut pool: Vec<HttpClient> = (0..10)
        .map(|_| HttpClient::connect(server.addr()))
        .collect();
    for client in &mut pool {
        client.exchange(16);
    }
    let probe = AttachedProbe::watching(&[endpoint]);
    for _ in 0..100 {
        for client in &mut pool {
            client.exchange(16);
        }
    }
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(
            endpoint,
            side,
            SETTLE,
            "1000 turns on the adopted pool",
            |s| s.counters.requests_started == 1000 && s.counters.responses_completed == 1000,
        );
        assert_eq!(seen.counters.connections_opened, 10, "{side:?}: adopted");
        assert_eq!(seen.counters.requests_abandoned, 0, "{side:?}");
    }
    assert_eq!(
        probe.read().probe.get(ProbeStat::ConnectionsAdopted),
        20,
        "both ends of ten"
    );
    // Their closes are seen too, though their state callback was never enabled.
    drop(pool);
    for side in [Side::Server, Side::Client] {
        let seen = probe.wait_for(endpoint, side, SETTLE, "the pool closed", |s| {
            s.counters.connections_closed == 10
        });
        assert_eq!(seen.counters.requests_abandoned, 0, "{side:?}");
    }
}
