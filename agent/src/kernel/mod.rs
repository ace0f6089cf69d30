//! All kernel access of the agent: loading and attaching the eBPF programs, editing the watch
//! set, and reading counters and listener backlogs into a [`Snapshot`].
//!
//! Nothing outside this module talks to aya, BPF maps, cgroups or netlink. Dropping the
//! [`Probe`] detaches every program (the attachments are BPF links owned by this process, so
//! they also go away if the process dies).

mod cgroup;
mod features;
mod floor;
mod listeners;
mod owners;
mod streams;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Mutex,
    time::Instant,
};

use aya::{
    Btf, Ebpf, EbpfLoader,
    maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray, PerCpuValues},
    programs::{
        BtfTracePoint, CgroupSkb, CgroupSkbAttachType, ProgramError, SockOps,
        links::CgroupAttachMode,
    },
    util::nr_cpus,
};
use retry_after_common::{
    CounterWriter, ENDPOINT_COUNTERS_MAP, EndpointCounters, EndpointKey, MAX_WATCHED_ENDPOINTS,
    PROBE_STATS_LEN, PROBE_STATS_MAP, ProbeStat, Protocol, SETTINGS_MAP, SLOT_GENERATIONS_MAP,
    Setting, Side, WATCHED_ENDPOINTS_MAP, WATCHED_PORTS_MAP, WatchValue, counter_index,
    h2::{BODIES_MAP, PARK_SCRATCH_MAP, STREAMS_MAP},
};

use retry_after_estimator::{
    endpoint::Endpoint,
    snapshot::{EndpointSnapshot, ProbeStats, Snapshot},
};

pub use cgroup::{CgroupScope, attach_dirs, cgroup_scope, find_cgroup2_root};
pub use features::{FeatureState, KernelFeature, KernelFeatures};
pub use floor::{FLOOR_PROGRAM_NAMES, Floor};
pub use listeners::{ListenerBacklog, listener_backlogs};
pub use owners::{Held, SocketOwner, TcpSocket, owner_cgroups, socket_owners, tcp_sockets};
pub use streams::Http2Options;
use streams::StreamSweeper;

/// The compiled eBPF object, built by agent/build.rs.
static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/retry-after-ebpf"));

/// Names of our programs where the kernel runs them all, as it lists them (`bpftool prog`).
pub const PROGRAM_NAMES: [&str; 4] = ProgramSet::Full.names();

/// Which build of the counting programs the kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgramSet {
    /// Every program: turns, TLS records and HTTP/2 streams.
    Full,
    /// Every program, each segment's HTTP/2 frames walked in steps by a loop of fixed bound and
    /// on by a chain of tail calls (no `bpf_loop`, before 5.17, or the full build refused).
    Http2InSteps,
    /// Without HTTP/2 streams (both builds that count them refused): HTTP/2 connections are
    /// left out.
    WithoutHttp2,
}

impl ProgramSet {
    /// Its programs' names: sock_ops, ingress, egress, the `tcp_destroy_sock` tracepoint.
    pub const fn names(self) -> [&'static str; 4] {
        match self {
            Self::Full => ["ra_sockops", "ra_ingress", "ra_egress", "ra_destroy"],
            Self::Http2InSteps => [
                "ra_sockops_step",
                "ra_ingress_step",
                "ra_egress_step",
                "ra_destroy",
            ],
            Self::WithoutHttp2 => [
                "ra_sockops_noh2",
                "ra_ingress_noh2",
                "ra_egress_noh2",
                "ra_destroy_noh2",
            ],
        }
    }

    /// The programs its segment programs reach by tail calls, each with the table that holds
    /// it: the walk of parked HTTP/2 segments, and in steps, the walk on from a pause.
    const fn tail_calls(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Self::Full => &[("ra_ingress_parked", "H2_PARKED_WALK")],
            Self::Http2InSteps => &[
                ("ra_parked_step", "H2_PARKED_WALK"),
                ("ra_ingress_more", "H2_INGRESS_MORE"),
                ("ra_egress_more", "H2_EGRESS_MORE"),
            ],
            Self::WithoutHttp2 => &[],
        }
    }
}

