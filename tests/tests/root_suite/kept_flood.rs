//! One address minting places through the distribution's HAProxy: with kept returns by
//! cookie, every rejection without a cookie is a new client to the book, so an address that
//! never keeps its cookies could take a place at each of its requests and fill every second up
//! to the horizon. With `RETRY_AFTER_SOURCE_SHARE_PERCENT` (the address from the last entry of
//! `X-Forwarded-For`, as a load balancer in front appends it), that address is given places at
//! most at its share of the drain, and honest clients, each with its own address and its own
//! cookie jar (real urllib3 `Retry` honouring Retry-After), keep theirs: admitted at them, none
//! giving up. The truth: the flood's own record of the places it was given (429s with a return
//! cookie), the honest clients' record, HAProxy's stats and the agent's `over_share` count.

use std::{path::PathBuf, process::Command, time::Duration};

use retry_after_testkit::{AgentProcess, free_port, http::HttpServer, proxies::Haproxy, run_ok};

use crate::kept_returns::{
    CAPACITY, KEPT_RETURNS, Keep, REPLICAS, SERVICE_TIME, agent_service, clairvoyant_p99,
    haproxy_frontend, kept_clients_with, quantile, tickets,
};

/// The service's name.
const SERVICE: &str = "flood";
/// The share of the drain one address may be given places at.
const SHARE_PERCENT: f64 = 25.0;
/// How long the flood and the honest clients go on.
const SECONDS: u32 = 20;
/// The flood's requests: 500 a second, each a new client to the book.
const FLOOD_REQUESTS: u32 = 10_000;

/// What the flood recorded.
#[derive(Debug)]
struct Flood {
    sent: u64,
    /// Requests let through: fresh arrivals into free room (no one in line, or the queue
    /// empty).
    admitted: u64,
    places: u64,
    hints: u64,
    errors: u64,
}

fn flood(url: &str) -> Flood {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("clients/key_rotation_flood.py");
    let out = run_ok(
        Command::new("python3")
            .arg(script)
            .args(["--url", url])
            .args(["--requests", &FLOOD_REQUESTS.to_string()])
            .args(["--seconds", &SECONDS.to_string()])
            .args(["--source", "203.0.113.9"]),
    );
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("the flood's record");
    let count = |key: &str| v[key].as_u64().unwrap_or_else(|| panic!("{key} in {out}"));
    Flood {
        sent: count("sent"),
        admitted: v["answered"]["200"].as_u64().unwrap_or(0),
        places: count("places"),
        hints: count("hints"),
        errors: count("errors"),
    }
}

#[test]
fn one_address_minting_cookies_gets_its_share_and_honest_clients_keep_their_places() {
    let replicas: Vec<HttpServer> = (0..REPLICAS)
        .map(|_| HttpServer::replica(SERVICE_TIME))
        .collect();
    let front = free_port();
    let agent = AgentProcess::start("", &agent_service(SERVICE, &replicas, None, KEPT_RETURNS));
    let secret = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(secret.path(), "the proxies' secret\n").unwrap();
    let haproxy = Haproxy::start_with_lua(
        &agent.socket,
        &[
            ("RETRY_AFTER_SERVICES", &format!("{SERVICE}:be_{SERVICE}")),
            ("RETRY_AFTER_STATIC", "5"),
            ("RETRY_AFTER_KEEP", &format!("{SERVICE}=cookie")),
            ("RETRY_AFTER_SECRET_FILE", secret.path().to_str().unwrap()),
            (
                "RETRY_AFTER_SOURCE_SHARE_PERCENT",
                &format!("{SHARE_PERCENT}"),
            ),
            ("RETRY_AFTER_SOURCE_HEADER", "x-forwarded-for"),
        ],
        &haproxy_frontend(SERVICE, front, &replicas),
    );
    let url = format!("http://{front}/");
    // Honest clients at 1.3× the fleet's capacity; the flood beside them.
    let (honest, flooded) = std::thread::scope(|s| {
        let honest = s.spawn(|| {
            kept_clients_with(
                &url,
                1.3 * CAPACITY,
                SECONDS,
                31,
                Keep::Cookie,
                &["--forwarded-for"],
            )
        });
        let flooded = s.spawn(|| flood(&url));
        (honest.join().unwrap(), flooded.join().unwrap())
    });
    std::thread::sleep(Duration::from_secs(3));
    let metrics = agent.metrics();
    let count = |outcome| tickets(&metrics, SERVICE, outcome);
    let stat = |field| haproxy.stat(&format!("fe_{SERVICE}"), "FRONTEND", field);
    let (issued, over_share) = (count("issued"), count("over_share"));
    let bound_p99 = clairvoyant_p99(&honest.arrivals, REPLICAS * 2, SERVICE_TIME);
    // What the honest clients can be promised: the room the address's share leaves, a fleet
    // of three places of four for the same arrivals.
    let share_bound_p99 = clairvoyant_p99(&honest.arrivals, REPLICAS * 2 * 3 / 4, SERVICE_TIME);
    let p99 = quantile(&honest.times, 0.99);
    eprintln!(
        "flood from one address: {flooded:?}; honest: {} clients, {:.1}% of {} retries admitted, \
         {} gave up, p99 to success {p99:.1} s, the bound's {bound_p99:.1} s (with three places \
         of four: {share_bound_p99:.1} s); agent: issued \
         {issued}, over_share {over_share}; HAProxy 2xx {} 4xx {}",
        honest.clients,
        100.0 * honest.admitted_share(),
        honest.retries,
        honest.gave_up,
        stat("hrsp_2xx"),
        stat("hrsp_4xx"),
    );
    assert_eq!((flooded.errors, honest.errors), (0, 0));
    assert_eq!(
        flooded.admitted + flooded.places + flooded.hints,
        flooded.sent,
        "every request answered 200 or 429"
    );
    // The address's share: 25% of the drain (16 a second) for 20 s, and a second's worth at
    // once, with a few seconds' slack for the drain rate the agent measured.
    let share = SHARE_PERCENT / 100.0 * CAPACITY;
    assert!(
        flooded.places as f64 <= share * (f64::from(SECONDS) + 4.0),
        "{} places for one address",
        flooded.places
    );
    // Every rejection of the flood without a place was counted as over its share (the
    // honest clients, one address each, are never over theirs).
    assert_eq!(over_share as u64, flooded.hints);
    // The honest clients kept their places.
    assert_eq!(honest.gave_up, 0, "{}", honest.gave_up_story());
    assert!(honest.admitted_share() >= 0.95, "{honest:?}");
    assert!(
        p99 <= 1.5 * share_bound_p99,
        "p99 {p99:.1} s, the bound's with the share left {share_bound_p99:.1} s"
    );
    assert_eq!(stat("hrsp_2xx"), honest.succeeded + flooded.admitted);
}
