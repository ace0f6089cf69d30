//! Which cgroups own the sockets the agent watches: the processes listening on a watched
//! endpoint (the replicas, the proxy's frontend) and those connected to a backend (the
//! proxy), found from `/proc/net/tcp{,6}` ([`tcp_sockets`]) and each process's open files. What
//! `attach_cgroups = "auto"` attaches the programs to, so that no other socket of the node
//! runs them.

use std::{
    collections::BTreeMap,
    fs, io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
};

use super::listeners::listener_serves;
use retry_after_estimator::endpoint::Endpoint;

/// One process owning a watched socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketOwner {
    /// Its cgroup, relative to the cgroup v2 root (`system.slice/nginx.service`; empty: the
    /// root itself).
    pub cgroup: PathBuf,
    /// The process.
    pub pid: u32,
    /// Its command name (`/proc/<pid>/comm`).
    pub command: String,
    /// What it holds.
    pub holds: Held,
}

/// What a [`SocketOwner`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// A listener a watched endpoint's connections land on.
    Listener(SocketAddr),
    /// A connection to a watched backend.
    Connection(SocketAddr),
}

impl std::fmt::Display for SocketOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.holds {
            Held::Listener(addr) => format!("listens on {addr}"),
            Held::Connection(addr) => format!("is connected to {addr}"),
        };
        write!(
            f,
            "/{} ({} pid {} {what})",
            self.cgroup.display(),
            self.command,
            self.pid
        )
    }
}

/// A TCP socket of `/proc/net/tcp{,6}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpSocket {
    /// Its local address.
    pub local: SocketAddr,
    /// Its peer's address (unspecified for a listener).
    pub remote: SocketAddr,
    /// Its TCP state, as the kernel numbers them (`TCP_ESTABLISHED` 1, `TCP_LISTEN` 10).
    pub state: u8,
    /// Its inode, which a process's open file `socket:[inode]` names.
    pub inode: u64,
}

/// `TCP_ESTABLISHED`.
const ESTABLISHED: u8 = 1;
/// `TCP_LISTEN`.
const LISTEN: u8 = 10;

impl TcpSocket {
    /// True for a connection (not a listener, not closing).
    pub fn is_established(&self) -> bool {
        self.state == ESTABLISHED
    }

    /// True for a listener.
    pub fn is_listening(&self) -> bool {
        self.state == LISTEN
    }
}

/// Every TCP socket of this network namespace, IPv4 and IPv6, from `proc` (`/proc`).
///
/// # Errors
/// `/proc/net/tcp` cannot be read (`tcp6` is skipped on a kernel without IPv6).
pub fn tcp_sockets(proc: &Path) -> io::Result<Vec<TcpSocket>> {
    let mut sockets = Vec::new();
    for file in ["net/tcp", "net/tcp6"] {
        let text = match fs::read_to_string(proc.join(file)) {
            Ok(text) => text,
            Err(e) if file == "net/tcp6" && e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        sockets.extend(text.lines().skip(1).filter_map(parse_tcp_line));
    }
    Ok(sockets)
}

/// The processes of this node that listen on one of `servers` or are connected to one of
/// `backends`, one entry per process and socket kind, ordered by cgroup. `proc` is the proc
/// file system (`/proc`).
///
/// # Errors
/// `/proc/net/tcp` cannot be read. A process that exits while it is looked at is skipped.
pub fn socket_owners(
    proc: &Path,
    servers: &[Endpoint],
    backends: &[Endpoint],
) -> io::Result<Vec<SocketOwner>> {
    let wanted: BTreeMap<u64, Held> = tcp_sockets(proc)?
        .iter()
        .filter_map(|socket| Some((socket.inode, wanted_socket(socket, servers, backends)?)))
        .collect();
    let mut owners = Vec::new();
    if wanted.is_empty() {
        return Ok(owners);
    }
    for pid in fs::read_dir(proc)?.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
    {
        owners.extend(owned_by(proc, pid, &wanted));
    }
    owners.sort_by(|a, b| (&a.cgroup, a.pid).cmp(&(&b.cgroup, b.pid)));
    owners.dedup();
    Ok(owners)
}

/// Whether a socket is one to find the owner of.
fn wanted_socket(entry: &TcpSocket, servers: &[Endpoint], backends: &[Endpoint]) -> Option<Held> {
    if entry.is_listening() {
        let serves = servers.iter().any(|e| listener_serves(&entry.local, e));
        return serves.then_some(Held::Listener(entry.local));
    }
    backends
        .iter()
        .any(|b| b.matches(&entry.remote))
        .then_some(Held::Connection(entry.remote))
}

/// The sockets of `wanted` process `pid` holds, with its cgroup; none if it is gone.
fn owned_by(proc: &Path, pid: u32, wanted: &BTreeMap<u64, Held>) -> Vec<SocketOwner> {
    let dir = proc.join(pid.to_string());
    let Ok(fds) = fs::read_dir(dir.join("fd")) else {
        return Vec::new();
    };
    let mut held: Vec<Held> = fds
        .filter_map(|fd| {
            let target = fs::read_link(fd.ok()?.path()).ok()?;
            let inode = target
                .to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse::<u64>()
                .ok()?;
            wanted.get(&inode).copied()
        })
        .collect();
    // One line per kind of socket: a proxy holds many connections.
    held.sort_by_key(|h| matches!(h, Held::Connection(_)));
    held.dedup_by_key(|h| matches!(h, Held::Connection(_)));
    let Some(cgroup) = fs::read_to_string(dir.join("cgroup"))
        .ok()
        .and_then(|text| unified_cgroup(&text))
    else {
        return Vec::new();
    };
    let command = fs::read_to_string(dir.join("comm"))
        .map(|c| c.trim_end().to_owned())
        .unwrap_or_default();
    held.into_iter()
        .map(|holds| SocketOwner {
            cgroup: cgroup.clone(),
            pid,
            command: command.clone(),
            holds,
        })
        .collect()
}

/// The cgroup v2 path in a `/proc/<pid>/cgroup` file (its `0::/path` line), relative to the
/// root.
fn unified_cgroup(text: &str) -> Option<PathBuf> {
    text.lines()
        .find_map(|line| line.strip_prefix("0::"))
        .map(|path| PathBuf::from(path.trim_start_matches('/')))
}

/// One line of `/proc/net/tcp` or `tcp6`: `sl local rem st … inode …`.
fn parse_tcp_line(line: &str) -> Option<TcpSocket> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.len() < 10 {
        return None;
    }
    Some(TcpSocket {
        local: parse_address(fields[1])?,
        remote: parse_address(fields[2])?,
        state: u8::from_str_radix(fields[3], 16).ok()?,
        inode: fields[9].parse().ok()?,
    })
}

