//! From a run's attempts to its figures: what happened to the clients, and what the agent's
//! judge made of it.

use serde::{Deserialize, Serialize};

use crate::{load::Outcome, record::RunResult};

/// The figures of one run, over the clients that arrived after the warm-up.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Figures {
    /// Clients measured.
    pub clients: usize,
    /// Attempts they sent.
    pub sent: usize,
    /// Of those: served, rejected by the proxy, failed otherwise.
    pub served: usize,
    /// Rejected by the proxy.
    pub rejected: usize,
    /// Failed otherwise (a replica lost mid-request, a timeout).
    pub failed: usize,
    /// Retries sent at the delay a rejection suggested (clients that honour the header).
    pub retries_at_suggested: usize,
    /// Of those, after an answer at the clamp's top (60 s): under kept returns, a client
    /// whose place is further away comes back then and is told the rest.
    #[serde(default)]
    pub retries_at_clamp: usize,
    /// Of those, admitted.
    #[serde(default)]
    pub retries_at_clamp_admitted: usize,
    /// The bound only: clients it had to send more than the clamp's top away (their place
    /// lies beyond 60 s), so that no answer within the clamp can admit them at their first
    /// return.
    #[serde(default)]
    pub beyond_clamp: usize,
    /// Of those, admitted by the proxy.
    pub retries_at_suggested_admitted: usize,
    /// All retries (second and later attempts).
    pub retries: usize,
    /// Of those, admitted.
    pub retries_admitted: usize,
    /// Clients served.
    pub succeeded: usize,
    /// Clients rejected on every one of their attempts, or that gave up before their last
    /// (their deadline, or told not to retry).
    pub gave_up: usize,
    /// Clients still waiting when the run ended.
    pub unfinished: usize,
    /// Median time from first attempt to success, seconds.
    pub p50_s: Option<f64>,
    /// 99th percentile of the same.
    pub p99_s: Option<f64>,
    /// Mean time from first attempt to success, seconds.
    pub mean_s: Option<f64>,
    /// Successes per second while the measured schedule ran (answers within it).
    pub goodput: f64,
    /// Replica-seconds of idle capacity while a client waited to retry.
    pub idle_replica_s: f64,
    /// Of those, while requests were queued at a proxy: capacity its placement (its own
    /// backoff) left idle, which no answer can fill.
    #[serde(default)]
    pub idle_replica_s_queued: f64,
    /// The agent's judge: share of its answers after which a retry at the suggested time was
    /// admitted (from the proxy's reports), for the rung the policy answers from.
    pub judge_admitted: Option<f64>,
    /// The agent's judge: share of answers whose queue drained within the suggested delay.
    pub judge_drained_in_time: Option<f64>,
    /// Requests the agent was told the proxy admitted and rejected (all clients).
    pub reported: Option<(f64, f64)>,
    /// The same figures over the clients that do not wait as told (the scenario's mix), if
    /// it has any: whether obeying clients gain at their cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignoring: Option<Box<Figures>>,
}

impl Figures {
    /// Share of retries at the suggested time that were admitted.
    pub fn admitted_at_suggested(&self) -> Option<f64> {
        ratio(
            self.retries_at_suggested_admitted,
            self.retries_at_suggested,
        )
    }

    /// Share of retries at the suggested time admitted, of those after an answer below the
    /// clamp's top (the places within a minute).
    pub fn admitted_below_clamp(&self) -> Option<f64> {
        ratio(
            self.retries_at_suggested_admitted - self.retries_at_clamp_admitted,
            self.retries_at_suggested - self.retries_at_clamp,
        )
    }

    /// The share of retries an answer within the clamp can admit at the first return at best:
    /// the bound's, less the clients it sends beyond the clamp's top.
    pub fn first_return_ceiling(&self) -> Option<f64> {
        ratio(self.retries - self.beyond_clamp, self.retries)
    }

