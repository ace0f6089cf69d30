//! The Unix-socket server proxies talk to (protocol: the `retry-after-protocol` crate and
//! docs/protocol.md).
//!
//! Each connection is a task. One bad connection is answered with an `ERR` line and never
//! affects another. Limits: a request line is at most `MAX_LINE_LEN` bytes (longer ones are
//! discarded as they arrive, then refused); at most `max_clients` connections, and at that
//! limit a new connection sheds one that never sent a request, else the one idle the longest
//! (subscribers are not shed); a
//! connection that sends nothing for `idle_timeout` is closed unless it subscribed; optionally
//! only peers whose uid (SO_PEERCRED) is allowed are served.

use std::{
    collections::HashMap,
    io,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use rand::{RngExt, SeedableRng, rngs::SmallRng};
use tokio::{
    io::{AsyncBufRead, AsyncBufReadExt, AsyncWriteExt, BufReader, BufWriter},
    net::{UnixListener, UnixStream},
    sync::{Notify, broadcast},
};
use tracing::{debug, warn};

use crate::{
    estimate::{Estimator, Query},
    metrics::Metrics,
    protocol::{
        ErrorCode, HealthResponse, MAX_LINE_LEN, ProtocolError, QueryResponse, Request, Response,
    },
};

/// State shared by the tick loop, the socket server and the metrics endpoint.
pub struct Shared {
    /// The estimates.
    pub estimator: Mutex<Estimator>,
    /// The metrics.
    pub metrics: Metrics,
    /// When the agent started.
    pub started: Instant,
    /// Ticks so far.
    pub ticks: AtomicU64,
    /// When the last tick happened.
    pub last_tick: Mutex<Option<Instant>>,
    /// Watched endpoints.
    pub endpoints: AtomicUsize,
    /// Sends the tick number after every tick (subscribers push then).
    pub tick: broadcast::Sender<u64>,
}

impl Shared {
    /// Fresh state around `estimator`.
    pub fn new(estimator: Estimator) -> Self {
        Self {
            estimator: Mutex::new(estimator),
            metrics: Metrics::new(),
            started: Instant::now(),
            ticks: AtomicU64::new(0),
            last_tick: Mutex::new(None),
            endpoints: AtomicUsize::new(0),
            tick: broadcast::channel(16).0,
        }
    }

    /// The estimator, even if a panicking holder poisoned the lock.
    pub fn estimator(&self) -> MutexGuard<'_, Estimator> {
        self.estimator
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Limits of the socket server.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Only these peer uids are served, if set.
    pub allowed_uids: Option<Vec<u32>>,
    /// Connections held at once.
    pub max_clients: usize,
    /// Connections silent this long are closed (subscribers excepted).
    pub idle_timeout: Duration,
}

/// The socket cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Another agent answers on the socket.
    #[error("another agent is already serving {0}")]
    AlreadyRunning(PathBuf),
    /// Something that is not a socket is in the way.
    #[error("{0} exists and is not a socket; remove it or choose another agent.socket_path")]
    NotASocket(PathBuf),
    /// Creating, binding or setting permissions failed.
    #[error("cannot set up the socket {path}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Bind the socket at `path` with permissions `mode`: creates the parent directory, removes a
/// stale socket file left by an agent that died, refuses to steal a live one.
///
/// # Errors
/// [`ServerError`].
pub fn bind(path: &Path, mode: u32) -> Result<UnixListener, ServerError> {
    let io_error = |source| ServerError::Io {
        path: path.to_owned(),
        source,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io_error)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(ServerError::AlreadyRunning(path.to_owned()));
            }
            std::fs::remove_file(path).map_err(io_error)?;
        }
        Ok(_) => return Err(ServerError::NotASocket(path.to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error(e)),
    }
    let listener = UnixListener::bind(path).map_err(io_error)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io_error)?;
    Ok(listener)
}

