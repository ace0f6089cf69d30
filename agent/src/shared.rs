//! The state the tick loop, the socket server and the metrics endpoint share: the estimates,
//! the metrics and the tick's clock. The tick loop moves it forward with [`Shared::tick_done`];
//! everyone else reads it through the methods here.

use std::{
    sync::{
        Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Instant,
};

use tokio::sync::broadcast;

use crate::metrics::Metrics;
use retry_after_estimator::Estimator;
use retry_after_protocol::HealthResponse;

/// Ticks a subscriber may fall behind before it misses one (it then pushes on the next).
const TICKS_BUFFERED: usize = 16;

/// State shared by the tick loop, the socket server and the metrics endpoint.
pub struct Shared {
    estimator: Mutex<Estimator>,
    metrics: Metrics,
    started: Instant,
    ticks: AtomicU64,
    last_tick: Mutex<Option<Instant>>,
    endpoints: usize,
    tick: broadcast::Sender<u64>,
}

impl Shared {
    /// Fresh state around `estimator`, with `endpoints` endpoints watched.
    pub fn new(estimator: Estimator, endpoints: usize) -> Self {
        Self {
            estimator: Mutex::new(estimator),
            metrics: Metrics::new(),
            started: Instant::now(),
            ticks: AtomicU64::new(0),
            last_tick: Mutex::new(None),
            endpoints,
            tick: broadcast::channel(TICKS_BUFFERED).0,
        }
    }

    /// The estimator, even if a panicking holder poisoned the lock.
    pub fn estimator(&self) -> MutexGuard<'_, Estimator> {
        self.estimator
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The agent's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Count a finished tick, date it, and tell the subscribers its number.
    pub fn tick_done(&self) {
        let ticks = self.ticks.fetch_add(1, Ordering::Relaxed) + 1;
        *self.last_tick() = Some(Instant::now());
        let _ = self.tick.send(ticks);
    }

    /// The numbers of the ticks to come, as each finishes.
    pub fn ticks(&self) -> broadcast::Receiver<u64> {
        self.tick.subscribe()
    }

    /// The agent's health as `HEALTH` reports it, with `connections` proxy connections open.
    pub fn health(&self, connections: usize) -> HealthResponse {
        HealthResponse {
            uptime_s: self.started.elapsed().as_secs(),
            ticks: self.ticks.load(Ordering::Relaxed),
            last_tick_ms: self.last_tick().map(|t| t.elapsed().as_millis() as u64),
            services: self.estimator().services().count(),
            endpoints: self.endpoints,
            connections,
        }
    }

    fn last_tick(&self) -> MutexGuard<'_, Option<Instant>> {
        self.last_tick.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl AsRef<Metrics> for Shared {
    fn as_ref(&self) -> &Metrics {
        &self.metrics
    }
}
