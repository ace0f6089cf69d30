//! The Unix-socket protocol between the agent and rejecting proxies: one module, every message.
//!
//! Text, one message per line (`\n`, an optional `\r` before it is ignored), ASCII words
//! separated by single spaces, options as `key=value`. Small enough to speak from Lua (HAProxy,
//! nginx), Python or a shell (`socat`). docs/protocol.md is the reference; this module is the
//! implementation: [`Request::parse`] turns a line into a typed request, the `Display` impls
//! of the responses write lines. Parsing never panics and never allocates more than the line.
//!
//! Requests:
//!
//! ```text
//! QUERY <service> [depth=<n>] [streak=<n>]
//! SUBSCRIBE <service>
//! HEALTH
//! ```
//!
//! Responses: `RETRY-AFTER …` to a query, `ESTIMATE …` pushed to a subscriber once at once and
//! then every tick, `HEALTH …`, or `ERR <code> <reason>`. After an error the connection stays
//! usable.

use std::fmt;

/// Longest request line accepted, in bytes, without its newline.
pub const MAX_LINE_LEN: usize = 512;

/// Longest service name accepted.
pub const MAX_SERVICE_NAME_LEN: usize = 128;

/// A request from a proxy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request<'a> {
    /// One Retry-After now.
    Query {
        /// The service.
        service: &'a str,
        /// The proxy's queue depth for it, if known.
        queue_depth: Option<u64>,
        /// The proxy's placement backoff streak, if known.
        backoff_streak: Option<u32>,
    },
    /// Push the service's estimate now and every tick.
    Subscribe {
        /// The service.
        service: &'a str,
    },
    /// The agent's state.
    Health,
}

/// Why a line was refused: the code and reason of an `ERR` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProtocolError {
    /// Machine-readable code.
    pub code: ErrorCode,
    /// What was wrong, for people.
    pub reason: String,
}

/// The `ERR` codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// Empty, not ASCII text, or malformed.
    BadRequest,
    /// Longer than [`MAX_LINE_LEN`].
    LineTooLong,
    /// Not a command of this protocol.
    UnknownCommand,
    /// An option or its value is not valid.
    BadArgument,
    /// No such service is configured.
    UnknownService,
    /// The peer's uid is not allowed.
    Denied,
    /// Too many connections; this one is closed.
    Overloaded,
    /// No request for too long; this connection is closed.
    Idle,
}

impl ErrorCode {
    /// Every code.
    pub const ALL: [ErrorCode; 8] = [
        Self::BadRequest,
        Self::LineTooLong,
        Self::UnknownCommand,
        Self::BadArgument,
        Self::UnknownService,
        Self::Denied,
        Self::Overloaded,
        Self::Idle,
    ];

    /// The code as written on the wire.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::BadRequest => "bad_request",
            Self::LineTooLong => "line_too_long",
            Self::UnknownCommand => "unknown_command",
            Self::BadArgument => "bad_argument",
            Self::UnknownService => "unknown_service",
            Self::Denied => "denied",
            Self::Overloaded => "overloaded",
            Self::Idle => "idle",
        }
    }
}

impl ProtocolError {
    /// An error with a code and reason.
    pub fn new(code: ErrorCode, reason: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ProtocolError {
    /// `ERR <code> <reason>`; the reason is kept to printable ASCII on one line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ERR {} ", self.code.as_str())?;
        for c in self.reason.chars() {
            let c = if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            };
            write!(f, "{c}")?;
        }
        Ok(())
    }
}

