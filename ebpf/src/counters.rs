//! Counter updates that stay exact when programs nest on one CPU.
//!
//! A cgroup_skb program running in process context (a send) can be interrupted by a softirq
//! that runs another of our programs (a receive) on the same CPU, and both may update the same
//! per-CPU value. Plain read-modify-write would lose one of the updates, so every increment is
//! a BPF atomic add. `core::sync::atomic::AtomicU64` has no `fetch_add` on the bpfel target, so
//! the add goes through the compiler intrinsic, which LLVM lowers to the BPF `lock xadd`
//! instruction when its result is unused (the form every verifier accepts).

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::maps::PerCpuArray;
use retry_after_common::{EndpointCounters, ProbeStat, turn::TurnDelta};

/// Atomically add `n` to the counter at `slot`.
///
/// # Safety
/// `slot` must point into a live, 8-byte aligned map value.
#[inline(always)]
pub unsafe fn add(slot: *mut u64, n: u64) {
    if n != 0 {
        // SAFETY: guaranteed by the caller.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(slot, n) };
    }
}

/// Apply what one turn event did to an endpoint's counters.
///
/// # Safety
/// `c` must point into a live map value.
#[inline(always)]
pub unsafe fn apply(c: *mut EndpointCounters, delta: &TurnDelta) {
    // SAFETY: guaranteed by the caller.
    unsafe {
        add(&mut (*c).requests_started, delta.started as u64);
        // A withdrawn start is subtracted (wrapping; the agent sums the per-CPU copies
        // wrapping, so the total is exact even when this CPU's own copy goes below zero).
        add(
            &mut (*c).requests_started,
            (delta.withdrawn as u64).wrapping_neg(),
        );
        add(&mut (*c).responses_completed, delta.completed as u64);
        add(&mut (*c).responses_rejected, delta.rejected as u64);
        add(&mut (*c).requests_abandoned, delta.abandoned as u64);
        add(&mut (*c).request_bytes, delta.request_bytes as u64);
        add(&mut (*c).response_bytes, delta.response_bytes as u64);
    }
}

/// Count one occurrence of a probe-wide event.
#[inline(always)]
pub fn probe_stat(stats: &PerCpuArray<u64>, stat: ProbeStat) {
    if let Some(slot) = stats.get_ptr_mut(stat as u32) {
        // SAFETY: `slot` points into this CPU's copy of the array.
        unsafe { add(slot, 1) };
    }
}
