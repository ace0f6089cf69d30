//! `retry-after-agent status` as a person runs it: in an 80×24 tmux pane, against an agent
//! under load (wrk overloading HAProxy with the Lua integration keeping returns in front of two
//! replicas, so the agent sees the queue, the drain, the proxy's reports and the judge's
//! verdicts). The pane must show the service's numbers in their columns, the fresh arrivals
//! as wrk sends them (wrk never comes back when told: its requests are all fresh), move from
//! one refresh to the next, and say plainly that no agent is running once it is stopped. Off a
//! terminal, one snapshot; with no agent, `--once` fails with one line.

use std::{
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use retry_after_testkit::{
    AgentProcess, agent_binary, free_port,
    http::HttpServer,
    proxies::{Haproxy, HaproxyStats, Wrk},
    run_ok,
};

use retry_after_testkit::kept_returns::{agent_service, haproxy_frontend};

/// The tmux session of this test.
const SESSION: &str = "retry-after-status-view";

/// Ends the tmux session however the test ends.
struct Session;

impl Drop for Session {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", SESSION])
            .status();
    }
}

/// HAProxy's frontend `req_tot`, read every 250 ms on a thread of its own until finished.
struct Counter {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<Counted>>,
}

/// The readings: when, and the count then.
struct Counted(Vec<(Instant, u64)>);

