//! The `retry-after-agent` binary: parses the command line and runs one command.
//!
//! Errors are printed as one line, `retry-after-agent: <what failed>: <cause>: …`, never with
//! a backtrace, and the exit code says what kind of failure it was (docs/operations.md):
//! 0 success; 1 failure (kernel, socket, an agent that does not answer, `check` finding
//! something missing); 2 bad command line or configuration; 3 another agent runs on this node.

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
    time::Duration,
};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use retry_after_agent::{
    attach,
    instance::{InstanceError, InstanceLock},
    kernel::{FeatureState, KernelSupport, Probe, ProbeOptions, find_cgroup2_root},
    privileges, run,
    run::RunError,
    shutdown,
};
use retry_after_common::Protocol;
use retry_after_estimator::{
    config::{AttachCgroups, Config, ConfigError, DEFAULT_CONFIG},
    {RejectedAt, ReplicaQueue, RetryAfterPolicy, ServiceSettings},
};
use retry_after_policy::{MAX_KEPT_RETRY_AFTER_S, MAX_RETRY_AFTER_S};
use tracing::info;

/// What `--version` prints after the name: the version and the commit built from (build.rs).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("RETRY_AFTER_AGENT_COMMIT"),
    ")"
);

/// Tells load-shedding proxies when to tell clients to come back: computes Retry-After from
/// backend load observed in the kernel with eBPF, and serves it over a Unix socket.
#[derive(Debug, Parser)]
#[command(version = VERSION, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon (as root, or with CAP_BPF and CAP_NET_ADMIN): attach the eBPF programs,
    /// watch the configured backends, serve proxies and metrics until SIGINT or SIGTERM.
    Run {
        /// Configuration file (TOML); without it the embedded default is used.
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Ask a running agent for a service's Retry-After, as a proxy would, and print the answer.
    Query {
        /// The service, as named in the configuration.
        service: String,
        /// Your queue depth for the service.
        #[arg(long, value_name = "N")]
        queue_depth: Option<u64>,
        /// Your placement backoff streak.
        #[arg(long, value_name = "N")]
        backoff_streak: Option<u32>,
        /// The agent's socket (default: agent.socket_path of --config, or of the default
        /// configuration).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Configuration file whose socket path to use.
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Give up after this many milliseconds.
        #[arg(long, default_value_t = 2000, value_name = "MS")]
        timeout_ms: u64,
    },
    /// Watch every service live, refreshed each second from the socket: queue depth and its
    /// source, drain rate, fresh arrivals, the answer with its rung and reason, returns
    /// promised, the judge's admitted share. Once with --once, or when not on a terminal.
    Status {
        /// Print one snapshot and exit.
        #[arg(long)]
        once: bool,
        /// The agent's socket (default: agent.socket_path of --config, or of the default
        /// configuration).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Configuration file whose socket path to use.
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Milliseconds between refreshes.
        #[arg(long, default_value_t = 1000, value_name = "MS", value_parser = clap::value_parser!(u64).range(100..=60_000))]
        interval_ms: u64,
    },
    /// Validate a configuration and check that this machine has what the agent needs.
    Check {
        /// Configuration file (TOML); without it the embedded default is checked.
        #[arg(long, short, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Print the embedded default configuration, a starting point for your own.
    PrintDefaultConfig,
}

fn load(config: Option<&PathBuf>) -> anyhow::Result<Config> {
    Ok(match config {
        Some(path) => Config::from_file(path)?,
        None => Config::default_config(),
    })
}

/// The socket a client command talks to: `--socket`, else `agent.socket_path` of `--config`
/// or of the default configuration.
fn socket_path(socket: Option<PathBuf>, config: Option<&PathBuf>) -> anyhow::Result<PathBuf> {
    Ok(match socket {
        Some(socket) => socket,
        None => load(config)?.agent.socket_path,
    })
}

/// Exit codes.
mod exit {
    /// Something failed.
    pub const FAILURE: u8 = 1;
    /// The command line or the configuration is invalid.
    pub const INVALID: u8 = 2;
    /// Another agent runs on this node.
    pub const ANOTHER_AGENT: u8 = 3;
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if matches!(cli.command, Command::Run { .. }) {
        // The daemon's runtime threads hold no capability from their start: only the thread
        // that attaches needs any, and it gives them up once attached (`run`). Asked before
        // any thread starts.
        privileges::keeps_bpf();
        runtime.on_thread_start(|| {
            if let Err(error) = privileges::drop_all() {
                eprintln!("retry-after-agent: a runtime thread kept its capabilities: {error}");
                std::process::abort();
            }
        });
    }
    let runtime = match runtime.build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("retry-after-agent: cannot start the runtime: {error}");
            return ExitCode::from(exit::FAILURE);
        }
    };
    match runtime.block_on(command(cli)) {
        Ok(code) => code,
        Err(error) => {
            // `{:#}`: the message and every cause on one line; no backtrace, whatever
            // RUST_BACKTRACE says.
            eprintln!("retry-after-agent: {error:#}");
            ExitCode::from(exit_code(&error))
        }
    }
}

