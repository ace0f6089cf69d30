//! The Lua port of the policy under LuaJIT (the interpreter nginx's Lua module links, installed
//! by `./dev setup`) against the Rust implementation's answers in the shared vectors
//! (`policy/tests/vectors.tsv`; `./dev check` runs the Lua 5.3 and Python ports against the same
//! file in `policy/tests/ports.rs`); and the Python client against the real agent.

use std::{path::PathBuf, process::Command};

use retry_after_testkit::{AgentProcess, run_ok};

fn integrations() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../integrations")
}

#[test]
fn the_lua_port_answers_exactly_as_the_agent_on_shared_vectors_under_luajit() {
    let vectors = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../policy/tests/vectors.tsv");
    let text = run_ok(
        Command::new("luajit")
            .arg(integrations().join("lua/check_vectors.lua"))
            .arg(&vectors),
    );
    assert!(text.contains("2000 vectors agree (LuaJIT"), "{text}");
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
