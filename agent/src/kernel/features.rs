//! What the running kernel lets the programs do, asked of its own verifier at start.
//!
//! Each feature some program needs has a probe program in the object (`ebpf/src/features.rs`)
//! that only a kernel with that feature accepts; distributions backport features, so a kernel
//! version says less than the verifier does. What a missing feature switches off is named here
//! once, for the start-up log, `check` and the metrics.

use aya::{
    Btf, Ebpf,
    programs::{BtfTracePoint, CgroupSkb, ProgramError},
    util::KernelVersion,
};

/// A kernel feature that some of the programs need.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum KernelFeature {
    /// The `bpf_loop` helper: each segment's HTTP/2 frames walked in one loop.
    BpfLoop,
    /// Socket-local storage from a tracing program: the closes of adopted connections.
    TracingSocketStorage,
    /// cgroup attachments as BPF links, owned by the process and detached when it dies.
    CgroupLinks,
}

impl KernelFeature {
    /// Every feature, in the order they are reported.
    pub const ALL: [Self; 3] = [Self::BpfLoop, Self::TracingSocketStorage, Self::CgroupLinks];

    /// The name in logs, `check` and the `feature` label of `retry_after_kernel_feature`.
    pub fn name(self) -> &'static str {
        match self {
            Self::BpfLoop => "bpf_loop",
            Self::TracingSocketStorage => "tracing_socket_storage",
            Self::CgroupLinks => "cgroup_links",
        }
    }

    /// The mainline kernel version that brought it.
    pub fn since(self) -> &'static str {
        match self {
            Self::BpfLoop => "5.17",
            Self::TracingSocketStorage => "5.11",
            Self::CgroupLinks => "5.7",
        }
    }

    /// What goes without it.
    pub fn without(self) -> &'static str {
        match self {
            Self::BpfLoop => {
                "HTTP/2 frames are walked in steps, each a call of a function the verifier \
                 checks once, 2,048 a program and on in the next by a tail call: counted as \
                 exactly; a segment whose frames outlast the chain is counted in \
                 retry_after_probe_problems{kind=\"http2_walks_cut\"}"
            }
            Self::TracingSocketStorage => {
                "connections opened before the agent started (proxies' pools) are not adopted: \
                 only connections established while it runs are counted"
            }
            Self::CgroupLinks => {
                "programs are attached the legacy way: an agent killed with SIGKILL leaves them \
                 attached until `bpftool cgroup detach` removes them"
            }
        }
    }

    /// The probe program that only a kernel with this feature accepts, if it has one.
    fn probe_program(self) -> Option<&'static str> {
        match self {
            Self::BpfLoop => Some("ra_has_bpf_loop"),
            Self::TracingSocketStorage => Some("ra_has_sk_store"),
            Self::CgroupLinks => None,
        }
    }
}

/// Whether the kernel has a feature; if not, why (the verifier's own words).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FeatureState {
    /// The kernel has it.
    Present,
    /// The kernel lacks it, for this reason.
    Missing(String),
}

/// The state of every [`KernelFeature`] on the running kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelFeatures {
    states: [FeatureState; 3],
}

impl KernelFeatures {
    /// Ask the kernel: load each probe program of `ebpf` (then unload it). `btf` is the
    /// kernel's, for the tracing probe.
    pub fn probe(ebpf: &mut Ebpf, btf: &Btf) -> Self {
        Self {
            states: KernelFeature::ALL.map(|feature| probe_one(ebpf, btf, feature)),
        }
    }

    /// The state of `feature`.
    pub fn state(&self, feature: KernelFeature) -> &FeatureState {
        &self.states[feature as usize]
    }

    /// True if the kernel has `feature`.
    pub fn has(&self, feature: KernelFeature) -> bool {
        *self.state(feature) == FeatureState::Present
    }

    /// Count `feature` as missing, whatever the kernel said.
    pub fn switch_off(&mut self, feature: KernelFeature) {
        self.states[feature as usize] =
            FeatureState::Missing("switched off by the agent's options".into());
    }

    /// Every feature with its state, in [`KernelFeature::ALL`]'s order.
    pub fn iter(&self) -> impl Iterator<Item = (KernelFeature, &FeatureState)> {
        KernelFeature::ALL.into_iter().zip(&self.states)
    }
}

/// Probe one feature.
fn probe_one(ebpf: &mut Ebpf, btf: &Btf, feature: KernelFeature) -> FeatureState {
    let Some(name) = feature.probe_program() else {
        // aya attaches with links from 5.7 on, by the kernel's version; say what it does.
        return match KernelVersion::current() {
            Ok(version) if version >= KernelVersion::new(5, 7, 0) => FeatureState::Present,
            Ok(_) => FeatureState::Missing("kernel older than 5.7".into()),
            Err(error) => FeatureState::Missing(format!("kernel version unknown: {error}")),
        };
    };
    let loaded = match feature {
        KernelFeature::TracingSocketStorage => load_tracing(ebpf, name, btf),
        _ => load_skb(ebpf, name),
    };
    match loaded {
        Ok(()) => FeatureState::Present,
        Err(error) => FeatureState::Missing(refusal(&error)),
    }
}

/// Load and unload the cgroup_skb probe `name`.
fn load_skb(ebpf: &mut Ebpf, name: &str) -> Result<(), ProgramError> {
    let program: &mut CgroupSkb = ebpf
        .program_mut(name)
        .ok_or(ProgramError::NotLoaded)?
        .try_into()?;
    program.load()?;
    program.unload()
}

/// Load and unload the tracing probe `name` (on `tcp_destroy_sock`).
fn load_tracing(ebpf: &mut Ebpf, name: &str, btf: &Btf) -> Result<(), ProgramError> {
    let program: &mut BtfTracePoint = ebpf
        .program_mut(name)
        .ok_or(ProgramError::NotLoaded)?
        .try_into()?;
    program.load("tcp_destroy_sock", btf)?;
    program.unload()
}

/// The verifier's reason for refusing a program, in one line: the last line of its log that
/// is not its closing statistics, else the loader's error.
pub fn refusal(error: &ProgramError) -> String {
    if let ProgramError::LoadError {
        io_error,
        verifier_log,
    } = error
    {
        let log = verifier_log.to_string();
        let reason = log.lines().rev().map(str::trim).find(|line| {
            !line.is_empty()
                && !line.starts_with("verification time")
                && !line.starts_with("stack depth")
                && !line.starts_with("processed ")
        });
        return match reason {
            Some(reason) => format!("{reason} ({io_error})"),
            None => io_error.to_string(),
        };
    }
    error.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_feature_has_a_name_a_version_and_what_goes_without_it() {
        for (index, feature) in KernelFeature::ALL.into_iter().enumerate() {
            assert_eq!(feature as usize, index, "ALL is in declaration order");
            assert!(!feature.name().is_empty() && !feature.without().is_empty());
            assert!(feature.since().starts_with('5'), "{}", feature.since());
        }
    }
}
