//! Reading the TCP header of a segment seen by a cgroup_skb program.
//!
//! cgroup_skb programs see the packet from its network header on. Only the fields the turn
//! state machine needs are read: sequence number, acknowledgement number (if the ACK flag is
//! set) and the payload length.

use aya_ebpf::{EbpfContext, bindings::__sk_buff, programs::SkBuffContext};

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const IPV6_HEADER_LEN: u32 = 40;
const TCP_FLAG_ACK: u8 = 0x10;

/// What the turn state machine needs from one TCP segment.
pub struct Segment {
    /// Sequence number of the first payload byte.
    pub seq: u32,
    /// Acknowledgement number, if the ACK flag is set.
    pub ack: Option<u32>,
    /// Payload bytes (the whole GSO super-packet on egress).
    pub payload_len: u32,
}

/// The TCP segment in `ctx`, or `None` if it is not TCP over IPv4/IPv6 without extension
/// headers.
#[inline(always)]
pub fn parse_tcp(ctx: &SkBuffContext) -> Option<Segment> {
    // SAFETY: the context pointer of a cgroup_skb program is a valid __sk_buff.
    let protocol = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).protocol };
    let ip_header_len = match u16::from_be(protocol as u16) {
        ETH_P_IP => {
            let version_ihl: u8 = ctx.load(0).ok()?;
            let proto: u8 = ctx.load(9).ok()?;
            if proto != IPPROTO_TCP {
                return None;
            }
            ((version_ihl & 0x0f) as u32) * 4
        }
        ETH_P_IPV6 => {
            let next_header: u8 = ctx.load(6).ok()?;
            if next_header != IPPROTO_TCP {
                return None;
            }
            IPV6_HEADER_LEN
        }
        _ => return None,
    };
    let offset = ip_header_len as usize;
    let seq: u32 = ctx.load(offset + 4).ok()?;
    let ack: u32 = ctx.load(offset + 8).ok()?;
    let data_offset: u8 = ctx.load(offset + 12).ok()?;
    let flags: u8 = ctx.load(offset + 13).ok()?;
    let headers = ip_header_len + ((data_offset >> 4) as u32) * 4;
    let payload_len = ctx.len().saturating_sub(headers);
    Some(Segment {
        seq: u32::from_be(seq),
        ack: if flags & TCP_FLAG_ACK != 0 {
            Some(u32::from_be(ack))
        } else {
            None
        },
        payload_len,
    })
}
