//! The data path's floor: the two segment hooks with programs that let every segment pass at
//! once (`ra_floor_in`, `ra_floor_out`), for the data-path bench to measure the real programs
//! against in the same run. Never attached by the agent.

use std::path::Path;

use aya::{
    Ebpf,
    programs::{CgroupAttachMode, CgroupSkb, CgroupSkbAttachType},
};

use super::{
    EBPF_OBJECT, ProbeError, ProgramRunStats, attach_error, open_dirs, program_mut, run_stats,
};

/// Names of the floor's programs.
pub const FLOOR_PROGRAM_NAMES: [&str; 2] = ["ra_floor_in", "ra_floor_out"];

/// The floor's programs, loaded and attached to one cgroup until dropped.
pub struct Floor {
    ebpf: Ebpf,
}

impl Floor {
    /// Load the floor's programs (the other programs of the object stay unloaded) and attach
    /// them to the cgroup v2 directory `cgroup`.
    ///
    /// # Errors
    /// The object or a program is refused, or the cgroup cannot be opened or attached to.
    pub fn attach(cgroup: &Path) -> Result<Self, ProbeError> {
        let mut ebpf = Ebpf::load(EBPF_OBJECT).map_err(ProbeError::Load)?;
        let paths = [cgroup.to_path_buf()];
        let [(_, dir)] = &open_dirs(&paths)?[..] else {
            unreachable!("one directory opened for one path")
        };
        let [ingress, egress] = FLOOR_PROGRAM_NAMES;
        for (name, attach_type) in [
            (ingress, CgroupSkbAttachType::Ingress),
            (egress, CgroupSkbAttachType::Egress),
        ] {
            let program: &mut CgroupSkb = program_mut(&mut ebpf, name)?;
            program
                .load()
                .map_err(|source| ProbeError::Verify { name, source })?;
            program
                .attach(dir, attach_type, CgroupAttachMode::Single)
                .map_err(attach_error(name, cgroup))?;
        }
        Ok(Self { ebpf })
    }

    /// How often each floor program ran and for how long (while run-time statistics are
    /// enabled).
    pub fn program_run_stats(&self) -> Vec<ProgramRunStats> {
        run_stats(&self.ebpf)
    }
}