/// What the agent runs on this kernel, and what it left out for want of a feature.
#[derive(Clone, Debug)]
pub struct KernelSupport {
    /// What the kernel's verifier accepted of the feature probes.
    pub features: KernelFeatures,
    /// Why HTTP/2 streams are not counted, if they are not (the build without HTTP/2 runs).
    pub http2_off: Option<String>,
    /// Why HTTP/2 frames are walked in steps, if they are (the build without `bpf_loop` runs).
    pub http2_in_steps: Option<String>,
    /// Why connections opened before they were watched are not adopted, if they are not.
    pub adoption_off: Option<String>,
}

impl KernelSupport {
    /// The programs loaded: the build without HTTP/2 where HTTP/2 is off.
    pub fn programs(&self) -> ProgramSet {
        if self.http2_off.is_some() {
            ProgramSet::WithoutHttp2
        } else if self.http2_in_steps.is_some() {
            ProgramSet::Http2InSteps
        } else {
            ProgramSet::Full
        }
    }

    /// What is switched off, one line each (empty: nothing).
    pub fn limits(&self) -> Vec<String> {
        let http2 = self.http2_off.as_ref().map(|why| {
            format!(
                "HTTP/2 streams not counted, HTTP/2 connections left out: {why}; HTTP/1.x and TLS are counted"
            )
        });
        let steps = self
            .http2_in_steps
            .as_ref()
            .map(|why| format!("HTTP/2 frames walked in steps: {why}"));
        let adoption = self.adoption_off.as_ref().map(|why| {
            format!(
                "connections opened before the agent started are not adopted: {why}; connections established while it runs are counted"
            )
        });
        http2.into_iter().chain(steps).chain(adoption).collect()
    }
}

/// How the probe is loaded.
#[derive(Clone, Debug, Default)]
pub struct ProbeOptions {
    /// The root of the cgroup v2 hierarchy; `None` finds it from the mount table.
    pub cgroup: Option<PathBuf>,
    /// The cgroups whose sockets the programs see, absolute or relative to the root (see
    /// [`attach_dirs`]); none: the root itself, every socket of the node.
    pub attach_to: Vec<PathBuf>,
    /// Let the programs' debug-level log lines through to the agent's log.
    pub debug_log: bool,
    /// Features to run without even where the kernel has them, switching off what needs them
    /// as a kernel without them would (tests of older kernels' behaviour on this one).
    pub without: Vec<KernelFeature>,
    /// The HTTP/2 stream table's size and timeout.
    pub http2: Http2Options,
}

