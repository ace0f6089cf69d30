//! The reference rejecting proxy: what a load-shedding proxy in front of replicas does, built
//! small enough to read, with `Retry-After` from the agent on every rejection.
//!
//! * [`router`]: the queue, power-of-two-choices placement, placement backoff and streak, as
//!   a state machine without I/O (events in, decisions out, time passed in). The tokio proxy
//!   and the evaluation's simulator run this one router.
//! * [`kept`]: kept returns, the admission that keeps the places rejections promised (the
//!   router's [`Router::arrive_kept`] and the answer [`promise`]).
//! * [`proxy`]: the HTTP/1.1 proxy on tokio and hyper around it: accepts clients, queues or
//!   rejects them, forwards placed requests to the replicas, reports to the agent.
//!
//! The binary (`retry-after-reference-proxy`) runs the proxy in front of replicas a user
//! names on the command line.

pub mod kept;
pub mod proxy;
pub mod router;

pub use kept::{Keeping, KeyFrom, RETURN_COOKIE, Returning, promise};
pub use proxy::{HeaderPolicy, Proxy, ProxyConfig, REPORT_EVERY, Rejection};
pub use retry_after_policy::{Hint, Placement, Promise, give_place, told};
pub use router::{Arrival, Fleet, KeptArrival, RetryBacklog, Router, Wake};
