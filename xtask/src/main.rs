//! Project tasks, run through `./dev` (which first installs the pinned toolchain):
//!
//! * `setup`: everything a fresh Debian machine needs beyond rustup: bpf-linker built against
//!   the pinned toolchain's own LLVM, and the Debian and Python packages the tests and
//!   benchmarks use (`setup --for run`: bpf-linker only). Idempotent: a second run only checks.
//! * `run`: bpf-linker, then the agent with the embedded default configuration (nothing the
//!   tests use is installed).
//! * `check`: formatting, lints (host crates and the eBPF crate), rustdoc and every test that
//!   needs neither root nor an installed package (the crates' own tests, and the Lua and
//!   Python ports against the shared vectors): the lane for any contributor, with bpf-linker
//!   the only thing it installs.
//! * `test`: bpf-linker, then `check` and the root suite's build while everything else the
//!   tests run installs beside them, then the root suite: the integration tests that attach
//!   the real programs and drive real proxies (needs root). Ends with the time each part took.
//! * `bench [datapath|estimate|socket|sim]`: setup, then the benchmarks, all four by default
//!   (see docs/evaluation.md).
//! * `soak [MINUTES]`: setup, then the agent under mixed traffic for MINUTES, restarted once,
//!   its resources sampled each minute (as root; not part of `test`).
//! * `evaluate`: setup, then `retry-after-eval` with the arguments given; with none, the
//!   five scenarios under eight policies on real sockets and in the simulator, side by side
//!   (writes docs/evaluation-run/, see docs/evaluation.md).
//! * `package`: bpf-linker, the pinned cargo-deb and dpkg-dev, then the Debian package: the
//!   release agent (with its eBPF object, `--version` naming the commit), the systemd unit and
//!   sysusers file, the configuration under /etc and the docs, in `target/debian/`. Prints the
//!   package's path (docs/deploy.md, "Debian package"). `--profile dev` packages the debug
//!   build instead (the package's test does, with the suite's build).

mod bench;
// The build script's file: `--version`'s commit, said the same way here (`head_files` is the
// build script's alone).
#[allow(dead_code)]
#[path = "../../agent/git_commit.rs"]
mod git_commit;
mod lanes;
mod setup;
mod timings;

use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use cargo_metadata::Message;
use clap::{Parser, Subcommand};
use timings::{Timings, run_tests};

