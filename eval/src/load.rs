//! The load generator: open-loop arrivals, and clients that come back after a rejection.
//!
//! New clients arrive by a Poisson process whose rate follows a schedule of phases, drawn in
//! advance from the seed, so every policy sees the same arrivals. Each client sends its
//! request until it succeeds or has made `max_attempts` attempts:
//!
//! * [`Behaviour::HonourRetryAfter`]: after a rejection with `Retry-After: N`, it waits exactly
//!   N seconds; without the header it backs off as below;
//! * [`Behaviour::HonourCapped`]: the same, but it waits no longer than its cap (a client
//!   whose SDK limits the wait);
//! * [`Behaviour::HonourUpTo`]: the same up to its limit; a longer value is ignored and it
//!   backs off as without a header (the SDKs that fall back to their own backoff);
//! * [`Behaviour::HonourWithin`]: a client with a deadline: it waits the `Retry-After` while
//!   the retry falls within its deadline (from its first attempt) and gives up at once when it
//!   would not; every attempt says the seconds it has left ([`DEADLINE_HEADER`]), and it stops
//!   when told not to retry (`x-should-retry: false`, as the OpenAI and Anthropic SDKs do);
//! * [`Behaviour::Backoff`]: it ignores the header and backs off exponentially with full
//!   jitter (a uniform draw up to `base × 2^(attempt−1)`, capped): the status quo.
//!
//! Each client's behaviour is drawn from the scenario's mix.
//!
//! Every attempt is recorded; while a client waits to retry it is counted in
//! [`Load::waiting`].

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicI64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use rand::{RngExt, SeedableRng, rngs::StdRng};

/// A stretch of the schedule: new clients at `rate` per second for `seconds`, or at a rate
/// going linearly from `rate` to `ramp_to`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Phase {
    /// Length.
    pub seconds: f64,
    /// New clients per second (at the start, if it ramps).
    pub rate: f64,
    /// New clients per second at the end, if the rate ramps.
    pub ramp_to: Option<f64>,
}

/// What a client does after a rejection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behaviour {
    /// Wait exactly the `Retry-After`; back off (as `Backoff`) when there is none.
    HonourRetryAfter,
    /// Wait the `Retry-After` but never longer than this many seconds; back off when there is
    /// none.
    HonourCapped(u64),
    /// Wait the `Retry-After` when it is at most this many seconds; a longer one is ignored,
    /// and the client backs off as without a header (the Anthropic Python and OpenAI Node SDKs
    /// at 60 s, the OpenAI Python SDK before 2.52: docs/integrations/clients.md).
    HonourUpTo(u64),
    /// Wait the `Retry-After` while the retry falls within this many seconds of the first
    /// attempt; give up at once when it would not, or when told not to retry. Back off when
    /// there is no header.
    HonourWithin(u64),
    /// Ignore any header; back off exponentially with full jitter.
    Backoff,
}

impl Behaviour {
    /// Whether a client of this behaviour may not wait the `Retry-After` it is told.
    pub fn ignores_header(self) -> bool {
        !matches!(
            self,
            Behaviour::HonourRetryAfter | Behaviour::HonourWithin(_)
        )
    }

    /// The seconds a client of this behaviour has left `since_first` its first attempt, as
    /// its requests say them ([`DEADLINE_HEADER`]): `None` for a client without a deadline.
    pub fn deadline_left(self, since_first: Duration) -> Option<u64> {
        match self {
            Behaviour::HonourWithin(d) => Some(d.saturating_sub(since_first.as_secs())),
            _ => None,
        }
    }

    /// Whether a client rejected `since_first` its first attempt gives up rather than wait
    /// `wait`: its retry would fall past its deadline, or it was told not to retry.
    pub fn gives_up(self, since_first: Duration, wait: Duration, told_not_to_retry: bool) -> bool {
        match self {
            Behaviour::HonourWithin(d) => {
                told_not_to_retry || since_first + wait > Duration::from_secs(d)
            }
            _ => false,
        }
    }

