//! The reference rejecting proxy on tokio and hyper, around the [`Router`].
//!
//! * A request that finds the queue full is rejected at once with the configured status and,
//!   by the proxy's header policy, a `Retry-After` from the client library's subscription
//!   (computed with the proxy's own queue depth and backoff streak), and one access-log line.
//! * A dispatcher task polls the router: it places queued requests on replicas, and sleeps
//!   until the next arrival or completion, or through a placement backoff.
//! * Every admission and rejection is counted for the agent ([`Reporter`]); a request marked
//!   as a retry (`x-retry-attempt` > 1) is counted as one.
//!
//! A replica whose connection fails is taken out of placement, for good (until the proxy
//! restarts), and the request fails (502). The retry backlog holds one entry per client told
//! to come back, until its time (60 s at most): bounded by the rejection rate.

use std::{
    convert::Infallible,
    net::{IpAddr, SocketAddr},
    path::Path,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::{Request, Response, StatusCode, server::conn::http1, service::service_fn};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::{TokioExecutor, TokioIo},
};
use rand::{SeedableRng, rngs::StdRng};
use retry_after_client::{ClientOptions, Reporter, Rung, Subscription};
use tokio::{
    net::TcpListener,
    sync::{Notify, oneshot},
    task::JoinHandle,
};

use retry_after_policy::{
    KeptReturnsSettings, MAX_RETRY_AFTER_S, Placement, TicketBook, TicketCounters, TicketKey,
    give_place, told,
};

use crate::{
    kept::{Keeping, KeyFrom, Returning},
    router::{Arrival, Fleet, KeptArrival, RetryBacklog, Router, Wake},
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

/// How often the proxy reports what it did to the agent.
pub const REPORT_EVERY: Duration = Duration::from_millis(200);

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
    /// Whether a rejection with `Retry-After` carries `retry-after-ms` beside it: the same
    /// time in milliseconds (the answer's `millis`), which the OpenAI and Anthropic SDKs read
    /// first.
    pub retry_after_ms: bool,
    /// Seed of the placement draws and the jitter draws.
    pub seed: u64,
    /// Keep every rejection for [`Proxy::rejections`] (an evaluation's access log; memory
    /// grows with the rejections, so a long-running proxy leaves it off).
    pub record_rejections: bool,
    /// Keep the places rejections promise (kept returns), and how; `None`: answers are hints.
    pub keeping: Option<Keeping>,
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
    pub suggested_s: Option<u64>,
    /// The ladder rung the answer came from.
    pub rung: Rung,
}

