//! The simulator's speed: CPU seconds per simulated second, per scenario, over several runs,
//! with the median and the spread. Run by `./dev bench sim`.
//!
//! Usage: `sim-bench [ROUNDS] [SCENARIO_DIR]...` (default: 5 rounds over eval/scenarios and
//! eval/scenarios/suite, each scenario under the proposal's policy with its defaults)

use std::{path::Path, time::Duration};

use retry_after_eval::{policy::Policy, scenario::Scenario, sim::simulate};

/// CPU time of this process so far.
fn cpu_time() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID)");
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn scenarios(dirs: &[String]) -> Vec<Scenario> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dirs: Vec<std::path::PathBuf> = if dirs.is_empty() {
        vec![root.join("scenarios"), root.join("scenarios/suite")]
    } else {
        dirs.iter().map(Into::into).collect()
    };
    let mut files: Vec<_> = dirs
        .iter()
        .flat_map(|d| std::fs::read_dir(d).unwrap_or_else(|e| panic!("{}: {e}", d.display())))
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| Scenario::from_file(f).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rounds: usize = args
        .first()
        .and_then(|a| a.parse().ok())
        .unwrap_or(5)
        .max(1);
    let dirs = if args.first().is_some_and(|a| a.parse::<usize>().is_ok()) {
        &args[1..]
    } else {
        &args[..]
    };
    let policy = Policy::ComputedDefaults;
    println!(
        "| scenario | simulated s | CPU ms per run (median, min–max of {rounds}) | CPU s per simulated s |"
    );
    println!("|---|---|---|---|");
    let (mut total_cpu, mut total_sim) = (0.0, 0.0);
    for scenario in scenarios(dirs) {
        let mut simulated = 0.0;
        let mut cpu: Vec<f64> = (0..rounds)
            .map(|round| {
                let before = cpu_time();
                let result = simulate(&scenario, policy, 1 + round as u64);
                let took = (cpu_time() - before).as_secs_f64();
                // The simulated span: to the last answer (the schedule and what drained after).
                let last = result.attempts.iter().map(|a| a.answered).max();
                simulated = last
                    .unwrap_or_default()
                    .max(scenario.length())
                    .as_secs_f64();
                took
            })
            .collect();
        cpu.sort_by(f64::total_cmp);
        let median = cpu[cpu.len() / 2];
        total_cpu += median;
        total_sim += simulated;
        println!(
            "| {} | {simulated:.0} | {:.1} ({:.1}–{:.1}) | {:.5} |",
            scenario.name,
            median * 1000.0,
            cpu[0] * 1000.0,
            cpu[cpu.len() - 1] * 1000.0,
            median / simulated
        );
    }
    println!(
        "| all | {total_sim:.0} | {:.1} | {:.5} |",
        total_cpu * 1000.0,
        total_cpu / total_sim
    );
}