impl<'a> Request<'a> {
    /// Parse one line (without its newline; a trailing `\r` is ignored).
    ///
    /// # Errors
    /// A [`ProtocolError`] saying what is wrong with the line.
    pub fn parse(line: &'a [u8]) -> Result<Self, ProtocolError> {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.len() > MAX_LINE_LEN {
            return Err(ProtocolError::new(
                ErrorCode::LineTooLong,
                format!("lines are at most {MAX_LINE_LEN} bytes"),
            ));
        }
        if !line.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
            return Err(ProtocolError::new(
                ErrorCode::BadRequest,
                "a request is printable ASCII words separated by spaces",
            ));
        }
        // Checked above: printable ASCII is UTF-8.
        let line = std::str::from_utf8(line).expect("ASCII");
        let mut words = line.split(' ');
        let command = words.next().unwrap_or("");
        match command {
            "" => Err(ProtocolError::new(ErrorCode::BadRequest, "empty request")),
            "QUERY" => {
                let service = service(words.next())?;
                let mut queue_depth = None;
                let mut backoff_streak = None;
                for option in words {
                    match option.split_once('=') {
                        Some(("depth", v)) if queue_depth.is_none() => {
                            queue_depth = Some(number::<u64>("depth", v)?);
                        }
                        Some(("streak", v)) if backoff_streak.is_none() => {
                            backoff_streak = Some(number::<u32>("streak", v)?);
                        }
                        _ => {
                            return Err(ProtocolError::new(
                                ErrorCode::BadArgument,
                                format!(
                                    "unexpected {option:?}: QUERY takes depth=<n> and streak=<n>, once each"
                                ),
                            ));
                        }
                    }
                }
                Ok(Request::Query {
                    service,
                    queue_depth,
                    backoff_streak,
                })
            }
            "SUBSCRIBE" => {
                let service = service(words.next())?;
                no_more(words, "SUBSCRIBE")?;
                Ok(Request::Subscribe { service })
            }
            "HEALTH" => {
                no_more(words, "HEALTH")?;
                Ok(Request::Health)
            }
            other => Err(ProtocolError::new(
                ErrorCode::UnknownCommand,
                format!("{other:?} is not QUERY, SUBSCRIBE or HEALTH"),
            )),
        }
    }
}

fn service(word: Option<&str>) -> Result<&str, ProtocolError> {
    match word {
        Some(name) if !name.is_empty() && name.len() <= MAX_SERVICE_NAME_LEN => Ok(name),
        _ => Err(ProtocolError::new(
            ErrorCode::BadRequest,
            "a service name (1 to 128 characters) must follow the command",
        )),
    }
}

fn no_more<'a>(
    mut words: impl Iterator<Item = &'a str>,
    command: &str,
) -> Result<(), ProtocolError> {
    match words.next() {
        None => Ok(()),
        Some(extra) => Err(ProtocolError::new(
            ErrorCode::BadArgument,
            format!("unexpected {extra:?}: {command} takes no options"),
        )),
    }
}

fn number<T: std::str::FromStr>(name: &str, value: &str) -> Result<T, ProtocolError> {
    value.parse().map_err(|_| {
        ProtocolError::new(
            ErrorCode::BadArgument,
            format!("{name}={value:?} is not a non-negative integer in range"),
        )
    })
}

/// An optional value on the wire: the value, or `none`.
struct Opt<T>(Option<T>);

impl<T: fmt::Display> fmt::Display for Opt<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Some(v) => v.fmt(f),
            None => f.write_str("none"),
        }
    }
}

/// A float with 3 decimals, or `none` (also for NaN and infinities).
struct Float(Option<f64>);

impl fmt::Display for Float {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.filter(|v| v.is_finite()) {
            Some(v) => write!(f, "{v:.3}"),
            None => f.write_str("none"),
        }
    }
}

/// The answer to a `QUERY`:
///
/// ```text
/// RETRY-AFTER <seconds|none> ms=<n|none> rung=<computed|static|none> status=<code>
///   depth=<n> source=<proxy|frontend|beyond_capacity|in_flight> drain=<f|none>
///   occupancy=<f|none> saturation=<f|none>
/// ```
/// (one line). `seconds` is the header value (RFC 9110 delta-seconds), `none` for no header.
#[derive(Clone, Debug, PartialEq)]
pub struct QueryResponse {
    /// Header value.
    pub seconds: Option<u64>,
    /// The same in milliseconds, for `retry-after-ms`.
    pub millis: Option<u64>,
    /// The ladder rung that answered.
    pub rung: &'static str,
    /// Status code the proxy should reject with.
    pub status_code: u16,
    /// Queue depth used.
    pub queue_depth: u64,
    /// Its source.
    pub queue_depth_source: &'static str,
    /// Drain rate used (responses per second), if warm.
    pub drain_rate: Option<f64>,
    /// Occupancy used, if capacity is known.
    pub occupancy: Option<f64>,
    /// Saturation factor, if computed.
    pub saturation_factor: Option<f64>,
}

