//! Client library for rejecting proxies.
//!
//! The reject path must stay as cheap as it is without us: no RPC, no lock, no wait. So a
//! proxy keeps a [`Subscription`] per service: a background task holds a connection to the
//! agent, receives the service's estimate every tick, and stores it. On a rejection,
//! [`Subscription::retry_after`] reads the stored estimate (one atomic load), applies the
//! per-rejection jitter, the clamp and the fallback ladder locally, and returns, never awaiting.
//! When the agent is gone, the last estimate is used until it is older than the staleness
//! limit, then the static value; the task reconnects by itself, with backoff.
//!
//! [`query`] is the one-shot alternative: a synchronous round trip with a hard time bound that
//! falls back to the static value on any failure.
//!
//! # Examples
//!
//! ```no_run
//! # async fn example() {
//! use retry_after_client::{ClientOptions, Subscription};
//!
//! let options = ClientOptions { retry_after_s: Some(5), ..ClientOptions::default() };
//! let chat = Subscription::spawn("/run/retry-after-agent/agent.sock", "chat", options);
//! // On each rejection:
//! let decision = chat.retry_after(&mut rand::rng());
//! if let Some(seconds) = decision.seconds {
//!     // respond 429 with `Retry-After: {seconds}`
//! }
//! # }
//! ```

use std::{
    io::{Read, Write},
    os::unix::net::UnixStream as StdUnixStream,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

mod own_returns;
mod report;

use arc_swap::ArcSwapOption;
pub use own_returns::OwnReturns;
pub use report::Reporter;
pub use retry_after_protocol::policy::{FallbackReason, Hint, Rung};
use retry_after_protocol::{
    EstimatePush, HealthResponse, MAX_RESPONSE_LEN, QueryResponse, Request, Response, Schedule,
    StatusResponse,
};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader as AsyncBufReader},
    net::UnixStream,
    task::JoinHandle,
};

/// How a subscription behaves.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Used when no fresh estimate is available; `None`: no header then.
    pub retry_after_s: Option<u64>,
    /// Status to reject with before any estimate has arrived (429); afterwards the service's
    /// configured status is used, even when the estimate is stale.
    pub status_code: u16,
    /// An estimate older than this is not used (default 5 s: five agent ticks).
    pub stale_after: Duration,
    /// First reconnect delay (default 100 ms); doubles up to `reconnect_max`.
    pub reconnect_min: Duration,
    /// Longest reconnect delay (default 5 s).
    pub reconnect_max: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            retry_after_s: None,
            status_code: 429,
            stale_after: Duration::from_secs(5),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
        }
    }
}

/// The answer for one rejection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// `Retry-After` in delta-seconds; `None`: send no header.
    pub seconds: Option<u64>,
    /// The same in milliseconds, for `retry-after-ms`.
    pub millis: Option<u64>,
    /// The ladder rung it came from (`static` also when no fresh estimate is held).
    pub rung: Rung,
    /// Why it is not computed, if it is not (`None` also for this client's own fallback
    /// when no fresh estimate is held).
    pub reason: Option<FallbackReason>,
    /// The status code to reject with.
    pub status_code: u16,
}

impl Decision {
    /// As a kept-returns hint (`None` without a header): fresh when it is the agent's answer,
    /// computed or the agent's own fallback (which names its reason), not this client's
    /// static value for want of a fresh estimate.
    pub fn hint(&self) -> Option<Hint> {
        self.seconds.map(|seconds| Hint {
            seconds,
            fresh: self.rung == Rung::Computed || self.reason.is_some(),
        })
    }
}

struct Held {
    push: EstimatePush,
    received: Instant,
}

/// A live subscription to one service's estimate.
pub struct Subscription {
    held: Arc<ArcSwapOption<Held>>,
    options: ClientOptions,
    task: JoinHandle<()>,
    /// The returns this subscriber promised (`scheduled_returns`), on a clock from `epoch`.
    own: OwnReturns,
    epoch: Instant,
}

impl Subscription {
    /// Start following `service` on the agent at `socket`. Must be called within a tokio
    /// runtime; the background task runs until the subscription is dropped.
    pub fn spawn(socket: impl AsRef<Path>, service: &str, options: ClientOptions) -> Self {
        let held = Arc::new(ArcSwapOption::empty());
        let task = tokio::spawn(follow(
            socket.as_ref().to_path_buf(),
            service.to_owned(),
            held.clone(),
            options.clone(),
        ));
        Self {
            held,
            options,
            task,
            own: OwnReturns::default(),
            epoch: Instant::now(),
        }
    }

    /// The Retry-After for one rejection, from the agent's queue depth. Never blocks.
    pub fn retry_after(&self, rng: &mut impl rand::Rng) -> Decision {
        self.retry_after_with(None, None, rng)
    }

