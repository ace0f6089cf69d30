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

/// The `ERR` codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// Empty, not ASCII text, or malformed.
    BadRequest,
    /// Longer than [`crate::MAX_LINE_LEN`].
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

    /// The code written `name` on the wire.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|code| code.as_str() == name)
    }

    /// True if the agent closes the connection after this error.
    pub const fn closes(self) -> bool {
        matches!(self, Self::Denied | Self::Overloaded | Self::Idle)
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
