//! A vectors file the Rust code writes and the ports replay: the test that made the lines
//! checks them against the stored file, or writes it anew when `UPDATE_VECTORS` is set
//! (included with `#[path]` by each vectors test).

use std::path::PathBuf;

/// Check `made` against `policy/tests/<file>` (or write it there with `UPDATE_VECTORS=1`);
/// `test` is the cargo test target that makes it, for the message.
pub fn check_or_update(made: &str, file: &str, test: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(file);
    if std::env::var_os("UPDATE_VECTORS").is_some() {
        std::fs::write(&path, made).unwrap_or_else(|e| panic!("policy/tests/{file}: {e}"));
    }
    let stored =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("policy/tests/{file}: {e}"));
    let differ = made.lines().zip(stored.lines()).position(|(a, b)| a != b);
    assert!(
        differ.is_none() && made.lines().count() == stored.lines().count(),
        "the Rust results differ from policy/tests/{file} (first at line {}): if the change is intended, run UPDATE_VECTORS=1 cargo test -p retry-after-policy --test {test}",
        differ.map_or(0, |i| i + 1)
    );
}
