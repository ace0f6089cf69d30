//! The reference rejecting proxy: the proposal's router in front of the replicas.
//!
//! * One queue per proxy, bounded by `max_queued_requests`: a request that finds it full is
//!   rejected at once with the configured status and, by the proxy's header policy, a
//!   `Retry-After` from the client library's subscription (computed with the proxy's own
//!   queue depth and backoff streak), and one access-log line.
//! * A dispatcher places the request at the head of the queue by power of two choices: two
//!   replicas drawn at random, the one with fewer requests ongoing, if it has fewer than its
//!   `max_ongoing_requests`. When neither has room, placement is retried after a backoff of
//!   25 ms doubling to 500 ms, and the backoff streak (consecutive failed placements) grows;
//!   a placement ends it.
//! * Every admission and rejection is counted for the agent ([`Reporter`]); a request marked
//!   as a retry (`x-retry-attempt` > 1) is counted as one.
//!
//! A replica whose connection fails is taken out of placement and the request fails (502).

use std::{
    collections::VecDeque,
    convert::Infallible,
    net::SocketAddr,
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::{Request, Response, StatusCode, server::conn::http1, service::service_fn};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::{TokioExecutor, TokioIo},
};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use retry_after_client::{ClientOptions, Reporter, Rung, Subscription};
use tokio::{
    net::TcpListener,
    sync::{Notify, oneshot},
    task::JoinHandle,
};

/// Whether rejections carry a header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeaderPolicy {
    /// No `Retry-After`: clients back off on their own (the status quo).
    None,
    /// `Retry-After` from the agent's estimate, through the client library.
    FromAgent,
    /// The same, with the depth passed to it counting, besides the queue, the clients this
    /// proxy has told to come back whose time has not come yet (the retry backlog).
    FromAgentWithRetryBacklog,
}

/// How the proxy is set up.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// The service's name at the agent.
    pub service: String,
    /// The replicas and the most requests each takes at once.
    pub replicas: Vec<(SocketAddr, usize)>,
    /// The queue's bound.
    pub max_queued_requests: usize,
    /// Status of a rejection.
    pub status_code: u16,
    /// Whether rejections carry `Retry-After`.
    pub header: HeaderPolicy,
    /// Seed of the placement draws and the jitter draws.
    pub seed: u64,
}

/// One rejection, as the access log records it.
#[derive(Clone, Copy, Debug)]
pub struct Rejection {
    /// When, from the proxy's start.
    pub at: Duration,
    /// The queue depth then.
    pub queue_depth: usize,
    /// The backoff streak then.
    pub backoff_streak: u32,
    /// The suggested delay, if a header was sent.
    pub retry_after_s: Option<u64>,
    /// The ladder rung the answer came from.
    pub rung: Rung,
}

impl Rejection {
    /// Its access-log line (without newline).
    pub fn log_line(&self) -> String {
        let retry_after = self
            .retry_after_s
            .map_or_else(|| "-".to_owned(), |s| s.to_string());
        format!(
            "t={:.3} depth={} streak={} retry_after={} rung={}",
            self.at.as_secs_f64(),
            self.queue_depth,
            self.backoff_streak,
            retry_after,
            self.rung.as_str()
        )
    }
}

struct Backend {
    addr: SocketAddr,
    max_ongoing: usize,
    ongoing: AtomicUsize,
    up: AtomicBool,
}

struct State {
    config: ProxyConfig,
    started: Instant,
    backends: Vec<Backend>,
    queue: Mutex<VecDeque<oneshot::Sender<usize>>>,
    queued: Notify,
    streak: AtomicU32,
    subscription: Subscription,
    reporter: Reporter,
    rng: Mutex<StdRng>,
    rejections: Mutex<Vec<Rejection>>,
    /// When the clients told to come back are due (earliest first), for the retry backlog.
    due: Mutex<std::collections::BinaryHeap<std::cmp::Reverse<Instant>>>,
    client: Client<HttpConnector, Empty<Bytes>>,
}