/// What went wrong in the kernel part of the agent.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// No cgroup v2 hierarchy is mounted (the programs attach to one).
    #[error(
        "no cgroup v2 hierarchy is mounted; mount one (mount -t cgroup2 none /sys/fs/cgroup/unified) or pass its path"
    )]
    NoCgroup2,
    /// The cgroups to attach to cannot be used (missing, outside the hierarchy, nested).
    #[error("cannot attach to the cgroups given")]
    AttachCgroups(#[source] std::io::Error),
    /// The cgroup directory could not be opened.
    #[error("cannot open cgroup {path}")]
    OpenCgroup {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The eBPF object could not be loaded (map creation, relocation).
    #[error("cannot load the eBPF object (is the agent running as root, with CAP_BPF?)")]
    Load(#[source] aya::EbpfError),
    /// The kernel's BTF (/sys/kernel/btf/vmlinux) cannot be read.
    #[error(
        "cannot read the kernel's BTF (/sys/kernel/btf/vmlinux): a kernel built with CONFIG_DEBUG_INFO_BTF is needed"
    )]
    Btf(#[source] aya::BtfError),
    /// A program the object should contain is missing or of the wrong type.
    #[error("eBPF program {name} is missing from the object or has the wrong type")]
    MissingProgram {
        /// Program name.
        name: &'static str,
    },
    /// The kernel refused a program (the verifier log is in the source).
    #[error("the kernel refused eBPF program {name}")]
    Verify {
        /// Program name.
        name: &'static str,
        /// The loader's error, with the verifier log.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// A program could not be attached to the cgroup.
    #[error(
        "cannot attach {name} to cgroup {cgroup}: is another retry-after-agent (or another single-attach program) already attached there?"
    )]
    Attach {
        /// Program name.
        name: &'static str,
        /// The cgroup directory.
        cgroup: PathBuf,
        /// The loader's error.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// A map the object should contain is missing or of the wrong type.
    #[error("eBPF map {name} is missing or has the wrong type")]
    MissingMap {
        /// Map name.
        name: &'static str,
        /// The loader's error.
        #[source]
        source: aya::maps::MapError,
    },
    /// Reading or writing a map failed.
    #[error("{operation} on eBPF map {name} failed")]
    Map {
        /// What was being done.
        operation: &'static str,
        /// Map name.
        name: &'static str,
        /// The kernel's error.
        #[source]
        source: aya::maps::MapError,
    },
    /// The watch map is full.
    #[error("cannot watch {endpoint}: {limit} endpoints are already watched")]
    TooManyEndpoints {
        /// The endpoint refused.
        endpoint: Endpoint,
        /// The limit.
        limit: u32,
    },
    /// Both builds of the counting programs were refused (the verifier logs are in the source).
    #[error("the kernel refused eBPF program {name}, also without HTTP/2 ({full})")]
    VerifyBoth {
        /// The program of the build without HTTP/2.
        name: &'static str,
        /// Why the full build was refused, in one line.
        full: Box<str>,
        /// The loader's error, with the verifier log.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// The number of possible CPUs (the size of per-CPU values) could not be read.
    #[error("cannot read the number of possible CPUs")]
    Cpus(#[source] std::io::Error),
}

/// Execution statistics of one program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgramRunStats {
    /// Program name.
    pub name: String,
    /// Runs since statistics were enabled.
    pub run_count: u64,
    /// Total time spent in those runs.
    pub run_time: std::time::Duration,
}

/// How one endpoint is watched ([`Probe::watch_with`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WatchOptions {
    /// Only connections opened by sockets of this cgroup (and its descendants) count on the
    /// client side; `None`: every socket's.
    pub client_scope: Option<CgroupScope>,
    /// What the endpoint's connections speak (turns or HTTP/2 streams).
    pub protocol: Protocol,
}

/// The loaded, attached eBPF programs and their maps.
pub struct Probe {
    ebpf: Ebpf,
    /// The root of the cgroup v2 hierarchy.
    cgroup: PathBuf,
    /// The cgroups the programs are attached to.
    attached: Vec<PathBuf>,
    /// Each watched endpoint's slot and generation.
    watched: BTreeMap<Endpoint, WatchValue>,
    /// Slots not in use, lowest last.
    free_slots: Vec<u32>,
    next_generation: u32,
    cpus: usize,
    support: KernelSupport,
    /// The HTTP/2 streams the programs leave in their table, abandoned each read.
    sweeper: Mutex<StreamSweeper>,
}

impl Probe {
    /// Load the programs and attach them to the cgroup v2 root (or the cgroups of
    /// `options.attach_to`).
    ///
    /// # Errors
    /// Any [`ProbeError`] but `Map` and `TooManyEndpoints`.
    pub fn attach(options: &ProbeOptions) -> Result<Self, ProbeError> {
        let cgroup = match &options.cgroup {
            Some(path) => path.clone(),
            None => find_cgroup2_root().ok_or(ProbeError::NoCgroup2)?,
        };
        let attached =
            attach_dirs(&cgroup, &options.attach_to).map_err(ProbeError::AttachCgroups)?;
        let dirs = open_dirs(&attached)?;
        // aya-log levels: 2 = warn, 4 = debug.
        let log_level: u8 = if options.debug_log { 4 } else { 2 };
        let cpus = nr_cpus()
            .map_err(|(_, source)| ProbeError::Cpus(source))?
            .get();
        let mut loader = EbpfLoader::new();
        loader.override_global("AYA_LOG_LEVEL", &log_level, false);
        loader.map_max_entries(STREAMS_MAP, options.http2.max_streams);
        loader.map_max_entries(BODIES_MAP, options.http2.max_streams);
        // One scratch buffer per possible CPU (the programs index it by CPU).
        loader.map_max_entries(PARK_SCRATCH_MAP, cpus);
        let mut ebpf = loader.load(EBPF_OBJECT).map_err(ProbeError::Load)?;
        let btf = Btf::from_sys_fs().map_err(ProbeError::Btf)?;
        let support = load_programs(&mut ebpf, &btf, &options.without)?;
        attach_socket_programs(&mut ebpf, support.programs(), &dirs)?;
        if support.adoption_off.is_none() {
            attach_destroy_tracepoint(&mut ebpf, support.programs(), &cgroup)?;
        }
        let sweeper = Mutex::new(StreamSweeper::take(
            &mut ebpf,
            options.http2.stream_timeout,
        )?);
        Ok(Self {
            ebpf,
            cgroup,
            attached,
            watched: BTreeMap::new(),
            free_slots: (0..MAX_WATCHED_ENDPOINTS).rev().collect(),
            next_generation: 1,
            cpus: cpus as usize,
            support,
            sweeper,
        })
    }

    /// What runs on this kernel, and what was left out for want of a feature.
    pub fn kernel_support(&self) -> &KernelSupport {
        &self.support
    }

    /// Hand the programs' log records to a forwarder (see `aya_log`); call once, right after
    /// [`Probe::attach`]. Until it is called the records wait in their ring buffer.
    ///
    /// # Errors
    /// The log map is missing from the object.
    pub fn take_logger(
        &mut self,
    ) -> Result<aya_log::EbpfLogger<&'static dyn log::Log>, aya_log::Error> {
        aya_log::EbpfLogger::init(&mut self.ebpf)
    }

    /// The root of the cgroup v2 hierarchy (scopes resolve against it).
    pub fn cgroup(&self) -> &std::path::Path {
        &self.cgroup
    }

    /// The cgroups the programs are attached to: the root, or those the options named.
    pub fn attached_cgroups(&self) -> &[PathBuf] {
        &self.attached
    }

    /// Kernel ids of our loaded programs.
    pub fn program_ids(&self) -> Vec<u32> {
        self.ebpf
            .programs()
            .filter_map(|(_, program)| program.info().ok().map(|info| info.id()))
            .collect()
    }

    /// How often each of our programs ran and for how long in total. The kernel keeps these
    /// only while run-time statistics are enabled (`aya::sys::enable_stats`); otherwise zero.
    pub fn program_run_stats(&self) -> Vec<ProgramRunStats> {
        run_stats(&self.ebpf)
    }

    /// The endpoints being watched.
    pub fn watched(&self) -> impl Iterator<Item = &Endpoint> {
        self.watched.keys()
    }

    /// Start counting connections to `endpoint` established from now on. Watching an endpoint
    /// that is already watched changes nothing.
    ///
    /// # Errors
    /// `TooManyEndpoints` when every slot is taken; `Map` if the kernel refuses the update.
    pub fn watch(&mut self, endpoint: Endpoint) -> Result<(), ProbeError> {
        self.watch_with(endpoint, WatchOptions::default())
    }

    /// [`Probe::watch`], with `options`: the client side limited to one cgroup's sockets, the
    /// protocol the endpoint speaks.
    ///
    /// # Errors
    /// As [`Probe::watch`].
    pub fn watch_with(
        &mut self,
        endpoint: Endpoint,
        options: WatchOptions,
    ) -> Result<(), ProbeError> {
        let WatchOptions {
            client_scope,
            protocol,
        } = options;
        if self.watched.contains_key(&endpoint) {
            return Ok(());
        }
        let Some(slot) = self.free_slots.pop() else {
            return Err(ProbeError::TooManyEndpoints {
                endpoint,
                limit: MAX_WATCHED_ENDPOINTS,
            });
        };
        let generation = self.next_generation;
        self.next_generation = self.next_generation.checked_add(1).expect("2^32 watches");
        let watch = WatchValue {
            slot,
            generation,
            client_cgroup: client_scope.map_or(0, |s| s.id),
            client_cgroup_level: client_scope.map_or(0, |s| s.level),
            protocol: protocol as u32,
        };
        if let Err(error) = self.install(endpoint.key(), watch) {
            self.free_slots.push(slot);
            return Err(error);
        }
        self.watched.insert(endpoint, watch);
        self.update_port_bitmap(endpoint.port())
    }

    /// Zero the slot's counters, make the slot live under its new generation, then publish the
    /// watch (in that order, so no program ever counts into stale counters).
    fn install(&mut self, key: EndpointKey, watch: WatchValue) -> Result<(), ProbeError> {
        let cpus = self.cpus;
        let mut counters: PerCpuArray<&mut MapData, EndpointCounters> =
            self.map_mut(ENDPOINT_COUNTERS_MAP)?;
        for side in Side::ALL {
            for writer in CounterWriter::ALL {
                let zeros = PerCpuValues::try_from(vec![EndpointCounters::default(); cpus])
                    .map_err(ProbeError::Cpus)?;
                counters
                    .set(counter_index(watch.slot, side, writer), zeros, 0)
                    .map_err(|source| map_error("reset counters", ENDPOINT_COUNTERS_MAP, source))?;
            }
        }
        self.map_mut::<Array<_, u32>>(SLOT_GENERATIONS_MAP)?
            .set(watch.slot, &watch.generation, 0)
            .map_err(|source| map_error("set generation", SLOT_GENERATIONS_MAP, source))?;
        self.map_mut::<HashMap<_, EndpointKey, WatchValue>>(WATCHED_ENDPOINTS_MAP)?
            .insert(&key, &watch, 0)
            .map_err(|source| map_error("add watch", WATCHED_ENDPOINTS_MAP, source))
    }

    /// Stop counting `endpoint`: its connections stop counting at once and its counters are
    /// dropped. Unwatching an endpoint that is not watched changes nothing.
    ///
    /// # Errors
    /// `Map` if the kernel refuses the update.
    pub fn unwatch(&mut self, endpoint: &Endpoint) -> Result<(), ProbeError> {
        let Some(watch) = self.watched.remove(endpoint) else {
            return Ok(());
        };
        self.map_mut::<HashMap<_, EndpointKey, WatchValue>>(WATCHED_ENDPOINTS_MAP)?
            .remove(&endpoint.key())
            .map_err(|source| map_error("remove watch", WATCHED_ENDPOINTS_MAP, source))?;
        self.map_mut::<Array<_, u32>>(SLOT_GENERATIONS_MAP)?
            .set(watch.slot, &0, 0)
            .map_err(|source| map_error("clear generation", SLOT_GENERATIONS_MAP, source))?;
        self.free_slots.push(watch.slot);
        self.update_port_bitmap(endpoint.port())
    }

    /// Rewrite the bitmap word holding `port` from the watch set.
    fn update_port_bitmap(&mut self, port: u16) -> Result<(), ProbeError> {
        let index = u32::from(port / 64);
        let word = self
            .watched
            .keys()
            .map(Endpoint::port)
            .filter(|p| u32::from(p / 64) == index)
            .fold(0u64, |word, p| word | 1 << (p % 64));
        self.map_mut::<Array<_, u64>>(WATCHED_PORTS_MAP)?
            .set(index, &word, 0)
            .map_err(|source| map_error("update port bitmap", WATCHED_PORTS_MAP, source))
    }

    /// Read every watched endpoint's counters (both sides) and listener backlogs. Backlogs
    /// that cannot be read (netlink refused, no file descriptor left) are left out and the
    /// error is kept in the snapshot; the counters are always read.
    ///
    /// # Errors
    /// `Map` if a counters entry cannot be read.
    pub fn read(&self) -> Result<Snapshot, ProbeError> {
        let taken_at = Instant::now();
        let (backlogs, backlog_error) = match listener_backlogs() {
            Ok(backlogs) => (Some(backlogs), None),
            Err(error) => (
                None,
                Some(format!(
                    "cannot read listener backlogs over sock_diag netlink: {error}"
                )),
            ),
        };
        let sweeper = self.sweep_streams()?;
        let counters: PerCpuArray<&MapData, EndpointCounters> = self.map(ENDPOINT_COUNTERS_MAP)?;
        let mut endpoints = Vec::with_capacity(self.watched.len() * 2);
        for (endpoint, watch) in &self.watched {
            for side in Side::ALL {
                let mut sum = EndpointCounters::default();
                for writer in CounterWriter::ALL {
                    let per_cpu = counters
                        .get(&counter_index(watch.slot, side, writer), 0)
                        .map_err(|source| {
                            map_error("read counters", ENDPOINT_COUNTERS_MAP, source)
                        })?;
                    sum = per_cpu.iter().fold(sum, |sum, cpu| sum.add(cpu));
                }
                let swept = sweeper.abandoned().of(watch.slot, watch.generation, side);
                let counters = EndpointCounters {
                    requests_abandoned: sum.requests_abandoned.wrapping_add(swept.abandoned),
                    bodies_ended: sum.bodies_ended.wrapping_add(swept.bodies_ended),
                    ..sum
                };
                let accept_backlog = match (side, &backlogs) {
                    (Side::Server, Some(backlogs)) => Some(
                        backlogs
                            .iter()
                            .filter(|listener| listener.serves(endpoint))
                            .map(|listener| listener.queued)
                            .sum(),
                    ),
                    _ => None,
                };
                endpoints.push(EndpointSnapshot {
                    endpoint: *endpoint,
                    side,
                    counters,
                    accept_backlog,
                });
            }
        }
        let expired = sweeper.abandoned().expired;
        drop(sweeper);
        Ok(Snapshot {
            taken_at,
            endpoints,
            probe: self.probe_stats(expired)?,
            backlog_error,
        })
    }

    /// Abandon the HTTP/2 streams the programs leave behind (see [`StreamSweeper`]); the
    /// sweeper, holding what it abandoned so far.
    fn sweep_streams(&self) -> Result<std::sync::MutexGuard<'_, StreamSweeper>, ProbeError> {
        let mut sweeper = self
            .sweeper
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let live = |slot: u32, generation: u32| {
            self.watched
                .values()
                .any(|w| w.slot == slot && w.generation == generation)
        };
        sweeper.sweep(monotonic_ns(), live)?;
        Ok(sweeper)
    }

    fn probe_stats(&self, expired: u64) -> Result<ProbeStats, ProbeError> {
        let stats: PerCpuArray<&MapData, u64> = self.map(PROBE_STATS_MAP)?;
        let read = |stat: ProbeStat| -> Result<u64, ProbeError> {
            let values = stats
                .get(&(stat as u32), 0)
                .map_err(|source| map_error("read", PROBE_STATS_MAP, source))?;
            Ok(values.iter().sum())
        };
        let mut counts = [0; PROBE_STATS_LEN as usize];
        for (count, stat) in counts.iter_mut().zip(ProbeStat::ALL) {
            *count = read(*stat)?;
        }
        counts[ProbeStat::Http2StreamsExpired as usize] += expired;
        Ok(ProbeStats::new(counts))
    }

    /// Our map `name`, as the typed map `T`.
    fn map<'a, T>(&'a self, name: &'static str) -> Result<T, ProbeError>
    where
        T: TryFrom<&'a Map, Error = MapError>,
    {
        let map = self.ebpf.map(name).ok_or_else(|| missing_map(name))?;
        T::try_from(map).map_err(|source| ProbeError::MissingMap { name, source })
    }

    /// Our map `name`, as the typed map `T`, for writing.
    fn map_mut<'a, T>(&'a mut self, name: &'static str) -> Result<T, ProbeError>
    where
        T: TryFrom<&'a mut Map, Error = MapError>,
    {
        typed_map_mut(&mut self.ebpf, name)
    }
}