    /// Share of all retries that were admitted.
    pub fn retries_admitted_share(&self) -> Option<f64> {
        ratio(self.retries_admitted, self.retries)
    }

    /// Retries per success.
    pub fn retries_per_success(&self) -> Option<f64> {
        ratio(self.retries, self.succeeded)
    }
}

fn ratio(a: usize, b: usize) -> Option<f64> {
    (b > 0).then(|| a as f64 / b as f64)
}

/// The mean of `values`, if there are any.
pub(crate) fn mean(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values
        .into_iter()
        .fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// The figures of `run`, with those of the clients that ignore the header beside them.
pub fn figures(run: &RunResult) -> Figures {
    let ignores = |c: usize| run.ignores_header.get(c).copied().unwrap_or(false);
    let mut f = figures_of(run, |_| true);
    if (0..run.clients).any(ignores) {
        f.ignoring = Some(Box::new(figures_of(run, ignores)));
    }
    f
}

/// The figures of the clients of `run` that `keep` selects (idle capacity, goodput and the
/// judge are the run's).
fn figures_of(run: &RunResult, keep: impl Fn(usize) -> bool) -> Figures {
    let measured = |client: usize| client >= run.warm_up_clients && keep(client);
    let mut f = Figures {
        clients: (run.warm_up_clients..run.clients)
            .filter(|&c| keep(c))
            .count(),
        ..Figures::default()
    };
    let mut first_sent = vec![None; run.clients];
    let mut success_at = vec![None; run.clients];
    let mut rejected_last = vec![0u32; run.clients];
    for a in run.attempts.iter().filter(|a| measured(a.client)) {
        f.sent += 1;
        let admitted = !matches!(a.outcome, Outcome::Rejected { .. });
        match a.outcome {
            Outcome::Served => {
                f.served += 1;
                success_at[a.client] = Some(a.answered);
            }
            Outcome::Rejected { .. } => {
                f.rejected += 1;
                rejected_last[a.client] = rejected_last[a.client].max(a.number);
                if a.gave_up_after {
                    // Gave up before its last attempt: counted as if it had made them all.
                    rejected_last[a.client] = run.max_attempts;
                }
            }
            Outcome::Failed => f.failed += 1,
        }
        if a.number == 1 {
            first_sent[a.client] = Some(a.sent);
        } else {
            f.retries += 1;
            f.retries_admitted += admitted as usize;
            if let Some(s) = a.after_suggested_s {
                f.retries_at_suggested += 1;
                f.retries_at_suggested_admitted += admitted as usize;
                if s >= retry_after_policy::MAX_RETRY_AFTER_S {
                    f.retries_at_clamp += 1;
                    f.retries_at_clamp_admitted += admitted as usize;
                }
            }
        }
    }
    let mut times: Vec<f64> = (0..run.clients)
        .filter(|&c| keep(c))
        .filter_map(|c| Some((success_at[c]? - first_sent[c]?).as_secs_f64()))
        .collect();
    times.sort_by(f64::total_cmp);
    f.succeeded = times.len();
    f.gave_up = rejected_last
        .iter()
        .filter(|&&n| n == run.max_attempts)
        .count();
    f.unfinished = run.unfinished;
    f.p50_s = percentile(&times, 0.5);
    f.p99_s = percentile(&times, 0.99);
    f.mean_s = mean(times.iter().copied());
    let window = run.warm_up..run.warm_up + std::time::Duration::from_secs_f64(run.measured_s);
    let served_in_window = run
        .attempts
        .iter()
        .filter(|a| a.outcome == Outcome::Served && window.contains(&a.answered))
        .count();
    f.goodput = served_in_window as f64 / run.measured_s;
    f.idle_replica_s = run.idle_replica_s_while_waiting;
    f.idle_replica_s_queued = run.idle_replica_s_queued;
    f.judge_admitted = run.judge.admitted;
    f.judge_drained_in_time = run.judge.drained_in_time;
    f.reported = run.judge.reported;
    f
}
