//! The Debian package as an operator meets it: built by the documented command (`./dev
//! package`), installed on this machine with apt, its unit judged by systemd's verifier (as the
//! deploy test judges the source unit), its binary run from /usr/bin (`--version`, `check` on
//! the installed configuration), then removed and purged, leaving nothing of it behind. The
//! package's install and removal logs are printed (`--nocapture` shows them).

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    time::Instant,
};

use retry_after_testkit::{require_root, run_ok};

const PACKAGE: &str = "retry-after-agent";
const BINARY: &str = "/usr/bin/retry-after-agent";
const CONFIG_DIR: &str = "/etc/retry-after-agent";
const CONFIG: &str = "/etc/retry-after-agent/config.toml";
const UNIT: &str = "/usr/lib/systemd/system/retry-after-agent.service";
const DOCS: &str = "/usr/share/doc/retry-after-agent";
/// The system user the package's sysusers file declares.
const USER: &str = "retry-after";
/// The socket's directory, which `check` makes if it is missing.
const SOCKET_DIR: &str = "/run/retry-after-agent";

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

/// dpkg's status of the package (`install ok installed`, `deinstall ok config-files`), or
/// `None` when dpkg knows nothing of it.
fn dpkg_status() -> Option<String> {
    let out = Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", PACKAGE])
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (out.status.success() && !status.is_empty() && !status.ends_with("not-installed"))
        .then_some(status)
}

/// `apt-get <args>` without questions; its log (standard output and error), with dpkg's
/// progress through its database kept to the last step.
fn apt_get(args: &[&str]) -> String {
    let log = run_ok(
        Command::new("apt-get")
            .current_dir(workspace())
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["-y", "-q"])
            .args(args),
    );
    const PROGRESS: &str = "(Reading database ... ";
    log.lines()
        .map(|line| match line.rfind(PROGRESS) {
            Some(last) => &line[last..],
            None => line,
        })
        .map(|line| format!("{line}\n"))
        .collect()
}

fn user_exists() -> bool {
    Command::new("getent")
        .args(["passwd", USER])
        .output()
        .unwrap()
        .status
        .success()
}

/// Purges the package however the test ends, and undoes what the test did beside it: the
/// socket directory `check` made, the user the package's postinst made (purge leaves users, as
/// Debian packages do; the test leaves the machine as it found it).
struct Cleanup {
    user_existed: bool,
    socket_dir_existed: bool,
}

