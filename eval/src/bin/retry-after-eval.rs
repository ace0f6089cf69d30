//! `retry-after-eval`: run scenarios under policies on real sockets or in the simulator, and
//! write the results (results.md, results.json, charts) into a directory.
//!
//! ```text
//! retry-after-eval simulate --scenario-dir eval/scenarios/suite --out docs/evaluation-run/suite
//! retry-after-eval real --policy router_queue_drain_rate --policy static-5    (as root)
//! retry-after-eval agreement           (both side by side, every default policy; as root)
//! ```

use std::{
    fmt::Write as _,
    io::Write as _,
    path::{Path, PathBuf},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use clap::{Args, Parser, Subcommand};
use retry_after_eval::{
    bound::bound,
    figures::{Figures, figures},
    policy::Policy,
    report::{
        BOUND, Row, bar_chart, judge_table, kept_returns_table, operators_static_pick,
        suite_summary, table, tradeoff_chart,
    },
    run::run,
    scenario::Scenario,
    sim::simulate,
};

/// Retry-After evaluation: scenarios under policies, judged by what happens to the clients.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// On real sockets with the real agent (as root; about 50 s a run).
    Real(Common),
    /// In the discrete-event simulator (a fraction of a second a run).
    Simulate {
        #[command(flatten)]
        common: Common,
        /// Also run every static value of the sweep (1 to 60 s), for the suite's summary.
        #[arg(long)]
        static_sweep: bool,
    },
    /// Both, side by side: how far the simulator is from real sockets (as root).
    Agreement {
        #[command(flatten)]
        common: Common,
        /// Take the real-socket rows from this results.json of an earlier run (its `real/`, or
        /// a `real` run's) instead of running them again: for work on the simulator, or to add
        /// a policy's real rows to stored ones. Repeatable: a later file's row replaces an
        /// earlier one's for the same scenario and policy.
        #[arg(long)]
        real_from: Vec<PathBuf>,
    },
}

#[derive(Debug, Args)]
struct Common {
    /// A scenario file (repeatable).
    #[arg(long = "scenario-file")]
    scenario_files: Vec<PathBuf>,
    /// Every `*.toml` in this directory (repeatable). Without any scenario option: the five
    /// scenarios in eval/scenarios/.
    #[arg(long = "scenario-dir")]
    scenario_dirs: Vec<PathBuf>,
    /// A policy (repeatable): none, static-N, router_queue_drain_rate[-simple|-retry_backlog],
    /// scheduled_returns[-latest|-fill_capacity][-hN], kept_returns[-cookie][-maxN]. Default: the ten
    /// of the evaluation.
    #[arg(long = "policy")]
    policies: Vec<Policy>,
    /// Where results.md, results.json and the charts go.
    #[arg(long, default_value = "docs/evaluation-run")]
    out: PathBuf,
    /// The seed of arrivals, service times and every draw.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Stretch or shrink each scenario's measured part to this many seconds (1 to 7200).
    #[arg(long, value_parser = parse_seconds)]
    seconds: Option<f64>,
}

fn parse_seconds(text: &str) -> Result<f64, String> {
    text.parse::<f64>()
        .ok()
        .filter(|s| (1.0..=7200.0).contains(s))
        .ok_or_else(|| format!("{text:?}: a number of seconds from 1 to 7200"))
}

impl Common {
    fn scenarios(&self) -> Result<Vec<Scenario>> {
        let mut files = self.scenario_files.clone();
        let mut dirs = self.scenario_dirs.clone();
        if files.is_empty() && dirs.is_empty() {
            dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios"));
        }
        for dir in &dirs {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .with_context(|| format!("--scenario-dir {}", dir.display()))?
                .filter_map(|e| Some(e.ok()?.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "toml"))
                .collect();
            found.sort();
            if found.is_empty() {
                bail!("--scenario-dir {}: no *.toml in it", dir.display());
            }
            files.extend(found);
        }
        let mut scenarios: Vec<Scenario> = Vec::new();
        for file in &files {
            let s = Scenario::from_file(file)?;
            if scenarios.iter().any(|o| o.name == s.name) {
                bail!("{}: a second scenario named {:?}", file.display(), s.name);
            }
            scenarios.push(match self.seconds {
                Some(seconds) => s.scaled_to(seconds),
                None => s,
            });
        }
        Ok(scenarios)
    }

