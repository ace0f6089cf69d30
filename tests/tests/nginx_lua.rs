//! The nginx integration end to end: the distribution's nginx with its Lua module (LuaJIT)
//! running integrations/nginx/retry_after_nginx.lua over the shared policy module, two
//! workers, the real agent watching nginx's listener and the replicas from the kernel, wrk as
//! the load. nginx's `limit_req` holds what exceeds its rate in its own queue (requests at its
//! listener not yet forwarded, which the kernel sees) and rejects beyond the burst with 429.
//!
//! nginx's own access log records every response's status and Retry-After: every rejection
//! must carry one. While the agent runs the value is the agent's own answer for that queue
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
    time::{Duration, Instant},
};

use retry_after_protocol::{
    Response,
    policy::{QueueDepthSource, Rung},
};
use retry_after_testkit::{
    AgentProcess, free_port,
    http::{HttpServer, ServerOptions},
    proxies::{NGINX_LUA_MODULES, Nginx, Wrk, nginx_lua_package_path, nginx_workers_may_connect},
    rejections::{median, prober, values},
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
    HttpServer::start(
        "127.0.0.1:0",
        ServerOptions {
            response_body: 100,
            service_time: Duration::from_millis(250),
            ..Default::default()
        },
    )
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
         log_format rejections \"$status $sent_http_retry_after\";\n\
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
    let load = Wrk::start(front, 1, 60, 24);
    let stop = Arc::new(AtomicBool::new(false));
    let probes = prober(front, "/", stop.clone());
    let mut marks = Vec::new();
    let mut mark = |what: &str| marks.push((what.to_owned(), Instant::now()));
    // The agent's own answer for the queue it sees at nginx's listener.
    let agent_says = |agent: &AgentProcess| {
        let line = agent.request("QUERY api").unwrap();
        match Response::parse(&line) {
            Ok(Response::RetryAfter(a)) if a.rung == Rung::Computed => {
                assert_eq!(
                    a.queue_depth_source,
                    Some(QueueDepthSource::Frontend),
                    "{line}"
                );
                (a.seconds.unwrap(), a.queue_depth.unwrap())
            }
            other => panic!("not computed: {line} ({other:?})"),
        }
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

    // Computed: warm after 3 s of completions; give the average time to settle.
    thread::sleep(Duration::from_secs(6));
    mark("computed");
    thread::sleep(Duration::from_secs(2));
    let before_kill = agent_says(&agent);
    let busy_response = upstream_busy();
    thread::sleep(Duration::from_secs(2));
    mark("kill");
    agent.kill();
    // Stale after 1.5 s: nginx's static value.
    thread::sleep(Duration::from_millis(2500));
    mark("static");
    thread::sleep(Duration::from_secs(3));
    mark("restart");
    agent.restart();
    thread::sleep(Duration::from_secs(6));
    mark("computed again");
    thread::sleep(Duration::from_millis(1500));
    let after_restart = agent_says(&agent);
    thread::sleep(Duration::from_millis(1500));
    mark("end");
    let metrics = agent.metrics();
    stop.store(true, Ordering::SeqCst);
    let seen = probes.join().unwrap();
    drop(load);
    drop(nginx);

    let at = |name: &str| marks.iter().find(|(n, _)| n == name).unwrap().1;
    assert!(seen.len() > 100, "{} rejections probed", seen.len());
    for r in &seen {
        assert_eq!(r.status, 429, "{r:?}");
        let value = r
            .retry_after
            .as_deref()
            .unwrap_or_else(|| panic!("a rejection without Retry-After: {r:?}"));
        let seconds: u64 = value.parse().expect("delta-seconds");
        assert!((1..=60).contains(&seconds), "{seconds}");
    }
    // nginx's own record of every response: no rejection left without the header.
    let log = std::fs::read_to_string(&access_log).unwrap();
    let rejections: Vec<&str> = log.lines().filter(|l| l.starts_with("429 ")).collect();
    let without: Vec<&&str> = rejections
        .iter()
        .filter(|l| l.trim_end() == "429 -")
        .collect();
    eprintln!(
        "nginx logged {} responses, {} rejections, {} without Retry-After",
        log.lines().count(),
        rejections.len(),
        without.len()
    );
    assert!(rejections.len() > 1000, "wrk overloads nginx");
    assert!(
        without.is_empty(),
        "{} rejections without the header",
        without.len()
    );

    // While the agent computes: nginx's queue over the replicas' drain, the agent's own value.
    let computed = values(&seen, at("computed"), at("kill"));
    eprintln!("computed {computed:?}; the agent said {before_kill:?} (seconds, depth)");
    assert!(computed.iter().all(|v| *v != LUA_STATIC));
    assert!(
        before_kill.1 >= 10,
        "the kernel sees nginx's queue: {before_kill:?}"
    );
    assert!(median(computed).abs_diff(before_kill.0) <= 1);
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
    let fallback = values(&seen, at("static"), at("restart"));
    eprintln!("static {fallback:?}");
    assert!(!fallback.is_empty() && fallback.iter().all(|v| *v == LUA_STATIC));
    // Back: computed again, the restarted agent's own answer.
    let again = values(&seen, at("computed again"), at("end"));
    eprintln!("computed again {again:?}; the agent said {after_restart:?}");
    assert!(again.iter().all(|v| *v != LUA_STATIC));
    assert!(median(again).abs_diff(after_restart.0) <= 1);
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
    assert!(reported("rejected") <= rejections.len() as f64 + 1.0);
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
