//! Fuzzing the configuration loader, as a bounded proptest harness run by the test command:
//! whatever the text, `Config::parse` answers with a configuration or an error naming a field,
//! never a panic; and whatever it accepts, the estimator built from it answers every query
//! without a panic (a value that passes validation must not fail later).

use std::time::{Duration, Instant};

use proptest::prelude::*;
use retry_after_estimator::{
    config::{Config, ConfigError},
    {BackendLoad, Query, ServiceLoad, SideLoad},
};

/// Values a key might be given, well-formed or not.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_owned()),
        Just("1".to_owned()),
        Just("-1".to_owned()),
        Just("1e20".to_owned()),
        Just("1e-20".to_owned()),
        Just("nan".to_owned()),
        Just("inf".to_owned()),
        Just("18446744073709551615".to_owned()),
        Just("true".to_owned()),
        Just("[]".to_owned()),
        Just("\"\"".to_owned()),
        Just("\"0660\"".to_owned()),
        Just("\"*:80\"".to_owned()),
        Just("\"127.0.0.1:9\"".to_owned()),
        Just("\"[::1]:9\"".to_owned()),
        Just("\"0.0.0.0:9464\"".to_owned()),
        Just("\"queue_drain_rate\"".to_owned()),
        Just("\"replica\"".to_owned()),
        Just("\"/run/x.sock\"".to_owned()),
        (0u64..100_000).prop_map(|n| n.to_string()),
        (0.0..2.0f64).prop_map(|x| format!("{x:?}")),
        "\"[ -~]{0,12}\"",
    ]
}

const AGENT_KEYS: &[&str] = &[
    "tick_interval_ms",
    "attach_cgroups",
    "socket_path",
    "socket_mode",
    "allowed_uids",
    "max_clients",
    "client_idle_timeout_ms",
    "client_write_timeout_ms",
    "metrics_listen",
    "metrics_allow_remote",
    "tick_intervall_ms",
];

const SERVICE_KEYS: &[&str] = &["frontend", "rejected_at", "proxy_cgroup"];

const BACKPRESSURE_KEYS: &[&str] = &[
    "status_code",
    "retry_after_policy",
    "retry_after_s",
    "alpha",
    "warm_after_s",
    "cold_after_s",
    "backoff_streak_saturation",
    "occupancy_weight",
    "backoff_weight",
    "jitter",
    "min_retry_after_s",
    "max_retry_after_s",
];

fn lines(keys: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop::collection::vec((prop::sample::select(keys), value()), 0..5).prop_map(|pairs| {
        // A key given twice is a TOML error; keep the first.
        let mut seen = std::collections::BTreeSet::new();
        pairs
            .into_iter()
            .filter(|(k, _)| seen.insert(*k))
            .map(|(k, v)| format!("{k} = {v}\n"))
            .collect()
    })
}

fn config_text() -> impl Strategy<Value = String> {
    (
        lines(AGENT_KEYS),
        prop::collection::vec(
            (
                "[a-z]{1,6}",
                prop::collection::vec((value(), prop::option::of(value())), 1..3),
                lines(SERVICE_KEYS),
                lines(BACKPRESSURE_KEYS),
            ),
            0..3,
        ),
    )
        .prop_map(|(agent, services)| {
            let mut text = format!("[agent]\n{agent}");
            for (name, backends, service, backpressure) in services {
                let backends: Vec<String> = backends
                    .into_iter()
                    .map(|(address, max)| match max {
                        Some(max) => format!("{{ address = {address}, max_ongoing_requests = {max} }}"),
                        None => format!("{{ address = {address} }}"),
                    })
                    .collect();
                text.push_str(&format!(
                    "[[service]]\nname = \"{name}\"\nbackends = [{}]\n{service}[service.backpressure]\n{backpressure}",
                    backends.join(", ")
                ));
            }
            text
        })
}

/// Build the estimator a configuration implies, run it through ticks of load and answer.
fn exercise(config: &Config) {
    let mut estimator = config.estimator();
    let t0 = Instant::now();
    let names: Vec<String> = config.services.iter().map(|s| s.name.clone()).collect();
    for name in &names {
        let service = estimator
            .service_mut(name)
            .expect("every configured service has an estimator");
        let backends = service.settings().backends.len();
        for tick in 0..20u64 {
            let side = SideLoad {
                in_flight: tick % 7,
                waiting: tick % 3,
                completed_total: tick * tick * 13,
            };
            service.observe_load(
                t0 + Duration::from_millis(137 * tick),
                ServiceLoad {
                    rejected_at: service.settings().rejected_at,
                    replica_queue: service.settings().replica_queue,
                    backends: vec![
                        BackendLoad {
                            client: side,
                            server: side,
                            max_ongoing_requests: Some(3),
                        };
                        backends
                    ],
                    frontend_in_flight: Some(tick * 11),
                },
            );
        }
        for depth in [None, Some(0), Some(u64::MAX)] {
            let answer = service.answer_and_record(
                t0 + Duration::from_secs(3),
                Query {
                    queue_depth: depth,
                    backoff_streak: Some(u32::MAX),
                },
                0.999,
            );
            if let Some(seconds) = answer.seconds {
                assert!(seconds <= 86_400, "{answer:?}");
            }
            let _ = service.push(1).to_string();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn the_loader_never_panics_and_what_it_accepts_runs(text in config_text()) {
        match Config::parse(&text) {
            Ok(config) => exercise(&config),
            Err(ConfigError::Invalid { field, .. }) => prop_assert!(!field.is_empty()),
            Err(_) => {}
        }
    }

    #[test]
    fn arbitrary_text_is_refused_without_a_panic(text in "[\\[\\]a-z_=\".0-9 \n{},*:]{0,200}") {
        let _ = Config::parse(&text);
    }
}
