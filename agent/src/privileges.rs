//! Least privilege: what the agent needs, and giving it up once attached.
//!
//! Loading, verifying and attaching the programs needs `CAP_BPF`, `CAP_PERFMON` (the verifier
//! refuses the programs' pointer arithmetic without it) and `CAP_NET_ADMIN` (cgroup socket
//! programs); nothing else, as a test shows by running the agent as `nobody` with those three
//! alone. Once the programs are attached and the sockets bound, the agent reads maps through
//! file descriptors it already holds and answers on sockets it already listens on, which need
//! no capability at all. So [`drop_all`] empties every capability set and forbids regaining
//! any: the process that parses input from other processes holds no privilege.

use std::io;

/// The capabilities the agent needs to start, as systemd and Kubernetes write them.
pub const REQUIRED: [&str; 3] = ["CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"];

/// Highest capability number known to the kernels the agent supports (CAP_CHECKPOINT_RESTORE).
const LAST_CAP: i32 = 40;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// Give up every capability for good: the bounding set (where allowed), the ambient set, and
/// the effective, permitted and inheritable sets; and set no-new-privileges, so no exec can
/// bring any back.
///
/// # Errors
/// The kernel refused to clear the sets.
pub fn drop_all() -> io::Result<()> {
    // Dropping from the bounding set needs CAP_SETPCAP, which an agent started with only
    // the required capabilities does not have; the empty permitted set and
    // no-new-privileges are what matter then.
    for cap in 0..=LAST_CAP {
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
    }
    // SAFETY: prctl with integer arguments only.
    if unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    let header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [CapData::default(); 2];
    // SAFETY: capset reads a version-3 header and two data structs that we own.
    if unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The effective capability set of this process, as /proc/self/status shows it (hex).
pub fn effective() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| v.trim().to_owned())
}
