//! Data-path cost of the attached programs: requests per second through a keep-alive HTTP/1.1
//! server on loopback, driven by wrk, in three setups measured in rotating order within one
//! run: no programs; programs attached but the server's port not watched (the cost every other
//! socket on the node pays); programs attached and watching the server (every segment goes
//! through the turn state machine). Prints a markdown table and the median ratios. Then the
//! programs' own run time, from the kernel's statistics, in those two attached setups and
//! attached to another cgroup (`agent.attach_cgroups`), the traffic outside it: keep-alive, and
//! a new connection per request (whose state changes run the node-wide close tracepoint).
//! Last, in the same run, the HTTP/2 frame walk beside the HTTP/1.1 turns: nginx answering
//! both, h2load and wrk as the loads, each port not watched and watched.
//!
//! Usage: `datapath-bench [ROUNDS] [SECONDS] [CONNECTIONS] [KERNEL_ROUNDS]`   (defaults 10 5 16 5;
//! run as root; ROUNDS 0 skips the throughput table)

use std::time::Duration;

use retry_after_agent::kernel::{Floor, ProbeOptions, ProgramRunStats, find_cgroup2_root};
use retry_after_common::Side;
use retry_after_estimator::endpoint::Endpoint;
use retry_after_eval::bench::{self, median, pin_to_cpu};
use retry_after_testkit::{
    AttachedProbe, TestCgroup, free_port,
    http::{HttpServer, ServerOptions},
    proxies::Nginx,
};

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<u64>().expect("numeric argument"));
    let rounds = args.next().unwrap_or(10);
    let seconds = args.next().unwrap_or(5);
    let connections = args.next().unwrap_or(16);
    let kernel_rounds = args.next().unwrap_or(5);

    // The server (this process's threads) on CPU 0 and wrk on CPU 1: without pinning, the
    // scheduler's placement of 17 threads on 2 cores moves throughput by ±10% between runs,
    // more than the effect measured.
    pin_to_cpu(0);
    let server = HttpServer::start(
        "127.0.0.1:0",
        ServerOptions {
            response_body: 128,
            ..Default::default()
        },
    );
    let url = format!("http://{}/", server.addr());
    let endpoint = Endpoint::from(server.addr());

    // Warm up the server, the page cache and the CPU frequency.
    wrk(&url, 2, connections);

    throughput_table(&load(&url, seconds, connections), endpoint, rounds);
    println!();
    let kernel = measure_in_kernel_cost(&load(&url, seconds, connections), endpoint, kernel_rounds);
    report_in_kernel_cost(&kernel);
    println!();
    report_protocol_cost(&measure_protocol_cost(kernel_rounds, seconds, connections));
}

/// The load of one measurement at `url`.
fn load(url: &str, seconds: u64, connections: u64) -> Wrk<'_> {
    Wrk {
        url,
        seconds,
        connections,
    }
}

/// Throughput with no programs, attached and not watching, and watching, in `rounds` rounds
/// (the order rotating from round to round, so drift in the machine's speed favours none),
/// then the median ratios.
fn throughput_table(load: &Wrk<'_>, endpoint: Endpoint, rounds: u64) {
    println!(
        "| round | no programs (req/s) | attached, not watching (req/s) | attached, watching (req/s) | not watching / none | watching / none | requests counted |"
    );
    println!("|---|---|---|---|---|---|---|");
    let run = || wrk(load.url, load.seconds, load.connections);
    let (mut idle_ratios, mut watch_ratios) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let mut rps = [0.0; 3];
        let mut counted = 0;
        for step in 0..3 {
            let setup = (step + round as usize) % 3;
            rps[setup] = match setup {
                0 => run(),
                1 => {
                    let _probe = AttachedProbe::attach();
                    run()
                }
                _ => {
                    let probe = AttachedProbe::watching(&[endpoint]);
                    let result = run();
                    std::thread::sleep(Duration::from_millis(200));
                    counted = probe
                        .counters(endpoint, Side::Server)
                        .counters
                        .requests_started;
                    result
                }
            };
        }
        idle_ratios.push(rps[1] / rps[0]);
        watch_ratios.push(rps[2] / rps[0]);
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.4} | {:.4} | {} |",
            round + 1,
            rps[0],
            rps[1],
            rps[2],
            rps[1] / rps[0],
            rps[2] / rps[0],
            counted
        );
    }
    if rounds > 0 {
        let (idle, watch) = (median(idle_ratios), median(watch_ratios));
        println!();
        println!(
            "{rounds} rounds of {} s, {} connections; median ratios:",
            load.seconds, load.connections
        );
        println!(
            "attached, not watching / no programs: {idle:.4} ({:+.2}% throughput)",
            (idle - 1.0) * 100.0
        );
        println!(
            "attached, watching / no programs:     {watch:.4} ({:+.2}% throughput)",
            (watch - 1.0) * 100.0
        );
    }
}

