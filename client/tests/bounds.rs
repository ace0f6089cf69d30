//! The client keeps its promise against agents that misbehave on a real Unix socket: one
//! that never accepts (full backlog), one that drips its answer a byte at a time, one whose
//! answer never ends, one that goes silent under a subscription.

use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::{UnixListener, UnixStream},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use retry_after_client::{ClientError, ClientOptions, Subscription, query, query_or_static};

fn socket_path(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("retry-after-client-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a folder for the socket");
    dir.join("agent.sock")
}

/// An "agent" that answers every connection with `behaviour` on its own thread.
fn serve(path: &PathBuf, behaviour: fn(UnixStream)) -> Arc<AtomicUsize> {
    let listener = UnixListener::bind(path).expect("the test agent binds");
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            count.fetch_add(1, Ordering::SeqCst);
            thread::spawn(move || behaviour(stream));
        }
    });
    accepted
}

fn within(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> Result<retry_after_protocol::QueryResponse, ClientError>,
) {
    let started = Instant::now();
    let result = f();
    let took = started.elapsed();
    assert!(result.is_err(), "{what}: {result:?}");
    assert!(took < limit, "{what}: took {took:?}");
}

#[test]
fn a_full_backlog_does_not_hold_the_caller_past_its_deadline() {
    let path = socket_path("backlog");
    // Never accepts. A backlog of its own, small: the system's default (somaxconn) can be
    // more connections than an unprivileged process may hold open.
    let listener = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)
        .expect("a Unix socket");
    listener
        .bind(&socket2::SockAddr::unix(&path).expect("the socket's address"))
        .expect("the listener binds");
    listener.listen(8).expect("the listener listens");
    // Fill the backlog with connections nobody accepts.
    let mut held = Vec::new();
    loop {
        let socket =
            socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None).unwrap();
        socket.set_nonblocking(true).unwrap();
        match socket.connect(&socket2::SockAddr::unix(&path).unwrap()) {
            Ok(()) => held.push(socket),
            Err(_) => break,
        }
        assert!(held.len() < 100_000);
    }
    within(Duration::from_millis(800), "full backlog", || {
        query(&path, "api", None, None, Duration::from_millis(300))
    });
    assert_eq!(
        query_or_static(&path, "api", None, Duration::from_millis(100), Some(7)),
        Some(7)
    );
}

#[test]
fn an_answer_dripped_a_byte_at_a_time_is_cut_at_the_deadline() {
    let path = socket_path("drip");
    serve(&path, |stream| {
        let mut line = String::new();
        let _ = BufReader::new(&stream).read_line(&mut line);
        for byte in b"RETRY-AFTER 5 millis=5000 rung=static".iter().cycle() {
            if (&stream).write_all(&[*byte]).is_err() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
    });
    within(Duration::from_millis(900), "drip", || {
        query(&path, "api", None, None, Duration::from_millis(500))
    });
}

#[test]
fn an_answer_that_never_ends_is_refused_with_bounded_memory() {
    let path = socket_path("endless");
    serve(&path, |stream| {
        let mut line = String::new();
        let _ = BufReader::new(&stream).read_line(&mut line);
        let chunk = [b'R'; 4096];
        while (&stream).write_all(&chunk).is_ok() {}
    });
    let result = query(&path, "api", None, None, Duration::from_secs(5));
    assert!(
        matches!(&result, Err(ClientError::Protocol(reason)) if reason.contains("longer than")),
        "{result:?}"
    );
}

#[tokio::test]
async fn a_subscription_leaves_a_silent_agent_and_connects_again() {
    let path = socket_path("silent");
    let accepted = serve(&path, |stream| {
        let mut line = String::new();
        let _ = BufReader::new(&stream).read_line(&mut line);
        let push = "ESTIMATE api seq=1 retry_after_policy=static status_code=503 retry_after_s=9 queue_depth=none queue_depth_source=none drain_rate=none occupancy=none occupancy_weight=0.25 backoff_weight=0.25 backoff_streak_saturation=5 jitter=0.2 min_retry_after_s=1 max_retry_after_s=60 base_ms=none reason=static_policy\n";
        let _ = (&stream).write_all(push.as_bytes());
        // Then silence, as a stopped agent: the connection stays open.
        thread::sleep(Duration::from_secs(60));
    });
    let subscription = Subscription::spawn(
        &path,
        "api",
        ClientOptions {
            retry_after_s: Some(3),
            stale_after: Duration::from_millis(300),
            reconnect_min: Duration::from_millis(50),
            reconnect_max: Duration::from_millis(100),
            ..ClientOptions::default()
        },
    );
    let mut rng = rand::rng();
    let deadline = Instant::now() + Duration::from_secs(5);
    while subscription.retry_after(&mut rng).seconds != Some(9) {
        assert!(Instant::now() < deadline, "no push held");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Never blocks, whatever the agent does; once the push is stale, the client's own static
    // value with the service's status; and the silent connection is left for a new one.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let started = Instant::now();
    let decision = subscription.retry_after(&mut rng);
    assert!(started.elapsed() < Duration::from_millis(5));
    assert!(
        accepted.load(Ordering::SeqCst) >= 3,
        "reconnected: {} connections",
        accepted.load(Ordering::SeqCst)
    );
    // The newest push may be fresh again (each new connection gets one).
    assert!(
        decision.seconds == Some(9) || (decision.seconds, decision.status_code) == (Some(3), 503),
        "{decision:?}"
    );
}
