//! The daemon's main loop: attach, watch the configured endpoints, read a snapshot each tick,
//! stop when told to.

use std::{future::Future, path::PathBuf};

use tokio::{io::unix::AsyncFd, sync::watch};
use tracing::{debug, info, warn};

use crate::{
    config::Config,
    estimate::Estimator,
    kernel::{Probe, ProbeError, ProbeOptions},
    snapshot::Snapshot,
};

/// Why the daemon stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The kernel side failed (attach, watch, or a read).
    #[error(transparent)]
    Probe(#[from] ProbeError),
}

/// Run the agent until `shutdown` completes. Every program is detached before this returns,
/// whether it returns `Ok` or an error.
///
/// `snapshots` receives every tick's snapshot (consumers see the latest only).
///
/// # Errors
/// [`RunError`] if the programs cannot be attached or the counters cannot be read.
pub async fn run(
    config: Config,
    snapshots: watch::Sender<Option<Snapshot>>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RunError> {
    let options = ProbeOptions {
        cgroup: config.agent.cgroup.as_ref().map(PathBuf::from),
        max_connections: Some(config.agent.max_connections),
        debug_log: tracing::enabled!(tracing::Level::DEBUG),
    };
    let mut probe = Probe::attach(&options)?;
    forward_ebpf_logs(&mut probe);
    for endpoint in config.watched_endpoints() {
        probe.watch(endpoint)?;
    }
    info!(
        cgroup = %probe.cgroup().display(),
        endpoints = ?probe.watched().map(ToString::to_string).collect::<Vec<_>>(),
        "attached; watching"
    );

    let mut estimator = Estimator::from_config(&config);
    let mut tick = tokio::time::interval(config.agent.tick_interval());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tick.tick() => {
                let snapshot = probe.read()?;
                for endpoint in &snapshot.endpoints {
                    debug!(
                        endpoint = %endpoint.endpoint,
                        side = endpoint.side.as_str(),
                        opened = endpoint.counters.connections_opened,
                        closed = endpoint.counters.connections_closed,
                        requests = endpoint.counters.requests_started,
                        responses = endpoint.counters.responses_completed,
                        in_flight = endpoint.in_flight(),
                        backlog = ?endpoint.accept_backlog,
                        "tick"
                    );
                }
                debug!(probe = ?snapshot.probe, "tick");
                estimator.observe(&snapshot);
                for (name, service) in estimator.services() {
                    let signals = service.signals(Default::default());
                    debug!(
                        service = name,
                        drain_rate = ?signals.drain_rate,
                        queue_depth = signals.queue_depth,
                        source = signals.queue_depth_source.as_str(),
                        admitted_share = ?service.judge().admitted_share(),
                        "estimate"
                    );
                }
                snapshots.send_replace(Some(snapshot));
            }
        }
    }
    drop(probe);
    info!("detached; stopped");
    Ok(())
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
    let logger =
        match unsafe { AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) } {
            Ok(logger) => logger,
            Err(error) => {
                warn!(%error, "eBPF log records will not be forwarded");
                return;
            }
        };
    let mut logger = logger;
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
