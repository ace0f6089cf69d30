//! Waiting for the signal to stop.
//!
//! The daemon stops on SIGINT or SIGTERM. `run` takes any future as its shutdown trigger, so
//! tests and embedders decide when it stops.

use tokio::signal::unix::{Signal, SignalKind, signal};

/// SIGINT and SIGTERM, caught from the moment [`Signals::install`] returns: a signal that
/// comes while the daemon is still attaching stops it cleanly once it is up, instead of
/// killing it.
pub struct Signals {
    interrupt: Signal,
    terminate: Signal,
}

impl Signals {
    /// Catch SIGINT and SIGTERM from now on. Must be called within a tokio runtime.
    ///
    /// # Errors
    /// The signal handlers cannot be installed.
    pub fn install() -> std::io::Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// Completes when one of them has come (at once if one came already); says which.
    pub async fn recv(mut self) -> &'static str {
        tokio::select! {
            _ = self.interrupt.recv() => "SIGINT",
            _ = self.terminate.recv() => "SIGTERM",
        }
    }
}
