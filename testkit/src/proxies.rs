//! Software no one here wrote, run for real on loopback: the distribution's HAProxy (with its
//! own stats socket as the truth), nginx (with stub_status), and wrk as traffic. Each process
//! is stopped when dropped.

use std::{
    ffi::OsStr,
    io::{BufRead, BufReader, Read, Write},
    net::SocketAddr,
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// A running `haproxy -db` with a configuration of the test's.
pub struct Haproxy {
    child: Child,
    stats: HaproxyStats,
    dir: PathBuf,
}

/// HAProxy's stats socket, to be read from any thread.
#[derive(Clone, Debug)]
pub struct HaproxyStats(PathBuf);

impl Haproxy {
    /// Start HAProxy with `sections` (frontends and backends) after a `global` section with a
    /// stats socket and HTTP `defaults`; `cgroup`, if given, is a cgroup v2 directory the
    /// process joins before it starts (so every socket it opens belongs to it). Waits until
    /// the stats socket answers.
    pub fn start(sections: &str, cgroup: Option<&Path>) -> Self {
        Self::start_with_global("", sections, cgroup)
    }

    /// [`Haproxy::start`] with the HAProxy integration loaded ([`haproxy_lua_script`]), asking
    /// the agent at `agent_socket`, and each of `settings` (a `RETRY_AFTER_*` name, its value)
    /// set in its environment.
    pub fn start_with_lua(agent_socket: &Path, settings: &[(&str, &str)], sections: &str) -> Self {
        Self::start_with_lua_and(agent_socket, settings, "", sections)
    }

    /// [`Haproxy::start_with_lua`] with more lines for the `global` section (`localpeer`).
    pub fn start_with_lua_and(
        agent_socket: &Path,
        settings: &[(&str, &str)],
        global_lines: &str,
        sections: &str,
    ) -> Self {
        let mut global = format!(
            "    lua-load {}\n    setenv RETRY_AFTER_SOCKET {}\n{global_lines}",
            haproxy_lua_script().display(),
            agent_socket.display()
        );
        for (name, value) in settings {
            global.push_str(&format!("    setenv {name} {value}\n"));
        }
        Self::start_with_global(&global, sections, None)
    }

    /// [`Haproxy::start`] with more lines for the `global` section (`lua-load`, `setenv`).
    pub fn start_with_global(global: &str, sections: &str, cgroup: Option<&Path>) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "retry-after-haproxy-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let stats = dir.join("stats.sock");
        let config = format!(
            "global\n    stats socket {} mode 600 level user\n    maxconn 4096\n{global}\
             defaults\n    mode http\n    timeout connect 2s\n    timeout client 120s\n    \
             timeout server 120s\n    timeout queue 120s\n{sections}\n",
            stats.display()
        );
        let path = dir.join("haproxy.cfg");
        std::fs::write(&path, config).unwrap();
        let child = command_in(
            cgroup,
            "haproxy",
            [OsStr::new("-db"), OsStr::new("-f"), path.as_os_str()],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("haproxy is installed (./dev setup installs it)");
        let haproxy = Self {
            child,
            stats: HaproxyStats(stats),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while haproxy.command("show info").is_err() {
            assert!(Instant::now() < deadline, "haproxy did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        haproxy
    }

    /// One command on the stats socket; the whole answer.
    pub fn command(&self, command: &str) -> std::io::Result<String> {
        self.stats.command(command)
    }

    /// A field of `show stat` (see [`HaproxyStats::stat`]).
    pub fn stat(&self, pxname: &str, svname: &str, field: &str) -> u64 {
        self.stats.stat(pxname, svname, field)
    }

    /// The stats socket, for a thread of its own.
    pub fn stats(&self) -> HaproxyStats {
        self.stats.clone()
    }

    /// Stop it now (SIGKILL).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl HaproxyStats {
    /// One command on the stats socket; the whole answer.
    pub fn command(&self, command: &str) -> std::io::Result<String> {
        let mut stream = UnixStream::connect(&self.0)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.write_all(format!("{command}\n").as_bytes())?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer)?;
        Ok(answer)
    }

    /// A field of `show stat` (e.g. `qcur`, `scur`, `stot`) for proxy `pxname`, line `svname`
    /// (`FRONTEND`, `BACKEND` or a server's name).
    pub fn stat(&self, pxname: &str, svname: &str, field: &str) -> u64 {
        let csv = self.command("show stat").expect("haproxy stats socket");
        let mut lines = csv.lines();
        let header: Vec<&str> = lines
            .next()
            .and_then(|h| h.strip_prefix("# "))
            .expect("show stat header")
            .split(',')
            .collect();
        let column = header
            .iter()
            .position(|h| *h == field)
            .unwrap_or_else(|| panic!("no {field} in {header:?}"));
        lines
            .map(|l| l.split(',').collect::<Vec<_>>())
            .find(|row| row.first() == Some(&pxname) && row.get(1) == Some(&svname))
            .and_then(|row| row.get(column)?.parse().ok())
            .unwrap_or_else(|| panic!("no {pxname}/{svname} {field} in {csv}"))
    }
}

/// A running `wrk` (keep-alive HTTP/1.1 load from a separate process).
pub struct Wrk {
    child: Child,
}

/// What wrk printed at its end.
#[derive(Clone, Copy, Debug)]
pub struct WrkTotals {
    /// Requests completed in the run.
    pub requests: u64,
    /// The run's length, as wrk measured it.
    pub seconds: f64,
}

impl Wrk {
    /// `wrk -t threads -c connections -d seconds http://target/`, started now.
    pub fn start(target: SocketAddr, threads: u32, connections: u32, seconds: u32) -> Self {
        Self::start_url(&format!("http://{target}/"), threads, connections, seconds)
    }

    /// `wrk -t threads -c connections -d seconds url`, started now (`https://` for TLS).
    pub fn start_url(url: &str, threads: u32, connections: u32, seconds: u32) -> Self {
        Self::start_with(&[], url, threads, connections, seconds)
    }

    /// [`Wrk::start_url`] with `args` before the URL (`-s script.lua`, say).
    pub fn start_with(
        args: &[&str],
        url: &str,
        threads: u32,
        connections: u32,
        seconds: u32,
    ) -> Self {
        let child = Command::new("wrk")
            .args(args)
            .args([
                "-t",
                &threads.to_string(),
                "-c",
                &connections.to_string(),
                "-d",
                &format!("{seconds}s"),
                "--timeout",
                "60s",
                url,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("wrk is installed (./dev setup installs it)");
        Self { child }
    }

    /// Wait for the end of the run and read its totals (`N requests in Xs`).
    pub fn finish(mut self) -> WrkTotals {
        let stdout = self.child.stdout.take().unwrap();
        let mut totals = None;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let words: Vec<&str> = line.split_whitespace().collect();
            if let [requests, "requests", "in", seconds, ..] = words.as_slice() {
                totals = Some(WrkTotals {
                    requests: requests.parse().unwrap(),
                    seconds: seconds.trim_end_matches(['s', ',']).parse().unwrap(),
                });
            }
        }
        let _ = self.child.wait();
        totals.expect("wrk printed its totals")
    }
}

impl Drop for Wrk {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `load_module` lines the distribution's nginx needs for Lua (libnginx-mod-http-lua).
pub const NGINX_LUA_MODULES: &str = "load_module /usr/lib/nginx/modules/ndk_http_module.so;\nload_module /usr/lib/nginx/modules/ngx_http_lua_module.so;\n";

/// The HAProxy integration's script of this checkout (`lua-load` it), as an absolute path.
pub fn haproxy_lua_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../integrations/haproxy/retry_after.lua")
        .canonicalize()
        .unwrap()
}

/// nginx's `lua_package_path` for the nginx integration and the policy module of this
/// checkout.
pub fn nginx_lua_package_path() -> String {
    let integrations = Path::new(env!("CARGO_MANIFEST_DIR")).join("../integrations");
    let dir = |name: &str| integrations.join(name).canonicalize().unwrap();
    format!(
        "{}/?.lua;{}/?.lua;;",
        dir("nginx").display(),
        dir("lua").display()
    )
}

/// The agent's `[agent]` lines that let nginx's workers (the distribution's nginx started by
/// root runs them as `nobody`) open its socket, and root, and no one else.
pub fn nginx_workers_may_connect() -> String {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    let nobody: u32 = passwd
        .lines()
        .find_map(|l| {
            let fields: Vec<&str> = l.split(':').collect();
            (fields[0] == "nobody").then(|| fields[2].parse().unwrap())
        })
        .expect("a nobody user");
    format!("socket_mode = \"0666\"\nallowed_uids = [0, {nobody}]")
}

/// A running nginx (the distribution's) with a configuration of the test's: `servers` are the
/// `server { … }` blocks; a stub_status server on its own loopback port is added, and its
/// counters are the truth.
pub struct Nginx {
    child: Child,
    status: SocketAddr,
    dir: PathBuf,
    /// The network namespace it runs in, if not this process's.
    netns: Option<String>,
}

/// nginx's own counters (`stub_status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NginxStatus {
    /// Connections accepted.
    pub accepts: u64,
    /// Requests received.
    pub requests: u64,
}

impl Nginx {
    /// Start nginx in the foreground with `servers`; waits until stub_status answers.
    pub fn start(servers: &str) -> Self {
        Self::start_in(servers, None)
    }

    /// [`Nginx::start`], in `cgroup` if given (a cgroup v2 directory the process joins before
    /// it starts, so every socket it opens belongs to it).
    pub fn start_in(servers: &str, cgroup: Option<&Path>) -> Self {
        Self::start_with("", servers, cgroup)
    }

    /// [`Nginx::start_in`] with `main` added to the main context (`load_module` lines, a
    /// `worker_processes` other than 1) and `http` (server blocks and any other http-level
    /// directives) to the http block.
    pub fn start_with(main: &str, http: &str, cgroup: Option<&Path>) -> Self {
        Self::launch(main, http, cgroup, None)
    }

    /// [`Nginx::start`] in network namespace `netns` (its stub_status is read from inside it).
    pub fn start_in_netns(servers: &str, netns: &str) -> Self {
        Self::launch("", servers, None, Some(netns))
    }

    fn launch(main: &str, http: &str, cgroup: Option<&Path>, netns: Option<&str>) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "retry-after-nginx-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let status = crate::free_port();
        let d = dir.display();
        let workers = if main.contains("worker_processes") {
            ""
        } else {
            "worker_processes 1;\n"
        };
        let config = format!(
            "daemon off;\nmaster_process on;\n{workers}pid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n{main}\n\
             events {{ worker_connections 4096; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  \
             fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
             {http}\n  server {{ listen {status}; location / {{ stub_status; }} }}\n}}\n"
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, config).unwrap();
        let args = [
            OsStr::new("-c"),
            path.as_os_str(),
            OsStr::new("-p"),
            dir.as_os_str(),
        ];
        let mut command = match netns {
            Some(ns) => {
                let mut command = crate::netns::HostPair::command(ns, "nginx");
                command.args(args);
                command
            }
            None => command_in(cgroup, "nginx", args),
        };
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("nginx is installed (./dev setup installs it)");
        let nginx = Self {
            child,
            status,
            dir,
            netns: netns.map(str::to_owned),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while nginx.try_status().is_none() {
            assert!(Instant::now() < deadline, "nginx did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        nginx
    }

    fn try_status(&self) -> Option<NginxStatus> {
        let text = match &self.netns {
            Some(ns) => {
                let out = crate::netns::HostPair::command(ns, "curl")
                    .args(["-sf", &format!("http://{}/", self.status)])
                    .output()
                    .ok()?;
                String::from_utf8(out.stdout).ok()?
            }
            None => {
                let mut stream = std::net::TcpStream::connect(self.status).ok()?;
                stream
                    .write_all(b"GET / HTTP/1.0\r\nHost: status\r\n\r\n")
                    .ok()?;
                let mut text = String::new();
                stream.read_to_string(&mut text).ok()?;
                text
            }
        };
        let numbers: Vec<u64> = text
            .lines()
            .find(|l| {
                let words: Vec<&str> = l.split_whitespace().collect();
                words.len() == 3 && words.iter().all(|w| w.parse::<u64>().is_ok())
            })?
            .split_whitespace()
            .map(|w| w.parse().unwrap())
            .collect();
        Some(NginxStatus {
            accepts: numbers[0],
            requests: numbers[2],
        })
    }

    /// How each request nginx logged to `log` ended, from an access log of the status alone
    /// (`log_format ended '$status';` and `access_log <log> ended;`): (answered, reset by the
    /// client before the answer, which nginx logs as 499).
    pub fn endings(log: &Path) -> (u64, u64) {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let reset = text.lines().filter(|l| l.trim() == "499").count() as u64;
        (text.lines().count() as u64 - reset, reset)
    }

    /// What nginx wrote to its error log so far (warnings and worse).
    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default()
    }

    /// nginx's counters now. Reading them is itself one connection and one request, counted
    /// in what it returns.
    pub fn status(&self) -> NginxStatus {
        self.try_status().expect("stub_status answers")
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid; SIGQUIT is nginx's graceful stop.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `program` with `args`, run in `cgroup` if given: a shell joins the cgroup, then becomes the
/// program (the shell's pid is the program's), so the program opens no socket outside it.
pub fn command_in<S: AsRef<OsStr>>(
    cgroup: Option<&Path>,
    program: &str,
    args: impl IntoIterator<Item = S>,
) -> Command {
    match cgroup {
        Some(cgroup) => {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg("echo $$ > \"$1/cgroup.procs\" && shift && exec \"$@\"")
                .arg("sh")
                .arg(cgroup)
                .arg(program)
                .args(args);
            c
        }
        None => {
            let mut c = Command::new(program);
            c.args(args);
            c
        }
    }
}

/// A self-signed certificate for `localhost` and its key, made by the distribution's openssl in
/// a new directory: (certificate path, key path).
pub fn self_signed_certificate() -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "retry-after-tls-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    crate::run_ok(
        Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
            .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"])
            .args(["-subj", "/CN=localhost", "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&cert),
    );
    (cert, key)
}

/// A frontend that rejects once its backend's queue holds `limit` requests: the decision is
/// taken once per request (`txn.reject`), so every rule after it agrees even while the queue
/// moves (HAProxy runs several threads). HAProxy keeps its server connections alive and
/// reuses them: after the restart, the new agent adopts those it did not see open.
pub fn haproxy_frontend_rejecting_at(
    name: &str,
    bind: SocketAddr,
    limit: u32,
    replicas: &[&crate::http::HttpServer],
) -> String {
    let servers: String = replicas
        .iter()
        .enumerate()
        .map(|(i, r)| format!("    server r{i} {} maxconn 2\n", r.addr()))
        .collect();
    haproxy_frontend_rejecting_when(
        name,
        bind,
        &format!("queue(be_{name}) ge {limit}"),
        &servers,
    )
}

/// A frontend `fe_<name>` on `bind` rejecting for service `name` when `full` (an HAProxy
/// condition) holds, as [`haproxy_frontend_rejecting_at`] does, before backend `be_<name>`
/// of `servers` (its `server` lines).
pub fn haproxy_frontend_rejecting_when(
    name: &str,
    bind: SocketAddr,
    full: &str,
    servers: &str,
) -> String {
    format!(
        "frontend fe_{name}\n    bind {bind}\n\
         \x20   http-request set-var(txn.reject) bool(true) if {{ {full} }}\n\
         \x20   acl reject var(txn.reject) -m bool\n\
         \x20   http-request lua.retry_after {name} if reject\n\
         \x20   http-request return status 503 content-type text/plain string \"busy\" hdr Retry-After %[var(txn.retry_after)] if reject {{ var(txn.retry_after_status) -m int 503 }} {{ var(txn.retry_after) -m found }}\n\
         \x20   http-request return status 429 content-type text/plain string \"busy\" hdr Retry-After %[var(txn.retry_after)] if reject {{ var(txn.retry_after) -m found }}\n\
         \x20   http-request return status 429 content-type text/plain string \"busy\" if reject\n\
         \x20   http-request lua.retry_after_admitted {name}\n\
         \x20   http-after-response set-header retry-after-ms %[var(txn.retry_after_ms_header)] if {{ var(txn.retry_after_ms_header) -m found }}\n\
         \x20   default_backend be_{name}\n\
         backend be_{name}\n    balance roundrobin\n{servers}"
    )
}