impl fmt::Display for QueryResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RETRY-AFTER {} ms={} rung={} status={} depth={} source={} drain={} occupancy={} saturation={}",
            Opt(self.seconds),
            Opt(self.millis),
            self.rung,
            self.status_code,
            self.queue_depth,
            self.queue_depth_source,
            Float(self.drain_rate),
            Float(self.occupancy),
            Float(self.saturation_factor),
        )
    }
}

/// What a subscriber receives each tick: everything the proxy's reject path needs to answer
/// on its own, with its own jitter and, if it wants, its own queue depth.
///
/// ```text
/// ESTIMATE <service> seq=<n> base_ms=<n|none> jitter=<f> min=<s> max=<s> static=<s|none>
///   status=<code> depth=<n> drain=<f|none> occupancy_factor=<f> backoff_weight=<f>
///   backoff_saturation=<n>
/// ```
/// (one line). `base_ms` is the computed value before jitter and clamp (`none` when the
/// computed rung does not apply). A proxy with its own depth d and backoff streak s computes
/// `d / drain × (occupancy_factor + backoff_weight × min(s / backoff_saturation, 1))` seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct EstimatePush {
    /// The service.
    pub service: String,
    /// Increases by one each push on a connection.
    pub seq: u64,
    /// Computed value before jitter and clamp, in milliseconds.
    pub base_ms: Option<u64>,
    /// Relative jitter to apply per rejection.
    pub jitter: f64,
    /// Lower clamp, seconds.
    pub min_s: u64,
    /// Upper clamp, seconds.
    pub max_s: u64,
    /// The static fallback, seconds.
    pub static_s: Option<u64>,
    /// Status code to reject with.
    pub status_code: u16,
    /// Queue depth the base was computed from.
    pub queue_depth: u64,
    /// Drain rate, responses per second, if warm.
    pub drain_rate: Option<f64>,
    /// 1 + w1 · occupancy.
    pub occupancy_factor: f64,
    /// w2.
    pub backoff_weight: f64,
    /// B.
    pub backoff_saturation: u32,
}

impl fmt::Display for EstimatePush {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ESTIMATE {} seq={} base_ms={} jitter={} min={} max={} static={} status={} depth={} drain={} occupancy_factor={} backoff_weight={} backoff_saturation={}",
            self.service,
            self.seq,
            Opt(self.base_ms),
            Float(Some(self.jitter)),
            self.min_s,
            self.max_s,
            Opt(self.static_s),
            self.status_code,
            self.queue_depth,
            Float(self.drain_rate),
            Float(Some(self.occupancy_factor)),
            Float(Some(self.backoff_weight)),
            self.backoff_saturation,
        )
    }
}

impl EstimatePush {
    /// Parse an `ESTIMATE` line (the client side of the subscription).
    ///
    /// # Errors
    /// The line is not a well-formed `ESTIMATE` line.
    pub fn parse(line: &str) -> Result<Self, ProtocolError> {
        let bad =
            |what: &str| ProtocolError::new(ErrorCode::BadRequest, format!("ESTIMATE: {what}"));
        let mut words = line.trim_end_matches(['\r', '\n']).split(' ');
        if words.next() != Some("ESTIMATE") {
            return Err(bad("not an ESTIMATE line"));
        }
        let service = words.next().ok_or_else(|| bad("no service"))?.to_owned();
        let mut push = EstimatePush {
            service,
            seq: 0,
            base_ms: None,
            jitter: 0.0,
            min_s: 1,
            max_s: 60,
            static_s: None,
            status_code: 429,
            queue_depth: 0,
            drain_rate: None,
            occupancy_factor: 1.0,
            backoff_weight: 0.0,
            backoff_saturation: 1,
        };
        for word in words {
            let (key, value) = word.split_once('=').ok_or_else(|| bad(word))?;
            fn opt(v: &str) -> Option<&str> {
                (v != "none").then_some(v)
            }
            let n = |v: &str| v.parse::<u64>().map_err(|_| bad(word));
            let x = |v: &str| v.parse::<f64>().map_err(|_| bad(word));
            match key {
                "seq" => push.seq = n(value)?,
                "base_ms" => push.base_ms = opt(value).map(n).transpose()?,
                "jitter" => push.jitter = x(value)?,
                "min" => push.min_s = n(value)?,
                "max" => push.max_s = n(value)?,
                "static" => push.static_s = opt(value).map(n).transpose()?,
                "status" => push.status_code = value.parse().map_err(|_| bad(word))?,
                "depth" => push.queue_depth = n(value)?,
                "drain" => push.drain_rate = opt(value).map(x).transpose()?,
                "occupancy_factor" => push.occupancy_factor = x(value)?,
                "backoff_weight" => push.backoff_weight = x(value)?,
                "backoff_saturation" => {
                    push.backoff_saturation = value.parse().map_err(|_| bad(word))?;
                }
                // Fields added by later agents are skipped: old clients keep working.
                _ => {}
            }
        }
        Ok(push)
    }
}

