//! Reading the TCP header of a segment seen by a cgroup_skb program.
//!
//! cgroup_skb programs see the packet from its network header on. Only the fields the turn
//! state machine needs are read: sequence number, acknowledgement number (if the ACK flag is
//! set) and the payload length. The headers are read in place (direct packet access, no helper
//! call) when they are in the linear part of the buffer, which the kernel guarantees for TCP
//! on both paths; `bpf_skb_load_bytes` is the fallback.

use aya_ebpf::{EbpfContext, bindings::__sk_buff, programs::SkBuffContext};
use retry_after_common::{
    Payload, ProbeStat,
    turn::{self, ResponseStart, STATUS_LINE_PREFIX},
};

use crate::counters;

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const IPV4_MIN_HEADER_LEN: usize = 20;
const IPV6_HEADER_LEN: usize = 40;
/// The TCP header up to and including the flags byte.
const TCP_PREFIX_LEN: usize = 14;
const TCP_FLAG_PSH: u8 = 0x08;
const TCP_FLAG_ACK: u8 = 0x10;

/// What the turn state machine needs from one TCP segment.
///
/// Every field is defined whether or not the packet could be read (`parsed`): LLVM leaves the
/// payload of a `None` undefined, may spill and reload it on the path that never wrote it, and
/// Debian's 6.1 refuses a read of a stack slot the path did not write (6.12 accepts it).
pub struct Segment {
    /// The packet was a TCP segment over IPv4 or IPv6 whose headers could be read; if not,
    /// every other field is zero.
    pub parsed: bool,
    /// Sequence number of the first payload byte.
    pub seq: u32,
    /// Acknowledgement number (meaningful if `has_ack`).
    pub ack: u32,
    /// The ACK flag. (Not an `Option`: LLVM may leave the `None` payload undefined, and the
    /// verifier refuses to store an undefined register.)
    pub has_ack: bool,
    /// Payload bytes (the whole GSO super-packet on egress).
    pub payload_len: u32,
    /// The PSH flag: set on the segment that ends each write.
    pub push: bool,
    /// Offset of the first payload byte from the network header.
    pub payload_offset: u32,
    /// The segment's source port.
    pub source_port: u16,
    /// An IPv6 packet (else IPv4).
    pub ipv6: bool,
}

/// The sender's address of the IPv4 or IPv6 packet in `ctx` (IPv4 as IPv4-mapped IPv6), and
/// the source port of its TCP segment `segment`.
#[inline(always)]
pub fn source(ctx: &SkBuffContext, segment: &Segment) -> Option<([u8; 16], u16)> {
    let addr = if segment.ipv6 {
        ctx.load::<[u8; 16]>(8).ok()?
    } else {
        let [a, b, c, d] = ctx.load::<[u8; 4]>(12).ok()?;
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, b, c, d]
    };
    Some((addr, segment.source_port))
}

/// The payload of one segment, for the TLS record walk and the HTTP/2 frame walk.
pub struct SegmentPayload<'a> {
    ctx: &'a SkBuffContext,
    offset: u32,
}

impl<'a> SegmentPayload<'a> {
    /// The payload that begins `offset` bytes after the network header of `ctx`.
    #[inline(always)]
    pub fn new(ctx: &'a SkBuffContext, offset: u32) -> Self {
        Self { ctx, offset }
    }

    /// The packet's context.
    #[inline(always)]
    pub fn ctx(&self) -> &'a SkBuffContext {
        self.ctx
    }

    /// Where the payload begins, in bytes past the network header.
    #[inline(always)]
    pub fn offset(&self) -> u32 {
        self.offset
    }
}

impl Payload for SegmentPayload<'_> {
    #[inline(always)]
    fn header_at(&self, at: u32) -> Option<[u8; 5]> {
        self.ctx.load::<[u8; 5]>((self.offset + at) as usize).ok()
    }

    #[inline(always)]
    fn frame_header_at(&self, at: u32) -> Option<[u8; 9]> {
        self.ctx.load::<[u8; 9]>((self.offset + at) as usize).ok()
    }

    #[inline(always)]
    fn bytes_at(&self, at: u32, n: u32) -> Option<u32> {
        // One load of a constant size per case: the verifier wants a bounded length.
        let at = (self.offset + at) as usize;
        let bytes = match n {
            1 => {
                let [a] = self.ctx.load::<[u8; 1]>(at).ok()?;
                [0, 0, 0, a]
            }
            2 => {
                let [a, b] = self.ctx.load::<[u8; 2]>(at).ok()?;
                [0, 0, a, b]
            }
            3 => {
                let [a, b, c] = self.ctx.load::<[u8; 3]>(at).ok()?;
                [0, a, b, c]
            }
            4 => self.ctx.load::<[u8; 4]>(at).ok()?,
            _ => return None,
        };
        Some(u32::from_be_bytes(bytes))
    }

    #[inline(always)]
    fn word_at(&self, at: u32, n: u32) -> Option<[u8; 8]> {
        // One load where eight bytes are left (a head's bytes, mostly), two short ones at the
        // segment's end.
        if n >= 8 {
            return self.ctx.load::<[u8; 8]>((self.offset + at) as usize).ok();
        }
        retry_after_common::word_in_halves(self, at, n)
    }
}

