//! Ray Serve, the proposal's own system, end to end: the real Ray Serve 2.60 from PyPI
//! (`tests/clients/serve_apps.py`, in the project's virtual environment), started once, the
//! real agent watching Serve's HTTP port from the kernel, wrk as the load. Both places a Serve
//! rejection happens, loaded at once through one kill and restart of the agent:
//!
//! * **Serve's proxy rejects** (`/direct`: the ingress deployment's queue is full). nginx and
//!   HAProxy in front replace Serve's static
//!   `Retry-After` with the agent's while it runs; Serve's own value passes through with the
//!   agent stopped; the agent's again after it restarts. The
//!   queue is the one the kernel sees at Serve's port beyond the replicas' capacity, and the
//!   drain Serve's completed work, not its rejections.
//! * **A DeploymentHandle rejects inside an ingress** (`/ingress`: a FastAPI ingress calling
//!   the model): `retry_after_ray` answers the `BackPressureError` with the agent's value for
//!   the depth Serve states in it, Serve's own value with the agent stopped.
//!
//! Then urllib3 clients honouring Retry-After get in through nginx; and, with the same Serve,
//! urllib3 clients with a key each get in at the places an ingress keeps (`retry_after_ray`
//! with `keep`, policy `kept_returns`).

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use retry_after_protocol::{
    Response,
    policy::{QueueDepthSource, Rung},
};
use retry_after_testkit::{
    AgentProcess, free_port,
    proxies::{
        Haproxy, NGINX_LUA_MODULES, Nginx, Wrk, nginx_lua_package_path, nginx_workers_may_connect,
    },
    rejections::{Outage, Rejection, median, outage, prober, values},
    sample,
};

use retry_after_testkit::kept_returns::{Book, Keep, clairvoyant_p99, kept_clients, quantile};

/// The model's request places (two replicas, `max_ongoing_requests` 2) and its work per
/// request (`serve_apps.py`).
const MODEL_PLACES: usize = 4;
const MODEL_TIME: Duration = Duration::from_millis(200);

/// Serve's own static value (`serve_apps.py`): one the agent's answers here never take.
const SERVE_STATIC_S: u64 = 29;

/// How long a probe waits for its answer. Serve answers in Python, and a rejection from inside
/// the ingress (the handle's error, turned into a response by FastAPI) waits for the ingress's
/// event loop, which wrk keeps busy: a short wait takes a slow rejection for an admitted
/// request, and leaves windows without a rejection probed (docs/integrations/ray-serve.md
/// has the runs). A rejection is placed in its window by when its request was sent, so
/// waiting longer costs a probe nothing but time when Serve is slow: an admitted request takes
/// the model's 0.2 s and its queue (at most 8 behind 4 at a time: 0.6 s), a rejection far
/// less, when the machine is quiet.
const SERVE_PROBE_WAIT: Duration = Duration::from_secs(5);