#[derive(Debug, Parser)]
#[command(about = "retry-after-agent project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Install bpf-linker (against the pinned toolchain's LLVM) and the Debian and Python
    /// packages the tests use.
    Setup {
        /// `run`: only what building and running the agent needs; `test` (the default):
        /// everything.
        #[arg(long = "for", value_parser = ["run", "test"], default_value = "test")]
        purpose: String,
    },
    /// Install bpf-linker, then run the agent (release build) with the embedded default
    /// configuration.
    Run {
        /// Arguments after `run` for the agent, e.g. `--config my.toml`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Check formatting, lints and rustdoc and run the tests that need no root and no
    /// installed package (bpf-linker is the one thing installed).
    Check,
    /// Set up, then `check`, then the root suite (as root); prints the time of each part.
    Test,
    /// Set up, then measure the data-path cost of the attached programs.
    Bench(bench::BenchArgs),
    /// Set up, then soak the agent: mixed traffic on loopback for MINUTES (default 30), the
    /// agent restarted once midway, its memory, files, connections and ticks sampled each
    /// minute and its counts held to nginx's (as root; not part of `test`).
    Soak {
        /// How long, in minutes (6 at least).
        #[arg(default_value_t = 30)]
        minutes: u32,
    },
    /// Set up, then run the evaluation (`retry-after-eval`; with no arguments the real-socket
    /// and simulated runs side by side, as root, about 40 minutes).
    Evaluate {
        /// Arguments for `retry-after-eval`, e.g. `simulate --scenario-dir eval/scenarios/suite`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Install cargo-deb (pinned), then build the Debian package (release agent, systemd unit,
    /// sysusers file, configuration, docs) in target/debian/ and print its path.
    Package {
        /// The cargo profile whose agent is packaged: `release`, or `dev` (the package's test
        /// packages the debug build the suite already has).
        #[arg(long, default_value = "release", value_parser = ["release", "dev"])]
        profile: String,
    },
}

/// Build the agent (release), then run the evaluation crate's binary `bin` with `args`: the
/// evaluation and the soak start the agent binary, which must be built alongside them.
fn run_eval_binary(root: &Path, env: &setup::Env, bin: &str, args: &[String]) -> Result<()> {
    let mut build = env.cargo(root);
    build.args(["build", "--release", "--package", "retry-after-agent"]);
    run(build)?;
    let mut command = env.cargo(root);
    command.args([
        "run",
        "--release",
        "--package",
        "retry-after-eval",
        "--bin",
        bin,
        "--",
    ]);
    command.args(args);
    run(command)
}

/// Errors end the task as one message (its causes after colons) and exit 1: no backtrace,
/// so a failed test run's last lines are the failed tests' messages.
fn main() -> std::process::ExitCode {
    match task() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The task the command line names.
fn task() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    let needs = match &cli.task {
        // The tests' own packages install beside the checks (`test`), which need bpf-linker only.
        Task::Run { .. } | Task::Check | Task::Test => setup::Needs::Run,
        Task::Setup { purpose } if purpose == "run" => setup::Needs::Run,
        Task::Package { .. } => setup::Needs::Package,
        _ => setup::Needs::Everything,
    };
    let mut timings = Timings::default();
    let env = timings.part("setup", || setup::setup(&root, needs))?;
    match cli.task {
        Task::Setup { .. } => Ok(()),
        Task::Run { args } => {
            let mut command = env.cargo(&root);
            command.args([
                "run",
                "--release",
                "--package",
                "retry-after-agent",
                "--",
                "run",
            ]);
            command.args(args);
            run(command)
        }
        Task::Check => {
            check(&root, &env, &mut timings)?;
            timings.print();
            Ok(())
        }
        Task::Test => {
            let outcome = test(&root, &env, &mut timings);
            timings.print();
            outcome
        }
        Task::Bench(args) => bench::bench(&root, &env, &args),
        Task::Soak { minutes } => run_eval_binary(&root, &env, "soak", &[minutes.to_string()]),
        Task::Evaluate { args } => {
            let args = if args.is_empty() {
                DEFAULT_EVALUATION.iter().map(ToString::to_string).collect()
            } else {
                args
            };
            run_eval_binary(&root, &env, "retry-after-eval", &args)
        }
        Task::Package { profile } => {
            let deb = package(&root, &env, &profile)?;
            // Alone on standard output, the last line: what scripts and the package's test read.
            println!("{}", deb.display());
            Ok(())
        }
    }
}

/// Build the agent with `profile` (`release`, `dev`), then package it with cargo-deb
/// (`[package.metadata.deb]` in agent/Cargo.toml); the package's path.
fn package(root: &Path, env: &setup::Env, profile: &str) -> Result<PathBuf> {
    // Given to the build script, so `--version` names this tree even when only files changed
    // since the script last ran (a changed value runs it again).
    let commit = git_commit::describe(root).unwrap_or_else(|| git_commit::UNKNOWN.to_owned());
    eprintln!("+ {}={commit}", git_commit::VARIABLE);
    let mut build = env.cargo(root);
    build.env(git_commit::VARIABLE, &commit).args([
        "build",
        "--profile",
        profile,
        "--locked",
        "--package",
        "retry-after-agent",
        "--bin",
        "retry-after-agent",
    ]);
    run(build)?;
    let mut deb = env.cargo(root);
    deb.env(git_commit::VARIABLE, &commit).args([
        "deb",
        "--no-build",
        "--profile",
        profile,
        "--locked",
        "--package",
        "retry-after-agent",
    ]);
    // cargo-deb prints the package's path on standard output.
    let printed = capture(&mut deb)?;
    let path = printed
        .lines()
        .rev()
        .map(str::trim)
        .find(|line| line.ends_with(".deb"))
        .map(|line| root.join(line))
        .with_context(|| format!("cargo deb printed no package path: {printed:?}"))?;
    if !path.is_file() {
        bail!("cargo deb named {}, which is not there", path.display());
    }
    Ok(path)
}

/// What `./dev evaluate` runs without arguments: every scenario of `eval/scenarios/` under
/// the evaluation's default policies (`Policy::ALL`), results in docs/evaluation-run.
const DEFAULT_EVALUATION: [&str; 1] = ["agreement"];

/// The lane without root: formatting, lints, rustdoc, the crates' own tests and the ports'
/// vector checks.
fn check(root: &Path, env: &setup::Env, timings: &mut Timings) -> Result<()> {
    timings.part("format and lints", || lint(root, env))?;
    timings.part("estimator purity", || estimator_is_pure(root, env))?;
    // Rustdoc of every host crate, broken links and all.
    let mut doc = env.cargo(root);
    doc.env("RUSTDOCFLAGS", "-D warnings")
        .args(["doc", "--no-deps", "--workspace"]);
    doc.args(["--exclude", "retry-after-ebpf"]);
    timings.part("rustdoc", || run(doc))?;
    // Every crate's own tests (the root suite is the integration tests crate).
    let mut unit = env.cargo(root);
    unit.args(["test", "--workspace"]);
    unit.args(["--exclude", "retry-after-integration-tests"]);
    unit.args(["--exclude", "retry-after-ebpf"]);
    timings.part("crate tests", || run(unit))
}

/// The estimator's dependencies, as it resolves them alone, include neither aya nor tokio.
fn estimator_is_pure(root: &Path, env: &setup::Env) -> Result<()> {
    let mut tree = env.cargo(root);
    tree.args([
        "tree",
        "--package",
        "retry-after-estimator",
        "--edges",
        "normal",
    ])
    .args(["--prefix", "none", "--format", "{p}"]);
    let listed = capture(&mut tree)?;
    let impure: Vec<&str> = listed
        .lines()
        .filter(|package| {
            let name = package.split_whitespace().next().unwrap_or_default();
            name == "tokio" || name.starts_with("aya")
        })
        .collect();
    if !impure.is_empty() {
        bail!("retry-after-estimator must depend on neither aya nor tokio; it reaches {impure:?}");
    }
    Ok(())
}

/// `cargo fmt --check`, then clippy over the host crates and over the eBPF crate.
fn lint(root: &Path, env: &setup::Env) -> Result<()> {
    let mut fmt = env.cargo(root);
    fmt.args(["fmt", "--all", "--", "--check"]);
    run(fmt)?;
    // Host crates: the default members (the eBPF crate is not one).
    let mut clippy = env.cargo(root);
    clippy.args(["clippy", "--all-targets", "--", "-D", "warnings"]);
    run(clippy)?;
    // The eBPF crate builds for the BPF target only, so it is linted on its own.
    let mut clippy_ebpf = env.cargo(&root.join("ebpf"));
    clippy_ebpf.env("RUSTC_BOOTSTRAP", "1").args([
        "clippy",
        "--release",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--",
        "-D",
        "warnings",
    ]);
    run(clippy_ebpf)
}

/// `check`, then the root suite: the integration tests, a module at a time in each of two
/// lanes (network namespaces of their own, see `lanes`), the kernel matrix beside them, and
/// the tests that need the machine to themselves after both.
fn test(root: &Path, env: &setup::Env, timings: &mut Timings) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the root suite loads and attaches eBPF programs: run `./dev test` as root (CAP_BPF, CAP_NET_ADMIN), or `./dev check` for everything that needs no root"
        );
    }
    // What the root suite runs (the Debian and Python packages, Ray Serve's and vLLM's
    // environments, the kernels, cargo-deb) installs while the checks compile and run: the
    // downloads and unpacking wait on the network and the disk, the checks on the CPU.
    let packages = {
        let root = root.to_path_buf();
        std::thread::spawn(move || {
            let started = Instant::now();
            let outcome = setup::setup(&root, setup::Needs::Everything);
            (outcome, started.elapsed())
        })
    };
    let built = check(root, env, timings).and_then(|()| {
        // The detach test runs the real binary.
        let mut build = env.cargo(root);
        build.args(["build", "--package", "retry-after-agent", "--bins"]);
        timings.part("build the root suite", || {
            run(build)?;
            suite_binary(root, env)
        })
    });
    let (installed, took) = timings.part("waiting for the tests' packages", || {
        packages
            .join()
            .map_err(|_| anyhow::anyhow!("installing the tests' packages panicked"))
    })?;
    timings.record("  the tests' packages took, from the checks' start", took);
    let suite = built?;
    installed.context("installing what the root suite runs")?;
    // Run as cargo would (from the crate's folder), with libtest's own timing of each test.
    // The kernel matrix runs in virtual machines of its own, beside the lanes.
    let dir = root.join("tests");
    let args = [
        "--test-threads=1",
        "-Z",
        "unstable-options",
        "--report-time",
    ];
    let started = Instant::now();
    let shared = Mutex::new(std::mem::take(timings));
    let outcome = std::thread::scope(|scope| {
        let matrix = scope.spawn(|| {
            // Niced: the matrix's counts are exact however slowly its machines run, where the
            // lanes' load runs (kept returns, the fleet's p99) move with the CPU they get.
            let mut command = Command::new("nice");
            command
                .current_dir(&dir)
                .env("RUSTC_BOOTSTRAP", "1")
                .args(["-n", lanes::BESIDE_NICENESS])
                .arg(&suite)
                .arg(MATRIX)
                .args(args);
            lanes::record(run_tests(command), &shared)
        });
        lanes::run(&suite, &dir, &args, MATRIX, &shared, || {
            matrix
                .join()
                .unwrap_or_else(|_| bail!("the kernel matrix's runner panicked"))
        })
    });
    *timings = shared.into_inner().unwrap_or_else(|p| p.into_inner());
    timings.record("root suite, in all", started.elapsed());
    outcome
}