    fn policies(&self, static_sweep: bool) -> Vec<Policy> {
        let mut policies = if self.policies.is_empty() {
            Policy::ALL.to_vec()
        } else {
            self.policies.clone()
        };
        if static_sweep {
            for s in Policy::STATIC_SWEEP {
                if !policies.contains(&Policy::Static(s)) {
                    policies.push(Policy::Static(s));
                }
            }
        }
        policies
    }
}

/// Where a run happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Real,
    Simulated,
}

impl Place {
    fn name(self) -> &'static str {
        match self {
            Place::Real => "real",
            Place::Simulated => "simulated",
        }
    }
}

/// Shows which run is going and how long it has been: a line that updates itself on a
/// terminal, one line per finished run elsewhere.
struct Progress {
    total: usize,
    done: usize,
    started: Instant,
}

impl Progress {
    fn show(&self, label: &str, share: f64) {
        if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            return;
        }
        eprint!(
            "\r[{}/{}] {label}: {:>3.0}%   elapsed {:>5.0} s   ",
            self.done + 1,
            self.total,
            share * 100.0,
            self.started.elapsed().as_secs_f64()
        );
        let _ = std::io::stderr().flush();
    }
}

fn run_all(
    place: Place,
    scenarios: &[Scenario],
    policies: &[Policy],
    seed: u64,
    progress: &mut Progress,
) -> Vec<Row> {
    let mut out = Vec::new();
    for scenario in scenarios {
        for &policy in policies {
            let label = format!("{} {} × {}", place.name(), scenario.name, policy);
            progress.show(&label, 0.0);
            let result = match place {
                Place::Real => run(scenario, policy, seed, |share| progress.show(&label, share)),
                Place::Simulated => simulate(scenario, policy, seed),
            };
            let f = figures(&result);
            progress.done += 1;
            eprintln!(
                "\r[{}/{}] {label}: retries admitted at the suggested time {}, p99 {} s, elapsed {:.0} s",
                progress.done,
                progress.total,
                f.admitted_at_suggested()
                    .map_or_else(|| "–".to_owned(), |v| format!("{:.0}%", v * 100.0)),
                f.p99_s
                    .map_or_else(|| "–".to_owned(), |v| format!("{v:.1}")),
                progress.started.elapsed().as_secs_f64()
            );
            let row = Row {
                scenario: scenario.name.clone(),
                policy: policy.label(),
                name: policy.to_string(),
                source: place.name().to_owned(),
                figures: f,
            };
            out.push(row);
        }
    }
    out
}

/// The bound's row of each scenario, in order.
fn bounds(scenarios: &[Scenario], seed: u64) -> Vec<Row> {
    scenarios
        .iter()
        .map(|scenario| Row {
            scenario: scenario.name.clone(),
            policy: BOUND.to_owned(),
            name: "bound".to_owned(),
            source: "bound".to_owned(),
            figures: bound(scenario, seed),
        })
        .collect()
}

