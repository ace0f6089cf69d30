//! What watching costs the traffic watched, end to end: nginx and HAProxy answering flat out
//! on loopback (each its own one worker, on CPU 0; the load on CPU 1), HTTP/1.1 by wrk (64
//! connections), a chunked body (nginx's gzip) by wrk, and HTTP/2 by h2load (4 connections ×
//! 128 streams), each in cleartext and over TLS. In each round every cell is measured with
//! no agent, with the agent watching its port on both ends of every connection (attached at
//! the cgroup root: the client is on the node too, a node's worst case), and on one end (the
//! agent attached to the servers' cgroup only), in an order that rotates from round to round.
//! The agent is the real daemon, started for each measurement. Prints, per cell, the median
//! requests a second of each setup and the loss against no agent (median and spread over the
//! rounds); then, with the kernel's run-time statistics on, each plaintext cell's program time
//! per request with the agent (and BEFORE, if given) watching both ends against the empty
//! programs on the same hooks
//! (`ra_floor_in`, `ra_floor_out`) under the same load.
//!
//! Usage: `loss-bench [ROUNDS] [SECONDS] [BEFORE] [PROGRAM_ROUNDS]` (defaults 5 4 '' 3; as root
//! after `./dev setup`, the agent built: `cargo build --release -p retry-after-agent`; ROUNDS 0
//! skips the throughput table). BEFORE: another build of the agent, measured beside this one
//! in the same rounds (both ends, and one end), and in the program time.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

use retry_after_agent::kernel::{FLOOR_PROGRAM_NAMES, Floor, find_cgroup2_root};
use retry_after_eval::bench::{Done, h2load, median, pin_to_cpu, spread, wrk};
use retry_after_testkit::{
    AGENT_TICK_MS, AgentProcess, Launch, TestCgroup, endpoint_total, free_port,
    proxies::{Haproxy, Nginx, self_signed_certificate},
    require_root,
};

/// wrk's connections, and h2load's connections and streams at once on each.
const WRK_CONNECTIONS: u32 = 64;
const H2_CONNECTIONS: u32 = 4;
const H2_STREAMS: u32 = 128;

/// The software answering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Server {
    Nginx,
    Haproxy,
}

/// What the load asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wire {
    /// HTTP/1.1, a 3-byte body with a length.
    Http1,
    /// HTTP/1.1, a 4 KiB body gzipped on the fly: chunked transfer coding.
    Chunked,
    /// HTTP/2, one stream a request.
    H2,
}

/// One line of the table: a server, a wire, in cleartext or TLS, on its own port.
#[derive(Clone, Copy, Debug)]
struct Cell {
    server: Server,
    wire: Wire,
    tls: bool,
    addr: SocketAddr,
}

impl Cell {
    fn name(&self) -> String {
        let wire = match self.wire {
            Wire::Http1 => "HTTP/1.1",
            Wire::Chunked => "HTTP/1.1 chunked",
            Wire::H2 if self.tls => "HTTP/2",
            Wire::H2 => "h2c",
        };
        let tls = if self.tls { ", TLS" } else { "" };
        format!("{:?}, {wire}{tls}", self.server)
    }

    fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        let path = if self.wire == Wire::Chunked {
            "gzip"
        } else {
            ""
        };
        format!("{scheme}://{}/{path}", self.addr)
    }

    /// Run the cell's load for `seconds`.
    fn load(&self, seconds: u64) -> Done {
        let url = self.url();
        match self.wire {
            Wire::H2 => h2load(&url, seconds, H2_CONNECTIONS, H2_STREAMS),
            Wire::Http1 => wrk(&url, seconds, WRK_CONNECTIONS, &[]),
            Wire::Chunked => wrk(
                &url,
                seconds,
                WRK_CONNECTIONS,
                &["-H", "Accept-Encoding: gzip"],
            ),
        }
    }
}

/// What a measurement runs beside the load.
#[derive(Clone, Debug)]
enum Setup {
    None,
    /// An agent (this build: `None`; another's path) watching both ends, or only the servers'.
    Agent {
        binary: Option<PathBuf>,
        both_ends: bool,
    },
}

impl Setup {
    fn name(&self) -> String {
        match self {
            Self::None => "no agent".to_owned(),
            Self::Agent { binary, both_ends } => format!(
                "{}, {}",
                build_name(binary),
                if *both_ends { "both ends" } else { "one end" }
            ),
        }
    }
}