/// The programs' own run time per request, from the kernel's run-time statistics (enabled for
/// this measurement only: they add two clock reads per run). In each of `rounds` rounds the
/// same load is run with the port not watched (the early-exit path: what every other socket
/// pays) and watched, in alternating order; the difference is the cost of the turn state
/// machine and counters, free of the statistics' own overhead. Two more setups attach the
/// programs to an empty cgroup and watch the port: the traffic, outside that cgroup, runs none
/// of the socket programs; with a new connection per request it still runs the close
/// tracepoint, which sees every TCP state change of the node. See [`report_in_kernel_cost`].
fn measure_in_kernel_cost(load: &Wrk<'_>, endpoint: Endpoint, rounds: u64) -> InKernelCost {
    let _stats =
        aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("enable BPF run-time stats");
    let elsewhere = TestCgroup::create("retry-after-bench-elsewhere");
    let mut measured: Vec<[Measured; SETUPS]> = Vec::new();
    for round in 0..rounds as usize {
        let mut setups = [Measured::default(); SETUPS];
        // In a different order each round.
        for step in 0..SETUPS {
            let setup = (step + round) % SETUPS;
            setups[setup] = measure(setup, endpoint, &elsewhere, load);
        }
        measured.push(setups);
    }
    InKernelCost {
        rounds,
        seconds: load.seconds,
        measured,
    }
}

/// What [`measure_in_kernel_cost`] measured: each round's setups.
struct InKernelCost {
    rounds: u64,
    seconds: u64,
    /// One entry per round, indexed by setup (`NOT_WATCHING` ...).
    measured: Vec<[Measured; SETUPS]>,
}

/// Print the in-kernel cost: each round, then the median and the spread (lowest to highest)
/// of each figure.
fn report_in_kernel_cost(cost: &InKernelCost) {
    let InKernelCost {
        rounds,
        seconds,
        measured,
    } = cost;
    let lines: Vec<String> = measured.iter().enumerate().map(round_row).collect();
    let rows = in_kernel_summary(measured);
    println!(
        "In-kernel cost (BPF run-time statistics on), {rounds} rounds of {seconds} s:\n\n\
         | round | req/s, not watching | req/s, watching | req/s, attached elsewhere | ns per run, not watching | ns per run, watching | program ns per request, not watching | program ns per request, watching | marginal ns per request | runs per request, watching | runs per request, attached elsewhere | program ns per request, attached elsewhere | req/s, attached elsewhere, new connections | runs per request, attached elsewhere, new connections | program ns per request, attached elsewhere, new connections | ns per run, floor | watched run / floor run | watched request / four floor runs |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n{}\n\n\
         | figure | median | spread |\n|---|---|---|\n{}",
        lines.join("\n"),
        rows.join("\n"),
    );
}

