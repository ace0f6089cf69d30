//! Cost of asking the agent, against baselines measured in the same run.
//!
//! * One-shot QUERY round trip and throughput over the agent's real socket server, against a
//!   bare Unix-socket line echo server on the same runtime (target: ≤ 1.5× the echo).
//! * The client library's reject path: `Subscription::retry_after`, reading the latest estimate
//!   from memory and applying jitter, clamp and ladder (target: < 100 ns), against one random
//!   draw alone.
//!
//! The socket server runs in-process on a tokio runtime, fed an estimator warmed with
//! synthetic snapshots; nothing is attached to the kernel. Prints markdown tables.
//!
//! Usage: `socket-bench [ROUND_TRIPS] [CLIENTS] [SECONDS]`   (defaults 20000 4 3)

use std::{
    hint::black_box,
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixStream,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use rand::RngExt;
use retry_after_agent::{
    server::{self, ServerOptions},
    shared::Shared,
};
use retry_after_common::{EndpointCounters, Side};
use retry_after_estimator::{
    Estimator,
    config::Config,
    endpoint::Endpoint,
    snapshot::{EndpointSnapshot, ProbeStats, Snapshot},
};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt},
    net::UnixListener,
};

const CONFIG: &str = r#"
[[service]]
name = "api"
rejected_at = "replica"
backends = [{ address = "127.0.0.1:9", max_ongoing_requests = 4 }]
[service.backpressure]
retry_after_policy = "router_queue_drain_rate"
retry_after_s = 5

