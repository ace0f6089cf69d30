//! Support for the integration tests and the data-path benchmark: a real HTTP/1.1 server and
//! client on loopback, and the real eBPF probe, attached.
//!
//! Nothing here stands in for the kernel, a socket or a proxy: the server and client talk over
//! real TCP on 127.0.0.1 or ::1 and the probe is the agent's own, attached to the root cgroup.

pub mod engine;
pub mod engine_load;
pub mod gateway;
pub mod http;
pub mod kept_returns;
pub mod kernels;
pub mod netns;
pub mod nginx_kept;
pub mod proxies;
pub mod quiet;
pub mod rejections;
pub mod replica;
pub mod vm;

use std::{
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

pub use retry_after_agent::error_chain;
use retry_after_agent::kernel::{Probe, ProbeOptions};
use retry_after_common::Side;
use retry_after_estimator::{
    endpoint::Endpoint,
    snapshot::{EndpointSnapshot, Snapshot},
};

/// A cgroup v2 directory of the test's own, under the hierarchy's root; removed when dropped
/// (after its processes, which the test stops first).
pub struct TestCgroup(PathBuf);

impl TestCgroup {
    /// Create `NAME-PID` under the root of the mounted hierarchy.
    pub fn create(name: &str) -> Self {
        let root = retry_after_agent::kernel::find_cgroup2_root()
            .expect("a cgroup v2 hierarchy is mounted (the agent attaches to it)");
        let path = root.join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("create cgroup {}: {e}", path.display()));
        Self(path)
    }

    /// Its directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The tick of an agent started by [`AgentProcess`], in milliseconds (the evaluation's
/// simulator ticks its agents at the same pace).
pub const AGENT_TICK_MS: u64 = 200;

/// One test's agent or probe at a time in a process: they watch ports a later test may reuse,
/// and a test's figures are its own traffic's. Tests in one binary take turns through this
/// lock (and `./dev test` runs them single-threaded anyway).
static ATTACHED: Mutex<()> = Mutex::new(());

/// The agent's probe, attached for the length of one test.
pub struct AttachedProbe {
    /// The probe.
    pub probe: Probe,
    _turn: MutexGuard<'static, ()>,
}

/// Fail the test at once, saying why, when not run as root: the integration tests attach the
/// real eBPF programs (`./dev test` runs them as root).
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert!(
        euid == 0,
        "the integration tests attach the real eBPF programs and must run as root (uid {euid} \
         here): run `./dev test` as root"
    );
}

impl AttachedProbe {
    /// Attach the real programs. Panics (failing the test loudly) if that is not possible,
    /// e.g. when not run as root.
    pub fn attach() -> Self {
        Self::attach_with(&ProbeOptions::default())
    }

    /// [`AttachedProbe::attach`] with `options` (a smaller connection map, say).
    pub fn attach_with(options: &ProbeOptions) -> Self {
        require_root();
        let turn = ATTACHED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let probe = Probe::attach(options).unwrap_or_else(|error| {
            panic!(
                "cannot attach the eBPF programs (these tests must run as root with CAP_BPF): {}",
                error_chain(&error)
            )
        });
        Self { probe, _turn: turn }
    }

    /// What the programs run on this kernel, and what they left out.
    pub fn kernel_support(&self) -> &retry_after_agent::kernel::KernelSupport {
        self.probe.kernel_support()
    }

    /// Attach and watch `endpoints`.
    pub fn watching(endpoints: &[Endpoint]) -> Self {
        let mut attached = Self::attach();
        for endpoint in endpoints {
            attached.watch(*endpoint);
        }
        attached
    }

    /// Watch one more endpoint.
    pub fn watch(&mut self, endpoint: Endpoint) {
        self.probe
            .watch(endpoint)
            .unwrap_or_else(|error| panic!("watch {endpoint}: {}", error_chain(&error)));
    }

    /// Stop watching an endpoint.
    pub fn unwatch(&mut self, endpoint: Endpoint) {
        self.probe
            .unwatch(&endpoint)
            .unwrap_or_else(|error| panic!("unwatch {endpoint}: {}", error_chain(&error)));
    }

    /// Read a snapshot now.
    pub fn read(&self) -> Snapshot {
        self.probe
            .read()
            .unwrap_or_else(|error| panic!("read counters: {}", error_chain(&error)))
    }

    /// The counters of one endpoint and side now.
    pub fn counters(&self, endpoint: Endpoint, side: Side) -> EndpointSnapshot {
        *self
            .read()
            .endpoint(&endpoint, side)
            .unwrap_or_else(|| panic!("{endpoint} ({}) is not watched", side.as_str()))
    }

