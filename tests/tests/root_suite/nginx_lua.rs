//! The nginx integration end to end: the distribution's nginx with its Lua module (LuaJIT)
//! running integrations/nginx/retry_after_nginx.lua over the shared policy module, two
//! workers, the real agent watching nginx's listener and the replicas from the kernel, wrk as
//! the load. nginx's `limit_req` holds what exceeds its rate in its own queue (requests at its
//! listener not yet forwarded, which the kernel sees) and rejects beyond the burst with 429.
//!
//! nginx's own access log records every response's status, Retry-After and retry-after-ms:
//! every rejection must carry both, saying the same time. While the agent runs the value is the agent's own answer for that queue
//! (its `QUERY`), with the agent stopped nginx's static value, and the agent's again after it
//! restarts. An upstream's 503 without a header gets one too.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use retry_after_protocol::{
    Response,
    policy::{QueueDepthSource, Rung},
};
use retry_after_testkit::{
    AgentProcess, free_port,
    http::HttpServer,
    proxies::{NGINX_LUA_MODULES, Nginx, Wrk, nginx_lua_package_path, nginx_workers_may_connect},
    rejections::{PROBE_WAIT, median, outage, prober, values},
    sample,
};

/// nginx's own fallback: the computed values here stay far below it.
const LUA_STATIC: u64 = 31;

/// The directory of the nginx glue and its example.
fn nginx_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../integrations/nginx")
        .canonicalize()
        .unwrap()
}

fn replica() -> HttpServer {
    HttpServer::replica(Duration::from_millis(250))
}

