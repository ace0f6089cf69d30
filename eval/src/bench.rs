//! What the data-path benches share: the loads they drive (wrk and h2load on CPU 1, the
//! server pinned to CPU 0), and the figures they print (median and spread over rounds).

use std::process::Command;

/// What one run of a load did: requests a second, and requests completed.
#[derive(Clone, Copy, Debug)]
pub struct Done {
    pub rps: f64,
    pub requests: f64,
}

/// wrk at `url` for `seconds` s on CPU 1 (one thread, `connections` keep-alive connections),
/// with `extra` options; every answer must be a 2xx.
pub fn wrk(url: &str, seconds: u64, connections: u32, extra: &[&str]) -> Done {
    let out = Command::new("taskset")
        .args(["-c", "1", "wrk", "-t1", &format!("-c{connections}")])
        .arg(format!("-d{seconds}s"))
        .args(extra)
        .arg(url)
        .output()
        .expect("run wrk (./dev setup installs it)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "wrk failed on {url}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains("Non-2xx"),
        "wrk on {url} had failures:\n{text}"
    );
    let field = |of: &dyn Fn(&str) -> Option<String>| -> f64 {
        text.lines()
            .find_map(|l| of(l.trim()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("wrk's output on {url} lacks a figure:\n{text}"))
    };
    Done {
        rps: field(&|l| l.strip_prefix("Requests/sec:").map(str::to_owned)),
        requests: field(&|l| l.split_once(" requests in ").map(|(n, _)| n.to_owned())),
    }
}

/// h2load at `url` for `seconds` s on CPU 1 (one thread, `connections` connections, `streams`
/// at once on each): requests succeeded over the duration asked.
pub fn h2load(url: &str, seconds: u64, connections: u32, streams: u32) -> Done {
    let out = Command::new("taskset")
        .args(["-c", "1", "h2load", "-t1"])
        .args(["-c", &connections.to_string(), "-m", &streams.to_string()])
        .args(["-D", &seconds.to_string()])
        .arg(url)
        .output()
        .expect("run h2load (./dev setup installs it)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "h2load failed on {url}: {text}");
    let requests = text
        .lines()
        .find_map(|l| l.strip_prefix("requests: "))
        .and_then(|rest| {
            rest.split(", ")
                .find_map(|part| part.strip_suffix(" succeeded"))
        })
        .and_then(|n| n.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no requests succeeded in h2load's output on {url}:\n{text}"));
    Done {
        rps: requests / seconds as f64,
        requests,
    }
}

/// The median of `values` (the upper one of an even count).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The lowest and highest of `values`.
pub fn spread(values: &[f64]) -> (f64, f64) {
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (low, high)
}

/// Run this thread (and what it starts from now on) on CPU `cpu` only.
pub fn pin_to_cpu(cpu: usize) {
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
