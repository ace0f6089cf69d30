//! retry-after-agent: computes Retry-After for load-shedding proxies from backend load that
//! eBPF programs observe in the kernel.
//!
//! Data flows kernel → [`kernel::Probe`] (BPF maps) → a snapshot each tick → the estimator
//! (the `retry-after-estimator` crate) → the socket [`server`] → the proxy. See
//! docs/architecture.md. What is public here is what the daemon's binary, its tests and its
//! benchmarks use; the estimate and the configuration are the estimator crate's.

pub mod attach;
pub mod instance;
pub mod kernel;
mod metrics;
pub mod privileges;
pub mod run;
pub mod server;
pub mod shared;
pub mod shutdown;
pub mod status;

/// An error and all its causes on one line (`what: why: deeper why`).
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
