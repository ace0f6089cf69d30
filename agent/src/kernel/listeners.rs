//! Accept backlogs of listening TCP sockets, read over sock_diag netlink.
//!
//! A connection that finished its handshake but was not yet accepted by the application waits
//! in the listener's accept queue: queued work the eBPF counters cannot see as a request until
//! its bytes arrive. The kernel reports the queue length of a listener as `idiag_rqueue`
//! (and its limit as `idiag_wqueue`). Only listeners are dumped, so this stays cheap on nodes
//! with many connections.

use std::{
    io,
    mem::size_of,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use retry_after_estimator::endpoint::Endpoint;

/// One listening socket and its accept queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenerBacklog {
    /// The address it is bound to (possibly unspecified: 0.0.0.0 or ::).
    pub local: SocketAddr,
    /// Connections waiting to be accepted.
    pub queued: u32,
    /// The backlog limit passed to listen(2), as capped by the kernel.
    pub limit: u32,
}

impl ListenerBacklog {
    /// True if connections to `endpoint` land on this listener.
    pub fn serves(&self, endpoint: &Endpoint) -> bool {
        listener_serves(&self.local, endpoint)
    }
}

/// True if connections to `endpoint` land on a listener bound to `local`.
pub(super) fn listener_serves(local: &SocketAddr, endpoint: &Endpoint) -> bool {
    match endpoint {
        Endpoint::AnyAddress(port) => local.port() == *port,
        Endpoint::Addr(addr) => {
            addr.port() == local.port() && (local.ip().is_unspecified() || endpoint.matches(local))
        }
    }
}

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const TCP_LISTEN: u32 = 10;
const NLMSG_HEADER_LEN: usize = 16;
const INET_DIAG_REQ_LEN: usize = 56;
const INET_DIAG_MSG_LEN: usize = 72;

/// Every TCP listener of this network namespace, IPv4 and IPv6.
///
/// # Errors
/// The netlink socket cannot be opened, or the kernel answers with an error.
pub fn listener_backlogs() -> io::Result<Vec<ListenerBacklog>> {
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut listeners = Vec::new();
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        dump(&socket, family, &mut listeners)?;
    }
    Ok(listeners)
}

/// Dump the TCP listeners of `family` into `out`.
fn dump(socket: &OwnedFd, family: u8, out: &mut Vec<ListenerBacklog>) -> io::Result<()> {
    send_dump_request(socket, family)?;
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: `buffer` is valid for its whole length.
        let received = unsafe {
            libc::recv(
                socket.as_raw_fd(),
                buffer.as_mut_ptr().cast(),
                buffer.len(),
                0,
            )
        };
        if received < 0 {
            return Err(io::Error::last_os_error());
        }
        if read_messages(&buffer[..received as usize], out)? {
            return Ok(());
        }
    }
}

