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
}

impl Policy {
    /// The six policies of the evaluation, in table order (the default `--policy` set).
    pub const ALL: [Policy; 6] = [
        Policy::NoHeader,
        Policy::Static(1),
        Policy::Static(5),
        Policy::Static(30),
        Policy::ComputedSimple,
        Policy::ComputedDefaults,
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

/// The `--policy` names: `none`, `static-N`, `computed-simple`, `computed`,
/// `computed-retry-backlog`, `scheduled-returns[-latest|-fill][-hN]` (the default overload
/// rule, or another; with `overload_horizon_factor` N).
impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::NoHeader => f.write_str("none"),
            Policy::Static(s) => write!(f, "static-{s}"),
            Policy::ComputedSimple => f.write_str("computed-simple"),
            Policy::ComputedDefaults => f.write_str("computed"),
            Policy::ComputedRetryBacklog => f.write_str("computed-retry-backlog"),
            Policy::ScheduledReturns(rule, factor) => {
                f.write_str("scheduled-returns")?;
                match rule {
                    OverloadRule::LatestWithRoom => {}
                    OverloadRule::Latest => f.write_str("-latest")?,
                    OverloadRule::FillCapacity => f.write_str("-fill")?,
                }
                match factor {
                    Some(k) => write!(f, "-h{k}"),
                    None => Ok(()),
                }
            }
        }
    }
}

impl FromStr for Policy {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        let policy = match name {
            "none" => Policy::NoHeader,
            "computed-simple" => Policy::ComputedSimple,
            "computed" => Policy::ComputedDefaults,
            "computed-retry-backlog" => Policy::ComputedRetryBacklog,
            scheduled if scheduled.starts_with("scheduled-returns") => {
                parse_scheduled(scheduled).ok_or_else(|| {
                    format!("no policy {name:?}; scheduled returns are scheduled-returns[-latest|-fill][-hN] (N from 1 to 100)")
                })?
            }
            other => match other.strip_prefix("static-").map(str::parse::<u64>) {
                Some(Ok(s)) if (1..=60).contains(&s) => Policy::Static(s),
                _ => {
                    return Err(format!(
                        "no policy {name:?}; there are none, static-N (N from 1 to 60), computed-simple, computed, computed-retry-backlog, scheduled-returns[-latest|-fill][-hN]"
                    ));
                }
            },
        };
        Ok(policy)
    }
}

/// `scheduled-returns[-latest|-fill][-hN]`.
fn parse_scheduled(name: &str) -> Option<Policy> {
    let mut rest = name.strip_prefix("scheduled-returns")?;
    let mut rule = OverloadRule::LatestWithRoom;
    for (suffix, r) in [
        ("-latest", OverloadRule::Latest),
        ("-fill", OverloadRule::FillCapacity),
    ] {
        if let Some(after) = rest.strip_prefix(suffix) {
            (rest, rule) = (after, r);
        }
    }
    let factor = match rest.strip_prefix("-h") {
        Some(k) => Some(k.parse::<u32>().ok().filter(|k| (1..=100).contains(k))?),
        None if rest.is_empty() => None,
        None => return None,
    };
    Some(Policy::ScheduledReturns(rule, factor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back() {
        for p in Policy::ALL.into_iter().chain([
            Policy::ComputedRetryBacklog,
            Policy::Static(60),
            Policy::ScheduledReturns(OverloadRule::Latest, None),
            Policy::ScheduledReturns(OverloadRule::FillCapacity, Some(3)),
            Policy::ScheduledReturns(OverloadRule::LatestWithRoom, None),
            Policy::ScheduledReturns(OverloadRule::LatestWithRoom, Some(2)),
        ]) {
            assert_eq!(p.to_string().parse::<Policy>(), Ok(p));
        }
        assert!(
            "static-0"
                .parse::<Policy>()
                .unwrap_err()
                .contains("static-N")
        );
        assert!("computed, defaults".parse::<Policy>().is_err());
    }
}
