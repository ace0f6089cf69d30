//! The agent's configuration file (TOML).
//!
//! A bad file is refused whole, before anything is attached, with the path of the offending
//! field and the reason (`service[0].backends[1].address: ...`). Unknown fields are errors too:
//! a misspelt key silently ignored is a wrong Retry-After later.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    time::Duration,
};

use serde::Deserialize;

use retry_after_policy::{MAX_RETRY_AFTER_S, PolicyConstants, RetryAfterPolicy};

use crate::{
    endpoint::Endpoint,
    estimate::{DrainRateConstants, Scope},
};

/// The configuration the agent runs with when no file is given. It watches port 8080 on every
/// address, server and client side, computes Retry-After with the proposal's policy and falls
/// back to 5 s until warm.
pub const DEFAULT_CONFIG: &str = include_str!("default-config.toml");

/// A whole configuration.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Agent-wide settings.
    #[serde(default)]
    pub agent: AgentConfig,
    /// The services (deployments) whose backends are watched.
    #[serde(default, rename = "service")]
    pub services: Vec<ServiceConfig>,
}

/// Agent-wide settings.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// How often the counters are read, in milliseconds (default 1000: the proposal's 1 s
    /// interval).
    pub tick_interval_ms: u64,
    /// Bound on connections tracked in the kernel at once (default 65536).
    pub max_connections: u32,
    /// cgroup v2 directory to attach to (default: the root of the mounted hierarchy).
    pub cgroup: Option<String>,
    /// Path of the Unix socket proxies connect to.
    pub socket_path: String,
    /// Permissions of the socket file, octal (default "0660": owner and group).
    pub socket_mode: String,
    /// If set, only peers with these uids (SO_PEERCRED) are served.
    pub allowed_uids: Option<Vec<u32>>,
    /// Socket connections held at once; at the limit the longest-idle one is shed (256).
    pub max_clients: usize,
    /// A connection that sends no request for this long is closed, unless it subscribed
    /// (30000).
    pub client_idle_timeout_ms: u64,
    /// A connection whose peer does not read an answer within this is closed (1000).
    pub client_write_timeout_ms: u64,
    /// Address of the Prometheus endpoint (`/metrics`), loopback by default.
    pub metrics_listen: String,
    /// Allow `metrics_listen` on an address other than loopback. The metrics name backend
    /// addresses and load: exposing them off the node is a choice to make on purpose (false).
    pub metrics_allow_remote: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            tick_interval_ms: 1000,
            max_connections: retry_after_common::DEFAULT_MAX_CONNECTIONS,
            cgroup: None,
            socket_path: "/run/retry-after-agent/agent.sock".into(),
            socket_mode: "0660".into(),
            allowed_uids: None,
            max_clients: 256,
            client_idle_timeout_ms: 30_000,
            client_write_timeout_ms: 1_000,
            metrics_listen: "127.0.0.1:9464".into(),
            metrics_allow_remote: false,
        }
    }
}

impl AgentConfig {
    /// The tick interval.
    pub fn tick_interval(&self) -> Duration {
        Duration::from_millis(self.tick_interval_ms)
    }

    /// The socket file mode (validated).
    pub fn socket_mode(&self) -> u32 {
        u32::from_str_radix(&self.socket_mode, 8).expect("validated")
    }

    /// The metrics address (validated).
    pub fn metrics_listen(&self) -> std::net::SocketAddr {
        self.metrics_listen.parse().expect("validated")
    }

    /// The idle timeout of socket connections.
    pub fn client_idle_timeout(&self) -> Duration {
        Duration::from_millis(self.client_idle_timeout_ms)
    }

    /// The write deadline of socket connections.
    pub fn client_write_timeout(&self) -> Duration {
        Duration::from_millis(self.client_write_timeout_ms)
    }
}

