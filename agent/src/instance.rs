//! One agent per node.
//!
//! Two agents would both attach to the cgroup root (BPF links allow several attachments), both
//! count, and every packet would pay twice. So the agent holds a lock before it attaches: the
//! abstract Unix socket `@retry-after-agent` in the node's network namespace (host networking,
//! as node daemons and DaemonSets with `hostNetwork` run). Binding it succeeds for one process
//! only; it disappears with that process, however it dies, so there is never a stale lock; and
//! the holder answers every connection with one line that names it, so a second agent can say
//! which one is running.

use std::{
    io::{BufRead, BufReader},
    os::{linux::net::SocketAddrExt, unix::net::SocketAddr},
    time::Duration,
};

use tokio::io::AsyncWriteExt;

/// The abstract socket name of the lock.
pub const LOCK_NAME: &[u8] = b"retry-after-agent";

/// Why this agent may not run.
#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    /// Another agent holds the lock.
    #[error("another retry-after-agent is running on this node ({holder}); stop it first")]
    Running {
        /// What the running agent says of itself.
        holder: String,
    },
    /// The lock cannot be taken for another reason.
    #[error("cannot take the one-agent-per-node lock (abstract socket @retry-after-agent)")]
    Io(#[source] std::io::Error),
}

/// The held lock; released when dropped (or when the process ends).
pub struct InstanceLock {
    listener: std::os::unix::net::UnixListener,
}

impl InstanceLock {
    /// Take the lock, or say who holds it.
    ///
    /// # Errors
    /// [`InstanceError::Running`] naming the running agent.
    pub fn acquire() -> Result<Self, InstanceError> {
        let addr = SocketAddr::from_abstract_name(LOCK_NAME).map_err(InstanceError::Io)?;
        match std::os::unix::net::UnixListener::bind_addr(&addr) {
            Ok(listener) => Ok(Self { listener }),
            Err(error) if error.kind() == std::io::ErrorKind::AddrInUse => {
                Err(InstanceError::Running {
                    holder: holder(&addr).unwrap_or_else(|| "it did not say who it is".into()),
                })
            }
            Err(error) => Err(InstanceError::Io(error)),
        }
    }

    /// Answer every connection to the lock with `identity` (one line), until the returned task
    /// is dropped with the runtime. Must be called within a tokio runtime.
    ///
    /// # Errors
    /// The listener cannot be handed to tokio.
    pub fn announce(self, identity: String) -> std::io::Result<tokio::task::JoinHandle<()>> {
        self.listener.set_nonblocking(true)?;
        let listener = tokio::net::UnixListener::from_std(self.listener)?;
        Ok(tokio::spawn(async move {
            let line = format!("{identity}\n");
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let line = line.clone();
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(1),
                        stream.write_all(line.as_bytes()),
                    )
                    .await;
                });
            }
        }))
    }
}

/// What the lock's holder says of itself (within one second).
fn holder(addr: &SocketAddr) -> Option<String> {
    let stream = std::os::unix::net::UnixStream::connect_addr(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    let mut line = String::new();
    BufReader::new(std::io::Read::take(stream, 512))
        .read_line(&mut line)
        .ok()?;
    let line = line.trim_end();
    (!line.is_empty()).then(|| line.to_owned())
}
