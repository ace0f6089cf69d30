//! The commit a build is made from, as `retry-after-agent --version` names it. Shared by the
//! agent's build script and `./dev package` (xtask includes this file), so both say it the
//! same way.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// The variable that carries the commit into the binary (`env!` in main.rs). Set in the build's
/// environment (`./dev package` does; so can a packager building from a tarball), it is taken
/// as given.
pub const VARIABLE: &str = "RETRY_AFTER_AGENT_COMMIT";

/// What `--version` says without git: a build from a tarball, or where git cannot answer.
pub const UNKNOWN: &str = "unknown";

/// HEAD's first 12 hex digits, with `-dirty` when a tracked file differs from it (untracked
/// files do not count). `None` unless `root` is the top of a git checkout (its own `.git`, so a
/// tarball unpacked inside another repository does not take that one's commit) and git
/// answers.
pub fn describe(root: &Path) -> Option<String> {
    if !root.join(".git").exists() {
        return None;
    }
    let commit = git(root, &["rev-parse", "--short=12", "HEAD"])?;
    // --no-optional-locks: a build must not rewrite the index under a git command of its user.
    let changes = git(
        root,
        &[
            "--no-optional-locks",
            "status",
            "--porcelain",
            "--untracked-files=no",
        ],
    )?;
    Some(if changes.is_empty() {
        commit
    } else {
        format!("{commit}-dirty")
    })
}

/// The files that change when HEAD moves: HEAD itself (a checkout), the branch it names (a
/// commit; the branch's folder while the branch lives only in packed-refs, where the next
/// commit writes it) and packed-refs. Only those that exist: a missing one would make Cargo run
/// the build script at every build.
pub fn head_files(root: &Path) -> Vec<PathBuf> {
    if !root.join(".git").exists() {
        return Vec::new();
    }
    let git_path = |name: &str| git(root, &["rev-parse", "--git-path", name]).map(|p| root.join(p));
    let mut files: Vec<PathBuf> = ["HEAD", "packed-refs"]
        .into_iter()
        .filter_map(git_path)
        .collect();
    if let Some(branch) =
        git(root, &["symbolic-ref", "-q", "HEAD"]).and_then(|name| git_path(&name))
    {
        match branch.parent() {
            Some(folder) if !branch.exists() => files.push(folder.to_path_buf()),
            _ => files.push(branch),
        }
    }
    files.retain(|file| file.exists());
    files
}

/// git's trimmed standard output, if it ran and succeeded.
fn git(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .current_dir(root)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
