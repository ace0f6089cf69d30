//! The Unix-socket protocol between the agent and rejecting proxies: one crate, every message.
//!
//! Text, one message per line (`\n`; an optional `\r` before it is ignored), printable ASCII
//! words separated by single spaces, options as `key=value`. Small enough to speak from Lua
//! (HAProxy, nginx), Python or a shell (`socat`). docs/protocol.md is the reference; this
//! crate is the implementation. Every message both parses and prints
//! ([`Request::parse`] / [`Response::parse`] and `Display`), so the agent, the client library
//! and the tests share one vocabulary and nobody writes protocol lines by hand. Floats are
//! printed in their shortest exact form, so a value survives the trip unchanged.
//!
//! Requests (proxy → agent), each answered by exactly one line:
//!
//! ```text
//! QUERY <service> [queue_depth=<n>] [backoff_streak=<n>]         → RETRY-AFTER …
//! SUBSCRIBE <service>                                            → ESTIMATE … (then one per tick)
//! REPORT <service> admitted=<n> rejected=<n> [queue_depth=<n>] [backoff_streak=<n>]
//!        [retry_admitted=<n>] [retry_rejected=<n>] [handed_out=<entries>] → OK
//! HEALTH                                                         → HEALTH …
//! ```
//!
//! One rule names every `key=value`: the key is the name of the field it carries, a setting's
//! as the configuration file names it (`status_code`, `min_retry_after_s`), anything else as
//! the protocol's Rust fields do (`queue_depth`, `drain_rate`, `backoff_streak`).
//!
//! Any request may instead be answered `ERR <code> <reason>`; after an error the connection
//! stays usable unless the code is `denied`, `overloaded` or `idle`.

mod error;
mod request;
mod response;
mod wire;

pub use error::{ErrorCode, ProtocolError};
pub use request::{HandedOut, Report, Request};
pub use response::{
    EstimatePush, HealthResponse, QueryResponse, Response, Schedule, StatusResponse,
};
pub use retry_after_policy as policy;

/// Longest request line accepted, in bytes, without its newline.
pub const MAX_LINE_LEN: usize = 512;

/// Longest response line the agent sends, in bytes, without its newline (clients may refuse
/// longer ones).
pub const MAX_RESPONSE_LEN: usize = 2048;

/// Largest count a `REPORT` may carry in one field (ten million: 10,000 rejections a second
/// reported every 1,000 s); more is refused as `bad_argument`.
pub const MAX_REPORT_COUNT: u64 = 10_000_000;

/// Longest service name accepted.
pub const MAX_SERVICE_NAME_LEN: usize = 128;
