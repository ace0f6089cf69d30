//! Responses, agent → proxy: printed by the agent, parsed by clients.

use std::{fmt, time::Duration};

use retry_after_policy::{
    Answer, FallbackReason, PolicyConstants, PromisedReturns, QueueDepth, QueueDepthSource,
    RETURN_BINS, RetryAfterPolicy, Rung, Signals,
};

use crate::{
    ErrorCode, ProtocolError,
    wire::{Fields, Float, Opt, Returns, float, opt, opt_float, req, returns},
};

/// Any line the agent sends.
#[derive(Clone, Debug, PartialEq)]
pub enum Response {
    /// The answer to `QUERY`.
    RetryAfter(QueryResponse),
    /// A push to a subscriber (boxed: its schedule makes it the largest by far).
    Estimate(Box<EstimatePush>),
    /// The answer to `HEALTH`.
    Health(HealthResponse),
    /// The answer to `STATUS`.
    Status(StatusResponse),
    /// The answer to `REPORT`.
    Ok,
    /// A refused request.
    Err(ProtocolError),
}

impl Response {
    /// Parse one line the agent sent (a trailing `\r` or `\n` is ignored).
    ///
    /// # Errors
    /// The line is not a well-formed response.
    pub fn parse(line: &str) -> Result<Self, ProtocolError> {
        let line = line.trim_end_matches(['\r', '\n']);
        match line.split(' ').next() {
            Some("RETRY-AFTER") => QueryResponse::parse(line).map(Self::RetryAfter),
            Some("ESTIMATE") => EstimatePush::parse(line).map(|p| Self::Estimate(Box::new(p))),
            Some("HEALTH") => HealthResponse::parse(line).map(Self::Health),
            Some("STATUS") => StatusResponse::parse(line).map(Self::Status),
            Some("OK") if line == "OK" => Ok(Self::Ok),
            Some("ERR") => {
                let mut parts = line.splitn(3, ' ').skip(1);
                let code = parts
                    .next()
                    .and_then(|name| name.parse::<ErrorCode>().ok())
                    .ok_or_else(|| ProtocolError::malformed("ERR", line))?;
                Ok(Self::Err(ProtocolError::new(
                    code,
                    parts.next().unwrap_or(""),
                )))
            }
            _ => Err(ProtocolError::malformed("not a response", line)),
        }
    }
}

impl fmt::Display for Response {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RetryAfter(r) => r.fmt(f),
            Self::Estimate(e) => e.fmt(f),
            Self::Health(h) => h.fmt(f),
            Self::Status(s) => s.fmt(f),
            Self::Ok => f.write_str("OK"),
            Self::Err(e) => e.fmt(f),
        }
    }
}

/// The answer to a `QUERY` (one line):
///
/// ```text
/// RETRY-AFTER <seconds|none> millis=<n|none> rung=<computed|static|none> reason=<reason|none>
///   status_code=<code> queue_depth=<n|none>
///   queue_depth_source=<proxy|frontend|beyond_capacity|none> drain_rate=<f|none>
///   occupancy=<f|none> saturation_factor=<f|none>
/// ```
/// `seconds` is the header value (RFC 9110 delta-seconds), `none` for no header; `reason`
/// says why the computed rung did not answer.
#[derive(Clone, Debug, PartialEq)]
pub struct QueryResponse {
    /// Header value.
    pub seconds: Option<u64>,
    /// The same in milliseconds, for `retry-after-ms`.
    pub millis: Option<u64>,
    /// The ladder rung that answered.
    pub rung: Rung,
    /// Why the computed rung did not answer.
    pub reason: Option<FallbackReason>,
    /// Status code the proxy should reject with.
    pub status_code: u16,
    /// Queue depth used, if any source could see the queue.
    pub queue_depth: Option<u64>,
    /// Its source.
    pub queue_depth_source: Option<QueueDepthSource>,
    /// Drain rate used (responses per second), if warm.
    pub drain_rate: Option<f64>,
    /// Occupancy used, if capacity is known.
    pub occupancy: Option<f64>,
    /// Saturation factor, if computed.
    pub saturation_factor: Option<f64>,
}

impl QueryResponse {
    /// The response for a policy answer.
    pub fn new(answer: &Answer, status_code: u16) -> Self {
        let queue = answer.signals.queue_depth;
        Self {
            seconds: answer.seconds,
            millis: answer.millis,
            rung: answer.rung,
            reason: answer.reason,
            status_code,
            queue_depth: queue.map(|q| q.depth),
            queue_depth_source: queue.map(|q| q.source),
            drain_rate: answer.signals.drain_rate,
            occupancy: answer.signals.occupancy,
            saturation_factor: answer.computed.map(|c| c.saturation_factor),
        }
    }

