//! The agent's configuration file (TOML).
//!
//! A bad file is refused whole, before anything is attached, with the path of the offending
//! field and the reason (`service[0].backends[1].address: ...`). Unknown fields are errors too:
//! a misspelt key silently ignored is a wrong Retry-After later.

use std::{collections::BTreeSet, path::Path, time::Duration};

use serde::Deserialize;

use crate::endpoint::Endpoint;

/// The configuration the agent runs with when no file is given. It watches port 8080 on every
/// address, server and client side.
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
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            tick_interval_ms: 1000,
            max_connections: retry_after_common::DEFAULT_MAX_CONNECTIONS,
            cgroup: None,
        }
    }
}

impl AgentConfig {
    /// The tick interval.
    pub fn tick_interval(&self) -> Duration {
        Duration::from_millis(self.tick_interval_ms)
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
            if let Some(frontend) = &service.frontend {
                frontend
                    .parse::<Endpoint>()
                    .map_err(|e| invalid(at("frontend"), e.to_string()))?;
            }
        }
        Ok(())
    }

    /// Every endpoint the configuration asks to watch (backends and frontends), once each.
    pub fn watched_endpoints(&self) -> BTreeSet<Endpoint> {
        let mut endpoints = BTreeSet::new();
        for service in &self.services {
            for backend in &service.backends {
                endpoints.insert(backend.address.parse().expect("validated"));
            }
            if let Some(frontend) = &service.frontend {
                endpoints.insert(frontend.parse().expect("validated"));
            }
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
    fn unknown_fields_are_errors() {
        let e = error_of("[agent]\ntick_intervall_ms = 100\n");
        assert!(e.contains("tick_intervall_ms"), "{e}");
    }
}
