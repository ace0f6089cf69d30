//! Two test hosts on one machine: network namespaces made for the test, joined by a veth pair,
//! with nftables on either end to lose and duplicate what it sends (a lost segment's
//! retransmission arrives after the segments behind it: out of order). Traffic between them
//! never leaves the pair; both are gone when the value is dropped. (`tc netem` would also
//! delay and reorder, but this machine's kernel is built without it.)

use std::{
    net::Ipv4Addr,
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

use crate::run_ok;

/// The server's address, inside its namespace.
pub const SERVER_ADDR: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
/// The client's address, inside its namespace.
pub const CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 2);

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A server namespace and a client namespace joined by a veth pair.
pub struct HostPair {
    /// The server's namespace (`ip netns exec <server> …`).
    pub server: String,
    /// The client's namespace.
    pub client: String,
}

impl HostPair {
    /// Make both namespaces, the pair between them, and their addresses; loopback up in each.
    pub fn new() -> Self {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let tag = format!("{}-{n}", std::process::id());
        let pair = Self {
            server: format!("ra-srv-{tag}"),
            client: format!("ra-cli-{tag}"),
        };
        for ns in [&pair.server, &pair.client] {
            ip(&["netns", "add", ns]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        let (srv_if, cli_if) = (format!("ras{n}"), format!("rac{n}"));
        ip(&[
            "link",
            "add",
            &srv_if,
            "netns",
            &pair.server,
            "type",
            "veth",
            "peer",
            "name",
            &cli_if,
            "netns",
            &pair.client,
        ]);
        for (ns, dev, addr) in [
            (&pair.server, &srv_if, SERVER_ADDR),
            (&pair.client, &cli_if, CLIENT_ADDR),
        ] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/30"), "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
        }
        pair
    }

    /// Lose `lost` of every thousand packets each end receives and duplicate `duplicated` of
    /// every thousand it sends, each drawn at random (nftables' `numgen random`, `dup to` the
    /// peer).
    pub fn lose_and_duplicate(&self, lost: u32, duplicated: u32) {
        for (ns, peer) in [(&self.server, CLIENT_ADDR), (&self.client, SERVER_ADDR)] {
            // A loss after the sender's TCP sent it (on arrival: a drop in the sender's own
            // output hook is only a failed send, which TCP retries at once, in order).
            for command in [
                "add table ip chaos".to_owned(),
                "add chain ip chaos in { type filter hook prerouting priority -300; policy accept; }"
                    .to_owned(),
                "add chain ip chaos out { type filter hook output priority 0; policy accept; }"
                    .to_owned(),
                format!("add rule ip chaos in numgen random mod 1000 < {lost} counter drop"),
                format!(
                    "add rule ip chaos out numgen random mod 1000 < {duplicated} counter dup to {peer}"
                ),
            ] {
                run_ok(Self::command(ns, "nft").arg(command));
            }
        }
    }

    /// The rules of namespace `ns` as nftables lists them, with their counters: how many
    /// packets that end lost and duplicated.
    pub fn ruleset(ns: &str) -> String {
        run_ok(Self::command(ns, "nft").args(["list", "ruleset"]))
    }

    /// TCP's own count of segments that arrived out of order at the sockets of namespace `ns`
    /// (`TcpExtTCPOFOQueue`), with what `nstat` printed.
    pub fn arrived_out_of_order(ns: &str) -> (Option<u64>, String) {
        let ofo = run_ok(Self::command(ns, "nstat").args(["-az", "TcpExtTCPOFOQueue"]));
        let count = ofo
            .lines()
            .find_map(|l| l.strip_prefix("TcpExtTCPOFOQueue"))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok());
        (count, ofo)
    }

    /// `program` with `args`, run in namespace `ns`.
    pub fn command(ns: &str, program: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", ns, program]);
        command
    }
}

impl Default for HostPair {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for HostPair {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the pair, and so the pair.
        for ns in [&self.server, &self.client] {
            let _ = Command::new("ip").args(["netns", "delete", ns]).status();
        }
    }
}

/// `ip ARGS`, to success.
fn ip(args: &[&str]) {
    run_ok(Command::new("ip").args(args));
}
