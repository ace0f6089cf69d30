//! Waiting for the signal to stop.
//!
//! The daemon stops on SIGINT or SIGTERM. `run` takes any future as its shutdown trigger, so
//! tests and embedders decide when it stops.

/// Completes when the process receives SIGINT or SIGTERM.
///
/// # Errors
/// The signal handlers cannot be installed.
pub async fn signal() -> std::io::Result<&'static str> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    Ok(tokio::select! {
        _ = interrupt.recv() => "SIGINT",
        _ = terminate.recv() => "SIGTERM",
    })
}
