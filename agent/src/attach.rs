//! Where the programs attach: `agent.attach_cgroups`, with `"auto"` resolved, when the agent
//! starts, to the cgroups of the processes that own the watched sockets (the replicas'
//! listeners, the proxy's frontend and its connections to the backends).

use std::path::{Path, PathBuf};

use crate::{
    config::{AttachCgroups, Config},
    endpoint::Endpoint,
    kernel::{SocketOwner, owner_cgroups, socket_owners},
};

/// What an unwatched segment pays when the programs are attached at the root, as measured
/// (docs/evaluation.md, the data-path bench): named in the warning of a fallback.
pub const ROOT_COST: &str = "every segment of every socket on this node runs the programs' \
     early exit, about 80 ns each (docs/evaluation.md)";

/// Where to attach, and what was found on the way.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttachPlan {
    /// The cgroups to attach to; empty: the root.
    pub dirs: Vec<PathBuf>,
    /// The processes owning watched sockets now, by cgroup.
    pub owners: Vec<SocketOwner>,
    /// Why `"auto"` fell back to the root, if it did.
    pub fallback: Option<String>,
}

impl AttachPlan {
    /// The cgroups the owners are in, outermost only (what `"auto"` attaches to), if they
    /// are not the root.
    pub fn owner_cgroups(&self) -> Option<Vec<PathBuf>> {
        owner_cgroups(&self.owners)
    }
}

/// The plan for `config`, looking at the processes of `proc` (`/proc`).
pub fn plan(config: &Config, proc: &Path) -> AttachPlan {
    let servers: Vec<Endpoint> = config.watched_endpoints().into_iter().collect();
    let backends: Vec<Endpoint> = config
        .services
        .iter()
        .flat_map(|s| s.backends.iter().map(|b| b.endpoint))
        .collect();
    let (owners, looked) = match socket_owners(proc, &servers, &backends) {
        Ok(owners) => (owners, None),
        Err(e) => (
            Vec::new(),
            Some(format!("cannot read {}: {e}", proc.display())),
        ),
    };
    let mut plan = AttachPlan {
        owners,
        ..AttachPlan::default()
    };
    match &config.agent.attach_cgroups {
        AttachCgroups::Root => {}
        AttachCgroups::Paths(paths) => plan.dirs = paths.clone(),
        AttachCgroups::Auto => match (plan.owner_cgroups(), looked) {
            (_, Some(why)) => plan.fallback = Some(why),
            (Some(dirs), None) => plan.dirs = dirs,
            (None, None) if plan.owners.is_empty() => {
                plan.fallback = Some(
                    "no process listens on a watched endpoint or is connected to a backend yet"
                        .into(),
                );
            }
            (None, None) => {
                plan.fallback = Some("a process in the root cgroup owns a watched socket".into());
            }
        },
    }
    plan
}
