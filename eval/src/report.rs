//! From figures to what a reader sees: the markdown table of every run, bar charts per
//! figure, a trade-off chart per scenario (admitted share against idle capacity, every policy
//! a point, the clairvoyant bound marked), the suite's summary, and `results.json`.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::figures::{Figures, mean};

/// The label of the clairvoyant bound's rows.
pub const BOUND: &str = "clairvoyant bound";

/// One row of the results: a scenario under a policy (or the bound).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Row {
    /// The scenario's name.
    pub scenario: String,
    /// The policy's label ([`BOUND`] for the bound).
    pub policy: String,
    /// The policy's `--policy` name (`bound` for the bound).
    pub name: String,
    /// Where the figures come from: `real`, `simulated` or `bound`.
    pub source: String,
    /// The figures.
    pub figures: Figures,
}

impl Row {
    /// The share of retries admitted that the summaries read: at the suggested time where
    /// the policy suggests one, else of all retries.
    pub fn admitted(&self) -> Option<f64> {
        self.figures
            .admitted_at_suggested()
            .or_else(|| self.figures.retries_admitted_share())
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{:.0}%", v * 100.0))
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.digits$}"))
}

/// The markdown table of every row.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| scenario | policy | clients | retries admitted at the suggested time | judge: admitted | judge: drained in time | all retries admitted | retries per success | p50 to success (s) | p99 to success (s) | goodput (req/s) | idle replica-s while clients waited | gave up | unfinished |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for row in rows {
        let f = &row.figures;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {} | {} |",
            row.scenario,
            row.policy,
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

/// The judge against the clients: per row with a judge, the share of retries at the
/// suggested time the clients saw admitted, the judge's share, and the difference.
pub fn judge_table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| scenario | policy | clients saw admitted | judge: admitted | difference (points) |\n|---|---|---|---|---|\n",
    );
    for row in rows {
        let f = &row.figures;
        let (Some(seen), Some(judged)) = (f.admitted_at_suggested(), f.judge_admitted) else {
            continue;
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:+.1} |",
            row.scenario,
            row.policy,
            pct(Some(seen)),
            pct(Some(judged)),
            (judged - seen) * 100.0
        );
    }
    out
}

/// Per row: what kept returns are judged by. The share of retries at the suggested time
/// admitted, all and of those after an answer below the clamp's top (a place within the
/// minute); the best share any answer within the clamp can admit at the first return (the
/// bound's, less its clients sent further than 60 s); p99 time to success ÷ the bound's; idle
/// replica-seconds while clients waited, all and while no request was queued (the part the
/// answers leave: with requests queued it is the proxy's placement); and the clients that do
/// not wait as told (the scenario's mix): how many succeeded, gave up, their p99.
pub fn kept_returns_table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| scenario | policy | admitted at the suggested time | of places within the clamp | bound's ceiling (60 s clamp) | p99 ÷ bound's | idle replica-s (with no request queued) | clients ignoring the header: succeeded, gave up, p99 (s) |\n|---|---|---|---|---|---|---|---|\n",
    );
    for row in rows.iter().filter(|r| r.policy != BOUND) {
        let f = &row.figures;
        let bound = bound_of(rows, &row.scenario).map(|b| &b.figures);
        let ratio = f.p99_s.zip(bound.and_then(|b| b.p99_s)).map(|(a, b)| a / b);
        let ignoring = f.ignoring.as_deref().map_or_else(
            || "–".to_owned(),
            |g| {
                format!(
                    "{} of {}, {}, {}",
                    g.succeeded,
                    g.clients,
                    g.gave_up,
                    num(g.p99_s, 1)
                )
            },
        );
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {:.1} ({:.1}) | {ignoring} |",
            row.scenario,
            row.policy,
            pct(f.admitted_at_suggested()),
            pct(f.admitted_below_clamp()),
            pct(bound.and_then(Figures::first_return_ceiling)),
            num(ratio, 2),
            f.idle_replica_s,
            f.idle_replica_s - f.idle_replica_s_queued,
        );
    }
    out
}

