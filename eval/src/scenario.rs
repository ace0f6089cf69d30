//! Scenarios as data: a TOML file per scenario (the format is in docs/evaluation.md).
//!
//! A scenario names the replicas (service-time distribution, slowdown, cap), the proxies in
//! front of them (how many, and their queue bound), the arrival schedule (a warm-up, then
//! phases whose rates are multiples of the fleet's capacity, constant or ramping), timed
//! events (a replica lost, a replica added), and the clients (a mix of behaviours, attempts
//! each). Both the real-socket run and the simulator read the same [`Scenario`].

use std::{path::Path, time::Duration};

use serde::Deserialize;
use thiserror::Error;

use crate::load::{Behaviour, Phase};
pub use retry_after_testkit::replica::{ReplicaSpec, ServiceTime};

/// A scenario file that cannot be used.
#[derive(Debug, Error)]
pub enum ScenarioError {
    /// The file cannot be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a scenario.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong, naming the field and the value.
        message: String,
    },
}

/// One scenario, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    /// Short name (files, tables).
    pub name: String,
    /// What it models, in a line.
    pub title: String,
    /// Every replica, those absent at the start included.
    pub replicas: Vec<Replica>,
    /// Proxies in front of the fleet, each with its own queue and agent.
    pub proxies: usize,
    /// How each attempt reaches a proxy.
    pub front: Front,
    /// Each proxy's queue bound.
    pub max_queued_requests: usize,
    /// The arrival schedule; the first phase is the warm-up, whose clients are not measured.
    pub phases: Vec<Phase>,
    /// Timed events, from the start of the schedule, in time order.
    pub events: Vec<Event>,
    /// The clients' behaviours and their shares.
    pub clients: Vec<(f64, Behaviour)>,
    /// Attempts a client makes at most.
    pub attempts: u32,
    /// The agent's tick (its `tick_interval_ms`).
    pub agent_tick: Duration,
    /// How often each proxy reports to its agent.
    pub report_every: Duration,
}

/// One replica of a scenario.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Replica {
    /// How it serves.
    pub spec: ReplicaSpec,
    /// Requests it takes at once.
    pub max_ongoing_requests: usize,
    /// In service from the start (false: added by an event).
    pub present: bool,
}

impl Replica {
    /// Requests per second it completes when busy.
    pub fn capacity(&self) -> f64 {
        self.max_ongoing_requests as f64 / self.spec.mean_service_time().as_secs_f64()
    }
}

/// How the balancer in front of the proxies sends each attempt to one of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Front {
    /// A proxy drawn at random among those in service, for each attempt (round robin, least
    /// connections, DNS: a client's next attempt goes anywhere).
    Random,
    /// The proxy the client's key hashes to among those in service, consistently (HAProxy
    /// `balance hdr(<name>)` with `hash-type consistent`, nginx `hash $http_<name>
    /// consistent`, Envoy's ring hash): every attempt of a client goes to the same proxy,
    /// and a proxy leaving or joining moves only the keys it gives up or takes.
    KeyHash,
}

/// Something that happens to the fleet at a moment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Event {
    /// When, from the start of the schedule.
    pub at: Duration,
    /// What.
    pub kind: EventKind,
}

/// What an [`Event`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// The replica stops for good, as a crash: its requests in progress fail.
    LoseReplica(usize),
    /// The replica comes into service (autoscaling).
    AddReplica(usize),
    /// The proxy takes no more attempts (scaled in, restarted): the front sends them to the
    /// others. What it has queued is still served.
    ProxyLeaves(usize),
    /// The proxy, gone since it left, takes attempts again.
    ProxyJoins(usize),
}

impl Scenario {
    /// Requests per second the replicas present at the start complete when all are busy.
    pub fn capacity(&self) -> f64 {
        self.replicas
            .iter()
            .filter(|r| r.present)
            .map(Replica::capacity)
            .sum()
    }

    /// Length of the warm-up phase.
    pub fn warm_up(&self) -> Duration {
        Duration::from_secs_f64(self.phases[0].seconds)
    }

    /// Length of the whole schedule.
    pub fn length(&self) -> Duration {
        Duration::from_secs_f64(self.phases.iter().map(|p| p.seconds).sum())
    }

    /// Length of the measured part (after the warm-up).
    pub fn measured(&self) -> Duration {
        self.length() - self.warm_up()
    }

