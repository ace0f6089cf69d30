//! `retry-after-reference-proxy`: the reference rejecting proxy in front of replicas named on
//! the command line, with `Retry-After` from the agent on every rejection.
//!
//! ```text
//! retry-after-reference-proxy --listen 127.0.0.1:8000 --service chat \
//!     --replica 127.0.0.1:9001=4 --replica 127.0.0.1:9002=4 --max-queued-requests 32
//! ```
//!
//! Runs until SIGINT or SIGTERM.

use std::{net::SocketAddr, path::PathBuf};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, ValueEnum};
use retry_after_policy::{KeptReturnsSettings, KeyHasher};
use retry_after_reference_proxy::{
    HeaderPolicy, Keeping, KeyFrom, Proxy, ProxyConfig, RETURN_COOKIE,
};
use tokio::{net::TcpListener, signal::unix::SignalKind};

/// The reference rejecting proxy: a bounded queue, power-of-two-choices placement with
/// backoff, and Retry-After from retry-after-agent on every rejection.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    /// Address to accept clients on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// The agent's Unix socket.
    #[arg(long, default_value = "/run/retry-after-agent/agent.sock")]
    agent_socket: PathBuf,
    /// The service's name in the agent's configuration.
    #[arg(long)]
    service: String,
    /// A replica as ADDRESS=MAX_ONGOING_REQUESTS (repeat for each replica).
    #[arg(long = "replica", value_parser = parse_replica, required = true)]
    replicas: Vec<(SocketAddr, usize)>,
    /// Requests the queue holds before rejecting.
    #[arg(long, default_value_t = 32)]
    max_queued_requests: usize,
    /// Status code of a rejection (429 or 503).
    #[arg(long, default_value_t = 429)]
    status_code: u16,
    /// What rejections carry.
    #[arg(long, value_enum, default_value_t = Header::Agent)]
    header: Header,
    /// Leave `retry-after-ms` off rejections (by default it goes beside `Retry-After`, the
    /// same time in milliseconds).
    #[arg(long)]
    no_retry_after_ms: bool,
    /// Seed of the placement and jitter draws.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Keep the places rejections promise (kept returns), keyed by this request header
    /// (`header:x-api-key`) or by a signed return cookie (`cookie`, or `cookie:NAME`).
    #[arg(long, value_parser = parse_keep)]
    keep: Option<KeyFrom>,
    /// The secret keys are hashed and cookies signed with (a file holding it; proxies that
    /// honour each other's cookies share it). Without it, a random one.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// With `--keep`: the share of the drain, in percent (1 to 100), that the places given to
    /// one source (a client address) may take; past it, the hint without a place. 0: no bound.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=100))]
    source_share_percent: u8,
    /// With a source share: the header whose last entry is the client's address (a load
    /// balancer's `X-Forwarded-For`); without it, the connection's peer.
    #[arg(long)]
    source_header: Option<String>,
    /// With `--keep`: the header whose value is the seconds a request may wait
    /// (`x-request-timeout`); a place further away is not given, and the client is told its
    /// seconds and `x-should-retry: false`.
    #[arg(long)]
    deadline_header: Option<String>,
    /// With `--keep`: the wait every request is allowed, in seconds (as `--deadline-header`).
    #[arg(long)]
    max_wait_s: Option<u64>,
}

fn parse_keep(text: &str) -> Result<KeyFrom, String> {
    match text.split_once(':') {
        Some(("header", name)) if !name.is_empty() => {
            Ok(KeyFrom::Header(name.to_ascii_lowercase()))
        }
        Some(("cookie", name)) if !name.is_empty() => Ok(KeyFrom::Cookie(name.to_owned())),
        None if text == "cookie" => Ok(KeyFrom::Cookie(RETURN_COOKIE.to_owned())),
        _ => Err(format!(
            "{text:?}: expected header:NAME, cookie or cookie:NAME"
        )),
    }
}

/// The secret from `--secret-file`, or a random one.
fn secret(path: Option<&PathBuf>) -> Result<Vec<u8>> {
    match path {
        Some(path) => {
            let secret = std::fs::read(path)
                .with_context(|| format!("--secret-file: cannot read {}", path.display()))?;
            if secret.trim_ascii().is_empty() {
                bail!("--secret-file: {} is empty", path.display());
            }
            Ok(secret.trim_ascii().to_vec())
        }
        None => Ok(rand::random::<[u8; 32]>().to_vec()),
    }
}

/// `--header`.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum Header {
    /// No Retry-After.
    None,
    /// Retry-After from the agent's estimate with the proxy's queue depth.
    Agent,
    /// The same, the depth counting the clients told to come back who are not due yet.
    AgentWithRetryBacklog,
}

fn parse_replica(text: &str) -> Result<(SocketAddr, usize), String> {
    let (address, max) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?}: expected ADDRESS=MAX_ONGOING_REQUESTS"))?;
    let address = address
        .parse()
        .map_err(|e| format!("{address:?}: not a socket address ({e})"))?;
    let max = max
        .parse()
        .ok()
        .filter(|n| *n >= 1)
        .ok_or_else(|| format!("{max:?}: max_ongoing_requests is a whole number from 1"))?;
    Ok((address, max))
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let cli = Cli::parse();
    if !(cli.status_code == 429 || cli.status_code == 503) {
        bail!("--status-code: {} (expected 429 or 503)", cli.status_code);
    }
    if cli.max_queued_requests == 0 {
        bail!("--max-queued-requests: 0 (expected at least 1)");
    }
    let listener = TcpListener::bind(cli.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cli.listen))?;
    let config = ProxyConfig {
        service: cli.service,
        replicas: cli.replicas,
        max_queued_requests: cli.max_queued_requests,
        status_code: cli.status_code,
        header: match cli.header {
            Header::None => HeaderPolicy::None,
            Header::Agent => HeaderPolicy::FromAgent,
            Header::AgentWithRetryBacklog => HeaderPolicy::FromAgentWithRetryBacklog,
        },
        retry_after_ms: !cli.no_retry_after_ms,
        seed: cli.seed,
        record_rejections: false,
        keeping: match cli.keep {
            Some(key_from) => Some(Keeping {
                key_from,
                settings: KeptReturnsSettings {
                    source_share_percent: cli.source_share_percent,
                    ..KeptReturnsSettings::default()
                },
                hasher: KeyHasher::new(&secret(cli.secret_file.as_ref())?),
                source_header: cli.source_header,
                deadline_header: cli.deadline_header.map(|h| h.to_ascii_lowercase()),
                max_wait_s: cli.max_wait_s,
            }),
            None => None,
        },
    };
    let proxy = Proxy::serve(listener, config, &cli.agent_socket)?;
    tracing::info!(listen = %proxy.addr(), agent = %cli.agent_socket.display(), "serving");
    let mut terminate = tokio::signal::unix::signal(SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    tracing::info!("stopping");
    drop(proxy);
    Ok(())
}