impl Counter {
    fn start(stats: HaproxyStats) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = thread::spawn(move || {
            let mut readings = Vec::new();
            while !stopped.load(Ordering::Relaxed) {
                readings.push((Instant::now(), stats.stat("fe_chat", "FRONTEND", "req_tot")));
                thread::sleep(Duration::from_millis(250));
            }
            Counted(readings)
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> Counted {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .unwrap()
            .join()
            .expect("the counter thread")
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Counted {
    /// The lowest and highest rate over one second (from each reading to the first a second
    /// or more later) within `from..to`.
    fn envelope(&self, from: Instant, to: Instant) -> (f64, f64) {
        let rates: Vec<f64> = self
            .0
            .iter()
            .filter(|(at, _)| *at >= from)
            .filter_map(|&(at, count)| {
                let &(later, then) = self
                    .0
                    .iter()
                    .find(|(l, _)| l.duration_since(at) >= Duration::from_secs(1))?;
                (later <= to)
                    .then(|| (then - count) as f64 / later.duration_since(at).as_secs_f64())
            })
            .collect();
        assert!(!rates.is_empty(), "no HAProxy readings in the window");
        let low = rates.iter().copied().fold(f64::INFINITY, f64::min);
        let high = rates.iter().copied().fold(0.0, f64::max);
        (low, high)
    }
}

/// What the pane shows now.
fn capture() -> String {
    run_ok(Command::new("tmux").args(["capture-pane", "-p", "-t", SESSION]))
}

/// Capture until `seen` holds for the pane, or panic after `within`.
fn pane_until(within: Duration, seen: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + within;
    loop {
        let pane = capture();
        if seen(&pane) {
            return pane;
        }
        assert!(
            Instant::now() < deadline,
            "the pane never showed it:\n{pane}"
        );
        thread::sleep(Duration::from_millis(200));
    }
}

/// The pane's row for `service`, split into its columns.
fn columns<'a>(pane: &'a str, service: &str) -> Vec<&'a str> {
    pane.lines()
        .find(|l| l.starts_with(&format!("{service} ")))
        .unwrap_or_else(|| panic!("no row for {service}:\n{pane}"))
        .split_whitespace()
        .collect()
}

#[test]
fn the_status_view_shows_a_loaded_agent_live_in_80_columns_and_says_when_it_stops() {
    let replicas = [
        HttpServer::replica(Duration::from_millis(100)),
        HttpServer::replica(Duration::from_millis(100)),
    ];
    // HAProxy's listener is the service's frontend: the agent sees the queue HAProxy holds.
    let front = free_port();
    let mut agent = AgentProcess::start(
        "",
        &agent_service(
            "chat",
            &replicas,
            Some(front),
            "retry_after_policy = \"kept_returns\"\nretry_after_s = 5\n",
        ),
    );
    // Places by a header wrk never sends: the book tells HAProxy that none of its requests is
    // a return, and its reports say so.
    let secret = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(secret.path(), "the proxies' secret\n").unwrap();
    std::fs::set_permissions(
        secret.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .unwrap();
    let haproxy = Haproxy::start_with_lua(
        &agent.socket,
        &[
            ("RETRY_AFTER_SERVICES", "chat:be_chat"),
            ("RETRY_AFTER_STATIC", "5"),
            ("RETRY_AFTER_KEEP", "chat=header:x-api-key"),
            ("RETRY_AFTER_SECRET_FILE", secret.path().to_str().unwrap()),
        ],
        &haproxy_frontend("chat", front, &replicas),
    );
    let counter = Counter::start(haproxy.stats());
    let load = Wrk::start(front, 1, 64, 30);

    let _session = Session;
    let _ = Command::new("tmux")
        .args(["kill-session", "-t", SESSION])
        .status();
    run_ok(Command::new("tmux").args([
        "new-session",
        "-d",
        "-s",
        SESSION,
        "-x",
        "80",
        "-y",
        "24",
        &format!(
            "{} status --socket {}",
            agent_binary().display(),
            agent.socket.display()
        ),
    ]));
    // Under load: the drain warm, the answer computed, the judge's verdicts in.
    let loaded = pane_until(Duration::from_secs(30), |pane| {
        pane.lines().any(|l| {
            l.starts_with("chat ") && l.contains("computed") && l.trim_end().ends_with('%')
        })
    });
    eprintln!("the status view under load (80x24 tmux pane):\n{loaded}");
    assert!(loaded.contains(
        "SERVICE       DEPTH SOURCE   DRAIN/S FRESH/S ANSWER RUNG     PROMISED ADMITTED"
    ));
    let row = columns(&loaded, "chat");
    // chat, depth, source, drain/s, fresh/s, answer, rung, promised, admitted.
    assert_eq!(row.len(), 9, "{row:?}");
    assert_eq!(row[2], "frontend", "{row:?}");
    // The drain shown is the one the replicas count themselves (two of 2 places at 100 ms:
    // about 40/s), read over the two seconds after the pane.
    let drain: f64 = row[3].parse().unwrap();
    let answered = || -> usize {
        replicas
            .iter()
            .map(|r| r.answered.load(std::sync::atomic::Ordering::SeqCst))
            .sum()
    };
    let (before, since) = (answered(), std::time::Instant::now());
    std::thread::sleep(Duration::from_secs(2));
    let replicas_drain = (answered() - before) as f64 / since.elapsed().as_secs_f64();
    assert!(
        (drain - replicas_drain).abs() <= 0.25 * replicas_drain,
        "the replicas drained {replicas_drain:.1}/s: {row:?}"
    );
    assert!(row[5].ends_with('s') && row[6] == "computed", "{row:?}");
    assert!(loaded.contains("  kept_returns; "), "{loaded}");
    // The next refresh moves: the agent's tick count goes on.
    let ticks = |pane: &str| -> u64 {
        let line = pane.lines().nth(1).unwrap();
        line.split("ticks ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let before = ticks(&loaded);
    let later = pane_until(Duration::from_secs(10), |pane| ticks(pane) > before);
    assert!(ticks(&later) > before);

    // Fresh arrivals ("-" while no proxy reports): HAProxy's requests less the returns among
    // them, which its book tells (none: wrk never comes back when told, and sends no key), so
    // HAProxy's own request rate. wrk's rate moves with the machine's other work, and the view
    // shows an average that follows a change within a few seconds (the proxies' reports are
    // read a report interval late, then averaged with a 2 s time constant): each refresh must
    // lie within what HAProxy's frontend `req_tot` counted a second at a time over the 8 s
    // before it, give or take 10%. (The returns told to come back, or each tick's reports
    // alone, are not the fresh arrivals: docs/evaluation.md's history says what they read.)
    let mut shown = Vec::new();
    let mut pane = later;
    while shown.len() < 8 {
        let seen = ticks(&pane);
        pane = pane_until(Duration::from_secs(10), |p| ticks(p) > seen);
        let row = columns(&pane, "chat");
        let rate = row[4]
            .parse::<f64>()
            .unwrap_or_else(|_| panic!("no fresh arrival rate, so no reports: {row:?}"));
        shown.push((Instant::now(), rate));
    }
    let wrk = load.finish();
    let counted = counter.finish();
    for &(at, rate) in &shown {
        let (low, high) = counted.envelope(at - Duration::from_secs(8), at);
        eprintln!(
            "fresh arrivals shown {rate:.0}/s; HAProxy counted {low:.0} to {high:.0}/s over the \
             8 s before (wrk: {:.0}/s over its run)",
            wrk.requests as f64 / wrk.seconds
        );
        assert!(
            rate >= 0.9 * low && rate <= 1.1 * high,
            "the status view shows {rate:.1} fresh arrivals a second; HAProxy counted {low:.1} \
             to {high:.1} a second over the 8 s before"
        );
    }

    // Not on a terminal: one snapshot, the same view.
    let snapshot = run_ok(
        Command::new(agent_binary())
            .arg("status")
            .args(["--socket", agent.socket.to_str().unwrap()]),
    );
    assert!(
        snapshot.lines().any(|l| l.starts_with("chat ")),
        "{snapshot}"
    );
    assert!(
        snapshot.lines().all(|l| l.chars().count() <= 80),
        "{snapshot}"
    );

    // The agent stops: the pane says so, and --once fails with one line.
    agent.kill();
    let stopped = pane_until(Duration::from_secs(10), |pane| {
        pane.contains("no agent is running on")
    });
    eprintln!("with the agent stopped:\n{stopped}");
    let once = Command::new(agent_binary())
        .args([
            "status",
            "--once",
            "--socket",
            agent.socket.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let error = String::from_utf8_lossy(&once.stderr);
    assert_eq!(once.status.code(), Some(1), "{error}");
    assert!(
        error.starts_with("retry-after-agent: no agent is running on "),
        "{error}"
    );
    assert_eq!(error.lines().count(), 1, "{error}");
}