/// The root suite's module that runs in virtual machines (tests/tests/root_suite/).
const MATRIX: &str = "kernel_matrix::";

/// Build the root suite (the integration tests crate's one test binary); its path.
fn suite_binary(root: &Path, env: &setup::Env) -> Result<PathBuf> {
    let mut build = env.cargo(root);
    build.args([
        "test",
        "--package",
        "retry-after-integration-tests",
        "--no-run",
    ]);
    build.args(["--message-format", "json-render-diagnostics"]);
    // Cargo's progress and the compiler's messages to the terminal, the artifacts read here.
    build.stderr(std::process::Stdio::inherit());
    let messages = capture(&mut build)?;
    let binaries: Vec<PathBuf> = Message::parse_stream(messages.as_bytes())
        .filter_map(|message| match message {
            Ok(Message::CompilerArtifact(artifact)) if artifact.profile.test => {
                artifact.executable.map(PathBuf::from)
            }
            _ => None,
        })
        .collect();
    match <[PathBuf; 1]>::try_from(binaries) {
        Ok([binary]) => Ok(binary),
        Err(binaries) => bail!(
            "the integration tests crate built {} test binaries, not one",
            binaries.len()
        ),
    }
}

/// The workspace root (the parent of this crate's directory).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives inside the workspace")
        .to_path_buf()
}

/// Run a command to completion, failing with its command line if it fails.
fn run(mut command: Command) -> Result<()> {
    let line = command_line(&command);
    eprintln!("+ {line}");
    let status = command
        .status()
        .with_context(|| format!("cannot start `{line}`"))?;
    if !status.success() {
        bail!("`{line}` failed ({status})");
    }
    Ok(())
}

/// Run a command to completion and return its standard output, failing with its command line
/// if it fails.
fn capture(command: &mut Command) -> Result<String> {
    let line = command_line(command);
    eprintln!("+ {line}");
    let out = command
        .output()
        .with_context(|| format!("cannot start `{line}`"))?;
    if !out.status.success() {
        bail!("`{line}` failed ({})", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn command_line(command: &Command) -> String {
    std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(OsStr::to_string_lossy)
        .collect::<Vec<_>>()
        .join(" ")
}
