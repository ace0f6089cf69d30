//! Kept returns while the agent is away: through the distribution's HAProxy and nginx (the
//! Lua integrations, keyed by `x-api-key`), both overloaded by wrk, a client rejected while
//! the agent runs is given a place and gets in at it past the full queue; killed, the agent
//! leaves the proxies without a fresh estimate, and a client rejected then is told the static
//! value and given no place, so that its return five seconds later competes as a fresh arrival
//! and does not pass the queue's bound. The truth is what the proxies did with the request:
//! HAProxy's `txn.retry_after_kept` and nginx's `limit_req` key (emptied for a return), each
//! sent back in a response header, and the status.

use std::{net::SocketAddr, path::Path, thread, time::Duration};

use retry_after_testkit::kept_returns::{SERVICE_TIME, agent_service, haproxy_frontend};
use retry_after_testkit::{
    AgentProcess, free_port,
    http::HttpServer,
    proxies::{Haproxy, NGINX_LUA_MODULES, Nginx, Wrk, nginx_workers_may_connect},
};

use retry_after_testkit::http::{Seen, get_with};
use retry_after_testkit::nginx_kept::{BY_KEY, SERVICE, http_block};

/// The HAProxy service's name (nginx's is [`SERVICE`]).
const HAPROXY_SERVICE: &str = "outage";
/// The static value the proxies answer with when no estimate is fresh.
const STATIC_S: u64 = 5;

/// One GET with `key` as `x-api-key`, reading `header` for what the book did.
fn get(front: SocketAddr, key: &str, header: &str) -> Seen {
    get_with(front, &format!("x-api-key: {key}"), header)
}

/// A client with `key` rejected at `front`, then back when it was told: both answers.
fn reject_then_return(front: SocketAddr, key: &str, header: &str) -> (Seen, Seen) {
    // The overload keeps the queue full; a few tries find the client rejected.
    let first = (0..20)
        .map(|_| get(front, key, header))
        .find(|s| s.status == 429)
        .unwrap_or_else(|| panic!("{front} never rejected {key} under wrk's overload"));
    let wait = first
        .retry_after
        .unwrap_or_else(|| panic!("a rejection without Retry-After: {first:?}"));
    thread::sleep(Duration::from_secs(wait));
    (first, get(front, key, header))
}

/// HAProxy keeping returns for [`HAPROXY_SERVICE`] (the suite's frontend), with what the book
/// did sent back as `x-kept`.
fn haproxy(agent: &Path, secret: &Path, front: SocketAddr, replicas: &[HttpServer]) -> Haproxy {
    let frontend = haproxy_frontend(HAPROXY_SERVICE, front, replicas).replace(
        "    default_backend",
        "    http-after-response set-header x-kept %[var(txn.retry_after_kept)]\n    default_backend",
    );
    Haproxy::start_with_lua(
        agent,
        &[
            (
                "RETRY_AFTER_SERVICES",
                &format!("{HAPROXY_SERVICE}:be_{HAPROXY_SERVICE}"),
            ),
            ("RETRY_AFTER_STATIC", &STATIC_S.to_string()),
            (
                "RETRY_AFTER_KEEP",
                &format!("{HAPROXY_SERVICE}=header:x-api-key"),
            ),
            ("RETRY_AFTER_SECRET_FILE", &secret.display().to_string()),
        ],
        &frontend,
    )
}

#[test]
fn without_the_agent_a_rejection_gets_the_static_value_and_no_place_past_the_queue() {
    let ha_replicas: Vec<HttpServer> = (0..2).map(|_| HttpServer::replica(SERVICE_TIME)).collect();
    let ngx_replicas: Vec<HttpServer> = (0..2)
        .map(|_| HttpServer::replica(Duration::from_millis(5)))
        .collect();
    let (ha_front, ngx_front) = (free_port(), free_port());
    let kept = format!("retry_after_policy = \"kept_returns\"\nretry_after_s = {STATIC_S}\n");
    let mut agent = AgentProcess::start(
        &nginx_workers_may_connect(),
        &(agent_service(HAPROXY_SERVICE, &ha_replicas, None, &kept)
            + &agent_service(SERVICE, &ngx_replicas, Some(ngx_front), &kept)),
    );
    // nginx's workers (nobody) read the secret and write the log.
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "the proxies' secret\n").unwrap();
    for (path, mode) in [(dir.path(), 0o777), (secret.as_path(), 0o644)] {
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    }
    let _haproxy = haproxy(&agent.socket, &secret, ha_front, &ha_replicas);
    let _nginx = Nginx::start_with(
        &format!("{NGINX_LUA_MODULES}worker_processes 2;\n"),
        &http_block(
            ngx_front,
            &ngx_replicas,
            &agent.socket,
            dir.path(),
            "8m",
            &BY_KEY,
            "    add_header x-limit \"[$retry_after_limit]\" always;\n",
        ),
        None,
    );
    let _load: Vec<Wrk> = [ha_front, ngx_front]
        .iter()
        .map(|front| Wrk::start(*front, 1, 32, 60))
        .collect();
    // The agent's drain rates warm up under the load: both answers computed.
    for service in [HAPROXY_SERVICE, SERVICE] {
        let computed = (0..60).any(|_| {
            thread::sleep(Duration::from_millis(500));
            agent
                .request(&format!("QUERY {service} queue_depth=8"))
                .is_ok_and(|line| line.contains("rung=computed"))
        });
        assert!(
            computed,
            "{service}: the agent's answer is computed within 30 s"
        );
    }
    // And the proxies hold a push that says so (pushed every tick).
    thread::sleep(Duration::from_secs(2));
    // Each front, the header its proxy says what it did in, what it says of a return at its
    // place, and of a fresh arrival (HAProxy: queued into room, or rejected; nginx: the key
    // `limit_req` counts, the server's name, empty for a return).
    let ngx_fresh = format!("[{SERVICE}]");
    let fronts = [
        (ha_front, "x-kept", "returned", ["queued", "rejected"]),
        (ngx_front, "x-limit", "[]", [ngx_fresh.as_str(); 2]),
    ];

    for (front, header, returned, _) in fronts {
        let (first, back) = reject_then_return(front, "while-the-agent-runs", header);
        eprintln!("{front}, the agent running: {first:?}, then {back:?}");
        assert_eq!(
            (back.status, back.kept.as_str()),
            (200, returned),
            "a place given while the agent runs is kept past the full queue"
        );
    }

    agent.kill();
    // Past the proxies' stale_ms (5 s): no estimate is fresh.
    thread::sleep(Duration::from_secs(7));
    for (front, header, _, fresh) in fronts {
        let (first, back) = reject_then_return(front, "while-the-agent-is-away", header);
        eprintln!("{front}, the agent away: {first:?}, then {back:?}");
        assert_eq!(first.retry_after, Some(STATIC_S), "the static value");
        assert!(
            fresh.contains(&back.kept.as_str()) && [200, 429].contains(&back.status),
            "no place at a second that knows no room: the return is a fresh arrival: {back:?}"
        );
    }
}
