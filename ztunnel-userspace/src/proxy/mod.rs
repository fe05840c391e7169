//! The userspace proxy: listeners inside each enrolled pod, and what happens
//! to each accepted connection.
//!
//! - [`listeners`]: opens 15001/15006/15008 inside a pod's namespace.
//! - [`socket_factory`]: creates ztunnel's marked sockets inside a pod (the
//!   worker enters the pod's namespace for the `socket()` call alone;
//!   sockets keep the namespace they are born in).
//! - [`outbound`]: 15001, recovers the original destination from the kernel
//!   and carries the connection (passthrough TCP for now; HBONE next).
//! - [`inbound`]: 15006, the accepted socket's local address is the
//!   original destination; 15008, HBONE (mTLS + CONNECT) termination.
//! - [`admission`]: who may reach an enrolled pod, decided once for the
//!   three paths that deliver to it (15006, 15008, the same-node path).
//! - [`connections`]: the open inbound connections, re-checked against the
//!   policy whenever the mesh state changes.
//! - [`relay`]: bytes between two TCP sockets (copied, or spliced in the
//!   kernel once a direction streams).

pub mod admission;
pub mod connections;
pub mod inbound;
pub mod listeners;
pub mod outbound;
pub mod pod_routing;
pub mod relay;
pub mod socket_factory;
pub mod socks5;

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::Arc,
    sync::atomic::{AtomicU64, Ordering},
};

use tokio::net::TcpStream;

use crate::{
    hbone::pool::HbonePool,
    identity::{CertManager, Identity},
    state::{MeshState, StateHandle},
};

/// What every pod's proxy shares: the mesh state, certificates and the
/// HBONE connection pool.
#[derive(Debug, Clone)]
pub struct Shared {
    /// Current mesh state (swapped on config reload, through
    /// [`Shared::publish_state`]).
    pub state: StateHandle,
    /// Open inbound connections (where policy is enforced), so that a new
    /// state closes those it no longer allows.
    pub connections: Arc<connections::OpenConnections>,
    /// Workload certificates.
    pub certs: Arc<CertManager>,
    /// Pooled HBONE connections.
    pub pool: Arc<HbonePool>,
    /// Metrics.
    pub metrics: Arc<crate::telemetry::Metrics>,
    /// Set to `true` when draining starts (HBONE servers send GOAWAY).
    pub draining: Arc<tokio::sync::watch::Sender<bool>>,
    /// Pods enrolled on this node by IP, for the same-node fast path
    /// (`None` when the fast path is off).
    pub local_pods: Option<Arc<std::sync::RwLock<HashMap<IpAddr, PodContext>>>>,
    /// Limits on each phase where a peer can stall a connection.
    pub timeouts: crate::timeouts::Timeouts,
    /// Connection, handshake and enrolment-client limits and their counts.
    pub limits: Arc<crate::limits::NodeLimits>,
    /// The pipes TCP-to-TCP relays may splice streaming directions with
    /// (`--splice-pipes`; `None` with `--splice off` or `--sockmap on`, see
    /// [`relay`]).
    pub pipes: Option<Arc<relay::Pipes>>,
}

impl Shared {
    /// Replaces the mesh state, then closes the open connections the new
    /// state denies. Returns how many were closed. (In this order: see
    /// [`connections`] for why.)
    pub fn publish_state(&self, state: MeshState) -> usize {
        self.state.replace(state);
        self.connections
            .enforce(&self.state.current(), &self.metrics)
    }

    /// Drops what the proxy kept for a pod that left (addresses `ips`): its
    /// HBONE pool slots, and `identity`'s certificate when no enrolled pod
    /// has that identity any more.
    pub fn forget_pod(&self, ips: &[IpAddr], identity: Option<&Identity>) {
        let slots = self.pool.forget_source(ips);
        let certificate = identity.is_some_and(|id| self.certs.forget(id));
        tracing::debug!(
            slots,
            certificate,
            "dropped the pool slots and certificate of a removed pod"
        );
    }

    /// The enrolled pod owning `ip`, when the same-node fast path is on.
    pub fn local_pod(&self, ip: IpAddr) -> Option<PodContext> {
        let pods = self.local_pods.as_ref()?;
        pods.read().ok()?.get(&ip).cloned()
    }
}

/// A pod as the proxy sees it.
#[derive(Debug, Clone)]
pub struct PodContext {
    /// Pod uid, for logs.
    pub uid: String,
    /// The pod's workload identity.
    pub identity: Identity,
    /// The pod's addresses (from its `eth0`).
    pub ips: Vec<IpAddr>,
    /// The pod's netns cookie (part of the `ORIG_DST` key).
    pub netns_cookie: u64,
    /// Creates ztunnel's sockets inside the pod.
    pub sockets: socket_factory::SocketFactory,
    /// Original destinations come from `SO_ORIGINAL_DST` (iptables
    /// backend) instead of the kernel programs' maps.
    pub orig_dst_sockopt: bool,
}

