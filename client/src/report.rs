//! Telling the agent what the proxy did: `REPORT` lines, so the agent's judge can grade its
//! answers by what happened at the suggested time.
//!
//! The reject path only adds to atomic counters ([`Reporter::admitted`],
//! [`Reporter::rejected`], [`Reporter::handed_out`]); a background task sends them every
//! interval on its own connection and starts the counts again. When the agent is unreachable
//! the counts are kept (bounded by the protocol's largest count) and sent once it is back.
//!
//! What the proxy handed out is counted per rung and second (values above
//! [`MAX_KEPT_RETRY_AFTER_S`] as that), in a fixed table: no allocation on the reject path. A report
//! whose `handed_out=` would not fit on one line goes on in further `REPORT` lines with no
//! admissions or rejections of their own.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    },
    time::Duration,
};

use retry_after_protocol::{
    HandedOut, MAX_LINE_LEN, MAX_REPORT_COUNT, MAX_RESPONSE_LEN, Report, Request, Response,
    policy::{MAX_KEPT_RETRY_AFTER_S, Rung, TicketCounters, TicketOutcome},
};
use tokio::{
    io::{AsyncWriteExt, BufReader},
    net::{
        UnixStream,
        unix::{OwnedReadHalf, OwnedWriteHalf},
    },
    task::JoinHandle,
};

use crate::{ClientError, read_line, within};

/// Seconds the table of handed-out values holds: 0 to [`MAX_KEPT_RETRY_AFTER_S`] (places told
/// as they are where a service keeping returns opts in).
const SECONDS: usize = MAX_KEPT_RETRY_AFTER_S as usize + 1;
/// The rungs that carry a value, in table order.
const RUNGS: [Rung; 2] = [Rung::Computed, Rung::Static];
/// Ticket outcomes, counted in the vocabulary's order.
const OUTCOMES: usize = TicketOutcome::ALL.len();

/// Counts since the last report; `queue_depth` is `u64::MAX` while unknown.
struct Counts {
    admitted: AtomicU64,
    rejected: AtomicU64,
    retry_admitted: AtomicU64,
    retry_rejected: AtomicU64,
    queue_depth: AtomicU64,
    backoff_streak: AtomicU32,
    /// Rejections per rung (computed, static) and second handed out.
    handed_out: [[AtomicU64; SECONDS]; 2],
    /// Set once the proxy says what it hands out: from then on every report says it, `none`
    /// included.
    tracks_handed_out: AtomicBool,
    /// What became of the places the proxy keeps, per outcome.
    tickets: [AtomicU64; OUTCOMES],
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
            admitted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            retry_admitted: AtomicU64::new(0),
            retry_rejected: AtomicU64::new(0),
            queue_depth: AtomicU64::new(u64::MAX),
            backoff_streak: AtomicU32::new(0),
            handed_out: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            tracks_handed_out: AtomicBool::new(false),
            tickets: std::array::from_fn(|_| AtomicU64::new(0)),
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

    /// One rejection carried `Retry-After: seconds` from `rung`; call it for every rejection,
    /// with [`Rung::None`] for one without a header (nothing is counted then). Once called,
    /// every report says what was handed out (`handed_out=none` for nothing), and the agent
    /// judges exactly that.
    pub fn handed_out(&self, rung: Rung, seconds: u64) {
        self.counts.tracks_handed_out.store(true, Ordering::Relaxed);
        let Some(row) = RUNGS.iter().position(|r| *r == rung) else {
            return;
        };
        let second = seconds.min(MAX_KEPT_RETRY_AFTER_S) as usize;
        self.counts.handed_out[row][second].fetch_add(1, Ordering::Relaxed);
    }