/// The in-kernel cost's figures over the rounds: one table row each, its median and spread.
fn in_kernel_summary(measured: &[[Measured; SETUPS]]) -> [String; 12] {
    let figure = |setup: usize, of: fn(&Measured) -> f64| -> Vec<f64> {
        measured.iter().map(|m| of(&m[setup])).collect()
    };
    let marginal: Vec<f64> = measured
        .iter()
        .map(|m| m[WATCHING].per_request - m[NOT_WATCHING].per_request)
        .collect();
    [
        summary(
            0,
            "ns per run, not watching",
            &figure(NOT_WATCHING, |m| m.per_run),
        ),
        summary(0, "ns per run, watching", &figure(WATCHING, |m| m.per_run)),
        summary(
            0,
            "program ns per request, not watching",
            &figure(NOT_WATCHING, |m| m.per_request),
        ),
        summary(
            0,
            "program ns per request, watching",
            &figure(WATCHING, |m| m.per_request),
        ),
        summary(
            0,
            "marginal ns per request (watching − not watching)",
            &marginal,
        ),
        summary(
            2,
            "program runs per request, attached elsewhere",
            &figure(ELSEWHERE, |m| m.runs_per_request),
        ),
        summary(
            0,
            "program ns per request, attached elsewhere",
            &figure(ELSEWHERE, |m| m.per_request),
        ),
        summary(
            2,
            "program runs per request, attached elsewhere, new connections",
            &figure(ELSEWHERE_NEW_CONNECTIONS, |m| m.runs_per_request),
        ),
        summary(
            0,
            "program ns per request, attached elsewhere, new connections",
            &figure(ELSEWHERE_NEW_CONNECTIONS, |m| m.per_request),
        ),
        summary(0, "ns per run, floor", &figure(FLOOR, |m| m.per_run)),
        summary(
            2,
            "watched run / floor run",
            &measured
                .iter()
                .map(|m| m[WATCHING].per_run / m[FLOOR].per_run)
                .collect::<Vec<_>>(),
        ),
        summary(
            2,
            "watched request (both ends) / four floor runs",
            &measured
                .iter()
                .map(|m| watched_request_over_floor(&m[WATCHING], &m[FLOOR]))
                .collect::<Vec<_>>(),
        ),
    ]
}

/// The setups of a round: attached and not watching, watching, attached to an empty cgroup
/// and watching (keep-alive), the same with a new connection per request, and the floor (the
/// same two hooks with programs that return at once, attached where the programs are).
const NOT_WATCHING: usize = 0;
const WATCHING: usize = 1;
const ELSEWHERE: usize = 2;
const ELSEWHERE_NEW_CONNECTIONS: usize = 3;
const FLOOR: usize = 4;
const SETUPS: usize = 5;

/// The load of each measurement.
struct Wrk<'a> {
    url: &'a str,
    seconds: u64,
    connections: u64,
}

/// What one setup measured.
#[derive(Clone, Copy, Debug, Default)]
struct Measured {
    rps: f64,
    per_run: f64,
    per_request: f64,
    runs_per_request: f64,
}

/// Attach as `setup` says, run the load, read the programs' run-time statistics.
fn measure(setup: usize, endpoint: Endpoint, elsewhere: &TestCgroup, load: &Wrk<'_>) -> Measured {
    let programs = match setup {
        FLOOR => Programs::floor(),
        NOT_WATCHING => Programs::Probe(Box::new(AttachedProbe::attach())),
        WATCHING => Programs::Probe(Box::new(AttachedProbe::watching(&[endpoint]))),
        _ => {
            let mut probe = AttachedProbe::attach_with(&ProbeOptions {
                attach_to: vec![elsewhere.path().to_path_buf()],
                ..ProbeOptions::default()
            });
            probe.watch(endpoint);
            Programs::Probe(Box::new(probe))
        }
    };
    let rps = if setup == ELSEWHERE_NEW_CONNECTIONS {
        wrk_closing(load.url, load.seconds, load.connections)
    } else {
        wrk(load.url, load.seconds, load.connections)
    };
    programs.measured(rps, rps * load.seconds as f64)
}

/// What one setup attached: the agent's programs, or the floor's.
enum Programs {
    Probe(Box<AttachedProbe>),
    Floor(Floor),
}

impl Programs {
    /// The floor, attached to the cgroup v2 root (where the agent attaches by default).
    fn floor() -> Self {
        let root = find_cgroup2_root().expect("a cgroup v2 hierarchy");
        Self::Floor(Floor::attach(&root).expect("attach the floor programs (run as root)"))
    }

    /// The programs' run-time statistics, for `requests` requests at `rps`.
    fn measured(&self, rps: f64, requests: f64) -> Measured {
        let stats = match self {
            Self::Probe(probe) => probe.probe.program_run_stats(),
            Self::Floor(floor) => floor.program_run_stats(),
        };
        measured(&stats, rps, requests)
    }
}

/// Run-time statistics `stats`, for `requests` requests at `rps`.
fn measured(stats: &[ProgramRunStats], rps: f64, requests: f64) -> Measured {
    let (runs, nanos) = stats.iter().fold((0u64, 0u128), |(r, n), s| {
        (r + s.run_count, n + s.run_time.as_nanos())
    });
    Measured {
        rps,
        per_run: nanos as f64 / runs.max(1) as f64,
        per_request: nanos as f64 / requests,
        runs_per_request: runs as f64 / requests,
    }
}

