//! Run a command inside a virtual machine booting one of the kernel matrix's pinned Debian
//! kernels (see `retry_after_testkit::vm`), in this directory, with this machine's root
//! filesystem (read-only, under a tmpfs overlay), as root; its output comes to this
//! standard output as it is written, and its exit status is this command's.
//!
//! ```text
//! cargo run -p retry-after-testkit --bin guest -- --kernel 6.1 [--timeout SECONDS] -- CMD [ARGS...]
//! ```
//!
//! e.g. `cargo run -p retry-after-testkit --bin guest -- --kernel 6.1 -- uname -r`. With
//! `--console` the guest's serial console (the kernel's messages) follows the output. Needs
//! `./dev setup` (QEMU, busybox-static, the kernels).

use std::{process::ExitCode, time::Duration};

use retry_after_testkit::vm::{self, KERNELS, Options};

/// The command line, parsed.
struct Args {
    kernel: String,
    timeout: Duration,
    console: bool,
    command: Vec<String>,
}

const USAGE: &str =
    "usage: guest --kernel <5.10|6.1|6.12> [--timeout SECONDS] [--console] -- CMD [ARGS...]";

fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut kernel = None;
    let mut timeout = Duration::from_secs(600);
    let mut console = false;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--kernel" => kernel = Some(args.next().ok_or("--kernel needs a value")?),
            "--timeout" => {
                let seconds = args.next().ok_or("--timeout needs a value")?;
                let seconds: u64 = seconds
                    .parse()
                    .map_err(|_| format!("--timeout {seconds}: not a number of seconds"))?;
                timeout = Duration::from_secs(seconds);
            }
            "--console" => console = true,
            "--" => break,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let command: Vec<String> = args.collect();
    if command.is_empty() {
        return Err("no command given".to_owned());
    }
    let kernel = kernel.ok_or("--kernel is required")?;
    Ok(Args {
        kernel,
        timeout,
        console,
        command,
    })
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(error) => {
            eprintln!("guest: {error}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let Some(kernel) = vm::kernel(&args.kernel) else {
        let names: Vec<&str> = KERNELS.iter().map(|k| k.name).collect();
        eprintln!("guest: no kernel {} (known: {names:?})", args.kernel);
        return ExitCode::from(2);
    };
    let command: Vec<&str> = args.command.iter().map(String::as_str).collect();
    let options = Options {
        timeout: args.timeout,
        echo: true,
        ..Options::default()
    };
    match vm::run_with(kernel, &command, &options) {
        Ok(run) => {
            if args.console {
                eprintln!("--- console ---\n{}", run.console);
            }
            eprintln!(
                "guest: kernel {} booted in {:.1} s, exited {} after {:.1} s",
                kernel.release,
                run.boot.as_secs_f64(),
                run.exit_code,
                run.wall.as_secs_f64()
            );
            ExitCode::from(u8::try_from(run.exit_code).unwrap_or(255))
        }
        Err(error) => {
            eprintln!("guest: {error}");
            ExitCode::from(255)
        }
    }
}