/// The exit code for an error, from the kinds in its chain.
fn exit_code(error: &anyhow::Error) -> u8 {
    for cause in error.chain() {
        if cause.downcast_ref::<ConfigError>().is_some() {
            return exit::INVALID;
        }
        if let Some(InstanceError::Running { .. }) = cause.downcast_ref::<InstanceError>() {
            return exit::ANOTHER_AGENT;
        }
        if let Some(RunError::Instance(InstanceError::Running { .. })) =
            cause.downcast_ref::<RunError>()
        {
            return exit::ANOTHER_AGENT;
        }
    }
    exit::FAILURE
}

async fn command(cli: Cli) -> anyhow::Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Run { config } => {
            let config = load(config.as_ref())?;
            // Caught before anything is attached, so a stop during start-up is a clean stop.
            let signals =
                shutdown::Signals::install().context("cannot install the signal handlers")?;
            let shutdown = async {
                let signal = signals.recv().await;
                info!(signal, "stopping");
            };
            run::run(config, shutdown).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Query {
            service,
            queue_depth,
            backoff_streak,
            socket,
            config,
            timeout_ms,
        } => {
            let socket = socket_path(socket, config.as_ref())?;
            let answer = retry_after_client::query(
                &socket,
                &service,
                queue_depth,
                backoff_streak,
                Duration::from_millis(timeout_ms),
            )
            .with_context(|| format!("query to {}", socket.display()))?;
            println!("{answer}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Status {
            once,
            socket,
            config,
            interval_ms,
        } => {
            let socket = socket_path(socket, config.as_ref())?;
            retry_after_agent::status::run(&socket, once, Duration::from_millis(interval_ms))
                .await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Check { config } => Ok(check(config.as_ref())),
        Command::PrintDefaultConfig => {
            print!("{DEFAULT_CONFIG}");
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// What `check` says of a service's policy: which one it uses and, unless it is
/// `scheduled_returns`, why that one is recommended (docs/evaluation.md has the figures).
fn policy_note(settings: &ServiceSettings) -> String {
    let what = format!("service {}", settings.name);
    match settings.policy {
        RetryAfterPolicy::ScheduledReturns => format!(
            "ok      {what}: policy scheduled_returns (overload_rule {})",
            settings.constants.overload_rule
        ),
        RetryAfterPolicy::KeptReturns => format!(
            "ok      {what}: policy kept_returns: the proxies in front of it must keep the \
            places they promise (docs/integrations/), or it answers as scheduled_returns with \
            the fill_capacity rule"
        ),
        other => format!(
            "NOTE    {what}: policy {other}; scheduled_returns is recommended: on the \
            evaluation's suite of 24 overload scenarios a retry at its time was admitted 72% of \
            the time on average, against 10% for router_queue_drain_rate and 66% for the best \
            static value, with less capacity left idle (docs/evaluation.md). Set \
            retry_after_policy = \"scheduled_returns\" and keep retry_after_s as its fallback"
        ),
    }
}

/// What `check` says of a service's clamp: the values its Retry-After is kept within, and,
/// where it keeps returns, whether a place further away is told as it is.
fn clamp_note(settings: &ServiceSettings) -> String {
    let what = format!("service {}", settings.name);
    let (min, max) = settings.constants.clamp();
    let within = format!("Retry-After within {min} to {max} s");
    match settings.policy {
        RetryAfterPolicy::KeptReturns if max > MAX_RETRY_AFTER_S => format!(
            "NOTE    {what}: {within}: places up to {max} s away are told as they are; a \
            client that ignores or caps a value that long comes back early and spends an \
            attempt (what common clients do: docs/integrations/clients.md)"
        ),
        RetryAfterPolicy::KeptReturns => format!(
            "ok      {what}: {within}: a place further away is told {max} s and the client is \
            told the rest when it comes back; max_retry_after_s up to \
            {MAX_KEPT_RETRY_AFTER_S} tells it as it is, for clients that honour it \
            (docs/integrations/clients.md)"
        ),
        _ => format!("ok      {what}: {within}"),
    }
}

/// The lines `check` prints, and how many requirements are missing.
#[derive(Default)]
struct Checklist {
    missing: usize,
}

impl Checklist {
    /// A requirement, met or missing.
    fn report(&mut self, ok: bool, what: &str, detail: String) {
        println!(
            "{} {what}: {detail}",
            if ok { "ok     " } else { "MISSING" }
        );
        self.missing += usize::from(!ok);
    }

    /// Something that works, but not as well as it could.
    fn warn(&self, what: &str, detail: &str) {
        println!("WARN    {what}: {detail}");
    }
}

/// Print one line per requirement; exit non-zero if any is missing (2 if the configuration is
/// what is wrong).
fn check(config: Option<&PathBuf>) -> ExitCode {
    let mut list = Checklist::default();
    let config = check_configuration(&mut list, config);
    check_btf(&mut list);
    let cgroup = config
        .as_ref()
        .and_then(|c| c.agent.cgroup.clone())
        .or_else(find_cgroup2_root);
    list.report(
        cgroup.is_some(),
        "cgroup v2",
        match &cgroup {
            Some(path) => format!("hierarchy at {}", path.display()),
            None => "no cgroup2 hierarchy is mounted: mount -t cgroup2 none /sys/fs/cgroup/unified"
                .into(),
        },
    );
    check_programs(&mut list, config.as_ref(), cgroup);
    if let Some(config) = &config {
        check_socket_directory(&mut list, config);
    }
    if list.missing == 0 {
        println!("everything the agent needs is here");
        ExitCode::SUCCESS
    } else {
        println!("{} requirement(s) missing", list.missing);
        ExitCode::from(if config.is_none() {
            exit::INVALID
        } else {
            exit::FAILURE
        })
    }
}

/// The configuration (read once), each service's policy, and the services whose queue no
/// kernel source can see.
fn check_configuration(list: &mut Checklist, path: Option<&PathBuf>) -> Option<Config> {
    let config = match load(path) {
        Ok(config) => config,
        Err(error) => {
            list.report(false, "configuration", format!("{error:#}"));
            return None;
        }
    };
    list.report(
        true,
        "configuration",
        format!(
            "{} service(s), {} endpoint(s) to watch",
            config.services.len(),
            config.watched_endpoints().len()
        ),
    );
    for service in &config.services {
        let settings = service.settings();
        println!("{}", policy_note(&settings));
        println!("{}", clamp_note(&settings));
        if settings.policy != RetryAfterPolicy::Static && !settings.queue_needs_proxy_depth() {
            println!("{}", queue_note(&settings));
        }
        if settings.policy != RetryAfterPolicy::Static && settings.queue_needs_proxy_depth() {
            list.warn(
                &format!("service {}", service.name),
                queue_invisible_note(settings.rejected_at),
            );
        }
    }
    Some(config)
}

/// Where a computing service's queue depth comes from when the proxy passes none, and what
/// that source cannot see.
fn queue_note(settings: &ServiceSettings) -> String {
    let what = format!("service {}", settings.name);
    let inside = match settings.replica_queue {
        ReplicaQueue::BeyondCapacity => {
            "the requests in flight beyond each replica's max_ongoing_requests (an engine \
            whose batch is smaller, bounded by its KV cache, queues more than this shows; \
            replica_queue = \"waiting\" reads a streaming engine's queue without a capacity)"
        }
        ReplicaQueue::Waiting => {
            "the requests whose response's first body byte has not gone by (headers alone do \
            not count: an engine sends them before it schedules the request); a non-streamed \
            answer waits until its whole body, so its running requests count as waiting, and \
            inside TLS no body byte is seen"
        }
    };
    match settings.rejected_at {
        RejectedAt::Proxy => format!(
            "ok      {what}: queue depth from the frontend: the proxy's listener's requests \
            in flight minus those forwarded, plus what waits inside the replicas: {inside}"
        ),
        RejectedAt::Replica => format!("ok      {what}: queue depth at the replicas: {inside}"),
    }
}

/// Why a computing service whose queue no kernel source can see answers statically.
fn queue_invisible_note(rejected_at: RejectedAt) -> &'static str {
    match rejected_at {
        RejectedAt::Proxy => {
            "no frontend: the kernel cannot see the proxy's queue, so Retry-After is computed \
            only when the proxy passes queue_depth=; otherwise it is the static value (reason \
            queue_invisible). Declare `frontend` (the proxy's listener) or pass the depth"
        }
        RejectedAt::Replica => {
            "a backend has no max_ongoing_requests: the queue at the replicas cannot be seen, \
            so Retry-After is computed only when the replica passes queue_depth=; otherwise it is \
            the static value (reason queue_invisible)"
        }
    }
}

/// The kernel's BTF, which the programs are verified against.
fn check_btf(list: &mut Checklist) {
    let btf = std::path::Path::new("/sys/kernel/btf/vmlinux").exists();
    list.report(
        btf,
        "kernel BTF",
        if btf {
            "/sys/kernel/btf/vmlinux present".into()
        } else {
            "/sys/kernel/btf/vmlinux is absent: use a kernel built with CONFIG_DEBUG_INFO_BTF"
                .into()
        },
    );
}

/// Load, verify and attach the programs, then detach them at once; not beside a running
/// agent (the instance lock is held meanwhile, so none starts).
fn check_programs(list: &mut Checklist, config: Option<&Config>, cgroup: Option<PathBuf>) {
    let _lock = match InstanceLock::acquire() {
        Err(InstanceError::Running { holder }) => {
            list.report(
                true,
                "eBPF programs",
                format!("not loaded again: an agent is running and attached ({holder})"),
            );
            return;
        }
        Ok(lock) => Some(lock),
        Err(InstanceError::Io(_)) => None,
    };
    if cgroup.is_none() {
        return;
    }
    let plan = config.map(|c| (c, attach::plan(c, Path::new("/proc"))));
    if let Some((config, plan)) = &plan {
        report_attach_plan(list, config, plan);
    }
    let options = ProbeOptions {
        cgroup,
        attach_to: plan.map(|(_, plan)| plan.dirs).unwrap_or_default(),
        ..ProbeOptions::default()
    };
    match Probe::attach(&options) {
        Ok(probe) => {
            report_kernel_support(list, probe.kernel_support(), config);
            list.report(
                true,
                "eBPF programs",
                format!(
                    "sock_ops and cgroup_skb programs load and attach ({} programs: {}) to {}",
                    probe.program_ids().len(),
                    probe.kernel_support().programs().names()[..3].join(", "),
                    probe
                        .attached_cgroups()
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
        }
        Err(error) => list.report(
            false,
            "eBPF programs",
            format!("{:#}", anyhow::Error::from(error)),
        ),
    }
}

/// One line per kernel feature (present, or missing with the verifier's reason and what goes
/// without it), a warning per service that needs what is switched off. A missing feature is
/// not a missing requirement: the agent runs without what needs it.
fn report_kernel_support(list: &Checklist, support: &KernelSupport, config: Option<&Config>) {
    for (feature, state) in support.features.iter() {
        match state {
            FeatureState::Present => println!(
                "ok      kernel feature {} (since {}): present",
                feature.name(),
                feature.since()
            ),
            FeatureState::Missing(why) => list.warn(
                &format!(
                    "kernel feature {} (since {})",
                    feature.name(),
                    feature.since()
                ),
                &format!("missing ({why}): {}", feature.without()),
            ),
        }
    }
    for limit in support.limits() {
        list.warn("on this kernel", &limit);
    }
    if support.http2_off.is_none() {
        return;
    }
    let Some(config) = config else {
        return;
    };
    for (endpoint, protocol) in config.protocols() {
        if matches!(protocol, Protocol::Http2 | Protocol::Grpc) {
            list.warn(
                &format!("endpoint {endpoint}"),
                "configured as HTTP/2, whose streams this kernel cannot count: its requests are not counted",
            );
        }
    }
}

/// Which processes own the watched sockets now, and where `attach_cgroups = "auto"` attaches
/// for them (or why it would be the root, and what that costs).
fn report_attach_plan(list: &mut Checklist, config: &Config, plan: &attach::AttachPlan) {
    let found = if plan.owners.is_empty() {
        "no process owns a watched socket now".to_owned()
    } else {
        format!("the watched sockets' owners: {}", plan.owners_listed())
    };
    let setting = match config.agent.attach_cgroups {
        AttachCgroups::Auto => "agent.attach_cgroups = \"auto\"",
        _ => "with agent.attach_cgroups = \"auto\", the agent",
    };
    list.report(
        true,
        "attach cgroups",
        format!("{found}; {setting} {}", plan.auto_described()),
    );
}

/// The socket's directory can be created and written.
fn check_socket_directory(list: &mut Checklist, config: &Config) {
    let socket = &config.agent.socket_path;
    let dir = socket.parent().map(PathBuf::from).unwrap_or_default();
    let writable = std::fs::create_dir_all(&dir).is_ok() && tempfile_in(&dir).is_ok();
    list.report(
        writable,
        "socket directory",
        format!(
            "{} {}",
            dir.display(),
            if writable {
                "is writable"
            } else {
                "cannot be written"
            }
        ),
    );
}

/// Create and remove a file in `dir`.
fn tempfile_in(dir: &std::path::Path) -> std::io::Result<()> {
    let path = dir.join(format!(".retry-after-check-{}", std::process::id()));
    std::fs::write(&path, b"")?;
    std::fs::remove_file(path)
}
