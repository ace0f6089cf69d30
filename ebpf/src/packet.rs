//! Reading the TCP header of a segment seen by a cgroup_skb program.
//!
//! cgroup_skb programs see the packet from its network header on. Only the fields the turn
//! state machine needs are read: sequence number, acknowledgement number (if the ACK flag is
//! set) and the payload length. The headers are read in place (direct packet access, no helper
//! call) when they are in the linear part of the buffer, which the kernel guarantees for TCP
//! on both paths; `bpf_skb_load_bytes` is the fallback.

use aya_ebpf::{EbpfContext, bindings::__sk_buff, programs::SkBuffContext};
use retry_after_common::ProbeStat;

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
pub struct Segment {
    /// Sequence number of the first payload byte.
    pub seq: u32,
    /// Acknowledgement number, if the ACK flag is set.
    pub ack: Option<u32>,
    /// Payload bytes (the whole GSO super-packet on egress).
    pub payload_len: u32,
    /// The PSH flag: set on the segment that ends each write.
    pub push: bool,
    /// Offset of the first payload byte from the network header.
    pub payload_offset: u32,
}

/// True if the payload at `offset` begins an interim HTTP/1.x response (`HTTP/1.1 1xx`).
#[inline(always)]
pub fn starts_interim_response(ctx: &SkBuffContext, offset: u32) -> bool {
    match ctx.load::<[u8; 10]>(offset as usize) {
        Ok(start) => {
            start[..7] == *b"HTTP/1."
                && (start[7] == b'1' || start[7] == b'0')
                && start[8] == b' '
                && start[9] == b'1'
        }
        Err(_) => false,
    }
}

/// The TCP segment in `ctx`, or `None` if it is not TCP over IPv4/IPv6 without extension
/// headers.
#[inline(always)]
pub fn parse_tcp(ctx: &SkBuffContext) -> Option<Segment> {
    // SAFETY: the context pointer of a cgroup_skb program is a valid __sk_buff.
    let protocol = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).protocol };
    let is_ipv6 = match u16::from_be(protocol as u16) {
        ETH_P_IP => false,
        ETH_P_IPV6 => true,
        _ => return None,
    };
    parse_in_place(ctx, is_ipv6).or_else(|| {
        counters::probe_stat(&crate::PROBE_STATS, ProbeStat::HeadersCopied);
        parse_copied(ctx, is_ipv6)
    })
}

/// Fixed header fields of one segment, before the payload length is known.
struct Headers {
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
            ip_header_len,
            tcp: prefix,
        },
    )
}

#[inline(never)]
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
    segment(ctx, Headers { ip_header_len, tcp })
}

#[inline(always)]
fn segment(ctx: &SkBuffContext, headers: Headers) -> Option<Segment> {
    let t = headers.tcp;
    let seq = u32::from_be_bytes([t[4], t[5], t[6], t[7]]);
    let ack = u32::from_be_bytes([t[8], t[9], t[10], t[11]]);
    let tcp_header_len = ((t[12] >> 4) as u32) * 4;
    let payload_offset = headers.ip_header_len as u32 + tcp_header_len;
    let payload_len = ctx.len().saturating_sub(payload_offset);
    Some(Segment {
        seq,
        ack: (t[13] & TCP_FLAG_ACK != 0).then_some(ack),
        payload_len,
        push: t[13] & TCP_FLAG_PSH != 0,
        payload_offset,
    })
}
