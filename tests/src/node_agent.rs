//! A test node agent that speaks ZDS the way Istio's istio-cni does.
//!
//! It listens on a `SOCK_SEQPACKET` socket; ztunnel dials it. On each new
//! connection it reads the hello, sends every pod it knows (`add` with the
//! netns fd, waiting for each ack) and `snapshot_sent`. Later `add`s go to
//! the newest connection only, `del`s to every connection. An idle
//! connection gets a 10 ms read every 5 s, which is how istio-cni notices a
//! ztunnel that went away.
//!
//! The messages are encoded here by hand from Istio's field numbers, not
//! with ztunnel's generated code: a number that drifted in ztunnel's
//! `.proto` would make both sides agree with each other and disagree with
//! Istio, and this agent is the other side.

use std::{
    collections::BTreeMap,
    io::{IoSlice, IoSliceMut},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use nix::sys::socket::{
    AddressFamily, Backlog, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, accept, bind,
    listen, recvmsg, sendmsg, setsockopt, socket, sockopt,
};

/// How long the agent waits for an ack (ztunnel opens listeners and
/// attaches programs first).
const ACK_TIMEOUT: Duration = Duration::from_secs(20);

/// One pod as the agent knows it.
#[derive(Debug)]
pub struct AgentPod {
    /// Pod uid.
    pub uid: String,
    /// Pod name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Service account.
    pub service_account: String,
    /// The pod's netns (sent with every `add`).
    pub netns: PathBuf,
}

// ---- encoding, by hand, from Istio's zds.proto field numbers ----

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn field(number: u32, bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    varint(u64::from(number << 3 | 2), &mut out);
    varint(bytes.len() as u64, &mut out);
    out.extend_from_slice(bytes);
    out
}

/// `WorkloadRequest{add: AddWorkload{uid=1, workload_info=2{name=1,
/// namespace=2, service_account=3}}}`: `add` is field 1.
pub fn encode_add(pod: &AgentPod) -> Vec<u8> {
    let info = [
        field(1, pod.name.as_bytes()),
        field(2, pod.namespace.as_bytes()),
        field(3, pod.service_account.as_bytes()),
    ]
    .concat();
    field(1, &[field(1, pod.uid.as_bytes()), field(2, &info)].concat())
}

/// `WorkloadRequest{del: DelWorkload{uid=2}}`: `del` is field 2.
pub fn encode_del(uid: &str) -> Vec<u8> {
    field(2, &field(2, uid.as_bytes()))
}

/// `WorkloadRequest{keep: KeepWorkload{uid=1}}`: `keep` is field 5.
pub fn encode_keep(uid: &str) -> Vec<u8> {
    field(5, &field(1, uid.as_bytes()))
}

/// `WorkloadRequest{snapshot_sent: {}}`: field 3.
pub fn encode_snapshot_sent() -> Vec<u8> {
    field(3, &[])
}

/// The error of a `WorkloadResponse{ack: Ack{error=1}}` (empty: success),
/// or why the bytes are not one.
pub fn decode_ack(bytes: &[u8]) -> Result<String, String> {
    let inner = match bytes {
        [0x0a, len, rest @ ..] if usize::from(*len) == rest.len() => rest,
        // A length over 127 takes two varint bytes.
        [0x0a, lo, hi, rest @ ..]
            if lo & 0x80 != 0 && (usize::from(lo & 0x7f) | usize::from(*hi) << 7) == rest.len() =>
        {
            rest
        }
        _ => return Err(format!("not a WorkloadResponse with an ack: {bytes:02x?}")),
    };
    match inner {
        [] => Ok(String::new()),
        [0x0a, len, text @ ..] if usize::from(*len) == text.len() => {
            Ok(String::from_utf8_lossy(text).into_owned())
        }
        [0x0a, lo, hi, text @ ..]
            if lo & 0x80 != 0 && (usize::from(lo & 0x7f) | usize::from(*hi) << 7) == text.len() =>
        {
            Ok(String::from_utf8_lossy(text).into_owned())
        }
        _ => Err(format!("ack with unexpected fields: {inner:02x?}")),
    }
}

// ---- the agent ----

/// One connection from a ztunnel.
#[derive(Debug)]
struct Conn {
    fd: OwnedFd,
}

#[derive(Debug, Default)]
struct AgentState {
    pods: BTreeMap<String, AgentPod>,
    /// Oldest first.
    conns: Vec<Conn>,
    /// Every hello received, in order.
    hellos: Vec<Vec<u8>>,
    /// Every ack received, in order (for assertions).
    acks: Vec<String>,
}

/// The agent. Dropping it closes its socket and every connection.
#[derive(Debug)]
pub struct NodeAgent {
    path: PathBuf,
    state: Arc<Mutex<AgentState>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn send_packet(fd: RawFd, bytes: &[u8], pass: Option<RawFd>) -> nix::Result<()> {
    let fds;
    let cmsgs: Vec<ControlMessage<'_>> = match pass {
        Some(f) => {
            fds = [f];
            vec![ControlMessage::ScmRights(&fds)]
        }
        None => Vec::new(),
    };
    sendmsg::<()>(fd, &[IoSlice::new(bytes)], &cmsgs, MsgFlags::empty(), None).map(|_| ())
}

/// One packet, waiting at most `limit` (`Ok(None)`: the peer closed).
fn receive(fd: &OwnedFd, limit: Duration) -> nix::Result<Option<Vec<u8>>> {
    let tv = nix::sys::time::TimeVal::new(
        limit.as_secs() as i64,
        i64::from(limit.subsec_micros().max(1)),
    );
    setsockopt(fd, sockopt::ReceiveTimeout, &tv)?;
    let mut buf = vec![0u8; 1024];
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(fd.as_raw_fd(), &mut iov, None, MsgFlags::empty())?;
    let n = msg.bytes;
    if n == 0 {
        return Ok(None);
    }
    buf.truncate(n);
    Ok(Some(buf))
}

/// Sends `bytes` (with the netns of `pod`, if given) and returns the ack's
/// error.
fn request(conn: &Conn, bytes: &[u8], netns: Option<&Path>) -> Result<String, String> {
    let file = netns
        .map(|p| std::fs::File::open(p).map_err(|e| format!("open {}: {e}", p.display())))
        .transpose()?;
    send_packet(
        conn.fd.as_raw_fd(),
        bytes,
        file.as_ref().map(AsRawFd::as_raw_fd),
    )
    .map_err(|e| format!("send: {e}"))?;
    match receive(&conn.fd, ACK_TIMEOUT) {
        Ok(Some(answer)) => decode_ack(&answer),
        Ok(None) => Err("ztunnel closed the connection".into()),
        Err(e) => Err(format!("no ack: {e}")),
    }
}

impl NodeAgent {
    /// Listens on `path` (removed first if left over) with `pods` as the
    /// initial snapshot.
    pub fn start(path: &Path, pods: Vec<AgentPod>) -> Self {
        let _ = std::fs::remove_file(path);
        let listener = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )
        .expect("agent socket");
        bind(
            listener.as_raw_fd(),
            &UnixAddr::new(path).expect("agent path"),
        )
        .expect("bind agent socket");
        listen(&listener, Backlog::new(16).expect("backlog")).expect("listen");
        let state = Arc::new(Mutex::new(AgentState {
            pods: pods.into_iter().map(|p| (p.uid.clone(), p)).collect(),
            ..AgentState::default()
        }));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let (state, stop) = (Arc::clone(&state), Arc::clone(&stop));
            std::thread::spawn(move || serve(&listener, &state, &stop))
        };
        Self {
            path: path.to_path_buf(),
            state,
            stop,
            thread: Some(thread),
        }
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Adds a pod and sends it to the newest connection; the ack's error.
    pub fn add(&self, pod: AgentPod) -> Result<String, String> {
        let mut state = self.state.lock().expect("agent state");
        let bytes = encode_add(&pod);
        let netns = pod.netns.clone();
        state.pods.insert(pod.uid.clone(), pod);
        let conn = state.conns.last().ok_or("no ztunnel connected")?;
        let ack = request(conn, &bytes, Some(&netns))?;
        state.acks.push(ack.clone());
        Ok(ack)
    }

    /// Removes a pod and tells every connection; the acks' errors.
    pub fn del(&self, uid: &str) -> Vec<Result<String, String>> {
        let mut state = self.state.lock().expect("agent state");
        state.pods.remove(uid);
        let acks: Vec<_> = state
            .conns
            .iter()
            .map(|c| request(c, &encode_del(uid), None))
            .collect();
        state.acks.extend(acks.iter().flatten().cloned());
        acks
    }

    /// Sends raw bytes (a crafted request) to the newest connection, with
    /// `netns` attached if given: the ack's error, or what happened.
    pub fn send_raw(&self, bytes: &[u8], netns: Option<&Path>) -> Result<String, String> {
        let state = self.state.lock().expect("agent state");
        let conn = state.conns.last().ok_or("no ztunnel connected")?;
        request(conn, bytes, netns)
    }

    /// Every hello received so far (one per connection).
    pub fn hellos(&self) -> Vec<Vec<u8>> {
        self.state.lock().expect("agent state").hellos.clone()
    }

    /// Open connections.
    pub fn connections(&self) -> usize {
        self.state.lock().expect("agent state").conns.len()
    }

    /// Waits until `n` hellos have arrived (a connection each), at most
    /// `limit`.
    pub fn wait_for_hellos(&self, n: usize, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.hellos().len() < n {
            assert!(
                Instant::now() < deadline,
                "ztunnel did not connect {n} time(s) within {limit:?} (hellos: {:02x?})",
                self.hellos()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// How often an idle connection is checked, and how long the check reads.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(5);
const KEEPALIVE_READ: Duration = Duration::from_millis(10);

fn serve(listener: &OwnedFd, state: &Mutex<AgentState>, stop: &std::sync::atomic::AtomicBool) {
    let mut last_keepalive = Instant::now();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        match accept(listener.as_raw_fd()) {
            Ok(fd) => {
                // SAFETY: accept returned a fresh fd that we own.
                let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                let _ = nix::fcntl::fcntl(
                    &fd,
                    nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
                );
                let mut s = state.lock().expect("agent state");
                let hello = receive(&fd, Duration::from_secs(5))
                    .ok()
                    .flatten()
                    .unwrap_or_default();
                s.hellos.push(hello);
                let conn = Conn { fd };
                // The snapshot: every pod, then snapshot_sent, each acked.
                let mut ok = true;
                let pods: Vec<(Vec<u8>, PathBuf)> = s
                    .pods
                    .values()
                    .map(|p| (encode_add(p), p.netns.clone()))
                    .collect();
                for (bytes, netns) in pods {
                    match request(&conn, &bytes, Some(&netns)) {
                        Ok(ack) => s.acks.push(ack),
                        Err(_) => ok = false,
                    }
                }
                if ok && let Ok(ack) = request(&conn, &encode_snapshot_sent(), None) {
                    s.acks.push(ack);
                    s.conns.push(conn);
                }
            }
            Err(nix::Error::EAGAIN) => std::thread::sleep(Duration::from_millis(10)),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
        if last_keepalive.elapsed() >= KEEPALIVE_EVERY {
            last_keepalive = Instant::now();
            let mut s = state.lock().expect("agent state");
            // A read that returns 0 bytes (or fails other than by timing
            // out) means ztunnel closed: drop the connection.
            s.conns
                .retain(|c| matches!(receive(&c.fd, KEEPALIVE_READ), Err(nix::Error::EAGAIN)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_encoding_matches_istios_numbers() {
        assert_eq!(encode_del("u1"), [0x12, 0x04, 0x12, 0x02, b'u', b'1']);
        assert_eq!(encode_keep("u1"), [0x2a, 0x04, 0x0a, 0x02, b'u', b'1']);
        assert_eq!(encode_snapshot_sent(), [0x1a, 0x00]);
        assert_eq!(decode_ack(&[0x0a, 0x00]), Ok(String::new()));
        assert_eq!(decode_ack(&[0x0a, 0x03, 0x0a, 0x01, b'x']), Ok("x".into()));
        assert!(decode_ack(&[0x12, 0x00]).is_err());
    }
}
