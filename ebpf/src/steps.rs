//! The HTTP/2 frame walk of a segment, in steps: begun (`FrameStream::begin_walk`), a step
//! a frame (`FrameStream::step`), ended (`FrameStream::end_walk`). Between its steps the walk
//! waits in a slot of a per-CPU map (`H2_STEPPING`), with a copy of the direction's frame walk
//! and what its streams are inserted with; the steps read the segment from the packet or from
//! the parking map.
//!
//! Each step is a global function, [`ra_h2_step`] (or, for parked bytes walked by a program
//! with no packet, [`ra_h2_step_parked`]), which the verifier checks once, apart
//! from the programs that call it (5.6 and later); it takes only the context and numbers
//! (5.10), hence the slot. With `bpf_loop` (5.17) one loop calls it for all of a segment's
//! frames. Without it (Ubuntu 22.04's 5.15, Debian 11's 5.10) a loop of fixed bound calls it
//! up to [`STEPS_PER_PROGRAM`] times: the verifier walks such a loop call by call (with the
//! frame walk itself in the loop, every way a frame can go multiplied the states it keeps,
//! and the loop was refused after a few steps). A segment with more frames pauses, and a
//! program reached by a tail call walks the same segment on from there; a chain of tail calls
//! ends after 33 programs, and what is left then is not walked (`http2_walks_cut`).

use core::{
    ptr::{read_volatile, write_volatile},
    sync::atomic::{Ordering, compiler_fence},
};

use aya_ebpf::{
    EbpfContext,
    bindings::__sk_buff,
    macros::map,
    maps::{PerCpuArray, ProgramArray},
    programs::SkBuffContext,
};
use retry_after_common::h2::{FrameOps, FrameStream, SegmentWalk, StreamEntry};

use crate::{
    counters::KernelFrameOps,
    packet::SegmentPayload,
    parking,
    streams::{ConnectionStreams, StreamOwner},
};

/// Steps (frames) one program takes at most.
pub const STEPS_PER_PROGRAM: u32 = 2048;

/// No slot: the walk was not put in one.
pub(crate) const NO_LEVEL: u32 = u32::MAX;

/// Slots per CPU: one per level at which the programs nest on a CPU (a send in a system call
/// interrupted by a receive, or by a send of its own from a softirq).
pub(crate) const SLOTS: u32 = 4;

/// A walk between its steps, in a slot of this CPU.
pub(crate) struct Stepping {
    /// The walking direction's frame walk, copied in before the steps and back after.
    frames: FrameStream,
    /// Where the walk is in the segment.
    walk: SegmentWalk,
    /// The connection's id and the entry its streams are inserted with.
    connection: u64,
    entry: StreamEntry,
    /// Streams opened minus those ended by the steps (wrapping), added to the connection's
    /// count after them.
    open: u64,
    /// Where the segment's bytes are: in the packet, `offset` bytes past the network header
    /// (`parked` 0), or parked at `parked_seq`.
    offset: u32,
    parked: u32,
    parked_seq: u32,
}

impl StreamOwner for Stepping {
    #[inline(always)]
    fn connection(&self) -> u64 {
        self.connection
    }

    #[inline(always)]
    fn entry(&mut self) -> &mut StreamEntry {
        &mut self.entry
    }

    #[inline(always)]
    fn open_count(&mut self) -> *mut u64 {
        &raw mut self.open
    }
}

/// The walks between their steps (`H2_STEPPING`): `SLOTS` per CPU.
#[map]
static H2_STEPPING: PerCpuArray<Stepping> = PerCpuArray::with_max_entries(SLOTS, 0);

/// How deep the programs running on this CPU have taken slots (`H2_STEP_DEPTH`).
#[map]
static H2_STEP_DEPTH: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Where the bytes a walk steps through are.
#[derive(Clone, Copy)]
pub(crate) enum Source {
    /// In the packet, this many bytes past its network header.
    Packet(u32),
    /// Parked, the segment that begins at this sequence number.
    Parked(u32),
}

/// What a walk's steps need of its connection: its id, and the entry its streams are
/// inserted with.
pub(crate) struct StepsOf<'a> {
    pub connection: u64,
    pub entry: &'a StreamEntry,
}

