//! Backend endpoints as operators write them, and as the kernel programs key them.
//!
//! An endpoint is `address:port` (`127.0.0.1:8080`, `[::1]:8080`) or a port-only wildcard
//! (`*:8080`) that matches the port on every local or remote address.

use std::{
    fmt,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    str::FromStr,
};

use retry_after_common::EndpointKey;

/// A watched backend endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Endpoint {
    /// One address and port.
    Addr(SocketAddr),
    /// A port on any address.
    AnyAddress(u16),
}

/// Why a string is not an endpoint.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "`{input}` is not an endpoint: expected ADDRESS:PORT (127.0.0.1:8080, [::1]:8080) or *:PORT"
)]
pub struct ParseEndpointError {
    input: String,
}

impl Endpoint {
    /// The port.
    pub fn port(&self) -> u16 {
        match self {
            Endpoint::Addr(addr) => addr.port(),
            Endpoint::AnyAddress(port) => *port,
        }
    }

    /// The key the eBPF programs use for this endpoint.
    pub fn key(&self) -> EndpointKey {
        match self {
            Endpoint::Addr(SocketAddr::V4(addr)) => {
                EndpointKey::from_ipv4(addr.ip().octets(), addr.port())
            }
            Endpoint::Addr(SocketAddr::V6(addr)) => {
                EndpointKey::new(addr.ip().octets(), addr.port())
            }
            Endpoint::AnyAddress(port) => EndpointKey::any_address(*port),
        }
    }

    /// The endpoint a kernel key stands for (inverse of [`Endpoint::key`]).
    pub fn from_key(key: &EndpointKey) -> Self {
        if key.is_wildcard() {
            return Endpoint::AnyAddress(key.port);
        }
        let v6 = Ipv6Addr::from(key.addr);
        let ip = match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        };
        Endpoint::Addr(SocketAddr::new(ip, key.port))
    }

    /// True if a socket with this local (server side) or remote (client side) address would
    /// be counted under this endpoint.
    pub fn matches(&self, addr: &SocketAddr) -> bool {
        match self {
            Endpoint::Addr(own) => canonical(own) == canonical(addr),
            Endpoint::AnyAddress(port) => addr.port() == *port,
        }
    }
}

/// IPv4-mapped IPv6 addresses compare equal to their IPv4 form.
fn canonical(addr: &SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => *addr,
        },
        SocketAddr::V4(_) => *addr,
    }
}

impl FromStr for Endpoint {
    type Err = ParseEndpointError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let error = || ParseEndpointError {
            input: s.to_owned(),
        };
        if let Some(port) = s.strip_prefix("*:") {
            let port: u16 = port.parse().map_err(|_| error())?;
            if port == 0 {
                return Err(error());
            }
            return Ok(Endpoint::AnyAddress(port));
        }
        let addr: SocketAddr = s.parse().map_err(|_| error())?;
        if addr.port() == 0 || addr.ip().is_unspecified() {
            // 0.0.0.0:P would never match a connection; say *:P instead.
            return Err(error());
        }
        Ok(Endpoint::Addr(addr))
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Addr(addr) => write!(f, "{addr}"),
            Endpoint::AnyAddress(port) => write!(f, "*:{port}"),
        }
    }
}

impl From<SocketAddr> for Endpoint {
    fn from(addr: SocketAddr) -> Self {
        Endpoint::Addr(addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_every_form() {
        for text in ["127.0.0.1:8080", "[::1]:9000", "*:7000"] {
            let endpoint: Endpoint = text.parse().unwrap();
            assert_eq!(endpoint.to_string(), text);
            assert_eq!(Endpoint::from_key(&endpoint.key()), endpoint);
        }
    }

    #[test]
    fn rejects_what_would_never_match() {
        for text in [
            "127.0.0.1",
            "0.0.0.0:80",
            "[::]:80",
            "*:0",
            "*:x",
            "host:80",
            "",
        ] {
            let err = text.parse::<Endpoint>().unwrap_err();
            assert!(err.to_string().contains(&format!("`{text}`")), "{err}");
        }
    }

    #[test]
    fn ipv4_mapped_addresses_match_their_ipv4_endpoint() {
        let endpoint: Endpoint = "127.0.0.1:80".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:80".parse().unwrap();
        assert!(endpoint.matches(&mapped));
        assert!(Endpoint::AnyAddress(80).matches(&mapped));
        assert!(!Endpoint::AnyAddress(81).matches(&mapped));
    }
}