/// A running proxy.
pub struct Proxy {
    addr: SocketAddr,
    state: Arc<State>,
    tasks: Vec<JoinHandle<()>>,
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

impl Proxy {
    /// Listen on a free loopback port, subscribed and reporting to the agent at
    /// `agent_socket`.
    pub async fn start(config: ProxyConfig, agent_socket: &Path) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let options = ClientOptions {
            status_code: config.status_code,
            ..ClientOptions::default()
        };
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let state = Arc::new(State {
            backends: config
                .replicas
                .iter()
                .map(|&(addr, max_ongoing)| Backend {
                    addr,
                    max_ongoing,
                    ongoing: AtomicUsize::new(0),
                    up: AtomicBool::new(true),
                })
                .collect(),
            started: Instant::now(),
            queue: Mutex::new(VecDeque::new()),
            queued: Notify::new(),
            streak: AtomicU32::new(0),
            subscription: Subscription::spawn(agent_socket, &config.service, options),
            reporter: Reporter::spawn(agent_socket, &config.service, Duration::from_millis(200)),
            rng: Mutex::new(StdRng::seed_from_u64(config.seed)),
            rejections: Mutex::new(Vec::new()),
            due: Mutex::new(std::collections::BinaryHeap::new()),
            client: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(60))
                .build(connector),
            config,
        });
        let accept = {
            let state = state.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let state = state.clone();
                    tokio::spawn(async move {
                        let service = service_fn(move |request| handle(state.clone(), request));
                        let _ = http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            })
        };
        let dispatch = tokio::spawn(dispatch(state.clone()));
        Ok(Self {
            addr,
            state,
            tasks: vec![accept, dispatch],
        })
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Idle capacity now: the sum over live replicas of their free share of
    /// `max_ongoing_requests` (2.0: two replicas' worth idle).
    pub fn idle_replicas(&self) -> f64 {
        self.state
            .backends
            .iter()
            .filter(|b| b.up.load(Ordering::Relaxed))
            .map(|b| {
                let ongoing = b.ongoing.load(Ordering::Relaxed).min(b.max_ongoing);
                (b.max_ongoing - ongoing) as f64 / b.max_ongoing as f64
            })
            .sum()
    }

