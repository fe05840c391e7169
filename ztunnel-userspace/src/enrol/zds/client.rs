//! The client side of the listening socket: `ztunnel enrol` and our CNI
//! plugin send requests in order on one connection and stop at the first
//! refusal.

use std::{
    os::fd::{AsRawFd, OwnedFd, RawFd},
    path::Path,
    time::Duration,
};

use nix::sys::socket::{
    AddressFamily, SockFlag, SockType, UnixAddr, connect, setsockopt, socket, sockopt,
};
use prost::Message as _;

use super::{WorkloadRequest, ZdsError, wire, workload_response};

/// How long a client ([`request`]) waits for each step: connecting (a
/// full backlog), each send and each answer. One enrolment takes well
/// under a second; a daemon that has not answered in 10 s is stuck, and
/// the caller (a pod's sandbox creation, an operator) must hear so rather
/// than hang.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Receives the daemon's answer. A daemon that refused us (too many
/// clients) answers and closes; if our request was still unread then,
/// Linux reports `ECONNRESET` on the first receive, ahead of the answer
/// still queued behind it (the error is consumed by that receive), so the
/// answer is read with a second one.
fn receive_answer(fd: RawFd) -> Result<Option<wire::Packet>, nix::Error> {
    match wire::receive(fd) {
        Err(nix::Error::ECONNRESET) => wire::receive(fd),
        other => other,
    }
}

/// Sends `requests` in order on one connection to the socket at `path`,
/// each with its fd, and returns the first refusal, if any. Each step
/// waits at most [`CLIENT_TIMEOUT`].
pub fn request(
    path: &Path,
    requests: Vec<(WorkloadRequest, Option<OwnedFd>)>,
) -> Result<(), ZdsError> {
    request_within(path, requests, CLIENT_TIMEOUT)
}

/// [`request`] with each step (connect, every send, every answer) bounded
/// by `limit` (`SO_SNDTIMEO` bounds a unix socket's connect and sends,
/// `SO_RCVTIMEO` the receives).
pub fn request_within(
    path: &Path,
    requests: Vec<(WorkloadRequest, Option<OwnedFd>)>,
    limit: Duration,
) -> Result<(), ZdsError> {
    let sock_err = |source| match source {
        nix::Error::EAGAIN => ZdsError::Timeout {
            path: path.to_path_buf(),
            after: limit,
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
    let micros = limit.as_micros().max(1);
    let timeval = nix::sys::time::TimeVal::new(
        (micros / 1_000_000) as libc::time_t,
        (micros % 1_000_000) as libc::suseconds_t,
    );
    setsockopt(&fd, sockopt::SendTimeout, &timeval).map_err(sock_err)?;
    setsockopt(&fd, sockopt::ReceiveTimeout, &timeval).map_err(sock_err)?;
    connect(fd.as_raw_fd(), &UnixAddr::new(path).map_err(sock_err)?).map_err(sock_err)?;
    for (req, pass) in requests {
        let sent = wire::send(
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
                Ok(Some(packet)) => match wire::decode_response(&packet.bytes)?.payload {
                    Some(workload_response::Payload::Ack(ack)) if !ack.error.is_empty() => {
                        Err(ZdsError::Refused(ack.error))
                    }
                    _ => Err(sock_err(e)),
                },
                _ => Err(sock_err(e)),
            };
        }
        let packet = receive_answer(fd.as_raw_fd())
            .map_err(sock_err)?
            .ok_or(ZdsError::Closed)?;
        let response = wire::decode_response(&packet.bytes)?;
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
    use nix::sys::socket::{Backlog, bind, listen};

    use super::*;
    use crate::enrol::zds::{KeepWorkload, workload_request};

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
}