/// The rows of each scenario followed by its bound (`bounds`, one per scenario in order).
fn with_bounds(scenarios: &[Scenario], rows: &[Row], bounds: &[Row]) -> Vec<Row> {
    let mut out = Vec::new();
    for (s, bound) in scenarios.iter().zip(bounds) {
        out.extend(rows.iter().filter(|r| r.scenario == s.name).cloned());
        out.push(bound.clone());
    }
    out
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// A chart: file name, title, axis unit, and the figure it plots.
type Chart = (
    &'static str,
    &'static str,
    &'static str,
    fn(&Figures) -> Option<f64>,
);

const CHARTS: [Chart; 5] = [
    (
        "admitted-at-suggested.svg",
        "Retries admitted at the suggested time",
        "% of those retries",
        |f| f.admitted_at_suggested().map(|v| v * 100.0),
    ),
    (
        "retries-per-success.svg",
        "Retries per success",
        "retries / successful client",
        |f| f.retries_per_success(),
    ),
    (
        "p99-time-to-success.svg",
        "p99 time from first attempt to success",
        "seconds",
        |f| f.p99_s,
    ),
    ("goodput.svg", "Goodput", "successes / s", |f| {
        Some(f.goodput)
    }),
    (
        "idle-while-waiting.svg",
        "Idle capacity while clients waited to retry",
        "replica-seconds",
        |f| Some(f.idle_replica_s),
    ),
];

/// Write results.md, results.json and the charts of `rows` into `out`.
fn write_results(
    out: &Path,
    title: &str,
    scenarios: &[Scenario],
    rows: &[Row],
    took_s: f64,
) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let command: String = std::env::args().skip(1).map(|a| format!(" {a}")).collect();
    let mut md = format!(
        "# {title}\n\nMade by `retry-after-eval{command}` ({} rows, {took_s:.0} s).\n\nScenarios:\n\n",
        rows.len()
    );
    for s in scenarios {
        let _ = writeln!(
            md,
            "- `{}`: {} (capacity {:.0} req/s; {} prox{}, queue bound {} each).",
            s.name,
            s.title,
            s.capacity(),
            s.proxies,
            if s.proxies == 1 { "y" } else { "ies" },
            s.max_queued_requests
        );
    }
    md.push_str("\n## Every run\n\n");
    md.push_str(&table(rows));
    md.push_str("\n## The judge against the clients\n\n");
    md.push_str(&judge_table(rows));
    md.push_str("\n## Places, the clamp, and idle capacity by cause\n\n");
    md.push_str(&kept_returns_table(rows));
    md.push_str("\n## Summary over the scenarios\n\n");
    md.push_str(&suite_summary(rows));
    if let Some(pick) = operators_static_pick(rows) {
        let _ = writeln!(
            md,
            "\nThe single static value an operator would pick for these scenarios (within 5 points of the best mean admitted share among the static values, the least mean idle capacity): **{pick}**."
        );
    }
    md.push_str("\n## Charts\n\n");
    for (file, title, unit, value) in CHARTS {
        write(&out.join(file), &bar_chart(title, unit, rows, value))?;
        let _ = writeln!(md, "![{title}]({file})\n");
    }
    for s in scenarios {
        let file = format!("tradeoff-{}.svg", s.name);
        write(&out.join(&file), &tradeoff_chart(&s.name, rows))?;
        let _ = writeln!(
            md,
            "![{}: admitted share against idle capacity]({file})\n",
            s.name
        );
    }
    write(&out.join("results.md"), &md)?;
    let json = serde_json::to_string_pretty(rows).context("results as JSON")?;
    write(&out.join("results.json"), &json)?;
    eprintln!("wrote {}", out.join("results.md").display());
    Ok(())
}

/// The real-socket rows of earlier runs, for the scenarios and policies of `simulated`; a
/// later file's row replaces an earlier one's for the same scenario and policy.
fn read_real_rows(paths: &[PathBuf], simulated: &[Row]) -> Result<Vec<Row>> {
    let mut rows: Vec<Row> = Vec::new();
    for path in paths {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--real-from {}", path.display()))?;
        let read: Vec<Row> = serde_json::from_str(&text)
            .with_context(|| format!("--real-from {}: not a results.json", path.display()))?;
        for row in read.into_iter().filter(|r| r.source == "real") {
            rows.retain(|r| !(r.scenario == row.scenario && r.policy == row.policy));
            rows.push(row);
        }
    }
    // In the simulated runs' order, so the tables read the same either way.
    Ok(simulated
        .iter()
        .filter_map(|s| {
            rows.iter()
                .find(|r| r.scenario == s.scenario && r.policy == s.policy)
                .cloned()
        })
        .collect())
}

/// How many rows of the agreement table are within each tolerance.
#[derive(Default)]
struct Within {
    admitted: usize,
    goodput: usize,
    p50: usize,
    all: usize,
    rows: usize,
}

