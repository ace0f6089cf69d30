//! `retry-after-agent status` as a person runs it: in an 80×24 tmux pane, against an agent
//! under load (wrk overloading HAProxy with the Lua integration keeping returns in front of two
//! replicas, so the agent sees the queue, the drain, the proxy's reports and the judge's
//! verdicts). The pane must show the service's numbers in their columns, the fresh arrivals
//! as wrk sends them (wrk never comes back when told: its requests are all fresh), move from
//! one refresh to the next, and say plainly that no agent is running once it is stopped. Off a
//! terminal, one snapshot; with no agent, `--once` fails with one line.

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

use crate::kept_returns::{agent_service, haproxy_frontend};

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
    let _haproxy = Haproxy::start_with_lua(
        &agent.socket,
        &[
            ("RETRY_AFTER_SERVICES", "chat:be_chat"),
            ("RETRY_AFTER_STATIC", "5"),
            ("RETRY_AFTER_KEEP", "chat=header:x-api-key"),
            ("RETRY_AFTER_SECRET_FILE", secret.path().to_str().unwrap()),
        ],
        &haproxy_frontend("chat", front, &replicas),
    );
    let load = Wrk::start(front, 1, 64, 25);

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
    // wrk's own rate, within 10%, over five refreshes while it runs. Taking the returns
    // told to come back instead read 0.0 here: every rejection was counted as a return due.
    let mut fresh = Vec::new();
    let mut pane = later;
    while fresh.len() < 5 {
        let seen = ticks(&pane);
        pane = pane_until(Duration::from_secs(10), |p| ticks(p) > seen);
        let row = columns(&pane, "chat");
        fresh.push(
            row[4]
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("no fresh arrival rate, so no reports: {row:?}")),
        );
    }
    let wrk = load.finish();
    let sent = wrk.requests as f64 / wrk.seconds;
    let shown = fresh.iter().sum::<f64>() / fresh.len() as f64;
    eprintln!("fresh arrivals shown {fresh:?} (mean {shown:.1}/s); wrk sent {sent:.1}/s");
    assert!(
        (shown - sent).abs() <= 0.1 * sent,
        "the status view shows {shown:.1} fresh arrivals a second ({fresh:?}), wrk sent {sent:.1}"
    );

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
