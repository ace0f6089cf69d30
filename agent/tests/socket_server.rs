//! The socket server in-process, over a temporary Unix socket, with tokio's clock paused: no
//! root, no eBPF, and timeouts of seconds pass at once. What a peer does to the server: never
//! read, hold subscriptions, go silent, stay connected through a shutdown.

use std::{path::PathBuf, sync::Arc, time::Duration};

use retry_after_agent::{
    server::{self, ServerOptions},
    shared::Shared,
};
use retry_after_estimator::config::Config;
use retry_after_protocol::{ErrorCode, Request, Response, policy::Rung};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::UnixStream,
    sync::oneshot,
    task::JoinHandle,
};

const SERVICES: &str = "[[service]]\nname = \"api\"\nbackends = [{ address = \"127.0.0.1:1\" }]\n[service.backpressure]\nretry_after_s = 2\n";

struct TestServer {
    path: PathBuf,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl TestServer {
    fn start(max_clients: usize) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "retry-after-server-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        let path = dir.join("agent.sock");
        let config = Config::parse(SERVICES).expect("the test services parse");
        let shared = Arc::new(Shared::new(config.estimator(), 0));
        let listener = server::bind(&path, 0o600).expect("the socket binds");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::serve(
            listener,
            shared.clone(),
            ServerOptions {
                allowed_uids: None,
                max_clients,
                idle_timeout: Duration::from_secs(30),
                write_timeout: Duration::from_secs(1),
            },
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            path,
            shared,
            stop: Some(stop),
            task,
        }
    }

    async fn connect(&self) -> Peer {
        let stream = UnixStream::connect(&self.path)
            .await
            .expect("the server accepts");
        let (read, write) = stream.into_split();
        Peer {
            lines: BufReader::new(read).lines(),
            write,
        }
    }