    /// How long to wait after the rejection of attempt `number` that suggested
    /// `suggested_s`, with `u` a uniform draw from [0, 1) for the backoff's jitter; and the
    /// suggested delay if the wait is exactly it (a retry at the suggested time).
    pub fn wait(self, suggested_s: Option<u64>, number: u32, u: f64) -> (Duration, Option<u64>) {
        match (self, suggested_s) {
            (Behaviour::HonourRetryAfter, Some(s)) => (Duration::from_secs(s), Some(s)),
            (Behaviour::HonourCapped(cap), Some(s)) if s <= cap => {
                (Duration::from_secs(s), Some(s))
            }
            (Behaviour::HonourCapped(cap), Some(_)) => (Duration::from_secs(cap), None),
            (Behaviour::HonourUpTo(limit), Some(s)) if s <= limit => {
                (Duration::from_secs(s), Some(s))
            }
            (Behaviour::HonourWithin(_), Some(s)) => (Duration::from_secs(s), Some(s)),
            _ => {
                let bound = BACKOFF_BASE
                    .saturating_mul(1 << (number - 1).min(10))
                    .min(BACKOFF_CAP);
                (bound.mul_f64(u), None)
            }
        }
    }
}

/// First backoff bound of a client without a header (doubles per attempt).
pub const BACKOFF_BASE: Duration = Duration::from_millis(500);
/// Largest backoff bound.
pub const BACKOFF_CAP: Duration = Duration::from_secs(30);

/// How one attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Served (200).
    Served,
    /// Rejected by the proxy (its status code), with the suggested delay if a header came.
    Rejected {
        /// `Retry-After` in seconds, if sent.
        suggested_s: Option<u64>,
        /// The rejection said not to retry (`x-should-retry: false`).
        told_not_to_retry: bool,
    },
    /// Anything else: a failed replica (502), a broken connection, a timeout.
    Failed,
}

/// One attempt of one client.
#[derive(Clone, Copy, Debug)]
pub struct Attempt {
    /// The client (its arrival's index).
    pub client: usize,
    /// 1 for the first attempt.
    pub number: u32,
    /// When it was sent, from the load's start.
    pub sent: Duration,
    /// When its answer came.
    pub answered: Duration,
    /// How it ended.
    pub outcome: Outcome,
    /// The delay the previous attempt's rejection suggested, if it carried one (this attempt
    /// was then sent that long after it).
    pub after_suggested_s: Option<u64>,
    /// The client gave up after this rejection, before its last attempt: its retry would have
    /// fallen past its deadline, or it was told not to retry.
    pub gave_up_after: bool,
}

/// A load run in progress.
pub struct Load {
    /// Clients waiting to retry now.
    pub waiting: Arc<AtomicI64>,
    attempts: Arc<Mutex<Vec<Attempt>>>,
    done: Arc<AtomicUsize>,
    clients: usize,
    started: Instant,
}

/// Arrival times (from the start) of a Poisson process following `phases`.
pub fn arrivals(phases: &[Phase], seed: u64) -> Vec<Duration> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut times = Vec::new();
    let mut phase_start = 0.0;
    for phase in phases {
        let mut t = phase_start;
        if let Some(to) = phase.ramp_to {
            // Thinning: candidates at the phase's highest rate, each kept with the share of
            // it the rate has at that moment.
            let top = phase.rate.max(to);
            if top > 0.0 {
                loop {
                    let u: f64 = rng.random();
                    t += -(1.0 - u).ln() / top;
                    if t >= phase_start + phase.seconds {
                        break;
                    }
                    let rate = phase.rate + (to - phase.rate) * (t - phase_start) / phase.seconds;
                    if rng.random::<f64>() * top < rate {
                        times.push(Duration::from_secs_f64(t));
                    }
                }
            }
        } else if phase.rate > 0.0 {
            loop {
                let u: f64 = rng.random();
                t += -(1.0 - u).ln() / phase.rate;
                if t >= phase_start + phase.seconds {
                    break;
                }
                times.push(Duration::from_secs_f64(t));
            }
        }
        phase_start += phase.seconds;
    }
    times
}

/// The header every attempt of a client carries its own key in (`client-<index>`): what a
/// proxy keeping returns by key recognises it by (an API key, in real traffic).
pub const CLIENT_KEY_HEADER: &str = "x-client-key";

/// The header a client with a deadline says the seconds it has left in: what a proxy that
/// honours deadlines reads (its `deadline_header`).
pub const DEADLINE_HEADER: &str = "x-request-timeout";

