//! The agent's configuration: a TOML file (`file.rs`), validated whole into typed values
//! before anything is attached, so every other module reads durations, addresses, endpoints
//! and policies, never strings to parse again.
//!
//! A bad file is refused whole with the path of the offending field and the reason
//! (`service[0].backends[1].address: ...`). Unknown fields are errors too: a misspelt key
//! silently ignored is a wrong Retry-After later. Every number is bounded where a larger one
//! would fail later (a map too large to create, a duration that overflows, a name no proxy
//! can ask for).

mod file;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use retry_after_common::{MAX_WATCHED_ENDPOINTS, Protocol};
use retry_after_policy::{
    MAX_KEPT_RETRY_AFTER_S, MAX_RETRY_AFTER_S, PolicyConstants, RetryAfterPolicy,
};
use retry_after_protocol::MAX_SERVICE_NAME_LEN;

use self::file::{
    AgentFile, AttachCgroupsFile, BackendFile, BackpressureFile, ConfigFile, ServiceFile,
};
use crate::endpoint::Endpoint;
use crate::{DrainRateConstants, Estimator, RejectedAt, ReplicaQueue, ServiceSettings};

/// The configuration the agent runs with when no file is given. It watches port 8080 on every
/// address, computes Retry-After with the proposal's policy and falls back to 5 s until warm.
pub const DEFAULT_CONFIG: &str = include_str!("../default-config.toml");

/// A whole, valid configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Agent-wide settings.
    pub agent: AgentConfig,
    /// The services (deployments) whose backends are watched.
    pub services: Vec<ServiceConfig>,
}

/// Where the programs attach (`agent.attach_cgroups`), so which sockets run them.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum AttachCgroups {
    /// The cgroup v2 root: every socket of the node (the default).
    #[default]
    Root,
    /// The cgroups of the processes that own the watched sockets, found when the agent
    /// starts (`"auto"`); the root if none is found.
    Auto,
    /// These cgroups, absolute or relative to the hierarchy's root; none inside another.
    Paths(Vec<PathBuf>),
}

/// Agent-wide settings (`[agent]`).
#[derive(Clone, Debug, PartialEq)]
pub struct AgentConfig {
    /// How often the counters are read (1 s: the proposal's interval).
    pub tick_interval: Duration,
    /// The root of the cgroup v2 hierarchy (found from the mount table).
    pub cgroup: Option<PathBuf>,
    /// Where the programs attach: which sockets run them.
    pub attach_cgroups: AttachCgroups,
    /// The Unix socket proxies connect to.
    pub socket_path: PathBuf,
    /// Its permissions (0660).
    pub socket_mode: u32,
    /// If set, only peers with these uids are served.
    pub allowed_uids: Option<Vec<u32>>,
    /// Socket connections held at once (256).
    pub max_clients: usize,
    /// A connection that sends nothing this long is closed, unless it subscribed (30 s).
    pub client_idle_timeout: Duration,
    /// A connection whose peer does not read an answer within this is closed (1 s).
    pub client_write_timeout: Duration,
    /// The Prometheus endpoint (127.0.0.1:9464).
    pub metrics_listen: SocketAddr,
    /// Open HTTP/2 streams the kernel's stream table holds, all connections together (65,536).
    pub http2_max_streams: u32,
    /// An HTTP/2 stream open this long is abandoned and counted as expired (300 s).
    pub http2_stream_timeout: Duration,
}

/// One service (`[[service]]`): a set of backend replicas, maybe behind a proxy on this node.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceConfig {
    /// Unique name; proxies ask for the service by it.
    pub name: String,
    /// The replicas.
    pub backends: Vec<BackendConfig>,
    /// The proxy's own listener, if it runs on this node.
    pub frontend: Option<Endpoint>,
    /// Where requests are queued and rejected.
    pub rejected_at: RejectedAt,
    /// How the queue inside its replicas is read.
    pub replica_queue: ReplicaQueue,
    /// What its endpoints' connections speak, which decides how their requests are counted.
    pub protocol: Protocol,
    /// The proxy's cgroup v2, which alone counts on the backends' client side.
    pub proxy_cgroup: Option<PathBuf>,
    /// How rejections are answered.
    pub backpressure: BackpressureConfig,
}

