//! A socket's addresses as the sock_ops and cgroup_skb contexts carry them, and the endpoint
//! they name from either side.

use retry_after_common::{EndpointKey, Side};

/// The IPv4 address family.
pub(crate) const AF_INET: u32 = 2;
/// The IPv6 address family.
pub(crate) const AF_INET6: u32 = 10;

/// A socket's addresses, as both the sock_ops and the cgroup_skb context carry them: ports in
/// the kernel's orders (local in host order, remote in network order in the upper 16 bits),
/// addresses in network order.
pub(crate) struct Addresses {
    /// `AF_INET` or `AF_INET6`.
    pub(crate) family: u32,
    /// The local port, in host order.
    pub(crate) local_port: u32,
    /// The remote port, in network order in the upper 16 bits.
    pub(crate) remote_port: u32,
    /// The local IPv4 address.
    pub(crate) local_ip4: u32,
    /// The remote IPv4 address.
    pub(crate) remote_ip4: u32,
    /// The local IPv6 address, in four words.
    pub(crate) local_ip6: [u32; 4],
    /// The remote IPv6 address, in four words.
    pub(crate) remote_ip6: [u32; 4],
}

/// Read the address fields of a context (`bpf_sock_ops` or `__sk_buff`, which name them
/// alike). The verifier only accepts context loads at a constant offset from the context
/// pointer; each field gets its own volatile load, so the compiler selects between loaded
/// values, never between field pointers (which the verifier rejects).
macro_rules! addresses {
    ($ptr:expr) => {{
        use ::core::ptr::read_volatile;
        let p = $ptr;
        // SAFETY: `p` is the context the kernel passed in; these are plain u32 fields.
        unsafe {
            let family = read_volatile(&raw const (*p).family);
            let mut local_ip6 = [0u32; 4];
            let mut remote_ip6 = [0u32; 4];
            if family == $crate::addresses::AF_INET6 {
                local_ip6[0] = read_volatile(&raw const (*p).local_ip6[0]);
                local_ip6[1] = read_volatile(&raw const (*p).local_ip6[1]);
                local_ip6[2] = read_volatile(&raw const (*p).local_ip6[2]);
                local_ip6[3] = read_volatile(&raw const (*p).local_ip6[3]);
                remote_ip6[0] = read_volatile(&raw const (*p).remote_ip6[0]);
                remote_ip6[1] = read_volatile(&raw const (*p).remote_ip6[1]);
                remote_ip6[2] = read_volatile(&raw const (*p).remote_ip6[2]);
                remote_ip6[3] = read_volatile(&raw const (*p).remote_ip6[3]);
            }
            $crate::addresses::Addresses {
                family,
                local_port: read_volatile(&raw const (*p).local_port),
                remote_port: read_volatile(&raw const (*p).remote_port),
                local_ip4: read_volatile(&raw const (*p).local_ip4),
                remote_ip4: read_volatile(&raw const (*p).remote_ip4),
                local_ip6,
                remote_ip6,
            }
        }
    }};
}

pub(crate) use addresses;

/// The endpoint of `addresses` seen from `side`: the local address for a connection accepted
/// here, the remote one for a connection opened from here.
pub(crate) fn endpoint_of(a: &Addresses, side: Side) -> Option<EndpointKey> {
    let (ip4, ip6, port) = match side {
        Side::Server => (a.local_ip4, a.local_ip6, a.local_port as u16),
        Side::Client => (
            a.remote_ip4,
            a.remote_ip6,
            u32::from_be(a.remote_port) as u16,
        ),
    };
    match a.family {
        AF_INET => Some(EndpointKey::from_ipv4(ip4.to_ne_bytes(), port)),
        AF_INET6 => {
            let mut addr = [0u8; 16];
            let mut i = 0;
            while i < 4 {
                let word = ip6[i].to_ne_bytes();
                addr[i * 4] = word[0];
                addr[i * 4 + 1] = word[1];
                addr[i * 4 + 2] = word[2];
                addr[i * 4 + 3] = word[3];
                i += 1;
            }
            Some(EndpointKey::new(addr, port))
        }
        _ => None,
    }
}