    /// The same scenario with its measured part stretched or shrunk to `seconds` (phases and
    /// events after the warm-up scaled alike): a short run of a long scenario for a test.
    ///
    /// # Panics
    /// If `seconds` is not a positive finite number (the binary checks `--seconds`).
    pub fn scaled_to(&self, seconds: f64) -> Scenario {
        assert!(
            seconds > 0.0 && seconds.is_finite(),
            "a measured length of {seconds} s"
        );
        let warm_up = self.warm_up();
        let factor = seconds / self.measured().as_secs_f64();
        let mut s = self.clone();
        for phase in s.phases.iter_mut().skip(1) {
            phase.seconds *= factor;
        }
        for event in &mut s.events {
            event.at = warm_up + event.at.saturating_sub(warm_up).mul_f64(factor);
        }
        s
    }

    /// The behaviour of the client drawn at `u` (a uniform draw from [0, 1)).
    pub fn behaviour(&self, u: f64) -> Behaviour {
        let total: f64 = self.clients.iter().map(|c| c.0).sum();
        let mut acc = 0.0;
        for (share, behaviour) in &self.clients {
            acc += share / total;
            if u < acc {
                return *behaviour;
            }
        }
        self.clients
            .last()
            .map_or(Behaviour::HonourRetryAfter, |c| c.1)
    }

    /// Read and validate a scenario file.
    pub fn from_file(path: &Path) -> Result<Self, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text).map_err(|message| ScenarioError::Invalid {
            path: path.display().to_string(),
            message,
        })
    }

    /// Parse and validate a scenario's TOML; the error names the field and the value.
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: ScenarioFile = toml::from_str(text).map_err(|e| e.to_string())?;
        file.validate()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    name: String,
    title: String,
    #[serde(default = "one")]
    proxies: usize,
    #[serde(default)]
    front: FrontFile,
    max_ongoing_requests: usize,
    max_queued_requests: usize,
    #[serde(default = "default_attempts")]
    attempts: u32,
    #[serde(default = "default_interval_ms")]
    agent_tick_ms: u64,
    #[serde(default = "default_interval_ms")]
    report_every_ms: u64,
    #[serde(default = "default_warm_up_s")]
    warm_up_s: f64,
    #[serde(default = "default_warm_up_rate")]
    warm_up_rate: f64,
    replicas: Vec<ReplicaFile>,
    phases: Vec<PhaseFile>,
    #[serde(default)]
    events: Vec<EventFile>,
    #[serde(default)]
    clients: Vec<ClientsFile>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum FrontFile {
    #[default]
    Random,
    KeyHash,
}