/// Ask the kernel for every listening TCP socket of `family` (`SOCK_DIAG_BY_FAMILY`, dump).
fn send_dump_request(socket: &OwnedFd, family: u8) -> io::Result<()> {
    let mut request = [0u8; NLMSG_HEADER_LEN + INET_DIAG_REQ_LEN];
    let len = request.len() as u32;
    request[0..4].copy_from_slice(&len.to_ne_bytes());
    request[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    request[6..8].copy_from_slice(&flags.to_ne_bytes());
    request[8..12].copy_from_slice(&1u32.to_ne_bytes());
    // struct inet_diag_req_v2: family, protocol, ext, pad, states, then a zero socket id.
    request[16] = family;
    request[17] = libc::IPPROTO_TCP as u8;
    request[20..24].copy_from_slice(&(1u32 << TCP_LISTEN).to_ne_bytes());
    // SAFETY: sockaddr_nl is plain data; all-zero addresses the kernel.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as u16;
    // SAFETY: the buffer and address outlive the call; lengths match.
    let sent = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            request.as_ptr().cast(),
            request.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The netlink messages of one read: listeners into `out`; true at the dump's end.
fn read_messages(mut rest: &[u8], out: &mut Vec<ListenerBacklog>) -> io::Result<bool> {
    let truncated = || io::Error::new(io::ErrorKind::InvalidData, "truncated netlink message");
    while rest.len() >= NLMSG_HEADER_LEN {
        let msg_len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        if msg_len < NLMSG_HEADER_LEN || msg_len > rest.len() {
            return Err(truncated());
        }
        let msg_type = u16::from_ne_bytes([rest[4], rest[5]]);
        let body = &rest[NLMSG_HEADER_LEN..msg_len];
        match msg_type {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                // A `struct nlmsgerr`: the negated errno first.
                let errno = word_at(body, 0)
                    .map(i32::from_ne_bytes)
                    .ok_or_else(truncated)?;
                return Err(io::Error::from_raw_os_error(-errno));
            }
            SOCK_DIAG_BY_FAMILY => {
                if let Some(listener) = parse_diag_msg(body) {
                    out.push(listener);
                }
            }
            _ => {}
        }
        // Messages are 4-byte aligned.
        let advance = (msg_len + 3) & !3;
        rest = &rest[advance.min(rest.len())..];
    }
    Ok(false)
}

/// The four bytes at `at`, if `bytes` holds them.
fn word_at(bytes: &[u8], at: usize) -> Option<[u8; 4]> {
    bytes.get(at..at.checked_add(4)?)?.try_into().ok()
}

/// A `struct inet_diag_msg`: family, state, timer, retrans, socket id (ports big-endian,
/// addresses as four big-endian words), expires, rqueue, wqueue, uid, inode.
fn parse_diag_msg(msg: &[u8]) -> Option<ListenerBacklog> {
    if msg.len() < INET_DIAG_MSG_LEN {
        return None;
    }
    let port = u16::from_be_bytes([msg[4], msg[5]]);
    let src: [u8; 16] = msg[8..24].try_into().ok()?;
    let ip = match msg[0] as i32 {
        libc::AF_INET => IpAddr::V4(Ipv4Addr::new(src[0], src[1], src[2], src[3])),
        libc::AF_INET6 => IpAddr::V6(Ipv6Addr::from(src)),
        _ => return None,
    };
    Some(ListenerBacklog {
        local: SocketAddr::new(ip, port),
        queued: u32::from_ne_bytes(word_at(msg, 56)?),
        limit: u32::from_ne_bytes(word_at(msg, 60)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A netlink message: header (length, type, flags, sequence, port id), then `body`.
    fn message(msg_type: u16, body: &[u8]) -> Vec<u8> {
        let len = (NLMSG_HEADER_LEN + body.len()) as u32;
        let mut bytes = len.to_ne_bytes().to_vec();
        bytes.extend(msg_type.to_ne_bytes());
        bytes.extend([0; 10]);
        bytes.extend(body);
        bytes
    }

    #[test]
    fn an_error_message_gives_its_errno_and_a_truncated_one_is_refused_without_panic() {
        let mut out = Vec::new();
        let error = message(NLMSG_ERROR, &(-libc::EPERM).to_ne_bytes());
        let e = read_messages(&error, &mut out).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        for body in [&[][..], &[1, 2, 3]] {
            let e = read_messages(&message(NLMSG_ERROR, body), &mut out).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        }
        assert!(read_messages(&message(NLMSG_DONE, &[]), &mut out).unwrap());
        assert!(!read_messages(&[0; 15], &mut out).unwrap());
        assert!(out.is_empty());
    }

    #[test]
    fn a_wildcard_listener_serves_every_address_of_its_port() {
        let listener = ListenerBacklog {
            local: "0.0.0.0:8080".parse().unwrap(),
            queued: 3,
            limit: 128,
        };
        assert!(listener.serves(&"127.0.0.1:8080".parse().unwrap()));
        assert!(listener.serves(&"*:8080".parse().unwrap()));
        assert!(!listener.serves(&"127.0.0.1:8081".parse().unwrap()));
        let bound = ListenerBacklog {
            local: "127.0.0.2:8080".parse().unwrap(),
            ..listener
        };
        assert!(!bound.serves(&"127.0.0.1:8080".parse().unwrap()));
    }
}
