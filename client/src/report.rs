//! Telling the agent what the proxy did: `REPORT` lines, so the agent's judge can grade its
//! answers by what happened at the suggested time.
//!
//! The reject path only adds to atomic counters ([`Reporter::admitted`],
//! [`Reporter::rejected`]); a background task sends them every interval on its own connection
//! and starts the counts again. When the agent is unreachable the counts are kept (bounded by
//! the protocol's largest count) and sent once it is back.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    time::Duration,
};

use retry_after_protocol::{MAX_REPORT_COUNT, MAX_RESPONSE_LEN, Report, Request, Response};
use tokio::{
    io::{AsyncWriteExt, BufReader},
    net::UnixStream,
    task::JoinHandle,
};

use crate::{ClientError, read_line};

/// Counts since the last report; `queue_depth` is `u64::MAX` while unknown.
#[derive(Default)]
struct Counts {
    admitted: AtomicU64,
    rejected: AtomicU64,
    retry_admitted: AtomicU64,
    retry_rejected: AtomicU64,
    queue_depth: AtomicU64,
    backoff_streak: AtomicU32,
}

/// A proxy's admissions and rejections for one service, reported to the agent in the
/// background.
pub struct Reporter {
    counts: Arc<Counts>,
    task: JoinHandle<()>,
}

impl Reporter {
    /// Report for `service` to the agent at `socket` every `interval`. Must be called within
    /// a tokio runtime; the task runs until the reporter is dropped.
    pub fn spawn(socket: impl AsRef<Path>, service: &str, interval: Duration) -> Self {
        let counts = Arc::new(Counts {
            queue_depth: AtomicU64::new(u64::MAX),
            ..Counts::default()
        });
        let task = tokio::spawn(report_loop(
            socket.as_ref().to_path_buf(),
            service.to_owned(),
            interval,
            counts.clone(),
        ));
        Self { counts, task }
    }

    /// One request admitted to the queue; `retry`: it came back after a Retry-After.
    pub fn admitted(&self, retry: bool) {
        self.counts.admitted.fetch_add(1, Ordering::Relaxed);
        if retry {
            self.counts.retry_admitted.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One request rejected; `retry`: it came back after a Retry-After.
    pub fn rejected(&self, retry: bool) {
        self.counts.rejected.fetch_add(1, Ordering::Relaxed);
        if retry {
            self.counts.retry_rejected.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The proxy's queue depth and placement backoff streak now, sent with the next report.
    pub fn set_queue(&self, queue_depth: u64, backoff_streak: u32) {
        self.counts
            .queue_depth
            .store(queue_depth, Ordering::Relaxed);
        self.counts
            .backoff_streak
            .store(backoff_streak, Ordering::Relaxed);
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What has not been sent yet: taken from the counters at each interval.
#[derive(Clone, Copy, Default)]
struct Pending {
    admitted: u64,
    rejected: u64,
    retry_admitted: u64,
    retry_rejected: u64,
}

impl Pending {
    fn take(&mut self, counts: &Counts) {
        let take = |a: &AtomicU64, into: &mut u64| {
            *into = into
                .saturating_add(a.swap(0, Ordering::Relaxed))
                .min(MAX_REPORT_COUNT);
        };
        take(&counts.admitted, &mut self.admitted);
        take(&counts.rejected, &mut self.rejected);
        take(&counts.retry_admitted, &mut self.retry_admitted);
        take(&counts.retry_rejected, &mut self.retry_rejected);
    }
}

async fn report_loop(socket: PathBuf, service: String, interval: Duration, counts: Arc<Counts>) {
    let mut pending = Pending::default();
    loop {
        if let Err(error) =
            report_on_one_connection(&socket, &service, interval, &counts, &mut pending).await
        {
            tracing::debug!(%error, socket = %socket.display(), "retry-after report connection lost");
        }
        tokio::time::sleep(interval).await;
    }
}

/// Report every `interval` on one connection until it fails; what could not be sent stays in
/// `pending`.
async fn report_on_one_connection(
    socket: &Path,
    service: &str,
    interval: Duration,
    counts: &Counts,
    pending: &mut Pending,
) -> Result<(), ClientError> {
    let timed_out = || ClientError::Io(std::io::ErrorKind::TimedOut.into());
    let stream = tokio::time::timeout(interval, UnixStream::connect(socket))
        .await
        .map_err(|_| timed_out())??;
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut line = Vec::with_capacity(64);
    loop {
        ticker.tick().await;
        pending.take(counts);
        let depth = counts.queue_depth.load(Ordering::Relaxed);
        let request = Request::Report(Report {
            service,
            admitted: pending.admitted,
            rejected: pending.rejected,
            queue_depth: (depth != u64::MAX).then_some(depth),
            backoff_streak: Some(counts.backoff_streak.load(Ordering::Relaxed)),
            retry_admitted: Some(pending.retry_admitted),
            retry_rejected: Some(pending.retry_rejected),
        });
        tokio::time::timeout(interval, write.write_all(format!("{request}\n").as_bytes()))
            .await
            .map_err(|_| timed_out())??;
        line.clear();
        let limited = tokio::io::AsyncReadExt::take(&mut reader, MAX_RESPONSE_LEN as u64 + 1);
        tokio::time::timeout(interval, read_line(limited, &mut line))
            .await
            .map_err(|_| timed_out())??;
        let text = String::from_utf8_lossy(&line);
        match Response::parse(text.trim_end()).map_err(|e| ClientError::Protocol(e.reason))? {
            Response::Ok => *pending = Pending::default(),
            Response::Err(error) => return Err(ClientError::Agent(error.to_string())),
            other => return Err(ClientError::Protocol(other.to_string())),
        }
    }
}