fn one() -> usize {
    1
}
fn default_attempts() -> u32 {
    8
}
/// The agent's tick and the proxies' report interval unless a scenario says otherwise: those
/// of the real-socket runs (the testkit's agent tick and the reference proxy's reports; the
/// agent's own default tick is 1 s and HAProxy's Lua reports every second).
fn default_interval_ms() -> u64 {
    200
}
fn default_warm_up_s() -> f64 {
    5.0
}
fn default_warm_up_rate() -> f64 {
    0.5
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplicaFile {
    #[serde(default = "one")]
    count: usize,
    service_time: ServiceTimeFile,
    #[serde(default = "unit_slowdown")]
    slowdown: f64,
    #[serde(default)]
    chunks: u32,
    max_ongoing_requests: Option<usize>,
    #[serde(default)]
    absent: bool,
}

fn unit_slowdown() -> f64 {
    1.0
}

#[derive(Debug, Deserialize)]
#[serde(tag = "distribution", rename_all = "kebab-case", deny_unknown_fields)]
enum ServiceTimeFile {
    Fixed { ms: f64 },
    Exponential { mean_ms: f64 },
    HeavyTailed { median_ms: f64, sigma: f64 },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PhaseFile {
    seconds: f64,
    rate: f64,
    ramp_to: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EventFile {
    at_s: f64,
    lose_replica: Option<usize>,
    add_replica: Option<usize>,
    proxy_leaves: Option<usize>,
    proxy_joins: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClientsFile {
    share: f64,
    behaviour: String,
    cap_s: Option<u64>,
    deadline_s: Option<u64>,
}

fn check(
    ok: bool,
    field: &str,
    value: impl std::fmt::Display,
    expected: &str,
) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(format!("{field} = {value}: expected {expected}"))
    }
}

impl ScenarioFile {
    /// The scenario this file describes, or the first field out of range, named with its
    /// value.
    fn validate(self) -> Result<Scenario, String> {
        self.check_fields()?;
        let replicas = self.replicas()?;
        let capacity: f64 = replicas
            .iter()
            .filter(|r| r.present)
            .map(Replica::capacity)
            .sum();
        check(
            capacity > 0.0,
            "replicas",
            "none present at the start",
            "at least one present",
        )?;
        let phases = self.phases(capacity)?;
        let events = self.events(&replicas, phases.iter().map(|p| p.seconds).sum())?;
        let clients = self.clients()?;
        Ok(Scenario {
            name: self.name,
            title: self.title,
            replicas,
            proxies: self.proxies,
            front: match self.front {
                FrontFile::Random => Front::Random,
                FrontFile::KeyHash => Front::KeyHash,
            },
            max_queued_requests: self.max_queued_requests,
            phases,
            events,
            clients,
            attempts: self.attempts,
            agent_tick: Duration::from_millis(self.agent_tick_ms),
            report_every: Duration::from_millis(self.report_every_ms),
        })
    }

    /// The fields checked on their own: the name, the counts, the ticks and the warm-up.
    fn check_fields(&self) -> Result<(), String> {
        check(
            !self.name.is_empty()
                && self
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-'),
            "name",
            format!("{:?}", self.name),
            "letters, digits and '-'",
        )?;
        check(
            (1..=64).contains(&self.proxies),
            "proxies",
            self.proxies,
            "1 to 64",
        )?;
        check(
            self.max_ongoing_requests >= 1,
            "max_ongoing_requests",
            self.max_ongoing_requests,
            "at least 1",
        )?;
        check(
            self.max_queued_requests >= 1,
            "max_queued_requests",
            self.max_queued_requests,
            "at least 1",
        )?;
        check(
            (1..=100).contains(&self.attempts),
            "attempts",
            self.attempts,
            "1 to 100",
        )?;
        for (field, value) in [
            ("agent_tick_ms", self.agent_tick_ms),
            ("report_every_ms", self.report_every_ms),
        ] {
            check((10..=60_000).contains(&value), field, value, "10 to 60000")?;
        }
        check(
            self.warm_up_s > 0.0 && self.warm_up_s <= 7200.0,
            "warm_up_s",
            self.warm_up_s,
            "more than 0, at most 7200",
        )?;
        check(
            (0.0..=100.0).contains(&self.warm_up_rate),
            "warm_up_rate",
            self.warm_up_rate,
            "0 to 100 (× capacity)",
        )?;
        Ok(())
    }

    fn replicas(&self) -> Result<Vec<Replica>, String> {
        let mut replicas = Vec::new();
        for (i, r) in self.replicas.iter().enumerate() {
            let at = |field: &str| format!("replicas[{i}].{field}");
            check(
                (1..=256).contains(&r.count),
                &at("count"),
                r.count,
                "1 to 256",
            )?;
            check(
                r.slowdown > 0.0 && r.slowdown.is_finite(),
                &at("slowdown"),
                r.slowdown,
                "a positive number",
            )?;
            let ms = |v: f64, field: &str| {
                check(
                    v > 0.0 && v.is_finite(),
                    &at(field),
                    v,
                    "a positive number of milliseconds",
                )
                .map(|()| Duration::from_secs_f64(v / 1000.0))
            };
            let service_time = match r.service_time {
                ServiceTimeFile::Fixed { ms: v } => ServiceTime::Fixed(ms(v, "service_time.ms")?),
                ServiceTimeFile::Exponential { mean_ms } => {
                    ServiceTime::Exponential(ms(mean_ms, "service_time.mean_ms")?)
                }
                ServiceTimeFile::HeavyTailed { median_ms, sigma } => {
                    check(
                        (0.0..=3.0).contains(&sigma),
                        &at("service_time.sigma"),
                        sigma,
                        "0 to 3",
                    )?;
                    ServiceTime::HeavyTailed {
                        median: ms(median_ms, "service_time.median_ms")?,
                        sigma,
                    }
                }
            };
            let max_ongoing_requests = r.max_ongoing_requests.unwrap_or(self.max_ongoing_requests);
            check(
                max_ongoing_requests >= 1,
                &at("max_ongoing_requests"),
                max_ongoing_requests,
                "at least 1",
            )?;
            let replica = Replica {
                spec: ReplicaSpec {
                    service_time,
                    slowdown: r.slowdown,
                    chunks: r.chunks,
                },
                max_ongoing_requests,
                present: !r.absent,
            };
            replicas.extend(std::iter::repeat_n(replica, r.count));
        }
        check(
            !replicas.is_empty(),
            "replicas",
            "[]",
            "at least one replica",
        )?;
        Ok(replicas)
    }

    fn phases(&self, capacity: f64) -> Result<Vec<Phase>, String> {
        check(
            !self.phases.is_empty(),
            "phases",
            "[]",
            "at least one phase",
        )?;
        let mut phases = vec![Phase {
            seconds: self.warm_up_s,
            rate: self.warm_up_rate * capacity,
            ramp_to: None,
        }];
        for (i, p) in self.phases.iter().enumerate() {
            let at = |field: &str| format!("phases[{i}].{field}");
            check(
                p.seconds > 0.0 && p.seconds <= 7200.0,
                &at("seconds"),
                p.seconds,
                "more than 0, at most 7200",
            )?;
            check(
                (0.0..=100.0).contains(&p.rate),
                &at("rate"),
                p.rate,
                "0 to 100 (× capacity)",
            )?;
            if let Some(to) = p.ramp_to {
                check(
                    (0.0..=100.0).contains(&to),
                    &at("ramp_to"),
                    to,
                    "0 to 100 (× capacity)",
                )?;
            }
            phases.push(Phase {
                seconds: p.seconds,
                rate: p.rate * capacity,
                ramp_to: p.ramp_to.map(|to| to * capacity),
            });
        }
        Ok(phases)
    }

    fn events(&self, replicas: &[Replica], measured_s: f64) -> Result<Vec<Event>, String> {
        let mut events = Vec::new();
        for (i, e) in self.events.iter().enumerate() {
            let at = |field: &str| format!("events[{i}].{field}");
            check(
                (0.0..=measured_s).contains(&e.at_s),
                &at("at_s"),
                e.at_s,
                "within the phases",
            )?;
            let kind = match (e.lose_replica, e.add_replica, e.proxy_leaves, e.proxy_joins) {
                (Some(r), None, None, None) => EventKind::LoseReplica(r),
                (None, Some(r), None, None) => EventKind::AddReplica(r),
                (None, None, Some(p), None) => EventKind::ProxyLeaves(p),
                (None, None, None, Some(p)) => EventKind::ProxyJoins(p),
                _ => {
                    return Err(format!(
                        "events[{i}]: expected one of lose_replica, add_replica, proxy_leaves, proxy_joins"
                    ));
                }
            };
            match kind {
                EventKind::LoseReplica(r) => {
                    check(
                        r < replicas.len(),
                        &at("lose_replica"),
                        r,
                        "the index of a replica",
                    )?;
                }
                EventKind::AddReplica(r) => {
                    let field = at("add_replica");
                    check(r < replicas.len(), &field, r, "the index of a replica")?;
                    check(!replicas[r].present, &field, r, "a replica marked absent")?;
                }
                EventKind::ProxyLeaves(p) | EventKind::ProxyJoins(p) => {
                    let field = at(if e.proxy_leaves.is_some() {
                        "proxy_leaves"
                    } else {
                        "proxy_joins"
                    });
                    check(p < self.proxies, &field, p, "the index of a proxy")?;
                }
            }
            events.push(Event {
                at: Duration::from_secs_f64(self.warm_up_s + e.at_s),
                kind,
            });
        }
        events.sort_by_key(|e| e.at);
        self.check_event_order(replicas, &events)?;
        Ok(events)
    }

    /// In time order: a replica is added once, a lost replica stays lost, a proxy leaves while
    /// in service and joins after it left, and one proxy at least is always in service.
    fn check_event_order(&self, replicas: &[Replica], events: &[Event]) -> Result<(), String> {
        let mut up: Vec<bool> = replicas.iter().map(|r| r.present).collect();
        let mut lost = vec![false; replicas.len()];
        let mut proxy_up = vec![true; self.proxies];
        for e in events {
            let at_s = (e.at.as_secs_f64() - self.warm_up_s).max(0.0);
            match e.kind {
                EventKind::LoseReplica(r) => {
                    let what = format!("lose_replica = {r} at {at_s} s");
                    check(up[r], "events", what, "a replica in service then")?;
                    (up[r], lost[r]) = (false, true);
                }
                EventKind::AddReplica(r) => {
                    let what = format!("add_replica = {r} at {at_s} s");
                    let expected = "a replica not yet added (a lost replica stays lost)";
                    check(!up[r] && !lost[r], "events", what, expected)?;
                    up[r] = true;
                }
                EventKind::ProxyLeaves(p) => {
                    let what = format!("proxy_leaves = {p} at {at_s} s");
                    check(proxy_up[p], "events", &what, "a proxy in service then")?;
                    proxy_up[p] = false;
                    check(
                        proxy_up.contains(&true),
                        "events",
                        what,
                        "another proxy in service then",
                    )?;
                }
                EventKind::ProxyJoins(p) => {
                    let what = format!("proxy_joins = {p} at {at_s} s");
                    check(!proxy_up[p], "events", what, "a proxy that left before")?;
                    proxy_up[p] = true;
                }
            }
        }
        Ok(())
    }

    fn clients(&self) -> Result<Vec<(f64, Behaviour)>, String> {
        if self.clients.is_empty() {
            return Ok(vec![(1.0, Behaviour::HonourRetryAfter)]);
        }
        let mut clients = Vec::new();
        for (i, c) in self.clients.iter().enumerate() {
            let at = |field: &str| format!("clients[{i}].{field}");
            check(
                c.share > 0.0 && c.share.is_finite(),
                &at("share"),
                c.share,
                "a positive number",
            )?;
            if c.behaviour == "honour-within" {
                let deadline = c.deadline_s.filter(|&d| d >= 1).ok_or_else(|| {
                    format!(
                        "{}: expected a deadline of 1 s or more for \"honour-within\", not {:?}",
                        at("deadline_s"),
                        c.deadline_s
                    )
                })?;
                check(
                    c.cap_s.is_none(),
                    &at("cap_s"),
                    "set",
                    "not set for \"honour-within\"",
                )?;
                clients.push((c.share, Behaviour::HonourWithin(deadline)));
                continue;
            }
            check(
                c.deadline_s.is_none(),
                &at("deadline_s"),
                "set",
                "only for \"honour-within\"",
            )?;
            let behaviour = match (c.behaviour.as_str(), c.cap_s) {
                ("honour", None) => Behaviour::HonourRetryAfter,
                ("backoff", None) => Behaviour::Backoff,
                ("honour-capped", Some(cap)) if cap >= 1 => Behaviour::HonourCapped(cap),
                ("honour-up-to", Some(cap)) if cap >= 1 => Behaviour::HonourUpTo(cap),
                (b @ ("honour-capped" | "honour-up-to"), Some(cap)) => {
                    return Err(format!(
                        "{} = {cap}: expected a limit of 1 s or more for {b:?}",
                        at("cap_s")
                    ));
                }
                (b @ ("honour-capped" | "honour-up-to"), None) => {
                    return Err(format!(
                        "{}: missing ({b:?} needs a limit in seconds)",
                        at("cap_s")
                    ));
                }
                (b @ ("honour" | "backoff"), Some(_)) => {
                    return Err(format!(
                        "{}: only for \"honour-capped\" and \"honour-up-to\", not {b:?}",
                        at("cap_s")
                    ));
                }
                (other, _) => {
                    return Err(format!(
                        "{} = {other:?}: expected \"honour\", \"backoff\", \"honour-capped\", \"honour-up-to\" or \"honour-within\"",
                        at("behaviour")
                    ));
                }
            };
            clients.push((c.share, behaviour));
        }
        Ok(clients)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STEADY: &str = r#"
name = "steady"
title = "steady"
max_ongoing_requests = 4
max_queued_requests = 32
replicas = [{ count = 4, service_time = { distribution = "exponential", mean_ms = 100 } }]
phases = [{ seconds = 25, rate = 1.5 }]
"#;

    #[test]
    fn a_minimal_file_gets_the_defaults() {
        let s = Scenario::parse(STEADY).unwrap();
        assert_eq!((s.proxies, s.attempts, s.replicas.len()), (1, 8, 4));
        assert!((s.capacity() - 160.0).abs() < 1e-9);
        assert_eq!(s.phases[0].seconds, 5.0);
        assert!((s.phases[0].rate - 80.0).abs() < 1e-9);
        assert!((s.phases[1].rate - 240.0).abs() < 1e-9);
        assert_eq!(s.length(), Duration::from_secs(30));
        assert_eq!(s.clients, vec![(1.0, Behaviour::HonourRetryAfter)]);
    }

    #[test]
    fn errors_name_the_field_and_the_value() {
        let bad = STEADY.replace("rate = 1.5", "rate = -2");
        let e = Scenario::parse(&bad).unwrap_err();
        assert!(e.contains("phases[0].rate") && e.contains("-2"), "{e}");
        let bad = format!("{STEADY}\n[[events]]\nat_s = 3\nadd_replica = 1\n");
        let e = Scenario::parse(&bad).unwrap_err();
        assert!(
            e.contains("events[0].add_replica") && e.contains("absent"),
            "{e}"
        );
        let bad = format!(
            "{STEADY}\n[[events]]\nat_s = 3\nlose_replica = 1\n[[events]]\nat_s = 4\nlose_replica = 1\n"
        );
        let e = Scenario::parse(&bad).unwrap_err();
        assert!(
            e.contains("lose_replica = 1 at 4 s") && e.contains("in service"),
            "{e}"
        );
        let bad = STEADY.replace(
            "max_queued_requests = 32",
            "max_queued_requests = 32\nwarm_up_rate = inf",
        );
        let e = Scenario::parse(&bad).unwrap_err();
        assert!(e.contains("warm_up_rate = inf"), "{e}");
        let bad = format!("{STEADY}\n[[clients]]\nshare = 1\nbehaviour = \"obey\"\n");
        let e = Scenario::parse(&bad).unwrap_err();
        assert!(
            e.contains("clients[0].behaviour") && e.contains("obey"),
            "{e}"
        );
        let e = Scenario::parse(&format!("{STEADY}\nspeed = 2\n")).unwrap_err();
        assert!(e.contains("speed"), "{e}");
    }

    #[test]
    fn proxies_leave_and_join_behind_a_front_that_hashes_keys() {
        let fleet = STEADY.replace(
            "max_queued_requests = 32",
            "max_queued_requests = 32\nproxies = 3\nfront = \"key-hash\"",
        );
        let events =
            "[[events]]\nat_s = 5\nproxy_leaves = 2\n[[events]]\nat_s = 9\nproxy_joins = 2\n";
        let s = Scenario::parse(&format!("{fleet}\n{events}")).unwrap();
        assert_eq!(s.front, Front::KeyHash);
        assert_eq!(
            s.events.iter().map(|e| e.kind).collect::<Vec<_>>(),
            [EventKind::ProxyLeaves(2), EventKind::ProxyJoins(2)]
        );
        assert_eq!(Scenario::parse(STEADY).unwrap().front, Front::Random);
        let e = Scenario::parse(&fleet.replace("key-hash", "sticky")).unwrap_err();
        assert!(e.contains("front") && e.contains("sticky"), "{e}");
        let e = Scenario::parse(&format!(
            "{fleet}\n[[events]]\nat_s = 5\nproxy_leaves = 3\n"
        ))
        .unwrap_err();
        assert!(
            e.contains("events[0].proxy_leaves = 3") && e.contains("a proxy"),
            "{e}"
        );
        let e = Scenario::parse(&format!("{fleet}\n[[events]]\nat_s = 5\nproxy_joins = 1\n"))
            .unwrap_err();
        assert!(
            e.contains("proxy_joins = 1 at 5 s") && e.contains("left"),
            "{e}"
        );
        let all_leave = (0..3)
            .map(|p| format!("[[events]]\nat_s = {}\nproxy_leaves = {p}\n", p + 1))
            .collect::<String>();
        let e = Scenario::parse(&format!("{fleet}\n{all_leave}")).unwrap_err();
        assert!(
            e.contains("proxy_leaves = 2 at 3 s") && e.contains("another proxy"),
            "{e}"
        );
    }

    #[test]
    fn scaling_keeps_the_warm_up_and_moves_events_with_the_phases() {
        let text = format!("{STEADY}\n[[events]]\nat_s = 10\nlose_replica = 0\n");
        let s = Scenario::parse(&text).unwrap().scaled_to(5.0);
        assert_eq!(s.length(), Duration::from_secs(10));
        assert_eq!(s.events[0].at, Duration::from_secs(7));
    }

    #[test]
    fn the_client_mix_is_drawn_by_share() {
        let text = format!(
            "{STEADY}\n[[clients]]\nshare = 3\nbehaviour = \"honour\"\n[[clients]]\nshare = 1\nbehaviour = \"honour-capped\"\ncap_s = 10\n"
        );
        let s = Scenario::parse(&text).unwrap();
        assert_eq!(s.behaviour(0.74), Behaviour::HonourRetryAfter);
        assert_eq!(s.behaviour(0.76), Behaviour::HonourCapped(10));
        let sdk =
            format!("{STEADY}\n[[clients]]\nshare = 1\nbehaviour = \"honour-up-to\"\ncap_s = 60\n");
        assert_eq!(
            Scenario::parse(&sdk).unwrap().behaviour(0.5),
            Behaviour::HonourUpTo(60)
        );
    }
}
