//! Rejections seen from outside a proxy: a probe sends one request at a time on its own
//! connection and records each rejection with its status, its `Retry-After` and its
//! `retry-after-ms`, as a client sees them.

use crate::AgentProcess;

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
    /// When its request was sent. The proxy decided the answer after it, and the answer may
    /// arrive much later (a rejection from inside Ray Serve's ingress waits for its busy event
    /// loop), so a rejection is placed in a window of the outage by this.
    pub at: Instant,
    /// Its status code.
    pub status: u16,
    /// Its `Retry-After`, as sent.
    pub retry_after: Option<String>,
    /// Its `retry-after-ms`, as sent.
    pub retry_after_ms: Option<String>,
}

impl Rejection {
    /// Whether its `retry-after-ms` says the time its `Retry-After` says: both present, and
    /// the milliseconds rounded up to whole seconds are the seconds (each is the answer's
    /// value rounded up in its unit and clamped alike).
    pub fn millis_agree(&self) -> bool {
        let (Some(seconds), Some(millis)) = (&self.retry_after, &self.retry_after_ms) else {
            return false;
        };
        match (seconds.parse::<u64>(), millis.parse::<u64>()) {
            (Ok(seconds), Ok(millis)) => millis.div_ceil(1000) == seconds,
            _ => false,
        }
    }
}

/// How long a probe waits for an answer from a proxy written in C (nginx, HAProxy), which
/// rejects in well under a millisecond: an admitted request, queued behind slow replicas, is
/// left after that.
pub const PROBE_WAIT: Duration = Duration::from_millis(150);

/// One request for `path` on its own connection; a rejection answered within `wait` is
/// returned, a request still unanswered then (admitted, queued behind slow replicas) is left.
pub fn probe(target: SocketAddr, path: &str, wait: Duration) -> Option<Rejection> {
    let sent = Instant::now();
    let mut stream = TcpStream::connect(target).ok()?;
    stream.set_read_timeout(Some(wait)).ok()?;
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
    let header = |wanted: &str| {
        text.lines()
            .take_while(|l| !l.is_empty())
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case(wanted).then_some(value)
            })
            .map(|v| v.trim().to_owned())
    };
    Some(Rejection {
        at: sent,
        status,
        retry_after: header("retry-after"),
        retry_after_ms: header("retry-after-ms"),
    })
}

/// Probes `path` at `target` every 20 ms until `stop`, each probe waiting up to `wait` (see
/// [`probe`]), recording every rejection.
pub fn prober(
    target: SocketAddr,
    path: &'static str,
    wait: Duration,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<Vec<Rejection>> {
    thread::spawn(move || {
        let mut seen = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            seen.extend(probe(target, path, wait));
            thread::sleep(Duration::from_millis(20));
        }
        seen
    })
}

/// The `Retry-After` seconds of the rejections whose requests were sent within `window`
/// (from, to).
///
/// # Panics
/// If one of them has no header, or not delta-seconds.
pub fn values(rejections: &[Rejection], window: (Instant, Instant)) -> Vec<u64> {
    let (from, to) = window;
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

/// An agent outage, as [`outage`] drove it: the windows in which rejections carried the
/// computed value, the fallback, and the computed value again, and what `ask` said in each
/// computed window.
#[derive(Debug)]
pub struct Outage<T> {
    /// The agent computing, before the kill.
    pub computed: (Instant, Instant),
    /// The agent gone and its estimate stale in the proxy.
    pub fallback: (Instant, Instant),
    /// The restarted agent computing again.
    pub again: (Instant, Instant),
    /// `ask` before the kill.
    pub before: T,
    /// `ask` after the restart.
    pub after: T,
}

impl<T> Outage<T> {
    /// Where `at` falls among the windows, for a failure's message.
    pub fn describe(&self, at: Instant) -> String {
        let since = |t: Instant| at.saturating_duration_since(t).as_secs_f64();
        format!(
            "{:.2} s after the computed window began, {:.2} s after the fallback's, {:.2} s after the restart's",
            since(self.computed.0),
            since(self.fallback.0),
            since(self.again.0)
        )
    }
}

/// How long [`outage`] waits, at most, for the agent to compute its answer (its drain rate
/// warm) before each computed window.
const WARM_WITHIN: Duration = Duration::from_secs(30);

/// Kill and restart `agent` on the schedule the integration tests share, while the proxy in
/// front is under load and probed: at least 6 s for the drain to warm (until `ask` answers,
/// at most 30 s), a second for the proxies to hear it, 4 s computing (`ask` halfway), the
/// kill, 2.5 s for the proxy's estimate to go stale (their `stale` is 1.5 s), 3 s of
/// fallback, the restart, at least 6 s to reconnect and warm (until `ask` answers again), a
/// second, 3 s computing again (`ask` halfway): 26.5 s when the machine is quiet, what `ask`
/// takes, and the restart itself: the kernel's verifier takes seconds to load the programs
/// (about 5 s on the 2-core test machines). The waits for `ask` keep the windows where they
/// belong on a busy machine, where a replica's first answers come late. The load must last
/// longer: the tests start it for 60 s and stop it when this returns.
///
/// `ask` gives the agent's own answer once it computes one, `None` until then.
pub fn outage<T>(
    agent: &mut AgentProcess,
    mut ask: impl FnMut(&AgentProcess) -> Option<T>,
) -> Outage<T> {
    thread::sleep(Duration::from_secs(6));
    until_computed(agent, &mut ask);
    thread::sleep(Duration::from_secs(1));
    let computed_from = Instant::now();
    thread::sleep(Duration::from_secs(2));
    let before = until_computed(agent, &mut ask);
    thread::sleep(Duration::from_secs(2));
    let killed = Instant::now();
    agent.kill();
    thread::sleep(Duration::from_millis(2500));
    let stale = Instant::now();
    thread::sleep(Duration::from_secs(3));
    let restarted = Instant::now();
    agent.restart();
    thread::sleep(Duration::from_secs(6));
    until_computed(agent, &mut ask);
    thread::sleep(Duration::from_secs(1));
    let again_from = Instant::now();
    thread::sleep(Duration::from_millis(1500));
    let after = until_computed(agent, &mut ask);
    thread::sleep(Duration::from_millis(1500));
    Outage {
        computed: (computed_from, killed),
        fallback: (stale, restarted),
        again: (again_from, Instant::now()),
        before,
        after,
    }
}

/// `ask`'s answer, once it has one (asked every 200 ms; panics after [`WARM_WITHIN`]).
fn until_computed<T>(agent: &AgentProcess, ask: &mut impl FnMut(&AgentProcess) -> Option<T>) -> T {
    let deadline = Instant::now() + WARM_WITHIN;
    loop {
        if let Some(answer) = ask(agent) {
            return answer;
        }
        assert!(
            Instant::now() < deadline,
            "the agent computed no answer within {WARM_WITHIN:?} under the load"
        );
        thread::sleep(Duration::from_millis(200));
    }
}
