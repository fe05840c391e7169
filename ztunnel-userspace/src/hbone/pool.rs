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
use tokio::{net::TcpStream, sync::watch};
use tokio_rustls::TlsConnector;
use ztunnel_common::INBOUND_HBONE_PORT;

use super::{
    CLIENT_MAX_STREAMS, CONNECTION_WINDOW, HboneError, MAX_FRAME, PING_INTERVAL, PING_TIMEOUT,
    SPARE_IDLE_TIMEOUT, STREAM_WINDOW, early::Early,
};
use crate::{
    identity::{CertManager, Identity},
    proxy::socket_factory::SocketFactory,
    telemetry::{
        Metrics,
        metrics::{HandshakeOutcome, HandshakeSide},
    },
    timeouts::{Phase, Timeouts, within},
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

/// What the pool is configured with.
#[derive(Debug, Clone, Copy)]
pub struct PoolSettings {
    /// Idle pooled connections are closed after this long.
    pub idle_timeout: Duration,
    /// Limits on connect, handshakes and `CONNECT` responses.
    pub timeouts: Timeouts,
}

struct PooledConn {
    id: u64,
    send: SendRequest<Bytes>,
    streams: AtomicUsize,
    closed: AtomicBool,
    idle_since: Mutex<Instant>,
    /// No new streams after this (`identity::connection_expiry`).
    expires: std::time::SystemTime,
}

/// How the open that other streams wait for ended.
#[derive(Debug, Clone)]
enum Opening {
    /// Still connecting or handshaking.
    Pending,
    /// The connection is in the slot.
    Ready,
    /// It failed; the waiters fail with the same reason instead of each
    /// trying again (a dead peer costs one connect timeout, not one per
    /// stream in a queue).
    Failed(Arc<str>),
}

/// An open under way, announced in its slot.
struct PendingOpen {
    /// Tells this open apart from the others of its slot.
    id: u64,
    outcome: watch::Receiver<Opening>,
    /// Streams that chose to wait for it. Once they would fill the new
    /// connection, the next stream starts another open beside it instead
    /// of queueing behind it: a burst of N streams costs about N / 100
    /// opens run side by side, and every stream waits for one open, not
    /// for a queue of them.
    waiters: usize,
}

/// The connections of one destination. Its lock is never held across an
/// await: an open runs outside it, announced in `opening`, so a stalled
/// handshake holds up only the streams that chose to wait for it, and them
/// no longer than the open's own time limits.
#[derive(Default)]
struct Slot {
    conns: Vec<Arc<PooledConn>>,
    opening: Vec<PendingOpen>,
    /// Taken out of the pool's map (its source pod left, or its last
    /// connection ended): a stream that still holds it looks the key up
    /// again instead of opening a connection nobody else would find.
    detached: bool,
}

type SlotRef = Arc<Mutex<Slot>>;

/// Every slot, by key. A slot lives while it has a connection or an open
/// under way: the last connection to end takes it out (see [`Home`]), and
/// a pod that leaves takes its own out ([`HbonePool::forget_source`]), so
/// the map follows the pods and peers in use instead of growing with every
/// one ever seen.
type SlotMap = HashMap<PoolKey, SlotRef>;

fn lock(slot: &Mutex<Slot>) -> std::sync::MutexGuard<'_, Slot> {
    slot.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn lock_map(slots: &Mutex<SlotMap>) -> std::sync::MutexGuard<'_, SlotMap> {
    slots
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Where a pooled connection is listed, so that when it ends it takes
/// itself out, and its slot too when that is left empty. Lock order, here
/// as everywhere: the map, then a slot.
struct Home {
    slots: Arc<Mutex<SlotMap>>,
    key: PoolKey,
    slot: SlotRef,
}

impl Home {
    /// Whether `conn` closes now, and why: it carries no stream and was
    /// retired, has been idle for `idle_timeout`, or for
    /// [`SPARE_IDLE_TIMEOUT`] while an older connection of its slot is idle
    /// too. Decided under the slot's lock, where streams are taken, so no
    /// stream picks a connection that is closing.
    fn close_reason(&self, conn: &PooledConn, idle_timeout: Duration) -> Option<&'static str> {
        let slot = lock(&self.slot);
        if conn.streams.load(Ordering::Acquire) != 0 {
            return None;
        }
        let idle_for = conn
            .idle_since
            .lock()
            .map(|t| t.elapsed())
            .unwrap_or_default();
        let spare = || {
            idle_for >= SPARE_IDLE_TIMEOUT
                && slot.conns.iter().any(|c| {
                    c.id < conn.id
                        && !c.closed.load(Ordering::Acquire)
                        && c.streams.load(Ordering::Acquire) == 0
                })
        };
        let reason = if conn.closed.load(Ordering::Acquire) {
            "retired"
        } else if idle_for >= idle_timeout {
            "idle timeout"
        } else if spare() {
            "another connection to the peer is idle"
        } else {
            return None;
        };
        conn.closed.store(true, Ordering::Release);
        Some(reason)
    }

    fn leave(&self, conn: &Arc<PooledConn>) {
        lock(&self.slot).conns.retain(|c| !Arc::ptr_eq(c, conn));
        drop_if_empty(&self.slots, &self.key, &self.slot);
    }
}

