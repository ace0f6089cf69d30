//! How long each part of a task took, printed as a table at its end.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// The parts of a task in the order they ran, each with its time.
#[derive(Debug, Default)]
pub struct Timings {
    parts: Vec<(String, Duration)>,
}

impl Timings {
    /// Run `f` as the part `name`, recording its time whatever its outcome.
    pub fn part<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let started = Instant::now();
        let outcome = f();
        self.record(name, started.elapsed());
        outcome
    }

    /// Add `elapsed` to the part `name` (a new row the first time it is named).
    pub fn record(&mut self, name: &str, elapsed: Duration) {
        match self.parts.iter_mut().find(|(part, _)| part == name) {
            Some((_, total)) => *total += elapsed,
            None => self.parts.push((name.to_owned(), elapsed)),
        }
    }

    /// The table, to stderr: one row a part, then the sum of the top-level parts (rows
    /// indented with two spaces are inside the row above them and are not added again).
    pub fn print(&self) {
        let total: Duration = self
            .parts
            .iter()
            .filter(|(name, _)| !name.starts_with("  "))
            .map(|(_, elapsed)| *elapsed)
            .sum();
        let width = self
            .parts
            .iter()
            .map(|(name, _)| name.len())
            .max()
            .unwrap_or(0);
        eprintln!("\n{:<width$}  {:>8}", "part", "seconds");
        for (name, elapsed) in &self.parts {
            eprintln!("{name:<width$}  {:>8.1}", elapsed.as_secs_f64());
        }
        eprintln!("{:<width$}  {:>8.1}", "total", total.as_secs_f64());
    }
}

/// A libtest binary's outcome and the time of each of its tests, by module (the first
/// segment of a test's path).
pub type TestRun = (Result<()>, Vec<(String, Duration)>);

/// One libtest binary to its end, its output passed through line by line; when it fails, its
/// error ends with each failed test's panic message, so the last lines of a long log say what
/// failed.
pub fn run_tests(mut command: Command) -> TestRun {
    let mut modules = Vec::new();
    let mut failures = Failures::default();
    let outcome = (|| {
        let line = crate::command_line(&command);
        eprintln!("+ {line}");
        let mut child = command
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start `{line}`"))?;
        let stdout = child.stdout.take().context("the tests' stdout")?;
        for text in BufReader::new(stdout).lines() {
            let text = text.context("reading the tests' output")?;
            let mut out = std::io::stdout().lock();
            writeln!(out, "{text}")?;
            out.flush()?;
            if let Some((module, elapsed)) = test_time(&text) {
                modules.push((module.to_owned(), elapsed));
            }
            failures.read(&text);
        }
        let status = child.wait()?;
        if !status.success() {
            bail!("`{line}` failed ({status}){}", failures.summary());
        }
        Ok(())
    })();
    (outcome, modules)
}

/// The panic messages in libtest's `failures:` section, a few lines each.
#[derive(Debug, Default)]
struct Failures {
    /// Each failed test's name and the first lines of its panic message.
    tests: Vec<(String, Vec<String>)>,
    /// Inside a panic message (from `thread '…' (id) panicked at` to a backtrace).
    reading: bool,
}

impl Failures {
    /// Lines kept of each failed test's panic message.
    const LINES: usize = 8;
    /// Characters kept of each line.
    const WIDTH: usize = 1_000;

    /// Take in one line of libtest's output.
    fn read(&mut self, line: &str) {
        if let Some(name) = line
            .strip_prefix("---- ")
            .and_then(|rest| rest.strip_suffix(" stdout ----"))
        {
            self.tests.push((name.to_owned(), Vec::new()));
            self.reading = false;
        } else if line.starts_with("thread '") && line.contains(" panicked at ") {
            self.reading = true;
        } else if line == "failures:"
            || line.starts_with("stack backtrace:")
            || line.starts_with("note: run with `RUST_BACKTRACE")
        {
            self.reading = false;
            return;
        }
        if let Some((_, lines)) = self.tests.last_mut().filter(|_| self.reading)
            && lines.len() < Self::LINES
            && !line.trim().is_empty()
        {
            lines.push(line.chars().take(Self::WIDTH).collect());
        }
    }

    /// The failed tests and their messages, after a newline; empty if none was read.
    fn summary(&self) -> String {
        let mut text = String::new();
        for (name, lines) in &self.tests {
            text.push_str(&format!("\n{name}:"));
            for line in lines {
                text.push_str(&format!("\n    {line}"));
            }
        }
        text
    }
}

/// The module and time of a libtest line `test module::name ... ok <1.234s>`.
fn test_time(line: &str) -> Option<(&str, Duration)> {
    let rest = line.strip_prefix("test ")?;
    let (name, outcome) = rest.split_once(" ... ")?;
    let seconds = outcome.rsplit_once('<')?.1.strip_suffix("s>")?;
    let elapsed = Duration::try_from_secs_f64(seconds.parse().ok()?).ok()?;
    Some((name.split("::").next()?, elapsed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_keep_each_failed_tests_first_lines_until_the_list() {
        let mut failures = Failures::default();
        for line in [
            "test a::b ... FAILED <1.000s>",
            "failures:",
            "",
            "---- a::b stdout ----",
            "figures: 90% admitted",
            "thread 'a::b' panicked at tests/a.rs:3:5:",
            "assertion failed",
            "note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace",
            "---- c::d stdout ----",
            "thread 'c::d' (7) panicked at tests/c.rs:1:1:",
            "stack backtrace:",
            "   0: frames",
            "",
            "failures:",
            "    a::b",
        ] {
            failures.read(line);
        }
        assert_eq!(
            failures.summary(),
            "\na::b:\n    thread 'a::b' panicked at tests/a.rs:3:5:\n    assertion failed\nc::d:\n    thread 'c::d' (7) panicked at tests/c.rs:1:1:"
        );
    }

    #[test]
    fn a_test_line_gives_its_module_and_time() {
        assert_eq!(
            test_time("test http2::grpc_calls ... ok <12.500s>"),
            Some(("http2", Duration::from_millis(12_500)))
        );
        assert_eq!(
            test_time("test ray_serve::front ... FAILED <1.000s>"),
            Some(("ray_serve", Duration::from_secs(1)))
        );
        assert_eq!(
            test_time("test kernel_matrix::guest_side ... ignored"),
            None
        );
        assert_eq!(test_time("running 3 tests"), None);
    }
}
