//! The small pieces every message is made of: optional values written `none`, exact floats,
//! and `key=value` words.

use std::{fmt, str::FromStr};

use retry_after_policy::{PromisedReturns, RETURN_BINS};

use crate::ProtocolError;

/// An optional value on the wire: the value, or `none`.
pub(crate) struct Opt<'a, T>(pub &'a Option<T>);

impl<T: fmt::Display> fmt::Display for Opt<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(v) => v.fmt(f),
            None => f.write_str("none"),
        }
    }
}

/// A float in its shortest exact form (`0.3`, `16.666666666666668`), so parsing it back gives
/// the same bits. Not finite: `none`.
pub(crate) struct Float(pub Option<f64>);

impl fmt::Display for Float {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.filter(|v| v.is_finite()) {
            Some(v) => write!(f, "{v}"),
            None => f.write_str("none"),
        }
    }
}

/// A schedule of promised returns: counts per second joined by commas, trailing zeros left
/// out; `none` when nothing is promised.
pub(crate) struct Returns<'a>(pub &'a PromisedReturns);

impl fmt::Display for Returns<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bins = self.0.trimmed();
        if bins.is_empty() {
            return f.write_str("none");
        }
        for (i, count) in bins.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{count}")?;
        }
        Ok(())
    }
}

/// [`Returns`] read back: at most [`RETURN_BINS`] counts, digits only.
pub(crate) fn returns(value: &str) -> Result<PromisedReturns, ()> {
    if value == "none" {
        return Ok(PromisedReturns::NONE);
    }
    let counts = value.split(',');
    if counts.clone().count() > RETURN_BINS {
        return Err(());
    }
    let mut bins = Vec::with_capacity(RETURN_BINS);
    for count in counts {
        if count.is_empty() || !count.bytes().all(|b| b.is_ascii_digit()) {
            return Err(());
        }
        bins.push(count.parse::<u32>().map_err(|_| ())?);
    }
    Ok(PromisedReturns::from_bins(bins))
}

/// A response line split into its leading words and its `key=value` options.
pub(crate) struct Fields<'a> {
    pub line: &'a str,
    pub words: std::str::Split<'a, char>,
}

impl<'a> Fields<'a> {
    /// Split `line` (a trailing `\r`/`\n` is ignored); the first word must be `tag`.
    pub fn new(line: &'a str, tag: &str, what: &str) -> Result<Self, ProtocolError> {
        let line = line.trim_end_matches(['\r', '\n']);
        let mut words = line.split(' ');
        if words.next() != Some(tag) {
            return Err(ProtocolError::malformed(what, line));
        }
        Ok(Self { line, words })
    }

    /// The next plain word.
    pub fn word(&mut self, what: &str) -> Result<&'a str, ProtocolError> {
        self.words
            .next()
            .filter(|w| !w.is_empty())
            .ok_or_else(|| ProtocolError::malformed(what, self.line))
    }

    /// Every remaining `key=value`, handed to `apply`. Keys `apply` does not know are skipped,
    /// so fields added by later agents do not break older clients.
    pub fn options(
        self,
        what: &str,
        mut apply: impl FnMut(&str, &str) -> Option<Result<(), ()>>,
    ) -> Result<(), ProtocolError> {
        for word in self.words {
            let bad = || ProtocolError::malformed(what, self.line);
            let (key, value) = word.split_once('=').ok_or_else(bad)?;
            if let Some(Err(())) = apply(key, value) {
                return Err(bad());
            }
        }
        Ok(())
    }
}

/// `value` as a `T`, or `none`.
pub(crate) fn opt<T: FromStr>(value: &str) -> Result<Option<T>, ()> {
    if value == "none" {
        Ok(None)
    } else {
        value.parse().map(Some).map_err(|_| ())
    }
}

/// `value` as a `T`.
pub(crate) fn req<T: FromStr>(value: &str) -> Result<T, ()> {
    value.parse().map_err(|_| ())
}

/// A finite float, or `none`.
pub(crate) fn opt_float(value: &str) -> Result<Option<f64>, ()> {
    match opt::<f64>(value)? {
        Some(v) if !v.is_finite() => Err(()),
        v => Ok(v),
    }
}

/// A finite float.
pub(crate) fn float(value: &str) -> Result<f64, ()> {
    opt_float(value)?.ok_or(())
}