/// Takes `slot` out of the map when it holds no connection and no open is
/// under way.
fn drop_if_empty(slots: &Mutex<SlotMap>, key: &PoolKey, slot: &SlotRef) {
    let mut map = lock_map(slots);
    let mut inner = lock(slot);
    let listed = map.get(key).is_some_and(|s| Arc::ptr_eq(s, slot));
    if listed && inner.conns.is_empty() && inner.opening.is_empty() {
        inner.detached = true;
        map.remove(key);
    }
}

/// Rounds of [`HbonePool::pick`] before giving up: each round takes a
/// connection, opens one, or waits for an open that ended; only a
/// connection filled by others in the meantime (streams that arrived
/// while it opened), or an opener whose client went away, sends a stream
/// round again. Each round is bounded in time by the open it waits for.
const PICK_ROUNDS: usize = 6;

/// How many connections one `CONNECT` is tried on when they turn out to be
/// closed or going away before the stream was taken.
const CONNECT_ATTEMPTS: usize = 3;

/// Held by the stream that opens a connection for its slot. However the
/// open ends (success, failure, or the stream's task being dropped), the
/// slot stops announcing it and the waiters learn the outcome (a dropped
/// sender tells them to look again).
struct OpenGuard<'a> {
    slots: &'a Mutex<SlotMap>,
    key: &'a PoolKey,
    slot: &'a SlotRef,
    /// Which of the slot's opens this is.
    id: u64,
    /// `None` once the outcome is published.
    tx: Option<watch::Sender<Opening>>,
}

impl OpenGuard<'_> {
    fn finish(mut self, conn: Result<&Arc<PooledConn>, &HboneError>) {
        let outcome = {
            let mut slot = lock(self.slot);
            slot.opening.retain(|o| o.id != self.id);
            match conn {
                Ok(conn) => {
                    if slot.detached {
                        // Its pod left meanwhile: carry this one stream,
                        // then close.
                        conn.closed.store(true, Ordering::Release);
                    }
                    slot.conns.push(Arc::clone(conn));
                    Opening::Ready
                }
                Err(e) => Opening::Failed(e.to_string().into()),
            }
        };
        if let Some(tx) = self.tx.take() {
            tx.send_replace(outcome);
        }
        if conn.is_err() {
            drop_if_empty(self.slots, self.key, self.slot);
        }
    }
}

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        // Not finished: the opening stream went away mid-open. Its
        // waiters see the sender dropped and look again.
        if self.tx.is_some() {
            lock(self.slot).opening.retain(|o| o.id != self.id);
            drop_if_empty(self.slots, self.key, self.slot);
        }
    }
}

/// What a stream does after looking at its slot.
enum Pick {
    Take(Arc<PooledConn>),
    Open(watch::Sender<Opening>, u64),
    Wait(watch::Receiver<Opening>),
    /// The slot left the map between the lookup and the look: look again.
    Moved,
}

