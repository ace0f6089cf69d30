//! Waiting for a quiet machine. `./dev test` starts a test whose software takes long to start
//! (vLLM's engine) beside the other tests, niced, and holds a lock while they run; the test
//! starts its software, then waits here for the lock before its own load, and takes back the
//! CPU's full share for itself and everything it started.

use std::{
    fs::File,
    path::Path,
    time::{Duration, Instant},
};

/// The environment variable naming the lock file `./dev test` holds while other tests run.
pub const QUIET_LOCK_ENV: &str = "RETRY_AFTER_QUIET_LOCK";

/// Wait until the lock [`QUIET_LOCK_ENV`] names is free (at once without the variable), then
/// run this process and its descendants at niceness 0. How long it waited.
pub fn wait_for_quiet() -> Duration {
    let started = Instant::now();
    let Some(path) = std::env::var_os(QUIET_LOCK_ENV) else {
        return Duration::ZERO;
    };
    let file = File::open(Path::new(&path))
        .unwrap_or_else(|e| panic!("{QUIET_LOCK_ENV} names {path:?}, which cannot be opened: {e}"));
    file.lock()
        .unwrap_or_else(|e| panic!("waiting for the lock {path:?}: {e}"));
    drop(file);
    set_niceness_of_tree(std::process::id(), 0);
    started.elapsed()
}

/// Every thread of process `root` and of its descendants at `niceness` (niceness belongs to a
/// thread on Linux). Panics if one cannot be set, as lowering it needs CAP_SYS_NICE.
fn set_niceness_of_tree(root: u32, niceness: i32) {
    for pid in descendants(root) {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue; // it exited
        };
        for tid in tasks
            .flatten()
            .filter_map(|t| t.file_name().to_str()?.parse::<u32>().ok())
        {
            // SAFETY: setpriority(2) on a thread id; no memory is passed.
            if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, niceness) } != 0 {
                let error = std::io::Error::last_os_error();
                assert!(
                    error.raw_os_error() == Some(libc::ESRCH), // the thread exited
                    "niceness {niceness} for thread {tid} of process {pid}: {error}"
                );
            }
        }
    }
}

/// `root` and every process whose chain of parents reaches it, from `/proc`.
fn descendants(root: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .expect("/proc is mounted")
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            Some((pid, parent_in_stat(&stat)?))
        })
        .collect();
    let mut tree = vec![root];
    let mut at = 0;
    while let Some(&pid) = tree.get(at) {
        tree.extend(
            parents
                .iter()
                .filter(|(_, ppid)| *ppid == pid)
                .map(|(p, _)| *p),
        );
        at += 1;
    }
    tree
}

/// The parent's pid in a `/proc/PID/stat` line: the field after the state, which follows the
/// command's name in parentheses (a name may hold spaces and parentheses, so the last `)`).
fn parent_in_stat(stat: &str) -> Option<u32> {
    let (_, after_name) = stat.rsplit_once(')')?;
    after_name.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parent_follows_a_name_with_spaces_and_parentheses() {
        let stat = "4242 (a (b) c) S 17 4242 4242 0 -1 4194560";
        assert_eq!(parent_in_stat(stat), Some(17));
        assert_eq!(parent_in_stat("garbage"), None);
    }

    #[test]
    fn this_process_is_its_own_tree_and_its_children_are_in_it() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let tree = descendants(std::process::id());
        assert_eq!(tree[0], std::process::id());
        assert!(tree.contains(&child.id()), "{tree:?}");
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
