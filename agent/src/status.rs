//! `retry-after-agent status`: every service's numbers, as the socket's `HEALTH` and `STATUS`
//! give them, in an 80-column view refreshed each second on a terminal, or once.
//!
//! [`render`] is the view (pure: the same answers, the same text); [`run`] asks the agent and
//! draws it until Ctrl-C, saying so plainly while no agent answers.

use std::{
    fmt::Write as _,
    io::{IsTerminal, Write as _},
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use retry_after_client::{AgentStatus, ClientError};
use retry_after_protocol::StatusResponse;

/// The view's width: every line fits an 80-column terminal.
pub const WIDTH: usize = 80;

/// How long one refresh may wait on the agent.
const ASK_TIMEOUT: Duration = Duration::from_millis(800);

/// Why the view cannot be drawn.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// Nothing answers on the socket.
    #[error("no agent is running on {socket} ({cause})")]
    NotRunning {
        /// The socket tried.
        socket: String,
        /// What connecting said.
        cause: std::io::Error,
    },
    /// The agent answered, but not as expected, or not in time.
    #[error("the agent on {socket} did not answer: {cause}")]
    NoAnswer {
        /// The socket asked.
        socket: String,
        /// What went wrong.
        cause: ClientError,
    },
}

/// Ask the agent on `socket` for everything the view shows.
///
/// # Errors
/// [`StatusError::NotRunning`] when nothing answers there, else [`StatusError::NoAnswer`].
pub fn ask(socket: &Path) -> Result<AgentStatus, StatusError> {
    retry_after_client::status(socket, ASK_TIMEOUT).map_err(|cause| {
        let socket = socket.display().to_string();
        match cause {
            ClientError::Io(cause)
                if matches!(
                    cause.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                StatusError::NotRunning { socket, cause }
            }
            cause => StatusError::NoAnswer { socket, cause },
        }
    })
}

/// Draw the view until Ctrl-C (each `interval`), or once when `once` is set or standard
/// output is not a terminal.
///
/// # Errors
/// Once: the agent could not be asked ([`ask`]). Live, an agent that does not answer is
/// shown as such and asked again at the next refresh.
pub async fn run(socket: &Path, once: bool, interval: Duration) -> Result<(), StatusError> {
    if once || !std::io::stdout().is_terminal() {
        print!("{}", render(socket, &ask(socket)?, now_utc()));
        return Ok(());
    }
    let mut out = std::io::stdout();
    loop {
        let view = match ask(socket) {
            Ok(status) => render(socket, &status, now_utc()),
            Err(error) => not_answering(socket, &error, now_utc()),
        };
        // Home, each line cleared to its end, the rest of the screen cleared: no flicker.
        let screen: String = view.lines().map(|l| format!("{l}\x1b[K\r\n")).collect();
        let _ = write!(out, "\x1b[H{screen}\x1b[J");
        let _ = out.flush();
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = tokio::signal::ctrl_c() => {
                let _ = writeln!(out);
                return Ok(());
            }
        }
    }
}

/// The view while nothing answers: the header and why.
pub fn not_answering(socket: &Path, error: &StatusError, clock: String) -> String {
    let mut view = header(socket, &clock);
    let _ = writeln!(view, "{}", fit(&error.to_string(), WIDTH));
    let _ = writeln!(view, "asking again every second; Ctrl-C quits");
    view
}

/// The view of `status` from the agent on `socket`, at `clock` (`HH:MM:SS` UTC).
pub fn render(socket: &Path, status: &AgentStatus, clock: String) -> String {
    let h = &status.health;
    let mut view = header(socket, &clock);
    let last_tick = h
        .last_tick_ms
        .map_or_else(|| "none yet".to_owned(), |ms| format!("{ms} ms ago"));
    let _ = writeln!(
        view,
        "{}",
        fit(
            &format!(
                "up {}  ticks {} (last {last_tick})  services {}  endpoints {}  connections {}",
                duration(h.uptime_s),
                h.ticks,
                h.services,
                h.endpoints,
                h.connections
            ),
            WIDTH
        )
    );
    let _ = writeln!(view);
    let _ = writeln!(
        view,
        "{:<13} {:>5} {:<8} {:>7} {:>7} {:>6} {:<8} {:>8} {:>8}",
        "SERVICE",
        "DEPTH",
        "SOURCE",
        "DRAIN/S",
        "FRESH/S",
        "ANSWER",
        "RUNG",
        "PROMISED",
        "ADMITTED"
    );
    for service in &status.services {
        row(&mut view, service);
    }
    if status.services.is_empty() {
        let _ = writeln!(view, "no service is configured");
    }
    view
}

/// The first line: what is watched, and when.
fn header(socket: &Path, clock: &str) -> String {
    let title = fit(
        &format!("retry-after-agent on {}", socket.display()),
        WIDTH - clock.len() - 1,
    );
    format!("{title:<width$} {clock}\n", width = WIDTH - clock.len() - 1)
}

/// One service: its numbers, then its policy, what the judge has seen and why the answer is
/// not computed, if it is not.
fn row(view: &mut String, s: &StatusResponse) {
    let depth = s.queue_depth.map(|q| q.depth.to_string());
    let source = s.queue_depth.map(|q| match q.source.as_str() {
        "beyond_capacity" => "beyond",
        other => other,
    });
    let answer = match (s.seconds, s.millis) {
        (Some(_), Some(ms)) => format!("{:.2}s", ms as f64 / 1000.0),
        (Some(seconds), None) => format!("{seconds}s"),
        (None, _) => "none".to_owned(),
    };
    let _ = writeln!(
        view,
        "{:<13} {:>5} {:<8} {:>7} {:>7} {:>6} {:<8} {:>8} {:>8}",
        fit(&s.service, 13),
        fit(depth.as_deref().unwrap_or("-"), 5),
        fit(source.unwrap_or("-"), 8),
        fit(&rate(s.drain_rate), 7),
        fit(&rate(s.arrival_rate), 7),
        fit(&answer, 6),
        s.rung.as_str(),
        fit(&s.returns_promised.to_string(), 8),
        s.admitted_share
            .map_or_else(|| "-".to_owned(), |share| format!("{:.1}%", 100.0 * share)),
    );
    let mut detail = format!("  {}", s.retry_after_policy);
    if let Some(reason) = s.reason {
        let _ = write!(detail, "; {}: {}", s.rung, reason);
    }
    let _ = write!(detail, "; {} answers judged", s.admission_judged);
    let _ = writeln!(view, "{}", fit(&detail, WIDTH));
}

