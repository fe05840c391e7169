//! Bytes between a TCP socket and an HTTP/2 stream.
//!
//! - TCP -> HTTP/2: read only after the stream has granted send capacity
//!   for what was read, so a slow peer stops us reading (back-pressure); at
//!   EOF an empty DATA frame with END_STREAM carries the half-close.
//! - HTTP/2 -> TCP: each DATA frame is written out before its flow-control
//!   capacity is released to the peer, so the peer can never have more than
//!   one window in flight towards us; END_STREAM becomes `shutdown(SHUT_WR)`.
//! - An idle connection holds no read buffer: one is allocated only when the
//!   socket is readable: 16 KiB, or 256 KiB from a read that filled its
//!   buffer until one returns less than 16 KiB.

use std::io;

use bytes::{Bytes, BytesMut};
use h2::{RecvStream, SendStream};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};

/// First read size from TCP, and again after a short read: request/response
/// traffic never needs more, and each read's buffer lives until h2 has
/// written it.
const CHUNK: usize = 16 * 1024;
/// Read size once a read filled its buffer (the application is streaming):
/// four times fewer reads, DATA frames and connection-task wake-ups per byte
/// than 64 KiB reads (cross-node 1 stream 1.16x in a two-way A/B, see
/// docs/performance.md).
const STREAMING_CHUNK: usize = 256 * 1024;

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
        let mut size = CHUNK;
        loop {
            rd.readable().await?;
            let mut buf = BytesMut::with_capacity(size);
            let n = match rd.read_buf(&mut buf).await {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            };
            size = if n >= size {
                STREAMING_CHUNK
            } else if n < CHUNK {
                CHUNK
            } else {
                size
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::relay::tests::pattern;
    use tokio::net::TcpListener;

    /// Writes the pieces in order, with a pause after small ones so each is
    /// its own read, then half-closes.
    async fn write_pieces(wr: &mut tokio::net::tcp::OwnedWriteHalf, data: &[u8], sizes: &[usize]) {
        let mut at = 0;
        for &size in sizes.iter().cycle() {
            if at == data.len() {
                break;
            }
            let end = (at + size).min(data.len());
            wr.write_all(&data[at..end]).await.unwrap();
            if size < CHUNK {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
            at = end;
        }
        wr.shutdown().await.unwrap();
    }

    /// A stream that alternates bulk with small messages arrives whole and in
    /// order both ways, whatever read size the copy has switched to, and the
    /// byte counts are the application's.
    #[tokio::test]
    async fn streaming_and_small_writes_arrive_whole_both_ways() {
        // Application <-> (TCP) <-> tcp_to_h2 <-> (HTTP/2 over a pipe) <-> peer.
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let app = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (proxy_side, _) = l.accept().await.unwrap();
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        let server = tokio::spawn(async move {
            let mut conn = h2::server::Builder::new()
                .initial_window_size(crate::hbone::STREAM_WINDOW)
                .max_frame_size(crate::hbone::MAX_FRAME)
                .handshake::<_, Bytes>(server_io)
                .await
                .unwrap();
            let (request, mut respond) = conn.accept().await.unwrap().unwrap();
            tokio::spawn(async move { while conn.accept().await.is_some() {} });
            let mut send = respond
                .send_response(http::Response::new(()), false)
                .unwrap();
            let mut body = request.into_body();
            // The peer answers with its own stream (100,000-byte pieces, so
            // DATA frames that are not the reads' sizes) while it reads.
            let answer = pattern(3 << 20, 9);
            let reply = {
                let answer = answer.clone();
                async move {
                    for piece in answer.chunks(100_000).chain(std::iter::once(&[][..])) {
                        let last = piece.is_empty();
                        send.reserve_capacity(piece.len().max(1));
                        let mut rest = Bytes::copy_from_slice(piece);
                        while !rest.is_empty() {
                            let n = std::future::poll_fn(|cx| send.poll_capacity(cx))
                                .await
                                .unwrap()
                                .unwrap();
                            send.send_data(rest.split_to(n.min(rest.len())), false)
                                .unwrap();
                        }
                        if last {
                            send.send_data(Bytes::new(), true).unwrap();
                        }
                    }
                }
            };
            let read = async {
                let mut got = Vec::new();
                while let Some(data) = body.data().await {
                    let data = data.unwrap();
                    got.extend_from_slice(&data);
                    body.flow_control().release_capacity(data.len()).unwrap();
                }
                got
            };
            let ((), got) = tokio::join!(reply, read);
            (got, answer.len())
        });
        let limit = std::time::Duration::from_secs(60);
        let handshake = h2::client::Builder::new()
            .initial_window_size(crate::hbone::STREAM_WINDOW)
            .max_frame_size(crate::hbone::MAX_FRAME)
            .handshake::<_, Bytes>(client_io);
        let (mut client, conn) = tokio::time::timeout(limit, handshake)
            .await
            .unwrap()
            .unwrap();
        tokio::spawn(conn);
        let request = http::Request::connect("127.0.0.1:8080").body(()).unwrap();
        let (response, send) = client.send_request(request, false).unwrap();
        let recv = tokio::time::timeout(limit, response)
            .await
            .unwrap()
            .unwrap()
            .into_body();
        let copy = tokio::spawn(tcp_to_h2(proxy_side, send, recv));

        // Bulk, then small messages (back to small reads), then bulk again.
        let written = pattern(5 << 20, 3);
        let sizes = [
            1 << 20,
            1 << 20,
            700,
            1,
            5000,
            300_000,
            2 << 20,
            10,
            1 << 20,
        ];
        let (mut rd, mut wr) = app.into_split();
        let write = write_pieces(&mut wr, &written, &sizes);
        let mut received = Vec::new();
        let read = rd.read_to_end(&mut received);
        let ((), r) = tokio::time::timeout(limit, async { tokio::join!(write, read) })
            .await
            .unwrap();
        r.unwrap();
        let (up, down) = tokio::time::timeout(limit, copy)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let (at_peer, answer_len) = tokio::time::timeout(limit, server).await.unwrap().unwrap();
        assert!(
            at_peer == written,
            "the peer got {} of {} bytes, or out of order",
            at_peer.len(),
            written.len()
        );
        assert!(
            received == pattern(answer_len, 9),
            "the application got {} of {answer_len} bytes",
            received.len()
        );
        assert_eq!((up, down), (written.len() as u64, answer_len as u64));
    }
}
