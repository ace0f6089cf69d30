//! The daemon: attach, watch the configured endpoints, serve proxies and metrics, read the
//! counters and update the estimates each tick, stop when told to.

use std::{
    future::Future,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::{io::unix::AsyncFd, sync::broadcast};
use tracing::{debug, info, warn};

use crate::{
    attach, error_chain,
    instance::{InstanceError, InstanceLock},
    kernel::{
        FeatureState, Http2Options, KernelFeature, KernelSupport, Probe, ProbeError, ProbeOptions,
        WatchOptions, cgroup_scope,
    },
    metrics, privileges,
    server::{self, ServerError, ServerOptions},
    shared::Shared,
};
use retry_after_estimator::{
    Estimator,
    config::{AgentConfig, AttachCgroups, Config},
    snapshot::Snapshot,
};

/// Consecutive failed counter reads after which the probe is taken as gone.
const MAX_FAILED_READS: u32 = 10;

/// Open files the daemon needs beyond its connections: BPF maps, programs and links, the log
/// ring buffer, netlink, the listeners, the runtime.
const OPEN_FILES_RESERVE: u64 = 256;

/// Why the daemon stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Another agent runs on this node.
    #[error(transparent)]
    Instance(#[from] InstanceError),
    /// The kernel side failed (attach, watch, or a read).
    #[error(transparent)]
    Probe(#[from] ProbeError),
    /// The proxy socket could not be set up.
    #[error(transparent)]
    Server(#[from] ServerError),
    /// A service's `proxy_cgroup` cannot be used.
    #[error("proxy_cgroup {path}: cannot scope the client side to it")]
    ProxyCgroup {
        /// The configured path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The counters could not be read for many ticks in a row.
    #[error(
        "the kernel counters could not be read for {ticks} ticks in a row: the programs are gone"
    )]
    ProbeGone {
        /// Ticks in a row.
        ticks: u32,
        /// The last error.
        #[source]
        source: ProbeError,
    },
    /// The open-files limit is below what the configuration needs and cannot be raised.
    #[error(
        "agent.max_clients = {max_clients} needs {needed} open files, but the hard limit is {hard}: raise it (LimitNOFILE= in the unit, ulimit -Hn) or lower agent.max_clients"
    )]
    OpenFiles {
        /// The configured connection limit.
        max_clients: usize,
        /// Open files needed.
        needed: u64,
        /// The hard limit.
        hard: u64,
    },
    /// The capabilities could not be given up after attaching.
    #[error("cannot give up capabilities after attaching")]
    DropPrivileges(#[source] std::io::Error),
    /// The metrics endpoint could not be bound.
    #[error("cannot listen for metrics on {addr}")]
    Metrics {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Run the agent until `shutdown` completes. Every program is detached and the socket file
/// removed before this returns, whether it returns `Ok` or an error.
///
/// # Errors
/// [`RunError`] if the programs, the socket or the metrics endpoint cannot be set up, or the
/// counters cannot be read.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
    let agent = &config.agent;
    let lock = InstanceLock::acquire()?;
    raise_open_files(agent.max_clients)?;
    let probe = attach_and_watch(&config)?;
    let shared = Arc::new(Shared::new(config.estimator(), probe.watched().count()));
    shared.metrics().record_kernel_features(
        KernelFeature::ALL
            .map(|feature| (feature.name(), probe.kernel_support().features.has(feature))),
    );
    let metrics_listener = metrics::bind(agent.metrics_listen)
        .await
        .map_err(|source| RunError::Metrics {
            addr: agent.metrics_listen,
            source,
        })?;
    let listener = server::bind(&agent.socket_path, agent.socket_mode)?;
    let _socket_file = RemoveOnDrop(agent.socket_path.clone());
    // Everything privileged is done: attached, watched, bound. Give it all up before the
    // first byte from another process is parsed.
    privileges::drop_all().map_err(RunError::DropPrivileges)?;
    if privileges::keeps_bpf() {
        warn!(
            "this kernel refuses every bpf() call without CAP_BPF (kernel.unprivileged_bpf_disabled): \
             CAP_BPF is kept, and no other capability, so the counters stay readable"
        );
    }
    // The first tick before the first client: a query or a scrape right after start finds
    // every service's series and the kernel's first snapshot.
    tick_once(&probe, &shared, &mut 0)?;
    let (stop, _) = broadcast::channel::<()>(1);
    let server = tokio::spawn(server::serve(
        listener,
        shared.clone(),
        server_options(agent),
        stopped(&stop),
    ));
    let metrics_server = tokio::spawn(metrics::serve(
        metrics_listener,
        shared.clone(),
        stopped(&stop),
    ));
    let announcer = lock
        .announce(format!(
            "pid={} socket={} metrics={}",
            std::process::id(),
            agent.socket_path.display(),
            agent.metrics_listen
        ))
        .map_err(|e| RunError::Instance(InstanceError::Io(e)))?;
    log_serving(&probe, agent);
    let result = tick_until(shutdown, &probe, &shared, agent.tick_interval).await;
    let _ = stop.send(());
    let _ = server.await;
    let _ = metrics_server.await;
    announcer.abort();
    drop(probe);
    info!("detached; stopped");
    result
}

/// Say where the programs attach and why: with `"auto"`, the owners found (or why it falls
/// back to the root, with the cost); at the root by default, the cgroups `"auto"` would use.
fn log_attach_plan(config: &Config, plan: &attach::AttachPlan) {
    match (&config.agent.attach_cgroups, &plan.auto) {
        (AttachCgroups::Auto, Err(_)) => {
            warn!("agent.attach_cgroups = \"auto\" {}", plan.auto_described())
        }
        (AttachCgroups::Auto, Ok(_)) => info!(
            "agent.attach_cgroups = \"auto\" {}: the watched sockets' owners: {}",
            plan.auto_described(),
            plan.owners_listed()
        ),
        (AttachCgroups::Root, Ok(_)) => info!(
            "attached at the cgroup root: {}; the watched sockets' owners: {}; with \
             agent.attach_cgroups = \"auto\", the agent {}",
            attach::ROOT_COST,
            plan.owners_listed(),
            plan.auto_described()
        ),
        (AttachCgroups::Root | AttachCgroups::Paths(_), _) => {}
    }
}

/// Attach the programs (where `agent.attach_cgroups` says; `"auto"` resolved now) and watch
/// every configured endpoint, each scoped to its proxy's cgroup where one is set.
fn attach_and_watch(config: &Config) -> Result<Probe, RunError> {
    let plan = attach::plan(config, Path::new("/proc"));
    log_attach_plan(config, &plan);
    let options = ProbeOptions {
        cgroup: config.agent.cgroup.clone(),
        attach_to: plan.dirs,
        debug_log: tracing::enabled!(tracing::Level::DEBUG),
        http2: Http2Options {
            max_streams: config.agent.http2_max_streams,
            stream_timeout: config.agent.http2_stream_timeout,
        },
        ..ProbeOptions::default()
    };
    let mut probe = Probe::attach(&options)?;
    forward_ebpf_logs(&mut probe);
    log_kernel_support(probe.kernel_support());
    let scopes = config.client_scopes();
    let protocols = config.protocols();
    for endpoint in config.watched_endpoints() {
        // Scopes resolve against the hierarchy the programs attached to: `agent.cgroup` when
        // given (in a pod, the host's hierarchy mounted into the container), else the root.
        let scope = match scopes.get(&endpoint) {
            Some(path) => Some(cgroup_scope(probe.cgroup(), path).map_err(|source| {
                RunError::ProxyCgroup {
                    path: path.to_path_buf(),
                    source,
                }
            })?),
            None => None,
        };
        let options = WatchOptions {
            client_scope: scope,
            protocol: protocols.get(&endpoint).copied().unwrap_or_default(),
        };
        probe.watch_with(endpoint, options)?;
    }
    Ok(probe)
}

/// The socket server's limits, from the configuration.
fn server_options(agent: &AgentConfig) -> ServerOptions {
    ServerOptions {
        allowed_uids: agent.allowed_uids.clone(),
        max_clients: agent.max_clients,
        idle_timeout: agent.client_idle_timeout,
        write_timeout: agent.client_write_timeout,
    }
}

/// Completes when `stop` sends (or is dropped).
fn stopped(stop: &broadcast::Sender<()>) -> impl Future<Output = ()> + use<> {
    let mut stopped = stop.subscribe();
    async move {
        let _ = stopped.recv().await;
    }
}

/// What this kernel runs and lacks, once: a line for the features, a warning for each thing
/// switched off.
fn log_kernel_support(support: &KernelSupport) {
    let features: Vec<String> = support
        .features
        .iter()
        .map(|(feature, state)| match state {
            FeatureState::Present => format!("{}=yes", feature.name()),
            FeatureState::Missing(_) => format!("{}=no", feature.name()),
        })
        .collect();
    info!(programs = ?support.programs(), features = %features.join(" "), "kernel features probed");
    for limit in support.limits() {
        warn!("{limit}");
    }
}

/// The line that says the agent is up, and with what.
fn log_serving(probe: &Probe, agent: &AgentConfig) {
    info!(
        cgroups = ?probe.attached_cgroups(),
        socket = %agent.socket_path.display(),
        metrics = %agent.metrics_listen,
        endpoints = ?probe.watched().map(ToString::to_string).collect::<Vec<_>>(),
        capabilities = privileges::effective().as_deref().unwrap_or("unknown"),
        "attached; serving"
    );
}

/// Read the counters and update the estimates every `interval` until `shutdown` completes
/// (the first tick was taken before serving). A failed read is counted and retried next
/// tick; only a probe whose maps stay unreadable (the programs are gone) ends the daemon.
async fn tick_until(
    shutdown: impl Future<Output = ()>,
    probe: &Probe,
    shared: &Shared,
    interval: Duration,
) -> Result<(), RunError> {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    let mut failed_reads = 0u32;
    loop {
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            _ = tick.tick() => tick_once(probe, shared, &mut failed_reads)?,
        }
    }
}

/// One tick: read the counters and update the estimates, or count a failed read (`failed_reads`
/// in a row; too many and the probe is gone).
fn tick_once(probe: &Probe, shared: &Shared, failed_reads: &mut u32) -> Result<(), RunError> {
    let started = Instant::now();
    match probe.read() {
        Ok(snapshot) => {
            *failed_reads = 0;
            update(shared, &snapshot, started);
        }
        Err(error) => {
            shared.metrics().record_tick_error("counters");
            *failed_reads += 1;
            warn!(error = %error_chain(&error), failed_reads = *failed_reads, "cannot read the kernel counters");
            if *failed_reads >= MAX_FAILED_READS {
                return Err(RunError::ProbeGone {
                    ticks: *failed_reads,
                    source: error,
                });
            }
        }
    }
    Ok(())
}

/// One tick's work on a fresh snapshot: the estimates, the metrics, then the subscribers.
fn update(shared: &Shared, snapshot: &Snapshot, started: Instant) {
    if let Some(error) = &snapshot.backlog_error {
        shared.metrics().record_tick_error("backlogs");
        debug!(%error, "listener backlogs not read this tick");
    }
    {
        let mut estimator = shared.estimator();
        estimator.observe(snapshot);
        shared
            .metrics()
            .record_tick(snapshot, &estimator, started.elapsed());
        // Only when asked for: this runs under the lock that queries wait on.
        if tracing::enabled!(tracing::Level::DEBUG) {
            log_estimates(&estimator);
        }
    }
    shared.tick_done();
}

/// Raise the soft open-files limit to what `max_clients` connections need (the default soft
/// limit of a service, 1024, is below it for large `max_clients`), or refuse clearly.
fn raise_open_files(max_clients: usize) -> Result<(), RunError> {
    let needed = max_clients as u64 + metrics::MAX_HTTP_CONNECTIONS as u64 + OPEN_FILES_RESERVE;
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Ok(());
    }
    if limit.rlim_cur >= needed {
        return Ok(());
    }
    if limit.rlim_max < needed {
        return Err(RunError::OpenFiles {
            max_clients,
            needed,
            hard: limit.rlim_max,
        });
    }
    let raised = libc::rlimit {
        rlim_cur: needed,
        rlim_max: limit.rlim_max,
    };
    // SAFETY: setrlimit reads the struct we own.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
        info!(
            from = limit.rlim_cur,
            to = needed,
            "raised the open-files limit"
        );
    }
    Ok(())
}