/// Put `walk`, begun on `frames`, in this CPU's next free slot with what its steps need of
/// the connection (`of`) and where the segment's bytes are (`source`): its level, or `None`
/// if the programs nest deeper than the slots go (not seen; the walk then ends where it is).
/// Everything is passed by reference and copied into the slot field by field: a copy on the
/// stack took the walk's first step (`begin_steps`) past what 6.1 allows the segment
/// programs' chains of calls.
#[inline(always)]
pub(crate) fn enter(
    frames: &FrameStream,
    walk: &SegmentWalk,
    of: StepsOf<'_>,
    source: Source,
) -> Option<u32> {
    let (level, slot) = take_slot(&H2_STEPPING)?;
    let (offset, parked, parked_seq) = match source {
        Source::Packet(offset) => (offset, 0, 0),
        Source::Parked(seq) => (0, 1, seq),
    };
    // SAFETY: this CPU's slot at this level, which no other program uses until `leave`.
    // Field by field: a whole `Stepping` built first would take its size of the stack.
    unsafe {
        (*slot).frames = *frames;
        (*slot).walk = *walk;
        (*slot).connection = of.connection;
        (*slot).entry = *of.entry;
        (*slot).open = 0;
        (*slot).offset = offset;
        (*slot).parked = parked;
        (*slot).parked_seq = parked_seq;
    }
    Some(level)
}

/// Take the steps of the walk in this CPU's slot at `level`, each by [`ra_h2_step`], until
/// one says the segment is walked: all of them in one `bpf_loop` (`ONE_LOOP`), or up to
/// [`STEPS_PER_PROGRAM`] in a loop of fixed bound. A function of its own: the verifier then
/// walks what follows the loop once, not once for each way the loop can end.
#[inline(never)]
pub(crate) fn take_steps<const ONE_LOOP: bool>(ctx: &SkBuffContext, level: u32) {
    let skb = ctx.as_ptr().cast::<__sk_buff>();
    // A constant: the build without `bpf_loop` must not even name its callback (5.10 counts
    // the functions a program calls, not those it points to, and refuses the difference).
    if ONE_LOOP {
        // Hidden from the optimizer, which knows the step says 0 or 1 and would flip the bit
        // where the verifier, which takes a global function's answer for any number, wants a
        // branch before `bpf_loop`'s callback returns.
        KernelFrameOps::repeat(steps_at(level), || {
            core::hint::black_box(ra_h2_step(skb, level)) != 0
        });
    } else {
        // A constant bound: the verifier then splits its states only on what each step said.
        let mut i = 0;
        while i < STEPS_PER_PROGRAM {
            if ra_h2_step(skb, level) == 0 {
                break;
            }
            i += 1;
        }
    }
}

/// [`take_steps`] for a walk of parked bytes from a program that has no packet (the sock_ops
/// program walking a first flight), each step by [`ra_h2_step_parked`]. Its own loops, not
/// [`take_steps`]' with the step passed in: the closure then takes a frame of its own in
/// the segment programs' chain of calls, past the 512 bytes the verifier allows them.
#[inline(never)]
pub(crate) fn take_parked_steps<const ONE_LOOP: bool>(level: u32) {
    if ONE_LOOP {
        KernelFrameOps::repeat(steps_at(level), || {
            core::hint::black_box(ra_h2_step_parked(level)) != 0
        });
    } else {
        let mut i = 0;
        while i < STEPS_PER_PROGRAM {
            if ra_h2_step_parked(level) == 0 {
                break;
            }
            i += 1;
        }
    }
}

/// The most steps the walk in this CPU's slot at `level` can take (0 without a slot).
#[inline(always)]
fn steps_at(level: u32) -> u32 {
    // SAFETY: this CPU's slot, filled by `enter`.
    H2_STEPPING
        .get_ptr_mut(level)
        .map_or(0, |slot| unsafe { (*slot).walk.steps() })
}

/// End the walk in this CPU's slot at `level` with `end`, handed the direction's frame walk
/// as the steps left it, where the walk is (paused if steps remain), and the streams its
/// steps opened minus those they ended (to add to the connection's count, wrapping); then
/// give the slot back. Given back only once `end` is done with it: a program nesting after
/// the depth's store takes this very slot.
#[inline(always)]
pub(crate) fn leave<R>(
    level: u32,
    end: impl FnOnce(&FrameStream, &mut SegmentWalk, u64) -> R,
) -> Option<R> {
    let depth = H2_STEP_DEPTH.get_ptr_mut(0)?;
    let slot = H2_STEPPING.get_ptr_mut(level)?;
    // SAFETY: this CPU's slot, taken by `enter` and not given back yet.
    let ended = unsafe { end(&(*slot).frames, &mut (*slot).walk, (*slot).open) };
    give_back_slot(depth, level);
    Some(ended)
}

