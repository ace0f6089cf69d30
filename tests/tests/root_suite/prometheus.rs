//! The shipped alerting and recording rules (deploy/prometheus/) and Grafana dashboard
//! (deploy/grafana/) against the distribution's Prometheus scraping a running agent under
//! load: every rule evaluates without error, every recording rule and every dashboard query
//! returns series, and the alert meant to fire does: the judge's admitted share under a static
//! 1 s policy at well over capacity (`RetryAfterJudgeAdmittedShareLow`), while the alerts
//! about a broken agent stay quiet.
//!
//! Two services, so that every panel has something to show: `static_1s` (the alert's), and
//! `kept` (`kept_returns`, HAProxy keeping places by source address, so that tickets are
//! reported), both behind the distribution's HAProxy with the Lua integration and loaded at
//! 1.5× their capacity by urllib3 clients that honour Retry-After. A scenario of `one_agent`:
//! the agent Prometheus scrapes carries the other scenarios' services too.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use retry_after_testkit::kept_returns::{
    CAPACITY, Keep, QUEUE_LIMIT, REPLICAS, SERVICE_TIME, agent_service, haproxy_frontend,
    kept_clients,
};
use retry_after_testkit::{AgentProcess, free_port, http::HttpServer, proxies::Haproxy};
use serde_json::Value;

use crate::one_agent::Scenario;
use retry_after_testkit::proxies::haproxy_frontend_rejecting_at;

/// The services: the alert's, and the one whose proxy keeps places.
const SERVICES: [&str; 2] = ["static_1s", "kept"];

fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// The distribution's Prometheus, scraping the agent every second and evaluating the shipped
/// rules every second; killed when dropped.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    _data: tempfile::TempDir,
}

impl Prometheus {
    fn start(agent_metrics: SocketAddr) -> Self {
        let data = tempfile::tempdir().unwrap();
        let rules = deploy()
            .join("prometheus/retry-after-agent.rules.yml")
            .canonicalize()
            .unwrap();
        let config = data.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: retry-after-agent\n    static_configs:\n      - targets: ['{agent_metrics}']\n",
                rules.display()
            ),
        )
        .unwrap();
        let addr = free_port();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                data.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the distribution's prometheus is installed (./dev setup installs it)");
        let prometheus = Self {
            child,
            addr,
            _data: data,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while get(addr, "/-/ready").is_none_or(|(status, _)| status != 200) {
            assert!(Instant::now() < deadline, "Prometheus did not become ready");
            thread::sleep(Duration::from_millis(200));
        }
        prometheus
    }

    /// A query's result (the `data.result` array), asserting the API said success.
    fn query(&self, promql: &str) -> Vec<Value> {
        let (status, body) = get(
            self.addr,
            &format!("/api/v1/query?query={}", encode(promql)),
        )
        .expect("Prometheus answers");
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("{body}"));
        assert_eq!(
            (status, v["status"].as_str()),
            (200, Some("success")),
            "{promql}: {body}"
        );
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The `data` of an API path.
    fn api(&self, path: &str) -> Value {
        let (_, body) = get(self.addr, path).expect("Prometheus answers");
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|_| panic!("{body}"));
        v["data"].clone()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.0 GET: status and body.
fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(addr).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: prometheus\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let (_, body) = text.split_once("\r\n\r\n")?;
    Some((status, body.to_owned()))
}

/// `text` percent-encoded for a query string.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every `expr` of the dashboard's panels.
fn dashboard_queries() -> Vec<String> {
    let text = std::fs::read_to_string(deploy().join("grafana/retry-after-agent.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let mut found = Vec::new();
    collect_exprs(&dashboard["panels"], &mut found);
    found
}

fn collect_exprs(v: &Value, found: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            if let Some(Value::String(expr)) = map.get("expr") {
                found.push(expr.clone());
            }
            map.values().for_each(|v| collect_exprs(v, found));
        }
        Value::Array(items) => items.iter().for_each(|v| collect_exprs(v, found)),
        _ => {}
    }
}

/// The state of `alert` in Prometheus's alerts (`firing`, `pending`), or `None`.
fn alert_state(prometheus: &Prometheus, alert: &str, service: Option<&str>) -> Option<String> {
    prometheus.api("/api/v1/alerts")["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| {
            a["labels"]["alertname"] == alert && service.is_none_or(|s| a["labels"]["service"] == s)
        })
        .map(|a| a["state"].as_str().unwrap().to_owned())
}

/// The two services of [`SERVICES`] behind one HAProxy, loaded at 1.5× their capacity by
/// urllib3 clients that honour Retry-After, and Prometheus scraping the agent they share with
/// the other scenarios of `one_agent`.
pub(crate) struct ShippedRulesOnPrometheus {
    replicas: [Vec<HttpServer>; 2],
    fronts: [SocketAddr; 2],
}

impl ShippedRulesOnPrometheus {
    /// How long the clients keep arriving: the alert's `for` (1m) after the judge's first
    /// verdicts, and a margin.
    const LOAD_SECONDS: u32 = 100;

    pub(crate) fn new() -> Self {
        let replicas = || {
            (0..REPLICAS)
                .map(|_| HttpServer::replica(SERVICE_TIME))
                .collect()
        };
        Self {
            replicas: [replicas(), replicas()],
            // HAProxy's listeners are the services' frontends: the agent sees its queues.
            fronts: [free_port(), free_port()],
        }
    }
}

