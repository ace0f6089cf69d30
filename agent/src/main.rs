//! The `retry-after-agent` binary: parses the command line and runs the daemon.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use retry_after_agent::{config::Config, run, shutdown};
use tracing::info;

/// Tells load-shedding proxies when to tell clients to come back: computes Retry-After from
/// backend load observed in the kernel with eBPF.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon (needs root or CAP_BPF + CAP_NET_ADMIN): attach the eBPF programs and
    /// watch the configured backends until SIGINT or SIGTERM.
    Run {
        /// Configuration file (TOML). Without it the embedded default configuration is used;
        /// `print-default-config` shows it.
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Print the embedded default configuration, a starting point for your own.
    PrintDefaultConfig,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match Cli::parse().command {
        Command::Run { config } => {
            let config = match &config {
                Some(path) => Config::from_file(path)?,
                None => Config::default_config(),
            };
            let (snapshots, _) = tokio::sync::watch::channel(None);
            let shutdown = async {
                match shutdown::signal().await {
                    Ok(signal) => info!(signal, "stopping"),
                    Err(error) => tracing::error!(%error, "cannot wait for signals; stopping"),
                }
            };
            run::run(config, snapshots, shutdown)
                .await
                .context("retry-after-agent failed")?;
        }
        Command::PrintDefaultConfig => print!("{}", retry_after_agent::config::DEFAULT_CONFIG),
    }
    Ok(())
}