/// A rate with one decimal, `-` when unknown.
fn rate(value: Option<f64>) -> String {
    value.map_or_else(
        || "-".to_owned(),
        // Whole numbers from 10,000 a second, so that they fit the column.
        |v| {
            if v >= 9_999.95 {
                format!("{v:.0}")
            } else {
                format!("{v:.1}")
            }
        },
    )
}

/// `text` cut to `width` characters, a `~` marking the cut.
fn fit(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('~');
    cut
}

/// Seconds as `1d02h`, `3h04m`, `5m06s` or `7s`.
fn duration(seconds: u64) -> String {
    let (d, h, m, s) = (
        seconds / 86_400,
        seconds / 3_600 % 24,
        seconds / 60 % 60,
        seconds % 60,
    );
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m{s:02}s"),
        (0, _, _) => format!("{h}h{m:02}m"),
        _ => format!("{d}d{h:02}h"),
    }
}

/// The time of day now, `HH:MM:SS` UTC.
fn now_utc() -> String {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!(
        "{:02}:{:02}:{:02} UTC",
        seconds / 3_600 % 24,
        seconds / 60 % 60,
        seconds % 60
    )
}

#[cfg(test)]
mod tests {
    use retry_after_protocol::{
        HealthResponse,
        policy::{FallbackReason, QueueDepth, QueueDepthSource, RetryAfterPolicy, Rung},
    };

    use super::*;

    fn service(name: &str) -> StatusResponse {
        StatusResponse {
            service: name.to_owned(),
            retry_after_policy: RetryAfterPolicy::ScheduledReturns,
            seconds: Some(5),
            millis: Some(4350),
            rung: Rung::Computed,
            reason: None,
            queue_depth: Some(QueueDepth {
                depth: 12,
                source: QueueDepthSource::Frontend,
            }),
            drain_rate: Some(16.0),
            arrival_rate: Some(24.06),
            returns_promised: 40,
            admission_judged: 1204,
            admitted_share: Some(0.912),
            next: None,
        }
    }

    fn agent(services: Vec<StatusResponse>) -> AgentStatus {
        AgentStatus {
            health: HealthResponse {
                uptime_s: 7_380,
                ticks: 29_644,
                last_tick_ms: Some(41),
                services: services.len(),
                endpoints: 4,
                connections: 5,
            },
            services,
        }
    }

    #[test]
    fn the_view_shows_each_services_numbers_in_its_columns() {
        let view = render(
            Path::new("/run/retry-after-agent/agent.sock"),
            &agent(vec![service("chat")]),
            "07:58:01 UTC".into(),
        );
        let lines: Vec<&str> = view.lines().collect();
        assert_eq!(
            lines[0],
            "retry-after-agent on /run/retry-after-agent/agent.sock              07:58:01 UTC"
        );
        assert_eq!(
            lines[1],
            "up 2h03m  ticks 29644 (last 41 ms ago)  services 1  endpoints 4  connections 5"
        );
        assert_eq!(
            lines[4],
            "chat             12 frontend    16.0    24.1  4.35s computed       40    91.2%"
        );
        assert_eq!(lines[5], "  scheduled_returns; 1204 answers judged");
    }

    #[test]
    fn every_line_fits_80_columns_whatever_the_values() {
        let mut long = service(&"s".repeat(64));
        long.queue_depth = Some(QueueDepth {
            depth: u64::MAX,
            source: QueueDepthSource::BeyondCapacity,
        });
        long.drain_rate = Some(1e300);
        long.arrival_rate = Some(-1e300);
        long.returns_promised = u64::MAX;
        long.millis = Some(u64::MAX);
        long.rung = Rung::Static;
        long.reason = Some(FallbackReason::EstimateUnusable);
        long.admission_judged = u64::MAX;
        let mut health = agent(vec![long]);
        health.health.uptime_s = u64::MAX;
        health.health.ticks = u64::MAX;
        health.health.last_tick_ms = Some(u64::MAX);
        let view = render(Path::new(&"/x".repeat(100)), &health, "23:59:59 UTC".into());
        for line in view.lines() {
            assert!(
                line.chars().count() <= WIDTH,
                "{} columns: {line}",
                line.len()
            );
        }
        assert!(view.contains("static: estimate_unusable"), "{view}");
    }

    #[test]
    fn an_agent_that_is_not_running_is_said_so() {
        let socket = Path::new("/nonexistent/agent.sock");
        let error = ask(socket).unwrap_err();
        assert!(matches!(error, StatusError::NotRunning { .. }), "{error}");
        let view = not_answering(socket, &error, "00:00:00 UTC".into());
        assert!(
            view.contains("no agent is running on /nonexistent/agent.sock"),
            "{view}"
        );
    }

    #[test]
    fn durations_read_at_a_glance() {
        let got: Vec<String> = [7, 306, 11_040, 93_600].into_iter().map(duration).collect();
        assert_eq!(got, ["7s", "5m06s", "3h04m", "1d02h"]);
    }
}