/// A build of the agent in the tables: this one (`None`), or the earlier one given.
fn build_name(binary: &Option<PathBuf>) -> &'static str {
    if binary.is_some() { "before" } else { "agent" }
}

/// The servers of every cell, running while the bench lasts, in one cgroup.
struct Servers {
    _nginx: Nginx,
    _haproxy: Haproxy,
    cgroup: TestCgroup,
    cells: Vec<Cell>,
}

fn main() {
    require_root();
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().map_or(5, |a| a.parse().expect("ROUNDS"));
    let seconds: u64 = args.next().map_or(4, |a| a.parse().expect("SECONDS"));
    let before = args.next().filter(|a| !a.is_empty()).map(PathBuf::from);
    let program_rounds: usize = args
        .next()
        .map_or(3, |a| a.parse().expect("PROGRAM_ROUNDS"));
    pin_to_cpu(0);
    let servers = Servers::start();
    let builds: Vec<Option<PathBuf>> = std::iter::once(None).chain(before.map(Some)).collect();
    let mut setups = vec![Setup::None];
    for binary in &builds {
        for both_ends in [true, false] {
            setups.push(Setup::Agent {
                binary: binary.clone(),
                both_ends,
            });
        }
    }
    for cell in &servers.cells {
        cell.load(1);
    }
    if rounds > 0 {
        let measured = throughput(&servers, &setups, rounds, seconds);
        print_loss(&servers.cells, &setups, &measured, rounds, seconds);
        println!();
    }
    print_program_time(&servers, &builds, program_rounds, seconds);
}

impl Servers {
    /// nginx and HAProxy, one worker each, answering every cell's port.
    fn start() -> Self {
        let cgroup = TestCgroup::create("retry-after-loss-bench");
        let (cert, key) = self_signed_certificate();
        let site = cert.parent().unwrap().join("site");
        std::fs::create_dir_all(&site).unwrap();
        let body: String = (0..4096).map(|i| (b'a' + (i % 26) as u8) as char).collect();
        std::fs::write(site.join("gzip"), body).unwrap();
        let pem = cert.with_file_name("both.pem");
        let both =
            std::fs::read_to_string(&cert).unwrap() + &std::fs::read_to_string(&key).unwrap();
        std::fs::write(&pem, both).unwrap();
        let mut cells = Vec::new();
        for (server, wires) in [
            (Server::Nginx, &[Wire::Http1, Wire::Chunked, Wire::H2][..]),
            (Server::Haproxy, &[Wire::Http1, Wire::H2][..]),
        ] {
            for tls in [false, true] {
                for &wire in wires {
                    let addr = free_port();
                    cells.push(Cell {
                        server,
                        wire,
                        tls,
                        addr,
                    });
                }
            }
        }
        let nginx = Nginx::start_in(
            &nginx_servers(&cells, (&cert, &key), &site),
            Some(cgroup.path()),
        );
        let haproxy = Haproxy::start_with_global(
            "    nbthread 1\n",
            &haproxy_frontends(&cells, &pem),
            Some(cgroup.path()),
        );
        Self {
            _nginx: nginx,
            _haproxy: haproxy,
            cgroup,
            cells,
        }
    }

    /// The agent's configuration: every cell's port a backend of one service, attached at the
    /// root (both ends) or to the servers' cgroup (one end).
    fn agent(&self, binary: Option<PathBuf>, both_ends: bool) -> AgentProcess {
        let backends: Vec<String> = self
            .cells
            .iter()
            .map(|c| format!("{{ address = \"{}\" }}", c.addr))
            .collect();
        let services = format!(
            "[[service]]\nname = \"bench\"\nbackends = [{}]\n",
            backends.join(", ")
        );
        let lines = if both_ends {
            String::new()
        } else {
            format!("attach_cgroups = [\"{}\"]\n", self.cgroup.path().display())
        };
        AgentProcess::start_with(
            &lines,
            &services,
            Launch {
                binary,
                ..Launch::default()
            },
        )
    }
}