/// Probes at once in each layout. A probe is held by each admitted request, which from inside
/// the ingress is about every other one.
const PROBERS: usize = 3;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Guards where Serve misses the targets HAProxy and nginx keep (95% of retries admitted, none
/// giving up, p99 within 1.5× the bound's), each under the runs measured
/// (docs/integrations/ray-serve.md; the misses in docs/evaluation.md's targets table).
/// urllib3 clients through nginx told by `scheduled_returns` as a hint: retries admitted
/// (86.5–91% in runs here; 77.6%, 215 of 277, in a CI run with the machine to itself) and
/// clients that got in (472–473 of 473).
const SCHEDULED_ADMITTED_GUARD: f64 = 0.7;
const SCHEDULED_SUCCEEDED_GUARD: f64 = 0.9;
/// Kept returns in Serve's ingress: retries admitted (89.8–97.3%), clients giving up (0 or 1
/// of 603) and p99 ÷ the bound's (2.18–3.44) in six runs; one run beside another load fell
/// to 83.3% and 6.61×, so the suite runs this test alone.
const KEPT_ADMITTED_GUARD: f64 = 0.85;
const KEPT_GAVE_UP_GUARD: f64 = 0.01;
const KEPT_P99_GUARD: f64 = 4.0;

/// The Serve apps, running until dropped (their stdin closes: Serve and Ray shut down).
struct ServeApps {
    child: Child,
    stdin: Option<ChildStdin>,
    addr: SocketAddr,
}

impl ServeApps {
    /// Serve on `addr`, its ingress answering with the agent at `agent_socket`.
    fn start(addr: SocketAddr, agent_socket: &Path) -> Self {
        let python = repo().join(".tools/serve-venv/bin/python");
        assert!(
            python.exists(),
            "{} is missing: ./dev setup --for test installs Ray Serve there",
            python.display()
        );
        let integrations = repo().join("integrations");
        let mut child = Command::new(python)
            .arg(repo().join("tests/clients/serve_apps.py"))
            .arg(addr.port().to_string())
            .arg(agent_socket)
            .env(
                "PYTHONPATH",
                format!(
                    "{}:{}",
                    integrations.join("python").display(),
                    integrations.join("ray").display()
                ),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the Serve apps");
        let started = Instant::now();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "the Serve apps did not start");
        eprintln!("Ray Serve up in {:.1} s", started.elapsed().as_secs_f64());
        let stdin = child.stdin.take();
        Self { child, stdin, addr }
    }
}

impl Drop for ServeApps {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(200));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let ray = repo().join(".tools/serve-venv/bin/ray");
        let _ = Command::new(ray)
            .args(["stop", "--force"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn services(serve: SocketAddr) -> String {
    let service = |name: &str, queue: &str, capacity: &str, policy: &str| {
        format!(
            "[[service]]\nname = \"{name}\"\nrejected_at = \"replica\"\nreplica_queue = \"{queue}\"\nbackends = [{{ address = \"{serve}\"{capacity} }}]\n[service.backpressure]\nretry_after_policy = \"{policy}\"\nretry_after_s = 7\njitter = 0.0\n"
        )
    };
    // Two replicas × max_ongoing_requests 2: beyond 4 in flight at Serve's port, a queue.
    let four = ", max_ongoing_requests = 4";
    let beyond = "beyond_capacity";
    service("serve-direct", beyond, four, "router_queue_drain_rate")
        + &service("serve-ingress", beyond, "", "router_queue_drain_rate")
        + &service("serve-scheduled", beyond, four, "scheduled_returns")
        + &service("serve-kept", beyond, "", "kept_returns")
        // The streaming replica at serve.llm's default max_ongoing_requests: its queue is
        // what waits for a first body byte.
        + &service("serve-stream", "waiting", "", "router_queue_drain_rate")
}

/// What the probes of one layout saw through the agent's kill and restart.
struct Cycle {
    seen: Vec<Rejection>,
    computed: Vec<u64>,
    agent_before: u64,
    fallback: Vec<u64>,
    again: Vec<u64>,
    agent_after: u64,
    /// Rejections carrying the agent's value whose `retry-after-ms` is missing or says
    /// another time.
    millis_disagree: Vec<Rejection>,
}

/// A place a test loads and probes: a target, a path there, wrk's connections to it, and which
/// of the agent's answers its rejections carry.
struct Layout {
    target: SocketAddr,
    path: &'static str,
    connections: u32,
    answer: usize,
}

/// Load each of `layouts`, probe each, and kill and restart the agent once for all of them;
/// `agent_says` is the agent's own answers for the queues the layouts answer for (`None` until
/// it computes them all). One cycle a layout, in their order.
fn kill_and_restart(
    agent: &mut AgentProcess,
    layouts: &[Layout],
    agent_says: impl Fn(&AgentProcess) -> Option<Vec<u64>>,
) -> Vec<Cycle> {
    // Longer than the outage's schedule (about 25 s).
    let loads: Vec<Wrk> = layouts
        .iter()
        .map(|l| {
            Wrk::start_url(
                &format!("http://{}{}", l.target, l.path),
                1,
                l.connections,
                60,
            )
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let probes: Vec<Vec<_>> = layouts
        .iter()
        .map(|l| {
            (0..PROBERS)
                .map(|_| prober(l.target, l.path, SERVE_PROBE_WAIT, stop.clone()))
                .collect()
        })
        .collect();
    let outage = outage(agent, agent_says);
    stop.store(true, Ordering::SeqCst);
    let cycles = probes
        .into_iter()
        .zip(layouts)
        .map(|(probes, layout)| {
            let seen: Vec<Rejection> = probes.into_iter().flat_map(|p| p.join().unwrap()).collect();
            Cycle::of(seen, &outage, layout.answer)
        })
        .collect();
    drop(loads);
    cycles
}

impl Cycle {
    /// What `seen` says about each part of `outage`, whose answer `answer` it carries.
    fn of(seen: Vec<Rejection>, outage: &Outage<Vec<u64>>, answer: usize) -> Self {
        let within = |r: &Rejection, (from, to): (Instant, Instant)| r.at >= from && r.at <= to;
        let millis_disagree = seen
            .iter()
            .filter(|r| within(r, outage.computed) || within(r, outage.again))
            .filter(|r| !r.millis_agree())
            .cloned()
            .collect();
        Self {
            millis_disagree,
            computed: values(&seen, outage.computed),
            fallback: values(&seen, outage.fallback),
            again: values(&seen, outage.again),
            seen,
            agent_before: outage.before[answer],
            agent_after: outage.after[answer],
        }
    }

    /// Every rejection carried an integer Retry-After; the agent's value while it ran, Serve's
    /// own with it stopped, the agent's again after the restart.
    fn check(&self, layout: &str) {
        eprintln!(
            "{layout}: {} rejections probed\n  computed {:?}, the agent said {}\n  agent stopped {:?}\n  computed again {:?}, the agent said {}",
            self.seen.len(),
            self.computed,
            self.agent_before,
            self.fallback,
            self.again,
            self.agent_after
        );
        // Each probe waits up to `SERVE_PROBE_WAIT` on each admitted request: tens of
        // rejections a layout, more on an idle machine.
        assert!(self.seen.len() > 40, "{layout}: {}", self.seen.len());
        assert!(
            !self.computed.is_empty() && !self.again.is_empty(),
            "{layout}"
        );
        for r in &self.seen {
            assert_eq!(r.status, 429, "{layout}: {r:?}");
            let value = r.retry_after.as_deref().expect("a Retry-After");
            let seconds: u64 = value.parse().expect("delta-seconds");
            assert!((1..=60).contains(&seconds), "{layout}: {seconds}");
        }
        // The agent's answers carry retry-after-ms too (Serve's own, with the agent stopped,
        // are left as Serve sent them).
        assert!(
            self.millis_disagree.is_empty(),
            "{layout}: {} rejections without a retry-after-ms saying their Retry-After's time: {:?}",
            self.millis_disagree.len(),
            self.millis_disagree.first()
        );
        assert!(self.computed.iter().all(|v| *v != SERVE_STATIC_S));
        assert!(median(self.computed.clone()).abs_diff(self.agent_before) <= 1);
        assert!(
            !self.fallback.is_empty() && self.fallback.iter().all(|v| *v == SERVE_STATIC_S),
            "{layout}: with the agent stopped, Serve's own {SERVE_STATIC_S} s in every rejection probed (at least one)"
        );
        assert!(self.again.iter().all(|v| *v != SERVE_STATIC_S));
        assert!(median(self.again.clone()).abs_diff(self.agent_after) <= 1);
    }
}

/// nginx in front of Serve's proxy, replacing its Retry-After with the agent's.
fn front(serve: SocketAddr, agent_socket: &Path) -> (Nginx, SocketAddr) {
    let front = free_port();
    let http = format!(
        "lua_package_path \"{}\";\n\
         lua_shared_dict retry_after 1m;\n\
         init_worker_by_lua_block {{ require(\"retry_after_nginx\").start({{ services = {{ \"serve-direct\", \"serve-scheduled\" }}, socket = \"{}\", retry_after_s = false, stale_ms = 1500, reconnect_max_ms = 1000 }}) }}\n\
         upstream serve {{ server {serve}; keepalive 32; }}\n\
         server {{\n  listen {front};\n  location / {{\n    proxy_http_version 1.1;\n    proxy_set_header Connection \"\";\n    proxy_pass http://serve;\n    header_filter_by_lua_block {{ require(\"retry_after_nginx\").stamp(\"serve-direct\", {{ replace_upstream = true }}) }}\n  }}\n\
         \x20 location /scheduled {{\n    proxy_http_version 1.1;\n    proxy_set_header Connection \"\";\n    proxy_pass http://serve/direct;\n    header_filter_by_lua_block {{ require(\"retry_after_nginx\").stamp(\"serve-scheduled\", {{ replace_upstream = true }}) }}\n  }}\n}}\n",
        nginx_lua_package_path(),
        agent_socket.display(),
    );
    (Nginx::start_with(NGINX_LUA_MODULES, &http, None), front)
}

/// HAProxy in front of Serve's proxy, replacing its Retry-After with the agent's
/// (`http-response lua.retry_after_response`).
fn haproxy_front(serve: SocketAddr, agent_socket: &Path) -> (Haproxy, SocketAddr) {
    let front = free_port();
    let haproxy = Haproxy::start_with_lua(
        agent_socket,
        &[
            ("RETRY_AFTER_SERVICES", "serve-direct:be_serve"),
            ("RETRY_AFTER_STALE_MS", "1500"),
            ("RETRY_AFTER_RECONNECT_MAX_MS", "1000"),
        ],
        &format!(
            "frontend fe_serve\n    bind {front}\n    http-response lua.retry_after_response serve-direct\n    default_backend be_serve\nbackend be_serve\n    server serve {serve}\n"
        ),
    );
    (haproxy, front)
}

/// The agent's computed answer to `request` (seconds, queue depth), checking the queue's
/// source; `None` while it does not compute.
fn computed(agent: &AgentProcess, request: &str, source: QueueDepthSource) -> Option<(u64, u64)> {
    let line = agent.request(request).unwrap();
    match Response::parse(&line) {
        Ok(Response::RetryAfter(a)) if a.rung == Rung::Computed => {
            assert_eq!(a.queue_depth_source, Some(source), "{line}");
            Some((a.seconds.unwrap(), a.queue_depth.unwrap()))
        }
        Ok(Response::RetryAfter(_)) => None,
        other => panic!("not an answer: {line} ({other:?})"),
    }
}

/// Serve's rejections carry the agent's Retry-After in both places Serve rejects (its proxy
/// and, through retry_after_ray, a DeploymentHandle in its ingress), through nginx and
/// HAProxy and across the agent's kill and restart; urllib3 clients told by
/// `scheduled_returns` get in; then, with the same Serve and agent, the ingress keeps the
/// places it gives, and a replica streams as serve.llm's do (`serve_streams`). One Serve for
/// all of it: it takes 12 s to start and 8 s to stop here.
#[test]
fn serve_rejections_carry_the_agents_retry_after_and_the_ingress_keeps_its_places() {
    let serve_addr = free_port();
    let mut agent = AgentProcess::start(&nginx_workers_may_connect(), &services(serve_addr));
    let serve = ServeApps::start(serve_addr, &agent.socket);

    // Serve's proxy rejects; nginx and HAProxy in front answer with the agent's value for the
    // queue the kernel sees at Serve's port beyond its replicas' capacity. At the same time a
    // DeploymentHandle rejects inside the ingress, and retry_after_ray answers for the depth
    // Serve states in the error (the model's queue: max_queued_requests 8, behind 4 running).
    let (nginx, front) = front(serve.addr, &agent.socket);
    let (haproxy, haproxy_front) = haproxy_front(serve.addr, &agent.socket);
    let layout = |target, path, connections, answer| Layout {
        target,
        path,
        connections,
        answer,
    };
    let cycles = kill_and_restart(
        &mut agent,
        &[
            layout(front, "/direct", 10, 0),
            layout(haproxy_front, "/direct", 10, 0),
            layout(serve.addr, "/ingress/", 15, 1),
        ],
        |agent| {
            let (direct, depth) = computed(
                agent,
                "QUERY serve-direct",
                QueueDepthSource::BeyondCapacity,
            )?;
            let (ingress, _) = computed(
                agent,
                "QUERY serve-ingress queue_depth=8",
                QueueDepthSource::Proxy,
            )?;
            eprintln!("serve-direct: the agent sees a queue of {depth}");
            Some(vec![direct, ingress])
        },
    );
    cycles[0].check("Serve's proxy, nginx in front");
    cycles[1].check("Serve's proxy, HAProxy in front");
    cycles[2].check("a DeploymentHandle, retry_after_ray");
    drop(haproxy);
    // The drain is Serve's work: its rejections are counted apart.
    let metrics = agent.metrics();
    let counter = |name: &str| {
        sample(
            &metrics,
            &format!("{name}{{endpoint=\"{serve_addr}\",side=\"server\"}}"),
        )
        .unwrap()
    };
    let (completed, rejected) = (
        counter("retry_after_endpoint_responses_completed_total"),
        counter("retry_after_endpoint_responses_rejected_total"),
    );
    eprintln!("at Serve's port since the restart: {completed} responses, {rejected} rejections");
    assert!(rejected > 0.0 && rejected < completed);
    let reported = sample(
        &metrics,
        "retry_after_proxy_requests_total{outcome=\"rejected\",service=\"serve-ingress\"}",
    )
    .unwrap_or(0.0);
    eprintln!("retry_after_ray reported {reported} rejections to the restarted agent");
    assert!(reported > 0.0);

    urllib3_clients_told_by_scheduled_returns_get_in(front);
    drop(nginx);
    the_ingress_keeps_the_places_it_gives_to_keyed_urllib3_clients(&serve, &agent);
    crate::serve_streams::serve_streams_wait_then_stream_as_its_replica_says(serve.addr, &agent);
    drop(serve);
}

/// Clients that honour Retry-After (urllib3's own Retry) get in through nginx at `front`, told
/// by `scheduled_returns` (the same Serve app, under its own service name). They arrive for
/// 15 s, and the last of them wait out their answers (up to a minute).
fn urllib3_clients_told_by_scheduled_returns_get_in(front: SocketAddr) {
    let script = repo().join("tests/clients/retrying_clients.py");
    let out = retry_after_testkit::run_stdout(
        Command::new("python3")
            .arg(script)
            .args(["--url", &format!("http://{front}/scheduled")])
            .args(["--rate", "30", "--seconds", "15"])
            .args(["--retries", "3", "--seed", "7"]),
    );
    let record: serde_json::Value = serde_json::from_str(out.trim()).expect("the clients' record");
    let count = |key: &str| record[key].as_u64().unwrap();
    let (clients, succeeded, retries, admitted) = (
        count("clients"),
        count("succeeded"),
        count("retries"),
        count("retries_admitted"),
    );
    eprintln!(
        "urllib3 clients at 30/s, scheduled_returns: {clients} clients, {succeeded} succeeded, {} gave up; {retries} retries, {admitted} admitted",
        count("gave_up")
    );
    assert!(clients > 300);
    assert!(retries > 20, "the clients were rejected and retried");
    assert!(
        admitted as f64 >= SCHEDULED_ADMITTED_GUARD * retries as f64,
        "guard: retries at the agent's time got in"
    );
    assert!(
        succeeded as f64 >= SCHEDULED_SUCCEEDED_GUARD * clients as f64,
        "guard: nearly every client got in"
    );
}

/// The ingress keeps the places it promises (retry_after_ray with keep="header:x-api-key") to
/// urllib3 clients with a key each, at 1.5x the model's 20 requests a second for 20 s,
/// straight to Serve's port. Its figures move with the machine's load (Serve's proxy, ingress
/// and replicas are Python processes), so `./dev test` runs it with nothing beside it.
fn the_ingress_keeps_the_places_it_gives_to_keyed_urllib3_clients(
    serve: &ServeApps,
    agent: &AgentProcess,
) {
    let (kept, mid_run) = thread::scope(|s| {
        let asked = s.spawn(|| {
            thread::sleep(Duration::from_secs(12));
            agent.request("QUERY serve-kept").unwrap_or_default()
        });
        let kept = kept_clients(
            &format!("http://{}/kept/", serve.addr),
            30.0,
            20,
            31,
            Keep::Header,
        );
        (kept, asked.join().unwrap())
    });
    eprintln!("the agent mid-run: {}", mid_run.trim());
    let bound = clairvoyant_p99(&kept.arrivals, MODEL_PLACES, MODEL_TIME);
    let p99 = quantile(&kept.times, 0.99);
    // The ingress's last report reaches the agent within a second or two.
    thread::sleep(Duration::from_secs(3));
    let book = Book::read(&agent.metrics(), "serve-kept");
    let line = format!(
        "urllib3 clients at 30/s, kept returns in the ingress: {} clients, {:.1}% of {} retries admitted, {} gave up, {} errors, {} answered 429; p99 to success {p99:.1} s, the bound's {bound:.1} s ({:.2}x); the ingress's book: {}",
        kept.clients,
        100.0 * kept.admitted_share(),
        kept.retries,
        kept.gave_up,
        kept.errors,
        kept.answered_429,
        p99 / bound,
        book.describe(),
    );
    eprintln!("{line}");
    assert_eq!(kept.errors, 0);
    assert!(kept.retries > 50, "the load overloads the model");
    // Guards, not the targets (95% admitted, none giving up, p99 within 1.5x: HAProxy and
    // nginx keep them). The ingress paces the places at the drain the agent measures at
    // Serve's port (15 of the model's 20 requests a second, mid-run), which is the ingress's
    // own admissions: its count of the model's queue (ServeQueue) includes the requests
    // running, so it rarely sees the model idle and lets fresh arrivals fill it; and a return
    // it lets through at its place can still be refused by Serve's queue, and is then given a
    // new place at the back. docs/integrations/ray-serve.md gives the runs and the miss.
    assert!(
        kept.admitted_share() >= KEPT_ADMITTED_GUARD,
        "guard: {line}"
    );
    assert!(
        kept.gave_up as f64 <= KEPT_GAVE_UP_GUARD * kept.clients as f64,
        "guard, at most 1% giving up: {}",
        kept.gave_up_story()
    );
    assert!(p99 <= KEPT_P99_GUARD * bound, "guard: {line}");
    // The book's own account agrees with the clients': a place or a counted reason for every
    // 429, every admitted retry at its place or counted. (A place taken is not always a retry
    // admitted here: Serve may refuse it.)
    book.accounts_for_rejections(&kept, &line);
    book.accounts_for_admitted_retries(&kept, &line);
}
