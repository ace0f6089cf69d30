//! A command run inside a virtual machine booting one of the pinned Debian kernels
//! ([`crate::kernels::KERNELS`]), for the kernel matrix.
//!
//! QEMU (emulated CPU, TCG) boots the kernel unpacked by `./dev setup` under
//! `.tools/kernels/<version>/` with an initramfs made here: a static busybox, the kernel's own
//! virtio, 9p and overlay modules, and an init that mounts this machine's root filesystem
//! read-only over 9p with a tmpfs overlay on top (so the guest can write, and nothing it
//! writes reaches the host), mounts proc, sys, devtmpfs, cgroup2, bpffs, tracefs and debugfs
//! and a tmpfs on `/run`, brings up `lo` (the guest has no other network), then runs the
//! command in the host's working directory. A second, writable 9p share (a temporary
//! directory of the host's) carries the command in and its output and exit status out.
//!
//! The guest's `/run` is its own (empty tmpfs); everything else, `/tmp` included (a clone of
//! the project may live there), is the host's as it was at boot, writable through the
//! overlay.

use std::{
    collections::HashMap,
    fmt,
    fs::{self, File},
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

pub use crate::kernels::{KERNELS, Kernel};

/// The QEMU binary the machines run on.
const QEMU: &str = "qemu-system-x86_64";
/// The static busybox the initramfs is built around (Debian's busybox-static).
const BUSYBOX: &str = "/bin/busybox";
/// The modules the init loads (with what they depend on, first): PCI virtio, the 9p
/// filesystem over virtio, overlayfs, the virtio entropy source (so early `getrandom` does
/// not wait on an old kernel), and TCP's sock_diag (the agent reads listeners' backlogs over
/// it; a node loads it on demand, the guest has no modules directory to load it from).
const MODULES: [&str; 6] = [
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "overlay",
    "virtio_rng",
    "tcp_diag",
];
/// Environment variables of the host handed on to the guest's command.
const FORWARDED_ENV: [&str; 6] = [
    "RUST_LOG",
    "RUST_BACKTRACE",
    "LANG",
    "USER",
    "CARGO_MANIFEST_DIR",
    "CARGO_TARGET_DIR",
];
/// The directories the guest's PATH has besides the host's own.
const SYSTEM_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The first stage of the guest's init: from the initramfs to the overlay root.
const STAGE1: &str = r#"#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /lower /upper /newroot
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() {
    echo "vm-init: $*" > /dev/console
    poweroff -f
}
while read -r module; do
    insmod "/modules/$module" || fail "insmod $module"
done < /modules/order
mount -t 9p -o ro,trans=virtio,version=9p2000.L,msize=262144,cache=loose hostroot /lower \
    || fail "cannot mount the host's root"
mount -t tmpfs -o mode=0755 upper /upper
mkdir -p /upper/data /upper/work
mount -t overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work overlay /newroot \
    || fail "cannot mount the overlay"
mount -t tmpfs -o mode=0755 run /newroot/run || fail "cannot mount /run"
mkdir -p /newroot/run/vm /newroot/run/vm-init
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 vmrun /newroot/run/vm \
    || fail "cannot mount the run share"
cp /bin/busybox /stage2 /newroot/run/vm-init/
mount --move /dev /newroot/dev
umount /proc /sys
exec switch_root /newroot /run/vm-init/busybox sh /run/vm-init/stage2
"#;

/// The second stage: the guest's own filesystems, `lo`, the command, its status, power off.
const STAGE2: &str = r#"B=/run/vm-init/busybox
$B mount -t proc proc /proc
$B mount -t sysfs sysfs /sys
$B mount -t cgroup2 cgroup2 /sys/fs/cgroup
$B mount -t bpf bpf /sys/fs/bpf
$B mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
$B mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
$B mkdir -p /dev/pts /dev/shm
$B mount -t devpts devpts /dev/pts
$B mount -t tmpfs -o mode=1777 shm /dev/shm
$B ip link set lo up
$B hostname kernel-matrix
$B sh /run/vm/command > /run/vm/output 2>&1 < /dev/null
code=$?
echo "$code" > /run/vm/exit_code.new
$B mv /run/vm/exit_code.new /run/vm/exit_code
$B sync
echo "vm-init: the command exited with $code" > /dev/console
$B poweroff -f
"#;

/// What went wrong running a command in a virtual machine.
#[derive(Debug)]
pub enum VmError {
    /// Something the machine needs is not installed (`./dev setup` installs it).
    Missing(String),
    /// Building the initramfs or the run directory failed.
    Io(String, std::io::Error),
    /// QEMU could not start.
    Qemu(std::io::Error),
    /// The machine did not finish within the time allowed; its console so far.
    TimedOut {
        /// How long it was given.
        timeout: Duration,
        /// The command's output so far.
        output: String,
        /// The serial console so far.
        console: String,
    },
    /// The machine stopped without the command's exit status (it did not boot, or the init
    /// failed); its console.
    NoExitStatus {
        /// The command's output, if it started.
        output: String,
        /// The serial console.
        console: String,
        /// What QEMU itself printed.
        qemu: String,
    },
}

impl fmt::Display for VmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing(what) => write!(f, "{what} is missing: run `./dev setup` (as root)"),
            Self::Io(what, error) => write!(f, "{what}: {error}"),
            Self::Qemu(error) => write!(f, "cannot start {QEMU} (run `./dev setup`): {error}"),
            Self::TimedOut {
                timeout,
                output,
                console,
            } => write!(
                f,
                "the virtual machine did not finish within {timeout:?}\n--- output ---\n\
                 {output}\n--- console ---\n{console}"
            ),
            Self::NoExitStatus {
                output,
                console,
                qemu,
            } => write!(
                f,
                "the virtual machine stopped without the command's exit status\n--- output \
                 ---\n{output}\n--- console ---\n{console}\n--- qemu ---\n{qemu}"
            ),
        }
    }
}