[[service]]
name = "scheduled"
rejected_at = "replica"
backends = [{ address = "127.0.0.1:9", max_ongoing_requests = 4 }]
[service.backpressure]
retry_after_policy = "scheduled_returns"
retry_after_s = 5
"#;

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<u64>().expect("numeric argument"));
    let round_trips = args.next().unwrap_or(20_000);
    let clients = args.next().unwrap_or(4);
    let seconds = args.next().unwrap_or(3);

    let dir = std::env::temp_dir().join(format!("retry-after-socket-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let agent_socket = dir.join("agent.sock");
    let echo_socket = dir.join("echo.sock");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    start_servers(&runtime, &agent_socket, &echo_socket);
    socket_table(&agent_socket, &echo_socket, round_trips, clients, seconds);
    let _guard = runtime.enter();
    reject_path_table(&agent_socket);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The agent's socket server over a warm estimator, and a bare echo server to compare with.
fn start_servers(runtime: &tokio::runtime::Runtime, agent_socket: &Path, echo_socket: &Path) {
    let shared = Arc::new(Shared::new(warm_estimator(), 0));
    let _guard = runtime.enter();
    let listener = server::bind(agent_socket, 0o600).unwrap();
    runtime.spawn(server::serve(
        listener,
        shared,
        ServerOptions {
            allowed_uids: None,
            max_clients: 256,
            idle_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(1),
        },
        std::future::pending(),
    ));
    let echo = UnixListener::bind(echo_socket).unwrap();
    runtime.spawn(echo_server(echo));
}

/// Round trip and throughput of `QUERY` against the bare echo, in the same run.
fn socket_table(
    agent_socket: &Path,
    echo_socket: &Path,
    round_trips: u64,
    clients: u64,
    seconds: u64,
) {
    let request = b"QUERY api queue_depth=12\n";
    println!("| measurement | bare echo | agent QUERY | ratio |");
    println!("|---|---|---|---|");
    let echo_rtt = round_trip_ns(echo_socket, request, round_trips);
    let agent_rtt = round_trip_ns(agent_socket, request, round_trips);
    println!(
        "| round trip, one connection (µs, median of {round_trips}) | {:.1} | {:.1} | {:.2} |",
        echo_rtt / 1000.0,
        agent_rtt / 1000.0,
        agent_rtt / echo_rtt
    );
    let echo_tput = throughput(echo_socket, request, clients, seconds);
    let agent_tput = throughput(agent_socket, request, clients, seconds);
    println!(
        "| throughput, {clients} connections (requests/s) | {echo_tput:.0} | {agent_tput:.0} | {:.2} |",
        echo_tput / agent_tput
    );
}

/// The reject path read from memory, per call, against one random draw (within a runtime).
fn reject_path_table(agent_socket: &Path) {
    let subscription = follow(agent_socket, "api");
    let mut rng = rand::rng();
    let decision = subscription.retry_after(&mut rng);
    assert_eq!(
        decision.rung,
        retry_after_client::Rung::Computed,
        "{decision:?}"
    );
    let calls = 2_000_000u32;
    let baseline = per_call_ns(calls, || {
        black_box(rng.random::<f64>());
    });
    let mut rng = rand::rng();
    let read = per_call_ns(calls, || {
        black_box(subscription.retry_after(&mut rng));
    });
    let mut rng = rand::rng();
    let with_depth = per_call_ns(calls, || {
        black_box(subscription.retry_after_with(Some(black_box(17)), Some(2), &mut rng));
    });
    // scheduled_returns reads the schedule and adds each value handed out to it: as the
    // calls fill it, later ones walk all of its 60 seconds.
    let scheduled = follow(agent_socket, "scheduled");
    let mut rng = rand::rng();
    let with_schedule = per_call_ns(calls, || {
        black_box(scheduled.retry_after_with(Some(black_box(17)), None, &mut rng));
    });
    let (early, placed) = kept_returns_paths(calls);
    println!();
    println!("| reject path | ns per call | ratio to baseline |");
    println!("|---|---|---|");
    println!("| baseline: one random draw | {baseline:.1} | 1.00 |");
    for (name, ns) in [
        ("`retry_after` (agent's depth)", read),
        ("`retry_after_with` (own depth and streak)", with_depth),
        (
            "`retry_after_with`, `scheduled_returns` (own depth, schedule filling)",
            with_schedule,
        ),
        (
            "`kept_returns`: admission check of a key holding a place (early, queue full)",
            early,
        ),
        (
            "`kept_returns`: a rejection given a place (key hashed, place found, booked)",
            placed,
        ),
    ] {
        println!("| {name} | {ns:.1} | {:.2} |", ns / baseline);
    }
}

/// Kept returns on the reject path, per call: the router's admission check for a key that
/// holds a place not yet due, with the queue full (a lookup in the book, the answer its
/// second); and a rejection given a place: the key's HMAC, the walk to the earliest second
/// with room and the booking, in a book the calls fill (20,000 a second of drain, so later
/// calls walk further).
fn kept_returns_paths(calls: u32) -> (f64, f64) {
    use retry_after_policy::{KeptReturnsSettings, KeyHasher, TicketBook, TicketKey};
    use retry_after_reference_proxy::{Returning, Router, promise};
    let settings = KeptReturnsSettings {
        max_keys: calls as usize * 2,
        ..KeptReturnsSettings::default()
    };
    let mut book = TicketBook::new(settings);
    let mut router: Router<u32> = Router::new(1, 1);
    router.arrive_kept(0, None, &mut book, 100, None);
    let holder = TicketKey(7 << 32);
    book.issue(holder, 130, 100);
    let returning = Some(Returning {
        key: holder,
        cookie_due: None,
    });
    let early = per_call_ns(calls, || {
        black_box(router.arrive_kept(1, black_box(returning), &mut book, 100, Some(20_000.0)));
    });
    let hasher = KeyHasher::new(b"bench secret");
    let mut i = 0u64;
    let placed = per_call_ns(calls, || {
        i += 1;
        let key = hasher.key(&i.to_be_bytes());
        black_box(promise(
            &mut book,
            key,
            None,
            Duration::from_millis(100_250),
            1,
            Some(20_000.0),
            (1, 60),
        ));
    });
    (early, placed)
}

/// A subscription to `service` that holds its first estimate (within a tokio runtime).
fn follow(socket: &Path, service: &str) -> retry_after_client::Subscription {
    let subscription = retry_after_client::Subscription::spawn(
        socket,
        service,
        retry_after_client::ClientOptions {
            retry_after_s: Some(5),
            ..Default::default()
        },
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while subscription.age().is_none() {
        assert!(
            Instant::now() < deadline,
            "no estimate from the in-process agent"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    subscription
}

/// An estimator for "api" and "scheduled", warmed: 10 ticks of 40 completions per second, 12 in flight.
fn warm_estimator() -> Estimator {
    let config = Config::parse(CONFIG).unwrap();
    let mut estimator = config.estimator();
    let t0 = Instant::now();
    let endpoint: Endpoint = "127.0.0.1:9".parse().unwrap();
    for tick in 0..10u64 {
        estimator.observe(&Snapshot {
            taken_at: t0 + Duration::from_secs(tick),
            endpoints: vec![EndpointSnapshot {
                endpoint,
                side: Side::Server,
                counters: EndpointCounters {
                    requests_started: tick * 40 + 12,
                    responses_completed: tick * 40,
                    ..Default::default()
                },
                accept_backlog: Some(0),
            }],
            probe: ProbeStats::default(),
            backlog_error: None,
        });
    }
    estimator
}

async fn echo_server(listener: UnixListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut lines = tokio::io::BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if write
                    .write_all(format!("{line}\n").as_bytes())
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
    }
}

fn connect(path: &Path) -> (UnixStream, BufReader<UnixStream>) {
    let stream = UnixStream::connect(path).unwrap();
    let reader = BufReader::new(stream.try_clone().unwrap());
    (stream, reader)
}

/// Median round trip of `count` sequential requests on one connection.
fn round_trip_ns(path: &Path, request: &[u8], count: u64) -> f64 {
    let (mut stream, mut reader) = connect(path);
    let mut line = String::new();
    let mut samples = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let start = Instant::now();
        stream.write_all(request).unwrap();
        line.clear();
        reader.read_line(&mut line).unwrap();
        samples.push(start.elapsed().as_nanos() as f64);
    }
    assert!(!line.starts_with("ERR"), "{line}");
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Requests per second over `clients` connections for `seconds`.
fn throughput(path: &Path, request: &[u8], clients: u64, seconds: u64) -> f64 {
    let until = Instant::now() + Duration::from_secs(seconds);
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let (path, request) = (path.to_path_buf(), request.to_vec());
            std::thread::spawn(move || {
                let (mut stream, mut reader) = connect(&path);
                let mut line = String::new();
                let mut done = 0u64;
                while Instant::now() < until {
                    stream.write_all(&request).unwrap();
                    line.clear();
                    reader.read_line(&mut line).unwrap();
                    done += 1;
                }
                done
            })
        })
        .collect();
    let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    total as f64 / seconds as f64
}

/// Median over batches of the time per call.
fn per_call_ns(calls: u32, mut call: impl FnMut()) -> f64 {
    let batch = calls / 10;
    let mut samples: Vec<f64> = (0..10)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..batch {
                call();
            }
            start.elapsed().as_nanos() as f64 / f64::from(batch)
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[5]
}