    /// Parse a `RETRY-AFTER` line.
    ///
    /// # Errors
    /// The line is not a well-formed `RETRY-AFTER` line.
    pub fn parse(line: &str) -> Result<Self, ProtocolError> {
        const WHAT: &str = "RETRY-AFTER";
        let mut fields = Fields::new(line, WHAT, WHAT)?;
        let seconds = opt(fields.word(WHAT)?).map_err(|()| ProtocolError::malformed(WHAT, line))?;
        let mut r = QueryResponse {
            seconds,
            millis: None,
            rung: Rung::None,
            reason: None,
            status_code: 429,
            queue_depth: None,
            queue_depth_source: None,
            drain_rate: None,
            occupancy: None,
            saturation_factor: None,
        };
        fields.options(WHAT, |key, v| {
            Some(match key {
                "millis" => opt(v).map(|x| r.millis = x),
                "rung" => req(v).map(|x| r.rung = x),
                "reason" => opt(v).map(|x| r.reason = x),
                "status_code" => req(v).map(|x| r.status_code = x),
                "queue_depth" => opt(v).map(|x| r.queue_depth = x),
                "queue_depth_source" => opt(v).map(|x| r.queue_depth_source = x),
                "drain_rate" => opt_float(v).map(|x| r.drain_rate = x),
                "occupancy" => opt_float(v).map(|x| r.occupancy = x),
                "saturation_factor" => opt_float(v).map(|x| r.saturation_factor = x),
                _ => return None,
            })
        })?;
        Ok(r)
    }
}

impl fmt::Display for QueryResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RETRY-AFTER {} millis={} rung={} reason={} status_code={} queue_depth={} queue_depth_source={} drain_rate={} occupancy={} saturation_factor={}",
            Opt(&self.seconds),
            Opt(&self.millis),
            self.rung,
            Opt(&self.reason),
            self.status_code,
            Opt(&self.queue_depth),
            Opt(&self.queue_depth_source),
            Float(self.drain_rate),
            Float(self.occupancy),
            Float(self.saturation_factor),
        )
    }
}

/// The part of a `scheduled_returns` answer that moves between pushes: the promised returns
/// from now on and the overload's age now (see [`EstimatePush::schedule`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    /// Returns promised, per second from now.
    pub returns: PromisedReturns,
    /// The overload's age now, seconds, while it lasts.
    pub overload_age_s: Option<f64>,
}

/// What a subscriber receives each tick: everything its reject path needs to answer on its
/// own, exactly as the agent would, with its own jitter draw and, if it has them, its own
/// queue depth, backoff streak and promised returns ([`EstimatePush::answer`]). One line:
///
/// ```text
/// ESTIMATE <service> seq=<n> retry_after_policy=<name> status_code=<code>
///   retry_after_s=<s|none> queue_depth=<n|none> queue_depth_source=<src|none>
///   drain_rate=<f|none> occupancy=<f|none> arrival_rate=<f|none> returns=<n,n,...|none>
///   overload_rule=<rule> overload_age_s=<f|none> overload_horizon_factor=<f|none>
///   occupancy_weight=<f> backoff_weight=<f> backoff_streak_saturation=<n> jitter=<f>
///   min_retry_after_s=<s> max_retry_after_s=<s> base_ms=<n|none> reason=<reason|none>
/// ```
/// Each key is the name of the field it carries (docs/protocol.md): a setting's as the
/// configuration file names it, anything else as the fields below do (`queue_depth_source`
/// for the source of `queue_depth`). `returns` is the schedule of promised returns per second
/// from the push on (bin 0 first, trailing zeros left out); `arrival_rate` the fresh arrival
/// rate; `overload_age_s` how long fresh arrivals have matched the drain rate. `base_ms` and
/// `reason` describe the agent's own answer without jitter or streak (for people and logs);
/// the other fields are the inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct EstimatePush {
    /// The service.
    pub service: String,
    /// Increases by one each push on a connection.
    pub seq: u64,
    /// The service's policy.
    pub retry_after_policy: RetryAfterPolicy,
    /// Status code to reject with.
    pub status_code: u16,
    /// The static fallback, seconds.
    pub retry_after_s: Option<u64>,
    /// The queue as the agent sees it, if it can.
    pub queue_depth: Option<QueueDepth>,
    /// Drain rate, responses per second, if warm.
    pub drain_rate: Option<f64>,
    /// Occupancy, if capacity is known.
    pub occupancy: Option<f64>,
    /// Fresh arrivals per second, if proxies report them.
    pub arrival_rate: Option<f64>,
    /// The returns promised, per second from the push on.
    pub returns: PromisedReturns,
    /// How long the overload has lasted at the push, seconds, while it lasts.
    pub overload_age_s: Option<f64>,
    /// The formula's and the ladder's constants.
    pub constants: PolicyConstants,
    /// The agent's own computed value before jitter and clamp, milliseconds.
    pub base_ms: Option<u64>,
    /// Why the agent's own answer is not computed.
    pub reason: Option<FallbackReason>,
}