/// The simulator against real sockets, per scenario and policy.
fn agreement_table(real: &[Row], simulated: &[Row]) -> (String, Within) {
    let mut md = String::from(
        "| scenario | policy | admitted: real | simulated | Δ points | goodput: real | simulated | Δ | p50 to success: real (s) | simulated (s) | Δ | mean to success: real (s) | simulated (s) | within 5 points, 10%, 20% |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut within = Within::default();
    let seconds = |v: Option<f64>| v.map_or_else(|| "–".to_owned(), |v| format!("{v:.2}"));
    for r in real {
        let Some(s) = simulated
            .iter()
            .find(|s| s.scenario == r.scenario && s.policy == r.policy)
        else {
            continue;
        };
        let (a, b) = (r.admitted().unwrap_or(0.0), s.admitted().unwrap_or(0.0));
        let (g, h) = (r.figures.goodput, s.figures.goodput);
        let (p, q) = (
            r.figures.p50_s.unwrap_or(0.0),
            s.figures.p50_s.unwrap_or(0.0),
        );
        let relative = |x: f64, y: f64| if x > 0.0 { (y - x) / x } else { 0.0 };
        let ok = [
            (b - a).abs() <= 0.05,
            relative(g, h).abs() <= 0.10,
            relative(p, q).abs() <= 0.20,
        ];
        within.rows += 1;
        within.admitted += usize::from(ok[0]);
        within.goodput += usize::from(ok[1]);
        within.p50 += usize::from(ok[2]);
        within.all += usize::from(ok.iter().all(|o| *o));
        let _ = writeln!(
            md,
            "| {} | {} | {:.0}% | {:.0}% | {:+.1} | {g:.1} | {h:.1} | {:+.0}% | {p:.2} | {q:.2} | {:+.0}% | {} | {} | {} |",
            r.scenario,
            r.policy,
            a * 100.0,
            b * 100.0,
            (b - a) * 100.0,
            relative(g, h) * 100.0,
            relative(p, q) * 100.0,
            seconds(r.figures.mean_s),
            seconds(s.figures.mean_s),
            if ok.iter().all(|o| *o) { "yes" } else { "no" }
        );
    }
    (md, within)
}

/// Every scenario under every policy in one place, with the bounds, written out.
fn evaluate(place: Place, common: &Common, static_sweep: bool, started: Instant) -> Result<()> {
    let (scenarios, policies) = (common.scenarios()?, common.policies(static_sweep));
    let mut progress = Progress {
        total: scenarios.len() * policies.len(),
        done: 0,
        started,
    };
    let rows = run_all(place, &scenarios, &policies, common.seed, &mut progress);
    let rows = with_bounds(&scenarios, &rows, &bounds(&scenarios, common.seed));
    let title = match place {
        Place::Real => "Evaluation on real sockets",
        Place::Simulated => "Evaluation in the simulator",
    };
    let took = started.elapsed().as_secs_f64();
    write_results(&common.out, title, &scenarios, &rows, took)
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let started = Instant::now();
    match cli.command {
        Command::Real(common) => evaluate(Place::Real, &common, false, started),
        Command::Simulate {
            common,
            static_sweep,
        } => evaluate(Place::Simulated, &common, static_sweep, started),
        Command::Agreement { common, real_from } => {
            let (scenarios, policies) = (common.scenarios()?, common.policies(false));
            let mut progress = Progress {
                total: 2 * scenarios.len() * policies.len(),
                done: 0,
                started,
            };
            let simulated = run_all(
                Place::Simulated,
                &scenarios,
                &policies,
                common.seed,
                &mut progress,
            );
            let real = match real_from.as_slice() {
                [] => run_all(
                    Place::Real,
                    &scenarios,
                    &policies,
                    common.seed,
                    &mut progress,
                ),
                files => read_real_rows(files, &simulated)?,
            };
            let (table, w) = agreement_table(&real, &simulated);
            let bound_rows = bounds(&scenarios, common.seed);
            let command: String = std::env::args().skip(1).map(|a| format!(" {a}")).collect();
            let md = format!(
                "# The simulator against real sockets\n\nMade by `retry-after-eval{command}` in {:.0} s: every scenario under every policy, once on real sockets with the real agent and once in the simulator, with the same seed. Within tolerance, of {} rows: admitted share within 5 points, {}; goodput within 10%, {}; p50 time to success within 20%, {}; all three, {}.\n\n{table}",
                started.elapsed().as_secs_f64(),
                w.rows,
                w.admitted,
                w.goodput,
                w.p50,
                w.all
            );
            std::fs::create_dir_all(&common.out)?;
            write(&common.out.join("agreement.md"), &md)?;
            let took = started.elapsed().as_secs_f64();
            // Real rows taken from an earlier run are written again with today's bounds.
            let real_title = if real_from.is_empty() {
                "Evaluation on real sockets".to_owned()
            } else {
                let files: Vec<String> =
                    real_from.iter().map(|p| p.display().to_string()).collect();
                format!(
                    "Evaluation on real sockets (the real rows from {}, earlier runs)",
                    files.join(" and ")
                )
            };
            write_results(
                &common.out.join("real"),
                &real_title,
                &scenarios,
                &with_bounds(&scenarios, &real, &bound_rows),
                took,
            )?;
            write_results(
                &common.out.join("simulated"),
                "Evaluation in the simulator",
                &scenarios,
                &with_bounds(&scenarios, &simulated, &bound_rows),
                took,
            )
        }
    }
}