/// Per policy over the whole suite: mean and worst admitted share, mean idle capacity, mean
/// p99 time to success and its mean ratio to the bound's, clients given up; the bound's row
/// last.
pub fn suite_summary(rows: &[Row]) -> String {
    let mut out = String::from(
        "| policy | scenarios | mean admitted | worst admitted (scenario) | mean idle replica-s | of it with no request queued | mean p99 (s) | mean p99 ÷ bound's | gave up |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for label in labels(rows) {
        let mine: Vec<&Row> = rows.iter().filter(|r| r.policy == label).collect();
        let admitted: Vec<(f64, &str)> = mine
            .iter()
            .filter_map(|r| Some((r.admitted()?, r.scenario.as_str())))
            .collect();
        let worst = admitted
            .iter()
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map_or_else(
                || "–".to_owned(),
                |(v, s)| format!("{} ({s})", pct(Some(*v))),
            );
        let ratios: Vec<f64> = mine
            .iter()
            .filter_map(|r| Some(r.figures.p99_s? / bound_of(rows, &r.scenario)?.figures.p99_s?))
            .collect();
        let _ = writeln!(
            out,
            "| {label} | {} | {} | {worst} | {:.1} | {:.1} | {} | {} | {} |",
            mine.len(),
            pct(mean(admitted.iter().map(|a| a.0))),
            mean(mine.iter().map(|r| r.figures.idle_replica_s)).unwrap_or(0.0),
            mean(
                mine.iter()
                    .map(|r| r.figures.idle_replica_s - r.figures.idle_replica_s_queued)
            )
            .unwrap_or(0.0),
            num(mean(mine.iter().filter_map(|r| r.figures.p99_s)), 1),
            num(mean(ratios.into_iter()), 2),
            mine.iter().map(|r| r.figures.gave_up).sum::<usize>(),
        );
    }
    out
}

/// The single static value an operator would pick for the whole suite: among the static
/// policies, those within 5 points of the best mean admitted share, the one leaving the least
/// mean idle capacity. Returns its label.
pub fn operators_static_pick(rows: &[Row]) -> Option<String> {
    let statics: Vec<(String, f64, f64)> = labels(rows)
        .into_iter()
        .filter(|l| l.starts_with("static "))
        .filter_map(|label| {
            let mine: Vec<&Row> = rows.iter().filter(|r| r.policy == label).collect();
            let admitted = mean(mine.iter().filter_map(|r| r.admitted()))?;
            let idle = mean(mine.iter().map(|r| r.figures.idle_replica_s))?;
            Some((label, admitted, idle))
        })
        .collect();
    let best = statics
        .iter()
        .map(|s| s.1)
        .fold(f64::NEG_INFINITY, f64::max);
    statics
        .into_iter()
        .filter(|s| s.1 >= best - 0.05)
        .min_by(|a, b| a.2.total_cmp(&b.2))
        .map(|s| s.0)
}

fn bound_of<'a>(rows: &'a [Row], scenario: &str) -> Option<&'a Row> {
    rows.iter()
        .find(|r| r.scenario == scenario && r.policy == BOUND)
}

/// Policy labels in order of first appearance.
fn labels(rows: &[Row]) -> Vec<String> {
    distinct(rows.iter().map(|r| &r.policy))
}

/// Scenario names in order of first appearance.
fn scenarios(rows: &[Row]) -> Vec<String> {
    distinct(rows.iter().map(|r| &r.scenario))
}

fn distinct<'a>(values: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for v in values {
        if !out.contains(v) {
            out.push(v.clone());
        }
    }
    out
}

const COLOURS: [&str; 16] = [
    "#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
];

/// A label's colour: the bound black, the rest by order of appearance.
fn colour(labels: &[String], label: &str) -> &'static str {
    if label == BOUND {
        return "#000000";
    }
    let i = labels.iter().position(|l| l == label).unwrap_or(0);
    COLOURS[i % COLOURS.len()]
}

fn svg_open(width: f64, height: f64, left: f64, title: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{left}\" y=\"22\" font-size=\"15\" font-weight=\"bold\">{}</text>\n",
        escape(title)
    )
}