/// One backend replica.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackendConfig {
    /// Its address.
    pub endpoint: Endpoint,
    /// Requests it serves at once (the proposal's `max_ongoing_requests`), if known.
    pub max_ongoing_requests: Option<u64>,
}

/// The proposal's BackpressureConfig, with the computed policy's constants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackpressureConfig {
    /// Status of a rejection: 429 or 503.
    pub status_code: u16,
    /// The policy.
    pub policy: RetryAfterPolicy,
    /// The static value, and the fallback of computed policies; `None`: no header.
    pub retry_after_s: Option<u64>,
    /// The drain-rate EWMA's constants.
    pub drain: DrainRateConstants,
    /// The formula's and the ladder's constants.
    pub constants: PolicyConstants,
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

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

/// The entry of a vocabulary that `value` names (its default where there is none), or an
/// error naming `field` and the names it may take.
fn named<T: std::str::FromStr + Default>(
    field: &str,
    value: Option<String>,
) -> Result<T, ConfigError>
where
    T::Err: std::fmt::Display,
{
    value
        .map(|v| v.parse::<T>())
        .transpose()
        .map_err(|e| invalid(field, e.to_string()))
        .map(Option::unwrap_or_default)
}

/// `value` within `range`, or an error naming `field`.
fn bounded<T: PartialOrd + std::fmt::Display + Copy>(
    field: &str,
    value: T,
    range: std::ops::RangeInclusive<T>,
) -> Result<T, ConfigError> {
    if range.contains(&value) {
        Ok(value)
    } else {
        Err(invalid(
            field,
            format!("{value} is outside {}..={}", range.start(), range.end()),
        ))
    }
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
        let file: ConfigFile =
            toml::from_str(text).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        let agent = agent(file.agent)?;
        let mut names = BTreeSet::new();
        let mut services = Vec::with_capacity(file.service.len());
        for (i, service_file) in file.service.into_iter().enumerate() {
            let service = service(i, service_file)?;
            if !names.insert(service.name.clone()) {
                return Err(invalid(
                    format!("service[{i}].name"),
                    format!("{:?} is used by an earlier service", service.name),
                ));
            }
            services.push(service);
        }
        let config = Self { agent, services };
        config.check_shared_backends()?;
        Ok(config)
    }

    /// The embedded default configuration.
    pub fn default_config() -> Self {
        Self::parse(DEFAULT_CONFIG).expect("the embedded default configuration is valid")
    }

    /// The client side of a backend is counted once: services sharing one share its scope.
    /// And every endpoint must fit in the watch map.
    fn check_shared_backends(&self) -> Result<(), ConfigError> {
        let mut scopes: BTreeMap<Endpoint, (usize, Option<&Path>)> = BTreeMap::new();
        for (i, service) in self.services.iter().enumerate() {
            let scope = service.proxy_cgroup.as_deref();
            for backend in &service.backends {
                let (first, theirs) = *scopes.entry(backend.endpoint).or_insert((i, scope));
                if theirs != scope {
                    return Err(invalid(
                        format!("service[{i}].proxy_cgroup"),
                        format!(
                            "{scope:?} differs from service[{first}].proxy_cgroup {theirs:?}, which shares backend {}",
                            backend.endpoint
                        ),
                    ));
                }
            }
        }
        self.check_shared_protocols()?;
        let watched = self.watched_endpoints().len();
        if watched > MAX_WATCHED_ENDPOINTS as usize {
            return Err(invalid(
                "service",
                format!("{watched} endpoints to watch; at most {MAX_WATCHED_ENDPOINTS}"),
            ));
        }
        Ok(())
    }

    /// An endpoint is watched once, as one protocol: services sharing one agree on it.
    fn check_shared_protocols(&self) -> Result<(), ConfigError> {
        let mut protocols: BTreeMap<Endpoint, (usize, Protocol)> = BTreeMap::new();
        for (i, service) in self.services.iter().enumerate() {
            let endpoints = service.backends.iter().map(|b| b.endpoint);
            for endpoint in endpoints.chain(service.frontend) {
                let (first, theirs) = *protocols.entry(endpoint).or_insert((i, service.protocol));
                if theirs != service.protocol {
                    return Err(invalid(
                        format!("service[{i}].protocol"),
                        format!(
                            "{:?} differs from service[{first}].protocol {:?}, which shares {endpoint}",
                            service.protocol.as_str(),
                            theirs.as_str()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every endpoint the configuration asks to watch (backends and frontends), once each.
    pub fn watched_endpoints(&self) -> BTreeSet<Endpoint> {
        let mut endpoints = BTreeSet::new();
        for service in &self.services {
            endpoints.extend(service.backends.iter().map(|b| b.endpoint));
            endpoints.extend(service.frontend);
        }
        endpoints
    }

    /// What each watched endpoint speaks: its service's `protocol`.
    pub fn protocols(&self) -> BTreeMap<Endpoint, Protocol> {
        let mut protocols = BTreeMap::new();
        for service in &self.services {
            let endpoints = service.backends.iter().map(|b| b.endpoint);
            for endpoint in endpoints.chain(service.frontend) {
                protocols.insert(endpoint, service.protocol);
            }
        }
        protocols
    }

    /// The proxy cgroup that scopes each scoped backend's client side.
    pub fn client_scopes(&self) -> BTreeMap<Endpoint, &Path> {
        let mut scopes = BTreeMap::new();
        for service in &self.services {
            if let Some(cgroup) = &service.proxy_cgroup {
                for backend in &service.backends {
                    scopes.insert(backend.endpoint, cgroup.as_path());
                }
            }
        }
        scopes
    }
}

impl Default for AgentConfig {
    fn default() -> Self {
        agent(AgentFile::default()).expect("the defaults are valid")
    }
}

/// Two of `paths` of which one holds the other, as far as the paths alone tell (both
/// relative, or both absolute; a mix is checked against the mounted hierarchy at attach time).
fn nested_pair(paths: &[PathBuf]) -> Option<(&PathBuf, &PathBuf)> {
    paths.iter().enumerate().find_map(|(i, a)| {
        paths[i + 1..].iter().find_map(|b| {
            if a.is_absolute() != b.is_absolute() {
                None
            } else if b.starts_with(a) {
                Some((a, b))
            } else if a.starts_with(b) {
                Some((b, a))
            } else {
                None
            }
        })
    })
}

fn agent(a: AgentFile) -> Result<AgentConfig, ConfigError> {
    let ms = |field: &str, value: u64, range| {
        bounded(&format!("agent.{field}"), value, range).map(Duration::from_millis)
    };
    let tick_interval = ms("tick_interval_ms", a.tick_interval_ms, 10..=60_000)?;
    let attach_cgroups = attach_cgroups(a.attach_cgroups)?;
    if !a.socket_path.starts_with('/') {
        return Err(invalid(
            "agent.socket_path",
            format!("{:?} is not an absolute path", a.socket_path),
        ));
    }
    let socket_mode = socket_mode(&a.socket_mode)?;
    if a.allowed_uids.as_ref().is_some_and(Vec::is_empty) {
        return Err(invalid(
            "agent.allowed_uids",
            "[] would refuse every proxy; omit it to allow any peer that can open the socket",
        ));
    }
    let max_clients = bounded("agent.max_clients", a.max_clients, 4..=65_536)?;
    let client_idle_timeout = ms(
        "client_idle_timeout_ms",
        a.client_idle_timeout_ms,
        100..=86_400_000,
    )?;
    let client_write_timeout = ms(
        "client_write_timeout_ms",
        a.client_write_timeout_ms,
        10..=60_000,
    )?;
    let metrics_listen = metrics_listen(&a.metrics_listen, a.metrics_allow_remote)?;
    let http2_max_streams = bounded(
        "agent.http2_max_streams",
        a.http2_max_streams,
        1_024..=16_777_216,
    )?;
    let http2_stream_timeout = ms(
        "http2_stream_timeout_ms",
        a.http2_stream_timeout_ms,
        1_000..=86_400_000,
    )?;
    Ok(AgentConfig {
        tick_interval,
        cgroup: a.cgroup.map(PathBuf::from),
        attach_cgroups,
        socket_path: PathBuf::from(a.socket_path),
        socket_mode,
        allowed_uids: a.allowed_uids,
        max_clients,
        client_idle_timeout,
        client_write_timeout,
        metrics_listen,
        http2_max_streams,
        http2_stream_timeout,
    })
}

/// `agent.attach_cgroups`: none (the root), `"auto"`, else distinct, non-empty, not nested
/// paths.
fn attach_cgroups(value: Option<AttachCgroupsFile>) -> Result<AttachCgroups, ConfigError> {
    let field = "agent.attach_cgroups";
    let paths = match value {
        None => return Ok(AttachCgroups::Root),
        Some(AttachCgroupsFile::Word(word)) if word == "auto" => return Ok(AttachCgroups::Auto),
        Some(AttachCgroupsFile::Word(word)) => {
            return Err(invalid(
                field,
                format!("{word:?} is neither \"auto\" nor a list of cgroup paths"),
            ));
        }
        Some(AttachCgroupsFile::Paths(paths)) => paths,
    };
    if paths.is_empty() {
        return Err(invalid(
            field,
            "[] would attach nowhere and see nothing; omit it to attach at the hierarchy's root",
        ));
    }
    for (i, path) in paths.iter().enumerate() {
        if path.is_empty() || paths[..i].contains(path) {
            return Err(invalid(field, format!("{path:?} is empty or given twice")));
        }
    }
    let paths: Vec<PathBuf> = paths.into_iter().map(PathBuf::from).collect();
    if let Some((outer, inner)) = nested_pair(&paths) {
        return Err(invalid(
            field,
            format!(
                "{:?} and {:?} are nested: name the outer one only (it holds the inner one's sockets)",
                outer.display().to_string(),
                inner.display().to_string()
            ),
        ));
    }
    Ok(AttachCgroups::Paths(paths))
}

/// `agent.socket_mode`: an octal mode.
fn socket_mode(text: &str) -> Result<u32, ConfigError> {
    match u32::from_str_radix(text, 8) {
        Ok(mode) if mode <= 0o777 => Ok(mode),
        _ => Err(invalid(
            "agent.socket_mode",
            format!("{text:?} is not an octal mode such as \"0660\""),
        )),
    }
}

/// `agent.metrics_listen`: an address, on loopback unless `allow_remote`.
fn metrics_listen(text: &str, allow_remote: bool) -> Result<SocketAddr, ConfigError> {
    let metrics_listen: SocketAddr = text.parse().map_err(|_| {
        invalid(
            "agent.metrics_listen",
            format!("{text:?} is not ADDRESS:PORT"),
        )
    })?;
    if !metrics_listen.ip().is_loopback() && !allow_remote {
        return Err(invalid(
            "agent.metrics_listen",
            format!(
                "{text:?} is not a loopback address: the metrics name backends and their load; set agent.metrics_allow_remote = true to expose them off the node"
            ),
        ));
    }
    Ok(metrics_listen)
}

fn service(i: usize, s: ServiceFile) -> Result<ServiceConfig, ConfigError> {
    let at = |field: &str| format!("service[{i}].{field}");
    if s.name.is_empty()
        || s.name.len() > MAX_SERVICE_NAME_LEN
        || !s
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(invalid(
            at("name"),
            format!(
                "{:?} must be 1 to {MAX_SERVICE_NAME_LEN} ASCII letters, digits, '-', '_' or '.'",
                s.name
            ),
        ));
    }
    if s.backends.is_empty() {
        return Err(invalid(
            at("backends"),
            "a service needs at least one backend",
        ));
    }
    let backends = backends(&at, s.backends)?;
    let frontend = s
        .frontend
        .map(|f| f.parse::<Endpoint>())
        .transpose()
        .map_err(|e| invalid(at("frontend"), e.to_string()))?;
    if let Some(n) = s.max_queued_requests {
        return Err(invalid(
            at("max_queued_requests"),
            format!(
                "{n}: the agent does not read a queue limit (the queue comes from the kernel or the proxy's queue_depth=); remove the field"
            ),
        ));
    }
    let rejected_at: RejectedAt = named(&at("rejected_at"), s.rejected_at)?;
    let replica_queue: ReplicaQueue = named(&at("replica_queue"), s.replica_queue)?;
    let protocol = s
        .protocol
        .map(|p| protocol(&p))
        .transpose()
        .map_err(|e| invalid(at("protocol"), e))?
        .unwrap_or_default();
    if s.proxy_cgroup.as_deref() == Some("") {
        return Err(invalid(
            at("proxy_cgroup"),
            "\"\" is not a cgroup; omit the field to count every process",
        ));
    }
    let backpressure = backpressure(&at("backpressure"), s.backpressure)?;
    Ok(ServiceConfig {
        name: s.name,
        backends,
        frontend,
        rejected_at,
        replica_queue,
        protocol,
        proxy_cgroup: s.proxy_cgroup.map(PathBuf::from),
        backpressure,
    })
}

/// A service's `protocol`, by its name.
fn protocol(name: &str) -> Result<Protocol, String> {
    Protocol::ALL
        .into_iter()
        .find(|p| p.as_str() == name)
        .ok_or_else(|| {
            let names: Vec<&str> = Protocol::ALL.iter().map(|p| p.as_str()).collect();
            format!("{name:?} is not one of {}", names.join(", "))
        })
}

/// A service's `backends`: each address parsed, each `max_ongoing_requests` bounded.
fn backends(
    at: &impl Fn(&str) -> String,
    files: Vec<BackendFile>,
) -> Result<Vec<BackendConfig>, ConfigError> {
    let mut backends = Vec::with_capacity(files.len());
    for (j, backend) in files.into_iter().enumerate() {
        let endpoint = backend
            .address
            .parse::<Endpoint>()
            .map_err(|e| invalid(at(&format!("backends[{j}].address")), e.to_string()))?;
        let max_ongoing_requests = backend
            .max_ongoing_requests
            .map(|n| {
                bounded(
                    &at(&format!("backends[{j}].max_ongoing_requests")),
                    n,
                    1..=1_000_000_000,
                )
            })
            .transpose()?;
        backends.push(BackendConfig {
            endpoint,
            max_ongoing_requests,
        });
    }
    Ok(backends)
}

fn backpressure(at: &str, b: BackpressureFile) -> Result<BackpressureConfig, ConfigError> {
    let section = Section(at);
    if ![429, 503].contains(&b.status_code) {
        return Err(invalid(
            section.field("status_code"),
            format!("{} is not 429 or 503", b.status_code),
        ));
    }
    let policy = section.parse("retry_after_policy", &b.retry_after_policy)?;
    Ok(BackpressureConfig {
        status_code: b.status_code,
        policy,
        retry_after_s: b
            .retry_after_s
            .map(|s| bounded(&section.field("retry_after_s"), s, 0..=86_400))
            .transpose()?,
        drain: drain_constants(&section, &b)?,
        constants: policy_constants(&section, &b, policy)?,
    })
}

/// The drain-rate average's constants of a `backpressure` section.
fn drain_constants(
    section: &Section<'_>,
    b: &BackpressureFile,
) -> Result<DrainRateConstants, ConfigError> {
    Ok(DrainRateConstants {
        alpha: section.above_zero("alpha", b.alpha, 1.0, "")?,
        warm_after: section.seconds("warm_after_s", b.warm_after_s, 3600.0)?,
        cold_after: section.seconds("cold_after_s", b.cold_after_s, 86_400.0)?,
    })
}

/// `max_retry_after_s` within 1 to 60, or up to the ticket book's horizon (300) where the
/// service keeps returns: a place minutes away is then told as it is (opt-in, for clients
/// that honour long values).
fn check_max_retry_after(
    section: &Section<'_>,
    b: &BackpressureFile,
    policy: RetryAfterPolicy,
) -> Result<(), ConfigError> {
    let (top, why) = if policy == RetryAfterPolicy::KeptReturns {
        (
            MAX_KEPT_RETRY_AFTER_S,
            "the kept places' horizon: the clamp may narrow, never widen",
        )
    } else {
        (
            MAX_RETRY_AFTER_S,
            "above 60 only where retry_after_policy = \"kept_returns\", up to 300",
        )
    };
    if (1..=top).contains(&b.max_retry_after_s) {
        return Ok(());
    }
    Err(invalid(
        section.field("max_retry_after_s"),
        format!("{} is outside 1..={top} ({why})", b.max_retry_after_s),
    ))
}

/// The policy's constants of a `backpressure` section.
fn policy_constants(
    section: &Section<'_>,
    b: &BackpressureFile,
    policy: RetryAfterPolicy,
) -> Result<PolicyConstants, ConfigError> {
    let backoff_streak_saturation = bounded(
        &section.field("backoff_streak_saturation"),
        b.backoff_streak_saturation,
        1..=1_000_000,
    )?;
    let occupancy_weight = section.between("occupancy_weight", b.occupancy_weight, 0.0, 100.0)?;
    let backoff_weight = section.between("backoff_weight", b.backoff_weight, 0.0, 100.0)?;
    let jitter = section.between("jitter", b.jitter, 0.0, 0.5)?;
    check_max_retry_after(section, b, policy)?;
    let min_retry_after_s = bounded(
        &section.field("min_retry_after_s"),
        b.min_retry_after_s,
        1..=b.max_retry_after_s,
    )?;
    let overload_rule = section.parse("overload_rule", &b.overload_rule)?;
    let overload_horizon_factor = b
        .overload_horizon_factor
        .map(|factor| section.above_zero("overload_horizon_factor", factor, 100.0, ""))
        .transpose()?;
    Ok(PolicyConstants {
        backoff_streak_saturation,
        occupancy_weight,
        backoff_weight,
        jitter,
        min_retry_after_s,
        max_retry_after_s: b.max_retry_after_s,
        overload_rule,
        overload_horizon_factor,
    })
}

/// A section of the file, for checks whose errors name `section.field` and the value.
struct Section<'a>(&'a str);

impl Section<'_> {
    /// The field's path.
    fn field(&self, name: &str) -> String {
        format!("{}.{name}", self.0)
    }

    /// `text` parsed, or an error naming the field with the parser's reason.
    fn parse<T: std::str::FromStr>(&self, name: &str, text: &str) -> Result<T, ConfigError>
    where
        T::Err: std::fmt::Display,
    {
        text.parse()
            .map_err(|e: T::Err| invalid(self.field(name), e.to_string()))
    }

    /// `value` in `(0, max]` (`unit` follows the bound in the error).
    fn above_zero(&self, name: &str, value: f64, max: f64, unit: &str) -> Result<f64, ConfigError> {
        if value > 0.0 && value <= max {
            return Ok(value);
        }
        Err(invalid(
            self.field(name),
            format!("{value} is outside (0, {max}]{unit}"),
        ))
    }

    /// `value` seconds in `(0, max]`.
    fn seconds(&self, name: &str, value: f64, max: f64) -> Result<Duration, ConfigError> {
        self.above_zero(name, value, max, " seconds")
            .map(Duration::from_secs_f64)
    }

    /// `value` in `[low, high]`.
    fn between(&self, name: &str, value: f64, low: f64, high: f64) -> Result<f64, ConfigError> {
        if (low..=high).contains(&value) {
            return Ok(value);
        }
        Err(invalid(
            self.field(name),
            format!("{value} is outside [{low}, {high}]"),
        ))
    }
}

impl Config {
    /// One cold estimator per configured service.
    pub fn estimator(&self) -> Estimator {
        Estimator::new(self.services.iter().map(ServiceConfig::settings))
    }
}

impl ServiceConfig {
    /// What shapes this service's estimate, resolved.
    pub fn settings(&self) -> ServiceSettings {
        let backpressure = &self.backpressure;
        ServiceSettings {
            name: self.name.clone(),
            rejected_at: self.rejected_at,
            replica_queue: self.replica_queue,
            policy: backpressure.policy,
            constants: backpressure.constants,
            drain: backpressure.drain,
            retry_after_s: backpressure.retry_after_s,
            status_code: backpressure.status_code,
            backends: self
                .backends
                .iter()
                .map(|b| (b.endpoint, b.max_ongoing_requests))
                .collect(),
            frontend: self.frontend,
        }
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
        assert_eq!(backpressure.policy, RetryAfterPolicy::ScheduledReturns);
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
    fn a_queue_limit_is_refused_because_nothing_reads_it() {
        let e = error_of(
            "[[service]]\nname = \"a\"\nmax_queued_requests = 64\nbackends = [{ address = \"*:1\" }]\n",
        );
        assert!(
            e.contains("service[0].max_queued_requests") && e.contains("64"),
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
        assert_eq!(b.policy, RetryAfterPolicy::Static);
        assert_eq!(b.constants, PolicyConstants::default());
        assert_eq!(b.drain, DrainRateConstants::default());
        assert_eq!(config.services[0].rejected_at, RejectedAt::Proxy);
        assert_eq!(b.status_code, 429);
        for (line, field) in [
            ("status_code = 500", "status_code"),
            ("alpha = 0.0", "alpha"),
            ("jitter = 0.9", "jitter"),
            ("max_retry_after_s = 120", "max_retry_after_s"),
            (
                "retry_after_policy = \"kept_returns\"\nmax_retry_after_s = 301",
                "max_retry_after_s",
            ),
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
    fn a_service_keeping_returns_may_tell_places_up_to_its_horizon() {
        let service = |lines: &str| {
            format!(
                "[[service]]\nname = \"a\"\nbackends = [{{ address = \"*:1\" }}]\n[service.backpressure]\n{lines}\n"
            )
        };
        let kept = Config::parse(&service(
            "retry_after_policy = \"kept_returns\"\nmax_retry_after_s = 120",
        ))
        .unwrap();
        assert_eq!(kept.services[0].backpressure.constants.clamp(), (1, 120));
        let e = error_of(&service(
            "retry_after_policy = \"scheduled_returns\"\nmax_retry_after_s = 120",
        ));
        assert!(
            e.contains("max_retry_after_s") && e.contains("120") && e.contains("kept_returns"),
            "{e}"
        );
    }

    #[test]
    fn the_policy_has_one_spelling_and_the_rejection_site_parses() {
        let config = Config::parse(
            "[[service]]\nname = \"a\"\nrejected_at = \"replica\"\nbackends = [{ address = \"*:1\" }]\n[service.backpressure]\nretry_after_policy = \"router_queue_drain_rate\"\n",
        )
        .unwrap();
        assert_eq!(config.services[0].rejected_at, RejectedAt::Replica);
        assert_eq!(
            config.services[0].backpressure.policy,
            RetryAfterPolicy::RouterQueueDrainRate
        );
        let e = error_of(
            "[[service]]\nname = \"a\"\nbackends = [{ address = \"*:1\" }]\n[service.backpressure]\nretry_after_policy = \"queue_drain_rate\"\n",
        );
        assert!(
            e.contains("retry_after_policy") && e.contains("\"queue_drain_rate\""),
            "{e}"
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
    fn the_protocol_parses_and_services_sharing_an_endpoint_agree_on_it() {
        let config = Config::parse(
            "[[service]]\nname = \"a\"\nprotocol = \"grpc\"\nbackends = [{ address = \"127.0.0.1:9\" }]\n",
        )
        .unwrap();
        let endpoint: Endpoint = "127.0.0.1:9".parse().unwrap();
        assert_eq!(config.protocols()[&endpoint], Protocol::Grpc);
        assert_eq!(
            Config::default_config().services[0].protocol,
            Protocol::Auto
        );
        let e = error_of(
            "[[service]]\nname = \"a\"\nprotocol = \"h3\"\nbackends = [{ address = \"*:1\" }]\n",
        );
        assert!(
            e.contains("service[0].protocol") && e.contains("\"h3\""),
            "{e}"
        );
        let e = error_of(
            "[[service]]\nname = \"a\"\nprotocol = \"http2\"\nbackends = [{ address = \"*:1\" }]\n\
             [[service]]\nname = \"b\"\nbackends = [{ address = \"*:1\" }]\n",
        );
        assert!(
            e.contains("service[1].protocol") && e.contains("http2"),
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
    fn attach_cgroups_is_the_root_auto_or_paths() {
        let of = |text: &str| Config::parse(text).unwrap().agent.attach_cgroups;
        assert_eq!(of(""), AttachCgroups::Root);
        assert_eq!(
            of("[agent]\nattach_cgroups = \"auto\"\n"),
            AttachCgroups::Auto
        );
        assert_eq!(
            of("[agent]\nattach_cgroups = [\"serving.slice\"]\n"),
            AttachCgroups::Paths(vec![PathBuf::from("serving.slice")])
        );
    }

    #[test]
    fn numbers_that_would_fail_later_are_refused_now() {
        for (text, field) in [
            ("[agent]\nmax_clients = 100000\n", "agent.max_clients"),
            (
                "[agent]\nclient_write_timeout_ms = 0\n",
                "agent.client_write_timeout_ms",
            ),
            ("[agent]\nallowed_uids = []\n", "agent.allowed_uids"),
            ("[agent]\nattach_cgroups = []\n", "agent.attach_cgroups"),
            (
                "[agent]\nattach_cgroups = [\"a\", \"a\"]\n",
                "agent.attach_cgroups",
            ),
            (
                "[agent]\nattach_cgroups = [\"serving.slice\", \"serving.slice/model.rejected_at\"]\n",
                "are nested",
            ),
            ("[agent]\nmax_clients = 2\n", "agent.max_clients"),
            (
                "[agent]\nattach_cgroups = \"automatic\"\n",
                "agent.attach_cgroups: \"automatic\" is neither",
            ),
        ] {
            let e = error_of(text);
            assert!(e.contains(field), "{text}: {e}");
        }
        let long = "s".repeat(retry_after_protocol::MAX_SERVICE_NAME_LEN + 1);
        let e = error_of(&format!(
            "[[service]]\nname = \"{long}\"\nbackends = [{{ address = \"*:1\" }}]\n"
        ));
        assert!(
            e.contains("service[0].name") && e.contains("1 to 128"),
            "{e}"
        );
        let e = error_of(
            "[[service]]\nname = \"a\"\nbackends = [{ address = \"*:1\", max_ongoing_requests = 10000000000 }]\n",
        );
        assert!(
            e.contains("service[0].backends[0].max_ongoing_requests"),
            "{e}"
        );
    }

    #[test]
    fn typed_values_are_parsed_once() {
        let config = Config::parse(
            "[agent]\nsocket_mode = \"0640\"\ntick_interval_ms = 250\n[[service]]\nname = \"a\"\nfrontend = \"127.0.0.1:80\"\nbackends = [{ address = \"[::1]:81\", max_ongoing_requests = 4 }]\n",
        )
        .unwrap();
        assert_eq!(config.agent.socket_mode, 0o640);
        assert_eq!(config.agent.tick_interval, Duration::from_millis(250));
        let service = &config.services[0];
        assert_eq!(service.frontend, Some("127.0.0.1:80".parse().unwrap()));
        assert_eq!(service.backends[0].endpoint, "[::1]:81".parse().unwrap());
        assert_eq!(service.backends[0].max_ongoing_requests, Some(4));
    }

    #[test]
    fn unknown_fields_are_errors() {
        let e = error_of("[agent]\ntick_intervall_ms = 100\n");
        assert!(e.contains("tick_intervall_ms"), "{e}");
    }
}
