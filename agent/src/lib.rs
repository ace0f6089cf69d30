//! retry-after-agent: computes Retry-After for load-shedding proxies from backend load that
//! eBPF programs observe in the kernel.
//!
//! Data flows kernel → [`kernel::Probe`] (BPF maps) → [`snapshot::Snapshot`] each tick → the
//! estimator → the proxy. See docs/architecture.md.

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
pub mod shutdown;
pub mod snapshot;
