//! Rejections seen from outside a proxy: a probe sends one request at a time on its own
//! connection and records each rejection with its status and its `Retry-After`, as a client
//! sees them.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

/// One rejection a probe received.
#[derive(Clone, Debug)]
pub struct Rejection {
    /// When it arrived.
    pub at: Instant,
    /// Its status code.
    pub status: u16,
    /// Its `Retry-After`, as sent.
    pub retry_after: Option<String>,
}

/// One request for `path` on its own connection; a rejection (answered at once) is returned,
/// an admitted request (queued behind slow replicas) is left after 150 ms.
pub fn probe(target: SocketAddr, path: &str) -> Option<Rejection> {
    let mut stream = TcpStream::connect(target).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_millis(150)))
        .ok()?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .ok()?;
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response);
    let status: u16 = text.split(' ').nth(1)?.parse().ok()?;
    if status == 200 {
        return None;
    }
    let retry_after = text
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("retry-after").then_some(value)
        })
        .map(|v| v.trim().to_owned());
    Some(Rejection {
        at: Instant::now(),
        status,
        retry_after,
    })
}

/// Probes `path` at `target` every 20 ms until `stop`, recording every rejection.
pub fn prober(
    target: SocketAddr,
    path: &'static str,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<Vec<Rejection>> {
    thread::spawn(move || {
        let mut seen = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            seen.extend(probe(target, path));
            thread::sleep(Duration::from_millis(20));
        }
        seen
    })
}

/// The `Retry-After` seconds of the rejections between `from` and `to`.
///
/// # Panics
/// If one of them has no header, or not delta-seconds.
pub fn values(rejections: &[Rejection], from: Instant, to: Instant) -> Vec<u64> {
    rejections
        .iter()
        .filter(|r| r.at >= from && r.at <= to)
        .map(|r| r.retry_after.as_deref().unwrap().parse().unwrap())
        .collect()
}

/// The median of `values`.
///
/// # Panics
/// If there are none.
pub fn median(mut values: Vec<u64>) -> u64 {
    assert!(!values.is_empty(), "no rejections in the window");
    values.sort_unstable();
    values[values.len() / 2]
}