    /// The Retry-After for one rejection, computed with the proxy's own queue depth and
    /// backoff streak where given: exactly what the agent would answer to
    /// `QUERY <service> queue_depth= backoff_streak=` with the same jitter draw and schedule.
    /// Never blocks: one atomic load, one random draw and the formula; with
    /// `scheduled_returns`, also a read of this proxy's own promises and one atomic add for
    /// the new one.
    pub fn retry_after_with(
        &self,
        queue_depth: Option<u64>,
        backoff_streak: Option<u32>,
        rng: &mut impl rand::Rng,
    ) -> Decision {
        let guard = self.held.load();
        let Some(held) = guard.as_ref() else {
            return self.fallback(self.options.status_code);
        };
        // One clock read: the estimate's age and, for the schedule, the time now.
        let now = Instant::now();
        if now.saturating_duration_since(held.received) > self.options.stale_after {
            return self.fallback(held.push.status_code);
        }
        let jitter_draw: f64 = rand::RngExt::random(rng);
        self.own.decide(
            &held.push,
            held.received.saturating_duration_since(self.epoch),
            now.saturating_duration_since(self.epoch),
            (queue_depth, backoff_streak),
            jitter_draw,
        )
    }

    /// What a proxy keeping returns places them with: the held estimate's drain rate (if it
    /// is warm) and its clamp, or `None` without a fresh estimate. Never blocks.
    pub fn drain_and_clamp(&self) -> Option<(Option<f64>, (u64, u64))> {
        let guard = self.held.load();
        let held = guard.as_ref()?;
        if held.received.elapsed() > self.options.stale_after {
            return None;
        }
        Some((held.push.drain_rate, held.push.constants.clamp()))
    }

    /// Returns promised by this subscriber that its schedule could not hold (none in
    /// practice: a bin holds 4 billion).
    pub fn returns_dropped(&self) -> u64 {
        self.own.dropped()
    }

    /// Age of the estimate held, if any.
    pub fn age(&self) -> Option<Duration> {
        self.held
            .load()
            .as_ref()
            .map(|held| held.received.elapsed())
    }

