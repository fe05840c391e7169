//! The enrolment socket.
//!
//! Messages follow Istio's ZDS protocol (same message shapes and field
//! numbers, decoded with prost), so that Istio's CNI agent can later drive
//! us: `add` (uid, workload info, and the pod's netns fd as `SCM_RIGHTS`;
//! an `add` whose workload info lacks the namespace or service account is
//! refused, since those make the pod's identity),
//! `keep` (still there), `del`, and `snapshot_sent` (everything not added or
//! kept on this connection so far is removed). Every request is answered
//! with an `ack`, whose `error` is empty on success.
//!
//! Transport: a `SOCK_SEQPACKET` unix socket (one message per packet, fds
//! travel with it), default `/var/run/ztunnel/ztunnel.sock`. In Istio the
//! node agent listens and ztunnel dials; here ztunnel listens so that a CNI
//! plugin or the `ztunnel enrol` command can reach the running daemon. The
//! message handling is independent of who dials.

use std::{
    collections::HashSet,
    io::{IoSlice, IoSliceMut},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use nix::sys::socket::{
    AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
    UnixAddr, accept, bind, connect, listen, recvmsg, sendmsg, setsockopt, socket, sockopt,
};
use prost::Message as _;

use super::{EnrolRequest, PodRegistry, Source};
use crate::{
    accept::{AcceptErrors, ListenerKind},
    netns::PodNetns,
    state::CaptureOptOut,
};

/// Default path of the enrolment socket.
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";
/// Largest message accepted (requests are a few hundred bytes).
const MAX_MESSAGE: usize = 64 * 1024;
/// How long a client ([`request`]) waits for each step: connecting (a
/// full backlog), each send and each answer. One enrolment takes well
/// under a second; a daemon that has not answered in 10 s is stuck, and
/// the caller (a pod's sandbox creation, an operator) must hear so rather
/// than hang.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Workload metadata sent with `add`.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct WorkloadInfo {
    /// Pod name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Kubernetes namespace.
    #[prost(string, tag = "2")]
    pub namespace: String,
    /// Service account.
    #[prost(string, tag = "3")]
    pub service_account: String,
}

/// Enrol a pod; its netns fd travels as `SCM_RIGHTS`.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct AddWorkload {
    /// Pod uid.
    #[prost(string, tag = "1")]
    pub uid: String,
    /// Metadata.
    #[prost(message, optional, tag = "2")]
    pub workload_info: Option<WorkloadInfo>,
}

/// The pod is still there (reconnect/snapshot).
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct KeepWorkload {
    /// Pod uid.
    #[prost(string, tag = "1")]
    pub uid: String,
}

/// Remove a pod.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct DelWorkload {
    /// Pod uid.
    #[prost(string, tag = "1")]
    pub uid: String,
}

/// Every current pod has been sent on this connection.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct SnapshotSent {}

/// One request.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct WorkloadRequest {
    /// What is asked.
    #[prost(oneof = "workload_request::Payload", tags = "1, 2, 3, 5")]
    pub payload: Option<workload_request::Payload>,
}

/// The request variants.
pub mod workload_request {
    /// What is asked.
    #[derive(Clone, PartialEq, Eq, prost::Oneof)]
    pub enum Payload {
        /// Enrol.
        #[prost(message, tag = "1")]
        Add(super::AddWorkload),
        /// Remove.
        #[prost(message, tag = "2")]
        Del(super::DelWorkload),
        /// Snapshot complete.
        #[prost(message, tag = "3")]
        SnapshotSent(super::SnapshotSent),
        /// Still present.
        #[prost(message, tag = "5")]
        Keep(super::KeepWorkload),
    }
}

/// Acknowledgement; `error` is empty on success.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct Ack {
    /// What went wrong, or empty.
    #[prost(string, tag = "1")]
    pub error: String,
}

/// One response.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct WorkloadResponse {
    /// The answer.
    #[prost(oneof = "workload_response::Payload", tags = "1")]
    pub payload: Option<workload_response::Payload>,
}

