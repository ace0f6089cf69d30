//! `retry-after-agent --version` names the version and the commit it was built from: what an
//! operator quotes in a bug report (the Debian package's binary is checked the same way in the
//! root suite's package test).

use std::{path::Path, process::Command};

#[test]
fn version_names_the_crate_version_and_the_commit() {
    let out = Command::new(env!("CARGO_BIN_EXE_retry-after-agent"))
        .arg("--version")
        .output()
        .expect("the agent binary runs");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).expect("--version prints UTF-8");
    let prefix = format!("retry-after-agent {} (", env!("CARGO_PKG_VERSION"));
    let commit = text
        .trim_end()
        .strip_prefix(&prefix)
        .and_then(|rest| rest.strip_suffix(')'))
        .unwrap_or_else(|| panic!("--version printed {text:?}, not {prefix}<commit>)"));
    // This checkout's HEAD, when there is one to ask (a tarball build says `unknown`).
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let head = Command::new("git")
        .current_dir(&root)
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|out| out.status.success() && root.join(".git").exists())
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned());
    match head {
        Some(head) => {
            let hash = commit.strip_suffix("-dirty").unwrap_or(commit);
            assert_eq!(
                hash, head,
                "--version names {commit}, the checkout is at {head}"
            );
            assert!(
                hash.len() == 12 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
                "{commit} is not 12 hex digits"
            );
        }
        None => assert_eq!(commit, "unknown", "no checkout here, yet {text:?}"),
    }
}
