//! A soak of the agent: mixed traffic on loopback for a long run, to show that nothing leaks
//! or drifts. nginx serves plain HTTP and TLS; the traffic is wrk with keep-alive on both,
//! ab with a new connection per request, and a pool of keep-alive connections opened before
//! the agent starts (so adopted), each sending a request every 100 ms. The real agent watches
//! both ports and is restarted (SIGKILL, then started again) once midway. Every minute the
//! agent's resident memory, open files, tracked connections (against the established sockets
//! the kernel lists) and mean tick time are sampled. At the restart and at the end the
//! traffic pauses, and the agent's counts of each life must equal nginx's stub_status.
//!
//! Usage: `soak [MINUTES]`   (default 30; run as root; `./dev soak` builds and runs it)

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use retry_after_agent::kernel::tcp_sockets;
use retry_after_testkit::{
    AgentProcess, free_port,
    proxies::{Nginx, NginxStatus, Wrk, self_signed_certificate},
    sample,
};

/// Minutes of each life not judged for flatness (start-up, the first connections).
const WARM_UP_MINUTES: usize = 2;

fn main() {
    let minutes: usize = std::env::args()
        .nth(1)
        .map(|m| m.parse().expect("MINUTES: a whole number"))
        .unwrap_or(30);
    assert!(minutes >= 2 * (WARM_UP_MINUTES + 1), "at least 6 minutes");
    let (cert, key) = self_signed_certificate();
    let (plain, tls) = (free_port(), free_port());
    let nginx = Nginx::start(&format!(
        "  server {{ listen {plain}; keepalive_requests 1000000; location / {{ return 200 \"ok\\n\"; }} }}\n  \
         server {{ listen {tls} ssl; ssl_certificate {}; ssl_certificate_key {}; \
         keepalive_requests 1000000; location / {{ return 200 \"ok\\n\"; }} }}",
        cert.display(),
        key.display()
    ));
    let traffic = Arc::new(Traffic::default());
    // Opened before the agent: adopted at their next request.
    let pool = spawn_pool(plain, 16, traffic.clone());
    let loads = spawn_loads(plain, tls, traffic.clone());
    traffic.pause();
    let mut agent = AgentProcess::start(
        "",
        &format!(
            "[[service]]\nname = \"soak\"\nrejected_at = \"replica\"\n\
             backends = [{{ address = \"{plain}\" }}, {{ address = \"{tls}\" }}]\n"
        ),
    );
    let mut life_start = nginx.status();
    traffic.resume();
    println!(
        "| minute | life | RSS (MiB) | open files | tracked connections | established sockets | mean tick (ms) | requests counted |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let (mut samples, mut lives) = (Vec::new(), Vec::new());
    let mut ticks = TickClock::default();
    let started = Instant::now();
    for minute in 1..=minutes {
        let due = started + Duration::from_secs(60 * minute as u64);
        thread::sleep(due.saturating_duration_since(Instant::now()));
        let life = lives.len() + 1;
        let s = Sample::take(minute, life, &agent, [plain, tls], &mut ticks);
        println!("{}", s.row());
        samples.push(s);
        if minute == minutes / 2 || minute == minutes {
            traffic.pause();
            lives.push(judge_life(life, &agent, &nginx, life_start, [plain, tls]));
            if minute == minutes / 2 {
                agent.restart();
                ticks = TickClock::default();
                life_start = nginx.status();
                traffic.resume();
            }
        }
    }
    traffic.stop();
    pool.join().unwrap();
    for load in loads {
        load.join().unwrap();
    }
    println!();
    for line in &lives {
        println!("{line}");
    }
    for life in [1, 2] {
        let judged: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.life == life)
            .skip(WARM_UP_MINUTES)
            .collect();
        println!("life {life}: {}", flatness(&judged));
    }
}

/// Whether the traffic runs, and how many loads are in the middle of a request.
#[derive(Default)]
struct Traffic {
    paused: AtomicBool,
    stopped: AtomicBool,
    busy: AtomicUsize,
}

