//! The Unix-socket server proxies talk to (protocol: the `retry-after-protocol` crate and
//! docs/protocol.md), cut like a small tokio server: this module binds and accepts,
//! `connection` serves one connection, `command` answers each request, `registry` holds
//! the connections and decides who makes room for whom.
//!
//! One bad connection is answered with an `ERR` line and never affects another. Limits: a
//! request line is at most `MAX_LINE_LEN` bytes; every answer is written within
//! `write_timeout` or the connection ends; at most `max_clients` connections, subscribers at
//! most three quarters of them; a connection that sends nothing for `idle_timeout` is closed
//! unless it subscribed; optionally only peers whose uid (SO_PEERCRED) is allowed are served.
//! [`serve`] returns only after every connection task has finished.

mod command;
mod connection;
mod registry;

use std::{
    future::Future,
    io,
    os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

pub use registry::max_subscribers;
use tokio::{
    net::UnixListener,
    sync::{broadcast, mpsc},
};
use tracing::{debug, warn};

use crate::shared::Shared;

/// Limits of the socket server.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Only these peer uids are served, if set.
    pub allowed_uids: Option<Vec<u32>>,
    /// Connections held at once.
    pub max_clients: usize,
    /// Connections silent this long are closed (subscribers excepted).
    pub idle_timeout: Duration,
    /// An answer not written within this ends its connection.
    pub write_timeout: Duration,
}

/// The socket cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Another agent answers on the socket.
    #[error("another agent is already serving {0}")]
    AlreadyRunning(PathBuf),
    /// Something that is not a socket is in the way.
    #[error("{0} exists and is not a socket; remove it or choose another agent.socket_path")]
    NotASocket(PathBuf),
    /// The socket's directory could be changed by someone else.
    #[error(
        "the socket directory {path} is {why}: anyone who can write it can replace the socket; use a directory owned by uid {uid} and not writable by others"
    )]
    UnsafeDirectory {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
        /// Our uid.
        uid: u32,
    },
    /// Creating, binding or setting permissions failed.
    #[error("cannot set up the socket {path}")]
    Io {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Bind the socket at `path` with permissions `mode`. Creates the parent directory (0755) or
/// checks that an existing one is ours and not writable by others; removes a stale socket
/// file left by an agent that died and refuses to steal a live one. The socket is created
/// owner-only and only then given `mode`, after checking it is the socket just made (not a
/// link), so it is never reachable with wider permissions than asked.
///
/// # Errors
/// [`ServerError`].
pub fn bind(path: &Path, mode: u32) -> Result<UnixListener, ServerError> {
    let io_error = |source| ServerError::Io {
        path: path.to_owned(),
        source,
    };
    if let Some(parent) = path.parent() {
        check_directory(parent).map_err(|e| match e {
            DirectoryError::Io(source) => io_error(source),
            DirectoryError::Unsafe(why) => ServerError::UnsafeDirectory {
                path: parent.to_owned(),
                why,
                // SAFETY: geteuid has no preconditions.
                uid: unsafe { libc::geteuid() },
            },
        })?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(ServerError::AlreadyRunning(path.to_owned()));
            }
            std::fs::remove_file(path).map_err(io_error)?;
        }
        Ok(_) => return Err(ServerError::NotASocket(path.to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error(e)),
    }
    // SAFETY: umask has no preconditions; it is restored at once.
    let old_umask = unsafe { libc::umask(0o177) };
    let listener = UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(old_umask) };
    let listener = listener.map_err(io_error)?;
    let meta = std::fs::symlink_metadata(path).map_err(io_error)?;
    if !meta.file_type().is_socket() {
        return Err(ServerError::NotASocket(path.to_owned()));
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io_error)?;
    Ok(listener)
}

enum DirectoryError {
    Io(io::Error),
    Unsafe(String),
}

/// Create `dir` (0755) if missing; else require it to be a directory of ours (or root's), not
/// writable by group or others unless sticky.
fn check_directory(dir: &Path) -> Result<(), DirectoryError> {
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(DirectoryError::Io)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
            .map_err(DirectoryError::Io)?;
        return Ok(());
    }
    let meta = std::fs::metadata(dir).map_err(DirectoryError::Io)?;
    if !meta.is_dir() {
        return Err(DirectoryError::Unsafe("not a directory".into()));
    }
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    if meta.uid() != uid && meta.uid() != 0 {
        return Err(DirectoryError::Unsafe(format!(
            "owned by uid {}",
            meta.uid()
        )));
    }
    let sticky = meta.mode() & 0o1000 != 0;
    if meta.mode() & 0o022 != 0 && !sticky {
        return Err(DirectoryError::Unsafe(format!(
            "writable by others (mode {:o})",
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

/// Serve connections on `listener` until `shutdown` completes, then tell every connection to
/// stop and wait until all of them have.
pub async fn serve(
    listener: UnixListener,
    shared: Arc<Shared>,
    options: ServerOptions,
    shutdown: impl Future<Output = ()>,
) {
    let registry = Arc::new(registry::Registry::new(options.max_clients));
    let options = Arc::new(options);
    // Dropping the sender tells every connection to stop; each task holds a clone of `done`,
    // so `finished` yields `None` once the last one has ended.
    let (stop, _) = broadcast::channel::<()>(1);
    let (done, mut finished) = mpsc::channel::<()>(1);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let (shared, options, registry) = (shared.clone(), options.clone(), registry.clone());
                    let (stop, done) = (stop.subscribe(), done.clone());
                    tokio::spawn(async move {
                        if let Err(error) = connection::serve(stream, &shared, &options, &registry, stop).await {
                            debug!(%error, "socket connection ended with an error");
                        }
                        drop(done);
                    });
                }
                Err(error) => {
                    // Out of file descriptors, for instance: back off, keep serving.
                    warn!(%error, "accept on the proxy socket failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
    drop(stop);
    drop(done);
    let _ = finished.recv().await;
}
