//! Data-path cost of the attached programs: requests per second through a keep-alive HTTP/1.1
//! server on loopback, driven by wrk, with and without the probe attached and watching the
//! server, in alternating order within one run. Prints a markdown table and the median ratio.
//!
//! Usage: datapath-bench [ROUNDS] [SECONDS] [CONNECTIONS]   (defaults 5 10 16; run as root)

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
    let rounds = args.next().unwrap_or(5);
    let seconds = args.next().unwrap_or(10);
    let connections = args.next().unwrap_or(16);

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
        "| round | order | without agent (req/s) | with agent (req/s) | ratio | requests counted |"
    );
    println!("|---|---|---|---|---|---|");
    let mut ratios = Vec::new();
    for round in 0..rounds {
        let attached_first = round % 2 == 1;
        let (mut without, mut with, mut counted) = (0.0, 0.0, 0);
        for attached in [attached_first, !attached_first] {
            if attached {
                let probe = AttachedProbe::watching(&[endpoint]);
                with = wrk(&url, seconds, connections);
                std::thread::sleep(Duration::from_millis(200));
                counted = probe
                    .counters(endpoint, Side::Server)
                    .counters
                    .requests_started;
            } else {
                without = wrk(&url, seconds, connections);
            }
        }
        let ratio = with / without;
        ratios.push(ratio);
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.4} | {} |",
            round + 1,
            if attached_first {
                "with first"
            } else {
                "without first"
            },
            without,
            with,
            ratio,
            counted
        );
    }
    ratios.sort_by(f64::total_cmp);
    let median = ratios[ratios.len() / 2];
    println!();
    println!(
        "median ratio with/without: {median:.4} ({:+.2}% throughput), {rounds} rounds of {seconds} s, {connections} connections",
        (median - 1.0) * 100.0
    );
}

/// Requests per second that wrk reports for one run.
fn wrk(url: &str, seconds: u64, connections: u64) -> f64 {
    let out = Command::new("wrk")
        .args([
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
