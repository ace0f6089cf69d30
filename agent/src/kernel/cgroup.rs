//! Finding the cgroup v2 hierarchy to attach to.
//!
//! Where it is mounted differs between machines: `/sys/fs/cgroup` on a pure cgroup v2 system,
//! `/sys/fs/cgroup/unified` on a hybrid one. The mount table says which.

use std::path::PathBuf;

/// The mount point of the cgroup v2 hierarchy, from /proc/self/mounts.
pub fn find_cgroup2_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    cgroup2_mount_point(&mounts)
}

/// The first `cgroup2` mount point in a mount table (the format of /proc/self/mounts).
fn cgroup2_mount_point(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_source, target, fstype) = (fields.next()?, fields.next()?, fields.next()?);
        // Spaces in mount points are written as \040.
        (fstype == "cgroup2").then(|| PathBuf::from(target.replace("\\040", " ")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_unified_mount_on_a_hybrid_system() {
        let mounts = "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n\
                      cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        assert_eq!(
            cgroup2_mount_point(mounts),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
    }

    #[test]
    fn none_without_cgroup2() {
        assert_eq!(cgroup2_mount_point("proc /proc proc rw 0 0\n"), None);
    }
}
