//! One proxy connection: read lines (bounded), answer each with one line (with a write
//! deadline), push estimates to subscribers, and end on shutdown, when shed, when idle, or when
//! the peer stops reading.

use std::{io, time::Instant};

use rand::{SeedableRng, rngs::SmallRng};
use tokio::{
    io::{AsyncBufRead, AsyncBufReadExt, AsyncWriteExt, BufReader, BufWriter},
    net::{UnixStream, unix::OwnedWriteHalf},
    sync::broadcast,
};

use super::{ServerOptions, Shared, command, registry::Registry};
use crate::{
    estimate::Query,
    protocol::{ErrorCode, MAX_LINE_LEN, ProtocolError, Request, Response},
};

/// Serve one connection until it ends. Errors end only this connection.
pub async fn serve(
    stream: UnixStream,
    shared: &Shared,
    options: &ServerOptions,
    registry: &Registry,
    mut shutdown: broadcast::Receiver<()>,
) -> io::Result<()> {
    let peer_uid = stream.peer_cred()?.uid();
    let (read, write) = stream.into_split();
    let mut out = Writer::new(write, shared, options);
    if let Some(allowed) = &options.allowed_uids
        && !allowed.contains(&peer_uid)
    {
        return out
            .error(ProtocolError::new(
                ErrorCode::Denied,
                format!("uid {peer_uid} is not in agent.allowed_uids"),
            ))
            .await;
    }
    let slot = registry.admit(&shared.metrics);
    let mut lines = LineReader::new(BufReader::new(read));
    let mut ticks = shared.tick.subscribe();
    let mut subscriptions: Vec<String> = Vec::new();
    let mut pushes = 0u64;
    let mut rng = SmallRng::from_rng(&mut rand::rng());
    // When each service was last reported on this connection: a report covers the time since.
    let connected = Instant::now();
    let mut reported: Vec<(String, Instant)> = Vec::new();
    loop {
        let idle = tokio::time::sleep(options.idle_timeout);
        tokio::select! {
            _ = shutdown.recv() => return Ok(()),
            _ = slot.shed.notified() => {
                return out.error(ProtocolError::new(ErrorCode::Idle, "shed to make room for a new connection")).await;
            }
            _ = idle, if subscriptions.is_empty() => {
                return out.error(ProtocolError::new(ErrorCode::Idle, "no request within agent.client_idle_timeout_ms")).await;
            }
            tick = ticks.recv(), if !subscriptions.is_empty() => {
                if let Err(broadcast::error::RecvError::Closed) = tick {
                    return Ok(());
                }
                for service in &subscriptions {
                    pushes += 1;
                    if let Some(push) = command::push(shared, service, pushes) {
                        out.line(&Response::Estimate(Box::new(push))).await?;
                    }
                }
            }
            line = lines.next() => {
                let line = match line? {
                    None => return Ok(()),
                    Some(Line::TooLong) => {
                        out.error(ProtocolError::new(ErrorCode::LineTooLong, format!("lines are at most {MAX_LINE_LEN} bytes"))).await?;
                        continue;
                    }
                    Some(Line::Complete(line)) => line,
                };
                let request = match Request::parse(&line) {
                    Ok(request) => request,
                    Err(error) => {
                        out.error(error).await?;
                        continue;
                    }
                };
                shared.metrics.record_request(request.command());
                let response = match request {
                    Request::Query { service, queue_depth, backoff_streak } => {
                        slot.touch();
                        command::query(shared, service, Query { queue_depth, backoff_streak }, &mut rng)
                    }
                    Request::Report(report) => {
                        slot.touch();
                        let last = reported.iter_mut().find(|(s, _)| s == report.service);
                        let from = last.as_ref().map_or(connected, |(_, at)| *at);
                        let response = command::report(shared, from, &report);
                        if response == Response::Ok {
                            let now = Instant::now();
                            match last {
                                Some((_, at)) => *at = now,
                                None => reported.push((report.service.to_owned(), now)),
                            }
                        }
                        response
                    }
                    Request::Subscribe { service } => {
                        pushes += 1;
                        match command::push(shared, service, pushes) {
                            None => command::unknown_service(service),
                            Some(_) if !slot.subscribe() => {
                                return out.error(ProtocolError::new(
                                    ErrorCode::Overloaded,
                                    "every subscription slot is taken (subscribers hold at most three quarters of agent.max_clients)",
                                )).await;
                            }
                            Some(push) => {
                                if !subscriptions.iter().any(|s| s == service) {
                                    subscriptions.push(service.to_owned());
                                }
                                Response::Estimate(Box::new(push))
                            }
                        }
                    }
                    Request::Health => {
                        slot.touch();
                        command::health(shared, slot.registry().len())
                    }
                };
                match response {
                    Response::Err(error) => out.error(error).await?,
                    response => out.line(&response).await?,
                }
            }
        }
    }
}