/// nginx's server blocks: a length, a gzipped file (chunked), HTTP/2; cleartext and TLS.
fn nginx_servers(cells: &[Cell], (cert, key): (&Path, &Path), site: &Path) -> String {
    let keep = "keepalive_requests 10000000; keepalive_timeout 60s;";
    cells
        .iter()
        .filter(|c| c.server == Server::Nginx)
        .map(|c| {
            let listen = match (c.wire, c.tls) {
                (Wire::H2, true) => "ssl http2",
                (Wire::H2, false) => "http2",
                (_, true) => "ssl",
                (_, false) => "",
            };
            let tls = if c.tls {
                format!(
                    "ssl_certificate {}; ssl_certificate_key {};",
                    cert.display(),
                    key.display()
                )
            } else {
                String::new()
            };
            format!(
                "  server {{ listen {} {listen}; {tls} {keep} http2_max_concurrent_streams 128; \
                 location / {{ return 200 \"ok\\n\"; }} \
                 location /gzip {{ alias {}/gzip; default_type text/plain; gzip on; gzip_types *; \
                 gzip_comp_level 1; gzip_min_length 0; }} }}\n",
                c.addr,
                site.display()
            )
        })
        .collect()
}

/// HAProxy's frontends, each answering itself: HTTP/1.1 and HTTP/2, cleartext and TLS.
fn haproxy_frontends(cells: &[Cell], pem: &Path) -> String {
    cells
        .iter()
        .filter(|c| c.server == Server::Haproxy)
        .enumerate()
        .map(|(i, c)| {
            let bind = match (c.wire, c.tls) {
                (Wire::H2, true) => format!("ssl crt {} alpn h2", pem.display()),
                (Wire::H2, false) => "proto h2".to_owned(),
                (_, true) => format!("ssl crt {} alpn http/1.1", pem.display()),
                (_, false) => String::new(),
            };
            format!(
                "frontend bench{i}\n    bind {} {bind}\n    http-request return status 200 \
                 content-type text/plain string ok\n",
                c.addr
            )
        })
        .collect()
}

/// Requests a second, per round, cell and setup (in that order of indices).
type Measured = Vec<Vec<Vec<f64>>>;

/// Every cell under every setup, `rounds` rounds of `seconds` s, the setups' order rotating.
fn throughput(servers: &Servers, setups: &[Setup], rounds: usize, seconds: u64) -> Measured {
    let mut measured = vec![vec![vec![0.0; setups.len()]; servers.cells.len()]; rounds];
    for (round, row) in measured.iter_mut().enumerate() {
        for step in 0..setups.len() {
            let s = (step + round) % setups.len();
            let agent = match &setups[s] {
                Setup::None => None,
                Setup::Agent { binary, both_ends } => {
                    Some(servers.agent(binary.clone(), *both_ends))
                }
            };
            for (c, cell) in servers.cells.iter().enumerate() {
                row[c][s] = cell.load(seconds).rps;
                if let Some(agent) = &agent {
                    watched(agent, cell, &setups[s]);
                }
            }
        }
        eprintln!("round {} of {rounds} done", round + 1);
    }
    measured
}

/// Fail unless `agent` counted requests at `cell`'s port on the server's side: a setup that
/// watched nothing would measure nothing.
fn watched(agent: &AgentProcess, cell: &Cell, setup: &Setup) {
    std::thread::sleep(std::time::Duration::from_millis(2 * AGENT_TICK_MS));
    let started = endpoint_total(&agent.metrics(), "requests_started", cell.addr, "server");
    assert!(
        started > 0,
        "{}: {} counted no request",
        cell.name(),
        setup.name()
    );
}

/// The loss table: per cell, each setup's median requests a second, and each agent setup's
/// loss against no agent (median of the rounds' ratios, and their spread).
fn print_loss(cells: &[Cell], setups: &[Setup], measured: &Measured, rounds: usize, seconds: u64) {
    let agents: Vec<&Setup> = setups[1..].iter().collect();
    let head: Vec<String> = setups
        .iter()
        .map(|s| format!("req/s, {}", s.name()))
        .collect();
    let losses: Vec<String> = agents
        .iter()
        .map(|s| format!("loss, {} (spread)", s.name()))
        .collect();
    println!(
        "Throughput, {rounds} rounds of {seconds} s, setups in rotating order (wrk {WRK_CONNECTIONS} connections; h2load {H2_CONNECTIONS} × {H2_STREAMS} streams):\n"
    );
    println!("| cell | {} | {} |", head.join(" | "), losses.join(" | "));
    println!("|---|{}", "---:|".repeat(head.len() + losses.len()));
    for (c, cell) in cells.iter().enumerate() {
        let of = |s: usize| -> Vec<f64> { measured.iter().map(|r| r[c][s]).collect() };
        let rps: Vec<String> = (0..setups.len())
            .map(|s| format!("{:.0}", median(of(s))))
            .collect();
        let loss: Vec<String> = (1..setups.len())
            .map(|s| {
                let l: Vec<f64> = measured
                    .iter()
                    .map(|r| 100.0 * (1.0 - r[c][s] / r[c][0]))
                    .collect();
                let (lo, hi) = spread(&l);
                format!("{:.1}% ({lo:.1} to {hi:.1})", median(l.clone()))
            })
            .collect();
        println!(
            "| {} | {} | {} |",
            cell.name(),
            rps.join(" | "),
            loss.join(" | ")
        );
    }
}

