//! From attempts to figures, a markdown table and SVG bar charts.

use std::fmt::Write as _;

use super::{
    Policy,
    load::Outcome,
    run::{MAX_ATTEMPTS, RunResult},
};

/// The figures of one run, over the clients that arrived after the warm-up.
#[derive(Clone, Debug, Default)]
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
    /// Of those, admitted by the proxy.
    pub retries_at_suggested_admitted: usize,
    /// All retries (second and later attempts).
    pub retries: usize,
    /// Of those, admitted.
    pub retries_admitted: usize,
    /// Clients served.
    pub succeeded: usize,
    /// Clients rejected on every one of their attempts.
    pub gave_up: usize,
    /// Clients still waiting when the run ended.
    pub unfinished: usize,
    /// Median time from first attempt to success, seconds.
    pub p50_s: Option<f64>,
    /// 99th percentile of the same.
    pub p99_s: Option<f64>,
    /// Successes per second while the measured schedule ran (answers within it).
    pub goodput: f64,
    /// Replica-seconds of idle capacity while a client waited to retry.
    pub idle_replica_s: f64,
    /// The agent's judge: share of its answers after which a retry at the suggested time was
    /// admitted (from the proxy's reports), for the rung the policy answers from.
    pub judge_admitted: Option<f64>,
    /// The agent's judge: share of answers whose queue drained within the suggested delay.
    pub judge_drained_in_time: Option<f64>,
    /// Requests the agent was told the proxy admitted and rejected (all clients).
    pub reported: Option<(f64, f64)>,
}

impl Figures {
    /// Share of retries at the suggested time that were admitted.
    pub fn admitted_at_suggested(&self) -> Option<f64> {
        ratio(
            self.retries_at_suggested_admitted,
            self.retries_at_suggested,
        )
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

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// The figures of `run`.
pub fn figures(run: &RunResult) -> Figures {
    let measured = |client: usize| client >= run.warm_up_clients;
    let mut f = Figures {
        clients: run.clients - run.warm_up_clients,
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
            }
            Outcome::Failed => f.failed += 1,
        }
        if a.number == 1 {
            first_sent[a.client] = Some(a.sent);
        } else {
            f.retries += 1;
            f.retries_admitted += admitted as usize;
            if a.after_suggested_s.is_some() {
                f.retries_at_suggested += 1;
                f.retries_at_suggested_admitted += admitted as usize;
            }
        }
    }
    let mut times: Vec<f64> = (0..run.clients)
        .filter_map(|c| Some((success_at[c]? - first_sent[c]?).as_secs_f64()))
        .collect();
    times.sort_by(f64::total_cmp);
    f.succeeded = times.len();
    f.gave_up = rejected_last.iter().filter(|&&n| n == MAX_ATTEMPTS).count();
    f.unfinished = run.unfinished;
    f.p50_s = percentile(&times, 0.5);
    f.p99_s = percentile(&times, 0.99);
    let window = run.warm_up..run.warm_up + std::time::Duration::from_secs_f64(run.measured_s);
    let served_in_window = run
        .attempts
        .iter()
        .filter(|a| a.outcome == Outcome::Served && window.contains(&a.answered))
        .count();
    f.goodput = served_in_window as f64 / run.measured_s;
    f.idle_replica_s = run.idle_replica_s_while_waiting;
    let rung = match run.policy {
        Policy::NoHeader => None,
        Policy::Static(_) => Some("static"),
        _ => Some("computed"),
    };
    if let Some(rung) = rung {
        let metrics =
            prometheus_parse::Scrape::parse(run.agent_metrics.lines().map(|l| Ok(l.to_owned())))
                .expect("the agent's metrics parse");
        let labelled = |s: &prometheus_parse::Sample| {
            s.labels.get("service") == Some("eval") && s.labels.get("rung") == Some(rung)
        };
        for s in &metrics.samples {
            match (&s.metric[..], &s.value) {
                ("retry_after_judge_admitted_ratio", prometheus_parse::Value::Gauge(v))
                    if labelled(s) =>
                {
                    f.judge_admitted = Some(*v)
                }
                (
                    "retry_after_judge_observed_over_suggested_ratio",
                    prometheus_parse::Value::Histogram(buckets),
                ) if labelled(s) => {
                    let total = buckets.last().map_or(0.0, |b| b.count);
                    let within = buckets
                        .iter()
                        .find(|b| b.less_than == 1.0)
                        .map_or(0.0, |b| b.count);
                    f.judge_drained_in_time = (total > 0.0).then(|| within / total);
                }
                _ => {}
            }
        }
        let reported = |outcome: &str| {
            metrics
                .samples
                .iter()
                .find(|s| {
                    s.metric == "retry_after_proxy_requests_total"
                        && s.labels.get("outcome") == Some(outcome)
                })
                .and_then(|s| match s.value {
                    prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => {
                        Some(v)
                    }
                    _ => None,
                })
        };
        f.reported = reported("admitted").zip(reported("rejected"));
    }
    f
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{:.0}%", v * 100.0))
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.digits$}"))
}

