//! Early data: what the application sends while its `CONNECT` waits for
//! the peer's response.
//!
//! Waiting for the 200 before reading the application costs one round trip
//! between the two ztunnels on every new connection, which is most of what a
//! short connection (an HTTP request) pays for the tunnel. So the bytes the
//! application writes meanwhile go out on the stream at once, and a copy is
//! kept until the response:
//!
//! - 200: the copy is dropped; the peer hands the bytes to its application
//!   first, in order, as soon as it has connected to it.
//! - a refused stream (`REFUSED_STREAM`, or a GOAWAY that crossed the
//!   request): the peer's application never saw it, so the pool opens the
//!   stream again elsewhere and sends the copy first ([`Early::replay`]).
//! - any other answer (a denial, 503, a timeout): the copy is dropped and
//!   the application's connection is reset, as without early data. The
//!   peer decides before it connects to its application, so bytes sent
//!   ahead of a denial reach no one; it discards them with the stream.
//!
//! The copy is bounded by [`EARLY_LIMIT`]: past it nothing more is read
//! until the response, which is back-pressure on the application, not loss.
//! Nothing is allocated for an application that sends nothing first.

use std::io;

use bytes::{Bytes, BytesMut};
use h2::{RecvStream, SendStream, client::ResponseFuture};
use http::Response;
use tokio::net::TcpStream;

/// Most bytes read from the application before the peer's response. Well
/// under the stream window (4 MiB, Istio's), so they never wait for it.
pub const EARLY_LIMIT: usize = 64 * 1024;

/// Reads up to this size are copied out of the read buffer before being kept.
const SMALL_READ: usize = 4096;

/// The bytes sent ahead of the response, kept to send again.
#[derive(Debug, Default)]
pub struct Early {
    chunks: Vec<Bytes>,
    len: usize,
    /// The application's end reached EOF or failed: no more reads here; the
    /// copy that follows reads it again and sees the same.
    stopped: bool,
}

impl Early {
    /// Bytes sent ahead of the response.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether nothing was sent ahead.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sends the kept bytes again, on a new stream after a refused one.
    pub fn replay(&mut self, stream: &mut SendStream<Bytes>) -> Result<(), h2::Error> {
        // Reading stopped when the refused stream would take no more; the
        // new one may. (After EOF the next read sees EOF again.)
        self.stopped = false;
        for chunk in &self.chunks {
            // Within EARLY_LIMIT: h2 buffers what the window does not take.
            stream.send_data(chunk.clone(), false)?;
        }
        Ok(())
    }