/// The HTTP/2 frame walk's cost beside the HTTP/1.1 turns', on one server: nginx (one
/// worker, on CPU 0 with this process) answering HTTP/1.1 on one port, driven by wrk, and
/// cleartext HTTP/2 on another, driven by h2load (`connections` connections, 8 streams at once
/// on each); each with the floor attached, then the programs with the port not watched, then
/// watched (both ends, as above), in rotating order, `rounds` rounds of `seconds` s. A request
/// of HTTP/2 is a stream. See [`report_protocol_cost`].
fn measure_protocol_cost(rounds: u64, seconds: u64, connections: u64) -> ProtocolCost {
    let _stats =
        aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("enable BPF run-time stats");
    let (h1, h2) = (free_port(), free_port());
    let _nginx = Nginx::start(&format!(
        "  server {{ listen {h1}; keepalive_requests 1000000; location / {{ return 200 \"ok\\n\"; }} }}\n  \
         server {{ listen {h2} http2; http2_max_concurrent_streams 128; keepalive_requests 1000000; \
         location / {{ return 200 \"ok\\n\"; }} }}"
    ));
    let (h1_url, h2_url) = (format!("http://{h1}/"), format!("http://{h2}/"));
    let endpoints = [Endpoint::from(h1), Endpoint::from(h2)];
    let mut measured: Vec<[Measured; PROTOCOL_SETUPS]> = Vec::new();
    for round in 0..rounds as usize {
        let mut row = [Measured::default(); PROTOCOL_SETUPS];
        for step in 0..PROTOCOL_SETUPS {
            let setup = (step + round) % PROTOCOL_SETUPS;
            let (protocol, mode) = (setup / MODES.len(), setup % MODES.len());
            let endpoint = endpoints[protocol];
            let programs = match mode {
                0 => Programs::floor(),
                1 => Programs::Probe(Box::new(AttachedProbe::attach())),
                _ => Programs::Probe(Box::new(AttachedProbe::watching(&[endpoint]))),
            };
            let (rps, requests) = if protocol == 0 {
                let rps = wrk(&h1_url, seconds, connections);
                (rps, rps * seconds as f64)
            } else {
                h2load_for(&h2_url, seconds, connections)
            };
            row[setup] = programs.measured(rps, requests);
        }
        measured.push(row);
    }
    ProtocolCost {
        rounds,
        seconds,
        connections,
        measured,
    }
}

/// The protocols [`measure_protocol_cost`] loads, in the order of its setups.
const PROTOCOLS: [&str; 2] = ["HTTP/1.1", "HTTP/2"];
/// What each protocol's setups attach, in order: the floor, the programs with the port not
/// watched, the programs watching it.
const MODES: [&str; 3] = ["floor", "not watching", "watching"];
/// Setups per round of the protocol cost: each protocol in each mode.
const PROTOCOL_SETUPS: usize = PROTOCOLS.len() * MODES.len();

/// What [`measure_protocol_cost`] measured: each round's setups.
struct ProtocolCost {
    rounds: u64,
    seconds: u64,
    connections: u64,
    /// One entry per round, indexed by setup (protocol × 3 + mode).
    measured: Vec<[Measured; PROTOCOL_SETUPS]>,
}

/// Print the protocol cost: each round, then the median and spread of each figure.
fn report_protocol_cost(cost: &ProtocolCost) {
    let ProtocolCost {
        rounds,
        seconds,
        connections,
        measured,
    } = cost;
    let names: Vec<String> = PROTOCOLS
        .iter()
        .flat_map(|protocol| MODES.iter().map(move |mode| format!("{protocol}, {mode}")))
        .collect();
    let lines: Vec<String> = measured
        .iter()
        .enumerate()
        .map(|(round, m)| {
            let cells: Vec<String> = m
                .iter()
                .map(|x| {
                    format!(
                        "{:.0} | {:.0} | {:.0} | {:.1}",
                        x.rps, x.per_run, x.per_request, x.runs_per_request
                    )
                })
                .collect();
            format!("| {} | {} |", round + 1, cells.join(" | "))
        })
        .collect();
    let rows = protocol_summary(measured, &names);
    let header: Vec<String> = names
        .iter()
        .map(|name| {
            format!("req/s, {name} | ns per run, {name} | program ns per request, {name} | runs per request, {name}")
        })
        .collect();
    println!(
        "HTTP/1.1 (wrk) and HTTP/2 (h2load, 8 streams at once per connection) through nginx, \
         {rounds} rounds of {seconds} s, {connections} connections:\n\n\
         | round | {} |\n|---|{}\n{}\n\n| figure | median | spread |\n|---|---|---|\n{}",
        header.join(" | "),
        "---|".repeat(24),
        lines.join("\n"),
        rows.join("\n"),
    );
}

