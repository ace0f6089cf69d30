//! The Python and Lua ports of the policy, against the Rust implementation's answers in the
//! shared vectors (`policy/tests/vectors.tsv`, which `cargo test -p retry-after-policy`
//! checks against the Rust answers): the one Lua policy module under both interpreters the
//! proxies embed (`lua5.3`, HAProxy's; `luajit`, nginx's) and the Python client under
//! `python3`; and the Python client against the real agent.

use std::{path::PathBuf, process::Command};

use retry_after_testkit::{AgentProcess, run_ok};

fn integrations() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../integrations")
}

#[test]
fn the_lua_and_python_ports_answer_exactly_as_the_agent_on_shared_vectors() {
    let vectors = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../policy/tests/vectors.tsv");
    for (lua, version) in [("lua5.3", "Lua 5.3"), ("luajit", "LuaJIT")] {
        let text = run_ok(
            Command::new(lua)
                .arg(integrations().join("lua/check_vectors.lua"))
                .arg(&vectors),
        );
        assert!(
            text.contains(&format!("2000 vectors agree ({version}")),
            "{lua}: {text}"
        );
    }
    let text = run_ok(
        Command::new("python3")
            .args([
                "-m",
                "unittest",
                "-v",
                "test_retry_after_client.SharedVectors",
            ])
            .current_dir(integrations().join("python"))
            .env("RETRY_AFTER_SOCKET", "/unused"),
    );
    assert!(text.contains("OK"), "{text}");
}

#[test]
fn the_python_client_against_the_real_agent() {
    let agent = AgentProcess::start(
        "",
        "[[service]]\nname = \"api\"\nbackends = [{ address = \"127.0.0.1:1\" }]\n[service.backpressure]\nretry_after_s = 7\nstatus_code = 503\n",
    );
    let text = run_ok(
        Command::new("python3")
            .args(["-m", "unittest", "-v", "test_retry_after_client.RealAgent"])
            .current_dir(integrations().join("python"))
            .env("RETRY_AFTER_SOCKET", &agent.socket),
    );
    assert!(
        text.contains("Ran 5 tests") && text.contains("OK"),
        "{text}"
    );
}
