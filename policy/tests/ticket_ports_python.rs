//! The Python port of kept returns (`integrations/python/retry_after_tickets.py`) against the
//! shared ticket vectors (`ticket_vectors.tsv`, which `ticket_vectors.rs` holds to the Rust
//! answers), under the machine's `python3` (its standard library only: `hmac` and `hashlib`
//! give HMAC-SHA1). The checker is `test_retry_after_client.TicketVectors`, which replays every
//! line on the Python book and prints how many agreed. `KeptReturnsInServe` checks the Ray
//! Serve ingress's admission (`integrations/ray/retry_after_ray.py`, Serve's errors stood in
//! for) on the same book; `ReturnCookieInARealJar` the return cookie in `http.cookiejar`.

use std::{path::PathBuf, process::Command};

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn the_python_ticket_book_answers_as_the_rust_one_on_every_vector() {
    let vectors = std::fs::read_to_string(workspace().join("policy/tests/ticket_vectors.tsv"))
        .expect("policy/tests/ticket_vectors.tsv");
    let out = Command::new("python3")
        .args([
            "-m",
            "unittest",
            "-v",
            "test_retry_after_client.TicketVectors",
        ])
        .current_dir(workspace().join("integrations/python"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 runs (the machine's own: nothing beyond its standard library is used)");
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && report.contains("\nOK"),
        "the Python ticket book disagrees:\n{report}"
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    let line = printed.lines().next().unwrap_or_default();
    eprintln!("{line}");
    assert_eq!(
        line,
        format!("{} ticket vectors agree (Python)", vectors.lines().count())
    );
}

/// Run one `unittest` class of `test_retry_after_client` and require it to pass.
fn unittest_passes(class: &str) {
    let out = Command::new("python3")
        .args([
            "-m",
            "unittest",
            "-v",
            &format!("test_retry_after_client.{class}"),
        ])
        .current_dir(workspace().join("integrations/python"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 runs (the machine's own: nothing beyond its standard library is used)");
    let report = String::from_utf8_lossy(&out.stderr);
    eprintln!("{report}");
    assert!(out.status.success() && report.contains("\nOK"), "{report}");
    assert!(!report.contains("Ran 0 tests"), "{report}");
}

#[test]
fn the_ray_serve_ingress_keeps_places_on_the_python_book() {
    unittest_passes("KeptReturnsInServe");
}

/// The return cookie in the standard library's `http.cookiejar` (its clock moved by the test):
/// a place 150 s away, told 60 s twice, is still held by the jar at its place.
#[test]
fn a_real_cookie_jar_keeps_the_return_cookie_until_its_place() {
    unittest_passes("ReturnCookieInARealJar");
}