/// The monotonic clock in nanoseconds, as the programs read it (`bpf_ktime_get_ns`).
fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut now) };
    (now.tv_sec as u64).saturating_mul(1_000_000_000) + now.tv_nsec as u64
}

/// Open each cgroup directory the programs attach to.
fn open_dirs(paths: &[PathBuf]) -> Result<Vec<(&PathBuf, std::fs::File)>, ProbeError> {
    paths
        .iter()
        .map(|path| {
            std::fs::File::open(path)
                .map(|dir| (path, dir))
                .map_err(|source| ProbeError::OpenCgroup {
                    path: path.clone(),
                    source,
                })
        })
        .collect()
}

/// How often each loaded program of `ebpf` ran, and for how long in total.
fn run_stats(ebpf: &Ebpf) -> Vec<ProgramRunStats> {
    ebpf.programs()
        .filter_map(|(name, program)| {
            let info = program.info().ok()?;
            Some(ProgramRunStats {
                name: name.to_owned(),
                run_count: info.run_count(),
                run_time: info.run_time(),
            })
        })
        .collect()
}

/// The error of attaching program `name` at `path`.
fn attach_error(name: &'static str, path: &Path) -> impl FnOnce(ProgramError) -> ProbeError {
    let cgroup = path.to_path_buf();
    move |source| ProbeError::Attach {
        name,
        cgroup,
        source,
    }
}

