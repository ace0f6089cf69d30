//! Data-path cost of the attached programs: requests per second through a keep-alive HTTP/1.1
//! server on loopback, driven by wrk, in three setups measured in rotating order within one
//! run: no programs; programs attached but the server's port not watched (the cost every other
//! socket on the node pays); programs attached and watching the server (every segment goes
//! through the turn state machine). Prints a markdown table and the median ratios.
//!
//! Usage: datapath-bench [ROUNDS] [SECONDS] [CONNECTIONS]   (defaults 10 5 16; run as root)

use std::{process::Command, time::Duration};

use retry_after_agent::endpoint::Endpoint;
use retry_after_common::Side;
use retry_after_integration_tests::{
    AttachedProbe,
    http::{HttpServer, ServerOptions},
};

fn main() {
    let mut args = std::env::args()
        .skip(1)
        .map(|a| a.parse::<u64>().expect("numeric argument"));
    let rounds = args.next().unwrap_or(10);
    let seconds = args.next().unwrap_or(5);
    let connections = args.next().unwrap_or(16);

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

    println!(
        "| round | no programs (req/s) | attached, not watching (req/s) | attached, watching (req/s) | not watching / none | watching / none | requests counted |"
    );
    println!("|---|---|---|---|---|---|---|");
    let (mut idle_ratios, mut watch_ratios) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // Rotate the order of the setups from round to round, so drift in the machine's speed
        // does not favour one of them.
        let mut rps = [0.0; 3];
        let mut counted = 0;
        for step in 0..3 {
            let setup = (step + round as usize) % 3;
            rps[setup] = match setup {
                0 => wrk(&url, seconds, connections),
                1 => {
                    let _probe = AttachedProbe::attach();
                    wrk(&url, seconds, connections)
                }
                _ => {
                    let probe = AttachedProbe::watching(&[endpoint]);
                    let result = wrk(&url, seconds, connections);
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
    let (idle, watch) = (median(idle_ratios), median(watch_ratios));
    let in_kernel = in_kernel_cost(&url, endpoint, seconds, connections);
    println!();
    println!("{rounds} rounds of {seconds} s, {connections} connections; median ratios:");
    println!(
        "attached, not watching / no programs: {idle:.4} ({:+.2}% throughput)",
        (idle - 1.0) * 100.0
    );
    println!(
        "attached, watching / no programs:     {watch:.4} ({:+.2}% throughput)",
        (watch - 1.0) * 100.0
    );
    println!();
    println!("{in_kernel}");
}

/// The programs' own run time per request, from the kernel's run-time statistics (enabled for
/// this measurement only: they add two clock reads per run). The same load is run with the
/// port not watched (the early-exit path) and watched; the difference is the cost of the turn
/// state machine and counters, free of the statistics' own overhead.
fn in_kernel_cost(url: &str, endpoint: Endpoint, seconds: u64, connections: u64) -> String {
    let _stats =
        aya::sys::enable_stats(aya::sys::Stats::RunTime).expect("enable BPF run-time stats");
    let mut per_request_ns = [0.0; 2];
    let mut watching_rps = 0.0;
    let mut lines = Vec::new();
    for (i, watching) in [false, true].into_iter().enumerate() {
        let probe = if watching {
            AttachedProbe::watching(&[endpoint])
        } else {
            AttachedProbe::attach()
        };
        let rps = wrk(url, seconds, connections);
        let requests = rps * seconds as f64;
        let stats = probe.probe.program_run_stats();
        let (runs, nanos) = stats.iter().fold((0u64, 0u128), |(r, n), s| {
            (r + s.run_count, n + s.run_time.as_nanos())
        });
        per_request_ns[i] = nanos as f64 / requests;
        if watching {
            watching_rps = rps;
        }
        lines.push(format!(
            "| {} | {:.0} | {:.1} | {:.0} | {:.0} |",
            if watching { "watching" } else { "not watching" },
            rps,
            runs as f64 / requests,
            nanos as f64 / runs.max(1) as f64,
            per_request_ns[i]
        ));
    }
    // Server and load generator keep both cores busy, so each request costs 2 s / rps of CPU.
    let cpu_ns_per_request = 2.0e9 / watching_rps;
    let marginal = per_request_ns[1] - per_request_ns[0];
    format!(
        "In-kernel cost (BPF run-time statistics on):\n\n| setup | req/s | program runs per request | ns per run | program ns per request |\n|---|---|---|---|---|\n{}\n\nmarginal cost of watching: {marginal:.0} ns of program time per request, {:.2}% of the {cpu_ns_per_request:.0} ns of CPU each request takes",
        lines.join("\n"),
        marginal / cpu_ns_per_request * 100.0
    )
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0,
            "sched_setaffinity"
        );
    }
}

/// Requests per second that wrk reports for one run (wrk runs on CPU 1).
fn wrk(url: &str, seconds: u64, connections: u64) -> f64 {
    let out = Command::new("taskset")
        .args([
            "-c",
            "1",
            "wrk",
            "-t1",
            &format!("-c{connections}"),
            &format!("-d{seconds}s"),
            url,
        ])
        .output()
        .expect("run wrk (./dev setup installs it)");
    assert!(
        out.status.success(),
        "wrk failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|line| line.strip_prefix("Requests/sec:"))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no Requests/sec in wrk output:\n{text}"))
}