    /// Waits for the response to the stream's `CONNECT`, meanwhile sending
    /// what `app` writes (up to [`EARLY_LIMIT`] in all, kept for
    /// [`Early::replay`]). Without `app`, just the response.
    pub async fn send_until_response(
        &mut self,
        stream: &mut SendStream<Bytes>,
        mut response: ResponseFuture,
        app: Option<&TcpStream>,
    ) -> Result<Response<RecvStream>, h2::Error> {
        let Some(app) = app else {
            return response.await;
        };
        loop {
            let reading = !self.stopped && self.len < EARLY_LIMIT;
            tokio::select! {
                biased;
                answer = &mut response => return answer,
                ready = app.readable(), if reading => {
                    if ready.is_err() {
                        self.stopped = true;
                        continue;
                    }
                    let mut buf = BytesMut::with_capacity(EARLY_LIMIT - self.len);
                    match app.try_read_buf(&mut buf) {
                        Ok(0) => self.stopped = true,
                        Ok(n) => {
                            // A short read (a request line) keeps a copy of
                            // its size, not the 64 KiB buffer, for as long
                            // as the answer takes.
                            let chunk = if n <= SMALL_READ {
                                Bytes::copy_from_slice(&buf)
                            } else {
                                buf.freeze()
                            };
                            self.len += n;
                            self.chunks.push(chunk.clone());
                            // A stream that cannot take it any more was
                            // reset or refused: the response says which
                            // (a refusal replays the chunk, kept above).
                            if stream.send_data(chunk, false).is_err() {
                                self.stopped = true;
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(_) => self.stopped = true,
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Real HTTP/2 (h2 both sides) over loopback TCP, and a real application
    //! socket pair; no TLS, which early data does not touch.

    use std::time::Duration;

    use bytes::Bytes;
    use h2::{
        Reason, RecvStream, SendStream,
        client::{ResponseFuture, SendRequest},
        server::SendResponse,
    };
    use http::{Method, Request, Response, StatusCode};
    use tokio::{
        io::{AsyncReadExt as _, AsyncWriteExt as _},
        net::{TcpListener, TcpStream},
        sync::mpsc,
        time::timeout,
    };

    use super::{EARLY_LIMIT, Early};

    const LIMIT: Duration = Duration::from_secs(10);

    /// A `CONNECT` as the server sees it.
    type Incoming = (RecvStream, SendResponse<Bytes>);

    /// An h2 client and, on the other end, a server handing each request to
    /// the test.
    async fn h2_pair() -> (SendRequest<Bytes>, mpsc::Receiver<Incoming>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let (sock, _) = listener.accept().await.expect("accept");
            let mut conn = h2::server::handshake(sock).await.expect("server handshake");
            while let Some(Ok((request, respond))) = conn.accept().await {
                if tx.send((request.into_body(), respond)).await.is_err() {
                    break;
                }
            }
        });
        let sock = TcpStream::connect(addr).await.expect("connect");
        let (send, conn) = h2::client::handshake(sock).await.expect("client handshake");
        tokio::spawn(conn);
        (send, rx)
    }

    /// Both ends of an application's connection: (the application, ours).
    async fn app_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let app = TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (ours, _) = listener.accept().await.expect("accept");
        (app, ours)
    }

    /// A `CONNECT` stream and its pending answer.
    async fn open(client: &SendRequest<Bytes>) -> (ResponseFuture, SendStream<Bytes>) {
        client
            .clone()
            .ready()
            .await
            .expect("ready")
            .send_request(connect(), false)
            .expect("request")
    }

    /// The peer's answer, early data sent meanwhile.
    async fn answer_of(
        early: &mut Early,
        stream: &mut SendStream<Bytes>,
        response: ResponseFuture,
        app: Option<&TcpStream>,
    ) -> Response<RecvStream> {
        timeout(LIMIT, early.send_until_response(stream, response, app))
            .await
            .expect("answered within the limit")
            .expect("a response, not an error")
    }

    fn connect() -> Request<()> {
        Request::builder()
            .method(Method::CONNECT)
            .uri("10.0.0.1:8080")
            .body(())
            .expect("request")
    }

    /// Reads the request body until `want` bytes came.
    async fn body(recv: &mut RecvStream, want: usize) -> Vec<u8> {
        let mut got = Vec::new();
        while got.len() < want {
            let data = timeout(LIMIT, recv.data())
                .await
                .expect("body within the limit")
                .expect("more body")
                .expect("data");
            recv.flow_control()
                .release_capacity(data.len())
                .expect("release");
            got.extend_from_slice(&data);
        }
        got
    }

    fn answer(respond: &mut SendResponse<Bytes>, status: StatusCode) {
        let response = Response::builder()
            .status(status)
            .body(())
            .expect("response");
        respond
            .send_response(response, false)
            .expect("send response");
    }

    #[tokio::test]
    async fn bytes_written_before_the_answer_reach_the_peer_before_it_answers() {
        let (client, mut incoming) = h2_pair().await;
        let (mut app, ours) = app_pair().await;
        app.write_all(b"GET / HTTP/1.1\r\n\r\n")
            .await
            .expect("write");
        let (response, mut stream) = open(&client).await;
        let server = tokio::spawn(async move {
            let (mut recv, mut respond) = incoming.recv().await.expect("a CONNECT");
            // The peer holds its answer until the request's bytes are there:
            // without early data this would wait forever (the limit fails it).
            let got = body(&mut recv, 18).await;
            answer(&mut respond, StatusCode::OK);
            got
        });
        let mut early = Early::default();
        let answered = answer_of(&mut early, &mut stream, response, Some(&ours)).await;
        assert_eq!(answered.status(), StatusCode::OK);
        assert_eq!(server.await.expect("server"), b"GET / HTTP/1.1\r\n\r\n");
        assert_eq!(early.len(), 18);
    }

    #[tokio::test]
    async fn no_more_than_the_limit_is_read_before_the_answer() {
        let (client, mut incoming) = h2_pair().await;
        let (mut app, ours) = app_pair().await;
        let total = 4 * EARLY_LIMIT;
        let writer = tokio::spawn(async move {
            app.write_all(&vec![7u8; total]).await.expect("write");
            app
        });
        let (response, mut stream) = open(&client).await;
        let server = tokio::spawn(async move {
            let (mut recv, mut respond) = incoming.recv().await.expect("a CONNECT");
            let got = body(&mut recv, EARLY_LIMIT).await;
            // Nothing past the limit arrives while the answer is held.
            let more = timeout(Duration::from_millis(300), recv.data()).await;
            assert!(more.is_err(), "data past the early limit: {more:?}");
            answer(&mut respond, StatusCode::OK);
            got.len()
        });
        let mut early = Early::default();
        let answered = answer_of(&mut early, &mut stream, response, Some(&ours)).await;
        assert_eq!(answered.status(), StatusCode::OK);
        assert_eq!(server.await.expect("server"), EARLY_LIMIT);
        assert_eq!(early.len(), EARLY_LIMIT as u64);
        // The rest waits in the application's socket for the copy.
        let _app = writer.await.expect("writer");
        let mut rest = vec![0u8; total - EARLY_LIMIT];
        let mut ours = ours;
        timeout(LIMIT, ours.read_exact(&mut rest))
            .await
            .expect("rest within the limit")
            .expect("the rest is still there");
    }

    #[tokio::test]
    async fn a_refused_stream_is_replayed_in_order_on_the_next() {
        let (client, mut incoming) = h2_pair().await;
        let (mut app, ours) = app_pair().await;
        app.write_all(b"first").await.expect("write");
        let (response, mut stream) = open(&client).await;
        let (mut recv, mut respond) = incoming.recv().await.expect("a CONNECT");
        let mut early = Early::default();
        let waited = early.send_until_response(&mut stream, response, Some(&ours));
        let refuse = async {
            assert_eq!(body(&mut recv, 5).await, b"first");
            respond.send_reset(Reason::REFUSED_STREAM);
        };
        let (refused, ()) = timeout(LIMIT, async { tokio::join!(waited, refuse) })
            .await
            .expect("refused within the limit");
        let e = refused.expect_err("the stream was refused");
        assert_eq!(e.reason(), Some(Reason::REFUSED_STREAM));

        // The next stream gets the kept bytes first, then what follows.
        let (response, mut stream) = open(&client).await;
        early.replay(&mut stream).expect("replay");
        app.write_all(b"+second").await.expect("write");
        let server = tokio::spawn(async move {
            let (mut recv, mut respond) = incoming.recv().await.expect("a second CONNECT");
            let got = body(&mut recv, 12).await;
            answer(&mut respond, StatusCode::OK);
            got
        });
        let answered = answer_of(&mut early, &mut stream, response, Some(&ours)).await;
        assert_eq!(answered.status(), StatusCode::OK);
        assert_eq!(server.await.expect("server"), b"first+second");
        assert_eq!(early.len(), 12);
    }

    #[tokio::test]
    async fn a_denial_after_early_data_is_the_status_not_a_stream_error() {
        let (client, mut incoming) = h2_pair().await;
        let (mut app, ours) = app_pair().await;
        let (response, mut stream) = open(&client).await;
        // The application keeps writing while the peer denies and drops the
        // stream's body: later sends fail, the answer still comes through.
        let writer = tokio::spawn(async move {
            for _ in 0..50 {
                if app.write_all(&[1u8; 512]).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            app
        });
        let server = tokio::spawn(async move {
            let (mut recv, mut respond) = incoming.recv().await.expect("a CONNECT");
            body(&mut recv, 512).await;
            let response = Response::builder()
                .status(StatusCode::UNAUTHORIZED)
                .body(())
                .expect("response");
            respond.send_response(response, true).expect("deny");
            drop(recv);
        });
        let mut early = Early::default();
        let answered = answer_of(&mut early, &mut stream, response, Some(&ours)).await;
        assert_eq!(answered.status(), StatusCode::UNAUTHORIZED);
        server.await.expect("server");
        let _app = writer.await.expect("writer");
    }

    #[tokio::test]
    async fn without_an_application_socket_it_only_waits() {
        let (client, mut incoming) = h2_pair().await;
        let (response, mut stream) = open(&client).await;
        tokio::spawn(async move {
            let (_recv, mut respond) = incoming.recv().await.expect("a CONNECT");
            answer(&mut respond, StatusCode::OK);
            // Keep the stream open until the client has its answer.
            tokio::time::sleep(LIMIT).await;
        });
        let mut early = Early::default();
        let answered = answer_of(&mut early, &mut stream, response, None).await;
        assert_eq!(answered.status(), StatusCode::OK);
        assert!(early.is_empty());
    }
}
