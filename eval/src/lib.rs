//! The evaluation: which `Retry-After` gets a rejected client back in, judged by what
//! happens to the client who obeys it.
//!
//! A [`scenario::Scenario`] (a TOML file under `eval/scenarios/`) names the replicas, the
//! proxies, the load and the clients; a [`policy::Policy`] names what the proxies tell
//! rejected clients. A run of one under the other happens in one of two places, which leave
//! the same [`record::RunResult`]:
//!
//! * [`run`]: on real sockets, on loopback: replica servers, the reference rejecting proxy,
//!   the real agent watching the replicas from the kernel, open-loop clients ([`load`]);
//! * [`sim`]: in a discrete-event simulator on a simulated clock, running the proxy's router,
//!   the agent's estimator and the client library's decision, the product's own code.
//!
//! [`bound`] computes the clairvoyant bound for a scenario, what no `Retry-After` assignment
//! can beat; [`figures`] turns a run into the figures; [`report`] writes the tables, the
//! charts and `results.json`.

pub mod bench;
pub mod bound;
pub mod figures;
pub mod load;
pub mod policy;
pub mod record;
pub mod report;
pub mod run;
pub mod scenario;
pub mod seeds;
pub mod sim;
