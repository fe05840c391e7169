//! Closing an HBONE connection without losing what the peer has not read.
//!
//! When the server side of an HBONE connection ends it (a GOAWAY on drain,
//! once the last stream is done), the peer is usually still sending: window
//! updates for the data we just sent it, PING answers. Closing a socket
//! with unread bytes in its receive queue makes the kernel send RST instead
//! of FIN, and an RST makes the peer drop whatever it had received but not
//! yet read: the tail of the last stream's data. Seen in the drain test
//! under load: the last bytes of a 1 GiB echo never arrived.
//!
//! [`Lingering`] wraps the connection's I/O: its shutdown (which h2 calls
//! once the connection is over) sends TLS `close_notify` and FIN, then
//! reads and discards until the peer closes too, for at most a bounded
//! time, so that the final close finds nothing unread.

use std::{
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How long a closing connection waits for the peer's end of stream.
pub const LINGER: Duration = Duration::from_secs(2);

/// I/O whose shutdown waits (bounded) for the peer's end of stream.
#[derive(Debug)]
pub struct Lingering<T> {
    inner: T,
    limit: Duration,
    /// Set once our side is shut down: the wait for the peer's end.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> Lingering<T> {
    /// Wraps `inner`; its shutdown waits at most `limit` for the peer.
    pub fn new(inner: T, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            deadline: None,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Lingering<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Lingering<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    // Forwarded so h2 keeps writing a DATA frame's header and payload in
    // one call: without it h2 writes them separately, and under TLS each
    // write became its own record and its own `write(2)`.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.deadline.is_none() {
            ready!(Pin::new(&mut this.inner).poll_shutdown(cx))?;
            this.deadline = Some(Box::pin(tokio::time::sleep(this.limit)));
        }
        let mut scratch = [0u8; 4096];
        loop {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut buf) {
                // More from the peer: discard it, it comes after the end.
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {}
                // The peer's end of stream, or an error: nothing is left.
                Poll::Ready(_) => return Poll::Ready(Ok(())),
                Poll::Pending => {
                    let expired = this
                        .deadline
                        .as_mut()
                        .is_some_and(|d| d.as_mut().poll(cx).is_ready());
                    return if expired {
                        Poll::Ready(Ok(()))
                    } else {
                        Poll::Pending
                    };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    #[tokio::test]
    async fn shutdown_waits_for_the_peer_to_close_and_reads_what_it_sent() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut ours = Lingering::new(ours, Duration::from_secs(5));
        let peer = tokio::spawn(async move {
            let mut got = Vec::new();
            theirs.read_to_end(&mut got).await.expect("read");
            // Sent after our end of stream: must not make the close lose
            // anything, only be discarded.
            let _ = theirs.write_all(b"late window update").await;
            drop(theirs);
            got
        });
        ours.write_all(b"last bytes").await.expect("write");
        let started = std::time::Instant::now();
        ours.shutdown().await.expect("shutdown");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(peer.await.expect("peer"), b"last bytes");
    }

    /// Accepts everything, vectored, and remembers each call's size.
    #[derive(Default)]
    struct Recorder {
        calls: Vec<usize>,
    }

    impl AsyncRead for Recorder {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    impl AsyncWrite for Recorder {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            self.calls.push(buf.len());
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[std::io::IoSlice<'_>],
        ) -> Poll<std::io::Result<usize>> {
            let n = bufs.iter().map(|b| b.len()).sum();
            self.calls.push(n);
            Poll::Ready(Ok(n))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// h2 writes a DATA frame's header and payload in one vectored call
    /// only if its I/O says it can; under TLS two calls are two records.
    #[tokio::test]
    async fn vectored_writes_reach_the_inner_io_as_one_call() {
        let mut ours = Lingering::new(Recorder::default(), Duration::from_secs(1));
        assert!(ours.is_write_vectored());
        let header = [0u8; 9];
        let payload = [1u8; 4096];
        let bufs = [
            std::io::IoSlice::new(&header),
            std::io::IoSlice::new(&payload),
        ];
        let n = ours.write_vectored(&bufs).await.expect("write");
        assert_eq!(n, header.len() + payload.len());
        assert_eq!(ours.inner.calls, vec![header.len() + payload.len()]);
    }

    #[tokio::test]
    async fn a_peer_that_never_closes_is_waited_for_only_so_long() {
        let (ours, _theirs) = tokio::io::duplex(64);
        let mut ours = Lingering::new(ours, Duration::from_millis(300));
        let started = tokio::time::Instant::now();
        ours.shutdown().await.expect("shutdown");
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
