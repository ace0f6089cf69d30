//! The Lua and Python ports of the policy against the shared vectors (`vectors.tsv`, which
//! `vectors.rs` holds to the Rust answers), without root and without installed interpreters:
//! the Lua module runs under Lua 5.3 (HAProxy's language) built from source into this test,
//! the Python client under the machine's `python3` (its standard library only). The root
//! suite runs the same checks under the interpreters the proxies embed (`lua5.3`, `luajit`).

use std::process::Command;

#[path = "common/lua_checker.rs"]
mod lua_checker;

use lua_checker::workspace;

#[test]
fn the_lua_port_answers_as_the_rust_one_on_every_vector() {
    let line = lua_checker::first_line("check_vectors.lua", "vectors.tsv", |_| {});
    assert_eq!(line, "2000 vectors agree (Lua 5.3)");
}

#[test]
fn the_python_port_answers_as_the_rust_one_on_every_vector() {
    let out = Command::new("python3")
        .args([
            "-m",
            "unittest",
            "-v",
            "test_retry_after_client.SharedVectors",
        ])
        .current_dir(workspace().join("integrations/python"))
        .env("RETRY_AFTER_SOCKET", "/unused")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 runs (the machine's own: nothing beyond its standard library is used)");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("\nOK"), "{text}");
}
