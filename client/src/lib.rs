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
//! let options = ClientOptions { static_retry_after_s: Some(5), ..ClientOptions::default() };
//! let chat = Subscription::spawn("/run/retry-after-agent/agent.sock", "chat", options);
//! // On each rejection:
//! let decision = chat.retry_after(&mut rand::rng());
//! if let Some(seconds) = decision.seconds {
//!     // respond 429 with `Retry-After: {seconds}`
//! }
//! # }
//! ```

use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixStream as StdUnixStream,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use arc_swap::ArcSwapOption;
use retry_after_protocol::{EstimatePush, header_value};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader as AsyncBufReader},
    net::UnixStream,
    task::JoinHandle,
};

/// How a subscription behaves.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Used when no fresh estimate is available (and as the agent's own static fallback when
    /// the agent sends none); `None`: no header then.
    pub static_retry_after_s: Option<u64>,
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
            static_retry_after_s: None,
            stale_after: Duration::from_secs(5),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
        }
    }
}

/// Where a decision came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The agent's computed estimate, jittered here.
    Computed,
    /// A static value: the agent's configured one, or this client's when no fresh estimate
    /// is held.
    Static,
    /// No header.
    None,
}

/// The answer for one rejection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// `Retry-After` in delta-seconds; `None`: send no header.
    pub seconds: Option<u64>,
    /// The same in milliseconds, for `retry-after-ms`.
    pub millis: Option<u64>,
    /// Where it came from.
    pub source: Source,
    /// The status code to reject with (429 unless the agent's service says 503).
    pub status_code: u16,
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
        }
    }

    /// The Retry-After for one rejection, from the agent's queue depth. Never blocks.
    pub fn retry_after(&self, rng: &mut impl rand::Rng) -> Decision {
        self.retry_after_with(None, None, rng)
    }

    /// The Retry-After for one rejection, computed with the proxy's own queue depth and
    /// backoff streak where given. Never blocks.
    pub fn retry_after_with(
        &self,
        queue_depth: Option<u64>,
        backoff_streak: Option<u32>,
        rng: &mut impl rand::Rng,
    ) -> Decision {
        let guard = self.held.load();
        let fresh = guard
            .as_ref()
            .filter(|held| held.received.elapsed() <= self.options.stale_after);
        match fresh {
            Some(held) => decide(&held.push, queue_depth, backoff_streak, rng),
            None => static_decision(self.options.static_retry_after_s, 429),
        }
    }

    /// Age of the estimate held, if any.
    pub fn age(&self) -> Option<Duration> {
        self.held
            .load()
            .as_ref()
            .map(|held| held.received.elapsed())
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The ladder applied to a pushed estimate: computed (with jitter and clamp) → static → none.
pub fn decide(
    push: &EstimatePush,
    queue_depth: Option<u64>,
    backoff_streak: Option<u32>,
    rng: &mut impl rand::Rng,
) -> Decision {
    let base_s = match (queue_depth, push.drain_rate) {
        (Some(depth), Some(drain)) if drain.is_finite() && drain > 0.0 => {
            let streak = f64::from(backoff_streak.unwrap_or(0));
            let backoff = (streak / f64::from(push.backoff_saturation.max(1))).min(1.0);
            let factor = push.occupancy_factor + push.backoff_weight * backoff;
            Some(depth as f64 / drain * factor)
        }
        _ => push.base_ms.map(|ms| ms as f64 / 1000.0),
    };
    if let Some(base) = base_s {
        let unit: f64 = rand::RngExt::random(rng);
        if let Some((seconds, millis)) =
            header_value(base, push.jitter, unit, push.min_s, push.max_s)
        {
            return Decision {
                seconds: Some(seconds),
                millis: Some(millis),
                source: Source::Computed,
                status_code: push.status_code,
            };
        }
    }
    static_decision(push.static_s, push.status_code)
}

fn static_decision(static_s: Option<u64>, status_code: u16) -> Decision {
    match static_s {
        Some(s) => Decision {
            seconds: Some(s),
            millis: Some(s.saturating_mul(1000)),
            source: Source::Static,
            status_code,
        },
        None => Decision {
            seconds: None,
            millis: None,
            source: Source::None,
            status_code,
        },
    }
}

/// Keep a subscription alive: connect, subscribe, store every push; on any failure wait
/// (doubling, bounded) and start again.
async fn follow(
    socket: PathBuf,
    service: String,
    held: Arc<ArcSwapOption<Held>>,
    options: ClientOptions,
) {
    let mut delay = options.reconnect_min;
    loop {
        match subscribe_once(&socket, &service, &held).await {
            Ok(()) => delay = options.reconnect_min,
            Err(error) => {
                tracing::debug!(%error, socket = %socket.display(), "retry-after subscription lost")
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(options.reconnect_max);
    }
}

async fn subscribe_once(
    socket: &Path,
    service: &str,
    held: &ArcSwapOption<Held>,
) -> Result<(), ClientError> {
    let stream = UnixStream::connect(socket).await?;
    let (read, mut write) = stream.into_split();
    write
        .write_all(format!("SUBSCRIBE {service}\n").as_bytes())
        .await?;
    let mut lines = AsyncBufReader::new(read).lines();
    while let Some(line) = lines.next_line().await? {
        if line.starts_with("ERR ") {
            return Err(ClientError::Agent(line));
        }
        let push = EstimatePush::parse(&line).map_err(|e| ClientError::Protocol(e.reason))?;
        held.store(Some(Arc::new(Held {
            push,
            received: Instant::now(),
        })));
    }
    Ok(())
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

/// A one-shot answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueryAnswer {
    /// The header value, if any.
    pub seconds: Option<u64>,
    /// The whole `RETRY-AFTER` line.
    pub line: String,
}

/// Ask the agent once, synchronously, within `timeout` (connect, write and read together).
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
) -> Result<QueryAnswer, ClientError> {
    let deadline = Instant::now() + timeout;
    let remaining = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::TimedOut))
    };
    let stream = StdUnixStream::connect(socket)?;
    stream.set_write_timeout(Some(remaining()?))?;
    let mut request = format!("QUERY {service}");
    if let Some(depth) = queue_depth {
        request.push_str(&format!(" depth={depth}"));
    }
    if let Some(streak) = backoff_streak {
        request.push_str(&format!(" streak={streak}"));
    }
    request.push('\n');
    (&stream).write_all(request.as_bytes())?;
    stream.set_read_timeout(Some(remaining()?))?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line)?;
    let line = line.trim_end().to_owned();
    if line.starts_with("ERR ") {
        return Err(ClientError::Agent(line));
    }
    let value = line
        .strip_prefix("RETRY-AFTER ")
        .and_then(|rest| rest.split(' ').next())
        .ok_or_else(|| ClientError::Protocol(line.clone()))?;
    let seconds = match value {
        "none" => None,
        v => Some(v.parse().map_err(|_| ClientError::Protocol(line.clone()))?),
    };
    Ok(QueryAnswer { seconds, line })
}

