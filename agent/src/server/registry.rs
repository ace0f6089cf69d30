//! The connections held on the proxy socket, and who makes room for whom.
//!
//! At most `max_clients` connections are held. When a new one arrives at the limit, one that
//! never sent a request is shed first (the oldest of them), else the one idle the longest.
//! Subscribers are never shed, but they may hold at most three quarters of the slots
//! (`max_subscribers`): a `SUBSCRIBE` beyond that is refused, so subscriptions can never lock
//! out the proxies that only query.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::Instant,
};

use tokio::sync::Notify;

use crate::metrics::Metrics;

/// Open connections, for shedding and the subscription cap.
pub struct Registry {
    connections: Mutex<HashMap<u64, Entry>>,
    next_id: AtomicU64,
    max_clients: usize,
    max_subscribers: usize,
}

struct Entry {
    last_active: Instant,
    /// Has sent at least one valid request.
    working: bool,
    subscriber: bool,
    shed: Arc<Notify>,
}

/// The most subscribers `max_clients` connections allow: all but a quarter (at least one slot
/// stays for connections that only query).
pub fn max_subscribers(max_clients: usize) -> usize {
    max_clients.saturating_sub((max_clients / 4).max(1))
}

impl Registry {
    /// An empty registry for at most `max_clients` connections.
    pub fn new(max_clients: usize) -> Self {
        Self {
            connections: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            max_clients: max_clients.max(1),
            max_subscribers: max_subscribers(max_clients),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Entry>> {
        self.connections
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Connections held now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Admit a connection, shedding one if at the limit (see the module docs). Always admits:
    /// subscribers never fill every slot.
    pub fn admit<'a>(&'a self, metrics: &'a Metrics) -> Slot<'a> {
        let mut connections = self.lock();
        if connections.len() >= self.max_clients
            && let Some(idlest) = connections
                .iter()
                .filter(|(_, e)| !e.subscriber)
                .min_by_key(|(_, e)| (e.working, e.last_active))
                .map(|(id, _)| *id)
            && let Some(entry) = connections.remove(&idlest)
        {
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
        Slot {
            registry: self,
            metrics,
            id,
            shed,
        }
    }
}

/// An admitted connection's place in the registry; given up when dropped.
pub struct Slot<'a> {
    registry: &'a Registry,
    metrics: &'a Metrics,
    id: u64,
    /// Notified when the connection is shed to make room.
    pub shed: Arc<Notify>,
}

impl Slot<'_> {
    /// A valid request arrived.
    pub fn touch(&self) {
        if let Some(entry) = self.registry.lock().get_mut(&self.id) {
            entry.last_active = Instant::now();
            entry.working = true;
        }
    }

    /// Make this connection a subscriber. `false` if every subscription slot is taken (it
    /// stays what it was).
    pub fn subscribe(&self) -> bool {
        let mut connections = self.registry.lock();
        let subscribers = connections.values().filter(|e| e.subscriber).count();
        let Some(entry) = connections.get_mut(&self.id) else {
            return false;
        };
        entry.last_active = Instant::now();
        entry.working = true;
        if entry.subscriber {
            return true;
        }
        if subscribers >= self.registry.max_subscribers {
            return false;
        }
        entry.subscriber = true;
        true
    }

    /// The registry it belongs to.
    pub fn registry(&self) -> &Registry {
        self.registry
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut connections = self.registry.lock();
        connections.remove(&self.id);
        self.metrics.set_connections(connections.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subscribers_never_hold_every_slot() {
        assert_eq!(max_subscribers(256), 192);
        assert_eq!(max_subscribers(4), 3);
        assert_eq!(max_subscribers(1), 0);
        let metrics = Metrics::new();
        let registry = Registry::new(4);
        let slots: Vec<_> = (0..4).map(|_| registry.admit(&metrics)).collect();
        let subscribed: Vec<bool> = slots.iter().map(Slot::subscribe).collect();
        assert_eq!(subscribed, [true, true, true, false]);
        // At the limit, a new connection sheds the one that is not a subscriber.
        let _new = registry.admit(&metrics);
        assert_eq!(registry.len(), 4);
        let shed = slots[3].shed.clone();
        assert!(
            futures_lite_poll(shed.notified()),
            "the non-subscriber was told"
        );
    }

    /// Poll a future once (the notification is stored, so one poll sees it).
    fn futures_lite_poll(future: impl std::future::Future<Output = ()>) -> bool {
        let waker = std::task::Waker::noop();
        let mut context = std::task::Context::from_waker(waker);
        let mut future = std::pin::pin!(future);
        future.as_mut().poll(&mut context).is_ready()
    }
}