/// An address as the kernel prints it there: the address's 32-bit words in hex, each in
/// host byte order, then `:` and the port in hex.
fn parse_address(text: &str) -> Option<SocketAddr> {
    let (address, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| {
        u32::from_str_radix(address.get(8 * i..8 * i + 8)?, 16)
            .ok()
            .map(|w| w.to_ne_bytes())
    };
    let ip = match address.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for i in 0..4 {
                bytes[4 * i..4 * i + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The cgroups to attach to for `owners`: each owner's, outermost only (an owner in a cgroup
/// inside another owner's is covered by it). `None` if an owner is in the root itself, or
/// there is none: only the root covers them.
pub fn owner_cgroups(owners: &[SocketOwner]) -> Option<Vec<PathBuf>> {
    if owners.is_empty() || owners.iter().any(|o| o.cgroup.as_os_str().is_empty()) {
        return None;
    }
    let mut cgroups: Vec<PathBuf> = owners.iter().map(|o| o.cgroup.clone()).collect();
    cgroups.sort();
    cgroups.dedup();
    let outer: Vec<PathBuf> = cgroups
        .iter()
        .filter(|c| !cgroups.iter().any(|o| o != *c && c.starts_with(o)))
        .cloned()
        .collect();
    Some(outer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_net_tcp_lines_parse_for_both_families() {
        let v4 = "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 23456 1 0000000000000000 100 0 0 10 0";
        let entry = parse_tcp_line(v4).unwrap();
        assert_eq!(entry.local, "127.0.0.1:8080".parse().unwrap());
        assert!(entry.is_listening());
        assert_eq!(entry.inode, 23456);
        let v6 = "   1: 00000000000000000000000001000000:1F91 00000000000000000000000001000000:C350 01 00000000:00000000 00:00000000 00000000     0        0 777 1 0000000000000000 20 4 30 10 -1";
        let entry = parse_tcp_line(v6).unwrap();
        assert_eq!(entry.local, "[::1]:8081".parse().unwrap());
        assert_eq!(entry.remote, "[::1]:50000".parse().unwrap());
        assert!(entry.is_established());
        assert_eq!(parse_tcp_line("  sl  local_address rem_address   st"), None);
    }

    #[test]
    fn listeners_of_servers_and_connections_to_backends_are_wanted() {
        let any = |s: &str| s.parse::<SocketAddr>().unwrap();
        let listener = |local| TcpSocket {
            local: any(local),
            remote: any("0.0.0.0:0"),
            state: LISTEN,
            inode: 1,
        };
        let servers = [
            Endpoint::from(any("127.0.0.1:8080")),
            Endpoint::AnyAddress(9000),
        ];
        assert!(wanted_socket(&listener("0.0.0.0:8080"), &servers, &[]).is_some());
        assert!(wanted_socket(&listener("127.0.0.1:8080"), &servers, &[]).is_some());
        assert!(wanted_socket(&listener("10.1.2.3:9000"), &servers, &[]).is_some());
        assert!(wanted_socket(&listener("127.0.0.1:8081"), &servers, &[]).is_none());
        let connection = TcpSocket {
            local: any("127.0.0.1:40000"),
            remote: any("127.0.0.1:8080"),
            state: ESTABLISHED,
            inode: 2,
        };
        let backends = [Endpoint::from(any("127.0.0.1:8080"))];
        assert_eq!(
            wanted_socket(&connection, &servers, &backends),
            Some(Held::Connection(any("127.0.0.1:8080")))
        );
        assert_eq!(wanted_socket(&connection, &servers, &[]), None);
    }

    #[test]
    fn owner_cgroups_are_the_outermost_and_none_for_the_root() {
        let owner = |cgroup: &str| SocketOwner {
            cgroup: PathBuf::from(cgroup),
            pid: 1,
            command: "x".into(),
            holds: Held::Listener("127.0.0.1:1".parse().unwrap()),
        };
        let owners = [
            owner("system.slice/nginx.service"),
            owner("serving.slice/a"),
            owner("serving.slice"),
            owner("system.slice/nginx.service"),
        ];
        assert_eq!(
            owner_cgroups(&owners),
            Some(vec![
                PathBuf::from("serving.slice"),
                PathBuf::from("system.slice/nginx.service")
            ])
        );
        assert_eq!(owner_cgroups(&[owner(""), owner("a")]), None);
        assert_eq!(owner_cgroups(&[]), None);
        assert_eq!(
            unified_cgroup("0::/system.slice/haproxy.service\n"),
            Some(PathBuf::from("system.slice/haproxy.service"))
        );
    }
}