/// Probe the kernel's features, then load the programs it can run: the full build, or the
/// build without HTTP/2 if a feature it needs is missing or the kernel refuses it; the
/// `tcp_destroy_sock` program if the kernel can run it, else adoption is switched off (in
/// `SETTINGS`, before anything is attached). Only a refusal of the build without HTTP/2 fails.
/// The features in `without` count as missing.
fn load_programs(
    ebpf: &mut Ebpf,
    btf: &Btf,
    without: &[KernelFeature],
) -> Result<KernelSupport, ProbeError> {
    let mut features = KernelFeatures::probe(ebpf, btf);
    for feature in without {
        features.switch_off(*feature);
    }
    let (http2_in_steps, http2_off) = load_counting_programs(ebpf, &features)?;
    let mut support = KernelSupport {
        features,
        http2_off,
        http2_in_steps,
        adoption_off: None,
    };
    support.adoption_off = load_adoption(ebpf, &support.features, support.programs(), btf)?;
    Ok(support)
}

/// Load the socket programs of the fullest build `features` allow and the kernel accepts:
/// the full build, else the one that walks HTTP/2 frames in steps, else the one without
/// HTTP/2. Returns why HTTP/2 frames are walked in steps, and why HTTP/2 is off, if they are.
fn load_counting_programs(
    ebpf: &mut Ebpf,
    features: &KernelFeatures,
) -> Result<(Option<String>, Option<String>), ProbeError> {
    let lacking = missing(features, KernelFeature::BpfLoop);
    let in_steps = match lacking {
        Some(why) => why,
        None => match load_socket_programs(ebpf, ProgramSet::Full) {
            Ok(()) => return Ok((None, None)),
            Err(refused) => {
                unload_socket_programs(ebpf, ProgramSet::Full);
                format!(
                    "the kernel refused the full build: {}",
                    refused_reason(&refused)
                )
            }
        },
    };
    let Err(refused) = load_socket_programs(ebpf, ProgramSet::Http2InSteps) else {
        return Ok((Some(in_steps), None));
    };
    let steps = format!(
        "{in_steps}; and the build in steps: {}",
        refused_reason(&refused)
    );
    unload_socket_programs(ebpf, ProgramSet::Http2InSteps);
    load_socket_programs(ebpf, ProgramSet::WithoutHttp2).map_err(|error| match error {
        ProbeError::Verify { name, source } => ProbeError::VerifyBoth {
            name,
            full: steps.as_str().into(),
            source,
        },
        other => other,
    })?;
    Ok((
        None,
        Some(format!("the kernel refused the HTTP/2 builds: {steps}")),
    ))
}

