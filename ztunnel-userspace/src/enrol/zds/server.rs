//! The listening socket of local mode: our CNI plugin (`ztunnel-cni`) and
//! `ztunnel enrol` dial it. Each client is served on its own thread with
//! the same rules as a node agent ([`super::session`]).
//!
//! Whoever talks to it decides which pods are captured (a `snapshot_sent`
//! with an empty set un-enrols every pod of the node), so two locks guard
//! it: the file is created with mode 0600 (only root reaches it; istio-cni's
//! own server leaves this to the umask and the host folder), and each
//! client's credentials (`SO_PEERCRED`) must be root of the host or one of
//! the uids given with `--enrol-uid`. A refused client is told why and
//! closed before anything it sent is read.

use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::Arc,
};

use nix::sys::socket::{
    AddressFamily, Backlog, MsgFlags, SockFlag, SockType, UnixAddr, accept, bind, getsockopt,
    listen, sendmsg, socket, sockopt,
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

/// Who may use the socket besides root (`--enrol-uid`).
#[derive(Debug, Clone, Default)]
pub struct AllowedPeers {
    /// Extra uids (root is always allowed).
    pub uids: Vec<u32>,
}

impl AllowedPeers {
    /// Whether a client running as `uid` may enrol and remove pods.
    pub fn allows(&self, uid: u32) -> bool {
        uid == 0 || self.uids.contains(&uid)
    }
}

/// The mode of the socket file: only its owner (root) can connect.
const SOCKET_MODE: u32 = 0o600;

/// Binds `fd` at `path` with [`SOCKET_MODE`] from the first instant: bound
/// under a temporary name, restricted, then renamed over `path` (a rename
/// is atomic, so no client ever sees the file with the umask's mode).
fn bind_private(fd: &OwnedFd, path: &Path) -> Result<(), ZdsError> {
    use std::os::unix::fs::PermissionsExt as _;
    let sock_err = |source| ZdsError::Socket {
        path: path.to_path_buf(),
        source,
    };
    let mut temp = path.as_os_str().to_owned();
    temp.push(format!(".{}.new", std::process::id()));
    let temp = PathBuf::from(temp);
    let _ = std::fs::remove_file(&temp);
    bind(fd.as_raw_fd(), &UnixAddr::new(&temp).map_err(sock_err)?).map_err(sock_err)?;
    let io_err = |source: std::io::Error| {
        let _ = std::fs::remove_file(&temp);
        ZdsError::Socket {
            path: path.to_path_buf(),
            source: nix::Error::from_raw(source.raw_os_error().unwrap_or(libc::EIO)),
        }
    };
    std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(SOCKET_MODE))
        .map_err(io_err)?;
    std::fs::rename(&temp, path).map_err(io_err)
}

/// The peer's uid and pid, or why they could not be read.
fn peer_of(client: &OwnedFd) -> Result<(u32, i32), nix::Error> {
    getsockopt(client, sockopt::PeerCredentials).map(|c| (c.uid(), c.pid()))
}

/// Listens on `path` (replacing a stale socket file, or the one of a
/// ztunnel being replaced) and serves each client on its own thread.
/// Returns once listening.
pub fn serve(
    path: &Path,
    registry: Arc<PodRegistry>,
    allowed: AllowedPeers,
) -> Result<SocketFile, ZdsError> {
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
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(sock_err)?;
    bind_private(&fd, path)?;
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
                match peer_of(&client) {
                    Ok((uid, _)) if allowed.allows(uid) => {}
                    Ok((uid, pid)) => {
                        tracing::warn!(uid, pid, "enrolment client refused: not root and not an --enrol-uid");
                        refuse(&client, &format!("enrolment refused: uid {uid} is not root and not allowed by --enrol-uid"));
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "enrolment client refused: its credentials cannot be read");
                        continue;
                    }
                }
                // Counted and logged by the limit; the client is told why.
                let Some(place) = limits.enrol_client() else {
                    refuse(
                        &client,
                        &format!(
                            "too many enrolment clients ({} connected, --max-enrol-clients): try again later",
                            limits.limits().enrol_clients
                        ),
                    );
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

/// Answers a refused client (over the limit, or not allowed) with an `ack`
/// saying why (it reads it as the answer to its first request), then the
/// caller closes the connection. The send never blocks the accept thread:
/// an answer that does not fit in the socket buffer (a client flooding us)
/// is dropped, the close still says enough.
fn refuse(client: &OwnedFd, why: &str) {
    let payload = wire::ack_bytes(why);
    let _ = sendmsg::<()>(
        client.as_raw_fd(),
        &[std::io::IoSlice::new(&payload)],
        &[],
        MsgFlags::MSG_DONTWAIT,
        None,
    );
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn only_root_and_the_listed_uids_are_allowed() {
        let none = AllowedPeers::default();
        assert!(none.allows(0));
        assert!(!none.allows(1000));
        let some = AllowedPeers { uids: vec![1000] };
        assert!(some.allows(0) && some.allows(1000));
        assert!(!some.allows(65534));
    }

    #[test]
    fn the_socket_file_is_private_from_the_start() {
        let dir = std::env::temp_dir().join(format!("zt-enrol-mode-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("ztunnel.sock");
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .expect("socket");
        bind_private(&fd, &path).expect("bind");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, SOCKET_MODE, "{mode:o}");
        // Nothing is left under the temporary name.
        let names: Vec<_> = std::fs::read_dir(&dir)
            .expect("read_dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(names, vec![std::ffi::OsString::from("ztunnel.sock")]);
    }
}
