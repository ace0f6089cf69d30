//! Return cookies across proxies: the distribution's HAProxy and nginx, each with the Lua
//! integration keeping returns by cookie for one service under one secret, verify the cookies
//! the other minted with their own HMAC-SHA1 (HAProxy's `hmac` converter, OpenResty's
//! `ngx.hmac_sha1`). Both turn every fresh arrival away (HAProxy's queue bound set for every
//! request, nginx's `limit_req` at one a minute), so a 200 is a return let in at its place; the
//! proxies say which (HAProxy's `txn.retry_after_kept`, nginx's `limit_req` key emptied).
//! What is measured, and stated in docs/integrations/haproxy.md: a cookie is admitted once by
//! each proxy that has not seen it spent, so through two proxies twice; shown again to either,
//! it is a fresh arrival; a forged one is refused by both.

use std::{net::SocketAddr, thread, time::Duration};

use retry_after_testkit::kept_returns::{QUEUE_LIMIT, agent_service, haproxy_frontend};
use retry_after_testkit::{
    AgentProcess, free_port,
    http::HttpServer,
    proxies::{Haproxy, NGINX_LUA_MODULES, Nginx, nginx_workers_may_connect},
};

use retry_after_testkit::{
    http::{Seen, get_with},
    nginx_kept::{Keeping, SERVICE, http_block},
};

/// The return cookie's name, the integrations' default.
const COOKIE: &str = "retry_after_return";

/// The cookie's value (`<due>.<nonce>.<mac>`) from a rejection's `Set-Cookie`.
fn cookie_value(seen: &Seen) -> String {
    let set = seen
        .set_cookie
        .as_deref()
        .unwrap_or_else(|| panic!("a rejection in cookie mode sets the cookie: {seen:?}"));
    let pair = set.split(';').next().unwrap();
    pair.strip_prefix(&format!("{COOKIE}="))
        .unwrap_or_else(|| panic!("not the return cookie: {set}"))
        .to_owned()
}

/// A GET at `front` carrying the return cookie `value`.
fn with_cookie(front: SocketAddr, value: &str, header: &str) -> Seen {
    get_with(front, &format!("Cookie: {COOKIE}={value}"), header)
}

#[test]
fn haproxy_and_nginx_admit_each_others_cookies_once_each() {
    let replicas: Vec<HttpServer> = (0..2)
        .map(|_| HttpServer::replica(Duration::from_millis(5)))
        .collect();
    let (ha_front, ngx_front) = (free_port(), free_port());
    let agent = AgentProcess::start(
        &nginx_workers_may_connect(),
        &agent_service(
            SERVICE,
            &replicas,
            None,
            "retry_after_policy = \"kept_returns\"\nretry_after_s = 3\n",
        ),
    );
    // nginx's workers (nobody) read the secret and write the log.
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "the proxies' secret\n").unwrap();
    for (path, mode) in [(dir.path(), 0o777), (secret.as_path(), 0o644)] {
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    }
    // HAProxy: the queue's bound holds for every request, so only a place due gets in.
    let frontend = haproxy_frontend(SERVICE, ha_front, &replicas)
        .replace(
            &format!(" if {{ queue(be_{SERVICE}) ge {QUEUE_LIMIT} }}"),
            "",
        )
        .replace(
            "    default_backend",
            "    http-after-response set-header x-kept %[var(txn.retry_after_kept)]\n    default_backend",
        );
    assert!(
        frontend.contains("set-var(txn.reject) bool(true)\n"),
        "{frontend}"
    );
    let _haproxy = Haproxy::start_with_lua(
        &agent.socket,
        &[
            ("RETRY_AFTER_SERVICES", &format!("{SERVICE}:be_{SERVICE}")),
            ("RETRY_AFTER_STATIC", "3"),
            ("RETRY_AFTER_KEEP", &format!("{SERVICE}=cookie")),
            ("RETRY_AFTER_SECRET_FILE", &secret.display().to_string()),
        ],
        &frontend,
    );
    // nginx: limit_req lets one request a minute through, none waiting.
    let _nginx = Nginx::start_with(
        &format!("{NGINX_LUA_MODULES}worker_processes 2;\n"),
        &http_block(
            ngx_front,
            &replicas,
            &agent.socket,
            dir.path(),
            "8m",
            &Keeping {
                key: "cookie",
                per_minute: 1,
                burst: 0,
            },
            "    add_header x-limit \"[$retry_after_limit]\" always;\n",
        ),
        None,
    );
    // Both proxies hold the agent's push (every tick): places are kept at its hint.
    thread::sleep(Duration::from_secs(3));
    let ha = |value: &str| with_cookie(ha_front, value, "x-kept");
    let ngx = |value: &str| with_cookie(ngx_front, value, "x-limit");
    let (ha_returned, ngx_returned) = ("returned", "[]");

    // Each proxy turns a fresh arrival away with a place and its cookie.
    let from_ha = ha("none");
    assert_eq!(from_ha.status, 429, "{from_ha:?}");
    // nginx's first request of the minute passes limit_req; the next does not.
    let mut from_ngx = ngx("none");
    if from_ngx.status == 200 {
        from_ngx = ngx("none");
    }
    assert_eq!(from_ngx.status, 429, "{from_ngx:?}");
    let (ha_cookie, ngx_cookie) = (cookie_value(&from_ha), cookie_value(&from_ngx));
    let wait = from_ha.retry_after.max(from_ngx.retry_after).unwrap();
    eprintln!("HAProxy minted {ha_cookie}, nginx {ngx_cookie}; both due within {wait} s");

    // A forged cookie (its MAC's last digit changed) is a fresh arrival at both.
    let mut forged = ha_cookie.clone();
    let last = forged.pop().unwrap();
    forged.push(if last == '0' { '1' } else { '0' });
    thread::sleep(Duration::from_secs(wait));
    for seen in [ha(&forged), ngx(&forged)] {
        assert_eq!(seen.status, 429, "a forged cookie holds no place: {seen:?}");
    }

    // A request let in as a return: 200, and the proxy's own word for it.
    let admitted = |seen: Seen, returned: &str, what: &str| {
        assert_eq!(
            (seen.status, seen.kept.as_str()),
            (200, returned),
            "{what}: {seen:?}"
        );
    };
    // Each proxy admits the other's cookie at its place, with its own HMAC.
    admitted(
        ngx(&ha_cookie),
        ngx_returned,
        "nginx admits HAProxy's cookie as a return",
    );
    admitted(
        ha(&ngx_cookie),
        ha_returned,
        "HAProxy admits nginx's cookie as a return",
    );
    // Shown again where it was taken, a cookie is a fresh arrival (replayed).
    for seen in [ngx(&ha_cookie), ha(&ngx_cookie)] {
        assert_eq!(
            seen.status, 429,
            "a spent cookie is not admitted again: {seen:?}"
        );
    }
    // Each proxy keeps its own record of spent cookies: the proxy that minted a cookie, not
    // having seen it spent, admits it once more. One cookie, two proxies: two admissions.
    admitted(
        ha(&ha_cookie),
        ha_returned,
        "HAProxy admits its own cookie once",
    );
    admitted(
        ngx(&ngx_cookie),
        ngx_returned,
        "nginx admits its own cookie once",
    );
    for seen in [
        ha(&ha_cookie),
        ngx(&ngx_cookie),
        ha(&ngx_cookie),
        ngx(&ha_cookie),
    ] {
        assert_eq!(seen.status, 429, "no third admission: {seen:?}");
    }
}
