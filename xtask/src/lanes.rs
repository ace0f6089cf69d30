//! The root suite in lanes: its modules run two at a time, each lane in a network namespace of
//! its own, so that two agents, two nginx and two HAProxy run at once without meeting.
//!
//! What keeps two lanes apart:
//! - The agent's one-per-node lock is an abstract Unix socket, which belongs to a network
//!   namespace: each lane's agents see only that lane's lock.
//! - Every lane has its own loopback, so ports never clash as binds.
//! - The programs see every socket of the node whatever its namespace, and an agent counts the
//!   endpoints it watches (address and port). So each lane has its own block of ports: its
//!   ephemeral range (`net.ipv4.ip_local_port_range`, one per namespace) and, below it, the
//!   ports the tests' servers take (`free_port` takes them below the ephemeral range). No
//!   lane's traffic uses a port another lane may watch. The blocks stay clear of Ray's fixed
//!   ports (its workers' 10002–19999, its dashboard agent's 52365), which are never watched.
//!
//! The tests whose figures move with the machine's load and that miss their targets by more
//! when another lane loads it run after the lanes, alone. The kernel matrix runs beside the
//! lanes, in virtual machines with no network, and the tests run alone wait for it too: its
//! machines load both cores as much as a lane does.
//! The tests whose software takes long to start (vLLM's engine) start with the lanes, niced, in
//! a namespace of their own, and wait for the quiet lock before their load: it is released
//! once the tests run alone have ended.

use std::{
    collections::VecDeque,
    fs::File,
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{
    capture,
    timings::{TestRun, Timings, run_tests},
};

/// A lane: its name in the timings and the ephemeral range of its network namespace (the
/// tests' servers take the 10,000 ports below it).
struct Lane {
    name: &'static str,
    ephemeral_ports: &'static str,
}

/// The lanes: two, as the machines the suite runs on have two cores.
const LANES: [Lane; 2] = [
    Lane {
        name: "lane 1",
        ephemeral_ports: "30000 39999",
    },
    Lane {
        name: "lane 2",
        ephemeral_ports: "50000 59999",
    },
];

/// Tests (a module's path, or a test's) run alone after the lanes: Ray Serve's ingress keeping
/// places, where Serve's Python processes answer late on a loaded machine and its queue refuses
/// returns the ingress let through (two fresh-clone runs beside another lane: 91.2% and 83.3%
/// admitted, p99 3.0 and 6.6 times the bound's; in the suite run one test at a time, 95.2% and
/// 95.4%, 2.2 and 3.1 times: docs/integrations/ray-serve.md).
///
/// Serve's rejections run alone too: its urllib3 clients, told by `scheduled_returns`, got in
/// at 87–91% of their retries in runs of their own, and at 60% (261 of 435) and 59% (279 of
/// 472) in fresh-clone runs beside other lanes, one of them after the heaviest load had passed
/// (docs/integrations/ray-serve.md). Both are one test, with one Serve.
const ALONE: [&str; 1] = ["ray_serve::serve_rejections"];

/// Tests started beside the lanes, niced ([`BESIDE_NICENESS`]), whose software takes long to
/// start and whose load needs the machine to itself: each starts its software, then waits for
/// the quiet lock (`testkit::quiet`), which is released once the lanes, the kernel matrix and
/// the [`ALONE`] tests have ended. vLLM's engine takes about 50 s to start; its agreement with
/// the agent is read against the engine's own gauges, and an engine starved of CPU by another
/// lane and the kernel matrix's machines hands requests from its HTTP server to its scheduler
/// late, which the agent counts as waiting and vLLM does not (docs/integrations/vllm.md).
const STARTED_EARLY: [&str; 1] = ["vllm_engine"];

/// The network namespace of the tests started early: its servers take 50000–59999, ports no
/// lane's servers take (the lanes' own ephemeral ports are clients', not watched), and its
/// load runs once the lanes have ended.
const EARLY_LANE: Lane = Lane {
    name: "started beside the lanes",
    ephemeral_ports: "60000 64999",
};

/// The niceness of what runs beside the lanes (the kernel matrix's machines, the tests started
/// early): about a tenth of a core's share when a lane wants both cores, all the CPU the lanes
/// leave when they wait (their load runs mostly wait out retries). A fresh-clone run beside
/// matrix machines at the same priority saw HAProxy's polling loop lag into early returns (17
/// of 388, guard 3%) and a p99 over its guard (2.03 times the bound's, guard 2).
pub const BESIDE_NICENESS: &str = "10";

/// The variable naming the quiet lock to the tests started early (`testkit::quiet`).
const QUIET_LOCK_ENV: &str = "RETRY_AFTER_QUIET_LOCK";

/// Modules handed out first, longest first (their time in the last fresh-clone runs). The
/// others follow in name order. Only the order depends on it: a module missing here still
/// runs.
const LONG_FIRST: [&str; 12] = [
    "one_agent",
    "http2",
    "streamed_responses",
    "behind_nginx",
    "agent_service",
    "kept_flood",
    "evaluation",
    "nginx_lua",
    "haproxy_lua",
    "nginx_book",
    "abuse",
    "behind_haproxy",
];

/// The shell run inside a lane's new network namespace before the suite: loopback up, the
/// lane's ephemeral ports, then the command given after it.
const ENTER_LANE: &str = "ip link set lo up && \
     printf '%s\\n' \"$1\" > /proc/sys/net/ipv4/ip_local_port_range && \
     shift && exec \"$@\"";

/// The root suite's tests of one module: the module and its tests' full names.
type Module = (String, Vec<String>);

/// The root suite's binary and how each run of it is given its tests.
#[derive(Clone, Copy)]
struct Suite<'a> {
    binary: &'a Path,
    dir: &'a Path,
    args: &'a [&'a str],
}