/// The answer to `HEALTH`:
///
/// ```text
/// HEALTH ok uptime_s=<n> ticks=<n> last_tick_ms=<n|none> services=<n> endpoints=<n> connections=<n>
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthResponse {
    /// Seconds since the agent started.
    pub uptime_s: u64,
    /// Ticks (counter reads) so far.
    pub ticks: u64,
    /// Milliseconds since the last tick, if there was one.
    pub last_tick_ms: Option<u64>,
    /// Configured services.
    pub services: usize,
    /// Watched endpoints.
    pub endpoints: usize,
    /// Open socket connections.
    pub connections: usize,
}

impl fmt::Display for HealthResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "HEALTH ok uptime_s={} ticks={} last_tick_ms={} services={} endpoints={} connections={}",
            self.uptime_s,
            self.ticks,
            Opt(self.last_tick_ms),
            self.services,
            self.endpoints,
            self.connections
        )
    }
}

/// The widest clamp of a header value: common client SDKs ignore Retry-After above 60 s.
pub const MAX_RETRY_AFTER_S: u64 = 60;

/// The header value of an estimate: `base_s` seconds times a jitter factor
/// `1 + jitter · (2·unit − 1)` (uniform in [1 − jitter, 1 + jitter] for `unit` uniform in
/// [0, 1)), rounded up to whole seconds and to whole milliseconds, each clamped to
/// [`min_s`, `max_s`] (themselves kept within [1, 60]).
///
/// Jitter comes before rounding. The value is rounded to whole microseconds first, so
/// floating-point noise (0.1 × 3 × 10 = 3.0000000000000004) cannot add a second. Returns
/// `None` if `base_s` is not a finite non-negative number; bad `jitter` or `unit` values are
/// brought into range. The agent and the client library both finish estimates here, so a
/// subscriber's reject path produces exactly what a query would.
pub fn header_value(
    base_s: f64,
    jitter: f64,
    unit: f64,
    min_s: u64,
    max_s: u64,
) -> Option<(u64, u64)> {
    if !(base_s.is_finite() && base_s >= 0.0) {
        return None;
    }
    let value = base_s * jitter_factor(jitter, unit);
    let max = max_s.clamp(1, MAX_RETRY_AFTER_S);
    let min = min_s.clamp(1, max);
    // `as` saturates far beyond the clamp.
    let micros = (value * 1e6).round() as u64;
    Some((
        micros.div_ceil(1_000_000).clamp(min, max),
        micros.div_ceil(1_000).clamp(min * 1000, max * 1000),
    ))
}

