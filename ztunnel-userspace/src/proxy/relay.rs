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
//! connections. Without a pipe (budget spent, descriptors exhausted) a
//! direction keeps copying. A direction gives its pipe back as soon as a
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
    io,
    net::Shutdown,
    os::fd::{AsFd, OwnedFd},
    sync::{
        Arc,
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

/// Read size while copying; a read that fills it switches the direction to
/// splicing.
const CHUNK: usize = 16 * 1024;

/// Pipe capacity asked for (the kernel's default is 64 KiB): more bytes
/// per `splice()` call for streaming directions. The kernel may grant less
/// (the per-user pipe limits); whatever it grants works.
const PIPE_SIZE: usize = 256 * 1024;

/// Pipes the node's relays may hold at once.
pub const DEFAULT_PIPES: usize = 1024;

/// The node-wide budget of pipes for splicing.
#[derive(Debug)]
pub struct Pipes {
    left: AtomicUsize,
}

impl Pipes {
    /// A budget of `n` pipes (0: never splice).
    pub fn new(n: usize) -> Arc<Self> {
        Arc::new(Self {
            left: AtomicUsize::new(n),
        })
    }

    /// One pipe from the budget, returned when the [`Pipe`] is dropped.
    fn take(self: &Arc<Self>) -> Option<Arc<Self>> {
        self.left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .ok()
            .map(|_| Arc::clone(self))
    }

    /// Pipes not in use.
    pub fn left(&self) -> usize {
        self.left.load(Ordering::Acquire)
    }
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
    pipes: Option<&Arc<Pipes>>,
) -> io::Result<(Moved, Moved)> {
    tokio::try_join!(one_way(a, b, pipes), one_way(b, a, pipes))
}

async fn one_way(
    from: &TcpStream,
    to: &TcpStream,
    mut pipes: Option<&Arc<Pipes>>,
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
                        // Budget spent, out of descriptors or pipe quota:
                        // keep copying (this direction, for good).
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
}

impl Drop for Pipe {
    fn drop(&mut self) {
        self.budget.left.fetch_add(1, Ordering::AcqRel);
    }
}

const SPLICE_FLAGS: SpliceFFlags =
    SpliceFFlags::SPLICE_F_MOVE.union(SpliceFFlags::SPLICE_F_NONBLOCK);

impl Pipe {
    fn new(budget: &Arc<Pipes>) -> io::Result<Self> {
        let budget = budget
            .take()
            .ok_or_else(|| io::Error::other("the node's pipe budget is spent"))?;
        let (read, write) = match pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC) {
            Ok(ends) => ends,
            Err(e) => {
                budget.left.fetch_add(1, Ordering::AcqRel);
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

    /// Both directions at once, large and small writes, half-close each
    /// way; `splice` decides whether a pipe may be used.
    async fn exchange(pipes: &Arc<Pipes>, len: usize, write: usize) -> (Moved, Moved) {
        let (client, a, b, server) = pairs().await;
        let pipes = Arc::clone(pipes);
        let relay = tokio::spawn(async move { both_ways(&a, &b, Some(&pipes)).await });
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
        let pipes = Pipes::new(8);
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
        exchange(&Pipes::new(8), 1 << 20, 7).await;
    }

    #[tokio::test]
    async fn without_pipes_everything_is_copied() {
        let (up, down) = exchange(&Pipes::new(0), 4 << 20, 64 * 1024).await;
        assert_eq!((up.spliced, down.spliced), (0, 0));
    }

    #[tokio::test]
    async fn a_direction_gives_its_pipe_back_when_the_stream_slows() {
        let (mut client, a, b, mut server) = pairs().await;
        let pipes = Pipes::new(4);
        let budget = Arc::clone(&pipes);
        let relay = tokio::spawn(async move { both_ways(&a, &b, Some(&budget)).await });
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

    #[tokio::test]
    async fn a_spent_budget_leaves_the_other_direction_copying() {
        let pipes = Pipes::new(1);
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
        let pipes = Pipes::new(8);
        let relay = tokio::spawn(async move { both_ways(&a, &b, Some(&pipes)).await });
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
        let pipes = Pipes::new(8);
        let relay = tokio::spawn(async move { both_ways(&a, &b, Some(&pipes)).await });
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
        let pipes = Pipes::new(8);
        let relay = tokio::spawn(async move { both_ways(&a, &b, Some(&pipes)).await });
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
