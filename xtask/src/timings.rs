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

/// Run libtest binaries, one per command, at the same time, passing their output through line
/// by line, and record each module's time (the first segment of a test's path) as an indented
/// part of `timings`. Fails if any fails.
pub fn run_timed_tests(commands: Vec<Command>, timings: &mut Timings) -> Result<()> {
    let runs: Vec<TestRun> = std::thread::scope(|scope| {
        let handles: Vec<_> = commands
            .into_iter()
            .map(|command| scope.spawn(move || run_one(command)))
            .collect();
        handles
            .into_iter()
            .map(|handle| match handle.join() {
                Ok(run) => run,
                Err(_) => (
                    Err(anyhow::anyhow!("a test runner thread panicked")),
                    Vec::new(),
                ),
            })
            .collect()
    });
    let mut outcome = Ok(());
    for (result, modules) in runs {
        for (module, elapsed) in modules {
            timings.record(&format!("  {module}"), elapsed);
        }
        outcome = outcome.and(result);
    }
    outcome
}

/// A libtest binary's outcome and the time of each of its tests, by module.
type TestRun = (Result<()>, Vec<(String, Duration)>);

/// One libtest binary to its end.
fn run_one(mut command: Command) -> TestRun {
    let mut modules = Vec::new();
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
        }
        let status = child.wait()?;
        if !status.success() {
            bail!("`{line}` failed ({status})");
        }
        Ok(())
    })();
    (outcome, modules)
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