    /// Poll until `done` holds for the counters of `endpoint`/`side` (and still holds a moment
    /// later, so a count that overshoots is caught), or panic after `timeout` with the last
    /// counters seen.
    pub fn wait_for(
        &self,
        endpoint: Endpoint,
        side: Side,
        timeout: Duration,
        what: &str,
        done: impl Fn(&EndpointSnapshot) -> bool,
    ) -> EndpointSnapshot {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.counters(endpoint, side);
            if done(&seen) {
                std::thread::sleep(Duration::from_millis(200));
                let again = self.counters(endpoint, side);
                assert!(
                    done(&again),
                    "{what}: held at first, then changed: {seen:?} → {again:?}"
                );
                return again;
            }
            if Instant::now() > deadline {
                panic!("{what}: not reached within {timeout:?}; last seen {seen:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Run `command` to success; its standard output and error together (panics with them if it
/// fails).
pub fn run_ok(command: &mut std::process::Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{command:?} failed:\n{text}");
    text
}

/// Run `command` to success (panicking with its output otherwise) and return its standard
/// output alone, for a program that prints a record to parse; what it wrote to standard error
/// (a library's warning) is passed on to the test's.
pub fn run_stdout(command: &mut std::process::Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "{command:?} failed:\n{stdout}{stderr}"
    );
    if !stderr.trim().is_empty() {
        eprintln!(
            "{:?} said on standard error:\n{stderr}",
            command.get_program()
        );
    }
    stdout.into_owned()
}

/// A sample's value in a Prometheus text exposition: the line that starts with
/// `name_and_labels` (labels in the exposition's order) followed by a space.
pub fn sample(metrics: &str, name_and_labels: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

/// The value of `retry_after_endpoint_<name>_total` for `endpoint` and `side` (`server` or
/// `client`) in a Prometheus text exposition of the agent's (0 while not reported).
pub fn endpoint_total(
    metrics: &str,
    name: &str,
    endpoint: std::net::SocketAddr,
    side: &str,
) -> u64 {
    let metric = format!("retry_after_endpoint_{name}_total{{");
    let endpoint_label = format!("endpoint=\"{endpoint}\"");
    let side_label = format!("side=\"{side}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with(&metric))
        .filter(|l| l.contains(&endpoint_label) && l.contains(&side_label))
        .find_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// How the agent process is started.
#[derive(Clone, Debug, Default)]
pub struct Launch {
    /// Set the open-files limit (soft and hard) of the process to this.
    pub nofile: Option<u64>,
    /// A command the agent is run through (e.g. `setpriv` with its options).
    pub prefix: Vec<String>,
    /// Give the test's directory (configuration, socket) to this uid, for an agent that runs
    /// as that user.
    pub owner: Option<u32>,
    /// Another build of the agent to run instead of this tree's ([`agent_binary`]): a bench's
    /// earlier version beside the current one.
    pub binary: Option<std::path::PathBuf>,
}

/// The real agent binary, running with a configuration of the test's, stopped (SIGTERM) when
/// dropped.
pub struct AgentProcess {
    child: std::process::Child,
    launch: Launch,
    /// Its socket.
    pub socket: std::path::PathBuf,
    /// Its metrics address.
    pub metrics: std::net::SocketAddr,
    _turn: MutexGuard<'static, ()>,
    dir: std::path::PathBuf,
}

impl AgentProcess {
    /// Start the agent with `services` (TOML `[[service]]` tables) and extra `[agent]` lines;
    /// the socket and metrics address are chosen here. Waits until it answers HEALTH.
    pub fn start(agent_lines: &str, services: &str) -> Self {
        Self::start_with(agent_lines, services, Launch::default())
    }

    /// [`AgentProcess::start`], launched as `launch` says.
    pub fn start_with(agent_lines: &str, services: &str, launch: Launch) -> Self {
        require_root();
        let turn = ATTACHED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let dir = std::env::temp_dir().join(format!(
            "retry-after-test-{}-{}",
            std::process::id(),
            NEXT_AGENT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("agent.sock");
        let metrics = free_port();
        let config = format!(
            "[agent]\ntick_interval_ms = {AGENT_TICK_MS}\nsocket_path = {socket:?}\nmetrics_listen = \"{metrics}\"\n{agent_lines}\n{services}\n"
        );
        let path = dir.join("config.toml");
        std::fs::write(&path, config).unwrap();
        if let Some(uid) = launch.owner {
            std::os::unix::fs::chown(&dir, Some(uid), None).unwrap();
        }
        let child = Self::spawn(&path, &launch);
        let agent = Self {
            child,
            launch,
            socket,
            metrics,
            _turn: turn,
            dir,
        };
        agent.wait_until_serving();
        agent
    }

    fn spawn(config: &std::path::Path, launch: &Launch) -> std::process::Child {
        use std::os::unix::process::CommandExt;
        let binary = launch.binary.clone().unwrap_or_else(agent_binary);
        let mut command = match launch.prefix.split_first() {
            Some((program, args)) => {
                let mut command = std::process::Command::new(program);
                command.args(args).arg(binary);
                command
            }
            None => std::process::Command::new(binary),
        };
        command
            .args(["run", "--config"])
            .arg(config)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit());
        if let Some(nofile) = launch.nofile {
            // SAFETY: setrlimit is async-signal-safe; it only changes the child's own limit.
            unsafe {
                command.pre_exec(move || {
                    let limit = libc::rlimit {
                        rlim_cur: nofile,
                        rlim_max: nofile,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        command.spawn().expect("start the agent")
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Send `signal` to the process.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Stop the process (SIGSTOP) and return once the kernel shows it stopped: `kill`
    /// returns before the signal has taken effect.
    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let status = format!("/proc/{}/status", self.child.id());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !std::fs::read_to_string(&status)
            .unwrap_or_default()
            .lines()
            .any(|l| l.starts_with("State:") && l.contains("T (stopped)"))
        {
            assert!(Instant::now() < deadline, "the agent did not stop");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Wait until the socket answers HEALTH, or refuses us by uid (panics after 60 s: the
    /// verifier's checks take a few seconds, more while another lane's agent starts).
    pub fn wait_until_serving(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(line) = self.request("HEALTH")
                && (line.starts_with("HEALTH ok") || line.starts_with("ERR denied"))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not serve within 60 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// One request line on a fresh connection; the first answer line.
    pub fn request(&self, line: &str) -> std::io::Result<String> {
        use std::io::{BufRead, Write};
        let stream = std::os::unix::net::UnixStream::connect(&self.socket)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        (&stream).write_all(format!("{line}\n").as_bytes())?;
        let mut answer = String::new();
        std::io::BufReader::new(&stream).read_line(&mut answer)?;
        Ok(answer.trim_end().to_owned())
    }

    /// Its `HEALTH` answer, parsed (panics if the socket gives none).
    pub fn health(&self) -> retry_after_protocol::HealthResponse {
        let line = self.request("HEALTH").expect("a HEALTH answer");
        match retry_after_protocol::Response::parse(&line) {
            Ok(retry_after_protocol::Response::Health(health)) => health,
            other => panic!("not a health line: {line:?} ({other:?})"),
        }
    }

    /// GET /metrics.
    pub fn metrics(&self) -> String {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(self.metrics).expect("metrics endpoint");
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\n\r\n")
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        body.to_owned()
    }

    /// Kill the agent outright (SIGKILL: no cleanup, the socket file stays).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Start the agent again with the same configuration.
    pub fn restart(&mut self) {
        self.kill();
        self.child = Self::spawn(&self.dir.join("config.toml"), &self.launch);
        self.wait_until_serving();
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        // A test that failed while the agent was stopped must not hang here: continue it
        // first, then ask it to stop.
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGCONT);
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

static NEXT_AGENT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A loopback address with a port that was free a moment ago.
///
/// Taken below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), which it hands
/// out to every `connect` and every bind to port 0: a port from that range can be taken as a
/// client's source port by the time a server binds it (nginx failed to start so in CI).
pub fn free_port() -> std::net::SocketAddr {
    use std::sync::atomic::{AtomicU32, Ordering};
    /// Ports this process has tried so far: no two calls try the same one first.
    static TRIED: AtomicU32 = AtomicU32::new(0);
    const SPAN: u32 = 10_000;
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    // The SPAN ports below the range, if they are all unprivileged; test binaries run one
    // after another, and each starts at its own place among them.
    if let Some(base) = ephemeral_from.checked_sub(SPAN).filter(|b| *b >= 1_024) {
        let start = std::process::id() % SPAN;
        for _ in 0..SPAN {
            let port = base + (start + TRIED.fetch_add(1, Ordering::Relaxed)) % SPAN;
            if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port as u16)) {
                return listener.local_addr().unwrap();
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// The agent binary next to this test's own build output (`./dev test` builds it first).
pub fn agent_binary() -> std::path::PathBuf {
    // A test runs from target/<profile>/deps, a binary of this crate from target/<profile>.
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    let path = [dir, dir.parent().unwrap()]
        .map(|d| d.join("retry-after-agent"))
        .into_iter()
        .find(|p| p.exists());
    path.unwrap_or_else(|| {
        panic!(
            "the agent is not built next to {}: run `cargo build -p retry-after-agent` first (./dev test does)",
            exe.display()
        )
    })
}

/// How long tests wait for counters to settle after the traffic is done.
pub const SETTLE: Duration = Duration::from_secs(10);