impl Cleanup {
    fn purge_any_leftover() {
        if let Some(status) = dpkg_status() {
            println!("a package from an earlier run ({status}): purging it first");
            apt_get(&["purge", PACKAGE]);
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if dpkg_status().is_some() {
            let out = Command::new("apt-get")
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(["-y", "-q", "purge", PACKAGE])
                .output();
            eprintln!("cleanup: apt-get purge {PACKAGE}: {out:?}");
        }
        if !self.socket_dir_existed {
            let _ = std::fs::remove_dir(SOCKET_DIR);
        }
        if !self.user_existed && user_exists() {
            let _ = Command::new("userdel").arg(USER).status();
            let _ = Command::new("groupdel").arg(USER).output();
        }
    }
}

/// Standard output and error of a finished command, for messages.
fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `./dev package` from the workspace, as the docs say to run it, packaging the debug build
/// the suite already has (`--profile dev`: the same package, an unoptimised binary, without
/// a release build of its own); the package's path (the last line of its standard output).
fn build_package(root: &Path) -> PathBuf {
    let out = Command::new(root.join("dev"))
        .args(["package", "--profile", "dev"])
        .current_dir(root)
        // `./dev test` runs this suite with it; the package's build must not differ from the
        // documented command's (the agent's build script sets it for the eBPF crate itself).
        .env_remove("RUSTC_BOOTSTRAP")
        .output()
        .unwrap();
    let log = text(&out);
    assert!(out.status.success(), "./dev package failed:\n{log}");
    let tail: Vec<&str> = log.lines().rev().take(8).collect();
    println!("./dev package (last lines):");
    for line in tail.iter().rev() {
        println!("  {line}");
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let deb = PathBuf::from(stdout.lines().last().unwrap_or_default().trim());
    assert!(
        deb.is_file() && deb.extension().is_some_and(|e| e == "deb"),
        "./dev package's last line {deb:?} is not a package file:\n{log}"
    );
    deb
}

/// What `--version` should name: HEAD's first 12 hex digits, `-dirty` if a tracked file
/// differs (as `./dev package` gives it to the build).
fn expected_commit(root: &Path) -> String {
    let git = |args: &[&str]| run_ok(Command::new("git").current_dir(root).args(args));
    let head = git(&["rev-parse", "--short=12", "HEAD"]).trim().to_owned();
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"])
        .trim()
        .is_empty();
    if dirty { format!("{head}-dirty") } else { head }
}

#[test]
fn the_debian_package_installs_verifies_checks_and_purges_cleanly() {
    require_root();
    let root = workspace();
    Cleanup::purge_any_leftover();
    let _cleanup = Cleanup {
        user_existed: user_exists(),
        socket_dir_existed: Path::new(SOCKET_DIR).exists(),
    };
    let test_started = Instant::now();

    // Build.
    let started = Instant::now();
    let deb = build_package(&root);
    let version = env!("CARGO_PKG_VERSION");
    let name = deb.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with(&format!("{PACKAGE}_{version}-1_")),
        "{name} is not {PACKAGE}_{version}-1_<arch>.deb"
    );
    println!("built {} in {:.0?}", deb.display(), started.elapsed());
    let control = run_ok(Command::new("dpkg-deb").arg("--info").arg(&deb));
    println!("dpkg-deb --info:\n{control}");
    let depends = control
        .lines()
        .find_map(|l| l.trim().strip_prefix("Depends: "))
        .unwrap_or_else(|| panic!("no Depends:\n{control}"));
    assert!(depends.contains("libc6"), "{depends}");
    assert!(depends.contains("systemd"), "{depends}");
    println!(
        "dpkg-deb --contents:\n{}",
        run_ok(Command::new("dpkg-deb").arg("--contents").arg(&deb))
    );

    // Install, as the docs say.
    let started = Instant::now();
    // A path apt takes for a file, not a package name: `./` and the path from the workspace.
    let relative = deb.strip_prefix(&root).unwrap_or(&deb);
    let log = apt_get(&["install", &format!("./{}", relative.display())]);
    println!(
        "--- install log ({:.1?}) ---\n{log}--- end of install log ---",
        started.elapsed()
    );
    assert_eq!(dpkg_status().as_deref(), Some("install ok installed"));
    let listed = run_ok(Command::new("dpkg").args(["-L", PACKAGE]));
    let files: Vec<&str> = listed.lines().map(str::trim).collect();
    for expected in [
        BINARY,
        UNIT,
        "/usr/lib/sysusers.d/retry-after-agent.conf",
        CONFIG,
        "/usr/share/doc/retry-after-agent/README.md",
        "/usr/share/doc/retry-after-agent/CHANGELOG.md",
        "/usr/share/doc/retry-after-agent/copyright",
        "/usr/share/doc/retry-after-agent/docs/deploy.md",
        "/usr/share/doc/retry-after-agent/docs/configuration.md",
        "/usr/share/doc/retry-after-agent/docs/integrations/haproxy.md",
    ] {
        assert!(
            files.contains(&expected),
            "dpkg -L lacks {expected}:\n{listed}"
        );
        assert!(Path::new(expected).is_file(), "{expected} is not there");
    }
    for file in &files {
        assert!(Path::new(file).exists(), "dpkg -L names {file}, not there");
    }
    let conffiles = run_ok(Command::new("dpkg-query").args(["-W", "-f=${Conffiles}", PACKAGE]));
    assert!(conffiles.contains(CONFIG), "conffiles: {conffiles}");
    assert_eq!(
        std::fs::read_to_string(CONFIG).unwrap(),
        std::fs::read_to_string(root.join("deploy/systemd/config.toml")).unwrap()
    );
    assert!(user_exists(), "the postinst made no {USER} user");
    // Installed, not enabled (nor started: there is no systemd running here to start it).
    let wants = Path::new("/etc/systemd/system/multi-user.target.wants/retry-after-agent.service");
    assert!(!wants.exists(), "installing enabled the unit");

    // The installed unit, with systemd's own verifier, as the deploy test runs it.
    let verify = run_ok(Command::new("systemd-analyze").args(["verify", UNIT]));
    assert!(verify.trim().is_empty(), "verify said: {verify}");

    // The installed binary: its version and commit, and `check` on the installed configuration.
    let printed = run_ok(Command::new(BINARY).arg("--version"));
    println!("{BINARY} --version: {}", printed.trim());
    assert_eq!(
        printed.trim(),
        format!("{PACKAGE} {version} ({})", expected_commit(&root))
    );
    let check = run_ok(
        Command::new(BINARY)
            .args(["check", "--config", CONFIG])
            .env("RUST_LOG", "off"),
    );
    println!("{BINARY} check --config {CONFIG}:\n{check}");
    assert!(
        check.contains("everything the agent needs is here"),
        "{check}"
    );
    // The installed binary's own programs, loaded and attached (not an agent's beside it: the
    // root suite runs one test at a time).
    assert!(
        check.contains("eBPF programs: sock_ops and cgroup_skb programs load and attach"),
        "check did not load the installed binary's programs:\n{check}"
    );

    // Remove: the package's files go, the edited configuration stays.
    let started = Instant::now();
    let log = apt_get(&["remove", PACKAGE]);
    println!(
        "--- removal log ({:.1?}) ---\n{log}--- end of removal log ---",
        started.elapsed()
    );
    assert_eq!(dpkg_status().as_deref(), Some("deinstall ok config-files"));
    for gone in [BINARY, UNIT, DOCS] {
        assert!(
            !Path::new(gone).exists(),
            "{gone} is still there after remove"
        );
    }
    assert!(Path::new(CONFIG).is_file(), "remove took the conffile");

    // Purge: the configuration and systemd's record of the unit go too.
    let started = Instant::now();
    let log = apt_get(&["purge", PACKAGE]);
    println!(
        "--- purge log ({:.1?}) ---\n{log}--- end of purge log ---",
        started.elapsed()
    );
    let status = Command::new("dpkg").args(["-s", PACKAGE]).output().unwrap();
    assert!(
        !status.status.success() && text(&status).contains("is not installed"),
        "dpkg -s after purge: {}",
        text(&status)
    );
    assert_eq!(dpkg_status(), None);
    for gone in [
        CONFIG_DIR,
        "/etc/systemd/system/retry-after-agent.service",
        "/var/lib/systemd/deb-systemd-helper-masked/retry-after-agent.service",
        "/var/lib/systemd/deb-systemd-helper-enabled/retry-after-agent.service.dsh-also",
    ]
    .into_iter()
    .chain(files.iter().copied().filter(|f| !Path::new(f).is_dir()))
    {
        assert!(
            std::fs::symlink_metadata(gone).is_err(),
            "{gone} is still there after purge"
        );
    }
    assert!(
        !Path::new(DOCS).exists(),
        "{DOCS} is still there after purge"
    );
    println!(
        "left after purge: the {USER} user and group ({}; Debian leaves system users), removed \
         by this test's cleanup unless they were here before",
        if user_exists() { "present" } else { "absent" }
    );
    println!("the package's test took {:.0?}", test_started.elapsed());
}
