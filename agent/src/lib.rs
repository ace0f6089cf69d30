//! retry-after-agent: computes Retry-After for load-shedding proxies from backend load that
//! eBPF programs observe in the kernel.
//!
//! Data flows kernel → [`kernel::Probe`] (BPF maps) → [`snapshot::Snapshot`] each tick → the
//! estimator → the proxy. See docs/architecture.md.

pub mod attach;
pub mod config;
pub mod endpoint;
pub mod estimate;
pub mod instance;
pub mod kernel;
pub mod metrics;
pub mod privileges;
pub use retry_after_protocol as protocol;
pub mod run;
pub mod server;
pub mod shared;
pub mod shutdown;
pub mod snapshot;

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
