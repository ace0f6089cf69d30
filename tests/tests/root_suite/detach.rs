//! The real daemon attaches its programs while it runs and leaves nothing attached or loaded
//! once it has stopped on SIGTERM or SIGINT. Checked with bpftool, as an operator would, for
//! the programs the agent's own file descriptors hold (`prog_id` in /proc/<pid>/fdinfo): the
//! suite's other lane may run an agent of its own meanwhile.

use std::{
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use retry_after_agent::kernel::{PROGRAM_NAMES, find_cgroup2_root};
use retry_after_testkit::{TestCgroup, agent_binary, free_port, proxies::Nginx};

fn bpftool(args: &[&str]) -> serde_json::Value {
    let out = Command::new("bpftool")
        .args(args)
        .arg("--json")
        .output()
        .expect("bpftool is installed (./dev setup installs it)");
    assert!(
        out.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("bpftool prints JSON")
}

/// Ids of the loaded programs with our names among `ids`.
fn ours_loaded(ids: &[u64]) -> Vec<u64> {
    bpftool(&["prog", "show"])
        .as_array()
        .unwrap()
        .iter()
        .filter(|prog| PROGRAM_NAMES.contains(&prog["name"].as_str().unwrap_or("")))
        .map(|prog| prog["id"].as_u64().unwrap())
        .filter(|id| ids.contains(id))
        .collect()
}

/// Ids of the programs process `pid` holds a file descriptor of (a program's or a link's),
/// from the kernel's `prog_id` in each descriptor's fdinfo.
fn programs_held_by(pid: u32) -> Vec<u64> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return Vec::new();
    };
    let mut ids: Vec<u64> = fds
        .filter_map(|fd| std::fs::read_to_string(fd.ok()?.path()).ok())
        .flat_map(|info| {
            info.lines()
                .filter_map(|l| l.strip_prefix("prog_id:")?.trim().parse().ok())
                .collect::<Vec<u64>>()
        })
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// Links whose program is one of `programs`.
fn links_of(programs: &[u64]) -> Vec<serde_json::Value> {
    bpftool(&["link", "show"])
        .as_array()
        .unwrap()
        .iter()
        .filter(|link| {
            link["prog_id"]
                .as_u64()
                .is_some_and(|id| programs.contains(&id))
        })
        .cloned()
        .collect()
}

/// A configuration file with `agent_lines` and one service whose backend is `backend`.
fn config_file(agent_lines: &str, backend: &str) -> PathBuf {
    let config =
        std::env::temp_dir().join(format!("retry-after-detach-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        format!(
            "[agent]\ntick_interval_ms = 100\nsocket_path = \"/tmp/retry-after-detach.sock\"\n\
             metrics_listen = \"127.0.0.1:0\"\n{agent_lines}\n\
             [[service]]\nname = \"t\"\nbackends = [{{ address = \"{backend}\" }}]\n"
        ),
    )
    .unwrap();
    config
}

fn start_agent() -> Child {
    run_agent(&config_file("", "127.0.0.1:1"))
}

fn run_agent(config: &Path) -> Child {
    Command::new(agent_binary())
        .args(["run", "--config"])
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the agent")
}

/// The agent's programs and their links, once it has attached every one.
fn attached(agent: &mut Child) -> (Vec<u64>, Vec<serde_json::Value>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let programs = ours_loaded(&programs_held_by(agent.id()));
        let links = links_of(&programs);
        if programs.len() == PROGRAM_NAMES.len() && links.len() == PROGRAM_NAMES.len() {
            return (programs, links);
        }
        if let Some(status) = agent.try_wait().unwrap() {
            panic!("the agent exited before attaching: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not attach within 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Those of `programs` still loaded once the kernel has had up to 5 s to release them: it
/// frees a program after its last reference goes, and a tracing program only after an RCU
/// grace period.
fn programs_once_released(programs: &[u64]) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !ours_loaded(programs).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    ours_loaded(programs)
}

fn stop_and_check(signal: i32) {
    let mut agent = start_agent();
    let (programs, _) = attached(&mut agent);

    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(agent.id() as i32, signal) }, 0);
    let status = agent.wait().unwrap();
    assert!(
        status.success(),
        "the agent should exit cleanly on signal {signal}: {status}"
    );

    assert_eq!(
        programs_once_released(&programs),
        Vec::<u64>::new(),
        "programs still loaded 5 s after exit"
    );
    assert_eq!(
        links_of(&programs),
        Vec::<serde_json::Value>::new(),
        "links left after exit"
    );
}

#[test]
fn nothing_stays_attached_after_sigterm() {
    stop_and_check(libc::SIGTERM);
}

#[test]
fn nothing_stays_attached_after_sigint() {
    stop_and_check(libc::SIGINT);
}

/// The cgroups (by id) the agent's cgroup programs are attached to.
fn link_cgroups(links: &[serde_json::Value]) -> Vec<u64> {
    let mut ids: Vec<u64> = links
        .iter()
        .filter_map(|link| link["cgroup_id"].as_u64())
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// A cgroup's id: its directory's inode.
fn cgroup_id(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().ino()
}

/// `attach_cgroups = "auto"`: `check` names the process that owns the watched listener (nginx,
/// in a cgroup of its own) and its cgroup, and the agent attaches its socket programs there
/// and nowhere else; with nobody listening on the backend yet, it falls back to the root.
#[test]
fn attach_cgroups_auto_attaches_where_the_watched_listener_is_owned() {
    let cgroup = TestCgroup::create("retry-after-test-auto");
    let port = free_port();
    let _nginx = Nginx::start_in(
        &format!("  server {{ listen {port}; location / {{ return 200 \"ok\\n\"; }} }}"),
        Some(cgroup.path()),
    );
    let name = cgroup
        .path()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let config = config_file("attach_cgroups = \"auto\"", &port.to_string());
    let check = Command::new(agent_binary())
        .args(["check", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&check.stdout);
    let line = said
        .lines()
        .find(|l| l.contains("attach cgroups:"))
        .unwrap_or_else(|| panic!("no attach cgroups line in:\n{said}"));
    assert!(
        line.contains(&format!("/{name} (nginx pid"))
            && line.contains(&format!("listens on 127.0.0.1:{}", port.port()))
            && line.contains(&format!("attaches to /{name}")),
        "{line}"
    );
    assert!(check.status.success(), "{said}");

    let mut agent = run_agent(&config);
    let (programs, links) = attached(&mut agent);
    let sockets: Vec<serde_json::Value> = links
        .into_iter()
        .filter(|l| l["cgroup_id"].is_u64())
        .collect();
    assert_eq!(sockets.len(), 3, "sock_ops, ingress, egress: {sockets:?}");
    assert_eq!(link_cgroups(&sockets), vec![cgroup_id(cgroup.path())]);
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) }, 0);
    assert!(agent.wait().unwrap().success());
    assert_eq!(programs_once_released(&programs), Vec::<u64>::new());

    // Nobody listens on this backend: the root, with a warning.
    let config = config_file("attach_cgroups = \"auto\"", "127.0.0.1:1");
    let mut agent = run_agent(&config);
    let (programs, links) = attached(&mut agent);
    let root = find_cgroup2_root().unwrap();
    assert_eq!(link_cgroups(&links), vec![cgroup_id(&root)]);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) }, 0);
    assert!(agent.wait().unwrap().success());
    assert_eq!(programs_once_released(&programs), Vec::<u64>::new());
}