/// One service: a set of backend replicas, optionally behind a proxy listener on this node.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// Unique name; proxies ask for the service by it.
    pub name: String,
    /// The replicas.
    pub backends: Vec<BackendConfig>,
    /// The proxy's own listener, if it runs on this node.
    pub frontend: Option<String>,
    /// The proxy's queue limit for this service (the proposal's `max_queued_requests`).
    pub max_queued_requests: Option<u64>,
    /// Where requests are queued and rejected: `proxy` (default: the proxy on this node;
    /// drain is this node's client-side completions) or `replica` (the replicas on this node;
    /// drain is their server-side completions). See docs/estimator.md.
    pub rejected_at: Option<String>,
    /// The proxy's cgroup v2 (its systemd unit's or pod's), absolute or relative to the
    /// hierarchy's root, e.g. `system.slice/haproxy.service`: only connections it (or a
    /// descendant) opens to the backends count on the client side, so other processes on the
    /// node that call the same replicas change nothing. Unset: every process on the node.
    pub proxy_cgroup: Option<String>,
    /// How rejections are answered (the proposal's BackpressureConfig).
    #[serde(default)]
    pub backpressure: BackpressureConfig,
}

impl ServiceConfig {
    /// Where requests are queued and rejected (validated).
    pub fn rejected_at(&self) -> Scope {
        self.rejected_at
            .as_deref()
            .map_or(Scope::default(), |s| s.parse().expect("validated"))
    }

    /// The frontend endpoint, if any (validated).
    pub fn frontend_endpoint(&self) -> Option<Endpoint> {
        self.frontend
            .as_ref()
            .map(|f| f.parse().expect("validated"))
    }
}

/// The proposal's BackpressureConfig, with the computed policy's constants beside it.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BackpressureConfig {
    /// Status of a rejection: 429 (default) or 503.
    pub status_code: u16,
    /// `static` (default) or `router_queue_drain_rate` (alias `queue_drain_rate`).
    pub retry_after_policy: String,
    /// The static value, and the fallback of computed policies; none: no header.
    pub retry_after_s: Option<u64>,
    /// EWMA weight of the newest second (0.3), whatever the tick interval.
    pub alpha: f64,
    /// Seconds with completions before the drain rate is used (3).
    pub warm_after_s: f64,
    /// Seconds without backend work after which the drain rate is forgotten (30).
    pub cold_after_s: f64,
    /// Backoff streak at which the backoff signal saturates: B (5).
    pub backoff_streak_saturation: u32,
    /// Weight of occupancy: w1 (0.25).
    pub occupancy_weight: f64,
    /// Weight of the backoff signal: w2 (0.25).
    pub backoff_weight: f64,
    /// Relative jitter, 0 to 0.5 (0.2 = ±20%).
    pub jitter: f64,
    /// Lower clamp, seconds (1).
    pub min_retry_after_s: u64,
    /// Upper clamp, seconds (60, the most allowed).
    pub max_retry_after_s: u64,
}

impl Default for BackpressureConfig {
    fn default() -> Self {
        let c = PolicyConstants::default();
        let d = DrainRateConstants::default();
        Self {
            status_code: 429,
            retry_after_policy: RetryAfterPolicy::default().to_string(),
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
        }
    }
}

impl BackpressureConfig {
    /// The policy (validated).
    pub fn policy(&self) -> RetryAfterPolicy {
        self.retry_after_policy.parse().expect("validated")
    }

    /// The drain-rate EWMA's constants (validated).
    pub fn drain_constants(&self) -> DrainRateConstants {
        DrainRateConstants {
            alpha: self.alpha,
            warm_after: Duration::from_secs_f64(self.warm_after_s),
            cold_after: Duration::from_secs_f64(self.cold_after_s),
        }
    }

    /// The formula's and the ladder's constants.
    pub fn constants(&self) -> PolicyConstants {
        PolicyConstants {
            backoff_streak_saturation: self.backoff_streak_saturation,
            occupancy_weight: self.occupancy_weight,
            backoff_weight: self.backoff_weight,
            jitter: self.jitter,
            min_retry_after_s: self.min_retry_after_s,
            max_retry_after_s: self.max_retry_after_s,
        }
    }