impl EstimatePush {
    /// The answer to one rejection: the agent's signals, with the proxy's own queue depth and
    /// streak where given and `schedule` as the schedule and the overload's age (see
    /// [`EstimatePush::schedule`]), through the same ladder the agent runs. `jitter_draw` is a
    /// uniform draw from [0, 1) for the jitter.
    pub fn answer(
        &self,
        queue_depth: Option<u64>,
        backoff_streak: Option<u32>,
        schedule: &Schedule,
        jitter_draw: f64,
    ) -> Answer {
        let signals = Signals {
            queue_depth: queue_depth
                .map(|depth| QueueDepth {
                    depth,
                    source: QueueDepthSource::Proxy,
                })
                .or(self.queue_depth),
            drain_rate: self.drain_rate,
            occupancy: self.occupancy,
            backoff_streak: backoff_streak.unwrap_or(0),
            arrival_rate: self.arrival_rate,
            promised: schedule.returns,
            overload_age_s: schedule.overload_age_s,
        };
        retry_after_policy::answer(
            self.retry_after_policy,
            &self.constants,
            self.retry_after_s,
            signals,
            jitter_draw,
        )
    }

    /// What a subscriber answers with `since_push` after this push: the push's schedule from
    /// then on (shifted by the whole seconds elapsed), bin by bin no less than `own`, the
    /// returns this subscriber promised itself from then on (which the push may already
    /// count, once reported); and the overload's age then.
    pub fn schedule(&self, since_push: Duration, own: &PromisedReturns) -> Schedule {
        let skip = usize::try_from(since_push.as_secs()).unwrap_or(RETURN_BINS);
        Schedule {
            returns: self.returns.shifted_max(skip, own),
            overload_age_s: self
                .overload_age_s
                .map(|age| age + since_push.as_secs_f64()),
        }
    }

    /// The push's own schedule, as the agent answers with it.
    pub fn pushed_schedule(&self) -> Schedule {
        Schedule {
            returns: self.returns,
            overload_age_s: self.overload_age_s,
        }
    }

    /// Parse an `ESTIMATE` line.
    ///
    /// # Errors
    /// The line is not a well-formed `ESTIMATE` line.
    pub fn parse(line: &str) -> Result<Self, ProtocolError> {
        const WHAT: &str = "ESTIMATE";
        let mut fields = Fields::new(line, WHAT, WHAT)?;
        let mut p = EstimatePush {
            service: fields.word(WHAT)?.to_owned(),
            seq: 0,
            retry_after_policy: RetryAfterPolicy::Static,
            status_code: 429,
            retry_after_s: None,
            queue_depth: None,
            drain_rate: None,
            occupancy: None,
            arrival_rate: None,
            returns: PromisedReturns::NONE,
            overload_age_s: None,
            constants: PolicyConstants::default(),
            base_ms: None,
            reason: None,
        };
        let (mut depth, mut source) = (None, None);
        let mut c = PolicyConstants::default();
        fields.options(WHAT, |key, v| {
            Some(match key {
                "seq" => req(v).map(|x| p.seq = x),
                "retry_after_policy" => req(v).map(|x| p.retry_after_policy = x),
                "status_code" => req(v).map(|x| p.status_code = x),
                "retry_after_s" => opt(v).map(|x| p.retry_after_s = x),
                "queue_depth" => opt(v).map(|x| depth = x),
                "queue_depth_source" => opt(v).map(|x| source = x),
                "drain_rate" => opt_float(v).map(|x| p.drain_rate = x),
                "occupancy" => opt_float(v).map(|x| p.occupancy = x),
                "arrival_rate" => opt_float(v).map(|x| p.arrival_rate = x),
                "returns" => returns(v).map(|x| p.returns = x),
                "overload_rule" => req(v).map(|x| c.overload_rule = x),
                "overload_age_s" => opt_float(v).map(|x| p.overload_age_s = x),
                "overload_horizon_factor" => opt_float(v).map(|x| c.overload_horizon_factor = x),
                "occupancy_weight" => float(v).map(|x| c.occupancy_weight = x),
                "backoff_weight" => float(v).map(|x| c.backoff_weight = x),
                "backoff_streak_saturation" => req(v).map(|x| c.backoff_streak_saturation = x),
                "jitter" => float(v).map(|x| c.jitter = x),
                "min_retry_after_s" => req(v).map(|x| c.min_retry_after_s = x),
                "max_retry_after_s" => req(v).map(|x| c.max_retry_after_s = x),
                "base_ms" => opt(v).map(|x| p.base_ms = x),
                "reason" => opt(v).map(|x| p.reason = x),
                _ => return None,
            })
        })?;
        p.constants = c;
        p.queue_depth = queue_depth(depth, source, "ESTIMATE", line)?;
        Ok(p)
    }
}