    /// What became of the places the proxy keeps since it last said (kept returns): sent as
    /// `tickets=` with the next report.
    pub fn tickets(&self, since_last: &TicketCounters) {
        for (outcome, n) in since_last.iter() {
            self.counts.tickets[outcome as usize].fetch_add(n, Ordering::Relaxed);
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
#[derive(Clone, Copy)]
struct Pending {
    admitted: u64,
    rejected: u64,
    retry_admitted: u64,
    retry_rejected: u64,
    handed_out: [[u64; SECONDS]; 2],
    tickets: [u64; OUTCOMES],
}

impl Default for Pending {
    fn default() -> Self {
        Self {
            admitted: 0,
            rejected: 0,
            retry_admitted: 0,
            retry_rejected: 0,
            handed_out: [[0; SECONDS]; 2],
            tickets: [0; OUTCOMES],
        }
    }
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
        for (row, pending) in counts.handed_out.iter().zip(&mut self.handed_out) {
            for (count, into) in row.iter().zip(pending.iter_mut()) {
                take(count, into);
            }
        }
        for (count, into) in counts.tickets.iter().zip(&mut self.tickets) {
            take(count, into);
        }
    }

    /// The `tickets=` value: every outcome with a count, or nothing.
    fn tickets_value(&self) -> Option<String> {
        let entries: Vec<String> = TicketOutcome::ALL
            .iter()
            .zip(self.tickets)
            .filter(|(_, n)| *n > 0)
            .map(|(outcome, n)| format!("{outcome}:{n}"))
            .collect();
        (!entries.is_empty()).then(|| entries.join(","))
    }

    /// The `handed_out=` values, each at most as long as fits on a `REPORT` line beside the
    /// rest of it (the first also carries the counts), with the table cells each one carries.
    fn handed_out_values(&self, room: usize) -> Vec<(String, Vec<(usize, usize)>)> {
        let mut values: Vec<(String, Vec<(usize, usize)>)> = vec![(String::new(), Vec::new())];
        for (r, (row, rung)) in self.handed_out.iter().zip(RUNGS).enumerate() {
            for (seconds, &count) in row.iter().enumerate().filter(|(_, c)| **c > 0) {
                let mut entry = String::new();
                let h = HandedOut {
                    rung,
                    seconds: seconds as u64,
                    count,
                };
                let _ = h.write(&mut entry);
                let (last, _) = values.last().expect("one value at least");
                if !last.is_empty() && last.len() + 1 + entry.len() > room {
                    values.push((String::new(), Vec::new()));
                }
                let (last, cells) = values.last_mut().expect("one value at least");
                if !last.is_empty() {
                    last.push(',');
                }
                last.push_str(&entry);
                cells.push((r, seconds));
            }
        }
        values
    }

    /// What the agent has acknowledged: line `i` of a report, which carried `cells`.
    fn acknowledged(&mut self, i: usize, cells: &[(usize, usize)]) {
        if i == 0 {
            let handed_out = self.handed_out;
            *self = Self {
                handed_out,
                ..Self::default()
            };
        }
        for &(r, seconds) in cells {
            self.handed_out[r][seconds] = 0;
        }
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
    let stream = within(interval, UnixStream::connect(socket)).await?;
    let (read, write) = stream.into_split();
    let mut agent = Agent {
        reader: BufReader::new(read),
        write,
        line: Vec::with_capacity(64),
        deadline: interval,
    };
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        pending.take(counts);
        let tickets = pending.tickets_value();
        let first = Report {
            tickets: tickets.as_deref(),
            ..first_report(service, counts, pending)
        };
        // Room for `handed_out=` on a line: what the longest first line takes besides it (a
        // name too long for the protocol leaves little, and the agent refuses it anyway).
        let room = MAX_LINE_LEN
            .saturating_sub(Request::Report(first).to_string().len() + " handed_out=".len())
            .max(16);
        let tracking = counts.tracks_handed_out.load(Ordering::Relaxed);
        // One line at a time, each acknowledged before the next: a connection lost midway
        // leaves exactly what was not acknowledged to be sent again.
        for (i, (value, cells)) in pending.handed_out_values(room).iter().enumerate() {
            let handed_out = match (tracking, value.is_empty()) {
                (false, _) => None,
                (true, true) => Some("none"),
                (true, false) => Some(value.as_str()),
            };
            let report = Report {
                handed_out,
                ..if i == 0 { first } else { continuation(first) }
            };
            agent.report(&report).await?;
            pending.acknowledged(i, cells);
        }
    }
}

/// The first line of a report: the counts since the last one, the queue and streak now.
fn first_report<'a>(service: &'a str, counts: &Counts, pending: &Pending) -> Report<'a> {
    let depth = counts.queue_depth.load(Ordering::Relaxed);
    Report {
        service,
        admitted: pending.admitted,
        rejected: pending.rejected,
        queue_depth: (depth != u64::MAX).then_some(depth),
        backoff_streak: Some(counts.backoff_streak.load(Ordering::Relaxed)),
        retry_admitted: Some(pending.retry_admitted),
        retry_rejected: Some(pending.retry_rejected),
        handed_out: None,
        tickets: None,
    }
}

/// A line after the first: the same queue, no admissions, rejections or tickets of its own.
fn continuation(first: Report<'_>) -> Report<'_> {
    Report {
        admitted: 0,
        rejected: 0,
        retry_admitted: Some(0),
        retry_rejected: Some(0),
        tickets: None,
        ..first
    }
}

/// One reporting connection to the agent; every step has the report interval as deadline.
struct Agent {
    reader: BufReader<OwnedReadHalf>,
    write: OwnedWriteHalf,
    line: Vec<u8>,
    deadline: Duration,
}

impl Agent {
    /// Send one `REPORT` line and wait for its `OK`.
    async fn report(&mut self, report: &Report<'_>) -> Result<(), ClientError> {
        let text = format!("{}\n", Request::Report(*report));
        within(self.deadline, self.write.write_all(text.as_bytes())).await?;
        self.line.clear();
        let limited = tokio::io::AsyncReadExt::take(&mut self.reader, MAX_RESPONSE_LEN as u64 + 1);
        within(self.deadline, read_line(limited, &mut self.line)).await?;
        let text = String::from_utf8_lossy(&self.line);
        match Response::parse(text.trim_end()).map_err(|e| ClientError::Protocol(e.reason))? {
            Response::Ok => Ok(()),
            Response::Err(error) => Err(ClientError::Agent(error.to_string())),
            other => Err(ClientError::Protocol(other.to_string())),
        }
    }
}
