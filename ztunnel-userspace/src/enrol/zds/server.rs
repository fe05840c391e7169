//! The listening socket of local mode: our CNI plugin (`ztunnel-cni`) and
//! `ztunnel enrol` dial it. Each client is served on its own thread with
//! the same rules as a node agent ([`super::session`]).

use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::Arc,
};

use nix::sys::socket::{
    AddressFamily, Backlog, MsgFlags, SockFlag, SockType, UnixAddr, accept, bind, listen, sendmsg,
    socket,
};

use super::{ZdsError, session::Session, wire};
use crate::{
    accept::{AcceptErrors, ListenerKind},
    enrol::{PodRegistry, Source},
};

/// The socket file this process bound, identified by device and inode so
/// that it is removed only while it is still ours.
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    id: Option<(u64, u64)>,
}

impl SocketFile {
    fn identify(path: &Path) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt as _;
        std::fs::symlink_metadata(path)
            .ok()
            .map(|m| (m.dev(), m.ino()))
    }

    /// Removes the file if it is still the one this process bound. During
    /// an upgrade the next ztunnel replaces it with its own before this one
    /// exits; removing that would cut the enrollers off from it.
    pub fn remove_if_ours(&self) -> bool {
        let ours = self.id.is_some() && Self::identify(&self.path) == self.id;
        if ours {
            let _ = std::fs::remove_file(&self.path);
        } else {
            tracing::info!(socket = %self.path.display(), "enrolment socket file belongs to another ztunnel now: left in place");
        }
        ours
    }
}

/// Listens on `path` (replacing a stale socket file, or the one of a
/// ztunnel being replaced) and serves each client on its own thread.
/// Returns once listening.
pub fn serve(path: &Path, registry: Arc<PodRegistry>) -> Result<SocketFile, ZdsError> {
    let sock_err = |source| ZdsError::Socket {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| ZdsError::Dir {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    let _ = std::fs::remove_file(path);
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(sock_err)?;
    bind(fd.as_raw_fd(), &UnixAddr::new(path).map_err(sock_err)?).map_err(sock_err)?;
    let file = SocketFile {
        path: path.to_path_buf(),
        id: SocketFile::identify(path),
    };
    listen(&fd, Backlog::new(64).map_err(sock_err)?).map_err(sock_err)?;
    let limits = Arc::clone(&registry.shared().limits);
    let mut errors = AcceptErrors::new(
        ListenerKind::Enrolment,
        None,
        Arc::clone(&registry.shared().metrics),
    );
    std::thread::Builder::new()
        .name("enrol-accept".into())
        .spawn(move || {
            loop {
                let client = match accept(fd.as_raw_fd()) {
                    Ok(client) => {
                        errors.succeeded();
                        // SAFETY: accept returned a fresh fd that we own.
                        unsafe { OwnedFd::from_raw_fd(client) }
                    }
                    Err(e) => {
                        if let Some(wait) = errors.failed(Some(e as i32), &e) {
                            std::thread::sleep(wait);
                        }
                        continue;
                    }
                };
                // Counted and logged by the limit; the client is told why.
                let Some(place) = limits.enrol_client() else {
                    refuse_client(&client, limits.limits().enrol_clients);
                    continue;
                };
                let registry = Arc::clone(&registry);
                let _ = std::thread::Builder::new()
                    .name("enrol-client".into())
                    .spawn(move || {
                        let _place = place;
                        let draining = || *registry.shared().draining.borrow();
                        let mut session = Session::new(&registry, Source::Socket);
                        if let Err(e) = session.serve(&client, &draining, &mut |_| {}) {
                            tracing::warn!(error = %e, "enrolment client connection failed");
                        }
                    });
            }
        })
        .map_err(|e| ZdsError::Dir {
            path: path.to_path_buf(),
            source: e,
        })?;
    Ok(file)
}

/// Answers a client over the limit with an `ack` saying why (it reads it
/// as the answer to its first request), then closes the connection. The
/// send never blocks the accept thread: an answer that does not fit in the
/// socket buffer (a client flooding us) is dropped, the close still says
/// enough.
fn refuse_client(client: &OwnedFd, max: usize) {
    let payload = wire::ack_bytes(&format!(
        "too many enrolment clients ({max} connected, --max-enrol-clients): try again later"
    ));
    let _ = sendmsg::<()>(
        client.as_raw_fd(),
        &[std::io::IoSlice::new(&payload)],
        &[],
        MsgFlags::MSG_DONTWAIT,
        None,
    );
}