impl Rejection {
    /// Its access-log line (without newline).
    pub fn log_line(&self) -> String {
        let retry_after = self
            .suggested_s
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

/// What the handlers and the dispatcher share, under one lock.
struct Routing {
    fleet: Fleet,
    router: Router<oneshot::Sender<usize>>,
    backlog: RetryBacklog,
    /// The places kept (kept returns), and its counters as last reported.
    book: TicketBook,
    reported_tickets: TicketCounters,
    /// The jitter draws.
    rng: StdRng,
}

struct State {
    config: ProxyConfig,
    started: Instant,
    routing: Mutex<Routing>,
    queued: Notify,
    subscription: Subscription,
    reporter: Reporter,
    rejections: Mutex<Vec<Rejection>>,
    client: Client<HttpConnector, Empty<Bytes>>,
}

impl State {
    fn routing(&self) -> MutexGuard<'_, Routing> {
        self.routing.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The seed of a proxy's jitter draws, from its configured seed (the placement draws use the
/// seed itself).
pub fn jitter_seed(seed: u64) -> u64 {
    seed ^ 0x6a17_7e75
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
        Self::serve(listener, config, agent_socket)
    }

    /// Serve on `listener`, subscribed and reporting to the agent at `agent_socket`, until
    /// dropped. Must be called within a tokio runtime.
    pub fn serve(
        listener: TcpListener,
        config: ProxyConfig,
        agent_socket: &Path,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let options = ClientOptions {
            status_code: config.status_code,
            ..ClientOptions::default()
        };
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let routing = Routing {
            fleet: Fleet::new(config.replicas.iter().map(|r| r.1)),
            router: Router::new(config.max_queued_requests, config.seed),
            backlog: RetryBacklog::default(),
            book: TicketBook::new(config.keeping.as_ref().map_or(
                KeptReturnsSettings {
                    max_keys: 0,
                    horizon_s: 0,
                    ..KeptReturnsSettings::default()
                },
                |k| k.settings,
            )),
            reported_tickets: TicketCounters::default(),
            rng: StdRng::seed_from_u64(jitter_seed(config.seed)),
        };
        let state = Arc::new(State {
            started: Instant::now(),
            routing: Mutex::new(routing),
            queued: Notify::new(),
            subscription: Subscription::spawn(agent_socket, &config.service, options),
            reporter: Reporter::spawn(agent_socket, &config.service, REPORT_EVERY),
            rejections: Mutex::new(Vec::new()),
            client: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(60))
                .build(connector),
            config,
        });
        let accept = {
            let state = state.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((stream, peer)) = listener.accept().await else {
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let state = state.clone();
                    tokio::spawn(async move {
                        let service =
                            service_fn(move |request| handle(state.clone(), peer.ip(), request));
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
        self.state.routing().fleet.idle_replicas()
    }

    /// Requests waiting in the queue.
    pub fn queue_depth(&self) -> usize {
        self.state.routing().router.queue_depth()
    }

    /// Take replica `index` out of placement, or put it in (an added replica).
    pub fn set_replica_up(&self, index: usize, up: bool) {
        self.state.routing().fleet.set_up(index, up);
        self.state.queued.notify_one();
    }

    /// Every rejection so far, in order (empty unless `record_rejections`).
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
    peer: IpAddr,
    request: Request<hyper::body::Incoming>,
) -> Result<Response<Body>, Infallible> {
    let retry = request
        .headers()
        .get("x-retry-attempt")
        .and_then(|v| v.to_str().ok()?.parse::<u32>().ok())
        .is_some_and(|n| n > 1);
    let (tx, rx) = oneshot::channel();
    if let Some(keeping) = &state.config.keeping {
        if let Some(rejection) = arrive_kept(&state, keeping, request.headers(), peer, tx) {
            state.reporter.rejected(retry);
            return Ok(rejection);
        }
    } else {
        // Bound first: a guard in the `if let` scrutinee would live through the block, and
        // `reject` takes the routing lock again.
        let arrival = state.routing().router.arrive(tx);
        if let Arrival::Rejected {
            queue_depth,
            backoff_streak,
        } = arrival
        {
            state.reporter.rejected(retry);
            return Ok(reject(&state, queue_depth, backoff_streak));
        }
    }
    state.reporter.admitted(retry);
    state.queued.notify_one();
    let Ok(index) = rx.await else {
        return Ok(reply(StatusCode::SERVICE_UNAVAILABLE, b"proxy stopping\n"));
    };
    // Frees the replica's place however this handler ends: answered, failed, or dropped when
    // the client goes away mid-request.
    let mut placed = Placed {
        state: &state,
        index,
        failed: false,
    };
    let uri = format!("http://{}/", state.config.replicas[index].0);
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
    placed.failed = result.is_none();
    drop(placed);
    Ok(match result {
        Some(body) => Response::new(Full::new(body).boxed()),
        None => reply(StatusCode::BAD_GATEWAY, b"replica failed\n"),
    })
}

/// A request's place on a replica, given back when dropped; a failed request takes the
/// replica out of placement (until the proxy restarts).
struct Placed<'a> {
    state: &'a State,
    index: usize,
    failed: bool,
}

impl Drop for Placed<'_> {
    fn drop(&mut self) {
        {
            let mut routing = self.state.routing();
            routing.fleet.complete(self.index);
            if self.failed {
                routing.fleet.set_up(self.index, false);
            }
        }
        self.state.queued.notify_one();
    }
}

/// A request arrives at a proxy that keeps returns: queued (`None`), or the rejection to send,
/// with the time left to its place, a new place, or (no place can be given) the hint.
fn arrive_kept(
    state: &State,
    keeping: &Keeping,
    headers: &hyper::HeaderMap,
    peer: IpAddr,
    waiter: oneshot::Sender<usize>,
) -> Option<Response<Body>> {
    let service = &state.config.service;
    let KeptRequest {
        returning,
        source,
        deadline,
    } = kept_request(keeping, service, headers, peer);
    let (drain_rate, clamp) = state
        .subscription
        .drain_and_clamp()
        .unwrap_or((None, (1, MAX_RETRY_AFTER_S)));
    let now = unix_now();
    let now_s = now.as_secs();
    let mut routing = state.routing();
    let Routing {
        router, book, rng, ..
    } = &mut *routing;
    let arrival = router.arrive_kept(waiter, returning, book, now_s, drain_rate);
    let (depth, streak) = match arrival {
        KeptArrival::Returned | KeptArrival::Queued => {
            report_tickets(state, &mut routing);
            drop(routing);
            state.queued.notify_one();
            return None;
        }
        KeptArrival::Early { due } => {
            let seconds = told(due, now_s, clamp).seconds;
            report_tickets(state, &mut routing);
            drop(routing);
            return Some(rejection(state, 0, 0, kept_answer(seconds), None));
        }
        KeptArrival::Rejected {
            queue_depth,
            backoff_streak,
        } => (queue_depth, backoff_streak),
    };
    // A header key is the client's own; a cookie's is a new nonce. No key: a hint.
    let key = match (&keeping.key_from, returning) {
        (KeyFrom::Header(_), Some(r)) => r.key,
        (KeyFrom::Header(_), None) => {
            drop(routing);
            return Some(reject(state, depth, streak));
        }
        (KeyFrom::Cookie(_), _) => TicketKey(rand::RngExt::random(rng)),
    };
    let elapsed = f64::from(now.subsec_millis()) / 1000.0;
    // Before the drain rate is known, the hint's second, if it is the agent's (a fresh
    // estimate: computed, or the agent's own fallback while its drain rate warms).
    let hint = || {
        state
            .subscription
            .retry_after_with(Some(depth as u64), Some(streak), rng)
            .hint()
    };
    let place = give_place(
        book,
        key,
        source,
        now_s,
        elapsed,
        depth as u64,
        drain_rate,
        clamp,
        deadline,
        hint,
    );
    report_tickets(state, &mut routing);
    drop(routing);
    Some(answer_place(
        state,
        keeping,
        place,
        (depth, streak),
        key,
        now,
    ))
}

/// What a request says to the kept-returns book: the place it may return to, the source it
/// comes from, and how long it may wait.
struct KeptRequest {
    returning: Option<Returning>,
    source: Option<TicketKey>,
    deadline: Option<u64>,
}

/// Read [`KeptRequest`] from a request's `headers` and its connection's `peer`, as `keeping`
/// says where each is found.
fn kept_request(
    keeping: &Keeping,
    service: &str,
    headers: &hyper::HeaderMap,
    peer: IpAddr,
) -> KeptRequest {
    let named = |name: Option<&String>| {
        name.and_then(|n| headers.get(n.as_str()))
            .map(|v| v.as_bytes())
    };
    let header = match &keeping.key_from {
        KeyFrom::Header(name) => named(Some(name)),
        KeyFrom::Cookie(_) => None,
    };
    let cookie = headers
        .get(hyper::header::COOKIE)
        .and_then(|v| v.to_str().ok());
    KeptRequest {
        returning: keeping.returning(service, header, cookie),
        source: keeping.source(named(keeping.source_header.as_ref()), peer),
        deadline: keeping.deadline(named(keeping.deadline_header.as_ref())),
    }
}

/// The rejection that tells a client of `key`, rejected at `(depth, streak)` at `now`, where
/// `place` put it: its kept place (with a return cookie for cookie keys), the place beyond its
/// deadline with `x-should-retry: false`, or the hint alone.
fn answer_place(
    state: &State,
    keeping: &Keeping,
    place: Placement,
    (depth, streak): (usize, u32),
    key: TicketKey,
    now: Duration,
) -> Response<Body> {
    let place = match place {
        Placement::Kept(place) => place,
        Placement::HintAlone => return reject(state, depth, streak),
        Placement::BeyondDeadline(place) => {
            let mut response = rejection(state, depth, streak, kept_answer(place.seconds), None);
            response.headers_mut().insert(
                "x-should-retry",
                hyper::header::HeaderValue::from_static("false"),
            );
            return response;
        }
    };
    let cookie = keeping.set_cookie(&state.config.service, &place, key.0, now.as_secs());
    rejection(state, depth, streak, kept_answer(place.seconds), cookie)
}

/// The answer that tells a client its kept place, `seconds` away: a place is a whole second,
/// and the seconds told bring the client back within it, so its milliseconds are the same
/// time.
fn kept_answer(seconds: u64) -> Answered {
    Answered {
        seconds: Some(seconds),
        millis: Some(seconds.saturating_mul(1000)),
        rung: Rung::Computed,
    }
}

/// Hand the book's counters since the last report to the reporter.
fn report_tickets(state: &State, routing: &mut Routing) {
    let now = routing.book.counters();
    state
        .reporter
        .tickets(&now.since(&routing.reported_tickets));
    routing.reported_tickets = now;
}

/// Time on the wall clock, the books' clock: cookies carry it from proxy to proxy.
fn unix_now() -> Duration {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
}

/// The rejection of a request that found the queue at `depth` with placement at `streak`.
fn reject(state: &State, depth: usize, streak: u32) -> Response<Body> {
    let with_backlog = state.config.header == HeaderPolicy::FromAgentWithRetryBacklog;
    let answered = {
        let mut routing = state.routing();
        let now = Instant::now();
        let counted = if with_backlog {
            depth + routing.backlog.outstanding(now)
        } else {
            depth
        };
        let decision = state.subscription.retry_after_with(
            Some(counted as u64),
            Some(streak),
            &mut routing.rng,
        );
        let answered = match state.config.header {
            HeaderPolicy::FromAgent | HeaderPolicy::FromAgentWithRetryBacklog => Answered {
                seconds: decision.seconds,
                millis: decision.millis,
                rung: decision.rung,
            },
            HeaderPolicy::None => Answered {
                seconds: None,
                millis: None,
                rung: Rung::None,
            },
        };
        if with_backlog && let Some(s) = answered.seconds {
            routing.backlog.promise(now + Duration::from_secs(s));
        }
        answered
    };
    rejection(state, depth, streak, answered, None)
}

/// What a rejection tells the client: seconds (`None`: no header), the same in milliseconds,
/// and the rung it came from.
struct Answered {
    seconds: Option<u64>,
    millis: Option<u64>,
    rung: Rung,
}

/// The response to a rejection that carries `answered` and, for a place kept by cookie,
/// `set_cookie`; counted and logged.
fn rejection(
    state: &State,
    depth: usize,
    streak: u32,
    Answered {
        seconds,
        millis,
        rung,
    }: Answered,
    set_cookie: Option<String>,
) -> Response<Body> {
    state.reporter.handed_out(rung, seconds.unwrap_or(0));
    let rejection = Rejection {
        at: state.started.elapsed(),
        queue_depth: depth,
        backoff_streak: streak,
        suggested_s: seconds,
        rung,
    };
    tracing::debug!(line = %rejection.log_line(), "rejected");
    if state.config.record_rejections {
        state
            .rejections
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(rejection);
    }
    let status =
        StatusCode::from_u16(state.config.status_code).unwrap_or(StatusCode::TOO_MANY_REQUESTS);
    let mut response = reply(status, b"overloaded\n");
    if let Some(seconds) = seconds {
        let headers = response.headers_mut();
        headers.insert("retry-after", seconds.to_string().parse().expect("digits"));
        if state.config.retry_after_ms
            && let Some(millis) = millis
        {
            headers.insert(
                "retry-after-ms",
                millis.to_string().parse().expect("digits"),
            );
        }
    }
    if let Some(value) = set_cookie.and_then(|c| c.parse().ok()) {
        response
            .headers_mut()
            .insert(hyper::header::SET_COOKIE, value);
    }
    response
}

/// Poll the router: hand placed requests to their handlers, then sleep until an arrival or a
/// completion, or through a placement backoff.
async fn dispatch(state: Arc<State>) {
    let mut placed = Vec::new();
    loop {
        let (wake, depth, streak) = {
            let mut routing = state.routing();
            let Routing { fleet, router, .. } = &mut *routing;
            let wake = router.poll(Instant::now(), fleet, &mut placed);
            (wake, router.queue_depth(), router.backoff_streak())
        };
        state.reporter.set_queue(depth as u64, streak);
        for (waiter, index) in placed.drain(..) {
            if waiter.send(index).is_err() {
                // The client went away while queued.
                state.routing().fleet.complete(index);
            }
        }
        match wake {
            Wake::OnArrival => state.queued.notified().await,
            Wake::At(at) => tokio::time::sleep_until(at.into()).await,
        }
    }
}
