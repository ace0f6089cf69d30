//! Support for the integration tests and the data-path benchmark: a real HTTP/1.1 server and
//! client on loopback, and the real eBPF probe, attached.
//!
//! Nothing here stands in for the kernel, a socket or a proxy: the server and client talk over
//! real TCP on 127.0.0.1 or ::1 and the probe is the agent's own, attached to the root cgroup.

pub mod http;

use std::{
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

use retry_after_agent::{
    endpoint::Endpoint,
    kernel::{Probe, ProbeOptions},
    snapshot::{EndpointSnapshot, Snapshot},
};
use retry_after_common::Side;

/// Only one probe can be attached to the root cgroup at a time; tests in one binary take
/// turns through this lock (and `./dev test` runs them single-threaded anyway).
static ATTACHED: Mutex<()> = Mutex::new(());

/// The agent's probe, attached for the length of one test.
pub struct AttachedProbe {
    /// The probe.
    pub probe: Probe,
    _turn: MutexGuard<'static, ()>,
}

impl AttachedProbe {
    /// Attach the real programs. Panics (failing the test loudly) if that is not possible,
    /// e.g. when not run as root.
    pub fn attach() -> Self {
        let turn = ATTACHED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let probe = Probe::attach(&ProbeOptions::default()).unwrap_or_else(|error| {
            panic!(
                "cannot attach the eBPF programs (these tests must run as root with CAP_BPF): {}",
                error_chain(&error)
            )
        });
        Self { probe, _turn: turn }
    }

    /// Attach and watch `endpoints`.
    pub fn watching(endpoints: &[Endpoint]) -> Self {
        let mut attached = Self::attach();
        for endpoint in endpoints {
            attached.watch(*endpoint);
        }
        attached
    }

    /// Watch one more endpoint.
    pub fn watch(&mut self, endpoint: Endpoint) {
        self.probe
            .watch(endpoint)
            .unwrap_or_else(|error| panic!("watch {endpoint}: {}", error_chain(&error)));
    }

    /// Stop watching an endpoint.
    pub fn unwatch(&mut self, endpoint: Endpoint) {
        self.probe
            .unwatch(&endpoint)
            .unwrap_or_else(|error| panic!("unwatch {endpoint}: {}", error_chain(&error)));
    }

    /// Read a snapshot now.
    pub fn read(&self) -> Snapshot {
        self.probe
            .read()
            .unwrap_or_else(|error| panic!("read counters: {}", error_chain(&error)))
    }

    /// The counters of one endpoint and side now.
    pub fn counters(&self, endpoint: Endpoint, side: Side) -> EndpointSnapshot {
        *self
            .read()
            .endpoint(&endpoint, side)
            .unwrap_or_else(|| panic!("{endpoint} ({}) is not watched", side.as_str()))
    }

    /// Poll until `done` holds for the counters of `endpoint`/`side` (and still holds a moment
    /// later, so a count that overshoots is caught), or panic after `timeout` with the last
    /// counters seen.
    pub fn wait_for(
        &self,
        endpoint: Endpoint,
        side: Side,
        timeout: Duration,
        what: &str,
        done: impl Fn(&EndpointSnapshot) -> bool,
    ) -> EndpointSnapshot {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.counters(endpoint, side);
            if done(&seen) {
                std::thread::sleep(Duration::from_millis(200));
                let again = self.counters(endpoint, side);
                assert!(
                    done(&again),
                    "{what}: held at first, then changed: {seen:?} → {again:?}"
                );
                return again;
            }
            if Instant::now() > deadline {
                panic!("{what}: not reached within {timeout:?}; last seen {seen:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// An error and all its causes on one line.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// How long tests wait for counters to settle after the traffic is done.
pub const SETTLE: Duration = Duration::from_secs(10);
