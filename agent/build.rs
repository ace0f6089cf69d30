//! Compiles the eBPF programs (the `retry-after-ebpf` crate) for the BPF target, so the agent
//! can embed the object file. Needs `bpf-linker` on PATH (`./dev setup` installs it). Also
//! names the commit the binary is built from, for `--version` (`git_commit.rs`).

use std::path::{Path, PathBuf};

use anyhow::{Context as _, anyhow};
use aya_build::Toolchain;

mod git_commit;

const EBPF_PACKAGE: &str = "retry-after-ebpf";

fn main() -> anyhow::Result<()> {
    emit_commit()?;
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let package = packages
        .into_iter()
        .find(|package| package.name.as_str() == EBPF_PACKAGE)
        .ok_or_else(|| anyhow!("{EBPF_PACKAGE} package not found"))?;
    let root_dir = package
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent for {}", package.manifest_path))?;
    // The eBPF crate is built with build-std and one unstable intrinsic (see its counters.rs);
    // the pinned stable toolchain allows both with RUSTC_BOOTSTRAP, set only for that build.
    // SAFETY: build scripts are single-threaded; nothing else reads the environment here.
    unsafe { std::env::set_var("RUSTC_BOOTSTRAP", "1") };
    // The programs also compile the shared crate (the turn and TLS state machines); aya-build
    // watches only the eBPF crate's own directory.
    println!("cargo::rerun-if-changed={root_dir}/../common");
    let toolchain = pinned_toolchain().context("reading the channel from rust-toolchain.toml")?;
    // aya-build builds into OUT_DIR, which differs for each profile and each set of features
    // the agent is built with (check, doc, debug, test, release): the same object, built anew
    // each time. It is built once instead, in the target folder's `ebpf/`, and copied here.
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let shared = shared_ebpf_dir(&out_dir);
    // SAFETY: as above.
    unsafe { std::env::set_var("OUT_DIR", &shared) };
    let built = aya_build::build_ebpf(
        [aya_build::Package {
            name: EBPF_PACKAGE,
            root_dir: root_dir.as_str(),
            ..Default::default()
        }],
        Toolchain::Custom(Box::leak(toolchain.into_boxed_str())),
    );
    // SAFETY: as above.
    unsafe { std::env::set_var("OUT_DIR", &out_dir) };
    built?;
    let object = shared.join(EBPF_PACKAGE);
    std::fs::copy(&object, out_dir.join(EBPF_PACKAGE))
        .with_context(|| format!("copying {}", object.display()))?;
    Ok(())
}

/// `RETRY_AFTER_AGENT_COMMIT` for `--version`: as given in the environment, else the checkout's
/// commit (`-dirty` if tracked files differ), else `unknown` (no git, or not a checkout: a
/// tarball). This script runs again when HEAD moves, so the commit stays right; an edit alone
/// does not run it again, so `-dirty` may lag behind the files until then: `./dev package`
/// gives the variable, which runs it again whenever the value changes.
fn emit_commit() -> anyhow::Result<()> {
    println!("cargo::rerun-if-env-changed={}", git_commit::VARIABLE);
    let given = std::env::var(git_commit::VARIABLE).unwrap_or_default();
    let commit = if given.is_empty() {
        let manifest_dir = PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR not set")?,
        );
        let root = manifest_dir.parent().unwrap_or(&manifest_dir);
        for file in git_commit::head_files(root) {
            println!("cargo::rerun-if-changed={}", file.display());
        }
        git_commit::describe(root).unwrap_or_else(|| git_commit::UNKNOWN.to_owned())
    } else {
        given
    };
    println!("cargo::rustc-env={}={commit}", git_commit::VARIABLE);
    Ok(())
}

/// `<target>/ebpf`, from OUT_DIR (`<target>/<profile>/build/<package>-<hash>/out`); OUT_DIR
/// itself where it has no such shape.
fn shared_ebpf_dir(out_dir: &Path) -> PathBuf {
    match out_dir.ancestors().nth(4) {
        Some(target)
            if out_dir
                .parent()
                .and_then(Path::parent)
                .and_then(Path::file_name)
                == Some("build".as_ref()) =>
        {
            target.join("ebpf")
        }
        _ => out_dir.to_path_buf(),
    }
}

/// The channel named in the workspace's rust-toolchain.toml, so the eBPF crate is built by the
/// same toolchain (and therefore the same LLVM) that bpf-linker was built against.
fn pinned_toolchain() -> anyhow::Result<String> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR")?;
    let path = std::path::Path::new(&manifest_dir).join("../rust-toolchain.toml");
    println!("cargo::rerun-if-changed={}", path.display());
    let text = std::fs::read_to_string(&path)?;
    text.lines()
        .find_map(|line| line.trim().strip_prefix("channel"))
        .and_then(|rest| rest.split('"').nth(1))
        .map(str::to_owned)
        .ok_or_else(|| anyhow!("no channel = \"...\" line in {}", path.display()))
}
