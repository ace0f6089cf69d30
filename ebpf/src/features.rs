//! Kernel feature probes: tiny programs the agent loads at start, and never attaches. Each is
//! accepted only by a kernel that has one feature the counting programs use, so the agent
//! asks the verifier that will judge them, not a version number (distributions backport).

use core::{ffi::c_void, ptr::read_volatile};

use aya_ebpf::{
    macros::{btf_tracepoint, cgroup_skb},
    programs::{BtfTracePointContext, SkBuffContext},
};
use retry_after_common::{ProbeStat, h2::FrameOps};

use crate::{
    counters::KernelFrameOps,
    maps::{PROBE_STATS, tracked},
    walk_lock,
};

/// Atomic fetch operations (5.12), compare-and-exchange among them: the HTTP/2 walker word
/// (`walk_lock.rs`). An exchange of 0 for 0 in a probe-wide counter changes nothing.
#[cgroup_skb(ingress)]
fn ra_has_atomics(_ctx: SkBuffContext) -> i32 {
    if let Some(slot) = PROBE_STATS.get_ptr_mut(ProbeStat::ConnectionsUntracked as u32) {
        // The walker's own exchange, so the probe asks for the instruction the walk uses.
        // SAFETY: `slot` points into this CPU's copy of the array, 8-byte aligned.
        let exchanged = unsafe { walk_lock::exchange(slot, 0, 0) };
        // Read, so the fetch form is kept.
        // SAFETY: a local value.
        let _ = unsafe { read_volatile(&exchanged) };
    }
    1
}

/// `bpf_loop` (5.17): the HTTP/2 frame walk's loop.
#[cgroup_skb(ingress)]
fn ra_has_bpf_loop(_ctx: SkBuffContext) -> i32 {
    KernelFrameOps::repeat(1, || false);
    1
}

/// Socket-local storage from a tracing program (5.11): the closes of adopted connections.
#[btf_tracepoint(function = "tcp_destroy_sock")]
fn ra_has_sk_store(ctx: BtfTracePointContext) -> i32 {
    let sk: *mut c_void = ctx.arg(0);
    let _ = tracked(sk);
    0
}
