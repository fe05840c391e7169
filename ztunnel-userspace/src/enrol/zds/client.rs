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

/// How long a client waits for each answer (and for each send). An
/// enrolment opens listeners and attaches programs in the pod: well under a
/// second normally, seconds on a loaded node.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

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
/// each with its fd, and returns the first refusal, if any. Each answer is
/// awaited at most [`ANSWER_TIMEOUT`].
pub fn request(
    path: &Path,
    requests: Vec<(WorkloadRequest, Option<OwnedFd>)>,
) -> Result<(), ZdsError> {
    request_within(path, requests, ANSWER_TIMEOUT)
}

/// [`request`] with another time limit per answer.
pub fn request_within(
    path: &Path,
    requests: Vec<(WorkloadRequest, Option<OwnedFd>)>,
    limit: Duration,
) -> Result<(), ZdsError> {
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
    let timeval =
        nix::sys::time::TimeVal::new(limit.as_secs() as i64, i64::from(limit.subsec_micros()));
    setsockopt(&fd, sockopt::ReceiveTimeout, &timeval).map_err(sock_err)?;
    setsockopt(&fd, sockopt::SendTimeout, &timeval).map_err(sock_err)?;
    let timeout = |e: nix::Error| match e {
        nix::Error::EAGAIN => ZdsError::Timeout {
            path: path.to_path_buf(),
            seconds: limit.as_secs(),
        },
        other => sock_err(other),
    };
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
            return match receive_answer(fd.as_raw_fd()) {
                Ok(Some(packet)) => match wire::decode_response(&packet.bytes)?.payload {
                    Some(workload_response::Payload::Ack(ack)) if !ack.error.is_empty() => {
                        Err(ZdsError::Refused(ack.error))
                    }
                    _ => Err(timeout(e)),
                },
                _ => Err(timeout(e)),
            };
        }
        let packet = receive_answer(fd.as_raw_fd())
            .map_err(timeout)?
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
