//! Finding the cgroup v2 hierarchy, the cgroups the programs attach to, and the cgroups that
//! scope a client side.
//!
//! Where it is mounted differs between machines: `/sys/fs/cgroup` on a pure cgroup v2 system,
//! `/sys/fs/cgroup/unified` on a hybrid one. The mount table says which.

use std::{
    os::unix::fs::MetadataExt,
    path::{Component, Path, PathBuf},
};

/// A cgroup v2 as the programs compare it: its id (the inode number of its directory) and its
/// depth below the root of the hierarchy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CgroupScope {
    /// The cgroup id.
    pub id: u64,
    /// Its level: 0 for the root, 1 for a child of the root, and so on.
    pub level: u32,
}

/// The scope of the cgroup directory `path`: absolute (under the mount point `root`), or
/// relative to `root` (`system.slice/haproxy.service`).
///
/// # Errors
/// The directory does not exist, is not under `root`, or is the root itself (which would scope
/// nothing).
pub fn cgroup_scope(root: &Path, path: &Path) -> std::io::Result<CgroupScope> {
    let (full, level) = resolve(root, path)?;
    if level == 0 {
        return Err(invalid(
            "the root cgroup holds every process: it scopes nothing".to_owned(),
        ));
    }
    Ok(CgroupScope {
        id: std::fs::metadata(&full)?.ino(),
        level,
    })
}

/// The cgroup directories to attach the programs to: `paths` (each absolute, under the mount
/// point `root`, or relative to it), or `root` itself when there are none.
///
/// # Errors
/// A path is not a cgroup directory under `root`, or is inside another of `paths` (or is
/// the same).
pub fn attach_dirs(root: &Path, paths: &[PathBuf]) -> std::io::Result<Vec<PathBuf>> {
    if paths.is_empty() {
        return Ok(vec![root.to_path_buf()]);
    }
    let mut dirs = Vec::with_capacity(paths.len());
    for path in paths {
        let (dir, _) = resolve(root, path)?;
        if let Some(outer) = dirs
            .iter()
            .find(|d: &&PathBuf| dir.starts_with(d) || d.starts_with(&dir))
        {
            return Err(invalid(format!(
                "{} and {} are nested: name the outer one only (it holds the inner one's sockets)",
                outer.display(),
                dir.display()
            )));
        }
        dirs.push(dir);
    }
    Ok(dirs)
}

/// The directory of cgroup `path` (absolute, under the mount point `root`, or relative to it)
/// and its level below `root`.
fn resolve(root: &Path, path: &Path) -> std::io::Result<(PathBuf, u32)> {
    let full = if path.is_absolute() {
        path.to_path_buf()
    } else {
        root.join(path)
    };
    let relative = full.strip_prefix(root).map_err(|_| {
        invalid(format!(
            "{} is not inside the cgroup v2 hierarchy at {}",
            full.display(),
            root.display()
        ))
    })?;
    let mut level = 0u32;
    for component in relative.components() {
        match component {
            Component::Normal(_) => level += 1,
            _ => {
                return Err(invalid(format!(
                    "{} is not a plain cgroup path",
                    full.display()
                )));
            }
        }
    }
    let meta = std::fs::metadata(&full)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", full.display())))?;
    if !meta.is_dir() {
        return Err(invalid(format!(
            "{} is not a cgroup directory",
            full.display()
        )));
    }
    Ok((full, level))
}

fn invalid(why: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, why)
}

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
    fn a_scope_is_a_directory_below_the_root() {
        let root = std::env::temp_dir().join(format!("retry-after-cgroup-{}", std::process::id()));
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        let scope = cgroup_scope(&root, Path::new("a/b")).unwrap();
        assert_eq!(scope.level, 2);
        assert_eq!(cgroup_scope(&root, &root.join("a")).unwrap().level, 1);
        assert!(cgroup_scope(&root, &root).is_err());
        assert!(cgroup_scope(&root, Path::new("/elsewhere")).is_err());
        assert!(cgroup_scope(&root, Path::new("a/../a")).is_err());
        assert!(cgroup_scope(&root, Path::new("missing")).is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn attach_dirs_are_the_root_or_cgroups_none_inside_another() {
        let root = std::env::temp_dir().join(format!("retry-after-attach-{}", std::process::id()));
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::create_dir_all(root.join("c")).unwrap();
        let dirs = |paths: &[&str]| {
            let paths: Vec<PathBuf> = paths.iter().map(PathBuf::from).collect();
            attach_dirs(&root, &paths)
        };
        assert_eq!(dirs(&[]).unwrap(), vec![root.clone()]);
        assert_eq!(
            dirs(&["a/b", "c"]).unwrap(),
            vec![root.join("a/b"), root.join("c")]
        );
        let nested = dirs(&["a", "c", "a/b"]).unwrap_err().to_string();
        assert!(nested.contains("nested"), "{nested}");
        assert!(dirs(&["c", "c"]).is_err());
        let missing = dirs(&["missing"]).unwrap_err().to_string();
        assert!(missing.contains("missing"), "{missing}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn none_without_cgroup2() {
        assert_eq!(cgroup2_mount_point("proc /proc proc rw 0 0\n"), None);
    }
}
