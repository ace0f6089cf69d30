//! vLLM's CPU engine, started for a test: its OpenAI-compatible server on loopback, serving a
//! tiny Llama model built at start (`tests/engines/vllm/tiny_model.py`, its weights never read:
//! `--load-format dummy`), from the environment `./dev setup` makes (`.tools/vllm-venv`), every
//! cache under the engine's own directory, nothing fetched. Its own metrics (`/metrics`) are
//! the truth the engine tests hold the agent to.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

/// How long the engine may take to answer `/health`: about 45 s cold on two cores with the
/// machine to itself, far longer niced beside the suite's lanes (`./dev test` starts it there,
/// `quiet`). An engine that exits fails at once.
const READY_WITHIN: Duration = Duration::from_secs(600);

/// A running engine; stopped (SIGTERM, its processes exit in one or two seconds) when dropped.
pub struct Vllm {
    child: Child,
    addr: SocketAddr,
    dir: PathBuf,
}

/// The engine's own counts, from its `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct VllmCounts {
    /// `vllm:num_requests_waiting`: requests in its queue, not scheduled.
    pub waiting: f64,
    /// `vllm:num_requests_running`: requests in its batch.
    pub running: f64,
    /// `vllm:request_success_total`, every `finished_reason` summed: requests finished.
    pub finished: f64,
}

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

impl Vllm {
    /// Start the engine on `addr` with a batch of `max_num_seqs`; waits until `/health`
    /// answers 200. Panics with the engine's log if it does not.
    pub fn start(addr: SocketAddr, max_num_seqs: u32) -> Self {
        let python = repo().join(".tools/vllm-venv/bin/python");
        assert!(
            python.exists(),
            "vLLM's environment is missing: run ./dev setup"
        );
        let dir = std::env::temp_dir().join(format!("retry-after-vllm-{}", addr.port()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
        let model = dir.join("tiny-llama");
        let built = Command::new(&python)
            .arg(repo().join("tests/engines/vllm/tiny_model.py"))
            .arg(&model)
            .output()
            .expect("run tiny_model.py");
        assert!(built.status.success(), "tiny_model.py: {built:?}");
        let log = std::fs::File::create(dir.join("engine.log")).unwrap();
        let child = Command::new(&python)
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&model)
            .args(["--served-model-name", "tiny-llama", "--host", "127.0.0.1"])
            .args(["--port", &addr.port().to_string(), "--load-format", "dummy"])
            .args(["--dtype", "bfloat16", "--max-model-len", "512"])
            .args(["--max-num-seqs", &max_num_seqs.to_string()])
            .envs(environment(&dir))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start vLLM's server");
        let mut engine = Self { child, addr, dir };
        engine.wait_until_ready();
        engine
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its base URL for the OpenAI SDK (`http://ADDR/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    fn wait_until_ready(&mut self) {
        let deadline = Instant::now() + READY_WITHIN;
        while get(self.addr, "/health").is_none_or(|(status, _)| status != 200) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("vLLM exited ({status}) before it answered:\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "vLLM did not start within {READY_WITHIN:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The engine's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("engine.log")).unwrap_or_default()
    }

    /// Its counts now (one request to `/metrics`, which the agent counts too).
    pub fn counts(&self) -> VllmCounts {
        let (status, body) = get(self.addr, "/metrics").expect("vLLM's /metrics answers");
        assert_eq!(status, 200, "{body}");
        let sum = |name: &str| {
            body.lines()
                .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        VllmCounts {
            waiting: sum("vllm:num_requests_waiting"),
            running: sum("vllm:num_requests_running"),
            finished: sum("vllm:request_success_total"),
        }
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The engine's environment: offline, no usage reports, every cache under `dir`, the CPU
/// engine on loopback with a 1 GiB KV cache.
fn environment(dir: &Path) -> Vec<(&'static str, PathBuf)> {
    let under = |p: &str| dir.join(p);
    let fixed = |v: &str| PathBuf::from(v);
    vec![
        ("HOME", under("home")),
        ("XDG_CACHE_HOME", under("cache")),
        ("XDG_CONFIG_HOME", under("config")),
        ("HF_HOME", under("hf")),
        ("VLLM_CACHE_ROOT", under("vllm-cache")),
        ("VLLM_CONFIG_ROOT", under("vllm-config")),
        ("TORCHINDUCTOR_CACHE_DIR", under("inductor")),
        ("TMPDIR", under("tmp")),
        ("VLLM_RPC_BASE_PATH", under("tmp")),
        ("HF_HUB_OFFLINE", fixed("1")),
        ("TRANSFORMERS_OFFLINE", fixed("1")),
        ("HF_HUB_DISABLE_TELEMETRY", fixed("1")),
        ("VLLM_NO_USAGE_STATS", fixed("1")),
        ("VLLM_DO_NOT_TRACK", fixed("1")),
        ("DO_NOT_TRACK", fixed("1")),
        ("VLLM_TARGET_DEVICE", fixed("cpu")),
        ("VLLM_HOST_IP", fixed("127.0.0.1")),
        ("VLLM_CPU_KVCACHE_SPACE", fixed("1")),
    ]
}

/// GET `path` from `addr` (HTTP/1.1, the connection closed after): the status and body.
fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: engine\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}