/// Serve connections on `listener` until `shutdown` fires.
pub async fn serve(
    listener: UnixListener,
    shared: Arc<Shared>,
    options: ServerOptions,
    mut shutdown: broadcast::Receiver<()>,
) {
    let registry = Arc::new(Registry::default());
    let options = Arc::new(options);
    loop {
        tokio::select! {
            _ = shutdown.recv() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let (shared, options, registry) = (shared.clone(), options.clone(), registry.clone());
                    let shutdown = shutdown.resubscribe();
                    tokio::spawn(async move {
                        if let Err(error) = connection(stream, &shared, &options, &registry, shutdown).await {
                            debug!(%error, "socket connection ended with an error");
                        }
                    });
                }
                Err(error) => {
                    // Out of file descriptors, for instance: back off, keep serving.
                    warn!(%error, "accept on the proxy socket failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// Open connections, for shedding the longest-idle one at the limit.
#[derive(Default)]
struct Registry {
    connections: Mutex<HashMap<u64, Entry>>,
    next_id: AtomicU64,
}

struct Entry {
    last_active: Instant,
    /// Has sent at least one valid request.
    working: bool,
    subscriber: bool,
    shed: Arc<Notify>,
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Entry>> {
        self.connections
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Admit a connection, shedding one if at `max`: a connection that never sent a request
    /// goes first (the oldest of them), then the one idle the longest; subscribers are never
    /// shed. `None`: no room (every connection subscribed).
    fn admit<'a>(&'a self, max: usize, metrics: &'a Metrics) -> Option<Slot<'a>> {
        let mut connections = self.lock();
        if connections.len() >= max {
            let idlest = connections
                .iter()
                .filter(|(_, e)| !e.subscriber)
                .min_by_key(|(_, e)| (e.working, e.last_active))
                .map(|(id, _)| *id)?;
            let entry = connections.remove(&idlest).expect("present");
            entry.shed.notify_one();
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let shed = Arc::new(Notify::new());
        connections.insert(
            id,
            Entry {
                last_active: Instant::now(),
                working: false,
                subscriber: false,
                shed: shed.clone(),
            },
        );
        metrics.set_connections(connections.len());
        Some(Slot {
            registry: self,
            metrics,
            id,
            shed,
        })
    }
}

/// An admitted connection's place in the registry; given up when dropped.
struct Slot<'a> {
    registry: &'a Registry,
    metrics: &'a Metrics,
    id: u64,
    /// Notified when the connection is shed to make room.
    shed: Arc<Notify>,
}

impl Slot<'_> {
    /// A valid request arrived (and, for `subscriber`, a subscription was made).
    fn touch(&self, subscriber: bool) {
        if let Some(entry) = self.registry.lock().get_mut(&self.id) {
            entry.last_active = Instant::now();
            entry.working = true;
            entry.subscriber |= subscriber;
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut connections = self.registry.lock();
        connections.remove(&self.id);
        self.metrics.set_connections(connections.len());
    }
}

async fn connection(
    stream: UnixStream,
    shared: &Shared,
    options: &ServerOptions,
    registry: &Registry,
    mut shutdown: broadcast::Receiver<()>,
) -> io::Result<()> {
    let peer_uid = stream.peer_cred()?.uid();
    let (read, write) = stream.into_split();
    let mut out = Writer {
        inner: BufWriter::new(write),
        metrics: &shared.metrics,
    };
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
    let Some(slot) = registry.admit(options.max_clients, &shared.metrics) else {
        return out
            .error(ProtocolError::new(
                ErrorCode::Overloaded,
                "every connection slot holds a subscription",
            ))
            .await;
    };
    serve_lines(read, &mut out, &slot, shared, options, &mut shutdown).await
}

async fn serve_lines(
    read: tokio::net::unix::OwnedReadHalf,
    out: &mut Writer<'_>,
    slot: &Slot<'_>,
    shared: &Shared,
    options: &ServerOptions,
    shutdown: &mut broadcast::Receiver<()>,
) -> io::Result<()> {
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
                    let push = shared.estimator().service(service).map(|s| s.push(pushes));
                    if let Some(push) = push {
                        out.line(&push.to_string()).await?;
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
                let started = Instant::now();
                let request = match Request::parse(&line) {
                    Ok(request) => request,
                    Err(error) => {
                        out.error(error).await?;
                        continue;
                    }
                };
                match request {
                    Request::Query { service, queue_depth, backoff_streak } => {
                        shared.metrics.record_request("query");
                        slot.touch(false);
                        let query = Query { queue_depth, backoff_streak };
                        let unit = rng.random::<f64>();
                        let answer = shared.estimator().service_mut(service).map(|s| {
                            (s.estimate(Instant::now(), query, unit), s.settings().status_code)
                        });
                        let Some((answer, status_code)) = answer else {
                            out.error(unknown_service(service)).await?;
                            continue;
                        };
                        let response = Response::RetryAfter(QueryResponse::new(&answer, status_code));
                        out.line(&response.to_string()).await?;
                        shared.metrics.record_answers(service, &answer, 1);
                        shared.metrics.record_query_duration(started.elapsed());
                    }
                    Request::Report(report) => {
                        shared.metrics.record_request("report");
                        slot.touch(false);
                        let now = Instant::now();
                        let last = reported.iter_mut().find(|(s, _)| s == report.service);
                        let from = last.as_ref().map_or(connected, |(_, at)| *at);
                        let answer = shared
                            .estimator()
                            .service_mut(report.service)
                            .map(|s| s.report(from, now, &report));
                        let Some(answer) = answer else {
                            out.error(unknown_service(report.service)).await?;
                            continue;
                        };
                        match last {
                            Some((_, at)) => *at = now,
                            None => reported.push((report.service.to_owned(), now)),
                        }
                        shared.metrics.record_answers(report.service, &answer, report.rejected);
                        shared.metrics.record_report(&report);
                        out.line(&Response::Ok.to_string()).await?;
                    }
                    Request::Subscribe { service } => {
                        shared.metrics.record_request("subscribe");
                        pushes += 1;
                        let push = shared.estimator().service(service).map(|s| s.push(pushes));
                        let Some(push) = push else {
                            out.error(unknown_service(service)).await?;
                            continue;
                        };
                        slot.touch(true);
                        if !subscriptions.iter().any(|s| s == service) {
                            subscriptions.push(service.to_owned());
                        }
                        out.line(&push.to_string()).await?;
                    }
                    Request::Health => {
                        shared.metrics.record_request("health");
                        slot.touch(false);
                        let last_tick = *shared.last_tick.lock().unwrap_or_else(|p| p.into_inner());
                        let health = Response::Health(HealthResponse {
                            uptime_s: shared.started.elapsed().as_secs(),
                            ticks: shared.ticks.load(Ordering::Relaxed),
                            last_tick_ms: last_tick.map(|t| t.elapsed().as_millis() as u64),
                            services: shared.estimator().services().count(),
                            endpoints: shared.endpoints.load(Ordering::Relaxed),
                            connections: slot.registry.lock().len(),
                        });
                        out.line(&health.to_string()).await?;
                    }
                }
            }
        }
    }
}

fn unknown_service(service: &str) -> ProtocolError {
    ProtocolError::new(
        ErrorCode::UnknownService,
        format!("no service {service:?} is configured"),
    )
}

/// The write half, which counts the errors it sends.
struct Writer<'a> {
    inner: BufWriter<tokio::net::unix::OwnedWriteHalf>,
    metrics: &'a Metrics,
}

impl Writer<'_> {
    async fn line(&mut self, line: &str) -> io::Result<()> {
        self.inner.write_all(line.as_bytes()).await?;
        self.inner.write_all(b"\n").await?;
        self.inner.flush().await
    }

    async fn error(&mut self, error: ProtocolError) -> io::Result<()> {
        self.metrics.record_error(error.code);
        self.line(&error.to_string()).await
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
