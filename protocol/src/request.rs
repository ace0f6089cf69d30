//! Requests, proxy → agent: parsed by the agent, printed by clients.

use std::fmt;

use crate::{
    ErrorCode, MAX_LINE_LEN, MAX_REPORT_COUNT, MAX_SERVICE_NAME_LEN, ProtocolError,
    policy::{MAX_KEPT_RETRY_AFTER_S, Rung, TicketOutcome},
    wire::Opt,
};

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
    /// What the proxy did since its previous report (the judge's evidence).
    Report(Report<'a>),
    /// The agent's state.
    Health,
    /// One service's numbers for people (`retry-after-agent status`): `service`'s, or the first
    /// service's; each answer names the next service, so a viewer walks them all.
    Status {
        /// The service; `None`: the first.
        service: Option<&'a str>,
    },
}

/// What a proxy did for one service since its previous `REPORT` on this connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Report<'a> {
    /// The service.
    pub service: &'a str,
    /// Requests it admitted to its queue.
    pub admitted: u64,
    /// Requests it rejected (each answered with the Retry-After it computed).
    pub rejected: u64,
    /// Its queue depth now, if it knows it.
    pub queue_depth: Option<u64>,
    /// Its placement backoff streak now, if it has one.
    pub backoff_streak: Option<u32>,
    /// Of the admitted requests, those it knows were retries after a Retry-After.
    pub retry_admitted: Option<u64>,
    /// Of the rejected requests, those it knows were retries after a Retry-After.
    pub retry_rejected: Option<u64>,
    /// What it handed out: `handed_out=` as sent, checked (`none`: no rejection carried a
    /// value); read it with [`Report::handed_out`].
    pub handed_out: Option<&'a str>,
    /// What became of the places it keeps (kept returns) since its last report: `tickets=`
    /// as sent, checked, entries `<outcome>:<count>`; read it with [`Report::tickets`].
    pub tickets: Option<&'a str>,
}

/// Rejections that carried one `Retry-After` value from one rung, as a proxy reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandedOut {
    /// The rung the value came from (computed or static).
    pub rung: Rung,
    /// The value in seconds (0 to 300: above 60 only from a service keeping returns that
    /// opted in).
    pub seconds: u64,
    /// Rejections that carried it.
    pub count: u64,
}

impl HandedOut {
    /// Its form on the wire: `c3:12` (computed, 3 s, 12 times), `s5:40` (static).
    pub fn write(&self, out: &mut impl fmt::Write) -> fmt::Result {
        let rung = if self.rung == Rung::Static { 's' } else { 'c' };
        write!(out, "{rung}{}:{}", self.seconds, self.count)
    }

    fn parse(entry: &str) -> Option<Self> {
        let rung = match entry.as_bytes().first()? {
            b'c' => Rung::Computed,
            b's' => Rung::Static,
            _ => return None,
        };
        let (seconds, count) = entry[1..].split_once(':')?;
        let digits = |v: &str| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit());
        if !(digits(seconds) && digits(count)) {
            return None;
        }
        let parsed = Self {
            rung,
            seconds: seconds.parse().ok()?,
            count: count.parse().ok()?,
        };
        (parsed.seconds <= MAX_KEPT_RETRY_AFTER_S && parsed.count <= MAX_REPORT_COUNT)
            .then_some(parsed)
    }
}

impl<'a> Report<'a> {
    /// `REPORT`'s service and options: `admitted=` and `rejected=` are required, every
    /// count is at most `MAX_REPORT_COUNT`.
    fn parse(mut words: impl Iterator<Item = &'a str>) -> Result<Self, ProtocolError> {
        let mut report = Report {
            service: service(words.next())?,
            ..Report::default()
        };
        let (mut admitted, mut rejected) = (None, None);
        options(
            words,
            "REPORT takes admitted=<n> rejected=<n> and optionally queue_depth=, backoff_streak=, retry_admitted=, retry_rejected=, handed_out=, tickets=",
            |key, v| match key {
                "admitted" => set(&mut admitted, key, v),
                "rejected" => set(&mut rejected, key, v),
                "queue_depth" => set(&mut report.queue_depth, key, v),
                "backoff_streak" => set(&mut report.backoff_streak, key, v),
                "retry_admitted" => set(&mut report.retry_admitted, key, v),
                "retry_rejected" => set(&mut report.retry_rejected, key, v),
                "handed_out" if report.handed_out.is_none() => {
                    Some(checked_handed_out(v).map(|v| report.handed_out = Some(v)))
                }
                "tickets" if report.tickets.is_none() => {
                    Some(checked_tickets(v).map(|v| report.tickets = Some(v)))
                }
                _ => None,
            },
        )?;
        let (Some(admitted), Some(rejected)) = (admitted, rejected) else {
            return Err(ProtocolError::new(
                ErrorCode::BadArgument,
                "REPORT needs admitted=<n> and rejected=<n>",
            ));
        };
        report.admitted = admitted;
        report.rejected = rejected;
        report.check_counts()?;
        Ok(report)
    }