/// What the payload at `offset` says of the response it begins (its status line): interim,
/// a rejection (429, 503), or anything else.
#[inline(always)]
pub fn response_start(ctx: &SkBuffContext, offset: u32) -> ResponseStart {
    match ctx.load::<[u8; STATUS_LINE_PREFIX]>(offset as usize) {
        Ok(first) => turn::response_start(first),
        Err(_) => ResponseStart::Other,
    }
}

impl Segment {
    /// No segment: what [`parse_tcp`] makes of a packet it cannot read.
    const NONE: Self = Self {
        parsed: false,
        seq: 0,
        ack: 0,
        has_ack: false,
        payload_len: 0,
        push: false,
        payload_offset: 0,
        source_port: 0,
        ipv6: false,
    };
}

/// The TCP segment in `ctx`, or [`Segment::NONE`] (not `parsed`) if it is not TCP over
/// IPv4/IPv6 without extension headers.
#[inline(always)]
pub fn parse_tcp(ctx: &SkBuffContext) -> Segment {
    read_tcp(ctx).unwrap_or(Segment::NONE)
}

#[inline(always)]
fn read_tcp(ctx: &SkBuffContext) -> Option<Segment> {
    // SAFETY: the context pointer of a cgroup_skb program is a valid __sk_buff.
    let protocol = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).protocol };
    let is_ipv6 = match u16::from_be(protocol as u16) {
        ETH_P_IP => false,
        ETH_P_IPV6 => true,
        _ => return None,
    };
    parse_in_place(ctx, is_ipv6).or_else(|| {
        counters::probe_stat(&crate::maps::PROBE_STATS, ProbeStat::HeadersCopied);
        parse_copied(ctx, is_ipv6)
    })
}

/// Fixed header fields of one segment, before the payload length is known.
struct Headers {
    ipv6: bool,
    ip_header_len: usize,
    tcp: [u8; TCP_PREFIX_LEN],
}

#[inline(always)]
fn parse_in_place(ctx: &SkBuffContext, is_ipv6: bool) -> Option<Segment> {
    let data = ctx.data();
    let data_end = ctx.data_end();
    let ip_header_len = if is_ipv6 {
        if data + IPV6_HEADER_LEN > data_end {
            return None;
        }
        // SAFETY: bounds checked above against data_end.
        if unsafe { *((data + 6) as *const u8) } != IPPROTO_TCP {
            return None;
        }
        IPV6_HEADER_LEN
    } else {
        if data + IPV4_MIN_HEADER_LEN > data_end {
            return None;
        }
        // SAFETY: bounds checked above against data_end.
        let (version_ihl, proto) = unsafe { (*(data as *const u8), *((data + 9) as *const u8)) };
        if proto != IPPROTO_TCP {
            return None;
        }
        ((version_ihl & 0x0f) as usize) * 4
    };
    if ip_header_len < IPV4_MIN_HEADER_LEN {
        return None;
    }
    let tcp = data + ip_header_len;
    if tcp + TCP_PREFIX_LEN > data_end {
        return None;
    }
    // SAFETY: bounds checked above against data_end.
    let prefix = unsafe { *(tcp as *const [u8; TCP_PREFIX_LEN]) };
    segment(
        ctx,
        Headers {
            ipv6: is_ipv6,
            ip_header_len,
            tcp: prefix,
        },
    )
}

#[inline(always)]
fn parse_copied(ctx: &SkBuffContext, is_ipv6: bool) -> Option<Segment> {
    let ip_header_len = if is_ipv6 {
        let next_header: u8 = ctx.load(6).ok()?;
        if next_header != IPPROTO_TCP {
            return None;
        }
        IPV6_HEADER_LEN
    } else {
        let version_ihl: u8 = ctx.load(0).ok()?;
        let proto: u8 = ctx.load(9).ok()?;
        if proto != IPPROTO_TCP {
            return None;
        }
        ((version_ihl & 0x0f) as usize) * 4
    };
    let tcp: [u8; TCP_PREFIX_LEN] = ctx.load(ip_header_len).ok()?;
    segment(
        ctx,
        Headers {
            ipv6: is_ipv6,
            ip_header_len,
            tcp,
        },
    )
}

#[inline(always)]
fn segment(ctx: &SkBuffContext, headers: Headers) -> Option<Segment> {
    let t = headers.tcp;
    let seq = u32::from_be_bytes([t[4], t[5], t[6], t[7]]);
    let ack = u32::from_be_bytes([t[8], t[9], t[10], t[11]]);
    let tcp_header_len = ((t[12] >> 4) as u32) * 4;
    let payload_offset = headers.ip_header_len as u32 + tcp_header_len;
    // Through memory: the saturating subtraction's result, kept in a register across the merge
    // with an unread packet, was reloaded from a stack slot that way never wrote (Debian 11's
    // and 12's verifiers refuse the read).
    let payload_len = core::hint::black_box(ctx.len().saturating_sub(payload_offset));
    Some(Segment {
        parsed: true,
        seq,
        ack,
        has_ack: t[13] & TCP_FLAG_ACK != 0,
        payload_len,
        push: t[13] & TCP_FLAG_PSH != 0,
        payload_offset,
        source_port: u16::from_be_bytes([t[0], t[1]]),
        ipv6: headers.ipv6,
    })
}
