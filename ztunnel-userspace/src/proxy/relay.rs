//! Bytes between two TCP sockets: passthrough, plaintext inbound (15006)
//! and the same-node fast path.
//!
//! Each direction starts by copying through a buffer that exists only while
//! its socket is readable, so an idle connection holds none. A direction
//! whose read fills that buffer is streaming: from then on it moves bytes
//! with `splice(2)` through a pipe of its own, and the kernel hands the
//! socket buffers' pages from one socket to the other without copying them
//! into ztunnel and back. Request/response traffic, whose reads are small,
//! never pays for a pipe (two descriptors and a syscall to make them).
//!
//! Pipes come from a node-wide budget ([`Pipes`], 1,024 by default): each
//! holds two descriptors and up to 256 KiB in flight, and a pod must not
//! be able to spend the node's descriptors by streaming on many
//! connections. Each pod (the client pod of an outbound or same-node
//! connection, the destination pod of a plaintext inbound one) may hold a
//! share of it (256 by default, a quarter), so one pod streaming into
//! peers that never read cannot leave the others copying. Without a pipe
//! (budget or share spent, descriptors exhausted) a direction keeps
//! copying. A direction gives its pipe back as soon as a
//! read is short again (the stream slowed down or turned into requests and
//! responses), so quiet connections hold none.
//!
//! Both modes count the same bytes, turn EOF into `shutdown(SHUT_WR)` on
//! the other socket (half-close) and fail the whole relay on an error of
//! either direction. The pipe is always emptied before the next read from
//! the socket, so the socket's read readiness is only cleared when the
//! socket itself has nothing, and back-pressure is the receiver's socket
//! buffer, as with a copy.

use std::{
    collections::HashMap,
    io,
    net::Shutdown,
    os::fd::{AsFd, OwnedFd},
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use bytes::BytesMut;
use nix::{
    errno::Errno,
    fcntl::{FcntlArg, OFlag, SpliceFFlags, fcntl, splice},
    unistd::pipe2,
};
use tokio::{io::Interest, net::TcpStream};

use crate::{limits::Limit, telemetry::Metrics};

/// Read size while copying; a read that fills it switches the direction to
/// splicing.
const CHUNK: usize = 16 * 1024;

/// Pipe capacity asked for (the kernel's default is 64 KiB): more bytes
/// per `splice()` call for streaming directions. The kernel may grant less
/// (the per-user pipe limits); whatever it grants works.
const PIPE_SIZE: usize = 256 * 1024;

/// Pipes the node's relays may hold at once.
pub const DEFAULT_PIPES: usize = 1024;
/// Pipes one pod's relays may hold at once: a quarter of the node's, as
/// for connections and handshakes.
pub const DEFAULT_PIPES_PER_POD: usize = 256;

/// The node-wide budget of pipes for splicing, and each pod's share of it.
#[derive(Debug)]
pub struct Pipes {
    left: AtomicUsize,
    per_pod: usize,
    /// Pipes each pod holds (pods holding none are not listed).
    held: Mutex<HashMap<String, usize>>,
    metrics: Arc<Metrics>,
}

impl Pipes {
    /// A budget of `n` pipes (0: never splice), at most `per_pod` of them
    /// to one pod, in use shown in `metrics`.
    pub fn new(n: usize, per_pod: usize, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            left: AtomicUsize::new(n),
            per_pod,
            held: Mutex::default(),
            metrics,
        })
    }

    /// The budget as seen by pod `pod`'s relays.
    pub fn for_pod<'a>(self: &'a Arc<Self>, pod: &'a str) -> PodPipes<'a> {
        PodPipes { pipes: self, pod }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// One pipe from the pod's share and the node's budget, returned when
    /// the [`Pipe`] is dropped.
    fn take(self: &Arc<Self>, pod: &str) -> io::Result<Arc<Self>> {
        let mut held = self.held();
        let mine = held.get(pod).copied().unwrap_or(0);
        if mine >= self.per_pod {
            drop(held);
            let limit = Limit::PodSplicePipes.as_str();
            self.metrics.limit_reached(limit);
            self.metrics.pod_limit_reached(pod, limit);
            return Err(io::Error::other(format!(
                "pod {pod} holds its share of splice pipes ({})",
                self.per_pod
            )));
        }
        if self
            .left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_err()
        {
            return Err(io::Error::other("the node's pipe budget is spent"));
        }
        held.insert(pod.to_owned(), mine + 1);
        self.metrics.pod_pipes_held(pod, mine + 1);
        self.metrics.splice_pipes.inc();
        Ok(Arc::clone(self))
    }

    fn give_back(&self, pod: &str) {
        let mut held = self.held();
        let mine = held.get(pod).copied().unwrap_or(1).saturating_sub(1);
        if mine == 0 {
            held.remove(pod);
        } else {
            held.insert(pod.to_owned(), mine);
        }
        self.metrics.pod_pipes_held(pod, mine);
        self.metrics.splice_pipes.dec();
        self.left.fetch_add(1, Ordering::AcqRel);
    }

    /// Pipes not in use.
    pub fn left(&self) -> usize {
        self.left.load(Ordering::Acquire)
    }
}

