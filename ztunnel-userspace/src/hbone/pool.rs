//! The HBONE client: pooled HTTP/2 connections and `CONNECT` streams.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use h2::{RecvStream, SendStream, client::SendRequest};
use http::{Method, Request, StatusCode};
use rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;
use ztunnel_common::INBOUND_HBONE_PORT;

use super::{
    CLIENT_MAX_STREAMS, CONNECTION_WINDOW, HboneError, MAX_FRAME, PING_INTERVAL, PING_TIMEOUT,
    STREAM_WINDOW,
};
use crate::{
    identity::{CertManager, Identity},
    proxy::socket_factory::SocketFactory,
};

/// What makes two streams share a connection. The source pod's IP is part
/// of the key because connections are opened from inside that pod's
/// namespace (pod IP to pod IP); two replicas with one identity do not
/// share sockets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    /// The source pod's IP.
    pub src_ip: IpAddr,
    /// The source workload's identity (our client certificate).
    pub src: Identity,
    /// The destination pod's HBONE address (IP, 15008).
    pub dst: SocketAddr,
    /// The identity the destination must present.
    pub dst_identity: Identity,
}

struct PooledConn {
    id: u64,
    send: SendRequest<Bytes>,
    streams: AtomicUsize,
    closed: AtomicBool,
    idle_since: Mutex<Instant>,
}

type Slot = Arc<tokio::sync::Mutex<Vec<Arc<PooledConn>>>>;

/// The pool. Cheap to share (`Arc`).
pub struct HbonePool {
    certs: Arc<CertManager>,
    slots: Mutex<HashMap<PoolKey, Slot>>,
    idle_timeout: Duration,
    next_id: AtomicU64,
    handshakes: AtomicU64,
    reused: AtomicU64,
}

impl std::fmt::Debug for HbonePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HbonePool")
            .field("handshakes", &self.handshakes())
            .finish_non_exhaustive()
    }
}

/// An open `CONNECT` stream. Dropping it releases its slot in the pool.
pub struct Tunnel {
    /// Towards the peer.
    pub send: SendStream<Bytes>,
    /// From the peer.
    pub recv: RecvStream,
    /// Id of the pooled connection carrying it (for logs).
    pub connection: u64,
    _guard: StreamGuard,
}

struct StreamGuard(Arc<PooledConn>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if self.0.streams.fetch_sub(1, Ordering::AcqRel) == 1
            && let Ok(mut idle) = self.0.idle_since.lock()
        {
            *idle = Instant::now();
        }
    }
}

impl HbonePool {
    /// An empty pool issuing client certificates from `certs`.
    pub fn new(certs: Arc<CertManager>, idle_timeout: Duration) -> Self {
        Self {
            certs,
            slots: Mutex::new(HashMap::new()),
            idle_timeout,
            next_id: AtomicU64::new(1),
            handshakes: AtomicU64::new(0),
            reused: AtomicU64::new(0),
        }
    }

    /// TLS handshakes done so far (one per pooled connection opened).
    pub fn handshakes(&self) -> u64 {
        self.handshakes.load(Ordering::Relaxed)
    }

    /// Streams that went on an already open connection.
    pub fn reused(&self) -> u64 {
        self.reused.load(Ordering::Relaxed)
    }

    /// Open pooled connections.
    pub fn open_connections(&self) -> usize {
        let slots = self
            .slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        slots
            .values()
            .map(|s| {
                s.try_lock().map_or(0, |v| {
                    v.iter()
                        .filter(|c| !c.closed.load(Ordering::Relaxed))
                        .count()
                })
            })
            .sum()
    }

    /// Opens a `CONNECT` stream to `target` through the destination pod's
    /// HBONE port, on a pooled connection for `key` (opening one if none
    /// has room). `client` goes into the `forwarded` header.
    pub async fn connect(
        &self,
        key: PoolKey,
        sockets: &SocketFactory,
        target: SocketAddr,
        client: SocketAddr,
    ) -> Result<Tunnel, HboneError> {
        let slot = {
            let mut slots = self
                .slots
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            Arc::clone(slots.entry(key.clone()).or_default())
        };
        let h2_err = |source| HboneError::H2 {
            peer: key.dst,
            source,
        };
        // A pooled connection may have been closed by the peer (GOAWAY on
        // drain, an idle timeout) since we last looked: then it is dropped
        // from the pool and the stream is tried once more on a fresh one.
        let mut attempt = 0;
        let (conn, guard, mut send) = loop {
            attempt += 1;
            let conn = self.pick(&slot, &key, sockets).await?;
            let guard = StreamGuard(Arc::clone(&conn));
            match conn.send.clone().ready().await {
                Ok(send) => break (conn, guard, send),
                Err(e) => {
                    conn.closed.store(true, Ordering::Release);
                    if attempt >= 2 {
                        return Err(h2_err(e));
                    }
                }
            }
        };
        let request = Request::builder()
            .method(Method::CONNECT)
            .uri(target.to_string())
            .header("forwarded", format!("for=\"{client}\""))
            .body(())?;
        let (response, stream) = send.send_request(request, false).map_err(h2_err)?;
        let response = response.await.map_err(h2_err)?;
        if response.status() != StatusCode::OK {
            return Err(HboneError::Status {
                peer: key.dst,
                target,
                status: response.status(),
            });
        }
        Ok(Tunnel {
            send: stream,
            recv: response.into_body(),
            connection: conn.id,
            _guard: guard,
        })
    }