/// Program time per request with both ends watched, each plaintext cell: the floor and each
/// build of the agent in `builds` (`None`: this one), `rounds` rounds in rotating order. Each
/// build's nanoseconds a request of all its programs, and that over the floor's two.
fn print_program_time(servers: &Servers, builds: &[Option<PathBuf>], rounds: usize, seconds: u64) {
    let _stats =
        aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("enable BPF run-time stats");
    let head: Vec<String> = builds
        .iter()
        .map(build_name)
        .map(|n| format!("{n} ns per request | {n} / floor (spread) | {n} runs per request"))
        .collect();
    println!(
        "Program time per request (BPF run-time statistics on), {rounds} rounds of {seconds} s, both ends watched:\n"
    );
    println!("| cell | floor ns per request | {} |", head.join(" | "));
    println!("|---|---:|{}", "---:|---:|---:|".repeat(builds.len()));
    for cell in servers.cells.iter().filter(|c| !c.tls) {
        let measured = program_rounds(servers, cell, builds, rounds, seconds);
        let floor: Vec<f64> = measured.iter().map(|m| m[0].0).collect();
        let cells: Vec<String> = (1..=builds.len())
            .map(|b| {
                let ratio: Vec<f64> = measured.iter().map(|m| m[b].0 / m[0].0).collect();
                let (lo, hi) = spread(&ratio);
                format!(
                    "{:.0} | {:.2} ({lo:.2} to {hi:.2}) | {:.1}",
                    median(measured.iter().map(|m| m[b].0).collect()),
                    median(ratio.clone()),
                    median(measured.iter().map(|m| m[b].1).collect()),
                )
            })
            .collect();
        println!(
            "| {} | {:.0} | {} |",
            cell.name(),
            median(floor),
            cells.join(" | ")
        );
    }
}

/// `cell` under the floor (index 0) and each of `builds` (from 1), `rounds` rounds in
/// rotating order: (ns a request, runs a request) per round and setup.
fn program_rounds(
    servers: &Servers,
    cell: &Cell,
    builds: &[Option<PathBuf>],
    rounds: usize,
    seconds: u64,
) -> Vec<Vec<(f64, f64)>> {
    let setups = builds.len() + 1;
    (0..rounds)
        .map(|round| {
            let mut row = vec![(0.0, 0.0); setups];
            for step in 0..setups {
                let s = (step + round) % setups;
                row[s] = if s == 0 {
                    let root = find_cgroup2_root().expect("a cgroup v2 hierarchy");
                    let floor = Floor::attach(&root).expect("attach the floor programs");
                    program_time(cell, seconds, || {
                        let stats = floor.program_run_stats();
                        stats.iter().fold((0, 0), |(t, n), s| {
                            (t + s.run_time.as_nanos(), n + s.run_count)
                        })
                    })
                } else {
                    let _agent = servers.agent(builds[s - 1].clone(), true);
                    program_time(cell, seconds, agent_run_stats)
                };
            }
            row
        })
        .collect()
}

/// The run time (ns) and runs, summed, of the loaded programs the agent's process holds: ours
/// by their prefix, the floor's left out.
fn agent_run_stats() -> (u128, u64) {
    aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter(|p| {
            p.name_as_str()
                .is_some_and(|n| n.starts_with("ra_") && !FLOOR_PROGRAM_NAMES.contains(&n))
        })
        .fold((0, 0), |(t, n), p| {
            (t + p.run_time().as_nanos(), n + p.run_count())
        })
}

/// Run `cell`'s load, reading the programs' summed run time (ns) and runs by `read` before
/// and after: their run time per request completed, and their runs per request.
fn program_time(cell: &Cell, seconds: u64, read: impl Fn() -> (u128, u64)) -> (f64, f64) {
    let (t0, n0) = read();
    let requests = cell.load(seconds).requests;
    let (t1, n1) = read();
    ((t1 - t0) as f64 / requests, (n1 - n0) as f64 / requests)
}
