//! A vectors checker of `integrations/lua/` run under Lua 5.3 built into the test (included
//! with `#[path]` by each port test): its arguments as a command line gives them, its printed
//! lines collected, its exit on a difference turned into an error of the test.

use std::path::PathBuf;

use mlua::Lua;

/// The workspace's root.
pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Run `integrations/lua/<checker>` on `policy/tests/<vectors>`, after `prepare` (globals the
/// checker needs); the first line it printed.
pub fn first_line(checker: &str, vectors: &str, prepare: impl FnOnce(&Lua)) -> String {
    let script = workspace().join("integrations/lua").join(checker);
    let vectors = workspace().join("policy/tests").join(vectors);
    let lua = Lua::new();
    let arg = lua.create_table().expect("a table");
    arg.set(0, script.display().to_string()).expect("arg[0]");
    arg.set(1, vectors.display().to_string()).expect("arg[1]");
    lua.globals().set("arg", arg).expect("the global arg");
    prepare(&lua);
    let printed = lua.create_table().expect("a table");
    lua.globals()
        .set("printed", printed.clone())
        .expect("the global printed");
    lua.load(format!(
        "print = function(line) printed[#printed + 1] = line end
         os.exit = function(code) error('{checker} exits with ' .. tostring(code), 0) end"
    ))
    .exec()
    .expect("print and os.exit redirected");
    let source = std::fs::read_to_string(&script).unwrap_or_else(|e| panic!("{checker}: {e}"));
    lua.load(source)
        .set_name(checker)
        .exec()
        .unwrap_or_else(|error| panic!("the Lua port disagrees ({checker}): {error}"));
    printed
        .get(1)
        .unwrap_or_else(|e| panic!("{checker} prints its count: {e}"))
}