/// The response variants.
pub mod workload_response {
    /// The answer.
    #[derive(Clone, PartialEq, Eq, prost::Oneof)]
    pub enum Payload {
        /// Acknowledgement.
        #[prost(message, tag = "1")]
        Ack(super::Ack),
    }
}

/// Errors of the enrolment socket.
#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    /// Socket setup or I/O.
    #[error("enrolment socket {path}: {source}")]
    Socket {
        /// The socket path.
        path: PathBuf,
        /// The OS error.
        source: nix::Error,
    },
    /// Creating the socket's folder failed.
    #[error("cannot create {path}: {source}")]
    Dir {
        /// The folder.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The peer sent something that is not a `WorkloadRequest`.
    #[error("malformed enrolment message: {0}")]
    Decode(#[from] prost::DecodeError),
    /// The daemon refused the request.
    #[error("ztunnel refused: {0}")]
    Refused(String),
    /// The peer closed the connection early.
    #[error("connection closed before an answer")]
    Closed,
    /// The daemon did not accept, take or answer a request in time.
    #[error("enrolment socket {path}: no answer within {after:?}")]
    Timeout {
        /// The socket path.
        path: PathBuf,
        /// The bound that ran out.
        after: Duration,
    },
}

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
    /// exits; removing that would cut the node agent off from it.
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
                        serve_client(&client, &registry);
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
    let response = WorkloadResponse {
        payload: Some(workload_response::Payload::Ack(Ack {
            error: format!(
                "too many enrolment clients ({max} connected, --max-enrol-clients): try again later"
            ),
        })),
    };
    let payload = response.encode_to_vec();
    let _ = sendmsg::<()>(
        client.as_raw_fd(),
        &[IoSlice::new(&payload)],
        &[],
        MsgFlags::MSG_DONTWAIT,
        None,
    );
}

/// One received packet and the fd that came with it, if any.
type Packet = (Vec<u8>, Option<OwnedFd>);

/// Receives one packet and at most one fd (`None` at end of stream).
fn receive(fd: RawFd) -> Result<Option<Packet>, nix::Error> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut cmsg = nix::cmsg_space!([RawFd; 4]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(fd, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut received: Vec<OwnedFd> = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            // SAFETY: the kernel installed these fds for us; we own them now.
            received.extend(fds.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
        }
    }
    let len = msg.bytes;
    if len == 0 {
        return Ok(None);
    }
    buf.truncate(len);
    // Extra fds (a confused or hostile peer) are closed when dropped here.
    let first = if received.is_empty() {
        None
    } else {
        Some(received.remove(0))
    };
    Ok(Some((buf, first)))
}

fn send(fd: RawFd, payload: &[u8], pass: Option<RawFd>) -> Result<(), nix::Error> {
    let iov = [IoSlice::new(payload)];
    let fds;
    let cmsgs: Vec<ControlMessage<'_>> = match pass {
        Some(f) => {
            fds = [f];
            vec![ControlMessage::ScmRights(&fds)]
        }
        None => Vec::new(),
    };
    sendmsg::<()>(fd, &iov, &cmsgs, MsgFlags::empty(), None)?;
    Ok(())
}

fn serve_client(client: &OwnedFd, registry: &PodRegistry) {
    let mut seen: HashSet<String> = HashSet::new();
    loop {
        let (bytes, fd) = match receive(client.as_raw_fd()) {
            Ok(Some(received)) => received,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "enrolment receive failed");
                return;
            }
        };
        let error = match WorkloadRequest::decode(bytes.as_slice()) {
            Ok(request) => handle(request, fd, registry, &mut seen)
                .err()
                .unwrap_or_default(),
            Err(e) => format!("malformed enrolment message (expected a ZDS WorkloadRequest): {e}"),
        };
        if !error.is_empty() {
            tracing::warn!(%error, "enrolment request refused");
        }
        let response = WorkloadResponse {
            payload: Some(workload_response::Payload::Ack(Ack { error })),
        };
        if send(client.as_raw_fd(), &response.encode_to_vec(), None).is_err() {
            return;
        }
    }
}

