//! The policies an evaluation compares: what the rejecting proxy tells clients, from which
//! agent configuration.

use std::{fmt, str::FromStr};

use retry_after_policy::OverloadRule;
use retry_after_reference_proxy::HeaderPolicy;

/// What the rejecting proxy tells clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// No header; clients back off exponentially with jitter (the status quo).
    NoHeader,
    /// A fixed `Retry-After` of this many seconds.
    Static(u64),
    /// Computed, with the saturation factor's weights at zero (the proposal revision's form).
    ComputedSimple,
    /// Computed with the proposal's default constants.
    ComputedDefaults,
    /// Computed with the defaults, the proxy counting the clients it has told to come back and
    /// that are not due yet as part of its queue (a candidate change, not the proposal's).
    ComputedRetryBacklog,
    /// The agent's `scheduled_returns`, with this overload rule and, if given, this
    /// `overload_horizon_factor` (the clients' schedule kept by the agent and by the proxy's
    /// client library).
    ScheduledReturns(OverloadRule, Option<u32>),
    /// The agent's `kept_returns`: each proxy keeps the place it promised, by the client's key
    /// or by a return cookie (docs/estimator.md, "Kept returns"), telling places up to this
    /// `max_retry_after_s` away as they are (61 to 300; `None`: the default 60), and reading
    /// the wait each request allows or not.
    KeptReturns(KeptBy, Option<u64>, Deadlines),
}

/// Whether a proxy keeping returns reads the wait a request allows (its `deadline_header`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Deadlines {
    /// Not read: a place beyond a client's deadline is given all the same.
    Ignored,
    /// Read: a place beyond it is not given; the client is told its seconds and not to retry.
    Honoured,
}

/// How a proxy recognises a returning client under kept returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeptBy {
    /// A key the client sends on every attempt (an API-key header), kept in the book of the
    /// proxy that rejected it: a client coming back through another proxy is a fresh arrival
    /// there.
    Key,
    /// A signed return cookie the rejecting proxy sets and any proxy verifies: the place is
    /// honoured wherever the client comes back (each proxy remembers the cookies it took).
    Cookie,
    /// A key as [`KeptBy::Key`], its place shared between the proxies (HAProxy's peers
    /// replicating a stick table of the places' seconds): a client coming back through any
    /// proxy finds it there (each proxy remembers the places it took). On real sockets, with
    /// one proxy, the same as `Key`.
    SharedKey,
}

impl Policy {
    /// The policies `./dev evaluate` compares, in table order: the default `--policy` set.
    pub const ALL: [Policy; 10] = [
        Policy::NoHeader,
        Policy::Static(1),
        Policy::Static(5),
        Policy::Static(30),
        Policy::ComputedSimple,
        Policy::ComputedDefaults,
        Policy::ComputedRetryBacklog,
        Policy::ScheduledReturns(OverloadRule::LatestWithRoom, None),
        Policy::KeptReturns(KeptBy::Key, None, Deadlines::Ignored),
        Policy::KeptReturns(KeptBy::Cookie, None, Deadlines::Ignored),
    ];

    /// The static values an operator could pick, for the suite's summary.
    pub const STATIC_SWEEP: [u64; 10] = [1, 2, 3, 5, 8, 10, 15, 20, 30, 60];

    /// A short name for tables and charts.
    pub fn label(&self) -> String {
        match self {
            Policy::NoHeader => "no header".to_owned(),
            Policy::Static(s) => format!("static {s} s"),
            Policy::ComputedSimple => "computed, w1=w2=0".to_owned(),
            Policy::ComputedDefaults => "computed, defaults".to_owned(),
            Policy::ComputedRetryBacklog => "computed + retry backlog".to_owned(),
            Policy::KeptReturns(by, max, deadlines) => {
                let by = match by {
                    KeptBy::Key => "key",
                    KeptBy::Cookie => "cookie",
                    KeptBy::SharedKey => "key, shared",
                };
                let mut label = format!("kept returns ({by})");
                if let Some(max) = max {
                    label.push_str(&format!(", told up to {max} s"));
                }
                if *deadlines == Deadlines::Honoured {
                    label.push_str(", deadlines read");
                }
                label
            }
            Policy::ScheduledReturns(rule, factor) => {
                let mut label = "scheduled returns".to_owned();
                if *rule != OverloadRule::LatestWithRoom {
                    label.push_str(&format!(", {rule}"));
                }
                if let Some(k) = factor {
                    label.push_str(&format!(", horizon {k}× age"));
                }
                label
            }
        }
    }

    /// How a proxy recognises returning clients, if it keeps their places.
    pub fn kept(&self) -> Option<KeptBy> {
        match self {
            Policy::KeptReturns(by, ..) => Some(*by),
            _ => None,
        }
    }

    /// How the proxy's rejections are answered.
    pub fn header(&self) -> HeaderPolicy {
        match self {
            Policy::NoHeader => HeaderPolicy::None,
            Policy::ComputedRetryBacklog => HeaderPolicy::FromAgentWithRetryBacklog,
            _ => HeaderPolicy::FromAgent,
        }
    }