impl PodContext {
    /// The pod's address of the same family as `other`.
    pub fn ip_like(&self, other: IpAddr) -> Option<IpAddr> {
        self.ips
            .iter()
            .copied()
            .find(|ip| ip.is_ipv6() == other.is_ipv6())
    }
}

/// Errors of proxying one connection.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The kernel had no original destination for an accepted connection.
    #[error(
        "no original destination recorded for client {0} (the pod is at its --max-pod-pending-connects share, or the node's ORIG_DST map is full): connection reset (fail closed)"
    )]
    NoOrigDst(SocketAddr),
    /// The destination is one of ztunnel's own ports (would loop).
    #[error("destination {0} is one of ztunnel's own ports")]
    OwnPort(SocketAddr),
    /// Connecting upstream failed.
    #[error("connecting to {dst} failed: {source}")]
    Connect {
        /// Where.
        dst: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// I/O while copying.
    #[error("copying: {0}")]
    Io(#[from] std::io::Error),
    /// The HBONE leg failed.
    #[error(transparent)]
    Hbone(#[from] crate::hbone::HboneError),
    /// The outbound traffic policy refused the destination.
    #[error("denied: {0}")]
    Denied(&'static str),
    /// The destination cannot take the connection now (its pod or the
    /// node is at a limit): like a peer's 503 over HBONE, the client is
    /// reset.
    #[error("unavailable: {0}")]
    Unavailable(&'static str),
    /// The pod has no address of the needed family.
    #[error("pod has no {0} address")]
    NoPodAddress(&'static str),
    /// A phase ran out of time.
    #[error(transparent)]
    TimedOut(#[from] crate::timeouts::TimedOut),
}

impl ProxyError {
    /// Whether the failure was on the way to the destination (connect
    /// refused or timed out, a handshake, the peer's answer) rather than a
    /// decision to refuse: then the application's connection is reset, so
    /// that it sees a failure at once, as it would without the mesh,
    /// rather than a clean, empty stream.
    pub fn is_upstream_failure(&self) -> bool {
        !matches!(self, Self::Denied(_) | Self::OwnPort(_))
    }
}

/// Connects from inside a pod (see [`socket_factory::SocketFactory::connect_from`])
/// within the connect timeout; a timeout is logged and counted.
pub async fn connect_within(
    shared: &Shared,
    sockets: &socket_factory::SocketFactory,
    dst: SocketAddr,
    source: Option<IpAddr>,
) -> Result<TcpStream, ProxyError> {
    let connect = sockets.connect_from(dst, source);
    crate::timeouts::within(
        crate::timeouts::Phase::Connect,
        shared.timeouts.connect,
        dst,
        &shared.metrics,
        connect,
    )
    .await?
}

/// Whether `port` is one of ztunnel's own listener ports: a connection to
/// it would loop back into ztunnel, so both inbound paths refuse it.
pub(crate) fn is_own_port(port: u16) -> bool {
    use ztunnel_common::{INBOUND_HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT, SOCKS5_PORT};
    matches!(
        port,
        OUTBOUND_PORT | INBOUND_PLAINTEXT_PORT | INBOUND_HBONE_PORT | SOCKS5_PORT
    )
}

/// A connection id for log correlation.
pub fn next_connection_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Copies both ways until both directions are done, honouring half-close,
/// then closes `record` (metrics and the access log line). With `policy`,
/// a revocation (the policy no longer allows the connection) closes both
/// sides early. Splice pipes come from pod `pod`'s share.
pub async fn relay(
    shared: &Shared,
    pod: &str,
    downstream: TcpStream,
    upstream: TcpStream,
    record: crate::telemetry::ConnectionRecord,
    policy: Option<connections::Registration>,
) -> Result<(), ProxyError> {
    // Boxed: the relay's future (two directions, each with its copy and
    // splice states) is larger than the HBONE copy's, and a connection's
    // task is sized for its largest path; unboxed, every HBONE connection
    // would carry it too (about 1 KiB each, seen with 10,000 connections).
    let copy = Box::pin(relay::both_ways(
        &downstream,
        &upstream,
        shared.pipes.as_ref().map(|pipes| pipes.for_pod(pod)),
    ));
    let copied = match policy {
        Some(registration) => registration.unless_revoked(copy).await,
        None => copy.await,
    };
    match copied {
        Ok((sent, received)) => {
            shared
                .metrics
                .spliced
                .inc_by(sent.spliced + received.spliced);
            record.close(sent.bytes, received.bytes, &Ok(()));
            Ok(())
        }
        Err(e) => {
            record.close(0, 0, &Err(e.to_string()));
            Err(e.into())
        }
    }
}