/// Load the `tcp_destroy_sock` program of `programs` where the kernel can run it; else switch
/// adoption off, and say why.
fn load_adoption(
    ebpf: &mut Ebpf,
    features: &KernelFeatures,
    programs: ProgramSet,
    btf: &Btf,
) -> Result<Option<String>, ProbeError> {
    let adoption_off = match missing(features, KernelFeature::TracingSocketStorage) {
        Some(why) => Some(why),
        None => load_destroy_tracepoint(ebpf, programs, btf)
            .err()
            .map(|refused| format!("the kernel refused it: {}", refused_reason(&refused))),
    };
    if adoption_off.is_some() {
        switch_off(ebpf, Setting::AdoptionOff)?;
    }
    Ok(adoption_off)
}

/// "`feature` missing (since VERSION): why" if the kernel lacks `feature`.
fn missing(features: &KernelFeatures, feature: KernelFeature) -> Option<String> {
    match features.state(feature) {
        FeatureState::Present => None,
        FeatureState::Missing(why) => Some(format!(
            "{} missing (since {}): {why}",
            feature.name(),
            feature.since()
        )),
    }
}

/// The verifier's reason in a refusal, in one line.
fn refused_reason(error: &ProbeError) -> String {
    match error {
        ProbeError::Verify { name, source } => format!("{name}: {}", features::refusal(source)),
        other => other.to_string(),
    }
}