/// [`query`], or `static_retry_after_s` if it fails for any reason.
pub fn query_or_static(
    socket: impl AsRef<Path>,
    service: &str,
    queue_depth: Option<u64>,
    timeout: Duration,
    static_retry_after_s: Option<u64>,
) -> Option<u64> {
    query(socket, service, queue_depth, None, timeout)
        .map(|answer| answer.seconds)
        .unwrap_or(static_retry_after_s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{SeedableRng, rngs::SmallRng};

    fn push() -> EstimatePush {
        EstimatePush::parse(
            "ESTIMATE chat seq=1 base_ms=10000 jitter=0.200 min=1 max=60 static=5 status=503 depth=40 drain=4.000 occupancy_factor=1.000 backoff_weight=0.250 backoff_saturation=5",
        )
        .unwrap()
    }

    #[test]
    fn jitter_stays_within_bounds_and_varies() {
        let mut rng = SmallRng::seed_from_u64(3);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..1000 {
            let d = decide(&push(), None, None, &mut rng);
            assert_eq!((d.source, d.status_code), (Source::Computed, 503));
            let s = d.seconds.unwrap();
            assert!((8..=12).contains(&s), "{s}");
            seen.insert(s);
        }
        assert!(seen.len() >= 4, "jitter spreads the values: {seen:?}");
    }

    #[test]
    fn the_proxys_own_depth_and_streak_are_used() {
        let mut no_jitter = push();
        no_jitter.jitter = 0.0;
        let mut rng = SmallRng::seed_from_u64(3);
        // 12 / 4 × (1 + 0.25 × min(5/5, 1)) = 3.75 → 4
        let d = decide(&no_jitter, Some(12), Some(5), &mut rng);
        assert_eq!((d.seconds, d.millis), (Some(4), Some(3750)));
    }

    #[test]
    fn the_ladder_falls_to_static_then_none() {
        let mut rng = SmallRng::seed_from_u64(3);
        let mut cold = push();
        cold.base_ms = None;
        cold.drain_rate = None;
        assert_eq!(decide(&cold, Some(3), None, &mut rng).seconds, Some(5));
        cold.static_s = None;
        let d = decide(&cold, None, None, &mut rng);
        assert_eq!((d.seconds, d.source), (None, Source::None));
    }
}
