//! The end-to-end evaluation: every scenario under every policy, on loopback, with the real
//! agent, the reference proxy and open-loop clients. Writes a markdown table and SVG charts.
//!
//! Usage: evaluate [--out DIR] [--seconds S] [--seed N] [--scenario NAME]... [--policy NAME]... [--max-queued N]
//! (run as root; defaults: docs/evaluation-run, 25 s measured per run, seed 1, every scenario,
//! each scenario's own queue bound)

use std::{io::Write, path::PathBuf, time::Instant};

use retry_after_eval::{
    Policy,
    report::{Figures, bar_chart, figures, table},
    run::{RunResult, run},
    scenarios,
};

/// A chart: file name, title, axis unit, and the figure it plots.
type Chart = (
    &'static str,
    &'static str,
    &'static str,
    fn(&Figures) -> Option<f64>,
);

struct Args {
    out: PathBuf,
    seconds: f64,
    seed: u64,
    only: Vec<String>,
    policies: Vec<Policy>,
    max_queued: Option<usize>,
}

fn parse_args() -> Args {
    let mut args = Args {
        out: PathBuf::from("docs/evaluation-run"),
        seconds: 25.0,
        seed: 1,
        only: Vec::new(),
        policies: Vec::new(),
        max_queued: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| fail(&format!("{arg} needs a value")))
        };
        match arg.as_str() {
            "--out" => args.out = PathBuf::from(value()),
            "--seconds" => {
                args.seconds = value()
                    .parse()
                    .ok()
                    .filter(|s: &f64| *s >= 5.0 && *s <= 600.0)
                    .unwrap_or_else(|| fail("--seconds: a number from 5 to 600"))
            }
            "--seed" => {
                args.seed = value()
                    .parse()
                    .unwrap_or_else(|_| fail("--seed: a whole number"))
            }
            "--scenario" => args.only.push(value()),
            "--policy" => {
                let name = value();
                let policy = Policy::EVERY
                    .into_iter()
                    .find(|p| p.name() == name)
                    .unwrap_or_else(|| {
                        let names: Vec<String> = Policy::EVERY.iter().map(|p| p.name()).collect();
                        fail(&format!(
                            "no policy {name:?}; there are {}",
                            names.join(", ")
                        ))
                    });
                args.policies.push(policy);
            }
            "--max-queued" => {
                args.max_queued = Some(
                    value()
                        .parse()
                        .ok()
                        .filter(|n: &usize| (1..=100_000).contains(n))
                        .unwrap_or_else(|| fail("--max-queued: a number from 1 to 100000")),
                )
            }
            other => fail(&format!(
                "unknown argument {other:?}; usage: evaluate [--out DIR] [--seconds S] [--seed N] [--scenario NAME]... [--policy NAME]... [--max-queued N]"
            )),
        }
    }
    args
}

fn fail(message: &str) -> ! {
    eprintln!("evaluate: {message}");
    std::process::exit(2);
}

fn main() {
    let args = parse_args();
    let all = scenarios(args.seconds);
    for name in &args.only {
        if !all.iter().any(|s| s.name == name) {
            let names: Vec<&str> = all.iter().map(|s| s.name).collect();
            fail(&format!(
                "no scenario {name:?}; there are {}",
                names.join(", ")
            ));
        }
    }
    let chosen: Vec<_> = all
        .into_iter()
        .filter(|s| args.only.is_empty() || args.only.iter().any(|n| n == s.name))
        .map(|mut s| {
            if let Some(n) = args.max_queued {
                s.max_queued_requests = n;
            }
            s
        })
        .collect();
    std::fs::create_dir_all(&args.out)
        .unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", args.out.display())));
    let logs = std::env::temp_dir().join("retry-after-evaluation-access-logs");
    std::fs::create_dir_all(&logs).unwrap_or_else(|e| fail(&format!("{}: {e}", logs.display())));
    let policies = if args.policies.is_empty() {
        Policy::ALL.to_vec()
    } else {
        args.policies.clone()
    };
    let total = chosen.len() * policies.len();
    let started = Instant::now();
    let mut rows: Vec<(RunResult, Figures)> = Vec::new();
    for scenario in &chosen {
        for &policy in &policies {
            let n = rows.len() + 1;
            let label = format!("[{n}/{total}] {} × {}", scenario.name, policy.name());
            let result = run(scenario, policy, args.seed, |done| {
                eprint!(
                    "\r{label}: {:>3.0}%   elapsed {:>4.0} s   ",
                    done * 100.0,
                    started.elapsed().as_secs_f64()
                );
                let _ = std::io::stderr().flush();
            });
            let f = figures(&result);
            eprintln!(
                "\r{label}: done; retries admitted at the suggested time {}, goodput {:.1}/s, elapsed {:.0} s",
                f.admitted_at_suggested()
                    .map_or_else(|| "–".to_owned(), |v| format!("{:.0}%", v * 100.0)),
                f.goodput,
                started.elapsed().as_secs_f64()
            );
            write_access_log(&logs, &result);
            rows.push((result, f));
        }
    }
    let passed: String = std::env::args().skip(1).map(|a| format!(" {a}")).collect();
    let mut md = format!(
        "# Evaluation run: computed against static Retry-After\n\nMade by `./dev evaluate{passed}` (which runs `cargo run --release -p retry-after-integration-tests --bin evaluate --{passed}`), {} runs in {:.0} s.\n\nScenarios:\n\n",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    for s in &chosen {
        md.push_str(&format!(
            "- `{}`: {} (capacity {:.0} req/s; queue bound {}).\n",
            s.name,
            s.title,
            s.capacity(),
            s.max_queued_requests
        ));
    }
    md.push('\n');
    md.push_str(&table(&rows));
    let charts: [Chart; 5] = [
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
    md.push_str("\nCharts:\n\n");
    for (file, title, unit, value) in charts {
        let svg = bar_chart(title, unit, &rows, value);
        std::fs::write(args.out.join(file), svg)
            .unwrap_or_else(|e| fail(&format!("write {file}: {e}")));
        md.push_str(&format!("![{title}]({file})\n\n"));
    }
    let path = args.out.join("results.md");
    std::fs::write(&path, md).unwrap_or_else(|e| fail(&format!("write results.md: {e}")));
    eprintln!(
        "wrote {} and {} charts; access logs in {}",
        path.display(),
        charts.len(),
        logs.display()
    );
}

fn write_access_log(dir: &std::path::Path, run: &RunResult) {
    let name = format!(
        "{}-{}.log",
        run.scenario,
        run.policy.name().replace([' ', ','], "-")
    );
    let out: String = run.access_log.iter().map(|r| r.log_line() + "\n").collect();
    let _ = std::fs::write(dir.join(name), out);
}