/// Set `setting` to 1 in the programs' settings.
fn switch_off(ebpf: &mut Ebpf, setting: Setting) -> Result<(), ProbeError> {
    typed_map_mut::<Array<_, u32>>(ebpf, SETTINGS_MAP)?
        .set(setting as u32, &1, 0)
        .map_err(|source| map_error("switch off", SETTINGS_MAP, source))
}

/// Load the socket programs of `set` (sock_ops, and the segment programs both ways).
fn load_socket_programs(ebpf: &mut Ebpf, set: ProgramSet) -> Result<(), ProbeError> {
    let [sockops, ingress, egress, _] = set.names();
    let program: &mut SockOps = program_mut(ebpf, sockops)?;
    program.load().map_err(|source| ProbeError::Verify {
        name: sockops,
        source,
    })?;
    for name in [ingress, egress] {
        let program: &mut CgroupSkb = program_mut(ebpf, name)?;
        program
            .load()
            .map_err(|source| ProbeError::Verify { name, source })?;
    }
    for &(name, table) in set.tail_calls() {
        load_tail_call(ebpf, name, table)?;
    }
    Ok(())
}

/// Load the program `name`, reached by tail calls, and put it in the table `table` (index 0)
/// where the segment programs call it.
fn load_tail_call(
    ebpf: &mut Ebpf,
    name: &'static str,
    table: &'static str,
) -> Result<(), ProbeError> {
    let program: &mut CgroupSkb = program_mut(ebpf, name)?;
    program
        .load()
        .map_err(|source| ProbeError::Verify { name, source })?;
    let fd = program
        .fd()
        .map_err(|source| ProbeError::Verify { name, source })?
        .try_clone()
        .map_err(|source| ProbeError::Verify {
            name,
            source: ProgramError::from(source),
        })?;
    typed_map_mut::<aya::maps::ProgramArray<_>>(ebpf, table)?
        .set(0, &fd, 0)
        .map_err(|source| map_error("set", table, source))
}

