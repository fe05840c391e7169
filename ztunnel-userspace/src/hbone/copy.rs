//! Bytes between a TCP socket and an HTTP/2 stream.
//!
//! - TCP -> HTTP/2: read only after the stream has granted send capacity
//!   for what was read, so a slow peer stops us reading (back-pressure); at
//!   EOF an empty DATA frame with END_STREAM carries the half-close.
//! - HTTP/2 -> TCP: each DATA frame is written out before its flow-control
//!   capacity is released to the peer, so the peer can never have more than
//!   one window in flight towards us; END_STREAM becomes `shutdown(SHUT_WR)`.
//! - An idle connection holds no read buffer: one is allocated only when the
//!   socket is readable.

use std::io;

use bytes::{Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};

/// Read size from TCP.
const CHUNK: usize = 64 * 1024;

fn h2_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        e.into_io()
            .unwrap_or_else(|| io::Error::other("h2 I/O error"))
    } else {
        io::Error::other(e)
    }
}

/// Copies until both directions finished. Returns (bytes TCP -> stream,
/// bytes stream -> TCP).
pub async fn tcp_to_h2(
    tcp: TcpStream,
    mut send: SendStream<Bytes>,
    mut recv: RecvStream,
) -> io::Result<(u64, u64)> {
    let (mut rd, mut wr) = tcp.into_split();
    let upstream = async {
        let mut total = 0u64;
        loop {
            rd.readable().await?;
            let mut buf = BytesMut::with_capacity(CHUNK);
            let n = match rd.read_buf(&mut buf).await {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                send.send_data(Bytes::new(), true).map_err(h2_io)?;
                return Ok(total);
            }
            total += n as u64;
            let mut chunk = buf.freeze();
            while !chunk.is_empty() {
                send.reserve_capacity(chunk.len());
                let granted = std::future::poll_fn(|cx| send.poll_capacity(cx))
                    .await
                    .ok_or_else(|| {
                        io::Error::new(io::ErrorKind::BrokenPipe, "HBONE stream closed")
                    })?
                    .map_err(h2_io)?;
                let part = chunk.split_to(granted.min(chunk.len()));
                send.send_data(part, false).map_err(h2_io)?;
            }
        }
    };
    let downstream = async {
        let mut total = 0u64;
        while let Some(data) = recv.data().await {
            let data = data.map_err(h2_io)?;
            wr.write_all(&data).await?;
            total += data.len() as u64;
            recv.flow_control()
                .release_capacity(data.len())
                .map_err(h2_io)?;
        }
        wr.shutdown().await?;
        Ok::<u64, io::Error>(total)
    };
    tokio::try_join!(upstream, downstream)
}
