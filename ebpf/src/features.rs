//! Kernel feature probes: tiny programs the agent loads at start, and never attaches. Each is
//! accepted only by a kernel that has one feature the counting programs use, so the agent
//! asks the verifier that will judge them, not a version number (distributions backport).

use core::ffi::c_void;

use aya_ebpf::{
    macros::{btf_tracepoint, cgroup_skb},
    programs::{BtfTracePointContext, SkBuffContext},
};
use retry_after_common::h2::FrameOps;

use crate::{counters::KernelFrameOps, maps::tracked};

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