    fn metric(&self, name: &str) -> f64 {
        let text = self.shared.metrics().render();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {name}"))
            .parse()
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

struct Peer {
    lines: tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
    write: tokio::net::unix::OwnedWriteHalf,
}

impl Peer {
    async fn send(&mut self, request: Request<'_>) {
        self.write
            .write_all(format!("{request}\n").as_bytes())
            .await
            .expect("the request is written");
    }

    /// The next line, parsed; `None` at the end of the stream.
    async fn next(&mut self) -> Option<Response> {
        let line = self.lines.next_line().await.ok()??;
        Some(Response::parse(&line).unwrap_or_else(|e| panic!("{line}: {e:?}")))
    }

    async fn query(&mut self) -> Response {
        self.send(Request::Query {
            service: "api",
            queue_depth: None,
            backoff_streak: None,
        })
        .await;
        self.next().await.expect("an answer")
    }
}

fn is_answer(response: &Response) -> bool {
    matches!(response, Response::RetryAfter(a) if a.seconds == Some(2))
}

fn is_error(response: Option<Response>, code: ErrorCode) -> bool {
    matches!(response, Some(Response::Err(e)) if e.code == code)
}

#[tokio::test(start_paused = true)]
async fn a_peer_that_never_reads_loses_its_connection_and_others_keep_their_answers() {
    let server = TestServer::start(8);
    let greedy = server.connect().await;
    let mut greedy_write = greedy.write;
    // Pipeline queries without ever reading: once the socket buffers are full the agent's
    // write cannot finish, and after the write deadline the connection is ended.
    let flood = tokio::spawn(async move {
        let line = format!(
            "{}\n",
            Request::Query {
                service: "api",
                queue_depth: None,
                backoff_streak: None
            }
        );
        for _ in 0..200_000 {
            if greedy_write.write_all(line.as_bytes()).await.is_err() {
                return true;
            }
        }
        false
    });
    let mut polite = server.connect().await;
    assert!(is_answer(&polite.query().await));
    assert!(
        flood.await.unwrap(),
        "the agent closed the greedy connection"
    );
    assert_eq!(
        server.metric("retry_after_socket_write_timeouts_total"),
        1.0
    );
    for _ in 0..10 {
        assert!(is_answer(&polite.query().await));
    }
    polite.send(Request::Health).await;
    let Some(Response::Health(health)) = polite.next().await else {
        panic!("no health");
    };
    assert_eq!(health.connections, 1, "the greedy slot was given back");
}

#[tokio::test(start_paused = true)]
async fn subscriptions_cannot_lock_out_proxies_that_only_query() {
    let server = TestServer::start(4);
    let mut subscribers = Vec::new();
    for _ in 0..3 {
        let mut peer = server.connect().await;
        peer.send(Request::Subscribe { service: "api" }).await;
        assert!(matches!(peer.next().await, Some(Response::Estimate(_))));
        subscribers.push(peer);
    }
    // Three quarters of four slots are subscriptions: a fourth is refused and closed.
    let mut fourth = server.connect().await;
    fourth.send(Request::Subscribe { service: "api" }).await;
    assert!(is_error(fourth.next().await, ErrorCode::Overloaded));
    assert!(fourth.next().await.is_none());
    // Proxies that only query keep getting in, one after another, each shedding the idlest
    // non-subscriber; the subscribers are never shed.
    let mut previous: Option<Peer> = None;
    for _ in 0..20 {
        let mut peer = server.connect().await;
        assert!(is_answer(&peer.query().await));
        if let Some(mut shed) = previous.replace(peer) {
            assert!(is_error(shed.next().await, ErrorCode::Idle));
        }
    }
    server.shared.tick_done();
    for subscriber in &mut subscribers {
        assert!(matches!(
            subscriber.next().await,
            Some(Response::Estimate(_))
        ));
    }
}

#[tokio::test(start_paused = true)]
async fn a_silent_connection_is_closed_after_the_idle_timeout_and_a_subscriber_is_not() {
    let server = TestServer::start(8);
    let mut silent = server.connect().await;
    let mut subscriber = server.connect().await;
    subscriber.send(Request::Subscribe { service: "api" }).await;
    assert!(matches!(
        subscriber.next().await,
        Some(Response::Estimate(_))
    ));
    tokio::time::sleep(Duration::from_secs(31)).await;
    assert!(is_error(silent.next().await, ErrorCode::Idle));
    assert!(silent.next().await.is_none());
    server.shared.tick_done();
    assert!(matches!(
        subscriber.next().await,
        Some(Response::Estimate(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn shutdown_ends_every_connection_and_waits_for_them() {
    let mut server = TestServer::start(8);
    let mut peers = Vec::new();
    for i in 0..3 {
        let mut peer = server.connect().await;
        if i == 0 {
            peer.send(Request::Subscribe { service: "api" }).await;
            assert!(matches!(peer.next().await, Some(Response::Estimate(_))));
        } else {
            assert!(is_answer(&peer.query().await));
        }
        peers.push(peer);
    }
    server.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), &mut server.task)
        .await
        .expect("serve returns once every connection task has ended")
        .unwrap();
    for peer in &mut peers {
        assert!(peer.next().await.is_none(), "closed by the server");
    }
}

#[tokio::test(start_paused = true)]
async fn bad_lines_get_their_error_and_the_connection_stays_usable() {
    let server = TestServer::start(8);
    let mut peer = server.connect().await;
    for (line, code) in [
        (&b"FROBNICATE api\n"[..], ErrorCode::UnknownCommand),
        (b"QUERY api queue_depth=lots\n", ErrorCode::BadArgument),
        (b"QUERY nosuch\n", ErrorCode::UnknownService),
        (b"\xff\xfe\n", ErrorCode::BadRequest),
    ] {
        peer.write.write_all(line).await.unwrap();
        assert!(is_error(peer.next().await, code), "{line:?}");
        assert!(is_answer(&peer.query().await));
    }
}

#[tokio::test]
async fn every_value_a_reporter_handed_out_reaches_the_judge_over_as_many_lines_as_it_takes() {
    let server = TestServer::start(8);
    let reporter =
        retry_after_client::Reporter::spawn(&server.path, "api", Duration::from_millis(50));
    reporter.set_queue(5, 0);
    // 122 values (0 to 60 s on both rungs) do not fit on one 512-byte line.
    for rung in [Rung::Computed, Rung::Static] {
        for seconds in 0..=60 {
            reporter.rejected(false);
            reporter.handed_out(rung, seconds);
        }
    }
    reporter.admitted(true);
    let pending = || {
        let estimator = server.shared.estimator();
        estimator.service("api").unwrap().judge_pending()
    };
    for _ in 0..100 {
        if pending() == 122 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(pending(), 122, "one answer group per value handed out");
    assert_eq!(
        server.metric("retry_after_proxy_requests_total{outcome=\"rejected\",service=\"api\"}"),
        122.0
    );
    assert_eq!(
        server.metric("retry_after_proxy_requests_total{outcome=\"admitted\",service=\"api\"}"),
        1.0
    );
}
