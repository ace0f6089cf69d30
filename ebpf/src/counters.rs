//! Counter updates that stay exact when programs nest on one CPU.
//!
//! A cgroup_skb program running in process context (a send) can be interrupted by a softirq
//! that runs another of our programs (a receive, or a send of its own) on the same CPU, and
//! both may update the same per-CPU value; on a preemptible kernel another task may even run
//! in between. Plain read-modify-write would lose one of the updates, so those programs add
//! atomically. `core::sync::atomic::AtomicU64` has no `fetch_add` on the bpfel target, so the
//! add goes through the compiler intrinsic, which LLVM lowers to the BPF `lock xadd`
//! instruction when its result is unused (the form every verifier accepts).
//!
//! The ingress program is the exception: the kernel runs it from the TCP receive path with
//! bottom halves disabled, so it never nests with itself on one CPU. It writes a copy of the
//! endpoint counters of its own ([`CounterWriter::Ingress`]), with plain adds, which cost a
//! fraction of an atomic one.

use core::{
    ffi::c_void,
    intrinsics::{AtomicOrdering, atomic_xadd},
    ptr::{read_volatile, write_volatile},
};

use aya_ebpf::{
    helpers::{bpf_ktime_get_ns, bpf_loop},
    maps::PerCpuArray,
};
use retry_after_common::{
    ConnState, CounterWriter, EndpointCounters, ProbeStat, h2::FrameOps, turn::TurnDelta,
};

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

/// Atomically add `n` to the counter at `slot`, zero or not. For counts the HTTP/2 frame loop
/// made: a branch on them would make the verifier track each count's exact value through
/// every iteration of the loop, and walk it once per value.
///
/// # Safety
/// As [`add`].
#[inline(always)]
pub unsafe fn add_unconditionally(slot: *mut u64, n: u64) {
    // SAFETY: guaranteed by the caller.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(slot, n) };
}

/// One copy of an endpoint's counters, as the program that holds it updates them: with plain
/// adds (`PLAIN`) if only the ingress program writes the copy, atomically otherwise. A constant,
/// so each program's code carries one way of adding.
#[derive(Clone, Copy)]
pub struct Counters<const PLAIN: bool> {
    values: *mut EndpointCounters,
}

impl<const PLAIN: bool> Counters<PLAIN> {
    /// The programs that write a copy counted this way.
    pub const WRITER: CounterWriter = if PLAIN {
        CounterWriter::Ingress
    } else {
        CounterWriter::Any
    };

    /// The copy at `values`, written by [`Self::WRITER`].
    #[inline(always)]
    pub fn new(values: *mut EndpointCounters) -> Self {
        Self { values }
    }

    /// Add `n` to the counter at `slot`, a field of this copy.
    ///
    /// # Safety
    /// `slot` must point into this copy, a live map value.
    #[inline(always)]
    unsafe fn add(self, slot: *mut u64, n: u64) {
        if n == 0 {
            return;
        }
        if PLAIN {
            // SAFETY: guaranteed by the caller; no other program writes this copy on this CPU
            // while this one runs.
            unsafe { write_volatile(slot, read_volatile(slot).wrapping_add(n)) };
        } else {
            // SAFETY: guaranteed by the caller.
            unsafe { add(slot, n) };
        }
    }

    /// Count one connection opened.
    ///
    /// # Safety
    /// This copy must be a live map value.
    #[inline(always)]
    pub unsafe fn count_opened(self) {
        // SAFETY: guaranteed by the caller.
        unsafe { self.add(&raw mut (*self.values).connections_opened, 1) };
    }

    /// Count one connection closed.
    ///
    /// # Safety
    /// As [`Counters::count_opened`].
    #[inline(always)]
    pub unsafe fn count_closed(self) {
        // SAFETY: guaranteed by the caller.
        unsafe { self.add(&raw mut (*self.values).connections_closed, 1) };
    }

    /// Apply what one turn event did.
    ///
    /// # Safety
    /// As [`Counters::count_opened`].
    #[inline(always)]
    pub unsafe fn apply(self, delta: &TurnDelta) {
        let c = self.values;
        // SAFETY: guaranteed by the caller.
        unsafe {
            self.add(&raw mut (*c).requests_started, delta.started as u64);
            // A withdrawn start is subtracted (wrapping; the agent sums the copies wrapping,
            // so the total is exact even when one copy goes below zero).
            self.add(
                &raw mut (*c).requests_started,
                (delta.withdrawn as u64).wrapping_neg(),
            );
            self.add(&raw mut (*c).responses_completed, delta.completed as u64);
            self.add(&raw mut (*c).responses_rejected, delta.rejected as u64);
            self.add(&raw mut (*c).requests_abandoned, delta.abandoned as u64);
            self.add(&raw mut (*c).request_bytes, delta.request_bytes as u64);
            self.add(&raw mut (*c).response_bytes, delta.response_bytes as u64);
            self.add(&raw mut (*c).responses_inferred, delta.inferred as u64);
            self.add(&raw mut (*c).bodies_begun, delta.bodies_begun as u64);
            self.add(&raw mut (*c).bodies_ended, delta.bodies_ended as u64);
        }
    }