/// The markdown table of every run: one row per scenario and policy.
pub fn table(rows: &[(RunResult, Figures)]) -> String {
    let mut out = String::from(
        "| scenario | policy | clients | retries admitted at the suggested time | judge: admitted | judge: drained in time | all retries admitted | retries per success | p50 to success (s) | p99 to success (s) | goodput (req/s) | idle replica-s while clients waited | gave up | unfinished |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for (run, f) in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {} | {} |",
            run.scenario,
            run.policy.name(),
            f.clients,
            pct(f.admitted_at_suggested()),
            f.retries_at_suggested,
            pct(f.judge_admitted),
            pct(f.judge_drained_in_time),
            pct(f.retries_admitted_share()),
            num(f.retries_per_success(), 2),
            num(f.p50_s, 2),
            num(f.p99_s, 1),
            f.goodput,
            f.idle_replica_s,
            f.gave_up,
            f.unfinished,
        );
    }
    out
}

/// Colours of the policies, in `Policy::EVERY` order.
const COLOURS: [&str; 7] = [
    "#7f7f7f", "#c6dbef", "#6baed6", "#08519c", "#fdae6b", "#d94801", "#31a354",
];

fn colour(policy: Policy) -> &'static str {
    let i = Policy::EVERY.iter().position(|p| *p == policy).unwrap_or(0);
    COLOURS[i]
}

/// A grouped bar chart: one group per scenario, one bar per policy, of `value` (None: no
/// bar). `unit` labels the axis.
pub fn bar_chart(
    title: &str,
    unit: &str,
    rows: &[(RunResult, Figures)],
    value: impl Fn(&Figures) -> Option<f64>,
) -> String {
    let mut scenarios: Vec<&str> = Vec::new();
    let mut policies: Vec<Policy> = Vec::new();
    for (run, _) in rows {
        if !scenarios.contains(&run.scenario) {
            scenarios.push(run.scenario);
        }
        if !policies.contains(&run.policy) {
            policies.push(run.policy);
        }
    }
    let (width, height) = (960.0, 380.0);
    let (left, right, top, bottom) = (70.0, 20.0, 40.0, 90.0);
    let plot_w = width - left - right;
    let plot_h = height - top - bottom;
    let max = rows
        .iter()
        .filter_map(|(_, f)| value(f))
        .fold(0.0f64, f64::max);
    let scale_max = nice_ceiling(max);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{left}\" y=\"22\" font-size=\"15\" font-weight=\"bold\">{}</text>\n",
        escape(title)
    );
    for i in 0..=4 {
        let v = scale_max * i as f64 / 4.0;
        let y = top + plot_h - plot_h * i as f64 / 4.0;
        let _ = writeln!(
            svg,
            "<line x1=\"{left}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            left + plot_w,
            left - 6.0,
            y + 4.0,
            trim(v)
        );
    }
    let _ = writeln!(
        svg,
        "<text transform=\"translate(16,{:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>",
        top + plot_h / 2.0,
        escape(unit)
    );
    let group_w = plot_w / scenarios.len().max(1) as f64;
    let bar_w = group_w * 0.8 / policies.len().max(1) as f64;
    for (g, scenario) in scenarios.iter().enumerate() {
        let x0 = left + g as f64 * group_w + group_w * 0.1;
        for (p, policy) in policies.iter().enumerate() {
            let figure = rows
                .iter()
                .find(|(run, _)| run.scenario == *scenario && run.policy == *policy)
                .and_then(|(_, f)| value(f));
            let x = x0 + p as f64 * bar_w;
            match figure {
                Some(v) => {
                    let h = if scale_max > 0.0 {
                        plot_h * v / scale_max
                    } else {
                        0.0
                    };
                    let _ = writeln!(
                        svg,
                        "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"{}\"><title>{} · {}: {}</title></rect>",
                        top + plot_h - h,
                        bar_w - 1.0,
                        colour(*policy),
                        scenario,
                        policy.name(),
                        trim(v)
                    );
                }
                None => {
                    let _ = writeln!(
                        svg,
                        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#999\">–</text>",
                        x + bar_w / 2.0,
                        top + plot_h - 4.0
                    );
                }
            }
        }
        let _ = writeln!(
            svg,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            x0 + group_w * 0.4,
            top + plot_h + 18.0,
            escape(scenario)
        );
    }
    for (p, policy) in policies.iter().enumerate() {
        let x = left + (p % 3) as f64 * 260.0;
        let y = height - 42.0 + (p / 3) as f64 * 18.0;
        let _ = writeln!(
            svg,
            "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{:.1}\" y=\"{y:.1}\">{}</text>",
            y - 10.0,
            colour(*policy),
            x + 18.0,
            escape(&policy.name())
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn nice_ceiling(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let magnitude = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|&c| c >= v)
        .unwrap_or(10.0 * magnitude)
}

fn trim(v: f64) -> String {
    if v.fract().abs() < 1e-9 {
        format!("{v:.0}")
    } else if v.abs() < 10.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.1}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