impl Suite<'_> {
    /// The tests `tests` (exact names) in a new network namespace with `lane`'s ports.
    fn command(self, lane: &Lane, tests: &[String]) -> Command {
        let mut command = Command::new("unshare");
        self.enter(&mut command, lane, tests);
        command
    }

    /// `command` (unshare, or a wrapper that runs it) given the rest of the line.
    fn enter(self, command: &mut Command, lane: &Lane, tests: &[String]) {
        command
            .current_dir(self.dir)
            .env("RUSTC_BOOTSTRAP", "1")
            .args(["--net", "--", "sh", "-c", ENTER_LANE, "sh"])
            .arg(lane.ephemeral_ports)
            .arg(self.binary)
            .args(self.args)
            .arg("--exact")
            .args(tests);
    }
}

/// Run every test of the root suite binary `suite` except the modules `skip`s: the
/// [`STARTED_EARLY`] tests at once, niced, and the modules in [`LANES`]; then, once `beside`
/// (what ran beside the lanes) has ended too, the [`ALONE`] tests; then the quiet lock is
/// released. Each module is one process of `suite` given `args` and the module's test names
/// (exact). Records each lane's time and each module's in `timings`. Fails if any test fails,
/// or `beside` does, after running them all.
pub fn run(
    suite: &Path,
    dir: &Path,
    args: &[&str],
    skip: &str,
    timings: &Mutex<Timings>,
    beside: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let (early, modules) = split(modules(suite, dir, skip)?, &STARTED_EARLY);
    let (alone, shared) = split(modules, &ALONE);
    let suite = Suite {
        binary: suite,
        dir,
        args,
    };
    let quiet = QuietLock::hold()?;
    std::thread::scope(|scope| {
        let (tests, lock) = (&early, quiet.path().to_path_buf());
        let early = scope.spawn(move || run_early(suite, tests, &lock, timings));
        let mut outcome = run_lanes(suite, order(shared), timings);
        let started = Instant::now();
        outcome = outcome.and(beside());
        add(
            timings,
            "  waiting for the kernel matrix",
            started.elapsed(),
        );
        let started = Instant::now();
        if !alone.is_empty() {
            outcome = outcome.and(record(run_tests(suite.command(&LANES[0], &alone)), timings));
        }
        add(
            timings,
            "  alone, after the lanes and the matrix",
            started.elapsed(),
        );
        let released = Instant::now();
        drop(quiet);
        let early = early
            .join()
            .unwrap_or_else(|_| bail!("the tests started early panicked"));
        add(
            timings,
            "  started early, after the quiet",
            released.elapsed(),
        );
        outcome.and(early)
    })
}

/// The modules of `queue` in [`LANES`], each lane taking the next module when it is done.
fn run_lanes(suite: Suite, queue: VecDeque<Module>, timings: &Mutex<Timings>) -> Result<()> {
    let queue = Mutex::new(queue);
    let outcomes: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = LANES
            .iter()
            .map(|lane| {
                let queue = &queue;
                scope.spawn(move || {
                    let started = Instant::now();
                    let mut outcome = Ok(());
                    while let Some((_, tests)) = next(queue) {
                        let run = run_tests(suite.command(lane, &tests));
                        outcome = outcome.and(record(run, timings));
                    }
                    add(timings, &format!("  {}", lane.name), started.elapsed());
                    outcome
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|_| bail!("a lane of the root suite panicked"))
            })
            .collect()
    });
    outcomes.into_iter().collect::<Result<Vec<()>>>().map(drop)
}

/// The [`STARTED_EARLY`] tests `tests`, niced, in [`EARLY_LANE`], told the quiet lock `lock`.
fn run_early(suite: Suite, tests: &[String], lock: &Path, timings: &Mutex<Timings>) -> Result<()> {
    if tests.is_empty() {
        return Ok(());
    }
    let mut command = Command::new("nice");
    command
        .env(QUIET_LOCK_ENV, lock)
        .args(["-n", BESIDE_NICENESS, "unshare"]);
    suite.enter(&mut command, &EARLY_LANE, tests);
    record(run_tests(command), timings)
}

/// The lock the tests started early wait for: held from before they start until it is
/// dropped; its file is removed then.
struct QuietLock {
    file: File,
    path: PathBuf,
}

