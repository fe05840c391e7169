//! Packets on a `SOCK_SEQPACKET` unix socket, with the fds that travel
//! alongside (`SCM_RIGHTS`).

use std::{
    io::{IoSlice, IoSliceMut},
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
    time::Duration,
};

use nix::{
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg},
};
use prost::Message as _;

use super::{WorkloadResponse, ack};

/// Largest request accepted (requests are a few hundred bytes).
const MAX_MESSAGE: usize = 64 * 1024;

/// Largest response: Istio's node agent reads answers into a 1024-byte
/// buffer, so a longer one would be cut and fail to decode there.
pub const MAX_RESPONSE: usize = 1024;

/// At most this many fds are taken from one packet; more is a protocol
/// error (they are closed).
const MAX_FDS: usize = 4;

/// One received packet and the fds that came with it.
#[derive(Debug)]
pub struct Packet {
    /// The message bytes.
    pub bytes: Vec<u8>,
    /// The fds, in order.
    pub fds: Vec<OwnedFd>,
}

/// Receives one packet (`None` at end of stream).
pub fn receive(fd: RawFd) -> Result<Option<Packet>, nix::Error> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(fd, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut fds: Vec<OwnedFd> = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(received) = c {
            // SAFETY: the kernel installed these fds for us; we own them now.
            fds.extend(
                received
                    .into_iter()
                    .map(|f| unsafe { OwnedFd::from_raw_fd(f) }),
            );
        }
    }
    let len = msg.bytes;
    if len == 0 && fds.is_empty() {
        return Ok(None);
    }
    buf.truncate(len);
    Ok(Some(Packet { bytes: buf, fds }))
}

/// Waits up to `limit` for `fd` to have something to read (a packet or the
/// end of the stream). `false` on timeout.
pub fn readable(fd: BorrowedFd<'_>, limit: Duration) -> Result<bool, nix::Error> {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    let ms = PollTimeout::try_from(limit).unwrap_or(PollTimeout::MAX);
    loop {
        match poll(&mut fds, ms) {
            Ok(n) => return Ok(n > 0),
            Err(nix::Error::EINTR) => {}
            Err(e) => return Err(e),
        }
    }
}

/// Sends one packet, with `pass` attached.
pub fn send(fd: RawFd, payload: &[u8], pass: Option<RawFd>) -> Result<(), nix::Error> {
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

/// The bytes of an `ack`, its error cut (at a character boundary, with a
/// marker) so that the whole response fits in [`MAX_RESPONSE`].
pub fn ack_bytes(error: &str) -> Vec<u8> {
    const MARK: &str = " [...]";
    // Tags and two lengths of up to two bytes each.
    const OVERHEAD: usize = 6;
    let mut text = error.to_owned();
    if text.len() + OVERHEAD > MAX_RESPONSE {
        let mut cut = MAX_RESPONSE - OVERHEAD - MARK.len();
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str(MARK);
    }
    let bytes = ack(text).encode_to_vec();
    debug_assert!(bytes.len() <= MAX_RESPONSE);
    bytes
}

/// Sends an `ack` on `fd`.
pub fn send_ack(fd: &impl AsRawFd, error: &str) -> Result<(), nix::Error> {
    send(fd.as_raw_fd(), &ack_bytes(error), None)
}

/// Decodes a response.
pub fn decode_response(bytes: &[u8]) -> Result<WorkloadResponse, prost::DecodeError> {
    WorkloadResponse::decode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_error_is_cut_to_fit_the_node_agents_buffer() {
        let long = "é".repeat(2000);
        let bytes = ack_bytes(&long);
        assert!(bytes.len() <= MAX_RESPONSE, "{}", bytes.len());
        let response = decode_response(&bytes).expect("decodes");
        let Some(super::super::workload_response::Payload::Ack(a)) = response.payload else {
            panic!("no ack");
        };
        assert!(a.error.ends_with("[...]") && a.error.starts_with("éé"));
        assert_eq!(ack_bytes("short"), ack("short".into()).encode_to_vec());
    }
}