    /// The first invalid field, as (field name, reason).
    fn invalid_field(&self) -> Option<(&'static str, String)> {
        let b = self;
        if ![429, 503].contains(&b.status_code) {
            return Some((
                "status_code",
                format!("{} is not 429 or 503", b.status_code),
            ));
        }
        if let Err(e) = b.retry_after_policy.parse::<RetryAfterPolicy>() {
            return Some(("retry_after_policy", e.to_string()));
        }
        if !(b.alpha > 0.0 && b.alpha <= 1.0) {
            return Some(("alpha", format!("{} is outside (0, 1]", b.alpha)));
        }
        if !(b.warm_after_s > 0.0 && b.warm_after_s <= 3600.0) {
            return Some((
                "warm_after_s",
                format!("{} is outside (0, 3600] seconds", b.warm_after_s),
            ));
        }
        if !(b.cold_after_s > 0.0 && b.cold_after_s <= 86_400.0) {
            return Some((
                "cold_after_s",
                format!("{} is outside (0, 86400] seconds", b.cold_after_s),
            ));
        }
        if b.backoff_streak_saturation == 0 {
            return Some(("backoff_streak_saturation", "0: must be at least 1".into()));
        }
        for (field, weight) in [
            ("occupancy_weight", b.occupancy_weight),
            ("backoff_weight", b.backoff_weight),
        ] {
            if !(weight.is_finite() && weight >= 0.0) {
                return Some((field, format!("{weight} is not a non-negative number")));
            }
        }
        if !(0.0..=0.5).contains(&b.jitter) {
            return Some(("jitter", format!("{} is outside [0, 0.5]", b.jitter)));
        }
        if b.max_retry_after_s > MAX_RETRY_AFTER_S || b.max_retry_after_s == 0 {
            return Some((
                "max_retry_after_s",
                format!(
                    "{} is outside 1..={MAX_RETRY_AFTER_S} (the clamp may narrow, never widen)",
                    b.max_retry_after_s
                ),
            ));
        }
        if b.min_retry_after_s == 0 || b.min_retry_after_s > b.max_retry_after_s {
            return Some((
                "min_retry_after_s",
                format!(
                    "{} is outside 1..={}",
                    b.min_retry_after_s, b.max_retry_after_s
                ),
            ));
        }
        if let Some(s) = b.retry_after_s.filter(|s| *s > 86_400) {
            return Some(("retry_after_s", format!("{s} is more than a day")));
        }
        None
    }
}

/// One backend replica.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// `ADDRESS:PORT` or `*:PORT`.
    pub address: String,
    /// Requests the replica serves at once (the proposal's `max_ongoing_requests`).
    pub max_ongoing_requests: Option<u64>,
}

impl BackendConfig {
    /// The endpoint (validated).
    pub fn endpoint(&self) -> Endpoint {
        self.address.parse().expect("validated")
    }
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read configuration file {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The text is not valid TOML of the expected shape.
    #[error("invalid configuration: {0}")]
    Syntax(String),
    /// A field has a value that cannot be used.
    #[error("invalid configuration: {field}: {reason}")]
    Invalid {
        /// Path of the field, e.g. `service[0].backends[1].address`.
        field: String,
        /// What is wrong with its value.
        reason: String,
    },
}

impl Config {
    /// Read and validate a configuration file.
    ///
    /// # Errors
    /// [`ConfigError`] naming the file, or the field and its bad value.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text)
    }

