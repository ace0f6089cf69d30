//! The root suite: every test that loads and attaches the real eBPF programs or drives real
//! proxies, servers and clients (nginx, HAProxy, Ray Serve, grpcio, wrk, h2load, urllib3) on
//! loopback, as root. One binary, so it is built and linked once; each file is a module.
//! `./dev test` runs it after `./dev check`, a module at a time in each of two lanes (network
//! namespaces of their own, with ports of their own: xtask/src/lanes.rs), one test at a time
//! in a module, and prints each module's time. Without root, `./dev check` runs everything
//! else.

mod abuse;
mod agent_service;
mod behind_haproxy;
mod behind_nginx;
mod cli;
mod deadlines;
mod deploy;
mod detach;
mod evaluation;
mod fleet_of_proxies;
mod haproxy_h2_backends;
mod haproxy_lua;
mod http2;
mod in_flight;
mod integrations;
mod kept_cookies;
mod kept_flood;
mod kept_outage;
mod kept_returns;
mod kernel_matrix;
mod least_privilege;
mod llm_gateway;
mod nginx_book;
mod nginx_lua;
mod one_agent;
mod openai_sdk;
mod package;
mod prometheus;
mod ray_serve;
mod real_traffic;
mod serve_streams;
mod status_view;
mod streamed_responses;
mod turns;
mod vantage_points;
mod vllm_engine;
mod watch_set;