fn handle(
    request: WorkloadRequest,
    fd: Option<OwnedFd>,
    registry: &PodRegistry,
    seen: &mut HashSet<String>,
) -> Result<(), String> {
    use workload_request::Payload;
    match request.payload {
        Some(Payload::Add(add)) => {
            let (info, fd) = check_add(&add, fd)?;
            let pod_name = if info.name.is_empty() {
                &add.uid
            } else {
                &info.name
            };
            let name = format!("{}/{pod_name}", info.namespace);
            let identity = registry
                .identity_for(&add.uid, &info.namespace, &info.service_account)
                .ok_or_else(|| {
                    format!(
                        "add {}: no identity (workload info lacks namespace or service account)",
                        add.uid
                    )
                })?;
            // Checked before anything enters it, so that the error names
            // what was sent (a file, another namespace type).
            let netns =
                PodNetns::checked_from_fd(name, fd).map_err(|e| format!("add {}: {e}", add.uid))?;
            seen.insert(add.uid.clone());
            registry
                .enrol(EnrolRequest {
                    uid: add.uid,
                    netns,
                    capture: CaptureOptOut::default(),
                    identity,
                    source: Source::Socket,
                })
                .map(|_| ())
                .map_err(|e| e.to_string())
        }
        Some(Payload::Keep(keep)) => {
            seen.insert(keep.uid);
            Ok(())
        }
        Some(Payload::Del(del)) => registry
            .remove(&del.uid)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        Some(Payload::SnapshotSent(_)) => {
            let removed = registry
                .reconcile(Source::Socket, seen)
                .map_err(|e| e.to_string())?;
            if !removed.is_empty() {
                tracing::info!(?removed, "snapshot reconciled: removed pods not re-sent");
            }
            Ok(())
        }
        None => Err("empty request".into()),
    }
}

/// Checks an `add` as far as it can be without the registry: a uid, the
/// network namespace fd (`F`: an `OwnedFd` in the daemon; the fuzz target
/// passes a stand-in) and complete workload information. The error is the
/// `ack` the enroller gets. Pure, so that the fuzz target checks the real
/// rules.
pub fn check_add<F>(add: &AddWorkload, fd: Option<F>) -> Result<(&WorkloadInfo, F), String> {
    if add.uid.is_empty() {
        return Err("add: uid is empty".into());
    }
    let fd = fd.ok_or_else(|| {
        format!(
            "add {}: no network namespace fd (SCM_RIGHTS) attached",
            add.uid
        )
    })?;
    Ok((workload_info(add)?, fd))
}

/// The workload information of an `add`, which must name the namespace and
/// service account: they make the pod's identity, and guessing them (say,
/// `default/default`) would hand the pod a certificate, and the policies,
/// of another workload. The error names the pod and what is missing.
fn workload_info(add: &AddWorkload) -> Result<&WorkloadInfo, String> {
    let info = add.workload_info.as_ref().ok_or_else(|| {
        format!(
            "add {}: workload_info is missing (namespace and service account are required)",
            add.uid
        )
    })?;
    let missing: Vec<&str> = [
        ("workload_info.namespace", &info.namespace),
        ("workload_info.service_account", &info.service_account),
    ]
    .into_iter()
    .filter(|(_, value)| value.trim().is_empty())
    .map(|(field, _)| field)
    .collect();
    if !missing.is_empty() {
        return Err(format!(
            "add {}: {} must not be empty",
            add.uid,
            missing.join(" and ")
        ));
    }
    // Both are path segments of the SPIFFE id: a `/` in one would make an
    // identity that peers cannot parse back, or that reads as another
    // (namespace `a/sa/b` + account `c` and namespace `a` + account
    // `b/sa/c` would share one certificate name). Found by fuzzing.
    let slashed: Vec<&str> = [
        ("workload_info.namespace", &info.namespace),
        ("workload_info.service_account", &info.service_account),
    ]
    .into_iter()
    .filter(|(_, value)| value.contains('/'))
    .map(|(field, _)| field)
    .collect();
    if slashed.is_empty() {
        Ok(info)
    } else {
        Err(format!(
            "add {}: {} must not contain '/' (it separates the SPIFFE id's segments)",
            add.uid,
            slashed.join(" and ")
        ))
    }
}

