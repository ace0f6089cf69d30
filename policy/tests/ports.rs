//! The Lua and Python ports of the policy against the shared vectors (`vectors.tsv`, which
//! `vectors.rs` holds to the Rust answers), without root and without installed interpreters:
//! the Lua module runs under Lua 5.3 (HAProxy's language) built from source into this test,
//! the Python client under the machine's `python3` (its standard library only). The root
//! suite runs the same checks under the interpreters the proxies embed (`lua5.3`, `luajit`).

use std::{path::PathBuf, process::Command};

use mlua::Lua;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn the_lua_port_answers_as_the_rust_one_on_every_vector() {
    let script = workspace().join("integrations/lua/check_vectors.lua");
    let vectors = workspace().join("policy/tests/vectors.tsv");
    let lua = Lua::new();
    // The checker reads its own path and the vectors' from `arg`, as a command line gives them.
    let arg = lua.create_table().expect("a table");
    arg.set(0, script.display().to_string()).expect("arg[0]");
    arg.set(1, vectors.display().to_string()).expect("arg[1]");
    lua.globals().set("arg", arg).expect("the global arg");
    // Collect what it prints, and turn its exit on a difference into an error of this test.
    let printed = lua.create_table().expect("a table");
    lua.globals()
        .set("printed", printed.clone())
        .expect("the global printed");
    lua.load(
        "print = function(line) printed[#printed + 1] = line end
         os.exit = function(code) error('check_vectors.lua exits with ' .. tostring(code), 0) end",
    )
    .exec()
    .expect("print and os.exit redirected");
    let source = std::fs::read_to_string(&script).expect("check_vectors.lua");
    lua.load(source)
        .set_name("check_vectors.lua")
        .exec()
        .unwrap_or_else(|error| panic!("the Lua port disagrees: {error}"));
    let line: String = printed.get(1).expect("check_vectors.lua prints its count");
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
