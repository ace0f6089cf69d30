//! The HTTP/1.1 response framing walk of a server segment (`retry_after_common::http1`) in the
//! kernel. The walk is begun in the program (`ResponseFraming::begin`), then its steps (a skip
//! over body bytes, or up to eight bytes of a head, chunk line or trailer read) are each taken
//! by a global function, [`ra_http1_step`], which the verifier checks once, apart from the
//! programs (the walk inlined in a `bpf_loop` took `ra_ingress` past a million instructions).
//! Between its steps the walk waits in a slot of a per-CPU map (`H1_STEPPING`), taken at the
//! depth the programs nest to on the CPU, as the HTTP/2 walk's are (`steps.rs`).
//!
//! With `bpf_loop` (5.17) one loop takes every step of a segment: each walks one byte at
//! least, so the segment's length bounds it. Without it, a loop of fixed bound takes up to
//! [`STEPS_WITHOUT_LOOP`], in blocks; a segment that needs more loses the framing, and the
//! response it carries ends at the quiet turn (counted as inferred).

use aya_ebpf::{
    EbpfContext, bindings::__sk_buff, macros::map, maps::PerCpuArray, programs::SkBuffContext,
};
use retry_after_common::{
    ConnState,
    h2::FrameOps,
    http1::{Expected, Framed, ResponseFraming},
};

use crate::{counters::KernelFrameOps, packet::SegmentPayload, steps};

/// Steps a segment's walk takes at most without `bpf_loop`: a head of about 500 bytes, or some
/// 20 chunks.
pub const STEPS_WITHOUT_LOOP: u32 = 64;

/// Steps taken without `bpf_loop` before the walk is asked whether it has more to take.
const STEPS_A_BLOCK: u32 = 16;

/// A walk between its steps, in a slot of this CPU.
pub(crate) struct Stepping {
    /// The connection's framing, copied in before the steps and back after.
    framing: ResponseFraming,
    /// What the steps found.
    framed: Framed,
    /// Where the walk is in the segment, and the segment's length.
    pos: u32,
    len: u32,
    /// Where the segment's payload begins, in bytes past the network header.
    offset: u32,
}

/// The walks between their steps: one slot per level at which the programs nest on a CPU.
#[map]
static H1_STEPPING: PerCpuArray<Stepping> = PerCpuArray::with_max_entries(steps::SLOTS, 0);

/// Walk the framing of `len` server→client bytes at `seq` of `conn` (its payload `payload`):
/// what they tell of the response the turn expects (`expected`). With `bpf_loop` where
/// `ONE_LOOP`.
#[inline(always)]
pub(crate) fn walk_response<const ONE_LOOP: bool>(
    conn: &mut ConnState,
    (seq, len): (u32, u32),
    payload: &SegmentPayload,
    expected: Expected,
) -> Framed {
    let framing = &mut conn.server_framing;
    let mut framed = Framed::default();
    if let Some(start) = framing.begin(seq, len, payload, expected, &mut framed) {
        match steps::take_slot(&H1_STEPPING) {
            Some((level, slot)) => {
                // SAFETY: this CPU's slot at this level, which no other program uses until
                // it is given back. Field by field: a whole value would take the stack.
                unsafe {
                    (*slot).framing = *framing;
                    (*slot).framed = framed;
                    (*slot).pos = start;
                    (*slot).len = len;
                    (*slot).offset = payload.offset();
                }
                take_steps::<ONE_LOOP>(payload.ctx(), level, len);
                // SAFETY: as above.
                unsafe {
                    *framing = (*slot).framing;
                    framed = (*slot).framed;
                    if (*slot).pos < len {
                        framing.give_up();
                    }
                }
                steps::give_back(level);
            }
            None => framing.give_up(),
        }
        framing.walked_to(seq.wrapping_add(len));
    }
    framing.after(framed)
}

/// Take the steps of the walk in this CPU's slot at `level` (a segment of `len` bytes): all
/// of them in one `bpf_loop` (`ONE_LOOP`), or up to [`STEPS_WITHOUT_LOOP`]. A function of its
/// own, so that what follows is checked once, not once for each way the loop can end.
#[inline(never)]
fn take_steps<const ONE_LOOP: bool>(ctx: &SkBuffContext, level: u32, len: u32) {
    let skb = ctx.as_ptr().cast::<__sk_buff>();
    if ONE_LOOP {
        KernelFrameOps::repeat(len, || {
            core::hint::black_box(ra_http1_step(skb, level)) != 0
        });
    } else {
        // Blocks of calls whose answers are not looked at (a step past the segment's end
        // returns at once), and one look between blocks: each look the verifier cannot decide
        // is a branch it keeps for later, and 5.10 refuses a program that keeps 8,192 (a look
        // after every call, 256 of them, took `ra_ingress_step` past it beside the HTTP/2
        // walk's 2,048).
        let mut block = 0;
        while block < STEPS_WITHOUT_LOOP / STEPS_A_BLOCK {
            let mut i = 0;
            let mut more = 0;
            while i < STEPS_A_BLOCK {
                more = ra_http1_step(skb, level);
                i += 1;
            }
            if more == 0 {
                break;
            }
            block += 1;
        }
    }
}

/// One step of the walk in this CPU's slot `level`: true (1) while bytes remain. A global
/// function, which the verifier checks once: it may take only the context and numbers.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn ra_http1_step(skb: *mut __sk_buff, level: u32) -> i32 {
    let Some(slot) = H1_STEPPING.get_ptr_mut(level) else {
        return 0;
    };
    let Some(skb) = core::ptr::NonNull::new(skb) else {
        return 0;
    };
    // SAFETY: this CPU's slot, filled by `walk_response` before this call.
    let slot = unsafe { &mut *slot };
    let (pos, len) = (slot.pos, slot.len);
    if pos >= len || slot.framing.is_lost() {
        return 0;
    }
    let ctx = SkBuffContext::new(skb);
    let payload = SegmentPayload::new(&ctx, slot.offset);
    let walked = slot
        .framing
        .step(&payload, pos, len - pos, &mut slot.framed);
    slot.pos = pos + walked;
    i32::from(slot.pos < len)
}