    /// Add a body's wait for its first byte, `ns`.
    ///
    /// # Safety
    /// As [`Counters::count_opened`].
    #[inline(always)]
    pub unsafe fn add_first_byte_wait(self, ns: u64) {
        // SAFETY: guaranteed by the caller.
        unsafe { self.add(&raw mut (*self.values).first_byte_wait_ns, ns) };
    }

    /// The values of this copy.
    #[inline(always)]
    pub fn values(self) -> *mut EndpointCounters {
        self.values
    }
}

/// Apply what one HTTP/2 segment did to an endpoint's counters, atomically whichever program
/// writes the copy, and without branching on the counts (see [`add_unconditionally`]).
///
/// # Safety
/// `c` must point into a live map value.
#[inline(always)]
pub unsafe fn apply_streams(c: *mut EndpointCounters, delta: &TurnDelta) {
    // SAFETY: guaranteed by the caller.
    unsafe {
        add_unconditionally(&raw mut (*c).requests_started, delta.started as u64);
        add_unconditionally(&raw mut (*c).responses_completed, delta.completed as u64);
        add_unconditionally(&raw mut (*c).responses_rejected, delta.rejected as u64);
        add_unconditionally(&raw mut (*c).requests_abandoned, delta.abandoned as u64);
        add_unconditionally(&raw mut (*c).bodies_begun, delta.bodies_begun as u64);
        add_unconditionally(&raw mut (*c).bodies_ended, delta.bodies_ended as u64);
        add(&raw mut (*c).request_bytes, delta.request_bytes as u64);
        add(&raw mut (*c).response_bytes, delta.response_bytes as u64);
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

/// The HTTP/2 frame walk's loop in the kernel: `bpf_loop`, whose body the verifier checks
/// once.
pub struct KernelFrameOps;

impl FrameOps for KernelFrameOps {
    #[inline(always)]
    fn repeat<F: FnMut() -> bool>(n: u32, mut body: F) {
        /// One iteration: `ctx` is the body; 0 goes on, 1 stops.
        extern "C" fn step<F: FnMut() -> bool>(_index: u64, ctx: *mut c_void) -> i64 {
            // SAFETY: `ctx` is the `body` that `repeat` handed to bpf_loop, alive for the call.
            let body = unsafe { &mut *ctx.cast::<F>() };
            i64::from(!body())
        }
        let callback = step::<F> as *const () as *mut c_void;
        // SAFETY: the helper calls `callback` with `ctx`, on this stack, at most `n` times.
        unsafe { bpf_loop(n, callback, (&raw mut body).cast(), 0) };
    }
}

/// Count `n` occurrences of a probe-wide event, `n` made by the HTTP/2 frame loop (see
/// [`add_unconditionally`]).
#[inline(always)]
pub fn probe_stats_unconditionally(stats: &PerCpuArray<u64>, stat: ProbeStat, n: u64) {
    if let Some(slot) = stats.get_ptr_mut(stat as u32) {
        // SAFETY: `slot` points into this CPU's copy of the array.
        unsafe { add_unconditionally(slot, n) };
    }
}

/// The clock of a request's wait for its response's first body byte: started with the
/// request (by the client's segments), read when the body begins (by the server's) and the
/// wait added to the counters `c`. A function of its own: inlined, its clock took the
/// segment program's frame past what 6.1 allows its chains of calls (512 bytes).
#[inline(never)]
pub(crate) fn time_first_byte<const INGRESS: bool>(
    conn: &mut ConnState,
    c: Counters<INGRESS>,
    delta: &TurnDelta,
) {
    if delta.started == 0 && delta.bodies_begun == 0 {
        return;
    }
    // SAFETY: the helper takes no argument.
    let now = unsafe { bpf_ktime_get_ns() };
    if delta.started != 0 {
        conn.time_request(now);
    }
    if delta.bodies_begun != 0
        && let Some(wait) = conn.first_byte_wait_ns(now)
    {
        // SAFETY: `c` is this CPU's copy of a live map value.
        unsafe { c.add_first_byte_wait(wait) };
    }
}