/// One attempt of client `client` (its `number`, in the `x-retry-attempt` header; its key;
/// the seconds it has left, if it has a deadline; the return cookie it holds, as a cookie jar
/// would send it): served, rejected with the `Retry-After` it carried, or failed (another
/// status, an error, 120 s without an answer). A cookie the answer sets replaces `cookie`.
async fn attempt(
    http: &Client<HttpConnector, Empty<Bytes>>,
    url: &str,
    (client, number, deadline_left): (usize, u32, Option<u64>),
    cookie: &mut Option<String>,
) -> Outcome {
    let mut request = Request::get(url)
        .header("x-retry-attempt", number.to_string())
        .header(CLIENT_KEY_HEADER, format!("client-{client}"));
    if let Some(left) = deadline_left {
        request = request.header(DEADLINE_HEADER, left.to_string());
    }
    if let Some(cookie) = cookie.as_deref() {
        request = request.header(hyper::header::COOKIE, cookie);
    }
    let request = request.body(Empty::new()).expect("a valid request");
    let Ok(Ok(response)) =
        tokio::time::timeout(Duration::from_secs(120), http.request(request)).await
    else {
        return Outcome::Failed;
    };
    let status = response.status().as_u16();
    let header = |name| response.headers().get(name).and_then(|v| v.to_str().ok());
    let suggested_s = header(hyper::header::RETRY_AFTER).and_then(|v| v.parse().ok());
    let told_not_to_retry =
        header(hyper::header::HeaderName::from_static("x-should-retry")) == Some("false");
    if let Some(set) = header(hyper::header::SET_COOKIE) {
        // The name=value pair, as a cookie jar sends it back (attributes dropped).
        *cookie = set.split(';').next().map(str::to_owned);
    }
    let body = response.into_body().collect().await;
    match (status, body) {
        (200, Ok(_)) => Outcome::Served,
        (429 | 503, _) => Outcome::Rejected {
            suggested_s,
            told_not_to_retry,
        },
        _ => Outcome::Failed,
    }
}

impl Load {
    /// Start the clients of `arrivals` (each with its behaviour) against `target`, the
    /// proxy. Returns at once; each client runs in its own task.
    pub fn start(
        target: SocketAddr,
        arrivals: Vec<(Duration, Behaviour)>,
        max_attempts: u32,
        seed: u64,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let http: Client<HttpConnector, Empty<Bytes>> = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        let load = Self {
            waiting: Arc::new(AtomicI64::new(0)),
            attempts: Arc::new(Mutex::new(Vec::new())),
            done: Arc::new(AtomicUsize::new(0)),
            clients: arrivals.len(),
            started: Instant::now(),
        };
        let url = format!("http://{target}/");
        for (client, (at, behaviour)) in arrivals.into_iter().enumerate() {
            let url = url.clone();
            let http = http.clone();
            let attempts = load.attempts.clone();
            let waiting = load.waiting.clone();
            let done = Finished(load.done.clone());
            let started = load.started;
            let seed = crate::seeds::client(seed, client);
            tokio::spawn(async move {
                let _done = done;
                tokio::time::sleep_until((started + at).into()).await;
                let mut rng = StdRng::seed_from_u64(seed);
                let mut after_suggested_s = None;
                let mut cookie = None;
                let first = started.elapsed();
                for number in 1..=max_attempts {
                    let sent = started.elapsed();
                    let left = behaviour.deadline_left(sent - first);
                    let outcome = attempt(&http, &url, (client, number, left), &mut cookie).await;
                    let answered = started.elapsed();
                    // After a rejection, and not the last attempt: how long to wait, or give up.
                    let next = match outcome {
                        Outcome::Rejected {
                            suggested_s,
                            told_not_to_retry,
                        } if number < max_attempts => {
                            let (delay, honoured) =
                                behaviour.wait(suggested_s, number, rng.random());
                            let gives_up =
                                behaviour.gives_up(answered - first, delay, told_not_to_retry);
                            Some((delay, honoured, gives_up))
                        }
                        _ => None,
                    };
                    attempts
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(Attempt {
                            client,
                            number,
                            sent,
                            answered,
                            outcome,
                            after_suggested_s,
                            gave_up_after: next.is_some_and(|(_, _, gives_up)| gives_up),
                        });
                    let Some((delay, honoured, false)) = next else {
                        return;
                    };
                    after_suggested_s = honoured;
                    waiting.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(delay).await;
                    waiting.fetch_sub(1, Ordering::Relaxed);
                }
            });
        }
        load
    }

    /// Clients started (all arrivals, including those still to come).
    pub fn clients(&self) -> usize {
        self.clients
    }

    /// When the load started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Every attempt recorded so far.
    pub fn attempts(&self) -> Vec<Attempt> {
        self.attempts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Clients not finished yet (still to arrive, waiting, or in an attempt).
    pub fn unfinished(&self) -> usize {
        self.clients - self.done.load(Ordering::Relaxed)
    }

    /// True once every client has finished (succeeded, given up or failed).
    pub fn finished(&self) -> bool {
        self.unfinished() == 0
    }
}

/// Counts a client as finished when its task ends, however it ends.
struct Finished(Arc<AtomicUsize>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}