    /// A connection of `slot` with room for a stream, opening one if none
    /// has. Holding the slot while a handshake runs is what makes a burst
    /// of openers wait for one connection instead of opening one each.
    async fn pick(
        &self,
        slot: &Slot,
        key: &PoolKey,
        sockets: &SocketFactory,
    ) -> Result<Arc<PooledConn>, HboneError> {
        let mut conns = slot.lock().await;
        conns.retain(|c| !c.closed.load(Ordering::Acquire));
        let found = conns
            .iter()
            .find(|c| c.streams.load(Ordering::Acquire) < CLIENT_MAX_STREAMS)
            .cloned();
        let conn = if let Some(conn) = found {
            self.reused.fetch_add(1, Ordering::Relaxed);
            conn
        } else {
            let conn = self.open(key, sockets).await?;
            conns.push(Arc::clone(&conn));
            conn
        };
        conn.streams.fetch_add(1, Ordering::AcqRel);
        Ok(conn)
    }

    async fn open(
        &self,
        key: &PoolKey,
        sockets: &SocketFactory,
    ) -> Result<Arc<PooledConn>, HboneError> {
        let peer = key.dst;
        let tcp = sockets
            .connect(peer)
            .await
            .map_err(|e| HboneError::Proxy(Box::new(e)))?;
        let config =
            crate::tls::client_config(&self.certs, &key.src, vec![key.dst_identity.clone()])?;
        let tls = TlsConnector::from(config)
            .connect(ServerName::IpAddress(peer.ip().into()), tcp)
            .await
            .map_err(|source| HboneError::Tls { peer, source })?;
        if tls.get_ref().1.alpn_protocol() != Some(crate::tls::ALPN_H2) {
            return Err(HboneError::NoAlpn(peer));
        }
        self.handshakes.fetch_add(1, Ordering::Relaxed);
        let (send, connection) = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_frame_size(MAX_FRAME)
            .enable_push(false)
            .handshake::<_, Bytes>(tls)
            .await
            .map_err(|source| HboneError::H2 { peer, source })?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let pooled = Arc::new(PooledConn {
            id,
            send,
            streams: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            idle_since: Mutex::new(Instant::now()),
        });
        tracing::info!(connection = id, %peer, src = %key.src, dst_identity = %key.dst_identity, "HBONE connection established");
        tokio::spawn(drive(
            connection,
            Arc::clone(&pooled),
            peer,
            self.idle_timeout,
        ));
        Ok(pooled)
    }
}

/// Runs one pooled connection: polls it, sends keep-alive PINGs, and closes
/// it when idle too long, when a PING goes unanswered, or on error.
async fn drive(
    mut connection: h2::client::Connection<
        tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
        Bytes,
    >,
    pooled: Arc<PooledConn>,
    peer: SocketAddr,
    idle_timeout: Duration,
) {
    let dead = Arc::new(tokio::sync::Notify::new());
    if let Some(mut ping) = connection.ping_pong() {
        let dead = Arc::clone(&dead);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PING_INTERVAL).await;
                if !matches!(
                    tokio::time::timeout(PING_TIMEOUT, ping.ping(h2::Ping::opaque())).await,
                    Ok(Ok(_))
                ) {
                    dead.notify_one();
                    return;
                }
            }
        });
    }
    let mut check = tokio::time::interval(Duration::from_secs(1).min(idle_timeout));
    let reason = loop {
        tokio::select! {
            result = &mut connection => break match result {
                Ok(()) => "closed by peer".to_owned(),
                Err(e) => format!("error: {e}"),
            },
            () = dead.notified() => break "PING timed out".to_owned(),
            _ = check.tick() => {
                let idle = pooled.streams.load(Ordering::Acquire) == 0
                    && pooled.idle_since.lock().is_ok_and(|t| t.elapsed() >= idle_timeout);
                if idle {
                    break "idle timeout".to_owned();
                }
            }
        }
    };
    pooled.closed.store(true, Ordering::Release);
    tracing::info!(connection = pooled.id, %peer, %reason, "HBONE connection closed");
}

/// The well-known HBONE address of a pod.
pub fn hbone_addr(pod_ip: IpAddr) -> SocketAddr {
    SocketAddr::new(pod_ip, INBOUND_HBONE_PORT)
}
