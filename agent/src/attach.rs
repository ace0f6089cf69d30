//! Where the programs attach: `agent.attach_cgroups`, with `"auto"` resolved, when the agent
//! starts, to the cgroups of the processes that own the watched sockets (the replicas'
//! listeners, the proxy's frontend and its connections to the backends).

use std::path::{Path, PathBuf};

use crate::kernel::{SocketOwner, owner_cgroups, socket_owners};
use retry_after_estimator::{
    config::{AttachCgroups, Config},
    endpoint::Endpoint,
};

/// What an unwatched segment pays when the programs are attached at the root, as measured
/// (docs/evaluation.md, the data-path bench): named in the warning of a fallback.
pub const ROOT_COST: &str = "every segment of every socket on this node runs the programs' \
     early exit, about 80 ns each (docs/evaluation.md)";

/// Where to attach, and what was found on the way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachPlan {
    /// The cgroups to attach to; empty: the root.
    pub dirs: Vec<PathBuf>,
    /// The processes owning watched sockets now, by cgroup.
    pub owners: Vec<SocketOwner>,
    /// What `"auto"` attaches to, whatever the setting: the owners' cgroups, outermost only;
    /// or why it would be the root.
    pub auto: Result<Vec<PathBuf>, String>,
}

impl AttachPlan {
    /// The owners, one after another.
    pub fn owners_listed(&self) -> String {
        let owners: Vec<String> = self.owners.iter().map(ToString::to_string).collect();
        owners.join(", ")
    }

    /// What `"auto"` does: `attaches to /a, /b`, or `attaches at the root (why): the cost`.
    pub fn auto_described(&self) -> String {
        match &self.auto {
            Ok(dirs) => {
                let dirs: Vec<String> = dirs.iter().map(|d| format!("/{}", d.display())).collect();
                format!("attaches to {}", dirs.join(", "))
            }
            Err(why) => format!("attaches at the root ({why}): {ROOT_COST}"),
        }
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
    let (owners, auto) = match socket_owners(proc, &servers, &backends) {
        Err(e) => (
            Vec::new(),
            Err(format!("cannot read {}: {e}", proc.display())),
        ),
        Ok(owners) => {
            let auto = match owner_cgroups(&owners) {
                Some(dirs) => Ok(dirs),
                None if owners.is_empty() => Err(
                    "no process listens on a watched endpoint or is connected to a backend yet"
                        .to_owned(),
                ),
                None => Err("a process in the root cgroup owns a watched socket".to_owned()),
            };
            (owners, auto)
        }
    };
    let dirs = match &config.agent.attach_cgroups {
        AttachCgroups::Root => Vec::new(),
        AttachCgroups::Paths(paths) => paths.clone(),
        AttachCgroups::Auto => auto.clone().unwrap_or_default(),
    };
    AttachPlan { dirs, owners, auto }
}