/// Horizontal grid lines and labels for a value axis from 0 to `max`.
fn value_axis(svg: &mut String, left: f64, top: f64, plot_w: f64, plot_h: f64, max: f64) {
    for i in 0..=4 {
        let v = max * i as f64 / 4.0;
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
}

fn legend(svg: &mut String, labels: &[String], left: f64, bottom_y: f64) {
    for (p, label) in labels.iter().enumerate() {
        let x = left + (p % 4) as f64 * 220.0;
        let y = bottom_y + (p / 4) as f64 * 18.0;
        let _ = writeln!(
            svg,
            "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{:.1}\" y=\"{y:.1}\">{}</text>",
            y - 10.0,
            colour(labels, label),
            x + 18.0,
            escape(label)
        );
    }
}

/// A grouped bar chart: one group per scenario, one bar per policy, of `value` (None: no
/// bar). `unit` labels the axis.
pub fn bar_chart(
    title: &str,
    unit: &str,
    rows: &[Row],
    value: impl Fn(&Figures) -> Option<f64>,
) -> String {
    let scenarios = scenarios(rows);
    let labels = labels(rows);
    let legend_rows = labels.len().div_ceil(4) as f64;
    // Wide enough for a few pixels a bar; scenario names stand slanted under their group.
    let group_px = (labels.len() as f64 * 5.0).max(60.0);
    let width = (90.0 + scenarios.len() as f64 * group_px).max(1000.0);
    let height = 400.0 + 18.0 * legend_rows;
    let (left, right, top, bottom) = (70.0, 20.0, 40.0, 120.0 + 18.0 * legend_rows);
    let plot_w = width - left - right;
    let plot_h = height - top - bottom;
    let max = rows
        .iter()
        .filter_map(|r| value(&r.figures))
        .fold(0.0f64, f64::max);
    let scale_max = nice_ceiling(max);
    let mut svg = svg_open(width, height, left, title);
    value_axis(&mut svg, left, top, plot_w, plot_h, scale_max);
    let _ = writeln!(
        svg,
        "<text transform=\"translate(16,{:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>",
        top + plot_h / 2.0,
        escape(unit)
    );
    let group_w = plot_w / scenarios.len().max(1) as f64;
    let bar_w = group_w * 0.8 / labels.len().max(1) as f64;
    for (g, scenario) in scenarios.iter().enumerate() {
        let x0 = left + g as f64 * group_w + group_w * 0.1;
        for (p, label) in labels.iter().enumerate() {
            let figure = rows
                .iter()
                .find(|r| &r.scenario == scenario && &r.policy == label)
                .and_then(|r| value(&r.figures));
            let x = x0 + p as f64 * bar_w;
            match figure {
                Some(v) => {
                    let h = plot_h * v / scale_max;
                    let _ = writeln!(
                        svg,
                        "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"{}\"><title>{} · {}: {}</title></rect>",
                        top + plot_h - h,
                        (bar_w - 1.0).max(0.5),
                        colour(&labels, label),
                        escape(scenario),
                        escape(label),
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
        let (x, y) = (x0 + group_w * 0.4, top + plot_h + 14.0);
        let _ = writeln!(
            svg,
            "<text x=\"{x:.1}\" y=\"{y:.1}\" text-anchor=\"end\" font-size=\"11\" transform=\"rotate(-35 {x:.1} {y:.1})\">{}</text>",
            escape(scenario)
        );
    }
    legend(&mut svg, &labels, left, top + plot_h + 110.0);
    svg.push_str("</svg>\n");
    svg
}

/// The trade-off of one scenario: admitted share (up) against idle replica-seconds while
/// clients waited (right), every policy a point, the clairvoyant bound a black diamond. Up and
/// to the left is better.
pub fn tradeoff_chart(scenario: &str, rows: &[Row]) -> String {
    let mine: Vec<&Row> = rows.iter().filter(|r| r.scenario == scenario).collect();
    let labels = labels(rows);
    let (width, height) = (760.0, 420.0);
    let (left, right, top, bottom) = (70.0, 300.0, 40.0, 50.0);
    let plot_w = width - left - right;
    let plot_h = height - top - bottom;
    let max_idle = nice_ceiling(
        mine.iter()
            .map(|r| r.figures.idle_replica_s)
            .fold(0.0, f64::max),
    );
    let mut svg = svg_open(
        width,
        height,
        left,
        &format!("{scenario}: admitted share against idle capacity"),
    );
    value_axis(&mut svg, left, top, plot_w, plot_h, 100.0);
    let _ = writeln!(
        svg,
        "<text transform=\"translate(16,{:.1}) rotate(-90)\" text-anchor=\"middle\">% of retries admitted</text><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">idle replica-seconds while clients waited (0 to {})</text>",
        top + plot_h / 2.0,
        left + plot_w / 2.0,
        height - 12.0,
        trim(max_idle)
    );
    for (i, row) in mine.iter().enumerate() {
        let Some(admitted) = row.admitted() else {
            continue;
        };
        let x = left + plot_w * row.figures.idle_replica_s / max_idle;
        let y = top + plot_h * (1.0 - admitted);
        let fill = colour(&labels, &row.policy);
        let mark = if row.policy == BOUND {
            format!(
                "<path d=\"M{x:.1} {:.1} l6 6 l-6 6 l-6 -6 z\" fill=\"{fill}\"/>",
                y - 6.0
            )
        } else {
            format!("<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"5\" fill=\"{fill}\"/>")
        };
        let _ = writeln!(
            svg,
            "{mark}<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\">{}: {:.0}%, {:.1}</text>",
            left + plot_w + 14.0,
            top + 14.0 + 16.0 * i as f64,
            escape(&row.policy),
            admitted * 100.0,
            row.figures.idle_replica_s
        );
        let _ = writeln!(
            svg,
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"{fill}\"/>",
            left + plot_w + 8.0,
            top + 10.0 + 16.0 * i as f64
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
