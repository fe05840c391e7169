//! Dialling Istio's node agent (istio-cni), as Istio's ztunnel does.
//!
//! The agent listens on `INPOD_UDS` (default `/var/run/ztunnel/ztunnel.sock`)
//! and ztunnel connects: a restarted ztunnel, or the second one of an
//! upgrade, gets the whole snapshot at once. After connecting ztunnel sends
//! `ZdsHello{version: V1}`; the agent then sends every pod it has
//! (`add`/`keep`), `snapshot_sent`, and from then on `add`/`del`.
//!
//! A failed dial, or a connection that ends, is retried after a back-off
//! that starts at [`FIRST_BACKOFF`] and doubles up to [`MAX_BACKOFF`]; it
//! starts over once a connection has delivered its snapshot. Pods stay as
//! they are while the agent is away: only a new snapshot removes any.

use std::{
    os::fd::{AsRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
use prost::Message as _;

use super::{Version, ZdsError, ZdsHello, session::Session, wire};
use crate::enrol::{PodRegistry, Source};

/// First wait before dialling again (the agent may just be starting).
pub const FIRST_BACKOFF: Duration = Duration::from_millis(10);
/// Longest wait between dials: an agent that is away for long is still
/// found within this once it is back.
pub const MAX_BACKOFF: Duration = Duration::from_secs(15);

/// What readiness needs to know about the node agent.
#[derive(Debug, Default)]
pub struct NodeAgentStatus {
    connected: AtomicBool,
    /// A connection has delivered a complete snapshot (set once).
    synced: AtomicBool,
    pending: AtomicUsize,
}

impl NodeAgentStatus {
    /// `Ok` once a snapshot was applied and no pod is pending; otherwise
    /// why not (the readiness endpoint says it).
    pub fn ready(&self) -> Result<(), String> {
        if !self.synced.load(Ordering::Acquire) {
            return Err(if self.connected.load(Ordering::Acquire) {
                "waiting for the node agent's snapshot".into()
            } else {
                "not connected to the node agent yet".into()
            });
        }
        match self.pending.load(Ordering::Acquire) {
            0 => Ok(()),
            n => Err(format!(
                "{n} pod(s) from the node agent could not be enrolled yet"
            )),
        }
    }

    /// Whether a connection has delivered a complete snapshot.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Whether a connection is up.
    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }
}

/// Starts the thread that dials the node agent at `path` and serves it for
/// as long as the process runs (until it drains). Pods it enrols are of
/// [`Source::NodeAgent`].
pub fn start(path: PathBuf, registry: Arc<PodRegistry>) -> Result<Arc<NodeAgentStatus>, ZdsError> {
    let status = Arc::new(NodeAgentStatus::default());
    let thread_status = Arc::clone(&status);
    std::thread::Builder::new()
        .name("node-agent".into())
        .spawn(move || run(&path, &registry, &thread_status))
        .map_err(|source| ZdsError::Dir {
            path: PathBuf::from("node-agent thread"),
            source,
        })?;
    Ok(status)
}

fn run(path: &Path, registry: &PodRegistry, status: &NodeAgentStatus) {
    let draining = || *registry.shared().draining.borrow();
    let mut backoff = FIRST_BACKOFF;
    let mut failures = 0u32;
    while !draining() {
        let conn = match dial(path) {
            Ok(conn) => conn,
            Err(e) => {
                failures += 1;
                // The first failures are normal at start-up (the agent
                // comes up beside us); a lasting one is worth a warning,
                // not one per attempt.
                if failures == 5 || failures.is_multiple_of(60) {
                    tracing::warn!(socket = %path.display(), error = %e, failures, "cannot reach the node agent; still trying");
                } else {
                    tracing::debug!(socket = %path.display(), error = %e, "node agent not reachable yet");
                }
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        tracing::info!(socket = %path.display(), "connected to the node agent");
        failures = 0;
        status.connected.store(true, Ordering::Release);
        let mut session = Session::new(registry, Source::NodeAgent);
        let result = session.serve(&conn, &draining, &mut |s: &Session<'_>| {
            if s.snapshot_done() {
                status.synced.store(true, Ordering::Release);
                status.pending.store(s.pending(), Ordering::Release);
            }
        });
        status.connected.store(false, Ordering::Release);
        match result {
            Ok(()) => tracing::info!(socket = %path.display(), "node agent connection ended"),
            Err(e) => {
                tracing::warn!(socket = %path.display(), error = %e, "node agent connection failed");
            }
        }
        if session.snapshot_done() {
            backoff = FIRST_BACKOFF;
        }
        if !draining() {
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }
    tracing::debug!("draining: node agent connection closed");
}

/// Connects and says hello.
fn dial(path: &Path) -> Result<OwnedFd, ZdsError> {
    let sock_err = |source| ZdsError::Socket {
        path: path.to_path_buf(),
        source,
    };
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(sock_err)?;
    connect(fd.as_raw_fd(), &UnixAddr::new(path).map_err(sock_err)?).map_err(sock_err)?;
    let hello = ZdsHello {
        version: Version::V1.into(),
    };
    wire::send(fd.as_raw_fd(), &hello.encode_to_vec(), None).map_err(sock_err)?;
    Ok(fd)
}