/// `1 + j · (2·unit − 1)` with j limited to [0, 1) and unit to [0, 1].
pub fn jitter_factor(jitter: f64, unit: f64) -> f64 {
    let j = if jitter.is_finite() {
        jitter.clamp(0.0, 0.999)
    } else {
        0.0
    };
    let u = if unit.is_finite() {
        unit.clamp(0.0, 1.0)
    } else {
        0.5
    };
    1.0 + j * (2.0 * u - 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_values_by_hand() {
        // 2.1 s × 0.9 = 1.89 s → 2 s and 1890 ms (jitter before rounding).
        assert_eq!(header_value(2.1, 0.2, 0.25, 1, 60), Some((2, 1890)));
        // Float noise does not add a second.
        let noisy: f64 = 0.1 * 3.0 * 10.0;
        assert_eq!(noisy.ceil(), 4.0, "the case is real");
        assert_eq!(header_value(noisy, 0.0, 0.5, 1, 60), Some((3, 3000)));
        // Clamps, never wider than [1, 60].
        assert_eq!(header_value(0.0, 0.0, 0.5, 1, 60), Some((1, 1000)));
        assert_eq!(header_value(1e300, 0.0, 0.5, 0, 600), Some((60, 60_000)));
        assert_eq!(header_value(f64::NAN, 0.0, 0.5, 1, 60), None);
        assert_eq!(header_value(-1.0, 0.0, 0.5, 1, 60), None);
        for u in [f64::NAN, -3.0, 7.0] {
            let f = jitter_factor(0.2, u);
            assert!((0.8..=1.2).contains(&f), "{u} → {f}");
        }
    }

    #[test]
    fn parses_every_request() {
        assert_eq!(
            Request::parse(b"QUERY chat depth=12 streak=3"),
            Ok(Request::Query {
                service: "chat",
                queue_depth: Some(12),
                backoff_streak: Some(3)
            })
        );
        assert_eq!(
            Request::parse(b"QUERY chat\r"),
            Ok(Request::Query {
                service: "chat",
                queue_depth: None,
                backoff_streak: None
            })
        );
        assert_eq!(
            Request::parse(b"SUBSCRIBE chat"),
            Ok(Request::Subscribe { service: "chat" })
        );
        assert_eq!(Request::parse(b"HEALTH"), Ok(Request::Health));
    }

    #[test]
    fn every_bad_line_gets_its_code() {
        let code = |line: &[u8]| Request::parse(line).unwrap_err().code;
        assert_eq!(code(b""), ErrorCode::BadRequest);
        assert_eq!(code(b"QUERY"), ErrorCode::BadRequest);
        assert_eq!(code(b"QUERY  chat"), ErrorCode::BadRequest);
        assert_eq!(code(b"\x00\xff\x13binary"), ErrorCode::BadRequest);
        assert_eq!(code("QUERY caf\u{e9}".as_bytes()), ErrorCode::BadRequest);
        assert_eq!(code(b"query chat"), ErrorCode::UnknownCommand);
        assert_eq!(code(b"DELETE everything"), ErrorCode::UnknownCommand);
        assert_eq!(code(b"QUERY chat depth=-1"), ErrorCode::BadArgument);
        assert_eq!(code(b"QUERY chat depth=1 depth=2"), ErrorCode::BadArgument);
        assert_eq!(
            code(b"QUERY chat streak=99999999999"),
            ErrorCode::BadArgument
        );
        assert_eq!(code(b"QUERY chat color=red"), ErrorCode::BadArgument);
        assert_eq!(code(b"HEALTH now"), ErrorCode::BadArgument);
        assert_eq!(code(&[b'A'; MAX_LINE_LEN + 1]), ErrorCode::LineTooLong);
        let long_name = format!("QUERY {}", "s".repeat(MAX_SERVICE_NAME_LEN + 1));
        assert_eq!(code(long_name.as_bytes()), ErrorCode::BadRequest);
    }

    #[test]
    fn errors_are_one_printable_line() {
        let e = ProtocolError::new(ErrorCode::BadArgument, "x\ny\u{7}z");
        assert_eq!(e.to_string(), "ERR bad_argument x?y?z");
    }

    #[test]
    fn responses_print_as_documented() {
        let r = QueryResponse {
            seconds: Some(4),
            millis: Some(3500),
            rung: "computed",
            status_code: 429,
            queue_depth: 14,
            queue_depth_source: "proxy",
            drain_rate: Some(4.0),
            occupancy: None,
            saturation_factor: Some(1.0),
        };
        assert_eq!(
            r.to_string(),
            "RETRY-AFTER 4 ms=3500 rung=computed status=429 depth=14 source=proxy drain=4.000 occupancy=none saturation=1.000"
        );
        let push = EstimatePush {
            service: "chat".into(),
            seq: 7,
            base_ms: Some(2500),
            jitter: 0.2,
            min_s: 1,
            max_s: 60,
            static_s: Some(5),
            status_code: 503,
            queue_depth: 10,
            drain_rate: Some(4.0),
            occupancy_factor: 1.25,
            backoff_weight: 0.25,
            backoff_saturation: 5,
        };
        let line = push.to_string();
        assert_eq!(
            line,
            "ESTIMATE chat seq=7 base_ms=2500 jitter=0.200 min=1 max=60 static=5 status=503 depth=10 drain=4.000 occupancy_factor=1.250 backoff_weight=0.250 backoff_saturation=5"
        );
        assert_eq!(EstimatePush::parse(&line), Ok(push));
    }
}