/// The pool. Cheap to share (`Arc`).
pub struct HbonePool {
    certs: Arc<CertManager>,
    slots: Arc<Mutex<SlotMap>>,
    settings: PoolSettings,
    metrics: Arc<Metrics>,
    next_id: AtomicU64,
    next_open: AtomicU64,
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
    /// Bytes of the application's sent before the peer answered (see
    /// [`super::early`]); the copy counts from there.
    pub early: u64,
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
    /// An empty pool issuing client certificates from `certs` and counting
    /// timeouts in `metrics`.
    pub fn new(certs: Arc<CertManager>, settings: PoolSettings, metrics: Arc<Metrics>) -> Self {
        Self {
            certs,
            slots: Arc::default(),
            settings,
            metrics,
            next_id: AtomicU64::new(1),
            next_open: AtomicU64::new(0),
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

    /// Slots (one per source pod, source identity, destination and
    /// destination identity in use).
    pub fn slots(&self) -> usize {
        lock_map(&self.slots).len()
    }

    /// Drops the slots of a pod that left (its addresses `ips`). Their
    /// connections take no new stream and close once their last stream
    /// ends. Returns how many slots were dropped.
    pub fn forget_source(&self, ips: &[IpAddr]) -> usize {
        let mut dropped = 0;
        lock_map(&self.slots).retain(|key, slot| {
            if !ips.contains(&key.src_ip) {
                return true;
            }
            let mut slot = lock(slot);
            slot.detached = true;
            for conn in &slot.conns {
                conn.closed.store(true, Ordering::Release);
            }
            dropped += 1;
            false
        });
        dropped
    }

    /// The slot of `key`, made on first use.
    fn slot(&self, key: &PoolKey) -> SlotRef {
        let mut slots = lock_map(&self.slots);
        if let Some(slot) = slots.get(key) {
            return Arc::clone(slot);
        }
        Arc::clone(slots.entry(key.clone()).or_default())
    }

    /// Open pooled connections.
    pub fn open_connections(&self) -> usize {
        let slots = lock_map(&self.slots);
        slots
            .values()
            .map(|s| {
                lock(s)
                    .conns
                    .iter()
                    .filter(|c| !c.closed.load(Ordering::Relaxed))
                    .count()
            })
            .sum()
    }

    /// Opens a `CONNECT` stream to `target` through the destination pod's
    /// HBONE port, on a pooled connection for `key` (opening one if none
    /// has room). `client` goes into the `forwarded` header, and so does
    /// `service` (the hostname of the service the application addressed,
    /// as `host=`, the way Istio's ztunnel tells the destination). What
    /// `app` (the application's connection) writes while the peer answers
    /// goes ahead on the stream (see [`super::early`]).
    pub async fn connect(
        &self,
        key: PoolKey,
        sockets: &SocketFactory,
        target: SocketAddr,
        client: SocketAddr,
        service: Option<&str>,
        app: Option<&TcpStream>,
    ) -> Result<Tunnel, HboneError> {
        let peer = key.dst;
        let h2_err = |source| HboneError::H2 { peer, source };
        let limit = self.settings.timeouts.connect_response;
        // A pooled connection may have been closed by the peer (GOAWAY on
        // drain, an idle timeout) since we last looked: then it is dropped
        // from the pool and the stream is tried again on a fresh one. The
        // same when the peer refuses the stream itself because it is going
        // away (its GOAWAY crossed our request): a refused stream was never
        // seen by the application, so it is safe to send again. This is
        // what lets a draining peer (an upgrade) cost no connection.
        let mut attempt = 0;
        let mut early = Early::default();
        let (conn, guard, stream, response) = loop {
            attempt += 1;
            let conn = self.pick(&key, sockets).await?;
            let guard = StreamGuard(Arc::clone(&conn));
            let request = Request::builder()
                .method(Method::CONNECT)
                .uri(target.to_string())
                .header("forwarded", forwarded(client, service))
                .body(())?;
            // Waits for the peer to allow one more stream.
            let ready = conn.send.clone().ready();
            let sent =
                match within(Phase::ConnectResponse, limit, peer, &self.metrics, ready).await? {
                    Ok(mut send) => send.send_request(request, false),
                    Err(e) => Err(e),
                };
            // Until the request is out, any failure is the connection's
            // (closed, going away): the stream was never sent.
            let (response, mut stream) = match sent {
                Ok(sent) => sent,
                Err(e) => {
                    conn.closed.store(true, Ordering::Release);
                    if attempt >= CONNECT_ATTEMPTS {
                        return Err(h2_err(e));
                    }
                    tracing::debug!(%peer, attempt, error = %e, "HBONE connection unusable: trying another");
                    continue;
                }
            };
            // A retry sends first what went ahead on the refused stream.
            let answer = match early.replay(&mut stream) {
                Ok(()) => {
                    let waited = early.send_until_response(&mut stream, response, app);
                    // Dropping the response future on expiry resets the stream.
                    within(Phase::ConnectResponse, limit, peer, &self.metrics, waited).await?
                }
                Err(e) => Err(e),
            };
            match answer {
                Ok(response) => break (conn, guard, stream, response),
                Err(e) if e.is_go_away() || e.reason() == Some(h2::Reason::REFUSED_STREAM) => {
                    conn.closed.store(true, Ordering::Release);
                    if attempt >= CONNECT_ATTEMPTS {
                        return Err(h2_err(e));
                    }
                    tracing::debug!(%peer, attempt, error = %e, "HBONE stream refused by a peer going away: trying another connection");
                }
                Err(e) => return Err(h2_err(e)),
            }
        };
        if response.status() != StatusCode::OK {
            return Err(HboneError::Status {
                peer,
                target,
                status: response.status(),
            });
        }
        Ok(Tunnel {
            send: stream,
            recv: response.into_body(),
            connection: conn.id,
            early: early.len(),
            _guard: guard,
        })
    }

    /// A connection of `slot` with room for a stream, with that stream
    /// counted. When none has room, the first stream opens one and the
    /// streams arriving meanwhile wait for it (a burst shares one
    /// handshake per 100 streams, see [`PendingOpen::waiters`]), for no
    /// longer than an open may take; when the open fails they fail with it.
    async fn pick(
        &self,
        key: &PoolKey,
        sockets: &SocketFactory,
    ) -> Result<Arc<PooledConn>, HboneError> {
        let peer = key.dst;
        for _ in 0..PICK_ROUNDS {
            let slot = self.slot(key);
            let next = {
                let mut slot = lock(&slot);
                slot.conns.retain(|c| !c.closed.load(Ordering::Acquire));
                let now = std::time::SystemTime::now();
                // A connection whose certificates have expired carries its
                // open streams to their end but takes no new one.
                let found = slot
                    .conns
                    .iter()
                    .find(|c| {
                        c.streams.load(Ordering::Acquire) < CLIENT_MAX_STREAMS && now < c.expires
                    })
                    .cloned();
                if slot.detached {
                    Pick::Moved
                } else if let Some(conn) = found {
                    conn.streams.fetch_add(1, Ordering::AcqRel);
                    Pick::Take(conn)
                } else if let Some(open) = slot
                    .opening
                    .iter_mut()
                    // The opener's own stream is one of the connection's.
                    .find(|o| o.waiters + 1 < CLIENT_MAX_STREAMS)
                {
                    open.waiters += 1;
                    Pick::Wait(open.outcome.clone())
                } else {
                    let (tx, rx) = watch::channel(Opening::Pending);
                    let id = self.next_open.fetch_add(1, Ordering::Relaxed);
                    slot.opening.push(PendingOpen {
                        id,
                        outcome: rx,
                        waiters: 0,
                    });
                    Pick::Open(tx, id)
                }
            };
            match next {
                Pick::Take(conn) => {
                    self.reused.fetch_add(1, Ordering::Relaxed);
                    return Ok(conn);
                }
                Pick::Open(tx, id) => {
                    let guard = OpenGuard {
                        slots: &self.slots,
                        key,
                        slot: &slot,
                        id,
                        tx: Some(tx),
                    };
                    let home = Home {
                        slots: Arc::clone(&self.slots),
                        key: key.clone(),
                        slot: Arc::clone(&slot),
                    };
                    let opened = self.open(key, sockets, home).await;
                    if let Ok(conn) = &opened {
                        // Our own stream, before others can fill it.
                        conn.streams.fetch_add(1, Ordering::AcqRel);
                    }
                    guard.finish(opened.as_ref());
                    return opened;
                }
                Pick::Wait(mut opening) => {
                    let ended = opening.wait_for(|o| !matches!(o, Opening::Pending));
                    let limit = self.settings.timeouts.hbone_open();
                    let outcome = within(Phase::PoolWait, limit, peer, &self.metrics, ended)
                        .await?
                        .map(|o| (*o).clone());
                    if let Ok(Opening::Failed(reason)) = outcome {
                        return Err(HboneError::OpenFailed {
                            peer,
                            reason: reason.to_string(),
                        });
                    }
                    // Ready, or the opener went away: look again.
                }
                Pick::Moved => {}
            }
        }
        Err(HboneError::PoolBusy(peer))
    }

    /// Opens one connection: TCP, TLS, HTTP/2, each under its time limit.
    async fn open(
        &self,
        key: &PoolKey,
        sockets: &SocketFactory,
        home: Home,
    ) -> Result<Arc<PooledConn>, HboneError> {
        let peer = key.dst;
        let timeouts = &self.settings.timeouts;
        let metrics = &self.metrics;
        // With Istio's CA a new pod's first connection may come before its
        // certificate: wait for it (bounded) instead of failing at once.
        let own_cert = self
            .certs
            .wait_ready(&key.src, timeouts.tls_handshake)
            .await?;
        let tcp = within(
            Phase::Connect,
            timeouts.connect,
            peer,
            metrics,
            sockets.connect(peer),
        )
        .await?
        .map_err(|e| HboneError::Proxy(Box::new(e)))?;
        let config =
            crate::tls::client_config(&self.certs, &key.src, vec![key.dst_identity.clone()])?;
        let handshake =
            TlsConnector::from(config).connect(ServerName::IpAddress(peer.ip().into()), tcp);
        let count = |outcome| metrics.handshake(HandshakeSide::Client, outcome);
        let tls = match within(
            Phase::TlsHandshake,
            timeouts.tls_handshake,
            peer,
            metrics,
            handshake,
        )
        .await
        {
            Ok(Ok(tls)) => tls,
            Ok(Err(source)) => {
                count(HandshakeOutcome::Failed);
                return Err(HboneError::Tls { peer, source });
            }
            Err(timed_out) => {
                count(HandshakeOutcome::Timeout);
                return Err(timed_out.into());
            }
        };
        if tls.get_ref().1.alpn_protocol() != Some(crate::tls::ALPN_H2) {
            count(HandshakeOutcome::Failed);
            return Err(HboneError::NoAlpn(peer));
        }
        count(HandshakeOutcome::Ok);
        let expires =
            crate::identity::connection_expiry(&own_cert, tls.get_ref().1.peer_certificates());
        self.handshakes.fetch_add(1, Ordering::Relaxed);
        let handshake = h2::client::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_frame_size(MAX_FRAME)
            .enable_push(false)
            .handshake::<_, Bytes>(tls);
        let (send, connection) = within(
            Phase::H2Handshake,
            timeouts.h2_handshake,
            peer,
            metrics,
            handshake,
        )
        .await?
        .map_err(|source| HboneError::H2 { peer, source })?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let pooled = Arc::new(PooledConn {
            id,
            send,
            streams: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            idle_since: Mutex::new(Instant::now()),
            expires,
        });
        tracing::info!(connection = id, %peer, src = %key.src, dst_identity = %key.dst_identity, "HBONE connection established");
        tokio::spawn(drive(
            connection,
            Arc::clone(&pooled),
            peer,
            self.settings.idle_timeout,
            home,
        ));
        Ok(pooled)
    }
}

/// Runs one pooled connection: polls it, sends keep-alive PINGs, and closes
/// it when idle too long ([`Home::close_reason`]), when a PING goes
/// unanswered, or on error. Then it takes itself out of the pool.
async fn drive(
    mut connection: h2::client::Connection<
        tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
        Bytes,
    >,
    pooled: Arc<PooledConn>,
    peer: SocketAddr,
    idle_timeout: Duration,
    home: Home,
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
                if let Some(reason) = home.close_reason(&pooled, idle_timeout) {
                    break reason.to_owned();
                }
            }
        }
    };
    pooled.closed.store(true, Ordering::Release);
    home.leave(&pooled);
    tracing::info!(connection = pooled.id, %peer, %reason, "HBONE connection closed");
}