impl QuietLock {
    /// Create the lock's file and hold it.
    fn hold() -> Result<Self> {
        let path =
            std::env::temp_dir().join(format!("retry-after-quiet-{}.lock", std::process::id()));
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        file.lock()
            .with_context(|| format!("locking {}", path.display()))?;
        Ok(Self { file, path })
    }

    /// Its file.
    fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for QuietLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = self.file.unlock();
    }
}

/// The modules of the root suite binary `suite` and their tests, from libtest's own list,
/// leaving out the tests whose names begin with `skip`.
fn modules(suite: &Path, dir: &Path, skip: &str) -> Result<Vec<Module>> {
    let mut list = Command::new(suite);
    list.current_dir(dir).args(["--list", "--format", "terse"]);
    let listed = capture(&mut list)?;
    let mut modules: Vec<Module> = Vec::new();
    for line in listed.lines() {
        let Some(name) = line.strip_suffix(": test") else {
            continue;
        };
        if name.starts_with(skip) {
            continue;
        }
        let module = name
            .split_once("::")
            .with_context(|| format!("root suite test `{name}` is in no module"))?
            .0;
        match modules.iter_mut().find(|(known, _)| known == module) {
            Some((_, tests)) => tests.push(name.to_owned()),
            None => modules.push((module.to_owned(), vec![name.to_owned()])),
        }
    }
    if modules.is_empty() {
        bail!("the root suite listed no tests");
    }
    Ok(modules)
}

/// The tests of `modules` that `prefixes` name (a module's path, or a test's), and the modules
/// with the rest.
fn split(modules: Vec<Module>, prefixes: &[&str]) -> (Vec<String>, Vec<Module>) {
    let mut alone = Vec::new();
    let mut shared = Vec::new();
    for (module, tests) in modules {
        let (apart, rest): (Vec<String>, Vec<String>) = tests
            .into_iter()
            .partition(|test| prefixes.iter().any(|prefix| test.starts_with(prefix)));
        alone.extend(apart);
        if !rest.is_empty() {
            shared.push((module, rest));
        }
    }
    (alone, shared)
}

/// `modules` in the order they are handed out: [`LONG_FIRST`]'s, then the rest by name.
fn order(mut modules: Vec<Module>) -> VecDeque<Module> {
    modules.sort_by_key(|(module, _)| {
        let rank = LONG_FIRST.iter().position(|long| long == module);
        (rank.unwrap_or(LONG_FIRST.len()), module.clone())
    });
    modules.into()
}

/// The next module off the queue.
fn next(queue: &Mutex<VecDeque<Module>>) -> Option<Module> {
    queue
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .pop_front()
}

/// Add a run's module times to `timings`; its outcome.
pub(crate) fn record((outcome, modules): TestRun, timings: &Mutex<Timings>) -> Result<()> {
    for (module, elapsed) in modules {
        add(timings, &format!("  {module}"), elapsed);
    }
    outcome
}

/// Add `elapsed` to the part `name` of the shared `timings`.
fn add(timings: &Mutex<Timings>, name: &str, elapsed: Duration) {
    timings
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .record(name, elapsed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tests_named_apart_leave_the_rest_of_their_module_in_the_lanes() {
        let (alone, shared) = split(
            vec![
                (
                    "vllm_engine".to_owned(),
                    vec!["vllm_engine::the_agent_sees".to_owned()],
                ),
                (
                    "ray_serve".to_owned(),
                    vec![
                        "ray_serve::serve_rejections".to_owned(),
                        "ray_serve::the_ingress_keeps_the_places_it_gives".to_owned(),
                        "ray_serve::another".to_owned(),
                    ],
                ),
                ("turns".to_owned(), vec!["turns::ipv6".to_owned()]),
            ],
            &[
                "vllm_engine",
                "ray_serve::serve_rejections",
                "ray_serve::the_ingress_keeps",
            ],
        );
        assert_eq!(
            alone,
            [
                "vllm_engine::the_agent_sees",
                "ray_serve::serve_rejections",
                "ray_serve::the_ingress_keeps_the_places_it_gives"
            ]
        );
        assert_eq!(
            shared,
            [
                (
                    "ray_serve".to_owned(),
                    vec!["ray_serve::another".to_owned()]
                ),
                ("turns".to_owned(), vec!["turns::ipv6".to_owned()]),
            ]
        );
    }

    #[test]
    fn long_modules_are_handed_out_first_and_the_rest_by_name() {
        let module = |name: &str| (name.to_owned(), vec![format!("{name}::a")]);
        let first: Vec<String> = order(vec![
            module("turns"),
            module("cli"),
            module("one_agent"),
            module("kept_flood"),
        ])
        .into_iter()
        .map(|(name, _)| name)
        .collect();
        assert_eq!(first, ["one_agent", "kept_flood", "cli", "turns"]);
        let later: Vec<String> = order(["kept_flood", "evaluation", "http2"].map(module).into())
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        assert_eq!(later, ["http2", "kept_flood", "evaluation"]);
    }
}