    fn check_counts(&self) -> Result<(), ProtocolError> {
        let counts = [
            Some(self.admitted),
            Some(self.rejected),
            self.retry_admitted,
            self.retry_rejected,
        ];
        if counts.into_iter().flatten().any(|n| n > MAX_REPORT_COUNT) {
            return Err(ProtocolError::new(
                ErrorCode::BadArgument,
                format!(
                    "REPORT counts (admitted=, rejected=, retry_admitted=, retry_rejected=) are at most {MAX_REPORT_COUNT}: report more often"
                ),
            ));
        }
        Ok(())
    }

    /// The ticket outcomes with their counts, as reported (nothing if the proxy keeps no
    /// places).
    pub fn tickets(&self) -> impl Iterator<Item = (TicketOutcome, u64)> + '_ {
        self.tickets
            .into_iter()
            .flat_map(|v| v.split(','))
            .filter_map(ticket_entry)
    }

    /// The values handed out, as reported (nothing if the proxy did not say).
    pub fn handed_out(&self) -> impl Iterator<Item = HandedOut> + '_ {
        self.handed_out
            .filter(|v| *v != "none")
            .into_iter()
            .flat_map(|v| v.split(','))
            .filter_map(HandedOut::parse)
    }
}

impl<'a> Request<'a> {
    /// Parse one line (without its newline; a trailing `\r` is ignored).
    ///
    /// # Errors
    /// A [`ProtocolError`] saying what is wrong with the line.
    pub fn parse(line: &'a [u8]) -> Result<Self, ProtocolError> {
        let mut words = words(line)?;
        match words.next().unwrap_or("") {
            "" => Err(ProtocolError::new(ErrorCode::BadRequest, "empty request")),
            "QUERY" => Self::parse_query(words),
            "SUBSCRIBE" => {
                let service = service(words.next())?;
                options(words, "SUBSCRIBE takes no options", |_, _| None)?;
                Ok(Request::Subscribe { service })
            }
            "REPORT" => Report::parse(words).map(Request::Report),
            "HEALTH" => {
                options(words, "HEALTH takes no options", |_, _| None)?;
                Ok(Request::Health)
            }
            "STATUS" => {
                let service = words.next().map(|w| service(Some(w))).transpose()?;
                options(words, "STATUS takes no options", |_, _| None)?;
                Ok(Request::Status { service })
            }
            other => Err(ProtocolError::new(
                ErrorCode::UnknownCommand,
                format!("{other:?} is not QUERY, SUBSCRIBE, REPORT, HEALTH or STATUS"),
            )),
        }
    }

    /// `QUERY`'s service and options.
    fn parse_query(mut words: impl Iterator<Item = &'a str>) -> Result<Self, ProtocolError> {
        let service = service(words.next())?;
        let (mut queue_depth, mut backoff_streak) = (None, None);
        options(
            words,
            "QUERY takes queue_depth=<n> and backoff_streak=<n>",
            |key, v| match key {
                "queue_depth" => set(&mut queue_depth, key, v),
                "backoff_streak" => set(&mut backoff_streak, key, v),
                _ => None,
            },
        )?;
        Ok(Request::Query {
            service,
            queue_depth,
            backoff_streak,
        })
    }

    /// The command's name in lower case (`query`, `subscribe`, `report`, `health`,
    /// `status`), for logs and metrics.
    pub const fn command(&self) -> &'static str {
        match self {
            Request::Query { .. } => "query",
            Request::Subscribe { .. } => "subscribe",
            Request::Report(_) => "report",
            Request::Health => "health",
            Request::Status { .. } => "status",
        }
    }

    /// The service the request is about, if any.
    pub fn service(&self) -> Option<&'a str> {
        match self {
            Request::Query { service, .. } | Request::Subscribe { service } => Some(service),
            Request::Report(report) => Some(report.service),
            Request::Status { service } => *service,
            Request::Health => None,
        }
    }
}

