//! `retry-after-agent status` as a person runs it: in an 80×24 tmux pane, against an agent
//! under load (wrk overloading HAProxy with the Lua integration in front of two replicas, so
//! the agent sees the queue, the drain, the proxy's reports and the judge's verdicts). The
//! pane must show the service's numbers in their columns, move from one refresh to the next,
//! and say plainly that no agent is running once it is stopped. Off a terminal, one snapshot;
//! with no agent, `--once` fails with one line.

use std::{
    process::Command,
    thread,
    time::{Duration, Instant},
};

use retry_after_testkit::{
    AgentProcess, agent_binary, free_port,
    http::HttpServer,
    proxies::{Haproxy, Wrk},
    run_ok,
};

use crate::{haproxy_lua::frontend, kept_returns::agent_service};

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
            "retry_after_policy = \"scheduled_returns\"\nretry_after_s = 5\n",
        ),
    );
    let _haproxy = Haproxy::start_with_lua(
        &agent.socket,
        &[
            ("RETRY_AFTER_SERVICES", "chat:be_chat"),
            ("RETRY_AFTER_STATIC", "5"),
        ],
        &frontend("chat", front, 8, &replicas.iter().collect::<Vec<_>>()),
    );
    let _load = Wrk::start(front, 1, 64, 40);

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
    let drain: f64 = row[3].parse().unwrap();
    assert!(
        drain > 10.0,
        "two replicas of 2 places at 100 ms drain about 40/s: {row:?}"
    );
    // Fresh arrivals are shown once HAProxy reports its requests ("-" while none report).
    // They are the reported requests less the promised returns falling due, which wrk's
    // clients never make, so the figure may be 0.0 while the due returns exceed the requests.
    let fresh: f64 = row[4]
        .parse()
        .unwrap_or_else(|_| panic!("no fresh arrival rate, so no reports: {row:?}"));
    assert!(fresh >= 0.0, "{row:?}");
    assert!(row[5].ends_with('s') && row[6] == "computed", "{row:?}");
    assert!(loaded.contains("  scheduled_returns; "), "{loaded}");
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