impl Traffic {
    /// Pause, and return once no load is mid-run and the last answers have arrived.
    fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
        while self.busy.load(Ordering::SeqCst) > 0 {
            thread::sleep(Duration::from_millis(50));
        }
        thread::sleep(Duration::from_secs(2));
    }

    fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
    }

    fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        self.resume();
    }

    /// Run `job` while not stopped, each time the traffic is not paused.
    fn run(&self, mut job: impl FnMut()) {
        while !self.stopped.load(Ordering::SeqCst) {
            self.busy.fetch_add(1, Ordering::SeqCst);
            if self.paused.load(Ordering::SeqCst) {
                self.busy.fetch_sub(1, Ordering::SeqCst);
                thread::sleep(Duration::from_millis(20));
                continue;
            }
            job();
            self.busy.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// `connections` keep-alive connections to `addr`, opened now, each sending a request every
/// 100 ms while the traffic runs.
fn spawn_pool(
    addr: SocketAddr,
    connections: usize,
    traffic: Arc<Traffic>,
) -> thread::JoinHandle<()> {
    let mut streams: Vec<TcpStream> = (0..connections)
        .map(|_| TcpStream::connect(addr).expect("connect the pool"))
        .collect();
    thread::spawn(move || {
        traffic.run(|| {
            for stream in &mut streams {
                request(stream);
            }
            thread::sleep(Duration::from_millis(100));
        })
    })
}

/// One keep-alive request on `stream`, its whole response read.
fn request(stream: &mut TcpStream) {
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: soak\r\n\r\n")
        .expect("pool request");
    let mut response = Vec::new();
    let mut buf = [0u8; 512];
    // nginx's answer: headers with Content-Length: 3, then "ok\n".
    while !response.ends_with(b"ok\n") {
        let n = stream.read(&mut buf).expect("pool response");
        assert!(n > 0, "nginx closed a pool connection");
        response.extend_from_slice(&buf[..n]);
    }
}

/// The loads: wrk with keep-alive on the plain and the TLS port (10 s runs, 4 connections),
/// and ab with a new connection per request (500 requests, 4 at once).
fn spawn_loads(
    plain: SocketAddr,
    tls: SocketAddr,
    traffic: Arc<Traffic>,
) -> Vec<thread::JoinHandle<()>> {
    let wrk = |url: String, traffic: Arc<Traffic>| {
        thread::spawn(move || {
            traffic.run(|| {
                let totals = Wrk::start_url(&url, 1, 4, 10).finish();
                assert!(totals.requests > 0, "wrk made no request to {url}");
            })
        })
    };
    let ab = {
        let traffic = traffic.clone();
        let url = format!("http://{plain}/");
        thread::spawn(move || {
            traffic.run(|| {
                let out = std::process::Command::new("ab")
                    .args(["-q", "-n", "500", "-c", "4", &url])
                    .output()
                    .expect("ab is installed (./dev setup installs it)");
                assert!(out.status.success(), "ab failed");
            })
        })
    };
    vec![
        wrk(format!("http://{plain}/"), traffic.clone()),
        wrk(format!("https://{tls}/"), traffic),
        ab,
    ]
}

/// The agent's counts of one life against nginx's over the same time (the traffic paused):
/// both vantage points of both ports, started and completed.
fn judge_life(
    life: usize,
    agent: &AgentProcess,
    nginx: &Nginx,
    start: NginxStatus,
    ports: [SocketAddr; 2],
) -> String {
    let end = nginx.status();
    // The later reading of stub_status is itself one request, on its own (unwatched) port.
    let truth = end.requests - start.requests - 1;
    let metrics = agent.metrics();
    let counted = |name: &str, side: &str| -> u64 {
        ports
            .iter()
            .map(|addr| endpoint_value(&metrics, name, *addr, side))
            .sum()
    };
    let seen = [
        counted("retry_after_endpoint_requests_started_total", "server"),
        counted("retry_after_endpoint_responses_completed_total", "server"),
        counted("retry_after_endpoint_requests_started_total", "client"),
        counted("retry_after_endpoint_responses_completed_total", "client"),
    ];
    let exact = seen.iter().all(|&n| n == truth);
    format!(
        "life {life}: nginx answered {truth} requests; the agent counted started/completed {}/{} \
         server side, {}/{} client side: {}",
        seen[0],
        seen[1],
        seen[2],
        seen[3],
        if exact { "exact" } else { "NOT EXACT" }
    )
}

/// A counter of one endpoint and side, 0 if absent.
fn endpoint_value(metrics: &str, name: &str, addr: SocketAddr, side: &str) -> u64 {
    sample(
        metrics,
        &format!("{name}{{endpoint=\"{addr}\",side=\"{side}\"}}"),
    )
    .unwrap_or(0.0) as u64
}

/// The tick histogram's sum and count at the last sample.
#[derive(Default)]
struct TickClock {
    sum: f64,
    count: f64,
}

/// One minute's sample.
struct Sample {
    minute: usize,
    life: usize,
    rss_mib: f64,
    open_files: usize,
    tracked: u64,
    established: usize,
    tick_ms: f64,
    requests: u64,
}

impl Sample {
    fn take(
        minute: usize,
        life: usize,
        agent: &AgentProcess,
        ports: [SocketAddr; 2],
        ticks: &mut TickClock,
    ) -> Self {
        let proc = format!("/proc/{}", agent.pid());
        let status = std::fs::read_to_string(format!("{proc}/status")).unwrap();
        let rss_kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap();
        let open_files = std::fs::read_dir(format!("{proc}/fd")).unwrap().count();
        let metrics = agent.metrics();
        let mut tracked = 0;
        let mut requests = 0;
        for addr in ports {
            for side in ["server", "client"] {
                let opened = endpoint_value(
                    &metrics,
                    "retry_after_endpoint_connections_opened_total",
                    addr,
                    side,
                );
                let closed = endpoint_value(
                    &metrics,
                    "retry_after_endpoint_connections_closed_total",
                    addr,
                    side,
                );
                tracked += opened.saturating_sub(closed);
            }
            requests += endpoint_value(
                &metrics,
                "retry_after_endpoint_requests_started_total",
                addr,
                "server",
            );
        }
        let (sum, count) = (
            sample(&metrics, "retry_after_tick_duration_seconds_sum").unwrap_or(0.0),
            sample(&metrics, "retry_after_tick_duration_seconds_count").unwrap_or(0.0),
        );
        let tick_ms = 1000.0 * (sum - ticks.sum) / (count - ticks.count).max(1.0);
        *ticks = TickClock { sum, count };
        Self {
            minute,
            life,
            rss_mib: rss_kib / 1024.0,
            open_files,
            tracked,
            established: established_sockets(ports),
            tick_ms,
            requests,
        }
    }

    fn row(&self) -> String {
        format!(
            "| {} | {} | {:.1} | {} | {} | {} | {:.3} | {} |",
            self.minute,
            self.life,
            self.rss_mib,
            self.open_files,
            self.tracked,
            self.established,
            self.tick_ms,
            self.requests
        )
    }
}

/// Established TCP sockets with either end on one of `ports` (each loopback connection is
/// two: the server's and the client's).
fn established_sockets(ports: [SocketAddr; 2]) -> usize {
    let on_ports = |addr: &SocketAddr| ports.iter().any(|p| p.port() == addr.port());
    tcp_sockets(Path::new("/proc"))
        .expect("read /proc/net/tcp")
        .iter()
        .filter(|s| s.is_established() && (on_ports(&s.local) || on_ports(&s.remote)))
        .count()
}

/// Whether RSS, open files and the mean tick stayed within 10% of their first judged value
/// (the tick within 10%, or 0.1 ms, the clock's own wobble on a loaded machine).
fn flatness(judged: &[&Sample]) -> String {
    let spread = |of: &dyn Fn(&Sample) -> f64| {
        let values: Vec<f64> = judged.iter().map(|s| of(s)).collect();
        let (low, high) = values
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &v| {
                (l.min(v), h.max(v))
            });
        (low, high)
    };
    let verdict = |name: &str, (low, high): (f64, f64), slack: f64| {
        let flat = high <= low * 1.1 + slack;
        format!(
            "{name} {low:.2} to {high:.2} ({})",
            if flat { "flat" } else { "NOT FLAT" }
        )
    };
    [
        verdict("RSS (MiB)", spread(&|s| s.rss_mib), 0.0),
        verdict("open files", spread(&|s| s.open_files as f64), 0.0),
        verdict("mean tick (ms)", spread(&|s| s.tick_ms), 0.1),
    ]
    .join("; ")
}