impl fmt::Display for EstimatePush {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.constants;
        write!(
            f,
            "ESTIMATE {} seq={} retry_after_policy={} status_code={} retry_after_s={} queue_depth={} queue_depth_source={} drain_rate={} occupancy={} arrival_rate={} returns={} overload_rule={} overload_age_s={} overload_horizon_factor={} occupancy_weight={} backoff_weight={} backoff_streak_saturation={} jitter={} min_retry_after_s={} max_retry_after_s={} base_ms={} reason={}",
            self.service,
            self.seq,
            self.retry_after_policy,
            self.status_code,
            Opt(&self.retry_after_s),
            Opt(&self.queue_depth.map(|q| q.depth)),
            Opt(&self.queue_depth.map(|q| q.source)),
            Float(self.drain_rate),
            Float(self.occupancy),
            Float(self.arrival_rate),
            Returns(&self.returns),
            c.overload_rule,
            Float(self.overload_age_s),
            Float(c.overload_horizon_factor),
            Float(Some(c.occupancy_weight)),
            Float(Some(c.backoff_weight)),
            c.backoff_streak_saturation,
            Float(Some(c.jitter)),
            c.min_retry_after_s,
            c.max_retry_after_s,
            Opt(&self.base_ms),
            Opt(&self.reason),
        )
    }
}

/// The answer to `HEALTH` (one line):
///
/// ```text
/// HEALTH ok uptime_s=<n> ticks=<n> last_tick_ms=<n|none> services=<n> endpoints=<n> connections=<n>
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
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

impl HealthResponse {
    /// Parse a `HEALTH` line.
    ///
    /// # Errors
    /// The line is not a well-formed `HEALTH` line.
    pub fn parse(line: &str) -> Result<Self, ProtocolError> {
        const WHAT: &str = "HEALTH";
        let mut fields = Fields::new(line, WHAT, WHAT)?;
        if fields.word(WHAT)? != "ok" {
            return Err(ProtocolError::malformed(WHAT, line));
        }
        let mut h = HealthResponse::default();
        fields.options(WHAT, |key, v| {
            Some(match key {
                "uptime_s" => req(v).map(|x| h.uptime_s = x),
                "ticks" => req(v).map(|x| h.ticks = x),
                "last_tick_ms" => opt(v).map(|x| h.last_tick_ms = x),
                "services" => req(v).map(|x| h.services = x),
                "endpoints" => req(v).map(|x| h.endpoints = x),
                "connections" => req(v).map(|x| h.connections = x),
                _ => return None,
            })
        })?;
        Ok(h)
    }
}

impl fmt::Display for HealthResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "HEALTH ok uptime_s={} ticks={} last_tick_ms={} services={} endpoints={} connections={}",
            self.uptime_s,
            self.ticks,
            Opt(&self.last_tick_ms),
            self.services,
            self.endpoints,
            self.connections
        )
    }
}

