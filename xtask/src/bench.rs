//! `bench`: the project's benchmarks, release builds, each printing markdown tables with a
//! baseline measured in the same run (results and commands: docs/evaluation.md).

use std::path::Path;

use anyhow::Result;

use crate::setup::Env;

/// Which benchmarks to run, and the data-path benchmark's options.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// `datapath` (the kernel programs' cost under wrk load), `loss` (the throughput nginx and
    /// HAProxy lose to the agent, flat out, and the program time against the floor), `estimate` (one estimate call),
    /// `socket` (query round trip and the client library's reject path), `sim` (the
    /// evaluation's simulator: CPU seconds per simulated second), or all by default.
    which: Option<String>,
    /// Data path: rounds; each measures the three setups in rotating order.
    #[arg(long, default_value_t = 10)]
    rounds: u64,
    /// Data path: seconds of load per measurement.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Data path: concurrent keep-alive connections.
    #[arg(long, default_value_t = 16)]
    connections: u64,
    /// Data path: rounds of the in-kernel cost measurement (not watching, then watching).
    #[arg(long, default_value_t = 5)]
    kernel_rounds: u64,
    /// Loss: rounds, each measuring every cell without the agent and with it (`--seconds`
    /// each).
    #[arg(long, default_value_t = 5)]
    loss_rounds: u64,
}

/// Build and run the chosen benchmarks.
pub fn bench(root: &Path, env: &Env, args: &BenchArgs) -> Result<()> {
    let which = args.which.as_deref();
    if !matches!(
        which,
        None | Some("datapath" | "loss" | "estimate" | "socket" | "sim")
    ) {
        anyhow::bail!("unknown benchmark {which:?}: datapath, loss, estimate, socket or sim");
    }
    if matches!(which, None | Some("estimate")) {
        let mut command = env.cargo(root);
        command.args([
            "bench",
            "--package",
            "retry-after-estimator",
            "--bench",
            "estimate",
        ]);
        crate::run(command)?;
    }
    // The others (`sim-bench`, `socket-bench`, `datapath-bench`, `loss-bench`) are binaries of
    // the evaluation crate.
    let bench_bin = |bin: &str| {
        let mut command = env.cargo(root);
        command.args(["run", "--release", "--package", "retry-after-eval"]);
        command.args(["--bin", bin, "--"]);
        command
    };
    if matches!(which, None | Some("sim")) {
        crate::run(bench_bin("sim-bench"))?;
    }
    if matches!(which, None | Some("socket")) {
        crate::run(bench_bin("socket-bench"))?;
    }
    if matches!(which, None | Some("datapath")) {
        let mut command = bench_bin("datapath-bench");
        command.args(
            [
                args.rounds,
                args.seconds,
                args.connections,
                args.kernel_rounds,
            ]
            .map(|n| n.to_string()),
        );
        crate::run(command)?;
    }
    if matches!(which, None | Some("loss")) {
        let mut command = bench_bin("loss-bench");
        command.args([args.loss_rounds, args.seconds].map(|n| n.to_string()));
        crate::run(command)?;
    }
    Ok(())
}