    /// This client's own static answer, with the service's status code if known.
    fn fallback(&self, status_code: u16) -> Decision {
        let seconds = self.options.retry_after_s;
        Decision {
            seconds,
            millis: seconds.map(|s| s.saturating_mul(1000)),
            rung: if seconds.is_some() {
                Rung::Static
            } else {
                Rung::None
            },
            reason: None,
            status_code,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The answer to one rejection from a pushed estimate: the shared ladder
/// ([`EstimatePush::answer`]) with the proxy's own depth and streak where given, `schedule`
/// as the promised returns and the overload's age (see [`EstimatePush::schedule`]; read by
/// `scheduled_returns` only), and `jitter_draw`, a uniform draw from [0, 1), for the jitter.
pub fn decide(
    push: &EstimatePush,
    queue_depth: Option<u64>,
    backoff_streak: Option<u32>,
    schedule: &Schedule,
    jitter_draw: f64,
) -> Decision {
    let answer = push.answer(queue_depth, backoff_streak, schedule, jitter_draw);
    Decision {
        seconds: answer.seconds,
        millis: answer.millis,
        rung: answer.rung,
        reason: answer.reason,
        status_code: push.status_code,
    }
}

/// Keep a subscription alive: connect, subscribe, store every push; on any failure wait
/// (doubling, bounded, jittered so that proxies do not reconnect in lockstep after an agent
/// restart) and start again.
async fn follow(
    socket: PathBuf,
    service: String,
    held: Arc<ArcSwapOption<Held>>,
    options: ClientOptions,
) {
    let mut delay = options.reconnect_min;
    loop {
        match subscribe_once(&socket, &service, &held, &options).await {
            Ok(()) => delay = options.reconnect_min,
            Err(error) => {
                tracing::debug!(%error, socket = %socket.display(), "retry-after subscription lost")
            }
        }
        let jitter: f64 = rand::RngExt::random_range(&mut rand::rng(), 0.5..1.5);
        tokio::time::sleep(delay.mul_f64(jitter)).await;
        delay = (delay * 2).min(options.reconnect_max);
    }
}

/// One subscription, until the connection fails. Connecting is bounded by `stale_after`, and
/// so is the wait for each push: an agent that stops (SIGSTOP, a full backlog) is left for a
/// new connection instead of being waited on for ever. Lines are bounded.
async fn subscribe_once(
    socket: &Path,
    service: &str,
    held: &ArcSwapOption<Held>,
    options: &ClientOptions,
) -> Result<(), ClientError> {
    let stream = within(options.stale_after, UnixStream::connect(socket)).await?;
    let (read, mut write) = stream.into_split();
    let request = Request::Subscribe { service };
    let subscribe = format!("{request}\n");
    within(options.stale_after, write.write_all(subscribe.as_bytes())).await?;
    let mut reader = AsyncBufReader::new(read);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        let limited = tokio::io::AsyncReadExt::take(&mut reader, MAX_RESPONSE_LEN as u64 + 1);
        let read = within(options.stale_after, read_line(limited, &mut line)).await?;
        if read == 0 {
            return Ok(());
        }
        if line.last() != Some(&b'\n') {
            return Err(ClientError::Protocol(format!(
                "an answer longer than {MAX_RESPONSE_LEN} bytes"
            )));
        }
        let text = String::from_utf8_lossy(&line);
        match Response::parse(&text).map_err(|e| ClientError::Protocol(e.reason))? {
            Response::Estimate(push) => held.store(Some(Arc::new(Held {
                push: *push,
                received: Instant::now(),
            }))),
            Response::Err(error) => return Err(ClientError::Agent(error.to_string())),
            other => return Err(ClientError::Protocol(other.to_string())),
        }
    }
}

/// `io` within `deadline`, a timeout being an I/O error like any other.
pub(crate) async fn within<T>(
    deadline: Duration,
    io: impl Future<Output = std::io::Result<T>>,
) -> Result<T, ClientError> {
    match tokio::time::timeout(deadline, io).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(ClientError::Io(std::io::ErrorKind::TimedOut.into())),
    }
}

pub(crate) async fn read_line(
    mut reader: impl tokio::io::AsyncBufRead + Unpin,
    line: &mut Vec<u8>,
) -> std::io::Result<usize> {
    reader.read_until(b'\n', line).await
}

/// Why a one-shot query failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket could not be reached or the time bound passed.
    #[error("cannot talk to the agent")]
    Io(#[from] std::io::Error),
    /// The agent answered with an error line.
    #[error("the agent refused: {0}")]
    Agent(String),
    /// The agent's answer could not be read.
    #[error("unexpected answer from the agent: {0}")]
    Protocol(String),
}

/// Ask the agent once, synchronously, within `timeout` for the whole call: connecting
/// (an agent whose backlog is full is not waited on past it), writing, and reading an answer
/// of at most `MAX_RESPONSE_LEN` bytes, however slowly it arrives.
///
/// # Errors
/// [`ClientError`] on any failure; callers fall back to their static value (see
/// [`query_or_static`]).
pub fn query(
    socket: impl AsRef<Path>,
    service: &str,
    queue_depth: Option<u64>,
    backoff_streak: Option<u32>,
    timeout: Duration,
) -> Result<QueryResponse, ClientError> {
    let deadline = Instant::now() + timeout;
    let stream = connect_within(socket.as_ref(), deadline)?;
    let request = Request::Query {
        service,
        queue_depth,
        backoff_streak,
    };
    match round_trip(&stream, &request, deadline)? {
        Response::RetryAfter(answer) => Ok(answer),
        other => Err(unexpected(other)),
    }
}

/// What `retry-after-agent status` shows: the agent's health and every service's numbers,
/// in the agent's order.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentStatus {
    /// The answer to `HEALTH`.
    pub health: HealthResponse,
    /// The answers to `STATUS`, one per service.
    pub services: Vec<StatusResponse>,
}

/// Ask the agent for its health and every service's status on one connection, within
/// `timeout` for the whole call (`HEALTH`, then `STATUS` from the first service to the last).
///
/// # Errors
/// [`ClientError`] on any failure, an agent that is not running included.
pub fn status(socket: impl AsRef<Path>, timeout: Duration) -> Result<AgentStatus, ClientError> {
    let deadline = Instant::now() + timeout;
    let stream = connect_within(socket.as_ref(), deadline)?;
    let health = match round_trip(&stream, &Request::Health, deadline)? {
        Response::Health(health) => health,
        other => return Err(unexpected(other)),
    };
    let mut services: Vec<StatusResponse> = Vec::with_capacity(health.services);
    let mut next: Option<String> = None;
    while services.len() < health.services {
        let request = Request::Status {
            service: next.as_deref(),
        };
        let status = match round_trip(&stream, &request, deadline)? {
            Response::Status(status) => status,
            other => return Err(unexpected(other)),
        };
        next.clone_from(&status.next);
        services.push(status);
        if next.is_none() {
            break;
        }
    }
    Ok(AgentStatus { health, services })
}

/// An answer that is not the one asked for: the agent's refusal, or a protocol error.
fn unexpected(response: Response) -> ClientError {
    match response {
        Response::Err(error) => ClientError::Agent(error.to_string()),
        other => ClientError::Protocol(other.to_string()),
    }
}

