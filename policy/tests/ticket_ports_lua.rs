//! The Lua port of kept returns (`integrations/lua/retry_after_tickets.lua`) against the shared
//! ticket vectors (`ticket_vectors.tsv`, which `ticket_vectors.rs` holds to the Rust answers),
//! under Lua 5.3 (HAProxy's) built from source into this test. HAProxy gives the port HMAC-SHA1
//! natively; here the `hmac` and `sha1` crates do, as the global `hmac_sha1` the checker looks
//! for, so every line is checked. The root suite runs the same checker under LuaJIT.

use std::path::PathBuf;

use hmac::{Hmac, Mac};
use mlua::Lua;
use sha1::Sha1;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `hmac_sha1(secret, message)`: the 20 raw bytes, as HAProxy's `hmac` converter gives them.
fn install_hmac(lua: &Lua) {
    let hmac = lua
        .create_function(|lua, (secret, message): (mlua::String, mlua::String)| {
            let mut mac = Hmac::<Sha1>::new_from_slice(&secret.as_bytes())
                .map_err(|e| mlua::Error::external(e.to_string()))?;
            mac.update(&message.as_bytes());
            lua.create_string(mac.finalize().into_bytes())
        })
        .expect("a function");
    lua.globals()
        .set("hmac_sha1", hmac)
        .expect("the global hmac_sha1");
}

#[test]
fn the_lua_ticket_book_answers_as_the_rust_one_on_every_vector() {
    let script = workspace().join("integrations/lua/check_tickets.lua");
    let vectors = workspace().join("policy/tests/ticket_vectors.tsv");
    let lua = Lua::new();
    // The checker reads its own path and the vectors' from `arg`, as a command line gives them.
    let arg = lua.create_table().expect("a table");
    arg.set(0, script.display().to_string()).expect("arg[0]");
    arg.set(1, vectors.display().to_string()).expect("arg[1]");
    lua.globals().set("arg", arg).expect("the global arg");
    install_hmac(&lua);
    // Collect what it prints, and turn its exit on a difference into an error of this test.
    let printed = lua.create_table().expect("a table");
    lua.globals()
        .set("printed", printed.clone())
        .expect("the global printed");
    lua.load(
        "print = function(line) printed[#printed + 1] = line end
         os.exit = function(code) error('check_tickets.lua exits with ' .. tostring(code), 0) end",
    )
    .exec()
    .expect("print and os.exit redirected");
    let source = std::fs::read_to_string(&script).expect("check_tickets.lua");
    lua.load(source)
        .set_name("check_tickets.lua")
        .exec()
        .unwrap_or_else(|error| panic!("the Lua ticket book disagrees: {error}"));
    let line: String = printed.get(1).expect("check_tickets.lua prints its count");
    eprintln!("{line}");
    assert_eq!(line, "5144 ticket vectors agree (Lua 5.3)");
}
