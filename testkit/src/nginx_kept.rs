//! nginx keeping returns with the Lua integration before `limit_req`, as the example
//! configuration has it: the http block several suites run (the book under load, the agent
//! away, return cookies).

use std::path::Path;

use crate::{http::HttpServer, kept_returns::QUEUE_LIMIT, proxies::nginx_lua_package_path};

/// The service's name, in the agent and in nginx.
pub const SERVICE: &str = "api";
/// limit_req's rate, requests a second: the bound nothing may pass around.
pub const RATE: u64 = 200;

/// How nginx keeps returns in [`http_block`]: the key (`header:x-api-key`, `cookie`) and
/// `limit_req`'s rate (requests a minute) and burst.
pub struct Keeping<'a> {
    pub key: &'a str,
    pub per_minute: u64,
    pub burst: u32,
}

/// The suite's keeping: by `x-api-key`, [`RATE`] a second with a burst of [`QUEUE_LIMIT`].
pub const BY_KEY: Keeping<'static> = Keeping {
    key: "header:x-api-key",
    per_minute: RATE * 60,
    burst: QUEUE_LIMIT,
};

/// The http block: kept returns as `keeping` says before `limit_req`, as the example
/// configuration has it, with a tickets dictionary of `tickets_dict`, a log of each answer's
/// status and Retry-After, and `location` lines added to the location.
pub fn http_block(
    front: std::net::SocketAddr,
    replicas: &[HttpServer],
    agent: &Path,
    dir: &Path,
    tickets_dict: &str,
    keeping: &Keeping<'_>,
    location: &str,
) -> String {
    let servers: String = replicas
        .iter()
        .map(|r| format!("server {}; ", r.addr()))
        .collect();
    let d = dir.display();
    let Keeping {
        key,
        per_minute,
        burst,
    } = keeping;
    // nginx refuses `burst=0`: no burst is written as none.
    let burst_clause = if *burst > 0 {
        format!(" burst={burst}")
    } else {
        String::new()
    };
    format!(
        "lua_package_path \"{}\";\n\
         lua_shared_dict retry_after 1m;\n\
         lua_shared_dict retry_after_tickets {tickets_dict};\n\
         init_worker_by_lua_block {{ require(\"retry_after_nginx\").start({{ services = {{ \"{SERVICE}\" }}, socket = \"{}\", keep = {{ {SERVICE} = {{ key = \"{key}\", max_queued = {burst} }} }}, secret_file = \"{d}/secret\" }}) }}\n\
         log_format answers \"$status $sent_http_retry_after\";\n\
         limit_req_zone $retry_after_limit zone={SERVICE}:1m rate={per_minute}r/m;\n\
         limit_req_log_level info;\n\
         upstream up {{ {servers}keepalive 16; }}\n\
         server {{\n  listen {front};\n  server_name {SERVICE};\n  access_log {d}/answers.log answers;\n\
         \x20 location / {{\n    set $retry_after_limit $server_name;\n\
         \x20   rewrite_by_lua_block {{ require(\"retry_after_nginx\").admit(\"{SERVICE}\") }}\n\
         \x20   limit_req zone={SERVICE}{burst_clause};\n    limit_req_status 429;\n\
         \x20   proxy_http_version 1.1;\n    proxy_set_header Connection \"\";\n    proxy_pass http://up;\n\
         \x20   header_filter_by_lua_block {{ require(\"retry_after_nginx\").stamp(\"{SERVICE}\") }}\n{location}  }}\n}}\n",
        nginx_lua_package_path(),
        agent.display(),
    )
}
