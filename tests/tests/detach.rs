//! The real daemon attaches its programs while it runs and leaves nothing attached or loaded
//! once it has stopped on SIGTERM or SIGINT. Checked with bpftool, as an operator would.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use retry_after_agent::kernel::PROGRAM_NAMES;
use retry_after_testkit::agent_binary;

fn bpftool(args: &[&str]) -> serde_json::Value {
    let out = Command::new("bpftool")
        .args(args)
        .arg("--json")
        .output()
        .expect("bpftool is installed (./dev setup installs it)");
    assert!(
        out.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("bpftool prints JSON")
}

/// Ids of loaded programs with our names.
fn our_programs() -> Vec<u64> {
    bpftool(&["prog", "show"])
        .as_array()
        .unwrap()
        .iter()
        .filter(|prog| PROGRAM_NAMES.contains(&prog["name"].as_str().unwrap_or("")))
        .map(|prog| prog["id"].as_u64().unwrap())
        .collect()
}

/// Links whose program is one of `programs`.
fn links_of(programs: &[u64]) -> Vec<serde_json::Value> {
    bpftool(&["link", "show"])
        .as_array()
        .unwrap()
        .iter()
        .filter(|link| {
            link["prog_id"]
                .as_u64()
                .is_some_and(|id| programs.contains(&id))
        })
        .cloned()
        .collect()
}

fn start_agent() -> Child {
    let config =
        std::env::temp_dir().join(format!("retry-after-detach-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        "[agent]\ntick_interval_ms = 100\nsocket_path = \"/tmp/retry-after-detach.sock\"\nmetrics_listen = \"127.0.0.1:0\"\n[[service]]\nname = \"t\"\nbackends = [{ address = \"127.0.0.1:1\" }]\n",
    )
    .unwrap();
    Command::new(agent_binary())
        .args(["run", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the agent")
}

/// Our loaded programs, once the kernel has had up to 5 s to release them: it frees a program
/// after its last reference goes, and a tracing program only after an RCU grace period.
fn programs_once_released() -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !our_programs().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    our_programs()
}

fn stop_and_check(signal: i32) {
    assert!(
        programs_once_released().is_empty(),
        "programs of an earlier run are still loaded"
    );
    let mut agent = start_agent();
    let deadline = Instant::now() + Duration::from_secs(20);
    let programs = loop {
        let programs = our_programs();
        let links = links_of(&programs);
        if programs.len() == PROGRAM_NAMES.len() && links.len() == PROGRAM_NAMES.len() {
            break programs;
        }
        if let Some(status) = agent.try_wait().unwrap() {
            panic!("the agent exited before attaching: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not attach within 20 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    };

    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(agent.id() as i32, signal) }, 0);
    let status = agent.wait().unwrap();
    assert!(
        status.success(),
        "the agent should exit cleanly on signal {signal}: {status}"
    );

    assert_eq!(
        programs_once_released(),
        Vec::<u64>::new(),
        "programs still loaded 5 s after exit"
    );
    assert_eq!(
        links_of(&programs),
        Vec::<serde_json::Value>::new(),
        "links left after exit"
    );
}

#[test]
fn nothing_stays_attached_after_sigterm() {
    stop_and_check(libc::SIGTERM);
}

#[test]
fn nothing_stays_attached_after_sigint() {
    stop_and_check(libc::SIGINT);
}