impl std::error::Error for VmError {}

fn io_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
    let what = what.into();
    move |error| VmError::Io(what, error)
}

/// A command's run inside a virtual machine.
#[derive(Clone, Debug)]
pub struct GuestRun {
    /// What the command wrote to its standard output and error (together, in order).
    pub output: String,
    /// Its exit status (128 + the signal's number if a signal ended it).
    pub exit_code: i32,
    /// The serial console: the kernel's messages and the init's.
    pub console: String,
    /// From QEMU's start to the command's start.
    pub boot: Duration,
    /// From QEMU's start until it exited.
    pub wall: Duration,
}

/// How a command is run in a virtual machine; [`run`] takes the defaults.
#[derive(Clone, Debug)]
pub struct Options {
    /// The machine is stopped after this long.
    pub timeout: Duration,
    /// Copy the command's output to this process's standard output as it comes.
    pub echo: bool,
    /// More environment variables for the command.
    pub env: Vec<(String, String)>,
    /// The directory the command runs in (this process's working directory if `None`).
    pub dir: Option<PathBuf>,
    /// Memory of the machine, in MiB.
    pub memory_mib: u32,
    /// Virtual CPUs.
    pub cpus: u32,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(600),
            echo: false,
            env: Vec::new(),
            dir: None,
            memory_mib: 4096,
            cpus: 2,
        }
    }
}

/// The workspace's root (where `.tools/` is).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The kernel called `name` (`5.10`, `6.1`, `6.12`), or one whose release or version is
/// `name`.
pub fn kernel(name: &str) -> Option<&'static Kernel> {
    KERNELS
        .iter()
        .find(|k| k.name == name || k.release == name || k.version == name)
}

/// Where `./dev setup` unpacks `kernel`.
pub fn kernel_dir(kernel: &Kernel) -> PathBuf {
    workspace_root().join(".tools/kernels").join(kernel.version)
}

/// The kernel's image.
pub fn vmlinuz(kernel: &Kernel) -> PathBuf {
    kernel_dir(kernel).join(format!("boot/vmlinuz-{}", kernel.release))
}

/// The kernel's modules directory (under `lib/` up to bookworm, `usr/lib/` since trixie).
fn modules_dir(kernel: &Kernel) -> Result<PathBuf, VmError> {
    let dir = kernel_dir(kernel);
    ["lib/modules", "usr/lib/modules"]
        .map(|d| dir.join(d).join(kernel.release))
        .into_iter()
        .find(|d| d.join("kernel").is_dir())
        .ok_or_else(|| {
            VmError::Missing(format!(
                "the modules of kernel {} (under {})",
                kernel.name,
                dir.display()
            ))
        })
}

/// Run `command` (a program and its arguments) inside a machine booting `kernel`, in this
/// process's working directory; give up after `timeout`.
pub fn run(kernel: &Kernel, command: &[&str], timeout: Duration) -> Result<GuestRun, VmError> {
    run_with(
        kernel,
        command,
        &Options {
            timeout,
            ..Options::default()
        },
    )
}