/// The answer to `STATUS`: one service's numbers as a person watching the agent wants them
/// (`retry-after-agent status`), one line:
///
/// ```text
/// STATUS <service> retry_after_policy=<name> seconds=<s|none> millis=<n|none>
///   rung=<computed|static|none> reason=<reason|none> queue_depth=<n|none>
///   queue_depth_source=<src|none> drain_rate=<f|none> arrival_rate=<f|none>
///   returns_promised=<n> admission_judged=<n> admitted_share=<f|none> next=<service|none>
/// ```
/// `seconds` to `reason` are the agent's own answer now (its own view of the queue, no
/// streak, no jitter), recorded nowhere; `returns_promised` the clients told to come back
/// whose second has not come; `admission_judged` and `admitted_share` the judge's answers
/// judged for admission so far and the share after which a retry at the suggested time was
/// admitted (both rungs); `next` the service after this one (`none` after the last).
#[derive(Clone, Debug, PartialEq)]
pub struct StatusResponse {
    /// The service.
    pub service: String,
    /// Its policy.
    pub retry_after_policy: RetryAfterPolicy,
    /// The agent's own answer now, seconds (`None`: no header).
    pub seconds: Option<u64>,
    /// The same in milliseconds.
    pub millis: Option<u64>,
    /// The rung it came from.
    pub rung: Rung,
    /// Why it is not computed.
    pub reason: Option<FallbackReason>,
    /// The queue as the agent sees it, if it can.
    pub queue_depth: Option<QueueDepth>,
    /// Drain rate, responses per second, if warm.
    pub drain_rate: Option<f64>,
    /// Fresh arrivals per second, if proxies report them.
    pub arrival_rate: Option<f64>,
    /// Clients told to come back whose second has not come yet.
    pub returns_promised: u64,
    /// Answers the judge has judged for admission.
    pub admission_judged: u64,
    /// Of those, the share after which a retry at the suggested time was admitted.
    pub admitted_share: Option<f64>,
    /// The next service, in the agent's order.
    pub next: Option<String>,
}

impl StatusResponse {
    /// Parse a `STATUS` line.
    ///
    /// # Errors
    /// The line is not a well-formed `STATUS` line.
    pub fn parse(line: &str) -> Result<Self, ProtocolError> {
        const WHAT: &str = "STATUS";
        let mut fields = Fields::new(line, WHAT, WHAT)?;
        let mut s = StatusResponse {
            service: fields.word(WHAT)?.to_owned(),
            retry_after_policy: RetryAfterPolicy::Static,
            seconds: None,
            millis: None,
            rung: Rung::None,
            reason: None,
            queue_depth: None,
            drain_rate: None,
            arrival_rate: None,
            returns_promised: 0,
            admission_judged: 0,
            admitted_share: None,
            next: None,
        };
        let (mut depth, mut source) = (None, None);
        fields.options(WHAT, |key, v| {
            Some(match key {
                "retry_after_policy" => req(v).map(|x| s.retry_after_policy = x),
                "seconds" => opt(v).map(|x| s.seconds = x),
                "millis" => opt(v).map(|x| s.millis = x),
                "rung" => req(v).map(|x| s.rung = x),
                "reason" => opt(v).map(|x| s.reason = x),
                "queue_depth" => opt(v).map(|x| depth = x),
                "queue_depth_source" => opt(v).map(|x| source = x),
                "drain_rate" => opt_float(v).map(|x| s.drain_rate = x),
                "arrival_rate" => opt_float(v).map(|x| s.arrival_rate = x),
                "returns_promised" => req(v).map(|x| s.returns_promised = x),
                "admission_judged" => req(v).map(|x| s.admission_judged = x),
                "admitted_share" => opt_float(v).map(|x| s.admitted_share = x),
                "next" => opt(v).map(|x| s.next = x),
                _ => return None,
            })
        })?;
        s.queue_depth = queue_depth(depth, source, "STATUS", line)?;
        Ok(s)
    }
}

impl fmt::Display for StatusResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "STATUS {} retry_after_policy={} seconds={} millis={} rung={} reason={} queue_depth={} queue_depth_source={} drain_rate={} arrival_rate={} returns_promised={} admission_judged={} admitted_share={} next={}",
            self.service,
            self.retry_after_policy,
            Opt(&self.seconds),
            Opt(&self.millis),
            self.rung,
            Opt(&self.reason),
            Opt(&self.queue_depth.map(|q| q.depth)),
            Opt(&self.queue_depth.map(|q| q.source)),
            Float(self.drain_rate),
            Float(self.arrival_rate),
            self.returns_promised,
            self.admission_judged,
            Float(self.admitted_share),
            Opt(&self.next),
        )
    }
}

/// A line's `queue_depth` and `queue_depth_source` as one value: both or neither.
fn queue_depth(
    depth: Option<u64>,
    source: Option<QueueDepthSource>,
    what: &str,
    line: &str,
) -> Result<Option<QueueDepth>, ProtocolError> {
    match (depth, source) {
        (Some(depth), Some(source)) => Ok(Some(QueueDepth { depth, source })),
        (None, None) => Ok(None),
        _ => Err(ProtocolError::malformed(
            &format!("{what}: queue_depth and queue_depth_source go together"),
            line,
        )),
    }
}