/// Send `request` on `stream` and read its one answer line, both before `deadline`.
fn round_trip(
    stream: &StdUnixStream,
    request: &Request<'_>,
    deadline: Instant,
) -> Result<Response, ClientError> {
    let remaining = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::TimedOut))
    };
    stream.set_write_timeout(Some(remaining()?))?;
    let mut out = stream;
    out.write_all(format!("{request}\n").as_bytes())?;
    let mut line = Vec::with_capacity(256);
    let mut chunk = [0u8; 256];
    while !line.ends_with(b"\n") {
        if line.len() > MAX_RESPONSE_LEN {
            return Err(ClientError::Protocol(format!(
                "an answer longer than {MAX_RESPONSE_LEN} bytes"
            )));
        }
        stream.set_read_timeout(Some(remaining()?))?;
        let n = out.read(&mut chunk)?;
        if n == 0 {
            return Err(ClientError::Protocol(
                "the agent closed the connection".into(),
            ));
        }
        line.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&line);
    Response::parse(&text).map_err(|e| ClientError::Protocol(e.reason))
}

/// Connect to a Unix socket before `deadline`. A blocking connect waits for as long as the
/// listener's backlog is full; a non-blocking one fails at once with `WouldBlock`, so it is
/// retried (every millisecond) until the deadline.
fn connect_within(socket: &Path, deadline: Instant) -> std::io::Result<StdUnixStream> {
    let address = socket2::SockAddr::unix(socket)?;
    loop {
        let attempt = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
        attempt.set_nonblocking(true)?;
        match attempt.connect(&address) {
            Ok(()) => {
                attempt.set_nonblocking(false)?;
                return Ok(attempt.into());
            }
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(error) => return Err(error),
        }
    }
}

/// [`query`], or `retry_after_s` if it fails for any reason.
pub fn query_or_static(
    socket: impl AsRef<Path>,
    service: &str,
    queue_depth: Option<u64>,
    timeout: Duration,
    retry_after_s: Option<u64>,
) -> Option<u64> {
    query(socket, service, queue_depth, None, timeout)
        .map(|answer| answer.seconds)
        .unwrap_or(retry_after_s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng, rngs::SmallRng};

    fn push() -> EstimatePush {
        EstimatePush::parse(
            "ESTIMATE chat seq=1 retry_after_policy=router_queue_drain_rate status_code=503 retry_after_s=5 queue_depth=40 queue_depth_source=frontend drain_rate=4 occupancy=none occupancy_weight=0.25 backoff_weight=0.25 backoff_streak_saturation=5 jitter=0.2 min_retry_after_s=1 max_retry_after_s=60 base_ms=10000 reason=none",
        )
        .unwrap()
    }

    #[test]
    fn jitter_stays_within_bounds_and_varies() {
        let mut rng = SmallRng::seed_from_u64(3);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..1000 {
            let d = decide(&push(), None, None, &push().pushed_schedule(), rng.random());
            assert_eq!((d.rung, d.status_code), (Rung::Computed, 503));
            let s = d.seconds.unwrap();
            assert!((8..=12).contains(&s), "{s}");
            seen.insert(s);
        }
        assert!(seen.len() >= 4, "jitter spreads the values: {seen:?}");
    }

    #[test]
    fn the_proxys_own_depth_and_streak_are_used() {
        let mut no_jitter = push();
        no_jitter.constants.jitter = 0.0;
        // 12 / 4 × (1 + 0.25 × min(5/5, 1)) = 3.75 → 4
        let d = decide(
            &no_jitter,
            Some(12),
            Some(5),
            &push().pushed_schedule(),
            0.5,
        );
        assert_eq!((d.seconds, d.millis), (Some(4), Some(3750)));
        // A streak without a depth still counts: 40 / 4 × 1.25 = 12.5 → 13.
        let d = decide(&no_jitter, None, Some(5), &push().pushed_schedule(), 0.5);
        assert_eq!((d.seconds, d.millis), (Some(13), Some(12_500)));
    }

    #[test]
    fn the_ladder_falls_to_static_then_none_with_its_reason() {
        let mut cold = push();
        cold.drain_rate = None;
        let d = decide(&cold, Some(3), None, &push().pushed_schedule(), 0.5);
        assert_eq!(
            (d.seconds, d.reason),
            (Some(5), Some(FallbackReason::DrainNotWarm))
        );
        cold.retry_after_s = None;
        let d = decide(&cold, None, None, &push().pushed_schedule(), 0.5);
        assert_eq!((d.seconds, d.rung), (None, Rung::None));
    }
}