    /// Every rejection so far, in order.
    pub fn rejections(&self) -> Vec<Rejection> {
        self.state
            .rejections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn reply(status: StatusCode, body: &'static [u8]) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from_static(body)).boxed());
    *response.status_mut() = status;
    response
}

async fn handle(
    state: Arc<State>,
    request: Request<hyper::body::Incoming>,
) -> Result<Response<Body>, Infallible> {
    let retry = request
        .headers()
        .get("x-retry-attempt")
        .and_then(|v| v.to_str().ok()?.parse::<u32>().ok())
        .is_some_and(|n| n > 1);
    let (tx, rx) = oneshot::channel();
    let full = {
        let mut queue = state.queue.lock().unwrap_or_else(|p| p.into_inner());
        if queue.len() >= state.config.max_queued_requests {
            Some(queue.len())
        } else {
            queue.push_back(tx);
            None
        }
    };
    if let Some(depth) = full {
        state.reporter.rejected(retry);
        return Ok(reject(&state, depth));
    }
    state.reporter.admitted(retry);
    state.queued.notify_one();
    let Ok(index) = rx.await else {
        return Ok(reply(StatusCode::SERVICE_UNAVAILABLE, b"proxy stopping\n"));
    };
    let backend = &state.backends[index];
    let uri = format!("http://{}/", backend.addr);
    let forwarded = Request::get(uri)
        .body(Empty::new())
        .expect("a valid request");
    let result = match state.client.request(forwarded).await {
        Ok(response) => response
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .ok(),
        Err(_) => None,
    };
    backend.ongoing.fetch_sub(1, Ordering::Relaxed);
    state.queued.notify_one();
    Ok(match result {
        Some(body) => Response::new(Full::new(body).boxed()),
        None => {
            backend.up.store(false, Ordering::Relaxed);
            reply(StatusCode::BAD_GATEWAY, b"replica failed\n")
        }
    })
}

/// The rejection of a request that found the queue at `depth`.
fn reject(state: &State, depth: usize) -> Response<Body> {
    let streak = state.streak.load(Ordering::Relaxed);
    let with_backlog = state.config.header == HeaderPolicy::FromAgentWithRetryBacklog;
    let mut due = state.due.lock().unwrap_or_else(|p| p.into_inner());
    let now = Instant::now();
    while due.peek().is_some_and(|d| d.0 <= now) {
        due.pop();
    }
    let counted = if with_backlog {
        depth + due.len()
    } else {
        depth
    };
    let decision = {
        let mut rng = state.rng.lock().unwrap_or_else(|p| p.into_inner());
        state
            .subscription
            .retry_after_with(Some(counted as u64), Some(streak), &mut *rng)
    };
    let (seconds, rung) = match state.config.header {
        HeaderPolicy::FromAgent | HeaderPolicy::FromAgentWithRetryBacklog => {
            (decision.seconds, decision.rung)
        }
        HeaderPolicy::None => (None, Rung::None),
    };
    if with_backlog && let Some(s) = seconds {
        due.push(std::cmp::Reverse(now + Duration::from_secs(s)));
    }
    drop(due);
    state
        .rejections
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Rejection {
            at: state.started.elapsed(),
            queue_depth: depth,
            backoff_streak: streak,
            retry_after_s: seconds,
            rung,
        });
    let status =
        StatusCode::from_u16(state.config.status_code).unwrap_or(StatusCode::TOO_MANY_REQUESTS);
    let mut response = reply(status, b"overloaded\n");
    if let Some(seconds) = seconds {
        response
            .headers_mut()
            .insert("retry-after", seconds.to_string().parse().expect("digits"));
    }
    response
}

/// Place queued requests on replicas, in order, by power of two choices; back off while
/// neither choice has room.
async fn dispatch(state: Arc<State>) {
    const BACKOFF_START: Duration = Duration::from_millis(25);
    const BACKOFF_MAX: Duration = Duration::from_millis(500);
    loop {
        let waiting = state.queue.lock().unwrap_or_else(|p| p.into_inner()).len();
        state
            .reporter
            .set_queue(waiting as u64, state.streak.load(Ordering::Relaxed));
        if waiting == 0 {
            state.queued.notified().await;
            continue;
        }
        let Some(index) = choose(&state) else {
            let streak = state.streak.fetch_add(1, Ordering::Relaxed) + 1;
            let backoff = BACKOFF_START
                .saturating_mul(1 << (streak - 1).min(5))
                .min(BACKOFF_MAX);
            tokio::time::sleep(backoff).await;
            continue;
        };
        state.streak.store(0, Ordering::Relaxed);
        let head = state
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_front();
        if let Some(waiter) = head {
            state.backends[index]
                .ongoing
                .fetch_add(1, Ordering::Relaxed);
            if waiter.send(index).is_err() {
                // The client went away while queued.
                state.backends[index]
                    .ongoing
                    .fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// Two live replicas at random; the one with fewer ongoing requests, if it has room.
fn choose(state: &State) -> Option<usize> {
    let live: Vec<usize> = (0..state.backends.len())
        .filter(|&i| state.backends[i].up.load(Ordering::Relaxed))
        .collect();
    let (a, b) = {
        let mut rng = state.rng.lock().unwrap_or_else(|p| p.into_inner());
        match live.len() {
            0 => return None,
            1 => (live[0], live[0]),
            n => {
                let a = rng.random_range(0..n);
                let b = (a + rng.random_range(1..n)) % n;
                (live[a], live[b])
            }
        }
    };
    let load = |i: usize| state.backends[i].ongoing.load(Ordering::Relaxed);
    let pick = if load(a) <= load(b) { a } else { b };
    (load(pick) < state.backends[pick].max_ongoing).then_some(pick)
}