/// Take this CPU's next free slot of `slots` (a walk's, between its steps): its level and
/// place, or `None` if the programs nest deeper than the slots go (not seen). Every walk in
/// steps takes its slot by the one depth of this CPU, whichever map its slots are in.
#[inline(always)]
pub(crate) fn take_slot<T>(slots: &PerCpuArray<T>) -> Option<(u32, *mut T)> {
    let depth = H2_STEP_DEPTH.get_ptr_mut(0)?;
    // SAFETY: this CPU's value; a program that nests here runs to its end before this one
    // goes on, so the depth is a stack.
    let level = unsafe { read_volatile(depth) };
    let slot = slots.get_ptr_mut(level)?;
    // The slot is taken before a byte of it is written: a program that nests from here on
    // (a receive interrupting a send) takes the next one. Without the fence the compiler
    // may move the depth's store after the slot's, and a program nesting in between would
    // fill the same slot, this walk then finishing on the other connection's frames.
    // SAFETY: this CPU's value.
    unsafe { write_volatile(depth, level + 1) };
    compiler_fence(Ordering::SeqCst);
    Some((level, slot))
}

/// Give back the slot at `level` taken by [`take_slot`], once done with it: a program nesting
/// after the depth's store takes this very slot.
#[inline(always)]
pub(crate) fn give_back(level: u32) {
    if let Some(depth) = H2_STEP_DEPTH.get_ptr_mut(0) {
        give_back_slot(depth, level);
    }
}

/// [`give_back`], this CPU's depth found.
#[inline(always)]
fn give_back_slot(depth: *mut u32, level: u32) {
    compiler_fence(Ordering::SeqCst);
    // SAFETY: this CPU's value.
    unsafe { write_volatile(depth, level) };
}

/// One step of the walk in this CPU's slot `slot`: true (1) while more remain. A global
/// function, which the verifier checks once: it may take only the context and numbers.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ra_h2_step(skb: *mut __sk_buff, slot: u32) -> i32 {
    let Some(step) = H2_STEPPING.get_ptr_mut(slot) else {
        return 0;
    };
    // SAFETY: this CPU's slot, filled by `enter` before this call.
    let step = unsafe { &mut *step };
    let go_on = if step.parked != 0 {
        step_parked(step)
    } else if let Some(skb) = core::ptr::NonNull::new(skb) {
        let streams = ConnectionStreams::of(step);
        let ctx = SkBuffContext::new(skb);
        let payload = SegmentPayload::new(&ctx, step.offset);
        step.frames.step(&mut step.walk, &payload, &streams)
    } else {
        false
    };
    i32::from(go_on)
}

/// [`ra_h2_step`] for a walk of parked bytes, from a program that has no packet: a global
/// function of numbers alone, which any program type may call.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ra_h2_step_parked(slot: u32) -> i32 {
    let Some(step) = H2_STEPPING.get_ptr_mut(slot) else {
        return 0;
    };
    // SAFETY: this CPU's slot, filled by `enter` before this call.
    i32::from(step_parked(unsafe { &mut *step }))
}

/// One step of the walk `step`, whose bytes are parked: true while more remain.
#[inline(always)]
fn step_parked(step: &mut Stepping) -> bool {
    let streams = ConnectionStreams::of(step);
    match parking::parked_payload(step.connection, step.parked_seq) {
        Some(payload) => step.frames.step(&mut step.walk, &payload, &streams),
        None => {
            step.walk.lose();
            false
        }
    }
}

/// The program that walks on a received segment (index 0: `ra_ingress_more`), set by the
/// agent when it runs this build.
#[map]
static H2_INGRESS_MORE: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// The program that walks on a sent segment (index 0: `ra_egress_more`).
#[map]
static H2_EGRESS_MORE: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// Hand the segment to the program that walks on from where its walk paused (this program
/// ends here). Returns only if the tail call failed: the chain's 33 programs are spent.
#[inline(always)]
pub(crate) fn walk_more<const INGRESS: bool>(ctx: &SkBuffContext) {
    let table = if INGRESS {
        &H2_INGRESS_MORE
    } else {
        &H2_EGRESS_MORE
    };
    // SAFETY: a tail call with the program's own context.
    unsafe { table.tail_call(ctx, 0) };
}