/// The pipe budget as one pod's relay sees it: its share of the node's.
#[derive(Debug, Clone, Copy)]
pub struct PodPipes<'a> {
    pipes: &'a Arc<Pipes>,
    pod: &'a str,
}

/// What one direction moved.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Moved {
    /// Every byte, copied or spliced.
    pub bytes: u64,
    /// Those that went through a pipe (`splice`).
    pub spliced: u64,
}

/// Copies both ways between `a` and `b` until both directions reached EOF
/// (each passed on as a half-close), or until either fails. Returns
/// (a -> b, b -> a). Without `pipes` every byte is copied through ztunnel.
pub async fn both_ways(
    a: &TcpStream,
    b: &TcpStream,
    pipes: Option<PodPipes<'_>>,
) -> io::Result<(Moved, Moved)> {
    tokio::try_join!(one_way(a, b, pipes), one_way(b, a, pipes))
}

async fn one_way(
    from: &TcpStream,
    to: &TcpStream,
    mut pipes: Option<PodPipes<'_>>,
) -> io::Result<Moved> {
    let mut moved = Moved::default();
    let mut pipe: Option<Pipe> = None;
    loop {
        if let Some(p) = &pipe {
            match p.fill(from).await {
                Ok(0) => break,
                Ok(n) => {
                    p.drain(to, n).await?;
                    moved.bytes += n as u64;
                    moved.spliced += n as u64;
                    // A short read: the stream has slowed down (or turned
                    // into requests and responses). The pipe goes back to
                    // the budget rather than sit with a quiet connection;
                    // a full read takes one again.
                    if n < CHUNK {
                        pipe = None;
                    }
                }
                // The pipe is empty here: nothing is lost by going back to
                // copying.
                Err(e) if unsupported(&e) => {
                    tracing::debug!(error = %e, "splice refused; copying instead");
                    pipe = None;
                    pipes = None;
                }
                Err(e) => return Err(e),
            }
            continue;
        }
        match copy_burst(from, to, &mut moved).await? {
            Burst::Eof => break,
            Burst::Streaming => {
                if let Some(budget) = pipes {
                    match Pipe::new(budget) {
                        Ok(p) => pipe = Some(p),
                        // Budget or the pod's share spent, out of
                        // descriptors or pipe quota: keep copying (this
                        // direction, for good).
                        Err(e) => {
                            tracing::debug!(error = %e, "no pipe for splicing; copying instead");
                            pipes = None;
                        }
                    }
                }
            }
            Burst::Drained => {}
        }
    }
    socket2::SockRef::from(to).shutdown(Shutdown::Write)?;
    Ok(moved)
}

fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error().map(Errno::from_raw),
        Some(Errno::EINVAL | Errno::EOPNOTSUPP | Errno::ENOSYS)
    )
}

/// How a burst of copying ended.
enum Burst {
    /// `from` has nothing more for now.
    Drained,
    /// A read filled the whole buffer: more is probably queued.
    Streaming,
    /// `from` reached EOF.
    Eof,
}

