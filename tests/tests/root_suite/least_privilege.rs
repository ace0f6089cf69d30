//! Least privilege, verified: the agent run as `nobody` with CAP_BPF, CAP_NET_ADMIN and
//! CAP_PERFMON alone attaches and counts exactly, and once attached holds no capability.

use std::{thread, time::Duration};

use retry_after_agent::privileges::REQUIRED;
use retry_after_testkit::{
    AgentProcess, Launch,
    http::{HttpClient, HttpServer, ServerOptions},
};

const NOBODY: u32 = 65534;

/// `setpriv` giving exactly `caps` to a process of uid and gid `NOBODY`.
fn as_nobody_with(caps: &[&str]) -> Vec<String> {
    let list: Vec<String> = caps
        .iter()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    let list = list.join(",");
    vec![
        "setpriv".into(),
        format!("--reuid={NOBODY}"),
        format!("--regid={NOBODY}"),
        "--clear-groups".into(),
        format!("--inh-caps=-all,{list}"),
        format!("--ambient-caps=-all,{list}"),
        format!("--bounding-set=-all,{list}"),
    ]
}

/// A line of /proc/<pid>/status.
fn status(pid: u32, key: &str) -> String {
    status_line(&format!("/proc/{pid}/status"), key)
}

/// A line of the status file at `path`.
fn status_line(path: &str, key: &str) -> String {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_owned()))
        .unwrap_or_else(|| panic!("no {key} in {path}"))
}

/// Capabilities belong to threads: every thread of `pid` (its runtime's workers, which parse
/// what other processes send, among them) holds none and may gain none.
fn assert_no_thread_holds_a_capability(pid: u32) {
    let tasks: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .map(|task| task.unwrap().path().join("status"))
        .collect();
    assert!(tasks.len() > 1, "the runtime's threads: {tasks:?}");
    for task in tasks {
        let task = task.to_str().unwrap();
        for key in ["CapEff:", "CapPrm:"] {
            assert_eq!(status_line(task, key), "0000000000000000", "{task} {key}");
        }
        assert_eq!(status_line(task, "NoNewPrivs:"), "1", "{task}");
    }
}

#[test]
fn the_agent_as_nobody_with_three_capabilities_counts_exactly_then_holds_none() {
    let backend = HttpServer::start("127.0.0.1:0", ServerOptions::default());
    let addr = backend.addr();
    let agent = AgentProcess::start_with(
        "",
        &format!("[[service]]\nname = \"api\"\nbackends = [{{ address = \"{addr}\" }}]\n"),
        Launch {
            prefix: as_nobody_with(&REQUIRED),
            owner: Some(NOBODY),
            ..Launch::default()
        },
    );
    let pid = agent.pid();
    assert_eq!(status(pid, "Uid:").split_whitespace().next(), Some("65534"));
    assert_eq!(
        status(pid, "CapEff:"),
        "0000000000000000",
        "after attach: none"
    );
    assert_eq!(status(pid, "CapPrm:"), "0000000000000000");
    assert_eq!(status(pid, "NoNewPrivs:"), "1");
    assert_no_thread_holds_a_capability(pid);

    let mut client = HttpClient::connect(addr);
    for _ in 0..200 {
        client.exchange(16);
    }
    drop(client);
    let series = |side: &str| {
        format!(
            "retry_after_endpoint_requests_started_total{{endpoint=\"{addr}\",side=\"{side}\"}}"
        )
    };
    let mut last = String::new();
    for _ in 0..50 {
        last = agent.metrics();
        let count = |side| retry_after_testkit::sample(&last, &series(side));
        if count("server") == Some(200.0) && count("client") == Some(200.0) {
            return;
        }
        thread::sleep(Duration::from_millis(100));
    }
    panic!(
        "not exactly 200 on both sides: {}",
        last.lines()
            .filter(|l| l.contains("requests_started"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn without_cap_perfmon_the_agent_refuses_to_start_and_says_why() {
    let out = std::process::Command::new("setpriv")
        .args(&as_nobody_with(&["CAP_BPF", "CAP_NET_ADMIN"])[1..])
        .arg(retry_after_testkit::agent_binary())
        .args(["check"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("MISSING eBPF programs") && text.contains("refused"),
        "{text}"
    );
}