    /// Parse and validate configuration text.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field and its bad value.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let config: Config =
            toml::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// The embedded default configuration.
    pub fn default_config() -> Self {
        Self::parse(DEFAULT_CONFIG).expect("the embedded default configuration is valid")
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: String, reason: String| ConfigError::Invalid { field, reason };
        let agent = &self.agent;
        if !(10..=60_000).contains(&agent.tick_interval_ms) {
            return Err(invalid(
                "agent.tick_interval_ms".into(),
                format!("{} is outside 10..=60000", agent.tick_interval_ms),
            ));
        }
        if agent.max_connections < 64 {
            return Err(invalid(
                "agent.max_connections".into(),
                format!("{} is below the minimum of 64", agent.max_connections),
            ));
        }
        if agent.socket_path.is_empty() || !agent.socket_path.starts_with('/') {
            return Err(invalid(
                "agent.socket_path".into(),
                format!("{:?} is not an absolute path", agent.socket_path),
            ));
        }
        if !matches!(u32::from_str_radix(&agent.socket_mode, 8), Ok(mode) if mode <= 0o777) {
            return Err(invalid(
                "agent.socket_mode".into(),
                format!(
                    "{:?} is not an octal mode such as \"0660\"",
                    agent.socket_mode
                ),
            ));
        }
        if !(1..=65_536).contains(&agent.max_clients) {
            return Err(invalid(
                "agent.max_clients".into(),
                format!("{} is outside 1..=65536", agent.max_clients),
            ));
        }
        if agent.client_idle_timeout_ms < 100 {
            return Err(invalid(
                "agent.client_idle_timeout_ms".into(),
                format!(
                    "{} is below the minimum of 100",
                    agent.client_idle_timeout_ms
                ),
            ));
        }
        if !(10..=60_000).contains(&agent.client_write_timeout_ms) {
            return Err(invalid(
                "agent.client_write_timeout_ms".into(),
                format!("{} is outside 10..=60000", agent.client_write_timeout_ms),
            ));
        }
        match agent.metrics_listen.parse::<std::net::SocketAddr>() {
            Err(_) => {
                return Err(invalid(
                    "agent.metrics_listen".into(),
                    format!("{:?} is not ADDRESS:PORT", agent.metrics_listen),
                ));
            }
            Ok(addr) if !addr.ip().is_loopback() && !agent.metrics_allow_remote => {
                return Err(invalid(
                    "agent.metrics_listen".into(),
                    format!(
                        "{:?} is not a loopback address: the metrics name backends and their load; set agent.metrics_allow_remote = true to expose them off the node",
                        agent.metrics_listen
                    ),
                ));
            }
            Ok(_) => {}
        }
        let mut names = BTreeSet::new();
        for (i, service) in self.services.iter().enumerate() {
            let at = |field: &str| format!("service[{i}].{field}");
            if service.name.is_empty()
                || !service
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            {
                return Err(invalid(
                    at("name"),
                    format!(
                        "{:?} must be non-empty ASCII letters, digits, '-', '_' or '.'",
                        service.name
                    ),
                ));
            }
            if !names.insert(service.name.as_str()) {
                return Err(invalid(
                    at("name"),
                    format!("{:?} is used by an earlier service", service.name),
                ));
            }
            if service.backends.is_empty() {
                return Err(invalid(
                    at("backends"),
                    "a service needs at least one backend".into(),
                ));
            }
            for (j, backend) in service.backends.iter().enumerate() {
                backend
                    .address
                    .parse::<Endpoint>()
                    .map_err(|e| invalid(at(&format!("backends[{j}].address")), e.to_string()))?;
                if backend.max_ongoing_requests == Some(0) {
                    return Err(invalid(
                        at(&format!("backends[{j}].max_ongoing_requests")),
                        "0 would mean the backend can serve nothing; omit it if unknown".into(),
                    ));
                }
            }
            if let Some((field, reason)) = service.backpressure.invalid_field() {
                return Err(invalid(at(&format!("backpressure.{field}")), reason));
            }
            if service.max_queued_requests == Some(0) {
                return Err(invalid(
                    at("max_queued_requests"),
                    "0 would reject everything; omit it if unknown".into(),
                ));
            }
            if service.proxy_cgroup.as_deref().is_some_and(str::is_empty) {
                return Err(invalid(
                    at("proxy_cgroup"),
                    "\"\" is not a cgroup; omit the field to count every process".into(),
                ));
            }
            if let Some(rejected_at) = &service.rejected_at {
                rejected_at
                    .parse::<Scope>()
                    .map_err(|e| invalid(at("rejected_at"), e.to_string()))?;
            }
            if let Some(frontend) = &service.frontend {
                frontend
                    .parse::<Endpoint>()
                    .map_err(|e| invalid(at("frontend"), e.to_string()))?;
            }
        }
        // The client side of a backend is counted once: services sharing it share its scope.
        let mut scopes: BTreeMap<Endpoint, (usize, Option<&str>)> = BTreeMap::new();
        for (i, service) in self.services.iter().enumerate() {
            for backend in &service.backends {
                let scope = service.proxy_cgroup.as_deref();
                let (first, theirs) = *scopes.entry(backend.endpoint()).or_insert((i, scope));
                if theirs != scope {
                    return Err(invalid(
                        format!("service[{i}].proxy_cgroup"),
                        format!(
                            "{scope:?} differs from service[{first}].proxy_cgroup {theirs:?}, which shares backend {}",
                            backend.address
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The proxy cgroup that scopes each scoped backend's client side.
    pub fn client_scopes(&self) -> BTreeMap<Endpoint, &str> {
        let mut scopes = BTreeMap::new();
        for service in &self.services {
            if let Some(cgroup) = &service.proxy_cgroup {
                for backend in &service.backends {
                    scopes.insert(backend.endpoint(), cgroup.as_str());
                }
            }
        }
        scopes
    }

    /// Every endpoint the configuration asks to watch (backends and frontends), once each.
    pub fn watched_endpoints(&self) -> BTreeSet<Endpoint> {
        let mut endpoints = BTreeSet::new();
        for service in &self.services {
            endpoints.extend(service.backends.iter().map(BackendConfig::endpoint));
            endpoints.extend(service.frontend_endpoint());
        }
        endpoints
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_of(text: &str) -> String {
        Config::parse(text).unwrap_err().to_string()
    }

    #[test]
    fn the_default_configuration_is_valid() {
        let config = Config::default_config();
        assert_eq!(config.agent, AgentConfig::default());
        assert!(!config.watched_endpoints().is_empty());
        let backpressure = &config.services[0].backpressure;
        assert_eq!(
            backpressure.policy(),
            RetryAfterPolicy::RouterQueueDrainRate
        );
        assert_eq!(backpressure.retry_after_s, Some(5));
    }

    #[test]
    fn a_bad_backend_address_names_its_field_and_value() {
        let e = error_of(
            "[[service]]\nname = \"api\"\nbackends = [{ address = \"127.0.0.1:80\" }, { address = \"nowhere\" }]\n",
        );
        assert!(e.contains("service[0].backends[1].address"), "{e}");
        assert!(e.contains("`nowhere`"), "{e}");
    }

    #[test]
    fn duplicate_names_zero_capacity_and_bad_ticks_are_refused() {
        let e = error_of(
            "[[service]]\nname = \"a\"\nbackends = [{ address = \"*:1\" }]\n[[service]]\nname = \"a\"\nbackends = [{ address = \"*:2\" }]\n",
        );
        assert!(e.contains("service[1].name") && e.contains("\"a\""), "{e}");
        let e = error_of(
            "[[service]]\nname = \"a\"\nbackends = [{ address = \"*:1\", max_ongoing_requests = 0 }]\n",
        );
        assert!(
            e.contains("service[0].backends[0].max_ongoing_requests"),
            "{e}"
        );
        let e = error_of("[agent]\ntick_interval_ms = 5\n");
        assert!(
            e.contains("agent.tick_interval_ms") && e.contains('5'),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_policy_names_its_field_and_value() {
        let e = error_of(
            "[[service]]\nname = \"a\"\nbackends = [{ address = \"*:1\" }]\n[service.backpressure]\nretry_after_policy = \"auto\"\n",
        );
        assert!(
            e.contains("service[0].backpressure.retry_after_policy"),
            "{e}"
        );
        assert!(e.contains("\"auto\""), "{e}");
    }

    #[test]
    fn backpressure_defaults_are_the_proposals_and_bad_constants_are_refused() {
        let config =
            Config::parse("[[service]]\nname = \"a\"\nbackends = [{ address = \"*:1\" }]\n")
                .unwrap();
        let b = &config.services[0].backpressure;
        assert_eq!(b.policy(), RetryAfterPolicy::Static);
        assert_eq!(b.constants(), PolicyConstants::default());
        assert_eq!(b.drain_constants(), DrainRateConstants::default());
        assert_eq!(config.services[0].rejected_at(), Scope::Proxy);
        assert_eq!(b.status_code, 429);
        for (line, field) in [
            ("status_code = 500", "status_code"),
            ("alpha = 0.0", "alpha"),
            ("jitter = 0.9", "jitter"),
            ("max_retry_after_s = 120", "max_retry_after_s"),
            (
                "min_retry_after_s = 30\nmax_retry_after_s = 10",
                "min_retry_after_s",
            ),
            ("occupancy_weight = -1.0", "occupancy_weight"),
            ("cold_after_s = 0.0", "cold_after_s"),
            ("cold_after_s = 1e20", "cold_after_s"),
            ("warm_after_s = 0.0", "warm_after_s"),
        ] {
            let e = error_of(&format!(
                "[[service]]\nname = \"a\"\nbackends = [{{ address = \"*:1\" }}]\n[service.backpressure]\n{line}\n"
            ));
            assert!(
                e.contains(&format!("service[0].backpressure.{field}")),
                "{line}: {e}"
            );
        }
    }

    #[test]
    fn the_revision_name_and_the_rejection_site_parse() {
        let config = Config::parse(
            "[[service]]\nname = \"a\"\nrejected_at = \"replica\"\nbackends = [{ address = \"*:1\" }]\n[service.backpressure]\nretry_after_policy = \"queue_drain_rate\"\n",
        )
        .unwrap();
        assert_eq!(config.services[0].rejected_at(), Scope::Replica);
        assert_eq!(
            config.services[0].backpressure.policy(),
            RetryAfterPolicy::RouterQueueDrainRate
        );
        let e = error_of(
            "[[service]]\nname = \"a\"\nrejected_at = \"client\"\nbackends = [{ address = \"*:1\" }]\n",
        );
        assert!(
            e.contains("service[0].rejected_at") && e.contains("\"client\""),
            "{e}"
        );
    }

    #[test]
    fn services_sharing_a_backend_share_its_proxy_cgroup() {
        let e = error_of(
            "[[service]]\nname = \"a\"\nproxy_cgroup = \"haproxy\"\nbackends = [{ address = \"*:1\" }]\n[[service]]\nname = \"b\"\nbackends = [{ address = \"*:1\" }]\n",
        );
        assert!(
            e.contains("service[1].proxy_cgroup") && e.contains("\"haproxy\""),
            "{e}"
        );
    }

    #[test]
    fn metrics_off_loopback_must_be_asked_for() {
        let e = error_of("[agent]\nmetrics_listen = \"0.0.0.0:9464\"\n");
        assert!(
            e.contains("agent.metrics_listen") && e.contains("metrics_allow_remote"),
            "{e}"
        );
        Config::parse("[agent]\nmetrics_listen = \"0.0.0.0:9464\"\nmetrics_allow_remote = true\n")
            .unwrap();
        Config::parse("[agent]\nmetrics_listen = \"[::1]:9464\"\n").unwrap();
    }

    #[test]
    fn unknown_fields_are_errors() {
        let e = error_of("[agent]\ntick_intervall_ms = 100\n");
        assert!(e.contains("tick_intervall_ms"), "{e}");
    }
}