/// Receives the daemon's answer. A daemon that refused us (too many
/// clients) answers and closes; if our request was still unread then,
/// Linux reports `ECONNRESET` on the first receive, ahead of the answer
/// still queued behind it (the error is consumed by that receive), so the
/// answer is read with a second one.
fn receive_answer(fd: RawFd) -> Result<Option<Packet>, nix::Error> {
    match receive(fd) {
        Err(nix::Error::ECONNRESET) => receive(fd),
        other => other,
    }
}

/// Client side (used by `ztunnel enrol`): sends requests in order on one
/// connection and returns the first refusal, if any. Each step waits at
/// most [`CLIENT_TIMEOUT`].
pub fn request(
    path: &Path,
    requests: Vec<(WorkloadRequest, Option<OwnedFd>)>,
) -> Result<(), ZdsError> {
    request_within(path, requests, CLIENT_TIMEOUT)
}

/// [`request`] with each step (connect, every send, every answer) bounded
/// by `timeout` (`SO_SNDTIMEO` bounds a unix socket's connect and sends,
/// `SO_RCVTIMEO` the receives).
pub fn request_within(
    path: &Path,
    requests: Vec<(WorkloadRequest, Option<OwnedFd>)>,
    timeout: Duration,
) -> Result<(), ZdsError> {
    let sock_err = |source| match source {
        nix::Error::EAGAIN => ZdsError::Timeout {
            path: path.to_path_buf(),
            after: timeout,
        },
        source => ZdsError::Socket {
            path: path.to_path_buf(),
            source,
        },
    };
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(sock_err)?;
    // A zero timeval would mean "wait forever": at least 1 µs.
    let micros = timeout.as_micros().max(1);
    let timeval = nix::sys::time::TimeVal::new(
        (micros / 1_000_000) as libc::time_t,
        (micros % 1_000_000) as libc::suseconds_t,
    );
    setsockopt(&fd, sockopt::SendTimeout, &timeval).map_err(sock_err)?;
    setsockopt(&fd, sockopt::ReceiveTimeout, &timeval).map_err(sock_err)?;
    connect(fd.as_raw_fd(), &UnixAddr::new(path).map_err(sock_err)?).map_err(sock_err)?;
    for (req, pass) in requests {
        let sent = send(
            fd.as_raw_fd(),
            &req.encode_to_vec(),
            pass.as_ref().map(AsRawFd::as_raw_fd),
        );
        // A daemon that refused us (too many clients) answered and closed
        // before our request went out: its answer is still there to read,
        // and says more than EPIPE.
        if let Err(e) = sent {
            if e == nix::Error::EAGAIN {
                return Err(sock_err(e));
            }
            return match receive_answer(fd.as_raw_fd()) {
                Ok(Some((bytes, _))) => match WorkloadResponse::decode(bytes.as_slice())?.payload {
                    Some(workload_response::Payload::Ack(ack)) if !ack.error.is_empty() => {
                        Err(ZdsError::Refused(ack.error))
                    }
                    _ => Err(sock_err(e)),
                },
                _ => Err(sock_err(e)),
            };
        }
        let (bytes, _) = receive_answer(fd.as_raw_fd())
            .map_err(sock_err)?
            .ok_or(ZdsError::Closed)?;
        let response = WorkloadResponse::decode(bytes.as_slice())?;
        let Some(workload_response::Payload::Ack(ack)) = response.payload else {
            return Err(ZdsError::Closed);
        };
        if !ack.error.is_empty() {
            return Err(ZdsError::Refused(ack.error));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_with_istio_field_numbers() {
        let req = WorkloadRequest {
            payload: Some(workload_request::Payload::Keep(KeepWorkload {
                uid: "u1".into(),
            })),
        };
        let bytes = req.encode_to_vec();
        // Field 5 (keep), wire type 2: tag byte 0x2a.
        assert_eq!(bytes[0], 0x2a);
        assert_eq!(
            WorkloadRequest::decode(bytes.as_slice()).expect("decode"),
            req
        );
    }

    fn add(info: Option<WorkloadInfo>) -> AddWorkload {
        AddWorkload {
            uid: "pod-7".into(),
            workload_info: info,
        }
    }

    #[test]
    fn an_add_without_workload_info_is_refused_naming_the_pod_and_field() {
        let err = workload_info(&add(None)).expect_err("no workload info");
        assert!(
            err.contains("pod-7") && err.contains("workload_info is missing"),
            "{err}"
        );
        let err = workload_info(&add(Some(WorkloadInfo {
            name: "web".into(),
            namespace: "demo".into(),
            service_account: String::new(),
        })))
        .expect_err("no service account");
        assert!(
            err.contains("pod-7") && err.contains("workload_info.service_account"),
            "{err}"
        );
        assert!(!err.contains("workload_info.namespace"), "{err}");
        let err = workload_info(&add(Some(WorkloadInfo::default()))).expect_err("nothing");
        assert!(
            err.contains("workload_info.namespace and workload_info.service_account"),
            "{err}"
        );
        let full = add(Some(WorkloadInfo {
            name: "web".into(),
            namespace: "demo".into(),
            service_account: "web".into(),
        }));
        assert_eq!(workload_info(&full).expect("complete").namespace, "demo");
    }

    #[test]
    fn a_slash_in_namespace_or_service_account_is_refused() {
        // Regression (fuzz target zds_message): namespace `dem/` was
        // accepted and made the unparsable identity
        // spiffe://cluster.local/ns/dem//sa/a1.
        for (namespace, service_account, field) in [
            ("dem/", "a1", "workload_info.namespace"),
            ("demo", "a/sa/b", "workload_info.service_account"),
        ] {
            let err = workload_info(&add(Some(WorkloadInfo {
                name: "web".into(),
                namespace: namespace.into(),
                service_account: service_account.into(),
            })))
            .expect_err("slash");
            assert!(
                err.contains("pod-7") && err.contains(field) && err.contains("'/'"),
                "{err}"
            );
        }
    }

    #[test]
    fn a_client_waits_no_longer_than_its_timeout() {
        let dir = std::env::temp_dir().join(format!("zds-timeout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("z.sock");
        let _ = std::fs::remove_file(&path);
        // Listening but never accepting: the connect completes (backlog),
        // the request is queued, and no answer ever comes.
        let listener = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .expect("socket");
        bind(listener.as_raw_fd(), &UnixAddr::new(&path).expect("addr")).expect("bind");
        listen(&listener, Backlog::new(4).expect("backlog")).expect("listen");
        let keep = WorkloadRequest {
            payload: Some(workload_request::Payload::Keep(KeepWorkload {
                uid: "u".into(),
            })),
        };
        let start = std::time::Instant::now();
        let err = request_within(
            &path,
            vec![(keep.clone(), None)],
            Duration::from_millis(200),
        )
        .expect_err("no answer");
        assert!(matches!(err, ZdsError::Timeout { .. }), "{err}");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        drop(listener);
        let _ = std::fs::remove_file(&path);
        let err = request_within(&path, vec![(keep, None)], Duration::from_millis(200))
            .expect_err("no socket");
        assert!(
            matches!(
                err,
                ZdsError::Socket {
                    source: nix::Error::ENOENT,
                    ..
                }
            ),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn garbage_is_a_decode_error_not_a_panic() {
        assert!(WorkloadRequest::decode(&[0xff, 0xff, 0xff][..]).is_err());
    }
}