    /// The agent rung whose judge figures grade this policy, if it sends a header.
    pub fn rung(&self) -> Option<retry_after_policy::Rung> {
        match self {
            Policy::NoHeader => None,
            Policy::Static(_) => Some(retry_after_policy::Rung::Static),
            _ => Some(retry_after_policy::Rung::Computed),
        }
    }

    /// The `[service.backpressure]` lines of the agent's configuration. Computed policies fall
    /// back to a static 5 s (the ladder's middle rung) while the drain rate is not known.
    pub fn backpressure(&self) -> String {
        let common = "status_code = 429\n";
        match self {
            Policy::NoHeader => format!("{common}retry_after_policy = \"static\"\n"),
            Policy::Static(s) => {
                format!("{common}retry_after_policy = \"static\"\nretry_after_s = {s}\n")
            }
            Policy::ComputedSimple => format!(
                "{common}retry_after_policy = \"router_queue_drain_rate\"\nretry_after_s = 5\noccupancy_weight = 0.0\nbackoff_weight = 0.0\n"
            ),
            Policy::ComputedDefaults | Policy::ComputedRetryBacklog => format!(
                "{common}retry_after_policy = \"router_queue_drain_rate\"\nretry_after_s = 5\n"
            ),
            Policy::ScheduledReturns(rule, factor) => format!(
                "{common}retry_after_policy = \"scheduled_returns\"\nretry_after_s = 5\noverload_rule = \"{rule}\"\n{}",
                factor.map_or(String::new(), |k| format!(
                    "overload_horizon_factor = {k}.0\n"
                ))
            ),
            Policy::KeptReturns(_, max, _) => format!(
                "{common}retry_after_policy = \"kept_returns\"\nretry_after_s = 5\n{}",
                max.map_or(String::new(), |s| format!("max_retry_after_s = {s}\n"))
            ),
        }
    }

    /// The agent's `[[service]]` section for backends `addresses`, each taking
    /// `max_ongoing_requests`.
    pub fn service_config(&self, backends: &[(String, usize)]) -> String {
        let backends: Vec<String> = backends
            .iter()
            .map(|(address, max)| {
                format!("{{ address = \"{address}\", max_ongoing_requests = {max} }}")
            })
            .collect();
        format!(
            "[[service]]\nname = \"{SERVICE}\"\nbackends = [{}]\n[service.backpressure]\n{}",
            backends.join(", "),
            self.backpressure()
        )
    }
}

/// The service's name at the agent in every run.
pub const SERVICE: &str = "eval";

/// Every `--policy` name, for messages.
const NAMES: &str = "none, static-N (N from 1 to 60), router_queue_drain_rate[-simple|-retry_backlog], scheduled_returns[-latest|-fill_capacity][-hN] (N from 1 to 100), kept_returns[-cookie|-shared][-maxN][-deadlines] (N from 61 to 300)";

/// The `--policy` names, one rule: the configuration's `retry_after_policy` value (`none` for
/// no header), then each variant after a `-`. A variant is the value of the setting it
/// changes (`static-5`: `retry_after_s = 5`; `scheduled_returns-latest` and
/// `-fill_capacity`: the `overload_rule`; `-hN`: `overload_horizon_factor = N`) or names the
/// change (`router_queue_drain_rate-simple`: both weights 0; `-retry_backlog`: the proxy's
/// retry backlog in its depth; `kept_returns-cookie`: places kept by return cookie, not by
/// key; `-shared`: by key, the places shared between the proxies; `-maxN`: `max_retry_after_s = N`; `-deadlines`: the proxy reads the wait each request
/// allows). Words join with `_`, as in the configuration, so `-` only
/// ever separates variants.
impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::NoHeader => f.write_str("none"),
            Policy::Static(s) => write!(f, "static-{s}"),
            Policy::ComputedSimple => f.write_str("router_queue_drain_rate-simple"),
            Policy::ComputedDefaults => f.write_str("router_queue_drain_rate"),
            Policy::ComputedRetryBacklog => f.write_str("router_queue_drain_rate-retry_backlog"),
            Policy::ScheduledReturns(rule, factor) => {
                f.write_str("scheduled_returns")?;
                if *rule != OverloadRule::LatestWithRoom {
                    write!(f, "-{rule}")?;
                }
                match factor {
                    Some(k) => write!(f, "-h{k}"),
                    None => Ok(()),
                }
            }
            Policy::KeptReturns(by, max, deadlines) => {
                f.write_str("kept_returns")?;
                match by {
                    KeptBy::Key => {}
                    KeptBy::Cookie => f.write_str("-cookie")?,
                    KeptBy::SharedKey => f.write_str("-shared")?,
                }
                if let Some(s) = max {
                    write!(f, "-max{s}")?;
                }
                if *deadlines == Deadlines::Honoured {
                    f.write_str("-deadlines")?;
                }
                Ok(())
            }
        }
    }
}

