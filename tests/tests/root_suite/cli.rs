//! The binary's edges: one agent per node, one-line errors with documented exit codes.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use retry_after_testkit::{AgentProcess, agent_binary, free_port};

const SERVICE: &str = "[[service]]\nname = \"api\"\nbackends = [{ address = \"127.0.0.1:1\" }]\n";

/// A scratch directory, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("retry-after-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn config(&self, text: &str) -> std::path::PathBuf {
        let path = self.0.join("config.toml");
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Run the binary with RUST_BACKTRACE=1 (as on many developer machines); exit code and the
/// lines it wrote to standard error.
fn run(args: &[&std::ffi::OsStr]) -> (i32, Vec<String>) {
    let out = Command::new(agent_binary())
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr)
        .lines()
        .map(str::to_owned)
        .collect();
    (out.status.code().unwrap_or(-1), stderr)
}

#[test]
fn a_second_agent_refuses_and_names_the_running_one() {
    let first = AgentProcess::start("", SERVICE);
    let scratch = Scratch::new("second-agent");
    let config = scratch.config(&format!(
        "[agent]\nsocket_path = {:?}\nmetrics_listen = \"{}\"\n{SERVICE}",
        scratch.0.join("agent.sock"),
        free_port()
    ));
    let started = Instant::now();
    let (code, stderr) = run(&["run".as_ref(), "--config".as_ref(), config.as_os_str()]);
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(code, 3, "{stderr:?}");
    assert_eq!(stderr.len(), 1, "one line: {stderr:?}");
    assert!(
        stderr[0].starts_with(
            "retry-after-agent: another retry-after-agent is running on this node (pid="
        ) && stderr[0].contains(&format!("pid={} ", first.pid()))
            && stderr[0].contains(&first.socket.display().to_string()),
        "{stderr:?}"
    );
    // And it left nothing behind: the first still answers, on its own socket.
    assert!(first.request("HEALTH").unwrap().starts_with("HEALTH ok"));
    assert!(!scratch.0.join("agent.sock").exists());
}

#[test]
fn errors_are_one_line_without_a_backtrace_and_exit_codes_say_what_failed() {
    let scratch = Scratch::new("cli-errors");
    // An agent that is not there: 1.
    let missing = scratch.0.join("nobody.sock");
    let (code, stderr) = run(&[
        "query".as_ref(),
        "api".as_ref(),
        "--socket".as_ref(),
        missing.as_os_str(),
    ]);
    assert_eq!(code, 1, "{stderr:?}");
    assert_eq!(stderr.len(), 1, "one line, no backtrace: {stderr:?}");
    assert!(
        stderr[0].starts_with("retry-after-agent: query to ") && stderr[0].contains("No such file"),
        "{stderr:?}"
    );
    // A bad configuration: 2, naming the field.
    let config = scratch.config("[agent]\ntick_interval_ms = 1\n");
    let (code, stderr) = run(&["run".as_ref(), "--config".as_ref(), config.as_os_str()]);
    assert_eq!(code, 2, "{stderr:?}");
    assert_eq!(stderr.len(), 1, "{stderr:?}");
    assert!(stderr[0].contains("agent.tick_interval_ms"), "{stderr:?}");
    // A bad command line: 2 (clap's own usage error).
    let (code, _) = run(&["frobnicate".as_ref()]);
    assert_eq!(code, 2);
}