/// [`run`] with `options`.
pub fn run_with(kernel: &Kernel, command: &[&str], options: &Options) -> Result<GuestRun, VmError> {
    let image = vmlinuz(kernel);
    if !image.exists() {
        return Err(VmError::Missing(format!(
            "kernel {} ({})",
            kernel.name,
            image.display()
        )));
    }
    let initramfs = initramfs(kernel)?;
    let share = RunShare::create()?;
    let dir = match &options.dir {
        Some(dir) => dir.clone(),
        None => std::env::current_dir().map_err(io_error("the working directory"))?,
    };
    share.write_command(&dir, command, &options.env)?;
    let start = Instant::now();
    let child = qemu(&image, &initramfs, &share, options)?;
    watch(child, &share, options, start)
}

/// Start QEMU on `image` and `initramfs` with the host's root and `share` as 9p shares.
fn qemu(
    image: &Path,
    initramfs: &Path,
    share: &RunShare,
    options: &Options,
) -> Result<Child, VmError> {
    let qemu_log = File::create(share.path("qemu.log")).map_err(io_error("qemu.log"))?;
    Command::new(QEMU)
        .args([
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            "max",
            "-machine",
            "q35",
        ])
        .args(["-smp", &options.cpus.to_string()])
        .args(["-m", &format!("{}M", options.memory_mib)])
        .args(["-display", "none", "-monitor", "none", "-nic", "none"])
        .args(["-no-reboot", "-device", "virtio-rng-pci"])
        .arg("-serial")
        .arg(format!("file:{}", share.path("console.log").display()))
        .arg("-virtfs")
        .arg("local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap")
        .arg("-virtfs")
        .arg(format!(
            "local,path={},mount_tag=vmrun,security_model=none,multidevs=remap",
            share.dir.display()
        ))
        .arg("-kernel")
        .arg(image)
        .arg("-initrd")
        .arg(initramfs)
        .args([
            "-append",
            "console=ttyS0 panic=-1 random.trust_cpu=on loglevel=4 rdinit=/init",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(qemu_log)
        .spawn()
        .map_err(|error| {
            if error.kind() == std::io::ErrorKind::NotFound {
                VmError::Missing(QEMU.to_owned())
            } else {
                VmError::Qemu(error)
            }
        })
}

/// Follow the machine until it exits or `options.timeout` passes; its run.
fn watch(
    mut child: Child,
    share: &RunShare,
    options: &Options,
    start: Instant,
) -> Result<GuestRun, VmError> {
    let mut output = Tail::new(share.path("output"), options.echo);
    let mut boot = None;
    loop {
        output.poll();
        if boot.is_none() && output.started() {
            boot = Some(start.elapsed());
        }
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if start.elapsed() > options.timeout {
            let _ = child.kill();
            let _ = child.wait();
            output.poll();
            return Err(VmError::TimedOut {
                timeout: options.timeout,
                output: output.text(),
                console: share.read("console.log"),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let wall = start.elapsed();
    output.poll();
    let exit_code = share.read("exit_code").trim().parse::<i32>().ok();
    match exit_code {
        Some(exit_code) => Ok(GuestRun {
            output: output.text(),
            exit_code,
            console: share.read("console.log"),
            boot: boot.unwrap_or(wall),
            wall,
        }),
        None => Err(VmError::NoExitStatus {
            output: output.text(),
            console: share.read("console.log"),
            qemu: share.read("qemu.log"),
        }),
    }
}

/// A file the guest writes, read as it grows.
struct Tail {
    path: PathBuf,
    file: Option<File>,
    bytes: Vec<u8>,
    echo: bool,
}

impl Tail {
    fn new(path: PathBuf, echo: bool) -> Self {
        Self {
            path,
            file: None,
            bytes: Vec::new(),
            echo,
        }
    }

    /// True once the file exists (the guest has started the command).
    fn started(&self) -> bool {
        self.file.is_some()
    }

    /// Read what was added since the last call.
    fn poll(&mut self) {
        if self.file.is_none() {
            self.file = File::open(&self.path).ok();
        }
        let Some(file) = &mut self.file else { return };
        let mut new = Vec::new();
        let _ = file.seek(SeekFrom::Start(self.bytes.len() as u64));
        let _ = file.read_to_end(&mut new);
        if self.echo && !new.is_empty() {
            let mut stdout = std::io::stdout().lock();
            let _ = stdout.write_all(&new);
            let _ = stdout.flush();
        }
        self.bytes.extend_from_slice(&new);
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }
}

/// The host's directory shared writable with the guest: the command in, its output and exit
/// status and the console out. Removed when dropped.
struct RunShare {
    dir: PathBuf,
}

impl RunShare {
    fn create() -> Result<Self, VmError> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "retry-after-vm-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).map_err(io_error(format!("create {}", dir.display())))?;
        Ok(Self { dir })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn read(&self, name: &str) -> String {
        fs::read(self.path(name))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// The script the guest runs: into `dir`, the environment, then `command`.
    fn write_command(
        &self,
        dir: &Path,
        command: &[&str],
        env: &[(String, String)],
    ) -> Result<(), VmError> {
        let dir = quote(&dir.to_string_lossy());
        let mut script = format!(
            "cd {dir} || {{ echo guest: cannot enter {dir}, the guest has its own /run >&2; \
             exit 125; }}\n"
        );
        for (name, value) in guest_env(env) {
            script.push_str(&format!("export {name}={}\n", quote(&value)));
        }
        let words: Vec<String> = command.iter().map(|w| quote(w)).collect();
        script.push_str(&format!("exec {}\n", words.join(" ")));
        fs::write(self.path("command"), script).map_err(io_error("write the command"))
    }
}

impl Drop for RunShare {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The command's environment: PATH (the host's, then the system's directories), HOME, TERM,
/// a few of the host's variables ([`FORWARDED_ENV`]), then `extra`.
fn guest_env(extra: &[(String, String)]) -> Vec<(String, String)> {
    let host_path = std::env::var("PATH").unwrap_or_default();
    let mut env = vec![
        ("PATH".to_owned(), format!("{host_path}:{SYSTEM_PATH}")),
        ("HOME".to_owned(), "/root".to_owned()),
        ("TERM".to_owned(), "dumb".to_owned()),
    ];
    for name in FORWARDED_ENV {
        if let Ok(value) = std::env::var(name) {
            env.push((name.to_owned(), value));
        }
    }
    env.extend(extra.iter().cloned());
    env
}

/// `word` quoted for a POSIX shell.
fn quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// The initramfs for `kernel`, built once and kept under `.tools/vm/`.
pub fn initramfs(kernel: &Kernel) -> Result<PathBuf, VmError> {
    let modules = modules_dir(kernel)?;
    let busybox = fs::read(BUSYBOX)
        .map_err(|_| VmError::Missing(format!("{BUSYBOX} (Debian's busybox-static)")))?;
    let wanted = MODULES.join(",");
    let key = cache_key(&[
        STAGE1.as_bytes(),
        STAGE2.as_bytes(),
        wanted.as_bytes(),
        kernel.version.as_bytes(),
        &busybox,
    ]);
    let cache = workspace_root().join(".tools/vm");
    let path = cache.join(format!("initramfs-{}-{key:016x}.cpio", kernel.release));
    if path.exists() {
        return Ok(path);
    }
    fs::create_dir_all(&cache).map_err(io_error(format!("create {}", cache.display())))?;
    let archive = build_initramfs(&busybox, &module_order(&modules)?);
    let partial = path.with_extension(format!("partial-{}", std::process::id()));
    fs::write(&partial, archive).map_err(io_error(format!("write {}", partial.display())))?;
    fs::rename(&partial, &path).map_err(io_error(format!("write {}", path.display())))?;
    Ok(path)
}

/// A hash of what the initramfs is made of (the same for the same inputs in one toolchain).
fn cache_key(parts: &[&[u8]]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for part in parts {
        part.hash(&mut hasher);
    }
    hasher.finish()
}

/// The archive: directories, `/dev/console`, busybox, the two init stages, the modules (in
/// `/modules/`, uncompressed) and their loading order (`/modules/order`).
fn build_initramfs(busybox: &[u8], modules: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut cpio = Cpio::default();
    for dir in ["bin", "dev", "proc", "sys", "modules"] {
        cpio.dir(dir);
    }
    cpio.char_device("dev/console", 5, 1);
    cpio.file("bin/busybox", 0o755, busybox);
    cpio.file("init", 0o755, STAGE1.as_bytes());
    cpio.file("stage2", 0o644, STAGE2.as_bytes());
    let mut names = Vec::new();
    for (name, bytes) in modules {
        cpio.file(&format!("modules/{name}"), 0o644, bytes);
        names.push(name.as_str());
    }
    cpio.file(
        "modules/order",
        0o644,
        format!("{}\n", names.join("\n")).as_bytes(),
    );
    cpio.finish()
}

/// A module's file name (without a compression suffix) and its contents, decompressed.
fn read_module(path: &Path) -> Result<(String, Vec<u8>), VmError> {
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if let Some(name) = file_name.strip_suffix(".xz") {
        let out = Command::new("xz")
            .arg("-dc")
            .arg(path)
            .output()
            .map_err(|_| VmError::Missing("xz (xz-utils)".to_owned()))?;
        if !out.status.success() {
            return Err(VmError::Io(
                format!("xz -dc {}", path.display()),
                std::io::Error::other(String::from_utf8_lossy(&out.stderr).into_owned()),
            ));
        }
        return Ok((name.to_owned(), out.stdout));
    }
    let bytes = fs::read(path).map_err(io_error(format!("read {}", path.display())))?;
    Ok((file_name, bytes))
}

/// The modules to load for [`MODULES`], each after those it depends on (as its `.modinfo`
/// says): their names and contents, decompressed. Built-in ones are left out.
fn module_order(modules: &Path) -> Result<Vec<(String, Vec<u8>)>, VmError> {
    let builtin = fs::read_to_string(modules.join("modules.builtin")).unwrap_or_default();
    let builtin: Vec<String> = builtin.lines().map(module_name).collect();
    let mut files = HashMap::new();
    index_modules(&modules.join("kernel"), &mut files)?;
    let mut order = Vec::new();
    for wanted in MODULES {
        add_with_deps(&module_name(wanted), &files, &builtin, &mut order)?;
    }
    Ok(order)
}

/// Every module file under `dir`, by module name.
fn index_modules(dir: &Path, files: &mut HashMap<String, PathBuf>) -> Result<(), VmError> {
    let entries = fs::read_dir(dir).map_err(io_error(format!("read {}", dir.display())))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            index_modules(&path, files)?;
        } else if path.to_string_lossy().contains(".ko") {
            files.insert(module_name(&path.to_string_lossy()), path);
        }
    }
    Ok(())
}

/// Add module `name` to `order` after what it depends on (depth first; each once).
fn add_with_deps(
    name: &str,
    files: &HashMap<String, PathBuf>,
    builtin: &[String],
    order: &mut Vec<(String, Vec<u8>)>,
) -> Result<(), VmError> {
    let file_name = |(n, _): &(String, Vec<u8>)| module_name(n) == name;
    if order.iter().any(file_name) || builtin.iter().any(|b| b == name) {
        return Ok(());
    }
    let path = files
        .get(name)
        .ok_or_else(|| VmError::Missing(format!("kernel module {name}")))?;
    let (file, bytes) = read_module(path)?;
    for need in depends(&bytes) {
        add_with_deps(&module_name(&need), files, builtin, order)?;
    }
    order.push((file, bytes));
    Ok(())
}

/// The modules a module depends on: the `depends=` entry of its `.modinfo`.
fn depends(module: &[u8]) -> Vec<String> {
    const KEY: &[u8] = b"\0depends=";
    let Some(at) = module.windows(KEY.len()).position(|w| w == KEY) else {
        return Vec::new();
    };
    let value = &module[at + KEY.len()..];
    let end = value.iter().position(|b| *b == 0).unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end])
        .split(',')
        .filter(|d| !d.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A module's name from its path: the file name without `.ko` (and a compression suffix),
/// dashes as underscores.
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.replace('-', "_")
}

/// A `newc` cpio archive, as the kernel unpacks an initramfs.
#[derive(Default)]
struct Cpio {
    bytes: Vec<u8>,
    inode: u32,
}

impl Cpio {
    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, 0, &[]);
    }

    fn file(&mut self, name: &str, permissions: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | permissions, 0, data);
    }

    fn char_device(&mut self, name: &str, major: u32, minor: u32) {
        self.entry(name, 0o020_600, (major << 8) | minor, &[]);
    }

    /// One entry; `rdev` packs the device's major and minor number (major << 8 | minor).
    fn entry(&mut self, name: &str, mode: u32, rdev: u32, data: &[u8]) {
        self.inode += 1;
        let fields = [
            self.inode,
            mode,
            0,
            0,
            1,
            0,
            data.len() as u32,
            0,
            0,
            rdev >> 8,
            rdev & 0xff,
            name.len() as u32 + 1,
            0,
        ];
        self.bytes.extend_from_slice(b"070701");
        for field in fields {
            self.bytes
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, 0, &[]);
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_names_drop_suffixes_and_dashes() {
        assert_eq!(module_name("kernel/fs/9p/9p.ko.xz"), "9p");
        assert_eq!(
            module_name("kernel/drivers/char/hw_random/virtio-rng.ko"),
            "virtio_rng"
        );
    }

    #[test]
    fn dependencies_are_read_from_modinfo() {
        let module = b"\x7fELF...\0license=GPL\0depends=9pnet,netfs\0intree=Y\0";
        assert_eq!(depends(module), ["9pnet", "netfs"]);
        assert!(depends(b"\0depends=\0").is_empty());
    }

    #[test]
    fn words_are_quoted_for_the_shell() {
        assert_eq!(quote("it's"), r"'it'\''s'");
    }
}
