//! What one run leaves behind, the same from the real-socket run and the simulator: every
//! attempt of every client, the idle capacity while clients waited, and the agent's judge.

use std::time::Duration;

use retry_after_estimator::{JudgeStats, RungStats, judge::RATIO_BUCKETS};
use retry_after_policy::Rung;
use retry_after_reference_proxy::Rejection;

use crate::{load::Attempt, policy::Policy};

/// What one run produced.
#[derive(Clone, Debug)]
pub struct RunResult {
    /// The scenario's name.
    pub scenario: String,
    /// The policy.
    pub policy: Policy,
    /// Every attempt of every client.
    pub attempts: Vec<Attempt>,
    /// Clients that arrived (warm-up included).
    pub clients: usize,
    /// Clients that arrived during the warm-up (not measured).
    pub warm_up_clients: usize,
    /// Length of the warm-up.
    pub warm_up: Duration,
    /// Length of the measured schedule, seconds.
    pub measured_s: f64,
    /// Attempts a client makes at most.
    pub max_attempts: u32,
    /// Replica-seconds of idle capacity while at least one client waited to retry (after
    /// the warm-up).
    pub idle_replica_s_while_waiting: f64,
    /// Of those, the replica-seconds while requests were queued at a proxy: capacity its
    /// placement left idle, which no answer can fill.
    pub idle_replica_s_queued: f64,
    /// Clients still unfinished when the run ended.
    pub unfinished: usize,
    /// What the agent's judge made of the answers.
    pub judge: JudgeFigures,
    /// The proxies' access log (one line per rejection), where kept.
    pub access_log: Vec<Rejection>,
    /// Requests the replicas served, by their own count (real sockets only; `None` in the
    /// simulator, whose replicas are the model).
    pub replicas_served: Option<u64>,
    /// Per client, whether it ignores `Retry-After` (or caps its wait): its behaviour is not
    /// to honour the header as told.
    pub ignores_header: Vec<bool>,
}

/// The agent's judge at the end of a run, for the rung the policy answers from.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct JudgeFigures {
    /// Share of its answers after which a retry at the suggested time was admitted.
    pub admitted: Option<f64>,
    /// Share of drained answers whose queue drained within the suggested delay.
    pub drained_in_time: Option<f64>,
    /// Requests the agent was told the proxies admitted and rejected (all clients).
    pub reported: Option<(f64, f64)>,
}

impl JudgeFigures {
    /// The figures of `rung` summed over the judges of every agent (one per proxy), with the
    /// reported totals.
    pub fn from_stats<'a>(
        judges: impl IntoIterator<Item = &'a JudgeStats>,
        rung: Option<Rung>,
        reported: Option<(f64, f64)>,
    ) -> Self {
        let mut total = RungStats::default();
        if let Some(rung) = rung {
            for stats in judges.into_iter().filter_map(|j| j.rung(rung)) {
                total.admission_judged += stats.admission_judged;
                total.admitted += stats.admitted;
                for (sum, n) in total.ratio_counts.iter_mut().zip(stats.ratio_counts) {
                    *sum += n;
                }
            }
        }
        let drained: u64 = total.ratio_counts.iter().sum();
        // The buckets up to 1.0: drained within the suggested delay.
        let upto = RATIO_BUCKETS.iter().take_while(|b| **b <= 1.0).count();
        let within: u64 = total.ratio_counts[..upto].iter().sum();
        Self {
            admitted: total.admitted_share(),
            drained_in_time: (drained > 0).then(|| within as f64 / drained as f64),
            reported,
        }
    }
}