impl Scenario for ShippedRulesOnPrometheus {
    fn name(&self) -> &'static str {
        "prometheus"
    }

    fn services(&self) -> String {
        let policies = [
            "retry_after_policy = \"static\"\nretry_after_s = 1\n",
            "retry_after_policy = \"kept_returns\"\nretry_after_s = 5\n",
        ];
        SERVICES
            .iter()
            .zip(&self.replicas)
            .zip(policies)
            .zip(&self.fronts)
            .map(|(((name, replicas), policy), front)| {
                agent_service(name, replicas, Some(*front), policy)
            })
            .collect()
    }

    fn run(&self, agent: &AgentProcess) {
        let (replicas, fronts) = (&self.replicas, &self.fronts);
        let secret = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(secret.path(), "the proxies' secret\n").unwrap();
        let _haproxy = Haproxy::start_with_lua(
            &agent.socket,
            &[
                (
                    "RETRY_AFTER_SERVICES",
                    "static_1s:be_static_1s,kept:be_kept",
                ),
                ("RETRY_AFTER_STATIC", "5"),
                ("RETRY_AFTER_KEEP", "kept=source"),
                (
                    "RETRY_AFTER_SECRET_FILE",
                    &secret.path().display().to_string(),
                ),
            ],
            &(haproxy_frontend_rejecting_at(
                "static_1s",
                fronts[0],
                QUEUE_LIMIT,
                &replicas[0].iter().collect::<Vec<_>>(),
            ) + &haproxy_frontend("kept", fronts[1], &replicas[1])),
        );
        let prometheus = Prometheus::start(agent.metrics);
        thread::scope(|s| {
            for (front, seed) in fronts.iter().zip([51, 52]) {
                s.spawn(move || {
                    let url = format!("http://{front}/");
                    kept_clients(&url, 1.5 * CAPACITY, Self::LOAD_SECONDS, seed, Keep::Header)
                });
            }
            check(&prometheus);
        });
    }
}

/// What Prometheus says of the loaded agent: the alert fires, every rule is healthy, every
/// recording rule and dashboard query has series, the broken-agent alerts stay quiet.
fn check(prometheus: &Prometheus) {
    // The alert meant to fire: the judge sees retries told "1 s" rejected again. Its `for` is
    // 1m: pending first, then firing.
    let deadline = Instant::now() + Duration::from_secs(110);
    let mut pending_at = None;
    loop {
        // Of the service told 1 s: the agent holds the other scenarios' services too.
        let state = alert_state(
            prometheus,
            "RetryAfterJudgeAdmittedShareLow",
            Some("static_1s"),
        );
        if state.as_deref() == Some("pending") && pending_at.is_none() {
            pending_at = Some(Instant::now());
        }
        if state.as_deref() == Some("firing") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "RetryAfterJudgeAdmittedShareLow is {state:?}; the share: {:?}",
            prometheus.query("retry_after_judge_admitted_ratio")
        );
        thread::sleep(Duration::from_secs(1));
    }
    let share = prometheus.query("retry_after_judge_admitted_ratio{service=\"static_1s\"}");
    eprintln!(
        "RetryAfterJudgeAdmittedShareLow firing ({}), the share: {share:?}",
        pending_at.map_or_else(
            || "pending before the first look".to_owned(),
            |at| format!("{:.0} s after it went pending", at.elapsed().as_secs_f64())
        )
    );

    // Every rule evaluated without error; every recording rule has series.
    let groups = prometheus.api("/api/v1/rules")["groups"].clone();
    let rules: Vec<&Value> = groups
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect();
    // Prometheus loaded every rule the shipped file holds.
    let shipped = std::fs::read_to_string(deploy().join("prometheus/retry-after-agent.rules.yml"))
        .unwrap()
        .lines()
        .filter(|l| {
            let l = l.trim_start();
            l.starts_with("- record:") || l.starts_with("- alert:")
        })
        .count();
    assert_eq!(rules.len(), shipped, "rules loaded, of the shipped file's");
    for rule in &rules {
        let name = rule["name"].as_str().unwrap();
        assert_eq!(rule["health"], "ok", "{name}: {}", rule["lastError"]);
        if rule["type"] == "recording" {
            // Recorded under its name, for one of the services at least.
            let series = prometheus.query(name);
            assert!(!series.is_empty(), "recording rule {name} has no series");
        }
    }
    // The alerts about a broken agent stay quiet.
    for quiet in [
        "RetryAfterAgentDown",
        "RetryAfterAgentAbsent",
        "RetryAfterProbeProblems",
        "RetryAfterKernelFeatureOff",
        "RetryAfterTickErrors",
        "RetryAfterSocketWriteTimeouts",
    ] {
        assert_eq!(alert_state(prometheus, quiet, None), None, "{quiet}");
    }

    // Every dashboard query returns series for one of the services (tickets exist only for
    // the service that keeps places, the judge's static rung only for the static one).
    let queries = dashboard_queries();
    assert!(queries.len() >= 20, "{} dashboard queries", queries.len());
    for expr in &queries {
        let answered: Vec<(&str, usize)> = SERVICES
            .iter()
            .map(|service| {
                let promql = expr
                    .replace("$service", service)
                    .replace("$__rate_interval", "1m");
                (*service, prometheus.query(&promql).len())
            })
            .collect();
        eprintln!("{answered:?} series: {expr}");
        assert!(answered.iter().any(|(_, n)| *n > 0), "no series for {expr}");
    }
    eprintln!(
        "{} rules evaluated, {} dashboard queries answered",
        rules.len(),
        queries.len()
    );
}

#[test]
fn the_shipped_rules_pass_promtool_check_and_their_unit_tests() {
    let dir = deploy().join("prometheus");
    for args in [
        ["check", "rules", "retry-after-agent.rules.yml"],
        ["test", "rules", "tests/retry-after-agent.test.yml"],
    ] {
        let out = Command::new("promtool")
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("the distribution's promtool is installed (./dev setup installs prometheus)");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("promtool {}:\n{text}", args.join(" "));
        assert!(out.status.success() && text.contains("SUCCESS"), "{text}");
    }
}
