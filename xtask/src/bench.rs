//! `bench`: the data-path benchmark (tests/src/bin/datapath-bench.rs), release build.

use std::path::Path;

use anyhow::Result;

use crate::setup::Env;

/// Options of the data-path benchmark.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Rounds; each measures the three setups in rotating order.
    #[arg(long, default_value_t = 10)]
    rounds: u64,
    /// Seconds of load per measurement.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Concurrent keep-alive connections.
    #[arg(long, default_value_t = 16)]
    connections: u64,
}

/// Build and run the benchmark; it prints a markdown table.
pub fn bench(root: &Path, env: &Env, args: &BenchArgs) -> Result<()> {
    let mut command = env.cargo(root);
    command.args([
        "run",
        "--release",
        "--package",
        "retry-after-integration-tests",
        "--bin",
        "datapath-bench",
        "--",
    ]);
    command.args([args.rounds, args.seconds, args.connections].map(|n| n.to_string()));
    crate::run(command)
}
