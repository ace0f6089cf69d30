//! The Lua port of kept returns (`integrations/lua/retry_after_tickets.lua`) against the shared
//! ticket vectors (`ticket_vectors.tsv`, which `ticket_vectors.rs` holds to the Rust answers),
//! under Lua 5.3 (HAProxy's) built from source into this test. HAProxy gives the port HMAC-SHA1
//! natively; here the `hmac` and `sha1` crates do, as the global `hmac_sha1` the checker looks
//! for, so every line is checked. The root suite runs the same checker under LuaJIT.

use hmac::{Hmac, Mac};
use mlua::Lua;
use sha1::Sha1;

#[path = "common/lua_checker.rs"]
mod lua_checker;

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
    let line = lua_checker::first_line("check_tickets.lua", "ticket_vectors.tsv", install_hmac);
    eprintln!("{line}");
    let vectors = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ticket_vectors.tsv"),
    )
    .expect("policy/tests/ticket_vectors.tsv");
    assert_eq!(
        line,
        format!("{} ticket vectors agree (Lua 5.3)", vectors.lines().count())
    );
}