/// One debug line per service: what the estimate is made of after this tick.
fn log_estimates(estimator: &Estimator) {
    for (name, service) in estimator.services() {
        let own = service.own_answer();
        debug!(
            service = name,
            drain_rate = ?own.signals.drain_rate,
            queue_depth = ?own.signals.queue_depth.map(|q| q.depth),
            source = ?own.signals.queue_depth.map(|q| q.source.as_str()),
            rung = own.rung.as_str(),
            reason = ?own.reason,
            "tick"
        );
    }
}

/// Removes the socket file when the daemon stops.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        remove_socket(&self.0);
    }
}

fn remove_socket(path: &Path) {
    if let Err(error) = std::fs::remove_file(path)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        warn!(%error, path = %path.display(), "cannot remove the socket file");
    }
}

/// Forward the programs' aya-log records into our log, as they arrive.
fn forward_ebpf_logs(probe: &mut Probe) {
    let logger = match probe.take_logger() {
        Ok(logger) => logger,
        Err(error) => {
            warn!(%error, "eBPF log records will not be forwarded");
            return;
        }
    };
    // SAFETY: the logger owns its ring buffer fd; flushing neither closes nor replaces it.
    let registered =
        unsafe { AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) };
    let mut logger = match registered {
        Ok(logger) => logger,
        Err(error) => {
            warn!(%error, "eBPF log records will not be forwarded");
            return;
        }
    };
    tokio::spawn(async move {
        loop {
            let Ok(mut guard) = logger.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    });
}