/// The write half: every line is written within the write deadline, or the connection ends
/// (a peer that does not read cannot hold its slot). Counts the errors it sends.
struct Writer<'a> {
    inner: BufWriter<OwnedWriteHalf>,
    shared: &'a Shared,
    deadline: std::time::Duration,
}

impl<'a> Writer<'a> {
    fn new(write: OwnedWriteHalf, shared: &'a Shared, options: &ServerOptions) -> Self {
        Self {
            inner: BufWriter::new(write),
            shared,
            deadline: options.write_timeout,
        }
    }

    async fn line(&mut self, line: &impl std::fmt::Display) -> io::Result<()> {
        let text = format!("{line}\n");
        let write = async {
            self.inner.write_all(text.as_bytes()).await?;
            self.inner.flush().await
        };
        match tokio::time::timeout(self.deadline, write).await {
            Ok(result) => result,
            Err(_) => {
                self.shared.metrics.record_write_timeout();
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the peer did not read its answers within agent.client_write_timeout_ms",
                ))
            }
        }
    }

    async fn error(&mut self, error: ProtocolError) -> io::Result<()> {
        self.shared.metrics.record_error(error.code);
        self.line(&error).await
    }
}

/// A line read from a connection.
enum Line {
    /// A whole line, without its newline.
    Complete(Vec<u8>),
    /// A line longer than `MAX_LINE_LEN`; its bytes were discarded.
    TooLong,
}

/// Reads lines with bounded memory: bytes of an over-long line are dropped as they arrive.
/// Cancel-safe: partial state lives in the reader, and the only await is `fill_buf`.
struct LineReader<R> {
    inner: R,
    buffer: Vec<u8>,
    discarding: bool,
}

impl<R: AsyncBufRead + Unpin> LineReader<R> {
    fn new(inner: R) -> Self {
        Self {
            inner,
            buffer: Vec::with_capacity(128),
            discarding: false,
        }
    }

    /// The next line; `None` at the end of the stream (a partial last line is dropped).
    async fn next(&mut self) -> io::Result<Option<Line>> {
        loop {
            let available = self.inner.fill_buf().await?;
            if available.is_empty() {
                return Ok(None);
            }
            let newline = available.iter().position(|b| *b == b'\n');
            let chunk = &available[..newline.unwrap_or(available.len())];
            if !self.discarding {
                if self.buffer.len() + chunk.len() > MAX_LINE_LEN + 1 {
                    self.discarding = true;
                    self.buffer.clear();
                } else {
                    self.buffer.extend_from_slice(chunk);
                }
            }
            let used = chunk.len() + usize::from(newline.is_some());
            self.inner.consume(used);
            if newline.is_some() {
                if std::mem::take(&mut self.discarding) {
                    return Ok(Some(Line::TooLong));
                }
                return Ok(Some(Line::Complete(std::mem::take(&mut self.buffer))));
            }
        }
    }
}