#[test]
fn nginx_rejections_carry_the_computed_value_then_the_static_one_then_the_computed_again() {
    let (r1, r2) = (replica(), replica());
    let (front, busy) = (free_port(), free_port());
    let logs = tempfile::tempdir().unwrap();
    let access_log = logs.path().join("access.log");
    let mut agent = AgentProcess::start(
        &nginx_workers_may_connect(),
        &format!(
            "[[service]]\nname = \"api\"\nfrontend = \"{front}\"\nbackends = [{{ address = \"{}\", max_ongoing_requests = 2 }}, {{ address = \"{}\", max_ongoing_requests = 2 }}]\n[service.backpressure]\nretry_after_policy = \"router_queue_drain_rate\"\nretry_after_s = 7\njitter = 0.0\n",
            r1.addr(),
            r2.addr()
        ),
    );
    let http = format!(
        "lua_package_path \"{}\";\n\
         lua_shared_dict retry_after 1m;\n\
         init_worker_by_lua_block {{ require(\"retry_after_nginx\").start({{ services = {{ \"api\" }}, socket = \"{}\", retry_after_s = {LUA_STATIC}, stale_ms = 1500, reconnect_max_ms = 1000 }}) }}\n\
         limit_req_zone $server_name zone=api:1m rate=12r/s;\n\
         log_format rejections \"$status $sent_http_retry_after $sent_http_retry_after_ms $msec\";\n\
         upstream replicas {{ server {}; server {}; keepalive 16; }}\n\
         server {{ listen {busy}; return 503; }}\n\
         server {{\n  listen {front};\n  server_name api;\n  access_log {} rejections;\n\
         \x20 location / {{\n    limit_req zone=api burst=30;\n    limit_req_status 429;\n    proxy_http_version 1.1;\n    proxy_set_header Connection \"\";\n    proxy_pass http://replicas;\n    header_filter_by_lua_block {{ require(\"retry_after_nginx\").stamp(\"api\") }}\n  }}\n\
         \x20 location /busy {{ proxy_pass http://{busy}; header_filter_by_lua_block {{ require(\"retry_after_nginx\").stamp(\"api\") }} }}\n}}\n",
        nginx_lua_package_path(),
        agent.socket.display(),
        r1.addr(),
        r2.addr(),
        access_log.display(),
    );
    let nginx = Nginx::start_with(
        &format!("{NGINX_LUA_MODULES}worker_processes 2;\n"),
        &http,
        None,
    );
    // Longer than the outage's schedule (about 27 s here).
    let load = Wrk::start(front, 1, 60, 60);
    let stop = Arc::new(AtomicBool::new(false));
    let probes = prober(front, "/", PROBE_WAIT, stop.clone());
    // The agent's own answers for the queue it sees at nginx's listener, which moves as
    // nginx's burst fills and drains: five, 250 ms apart, as (lowest, highest, depths), once
    // it computes.
    let agent_says = |agent: &AgentProcess| {
        let answers: Vec<(u64, u64)> = (0..5)
            .map(|_| {
                thread::sleep(Duration::from_millis(250));
                let line = agent.request("QUERY api").unwrap();
                match Response::parse(&line) {
                    Ok(Response::RetryAfter(a)) if a.rung == Rung::Computed => {
                        assert_eq!(
                            a.queue_depth_source,
                            Some(QueueDepthSource::Frontend),
                            "{line}"
                        );
                        Some((a.seconds.unwrap(), a.queue_depth.unwrap()))
                    }
                    Ok(Response::RetryAfter(_)) => None,
                    other => panic!("not an answer: {line} ({other:?})"),
                }
            })
            .collect::<Option<_>>()?;
        let seconds = answers.iter().map(|a| a.0);
        let depths: Vec<u64> = answers.iter().map(|a| a.1).collect();
        Some((
            seconds.clone().min().unwrap(),
            seconds.max().unwrap(),
            depths,
        ))
    };
    let upstream_busy = || {
        let target = format!("127.0.0.1:{}", front.port());
        let mut stream = std::net::TcpStream::connect(target).unwrap();
        use std::io::{Read, Write};
        stream
            .write_all(b"GET /busy HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut text = String::new();
        let _ = stream.read_to_string(&mut text);
        text
    };

    let outage = outage(&mut agent, |agent| {
        agent_says(agent).map(|says| (says, upstream_busy()))
    });
    let (before_kill, busy_response) = outage.before.clone();
    let after_restart = outage.after.0.clone();
    let metrics = agent.metrics();
    let metrics_read = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    stop.store(true, Ordering::SeqCst);
    let seen = probes.join().unwrap();
    drop(load);
    drop(nginx);

    assert!(seen.len() > 100, "{} rejections probed", seen.len());
    for r in &seen {
        assert_eq!(r.status, 429, "{r:?}");
        let value = r.retry_after.as_deref().unwrap_or_else(|| {
            panic!(
                "a rejection without Retry-After: {r:?}, {}",
                outage.describe(r.at)
            )
        });
        let seconds: u64 = value.parse().expect("delta-seconds");
        assert!((1..=60).contains(&seconds), "{seconds}");
        assert!(
            r.millis_agree(),
            "retry-after-ms does not say the Retry-After's time: {r:?}"
        );
    }
    // nginx's own record of every response: no rejection left without the header.
    let log = std::fs::read_to_string(&access_log).unwrap();
    let rejections: Vec<&str> = log.lines().filter(|l| l.starts_with("429 ")).collect();
    let lacking = |field: usize| {
        rejections
            .iter()
            .filter(|l| l.split(' ').nth(field) == Some("-"))
            .count()
    };
    let (without, without_ms) = (lacking(1), lacking(2));
    eprintln!(
        "nginx logged {} responses, {} rejections, {without} without Retry-After, {without_ms} without retry-after-ms",
        log.lines().count(),
        rejections.len(),
    );
    assert!(rejections.len() > 1000, "wrk overloads nginx");
    assert_eq!(without, 0, "rejections without Retry-After");
    assert_eq!(without_ms, 0, "rejections without retry-after-ms");

    // While the agent computes: nginx's queue over the replicas' drain, the agent's own value.
    let computed = values(&seen, outage.computed);
    eprintln!(
        "computed {computed:?}; the agent said {before_kill:?} (lowest and highest seconds, depths)"
    );
    assert!(computed.iter().all(|v| *v != LUA_STATIC));
    assert!(
        before_kill.2.iter().all(|d| *d >= 10),
        "the kernel sees nginx's queue: {before_kill:?}"
    );
    assert!((before_kill.0.saturating_sub(1)..=before_kill.1 + 1).contains(&median(computed)));
    // The upstream's 503 carried none: it got the agent's.
    eprintln!(
        "upstream busy: {:?}",
        busy_response.lines().take(8).collect::<Vec<_>>()
    );
    assert!(busy_response.starts_with("HTTP/1.1 503"));
    let busy_value = busy_response
        .lines()
        .find_map(|l| l.strip_prefix("Retry-After: "))
        .expect("the upstream's 503 got a Retry-After");
    assert_ne!(busy_value.trim(), LUA_STATIC.to_string());
    // Agent gone: nginx's own static value, on every rejection.
    let fallback = values(&seen, outage.fallback);
    eprintln!("static {fallback:?}");
    assert!(!fallback.is_empty() && fallback.iter().all(|v| *v == LUA_STATIC));
    // Back: computed again, the restarted agent's own answer.
    let again = values(&seen, outage.again);
    eprintln!("computed again {again:?}; the agent said {after_restart:?}");
    assert!(again.iter().all(|v| *v != LUA_STATIC));
    assert!((after_restart.0.saturating_sub(1)..=after_restart.1 + 1).contains(&median(again)));
    // nginx reported what it did, to the restarted agent too.
    let reported = |outcome: &str| {
        sample(
            &metrics,
            &format!("retry_after_proxy_requests_total{{outcome=\"{outcome}\",service=\"api\"}}"),
        )
        .unwrap_or(0.0)
    };
    eprintln!(
        "reported to the restarted agent: {} admitted, {} rejected",
        reported("admitted"),
        reported("rejected")
    );
    assert!(reported("admitted") > 0.0 && reported("rejected") > 0.0);
    // No more than nginx logged by the time the metrics were read (its log's `$msec`).
    let logged_by_then = rejections
        .iter()
        .filter(|l| {
            l.split(' ')
                .nth(3)
                .and_then(|t| t.parse::<f64>().ok())
                .is_some_and(|t| t <= metrics_read)
        })
        .count();
    eprintln!("nginx logged {logged_by_then} rejections by the time the metrics were read");
    assert!(reported("rejected") <= logged_by_then as f64);
}

#[test]
fn the_example_configuration_is_valid_for_the_distributions_nginx() {
    let example = std::fs::read_to_string(nginx_dir().join("nginx.conf")).unwrap();
    assert!(example.contains("lua_package_path \"/etc/nginx/lua/?.lua;;\";"));
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("nginx.conf");
    std::fs::write(
        &config,
        example.replace("/etc/nginx/lua/?.lua;;", &nginx_lua_package_path()),
    )
    .unwrap();
    let out = Command::new("nginx")
        .arg("-t")
        .arg("-c")
        .arg(&config)
        .arg("-p")
        .arg(dir.path())
        .output()
        .expect("nginx is installed (./dev setup installs it)");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("test is successful"), "{text}");
}