/// The protocol cost's figures over the rounds, per setup then per protocol: one table row
/// each, its median and spread.
fn protocol_summary(measured: &[[Measured; PROTOCOL_SETUPS]], names: &[String]) -> Vec<String> {
    let figure = |of: &dyn Fn(&[Measured; PROTOCOL_SETUPS]) -> f64| -> Vec<f64> {
        measured.iter().map(of).collect()
    };
    let mut rows = Vec::new();
    for (setup, name) in names.iter().enumerate() {
        rows.push(summary(
            0,
            &format!("ns per run, {name}"),
            &figure(&|m| m[setup].per_run),
        ));
        rows.push(summary(
            0,
            &format!("program ns per request, {name}"),
            &figure(&|m| m[setup].per_request),
        ));
        rows.push(summary(
            1,
            &format!("program runs per request, {name}"),
            &figure(&|m| m[setup].runs_per_request),
        ));
    }
    for (protocol, name) in PROTOCOLS.iter().enumerate() {
        let [floor, idle, watch] = [3 * protocol, 3 * protocol + 1, 3 * protocol + 2];
        rows.push(summary(
            0,
            &format!("marginal ns per request, {name} (watching − not watching)"),
            &figure(&|m| m[watch].per_request - m[idle].per_request),
        ));
        rows.push(summary(
            2,
            &format!("watched run / floor run, {name}"),
            &figure(&|m| m[watch].per_run / m[floor].per_run),
        ));
        rows.push(summary(
            2,
            &format!("watched request / four floor runs, {name}"),
            &figure(&|m| watched_request_over_floor(&m[watch], &m[floor])),
        ));
    }
    rows
}

/// One round's row of the table.
fn round_row((round, m): (usize, &[Measured; SETUPS])) -> String {
    let [idle, watch, elsewhere, churn, floor] = m;
    format!(
        "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.2} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} | {:.2} | {:.2} |",
        round + 1,
        idle.rps,
        watch.rps,
        elsewhere.rps,
        idle.per_run,
        watch.per_run,
        idle.per_request,
        watch.per_request,
        watch.per_request - idle.per_request,
        watch.runs_per_request,
        elsewhere.runs_per_request,
        elsewhere.per_request,
        churn.rps,
        churn.runs_per_request,
        churn.per_request,
        floor.per_run,
        watch.per_run / floor.per_run,
        watched_request_over_floor(watch, floor),
    )
}

/// A watched request's program time (both ends) over four runs of the floor: the issue's
/// yardstick, a request being four runs (each direction seen leaving and arriving).
fn watched_request_over_floor(watch: &Measured, floor: &Measured) -> f64 {
    watch.per_request / (4.0 * floor.per_run)
}

/// A figure's median and spread (lowest to highest), with `digits` decimals.
fn summary(digits: usize, name: &str, values: &[f64]) -> String {
    let (low, high) = bench::spread(values);
    format!(
        "| {name} | {:.digits$} | {low:.digits$} to {high:.digits$} |",
        median(values.to_vec())
    )
}

/// Requests per second that wrk reports for one run (wrk runs on CPU 1).
fn wrk(url: &str, seconds: u64, connections: u64) -> f64 {
    bench::wrk(url, seconds, connections as u32, &[]).rps
}

/// [`wrk`] with `Connection: close` on every request: a new connection per request.
fn wrk_closing(url: &str, seconds: u64, connections: u64) -> f64 {
    bench::wrk(
        url,
        seconds,
        connections as u32,
        &["-H", "Connection: close"],
    )
    .rps
}

/// h2load for `seconds` s on CPU 1 (one thread, `connections` connections, 8 streams at once
/// on each): requests per second, and requests done.
fn h2load_for(url: &str, seconds: u64, connections: u64) -> (f64, f64) {
    let done = bench::h2load(url, seconds, connections as u32, 8);
    (done.rps, done.requests)
}