/// The `forwarded` header of a `CONNECT` (RFC 7239): the application's
/// address, and the service it addressed when it went to a VIP. A
/// hostname with characters a token may not hold is left out rather than
/// quoted: the config is ours, but a header that fails to build would fail
/// the connection.
fn forwarded(client: SocketAddr, service: Option<&str>) -> String {
    let token = |h: &&str| {
        !h.is_empty()
            && h.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
    };
    match service.filter(token) {
        Some(host) => format!("for=\"{client}\";host={host}"),
        None => format!("for=\"{client}\""),
    }
}

/// The well-known HBONE address of a pod.
pub fn hbone_addr(pod_ip: IpAddr) -> SocketAddr {
    SocketAddr::new(pod_ip, INBOUND_HBONE_PORT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_forwarded_header_names_the_service_when_it_can() {
        let client: SocketAddr = "10.0.0.9:4000".parse().expect("addr");
        assert_eq!(
            forwarded(client, Some("web.test.svc.cluster.local")),
            "for=\"10.0.0.9:4000\";host=web.test.svc.cluster.local"
        );
        assert_eq!(forwarded(client, None), "for=\"10.0.0.9:4000\"");
        // Not a token: left out rather than breaking the header.
        assert_eq!(
            forwarded(client, Some("we b;x=\"y\"")),
            "for=\"10.0.0.9:4000\""
        );
    }
}
