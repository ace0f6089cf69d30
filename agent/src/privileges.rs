//! Least privilege: what the agent needs, and giving it up once attached.
//!
//! Loading, verifying and attaching the programs needs `CAP_BPF`, `CAP_PERFMON` (the verifier
//! refuses the programs' pointer arithmetic without it) and `CAP_NET_ADMIN` (cgroup socket
//! programs); nothing else, as a test shows by running the agent as `nobody` with those three
//! alone. Once the programs are attached and the sockets bound, the agent reads maps through
//! file descriptors it already holds and answers on sockets it already listens on, which need
//! no capability at all. So [`drop_all`] empties every capability set and forbids regaining
//! any: the process that parses input from other processes holds no privilege.
//!
//! Capabilities belong to threads, so every thread gives them up: the thread that attached,
//! once it has, and each runtime thread as it starts ([`drop_all`] is the runtime's
//! thread-start hook for `run`).
//!
//! One exception, by kernel: kernels that check for `CAP_BPF` at every `bpf()` call while
//! `kernel.unprivileged_bpf_disabled` is set (Debian's 5.10, for one) refuse even a lookup in a
//! map whose descriptor the agent holds. There `CAP_BPF` alone is kept ([`keeps_bpf`]), so the
//! counters stay readable; the kernel is asked, not its version.

use std::{io, sync::OnceLock};

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

/// `CAP_BPF`'s number.
const CAP_BPF: i32 = 39;

/// Give up every capability of the calling thread for good (but `CAP_BPF` where
/// [`keeps_bpf`]): the bounding set (where allowed), the ambient set, and the effective,
/// permitted and inheritable sets; and set no-new-privileges, so no exec can bring any back.
///
/// # Errors
/// The kernel refused to clear the sets.
pub fn drop_all() -> io::Result<()> {
    let keep_bpf = keeps_bpf();
    // Dropping from the bounding set needs CAP_SETPCAP, which an agent started with only
    // the required capabilities does not have; the empty permitted set and
    // no-new-privileges are what matter then.
    for cap in (0..=LAST_CAP).filter(|&cap| !(keep_bpf && cap == CAP_BPF)) {
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
    let mut data = [CapData::default(); 2];
    if keep_bpf {
        let bit = 1 << (CAP_BPF - 32);
        data[1].effective = bit;
        data[1].permitted = bit;
    }
    if set_thread_capabilities(&data).is_err() {
        // Not held to begin with (started with CAP_SYS_ADMIN but not CAP_BPF): give up all.
        set_thread_capabilities(&[CapData::default(); 2])?;
    }
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Set the calling thread's effective, permitted and inheritable sets to `data`.
fn set_thread_capabilities(data: &[CapData; 2]) -> io::Result<()> {
    let header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    // SAFETY: capset reads a version-3 header and two data structs that we own.
    if unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// True if this kernel refuses every `bpf()` call from a thread without `CAP_BPF`, so the
/// agent keeps it to read its maps. Asked once, from a short-lived thread that gives up its
/// own capabilities and looks up an element of no map: `EPERM` says the call was refused
/// before its descriptor was looked at, `EBADF` that it would have been judged by the
/// descriptor alone.
pub fn keeps_bpf() -> bool {
    static KEEPS_BPF: OnceLock<bool> = OnceLock::new();
    *KEEPS_BPF.get_or_init(|| {
        std::thread::spawn(|| {
            if set_thread_capabilities(&[CapData::default(); 2]).is_err() {
                return false;
            }
            /// BPF_MAP_LOOKUP_ELEM.
            const MAP_LOOKUP: libc::c_long = 1;
            // The attribute's first field, the map descriptor: none.
            let mut attr = [0u64; 4];
            attr[0] = u64::from(u32::MAX);
            // SAFETY: bpf(2) reads a zeroed attribute of the size given, which we own.
            let result =
                unsafe { libc::syscall(libc::SYS_bpf, MAP_LOOKUP, attr.as_mut_ptr(), 32u32) };
            result == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
        })
        .join()
        .unwrap_or(false)
    })
}

/// The effective capability set of this process, as /proc/self/status shows it (hex).
pub fn effective() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| v.trim().to_owned())
}