/// Once `from` is readable: reads and writes everything out to `to` until
/// `from` has nothing more, reaches EOF, or fills the buffer. One buffer per
/// burst, dropped at its end, so an idle direction holds none.
async fn copy_burst(from: &TcpStream, to: &TcpStream, moved: &mut Moved) -> io::Result<Burst> {
    from.readable().await?;
    let mut buf = BytesMut::with_capacity(CHUNK);
    loop {
        buf.clear();
        let n = match from.try_read_buf(&mut buf) {
            Ok(0) => return Ok(Burst::Eof),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Burst::Drained),
            Err(e) => return Err(e),
        };
        write_all(to, &buf).await?;
        moved.bytes += n as u64;
        if n >= CHUNK {
            return Ok(Burst::Streaming);
        }
    }
}

async fn write_all(to: &TcpStream, mut rest: &[u8]) -> io::Result<()> {
    while !rest.is_empty() {
        to.writable().await?;
        match to.try_write(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A direction's pipe (both ends non-blocking), counted in the budget
/// until dropped.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    size: usize,
    budget: Arc<Pipes>,
    pod: String,
}

impl Drop for Pipe {
    fn drop(&mut self) {
        self.budget.give_back(&self.pod);
    }
}

const SPLICE_FLAGS: SpliceFFlags =
    SpliceFFlags::SPLICE_F_MOVE.union(SpliceFFlags::SPLICE_F_NONBLOCK);

impl Pipe {
    fn new(budget: PodPipes<'_>) -> io::Result<Self> {
        let pod = budget.pod;
        let budget = budget.pipes.take(pod)?;
        let (read, write) = match pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC) {
            Ok(ends) => ends,
            Err(e) => {
                budget.give_back(pod);
                return Err(e.into());
            }
        };
        let asked = i32::try_from(PIPE_SIZE).unwrap_or(i32::MAX);
        let size = fcntl(&write, FcntlArg::F_SETPIPE_SZ(asked))
            .or_else(|_| fcntl(&write, FcntlArg::F_GETPIPE_SZ))
            .map_or(64 * 1024, |n| usize::try_from(n).unwrap_or(64 * 1024));
        Ok(Self {
            read,
            write,
            size,
            budget,
            pod: pod.to_owned(),
        })
    }

    /// Moves what `from` has (up to the pipe's size) into the empty pipe;
    /// 0 at EOF.
    async fn fill(&self, from: &TcpStream) -> io::Result<usize> {
        loop {
            from.readable().await?;
            let moved = from.try_io(Interest::READABLE, || {
                splice(
                    from,
                    None,
                    self.write.as_fd(),
                    None,
                    self.size,
                    SPLICE_FLAGS,
                )
                .map_err(io::Error::from)
            });
            match moved {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                other => return other,
            }
        }
    }

    /// Moves the `len` bytes in the pipe into `to`.
    async fn drain(&self, to: &TcpStream, mut len: usize) -> io::Result<()> {
        while len > 0 {
            to.writable().await?;
            let moved = to.try_io(Interest::WRITABLE, || {
                splice(self.read.as_fd(), None, to, None, len, SPLICE_FLAGS)
                    .map_err(io::Error::from)
            });
            match moved {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => len -= n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::TcpListener;

    /// Two connected pairs over loopback: (client, relay's a) and
    /// (relay's b, server).
    async fn pairs() -> (TcpStream, TcpStream, TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (a, _) = l.accept().await.unwrap();
        let b = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        (client, a, b, server)
    }

    /// Bytes that differ from their neighbours and repeat only after 2 KiB
    /// shifts, so a lost, doubled or reordered piece shows (also used by
    /// `hbone::copy`'s tests).
    pub(crate) fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 11) as u8)
            .collect()
    }

    /// Writes `data` in `write`-byte pieces, then half-closes, while
    /// reading everything the other side sends until its half-close.
    async fn send_and_receive(mut end: TcpStream, data: Vec<u8>, write: usize) -> Vec<u8> {
        let (mut rd, mut wr) = end.split();
        let send = async {
            for part in data.chunks(write) {
                wr.write_all(part).await.unwrap();
            }
            wr.shutdown().await.unwrap();
        };
        let mut got = Vec::new();
        let recv = rd.read_to_end(&mut got);
        let ((), r) = tokio::join!(send, recv);
        r.unwrap();
        got
    }

    fn budget(n: usize) -> Arc<Pipes> {
        Pipes::new(n, n, Metrics::new())
    }

    /// Both directions at once, large and small writes, half-close each
    /// way; `splice` decides whether a pipe may be used.
    async fn exchange(pipes: &Arc<Pipes>, len: usize, write: usize) -> (Moved, Moved) {
        let (client, a, b, server) = pairs().await;
        let pipes = Arc::clone(pipes);
        let relay = tokio::spawn(async move { both_ways(&a, &b, Some(pipes.for_pod("a"))).await });
        let up = pattern(len, 1);
        let down = pattern(len / 2 + 7, 2);
        let (up2, down2) = (up.clone(), down.clone());
        let client_task = tokio::spawn(send_and_receive(client, up2, write));
        let server_task = tokio::spawn(send_and_receive(server, down2, write));
        let limit = std::time::Duration::from_secs(60);
        let at_server = tokio::time::timeout(limit, server_task)
            .await
            .unwrap()
            .unwrap();
        let at_client = tokio::time::timeout(limit, client_task)
            .await
            .unwrap()
            .unwrap();
        let moved = tokio::time::timeout(limit, relay)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(at_server == up, "client -> server bytes differ");
        assert!(at_client == down, "server -> client bytes differ");
        assert_eq!(moved.0.bytes, up.len() as u64);
        assert_eq!(moved.1.bytes, down.len() as u64);
        moved
    }

    #[tokio::test]
    async fn streaming_directions_are_spliced_in_order() {
        let pipes = budget(8);
        let (up, down) = exchange(&pipes, 8 << 20, 128 * 1024).await;
        assert_eq!(pipes.left(), 8, "pipes go back to the budget");
        // The first full read is copied; what follows goes through pipes.
        assert!(up.spliced > (4 << 20), "client -> server spliced {up:?}");
        assert!(
            down.spliced > (2 << 20),
            "server -> client spliced {down:?}"
        );
    }

    #[tokio::test]
    async fn small_writes_keep_order_whichever_mode_each_read_takes() {
        exchange(&budget(8), 1 << 20, 7).await;
    }

    #[tokio::test]
    async fn without_pipes_everything_is_copied() {
        let (up, down) = exchange(&budget(0), 4 << 20, 64 * 1024).await;
        assert_eq!((up.spliced, down.spliced), (0, 0));
    }

    #[tokio::test]
    async fn a_direction_gives_its_pipe_back_when_the_stream_slows() {
        let (mut client, a, b, mut server) = pairs().await;
        let pipes = budget(4);
        let budget = Arc::clone(&pipes);
        let relay = tokio::spawn(async move { both_ways(&a, &b, Some(budget.for_pod("a"))).await });
        let block = vec![5u8; 4 << 20];
        let mut got = vec![0u8; block.len()];
        let (w, r) = tokio::join!(client.write_all(&block), server.read_exact(&mut got));
        w.unwrap();
        r.unwrap();
        // Small messages now, the connection staying open: the pipe returns.
        let mut small = [0u8; 100];
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while pipes.left() < 4 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the pipe never came back"
            );
            client.write_all(&[9u8; 100]).await.unwrap();
            server.read_exact(&mut small).await.unwrap();
            assert_eq!(small, [9u8; 100]);
        }
        client.shutdown().await.unwrap();
        let mut rest = Vec::new();
        server.read_to_end(&mut rest).await.unwrap();
        server.shutdown().await.unwrap();
        let (up, _) = relay.await.unwrap().unwrap();
        assert!(up.spliced > 0, "{up:?}");
        assert_eq!(pipes.left(), 4);
    }

    #[test]
    fn a_pod_holds_at_most_its_share_of_the_nodes_pipes() {
        let metrics = Metrics::new();
        let pipes = Pipes::new(4, 2, Arc::clone(&metrics));
        let a: Vec<_> = (0..2)
            .map(|_| Pipe::new(pipes.for_pod("a")).expect("within a's share"))
            .collect();
        let refused = Pipe::new(pipes.for_pod("a")).err().expect("past a's share");
        assert!(refused.to_string().contains("pod a"), "{refused}");
        let b: Vec<_> = (0..2)
            .map(|_| Pipe::new(pipes.for_pod("b")).expect("b has its own share"))
            .collect();
        assert!(
            Pipe::new(pipes.for_pod("c")).is_err(),
            "the node's are spent"
        );
        let text = metrics.encode();
        for line in [
            "ztunnel_splice_pipes 4",
            "ztunnel_pod_splice_pipes{pod=\"a\"} 2",
            "ztunnel_pod_limit_reached_total{pod=\"a\",limit=\"pod_splice_pipes\"} 1",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        drop((a, b));
        assert_eq!(pipes.left(), 4);
        let text = metrics.encode();
        assert!(text.contains("ztunnel_splice_pipes 0"), "{text}");
        assert!(!text.contains("ztunnel_pod_splice_pipes{"), "{text}");
    }

    #[tokio::test]
    async fn a_spent_budget_leaves_the_other_direction_copying() {
        let pipes = budget(1);
        let (up, down) = exchange(&pipes, 8 << 20, 128 * 1024).await;
        assert!(
            (up.spliced == 0) != (down.spliced == 0),
            "one pipe, one spliced direction: {up:?} {down:?}"
        );
        assert_eq!(pipes.left(), 1);
    }

    #[tokio::test]
    async fn request_response_never_makes_a_pipe() {
        let (mut client, a, b, mut server) = pairs().await;
        let pipes = budget(8);
        let relay = tokio::spawn(async move { both_ways(&a, &b, Some(pipes.for_pod("a"))).await });
        let mut buf = [0u8; 1024];
        for i in 0..200u32 {
            let msg = [i as u8; 1024];
            client.write_all(&msg).await.unwrap();
            server.read_exact(&mut buf).await.unwrap();
            assert_eq!(buf, msg);
            server.write_all(&buf).await.unwrap();
            client.read_exact(&mut buf).await.unwrap();
        }
        client.shutdown().await.unwrap();
        assert_eq!(server.read(&mut buf).await.unwrap(), 0);
        server.shutdown().await.unwrap();
        assert_eq!(client.read(&mut buf).await.unwrap(), 0);
        let (up, down) = relay.await.unwrap().unwrap();
        assert_eq!((up.bytes, down.bytes), (204_800, 204_800));
        assert_eq!((up.spliced, down.spliced), (0, 0));
    }

    #[tokio::test]
    async fn a_receiver_that_stops_reading_stops_the_sender() {
        let (mut client, a, b, mut server) = pairs().await;
        let pipes = budget(8);
        let relay = tokio::spawn(async move { both_ways(&a, &b, Some(pipes.for_pod("a"))).await });
        // The server reads nothing: once the socket buffers and the pipe
        // are full, the client's writes must block (no unbounded queue in
        // ztunnel). Bounded: at most 256 MiB offered.
        let block = vec![3u8; 64 * 1024];
        let mut written = 0usize;
        for _ in 0..4096 {
            let write = client.write_all(&block);
            match tokio::time::timeout(std::time::Duration::from_millis(500), write).await {
                Ok(r) => r.unwrap(),
                Err(_) => break,
            }
            written += block.len();
        }
        assert!(
            written < 64 << 20,
            "{written} bytes accepted while the receiver read nothing"
        );
        // A write may have been half done when it timed out: read until the
        // client's half-close and check nothing was lost or reordered.
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(30),
            server.read_to_end(&mut got),
        )
        .await
        .unwrap()
        .unwrap();
        assert!(
            got.len() >= written,
            "{} of {written} bytes arrived",
            got.len()
        );
        assert!(got.iter().all(|&b| b == 3));
        server.shutdown().await.unwrap();
        let (up, _) = relay.await.unwrap().unwrap();
        assert_eq!(up.bytes, got.len() as u64);
        assert!(up.spliced > 0, "{up:?}");
    }

    #[tokio::test]
    async fn a_reset_fails_the_relay_while_splicing() {
        let (mut client, a, b, server) = pairs().await;
        let pipes = budget(8);
        let relay = tokio::spawn(async move { both_ways(&a, &b, Some(pipes.for_pod("a"))).await });
        // Stream enough to be splicing, then the server resets.
        let writer = tokio::spawn(async move {
            let block = vec![7u8; 64 * 1024];
            for _ in 0..2048 {
                if client.write_all(&block).await.is_err() {
                    return;
                }
            }
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        server.set_zero_linger().unwrap();
        drop(server);
        let result = tokio::time::timeout(std::time::Duration::from_secs(20), relay)
            .await
            .expect("the relay ends after a reset")
            .unwrap();
        assert!(result.is_err(), "a reset is an error, got {result:?}");
        writer.abort();
    }
}
