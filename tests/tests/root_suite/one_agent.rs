//! The suite's long load runs, under one agent at once. Each of them runs its clients for 20 s
//! to two minutes and then waits out the retries they were told to make; one after another
//! they took seven minutes, most of it waiting. The agent runs one to a node (its lock), so
//! they cannot be tests of their own running side by side: here each is a [`Scenario`] with
//! its own services, replicas, proxies and clients, the agent holds all their services, and
//! they run at once, each on its own thread. A scenario that fails does not stop the others;
//! the test fails naming every scenario that did, with its message.
//!
//! The scenarios: kept returns through HAProxy and nginx (`kept_returns`), the OpenAI SDK
//! behind both with and without `retry-after-ms` (`openai_sdk`), urllib3 clients through
//! HAProxy told static 5 s or `scheduled_returns` (`haproxy_lua`), three minutes at 1.5×
//! through HAProxy and nginx with the clamp at 60 and at 120 s (`kept_past_a_minute`), the
//! shipped rules and dashboard on a real Prometheus scraping this loaded agent
//! (`prometheus`), keyed OpenAI SDK clients through HAProxy proxies behind a front hashing
//! their key or sharing their places through peers (`fleet_of_proxies`), and SDK clients with
//! a deadline through HAProxy and nginx (`deadlines`).

use std::{any::Any, thread};

use retry_after_testkit::{AgentProcess, proxies::nginx_workers_may_connect};

use crate::{
    deadlines::ClientsWithADeadline, fleet_of_proxies::KeyedClientsThroughAFleetOfProxies,
    haproxy_lua::Urllib3ThroughHaproxy, kept_returns::KeptReturnsThroughProxies,
    openai_sdk::OpenAiSdkBehindProxies, prometheus::ShippedRulesOnPrometheus,
};

/// A load run that shares the agent with others running at the same time.
pub(crate) trait Scenario: Sync {
    /// Its name, for its thread and its failure.
    fn name(&self) -> &'static str;
    /// Its services, as the agent's `[[service]]` tables (names no other scenario uses).
    fn services(&self) -> String;
    /// Start its proxies against `agent`, run its clients to their end and check what they
    /// and the proxies recorded; panics on a miss.
    fn run(&self, agent: &AgentProcess);
}

/// What a panic said.
fn message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

#[test]
fn kept_returns_the_openai_sdk_urllib3_and_prometheus_run_at_once_under_one_agent() {
    let scenarios: Vec<Box<dyn Scenario>> = vec![
        Box::new(KeptReturnsThroughProxies::new()),
        Box::new(OpenAiSdkBehindProxies::new()),
        Box::new(Urllib3ThroughHaproxy::new()),
        Box::new(ShippedRulesOnPrometheus::new()),
        Box::new(KeyedClientsThroughAFleetOfProxies::new()),
        Box::new(KeptReturnsThroughProxies::past_a_minute()),
        Box::new(ClientsWithADeadline::new()),
    ];
    let services: String = scenarios.iter().map(|s| s.services()).collect();
    let agent = AgentProcess::start(&nginx_workers_may_connect(), &services);
    let failures: Vec<String> = thread::scope(|s| {
        let running: Vec<_> = scenarios
            .iter()
            .map(|scenario| {
                let agent = &agent;
                thread::Builder::new()
                    .name(scenario.name().to_owned())
                    .spawn_scoped(s, move || scenario.run(agent))
                    .expect("a thread for the scenario")
            })
            .collect();
        scenarios
            .iter()
            .zip(running)
            .filter_map(|(scenario, run)| {
                let payload = run.join().err()?;
                Some(format!(
                    "{}: {}",
                    scenario.name(),
                    message(payload.as_ref())
                ))
            })
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} of {} scenarios failed:\n{}",
        failures.len(),
        scenarios.len(),
        failures.join("\n")
    );
}
