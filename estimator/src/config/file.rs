//! The configuration file as written: TOML read by serde into plain strings and numbers, so
//! that validation (`super::Config::parse`) can name the exact field and value of every
//! mistake. Nothing outside the config module sees these types.

use serde::Deserialize;

/// A whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    #[serde(default)]
    pub agent: AgentFile,
    #[serde(default)]
    pub service: Vec<ServiceFile>,
}

/// `agent.attach_cgroups`: a list of paths, or a word (`"auto"`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum AttachCgroupsFile {
    Word(String),
    Paths(Vec<String>),
}

/// `[agent]`; defaults in `Default`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentFile {
    pub tick_interval_ms: u64,
    pub cgroup: Option<String>,
    pub attach_cgroups: Option<AttachCgroupsFile>,
    pub socket_path: String,
    pub socket_mode: String,
    pub allowed_uids: Option<Vec<u32>>,
    pub max_clients: usize,
    pub client_idle_timeout_ms: u64,
    pub client_write_timeout_ms: u64,
    pub metrics_listen: String,
    pub metrics_allow_remote: bool,
    pub http2_max_streams: u32,
    pub http2_stream_timeout_ms: u64,
}

impl Default for AgentFile {
    fn default() -> Self {
        Self {
            // The proposal's 1 s interval.
            tick_interval_ms: 1000,
            // The root of the mounted cgroup v2 hierarchy.
            cgroup: None,
            // The root: every socket of the node.
            attach_cgroups: None,
            socket_path: "/run/retry-after-agent/agent.sock".into(),
            // Owner and group: proxies join the socket's group.
            socket_mode: "0660".into(),
            // Every peer that can open the socket.
            allowed_uids: None,
            max_clients: 256,
            client_idle_timeout_ms: 30_000,
            client_write_timeout_ms: 1_000,
            // Loopback only.
            metrics_listen: "127.0.0.1:9464".into(),
            metrics_allow_remote: false,
            // About 6 MiB of kernel memory (see docs/kernel-observation.md).
            http2_max_streams: 65_536,
            // Five minutes: longer than any unary call, shorter than a connection's life.
            http2_stream_timeout_ms: 300_000,
        }
    }
}

/// `[[service]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceFile {
    pub name: String,
    pub backends: Vec<BackendFile>,
    pub frontend: Option<String>,
    /// Refused with a clear error: the agent reads no queue limit.
    pub max_queued_requests: Option<u64>,
    pub rejected_at: Option<String>,
    pub replica_queue: Option<String>,
    pub protocol: Option<String>,
    pub proxy_cgroup: Option<String>,
    #[serde(default)]
    pub backpressure: BackpressureFile,
}

/// One entry of `backends`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendFile {
    pub address: String,
    pub max_ongoing_requests: Option<u64>,
}

/// `[service.backpressure]`; defaults are the proposal's (see `Default`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackpressureFile {
    pub status_code: u16,
    pub retry_after_policy: String,
    pub retry_after_s: Option<u64>,
    pub alpha: f64,
    pub warm_after_s: f64,
    pub cold_after_s: f64,
    pub backoff_streak_saturation: u32,
    pub occupancy_weight: f64,
    pub backoff_weight: f64,
    pub jitter: f64,
    pub min_retry_after_s: u64,
    pub max_retry_after_s: u64,
    pub overload_rule: String,
    pub overload_horizon_factor: Option<f64>,
}

impl Default for BackpressureFile {
    fn default() -> Self {
        let c = retry_after_policy::PolicyConstants::default();
        let d = crate::DrainRateConstants::default();
        Self {
            status_code: 429,
            retry_after_policy: retry_after_policy::RetryAfterPolicy::default().to_string(),
            // No header when not computed.
            retry_after_s: None,
            alpha: d.alpha,
            warm_after_s: d.warm_after.as_secs_f64(),
            cold_after_s: d.cold_after.as_secs_f64(),
            backoff_streak_saturation: c.backoff_streak_saturation,
            occupancy_weight: c.occupancy_weight,
            backoff_weight: c.backoff_weight,
            jitter: c.jitter,
            min_retry_after_s: c.min_retry_after_s,
            max_retry_after_s: c.max_retry_after_s,
            overload_rule: c.overload_rule.to_string(),
            overload_horizon_factor: c.overload_horizon_factor,
        }
    }
}