impl fmt::Display for Request<'_> {
    /// The request line, without its newline.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Request::Query {
                service,
                queue_depth,
                backoff_streak,
            } => {
                write!(f, "QUERY {service}")?;
                if let Some(depth) = queue_depth {
                    write!(f, " queue_depth={depth}")?;
                }
                if let Some(streak) = backoff_streak {
                    write!(f, " backoff_streak={streak}")?;
                }
                Ok(())
            }
            Request::Subscribe { service } => write!(f, "SUBSCRIBE {service}"),
            Request::Report(r) => {
                write!(
                    f,
                    "REPORT {} admitted={} rejected={}",
                    r.service, r.admitted, r.rejected
                )?;
                for (key, value) in [
                    ("queue_depth", r.queue_depth),
                    ("backoff_streak", r.backoff_streak.map(u64::from)),
                    ("retry_admitted", r.retry_admitted),
                    ("retry_rejected", r.retry_rejected),
                ] {
                    if value.is_some() {
                        write!(f, " {key}={}", Opt(&value))?;
                    }
                }
                if let Some(handed_out) = r.handed_out {
                    write!(f, " handed_out={handed_out}")?;
                }
                if let Some(tickets) = r.tickets {
                    write!(f, " tickets={tickets}")?;
                }
                Ok(())
            }
            Request::Health => f.write_str("HEALTH"),
            Request::Status { service: None } => f.write_str("STATUS"),
            Request::Status {
                service: Some(service),
            } => write!(f, "STATUS {service}"),
        }
    }
}

/// The line's words, after checking its length and that it is printable ASCII words
/// separated by spaces (a trailing `\r` is dropped).
fn words(line: &[u8]) -> Result<impl Iterator<Item = &str>, ProtocolError> {
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
    let Ok(line) = std::str::from_utf8(line) else {
        unreachable!("printable ASCII is UTF-8");
    };
    Ok(line.split(' '))
}

/// A `handed_out=` value: `none`, or entries like `c3:12`, comma-separated.
fn checked_handed_out(value: &str) -> Result<&str, ProtocolError> {
    if value == "none" || value.split(',').all(|e| HandedOut::parse(e).is_some()) {
        return Ok(value);
    }
    Err(ProtocolError::new(
        ErrorCode::BadArgument,
        format!(
            "handed_out={value:?} is not entries like c3:12 or s5:40 (rung c or s, seconds, count), comma-separated"
        ),
    ))
}

/// One `tickets=` entry: `<outcome>:<count>`, the count at most `MAX_REPORT_COUNT`.
fn ticket_entry(entry: &str) -> Option<(TicketOutcome, u64)> {
    let (outcome, count) = entry.split_once(':')?;
    let count: u64 = count.parse().ok().filter(|&n| n <= MAX_REPORT_COUNT)?;
    Some((outcome.parse().ok()?, count))
}

fn checked_tickets(value: &str) -> Result<&str, ProtocolError> {
    if value.split(',').all(|e| ticket_entry(e).is_some()) {
        return Ok(value);
    }
    Err(ProtocolError::new(
        ErrorCode::BadArgument,
        format!(
            "tickets={value:?} is not entries like issued:3 or honoured:2 (an outcome of {}, a count up to {MAX_REPORT_COUNT}), comma-separated",
            TicketOutcome::ALL
                .iter()
                .map(|o| o.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ))
}

fn service(word: Option<&str>) -> Result<&str, ProtocolError> {
    match word {
        Some(name) if !name.is_empty() && name.len() <= MAX_SERVICE_NAME_LEN => Ok(name),
        _ => Err(ProtocolError::new(
            ErrorCode::BadRequest,
            format!(
                "a service name (1 to {MAX_SERVICE_NAME_LEN} characters) must follow the command"
            ),
        )),
    }
}

/// Apply every `key=value` option; `apply` returns `None` for a key it does not take.
fn options<'a>(
    words: impl Iterator<Item = &'a str>,
    usage: &str,
    mut apply: impl FnMut(&'a str, &'a str) -> Option<Result<(), ProtocolError>>,
) -> Result<(), ProtocolError> {
    for option in words {
        let unexpected = || {
            ProtocolError::new(
                ErrorCode::BadArgument,
                format!("unexpected {option:?}: {usage}, once each"),
            )
        };
        let (key, value) = option.split_once('=').ok_or_else(unexpected)?;
        apply(key, value).ok_or_else(unexpected)??;
    }
    Ok(())
}

/// Set an option given once; `None` (so: unexpected) if it was already given.
fn set<T: std::str::FromStr>(
    slot: &mut Option<T>,
    name: &str,
    value: &str,
) -> Option<Result<(), ProtocolError>> {
    if slot.is_some() {
        return None;
    }
    Some(match value.parse() {
        Ok(v) => {
            *slot = Some(v);
            Ok(())
        }
        Err(_) => Err(ProtocolError::new(
            ErrorCode::BadArgument,
            format!("{name}={value:?} is not a non-negative integer in range"),
        )),
    })
}
