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

use super::{
    ServerOptions, command,
    registry::{Registry, Slot},
};
use crate::shared::Shared;
use retry_after_estimator::Query;
use retry_after_protocol::{ErrorCode, MAX_LINE_LEN, ProtocolError, Report, Request, Response};

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
        let denied = format!("uid {peer_uid} is not in agent.allowed_uids");
        return out
            .error(ProtocolError::new(ErrorCode::Denied, denied))
            .await;
    }
    let mut connection = Connection::new(shared, registry.admit(shared.metrics()));
    let mut lines = LineReader::new(BufReader::new(read));
    let mut ticks = shared.ticks();
    loop {
        let idle = tokio::time::sleep(options.idle_timeout);
        let subscribed = !connection.subscriptions.is_empty();
        let end = tokio::select! {
            _ = shutdown.recv() => return Ok(()),
            _ = connection.slot.shed.notified() => Some(ProtocolError::new(ErrorCode::Idle, "shed to make room for a new connection")),
            _ = idle, if !subscribed => Some(ProtocolError::new(ErrorCode::Idle, "no request within agent.client_idle_timeout_ms")),
            tick = ticks.recv(), if subscribed => {
                if let Err(broadcast::error::RecvError::Closed) = tick {
                    return Ok(());
                }
                connection.push_estimates(&mut out).await?;
                None
            }
            line = lines.next() => match line? {
                None => return Ok(()),
                Some(line) => connection.answer(line, &mut out).await?,
            },
        };
        if let Some(error) = end {
            return out.error(error).await;
        }
    }
}

/// What one connection keeps between its requests.
struct Connection<'a> {
    shared: &'a Shared,
    slot: Slot<'a>,
    /// The services this connection subscribed to, in order.
    subscriptions: Vec<String>,
    /// Pushes sent so far: their sequence numbers.
    pushes: u64,
    /// Draws each `QUERY`'s jitter.
    rng: SmallRng,
    /// When each service was last reported on this connection: a report covers the time since.
    reported: Vec<(String, Instant)>,
}

impl<'a> Connection<'a> {
    fn new(shared: &'a Shared, slot: Slot<'a>) -> Self {
        Self {
            shared,
            slot,
            subscriptions: Vec::new(),
            pushes: 0,
            rng: SmallRng::from_rng(&mut rand::rng()),
            reported: Vec::new(),
        }
    }

    /// Answer one line. `Some` is the error that ends the connection.
    async fn answer(
        &mut self,
        line: Line,
        out: &mut Writer<'_>,
    ) -> io::Result<Option<ProtocolError>> {
        let line = match line {
            Line::Complete(line) => line,
            Line::TooLong => {
                let too_long = format!("lines are at most {MAX_LINE_LEN} bytes");
                out.error(ProtocolError::new(ErrorCode::LineTooLong, too_long))
                    .await?;
                return Ok(None);
            }
        };
        let request = match Request::parse(&line) {
            Ok(request) => request,
            Err(error) => {
                out.error(error).await?;
                return Ok(None);
            }
        };
        self.shared.metrics().record_request(request.command());
        let response = match request {
            Request::Query {
                service,
                queue_depth,
                backoff_streak,
            } => {
                self.slot.touch();
                let query = Query {
                    queue_depth,
                    backoff_streak,
                };
                command::query(self.shared, service, query, &mut self.rng)
            }
            Request::Report(report) => {
                self.slot.touch();
                self.report(&report)
            }
            Request::Subscribe { service } => match self.subscribe(service) {
                Ok(response) => response,
                Err(end) => return Ok(Some(end)),
            },
            Request::Health => {
                self.slot.touch();
                command::health(self.shared, self.slot.registry().len())
            }
            Request::Status { service } => {
                self.slot.touch();
                command::status(self.shared, service)
            }
        };
        out.respond(response).await?;
        Ok(None)
    }

    /// `REPORT`, covering the time since this connection last reported the service (the
    /// first covers a time unknown: a proxy's counts may predate the connection).
    fn report(&mut self, report: &Report<'_>) -> Response {
        let last = self.reported.iter_mut().find(|(s, _)| s == report.service);
        let from = last.as_ref().map(|(_, at)| *at);
        let response = command::report(self.shared, from, report);
        if response == Response::Ok {
            let now = Instant::now();
            match last {
                Some((_, at)) => *at = now,
                None => self.reported.push((report.service.to_owned(), now)),
            }
        }
        response
    }

    /// `SUBSCRIBE`: the first push, or the error that ends the connection when every
    /// subscription slot is taken.
    fn subscribe(&mut self, service: &str) -> Result<Response, ProtocolError> {
        self.pushes += 1;
        let Some(push) = command::push(self.shared, service, self.pushes) else {
            return Ok(command::unknown_service(service));
        };
        if !self.slot.subscribe() {
            return Err(ProtocolError::new(
                ErrorCode::Overloaded,
                "every subscription slot is taken (subscribers hold at most three quarters of agent.max_clients)",
            ));
        }
        if !self.subscriptions.iter().any(|s| s == service) {
            self.subscriptions.push(service.to_owned());
        }
        Ok(Response::Estimate(Box::new(push)))
    }

    /// One push per subscribed service, after a tick.
    async fn push_estimates(&mut self, out: &mut Writer<'_>) -> io::Result<()> {
        for service in &self.subscriptions {
            self.pushes += 1;
            if let Some(push) = command::push(self.shared, service, self.pushes) {
                out.line(&Response::Estimate(Box::new(push))).await?;
            }
        }
        Ok(())
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
                self.shared.metrics().record_write_timeout();
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the peer did not read its answers within agent.client_write_timeout_ms",
                ))
            }
        }
    }

    async fn error(&mut self, error: ProtocolError) -> io::Result<()> {
        self.shared.metrics().record_error(error.code);
        self.line(&error).await
    }

    /// Write a response; an `ERR` is counted as an error.
    async fn respond(&mut self, response: Response) -> io::Result<()> {
        match response {
            Response::Err(error) => self.error(error).await,
            response => self.line(&response).await,
        }
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
