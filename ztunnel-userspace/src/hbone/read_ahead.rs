//! Large reads under TLS.
//!
//! rustls pulls ciphertext from its transport 4 KiB at a time, so a 16 KiB
//! record costs four or five `read` system calls, and under bulk transfer
//! those calls were a large share of the receiving ztunnel's CPU. This
//! adapter sits between the TCP socket and rustls: one system call fills up
//! to [`READ_AHEAD`] bytes, and rustls's small reads are served from memory.
//!
//! The buffer exists only while it holds bytes: it is freed when the socket
//! has nothing more to give, so an idle pooled connection holds none. It is
//! never zeroed (the socket writes into its spare capacity): zeroing 64 KiB
//! for a 1 KiB request cost more CPU than the saved system calls.
//! Writes pass straight through (vectored included: h2 relies on it to put
//! a frame's header and payload in one TLS record).

use std::{
    io::{self, IoSlice},
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Buf as _, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes asked of the socket per read: four TLS records of the largest size.
pub const READ_AHEAD: usize = 64 * 1024;

pub struct ReadAhead<T> {
    inner: T,
    /// Unread bytes.
    buf: BytesMut,
}

impl<T> ReadAhead<T> {
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            buf: BytesMut::new(),
        }
    }

    /// Bytes held for reading (a test's view of the buffer).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.buf.capacity()
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ReadAhead<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.buf.is_empty() {
            // A caller with room for a whole read-ahead gains nothing from
            // the extra copy.
            if out.remaining() >= READ_AHEAD {
                return Pin::new(&mut this.inner).poll_read(cx, out);
            }
            this.buf.reserve(READ_AHEAD);
            match tokio_util::io::poll_read_buf(Pin::new(&mut this.inner), cx, &mut this.buf) {
                Poll::Ready(Ok(n)) if n > 0 => {}
                other => {
                    // End of stream, nothing to read yet, or an error: hold
                    // no memory meanwhile.
                    this.buf = BytesMut::new();
                    return other.map_ok(|_| ());
                }
            }
        }
        let n = out.remaining().min(this.buf.len());
        out.put_slice(&this.buf[..n]);
        this.buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ReadAhead<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    #[tokio::test]
    async fn small_reads_are_served_from_one_large_read_and_the_buffer_goes_when_drained() {
        let (mut far, near) = tokio::io::duplex(4 * READ_AHEAD);
        let sent: Vec<u8> = (0..READ_AHEAD + 1000).map(|i| (i % 251) as u8).collect();
        far.write_all(&sent).await.unwrap();
        let mut reader = ReadAhead::new(near);
        let mut got = Vec::new();
        let mut small = [0u8; 4096];
        // The first small read fills the read-ahead at once.
        let n = reader.read(&mut small).await.unwrap();
        got.extend_from_slice(&small[..n]);
        assert_eq!(n, 4096);
        assert_eq!(
            reader.buf.len(),
            READ_AHEAD - 4096,
            "one read took a whole read-ahead"
        );
        while got.len() < sent.len() {
            let n = reader.read(&mut small).await.unwrap();
            assert!(n > 0, "stream ended early");
            got.extend_from_slice(&small[..n]);
        }
        assert_eq!(got, sent, "bytes arrive whole and in order");
        // Nothing left to read: the next poll finds the socket empty and
        // drops the buffer.
        let pending = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            reader.read(&mut small),
        )
        .await;
        assert!(pending.is_err(), "no bytes were left");
        assert_eq!(reader.held(), 0, "an idle reader holds no buffer");
        // Writes pass through, and end of stream is seen.
        reader.write_all(b"back").await.unwrap();
        let mut echo = [0u8; 4];
        far.read_exact(&mut echo).await.unwrap();
        assert_eq!(&echo, b"back");
        drop(far);
        assert_eq!(reader.read(&mut small).await.unwrap(), 0);
        assert_eq!(reader.held(), 0);
    }
}
