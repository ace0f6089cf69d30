//! `ERR` lines: why a request was refused.

use std::fmt;

/// Why a line was refused: the code and reason of an `ERR` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProtocolError {
    /// Machine-readable code.
    pub code: ErrorCode,
    /// What was wrong, for people (printable ASCII on one line when printed).
    pub reason: String,
}

retry_after_policy::names! {
    /// The `ERR` codes, as written on the wire.
    ErrorCode, "error code" {
        /// Empty, not ASCII text, or malformed.
        BadRequest = "bad_request",
        /// Longer than [`crate::MAX_LINE_LEN`].
        LineTooLong = "line_too_long",
        /// Not a command of this protocol.
        UnknownCommand = "unknown_command",
        /// An option or its value is not valid.
        BadArgument = "bad_argument",
        /// No such service is configured.
        UnknownService = "unknown_service",
        /// The peer's uid is not allowed.
        Denied = "denied",
        /// Too many connections; this one is closed.
        Overloaded = "overloaded",
        /// No request for too long; this connection is closed.
        Idle = "idle",
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

    /// `line` is not a well-formed message of its kind (used by the response parsers).
    pub(crate) fn malformed(what: &str, line: &str) -> Self {
        let shown: String = line.chars().take(80).collect();
        Self::new(ErrorCode::BadRequest, format!("{what}: {shown:?}"))
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

impl std::error::Error for ProtocolError {}
