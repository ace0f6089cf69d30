//! The HTTP/2 frame walk of one segment as a build of the programs takes it (`H2_LOOP`,
//! `H2_STEPS`): begun, its steps taken (`steps.rs`), ended, and what it did counted. The
//! segment programs, the first flight and the connection's life all walk through here, and
//! nothing here calls back into them.

use aya_ebpf::programs::SkBuffContext;
use retry_after_common::{
    ConnState, EndpointCounters, Payload, ProbeStat, Protocol,
    h2::{FrameSegment, FrameWalk},
    tls::Sender,
};

use crate::{counters, maps::PROBE_STATS, steps, streams::ConnectionStreams};

/// How a build of the segment programs counts HTTP/2 connections: not at all (left out, and
/// counted as such).
pub(crate) const H2_OFF: u8 = 0;
/// ... by streams, each segment's frames walked by one `bpf_loop` (5.17 and later).
pub(crate) const H2_LOOP: u8 = 1;
/// ... by streams, each segment's frames walked in steps by a loop of fixed bound and on by a
/// chain of tail calls (`steps.rs`): kernels without `bpf_loop`.
pub(crate) const H2_STEPS: u8 = 2;

/// The chain of tail calls that walks a paused segment ran out (`steps.rs`): the rest of the
/// segment is not walked, and the walk's place is found again at the next segment that begins
/// with a frame header.
#[inline(always)]
pub(crate) fn cut(conn: &mut ConnState, sender: Sender) {
    conn.frames_mut(sender).lose_place();
    counters::probe_stat(&PROBE_STATS, ProbeStat::Http2WalksCut);
}

/// Walk `len` bytes at `seq` of `sender`'s (`payload`, where the steps find them at
/// `source`) as `H2` says (`steps.rs`), and count what they did: true if the walk paused, to
/// go on in the next program.
#[inline(always)]
pub(crate) fn walk_in_steps<P: Payload, const H2: u8>(
    ctx: &SkBuffContext,
    conn: &mut ConnState,
    c: *mut EndpointCounters,
    at: ((u32, u32), steps::Source),
    payload: &P,
    sender: Sender,
) -> bool {
    walk_taking_steps(conn, c, at, payload, sender, |level| {
        if H2 == H2_LOOP {
            steps::take_steps::<true>(ctx, level);
        } else {
            steps::take_steps::<false>(ctx, level);
        }
    })
}

/// The walk of [`walk_in_steps`], its steps taken by `take` (given the slot's level). The
/// walk is begun and ended by functions of their own and its steps are taken from here, so
/// that no chain of calls holds more than two stacks besides the program's (the verifier
/// holds them together to 512 bytes).
#[inline(always)]
pub(crate) fn walk_taking_steps<P: Payload>(
    conn: &mut ConnState,
    c: *mut EndpointCounters,
    (at, source): ((u32, u32), steps::Source),
    payload: &P,
    sender: Sender,
    take: impl FnOnce(u32),
) -> bool {
    let level = begin_steps(conn, c, &(at, source), payload, sender);
    if level == steps::NO_LEVEL {
        return false;
    }
    take(level);
    end_steps(conn, c, level, sender)
}

/// Begin a walk in steps: a walk with steps to take waits in this CPU's slot at the level
/// returned; one without (a retransmission, a segment that ends in a held header) is ended
/// and counted here, and `steps::NO_LEVEL` returned.
#[inline(never)]
fn begin_steps<P: Payload>(
    conn: &mut ConnState,
    c: *mut EndpointCounters,
    &((seq, len), source): &((u32, u32), steps::Source),
    payload: &P,
    sender: Sender,
) -> u32 {
    let protocol = Protocol::from_u32(u32::from(conn.protocol));
    let streams = ConnectionStreams::of(conn);
    let frames = match sender {
        Sender::Client => &mut conn.client_frames,
        Sender::Server => &mut conn.server_frames,
    };
    let segment = FrameSegment {
        seq,
        len,
        payload,
        sender,
        protocol,
    };
    let mut begun = frames.begin_walk(&mut conn.hole, &streams, segment);
    if begun.is_stepping() {
        let of = steps::StepsOf {
            connection: conn.h2_connection,
            entry: &conn.h2_entry,
        };
        if let Some(level) = steps::enter(frames, &begun, of, source) {
            return level;
        }
    }
    frames.end_walk(&mut conn.hole, &mut begun);
    count_walk(c, begun.did());
    steps::NO_LEVEL
}

/// End a walk in steps: the walk back from this CPU's slot at `level`, its place saved, what
/// it did counted. True if it paused.
#[inline(never)]
fn end_steps(conn: &mut ConnState, c: *mut EndpointCounters, level: u32, sender: Sender) -> bool {
    let frames = match sender {
        Sender::Client => &mut conn.client_frames,
        Sender::Server => &mut conn.server_frames,
    };
    let (hole, open) = (&mut conn.hole, &raw mut conn.h2_open);
    steps::leave(level, |stepped, walk, opened| {
        *frames = *stepped;
        // SAFETY: a field of the connection's live state; 2^64 - k subtracts k.
        unsafe { counters::add(open, opened) };
        frames.end_walk(hole, walk);
        count_walk(c, walk.did());
        walk.did().paused
    })
    .unwrap_or(false)
}

/// Count what a segment's walk did: its streams in the endpoint's counters `c`, its problems
/// in the probe's.
#[inline(always)]
fn count_walk(c: *mut EndpointCounters, walk: &FrameWalk) {
    if walk.unframed {
        counters::probe_stat(&PROBE_STATS, ProbeStat::Http2SegmentsUnframed);
    }
    counters::probe_stats_unconditionally(
        &PROBE_STATS,
        ProbeStat::Http2StreamsUntracked,
        u64::from(walk.untracked),
    );
    // SAFETY: `c` points into this CPU's copy of a live map value.
    unsafe { counters::apply_streams(c, &walk.delta) };
}