impl FromStr for Policy {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        let mut parts = name.split('-');
        let base = parts.next().unwrap_or_default();
        let variants: Vec<&str> = parts.collect();
        let policy = match (base, variants.as_slice()) {
            ("none", []) => Some(Policy::NoHeader),
            ("static", [s]) => s
                .parse::<u64>()
                .ok()
                .filter(|s| (1..=60).contains(s))
                .map(Policy::Static),
            ("router_queue_drain_rate", []) => Some(Policy::ComputedDefaults),
            ("router_queue_drain_rate", ["simple"]) => Some(Policy::ComputedSimple),
            ("router_queue_drain_rate", ["retry_backlog"]) => Some(Policy::ComputedRetryBacklog),
            ("scheduled_returns", variants) => scheduled(variants),
            ("kept_returns", variants) => kept(variants),
            _ => None,
        };
        policy.ok_or_else(|| format!("no policy {name:?}; there are {NAMES}"))
    }
}

/// `scheduled_returns`' variants: `[<overload_rule>][-hN]`, the rule by its configuration
/// name and left out when it is the default.
fn scheduled(variants: &[&str]) -> Option<Policy> {
    let named = variants
        .first()
        .and_then(|v| v.parse::<OverloadRule>().ok());
    let (rule, rest) = match named {
        Some(OverloadRule::LatestWithRoom) => return None,
        Some(rule) => (rule, &variants[1..]),
        None => (OverloadRule::LatestWithRoom, variants),
    };
    let factor = match rest {
        [] => None,
        [h] => Some(
            h.strip_prefix('h')?
                .parse::<u32>()
                .ok()
                .filter(|k| (1..=100).contains(k))?,
        ),
        _ => return None,
    };
    Some(Policy::ScheduledReturns(rule, factor))
}

/// `kept_returns`' variants: `[-cookie][-maxN][-deadlines]`.
fn kept(variants: &[&str]) -> Option<Policy> {
    let (by, rest) = match variants.first() {
        Some(&"cookie") => (KeptBy::Cookie, &variants[1..]),
        Some(&"shared") => (KeptBy::SharedKey, &variants[1..]),
        _ => (KeptBy::Key, variants),
    };
    let (deadlines, rest) = match rest.split_last() {
        Some((&"deadlines", rest)) => (Deadlines::Honoured, rest),
        _ => (Deadlines::Ignored, rest),
    };
    let max = match rest {
        [] => None,
        [m] => Some(
            m.strip_prefix("max")?
                .parse::<u64>()
                .ok()
                .filter(|s| (61..=retry_after_policy::MAX_KEPT_RETRY_AFTER_S).contains(s))?,
        ),
        _ => return None,
    };
    Some(Policy::KeptReturns(by, max, deadlines))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back() {
        for p in Policy::ALL.into_iter().chain([
            Policy::Static(60),
            Policy::ScheduledReturns(OverloadRule::Latest, None),
            Policy::ScheduledReturns(OverloadRule::FillCapacity, Some(3)),
            Policy::ScheduledReturns(OverloadRule::LatestWithRoom, Some(2)),
            Policy::KeptReturns(KeptBy::Key, Some(120), Deadlines::Ignored),
            Policy::KeptReturns(KeptBy::Cookie, Some(300), Deadlines::Ignored),
            Policy::KeptReturns(KeptBy::Key, None, Deadlines::Honoured),
            Policy::KeptReturns(KeptBy::SharedKey, Some(300), Deadlines::Ignored),
            Policy::KeptReturns(KeptBy::Cookie, Some(120), Deadlines::Honoured),
        ]) {
            assert_eq!(p.to_string().parse::<Policy>(), Ok(p));
        }
        assert_eq!(
            "scheduled_returns-fill_capacity-h4".parse::<Policy>(),
            Ok(Policy::ScheduledReturns(
                OverloadRule::FillCapacity,
                Some(4)
            ))
        );
        for bad in [
            "static-0",
            "static",
            "computed",
            "computed-simple",
            "scheduled-returns",
            "scheduled_returns-fill",
            "scheduled_returns-latest_with_room",
            "scheduled_returns-h4-latest",
            "router_queue_drain_rate-simple-retry_backlog",
            "kept_returns-max60",
            "kept_returns-max301",
            "kept_returns-max120-cookie",
            "computed, defaults",
        ] {
            let e = bad.parse::<Policy>().unwrap_err();
            assert!(e.contains("static-N"), "{bad}: {e}");
        }
    }

    #[test]
    fn every_base_name_is_a_configuration_value() {
        for p in Policy::ALL {
            let name = p.to_string();
            let base = name.split('-').next().unwrap();
            if p != Policy::NoHeader {
                assert!(
                    base.parse::<retry_after_policy::RetryAfterPolicy>().is_ok(),
                    "{name}"
                );
                assert!(p.backpressure().contains(&format!("\"{base}\"")), "{name}");
            }
        }
    }
}