/// Unload whatever of the socket programs of `set` was loaded.
fn unload_socket_programs(ebpf: &mut Ebpf, set: ProgramSet) {
    let [sockops, ingress, egress, _] = set.names();
    if let Ok(program) = program_mut::<SockOps>(ebpf, sockops) {
        let _ = program.unload();
    }
    let tail_calls = set.tail_calls().iter().map(|&(name, _)| name);
    for name in [ingress, egress].into_iter().chain(tail_calls) {
        if let Ok(program) = program_mut::<CgroupSkb>(ebpf, name) {
            let _ = program.unload();
        }
    }
}

/// Attach the loaded socket programs of `set` to every cgroup of `dirs`.
fn attach_socket_programs(
    ebpf: &mut Ebpf,
    set: ProgramSet,
    dirs: &[(&PathBuf, std::fs::File)],
) -> Result<(), ProbeError> {
    let [sockops, ingress, egress, _] = set.names();
    let program: &mut SockOps = program_mut(ebpf, sockops)?;
    for (path, dir) in dirs {
        // A single attachment: the kernel here refuses AllowMultiple for sock_ops on the
        // root.
        program
            .attach(dir, CgroupAttachMode::Single)
            .map_err(attach_error(sockops, path))?;
    }
    for (name, attach_type) in [
        (ingress, CgroupSkbAttachType::Ingress),
        (egress, CgroupSkbAttachType::Egress),
    ] {
        let program: &mut CgroupSkb = program_mut(ebpf, name)?;
        for (path, dir) in dirs {
            program
                .attach(dir, attach_type, CgroupAttachMode::Single)
                .map_err(attach_error(name, path))?;
        }
    }
    Ok(())
}

/// Load the `tcp_destroy_sock` program of `set`: closes of connections adopted after they
/// opened (their state callback was never enabled).
fn load_destroy_tracepoint(ebpf: &mut Ebpf, set: ProgramSet, btf: &Btf) -> Result<(), ProbeError> {
    let destroy = set.names()[3];
    let program: &mut BtfTracePoint = program_mut(ebpf, destroy)?;
    program
        .load("tcp_destroy_sock", btf)
        .map_err(|source| ProbeError::Verify {
            name: destroy,
            source,
        })
}

/// Attach the loaded `tcp_destroy_sock` program of `set`.
fn attach_destroy_tracepoint(
    ebpf: &mut Ebpf,
    set: ProgramSet,
    cgroup: &Path,
) -> Result<(), ProbeError> {
    let destroy = set.names()[3];
    let program: &mut BtfTracePoint = program_mut(ebpf, destroy)?;
    program.attach().map_err(attach_error(destroy, cgroup))?;
    Ok(())
}

/// The map `name` of `ebpf`, as the typed map `T`, for writing.
fn typed_map_mut<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<T, ProbeError>
where
    T: TryFrom<&'a mut Map, Error = MapError>,
{
    let map = ebpf.map_mut(name).ok_or_else(|| missing_map(name))?;
    T::try_from(map).map_err(|source| ProbeError::MissingMap { name, source })
}

fn program_mut<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, ProbeError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program>,
{
    ebpf.program_mut(name)
        .and_then(|program| program.try_into().ok())
        .ok_or(ProbeError::MissingProgram { name })
}

fn missing_map(name: &'static str) -> ProbeError {
    ProbeError::MissingMap {
        name,
        source: aya::maps::MapError::InvalidName {
            name: name.to_owned(),
        },
    }
}

fn map_error(
    operation: &'static str,
    name: &'static str,
    source: aya::maps::MapError,
) -> ProbeError {
    ProbeError::Map {
        operation,
        name,
        source,
    }
}
