//! HBONE: TCP tunnelled in HTTP/2 `CONNECT` streams over mutual TLS.
//!
//! - [`pool`]: the client side. HTTP/2 connections shared by streams with
//!   the same (source pod, source identity, destination address,
//!   destination identity); up to 100 concurrent openers wait on one
//!   handshake (more start opens beside it), for no longer than its time
//!   limits, and fail with it.
//! - [`server`]: the 15008 side. Terminates TLS and `CONNECT`, checks the
//!   target, connects to the application from inside the pod with the
//!   client's IP as source.
//! - [`linger`]: a server connection's close waits (bounded) for the
//!   client's end of stream, so that no unread frame turns it into a reset.
//! - [`early`]: what the application writes while its `CONNECT` waits for
//!   the peer's answer goes ahead, with a bounded copy for a refused stream.
//! - [`copy`]: moves bytes between a TCP socket and an HTTP/2 stream with
//!   back-pressure both ways and half-close.
//!
//! HTTP/2 settings (Istio's values, so either side can be the peer, and
//! sized for bulk transfer): stream window 4 MiB, connection window 16 MiB,
//! max frame 1 MiB, push off, 100 streams per pooled connection (servers
//! allow 200), PING every 10 s with a 20 s timeout, idle pooled connections
//! closed after 5 min (after 10 s when another of the same slot is idle).

pub mod copy;
pub mod early;
mod linger;
pub mod pool;
pub mod server;

use std::time::Duration;

/// Initial stream flow-control window.
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
/// Connection flow-control window.
pub const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
/// Largest frame we accept.
pub const MAX_FRAME: u32 = 1024 * 1024;
/// Streams a pooled client connection carries before another is opened.
pub const CLIENT_MAX_STREAMS: usize = 100;
/// Concurrent streams a server connection accepts.
pub const SERVER_MAX_STREAMS: u32 = 200;
/// Keep-alive PING interval.
pub const PING_INTERVAL: Duration = Duration::from_secs(10);
/// A PING without answer for this long closes the connection.
pub const PING_TIMEOUT: Duration = Duration::from_secs(20);
/// Idle pooled connections are closed after this long.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// A pooled connection idle this long while an older connection of its
/// slot is idle too is closed without waiting for the idle timeout: a
/// burst of streams opens one connection per 100, and each holds about
/// 100 KiB (the HTTP/2 stream table, which never shrinks, and the TLS and
/// HTTP/2 buffers) for as long as it lives. One idle connection per slot
/// is enough to take the next stream at once; 10 s rides out back-to-back
/// bursts without new handshakes.
pub const SPARE_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the HBONE layer; each names the peer or target.
#[derive(Debug, thiserror::Error)]
pub enum HboneError {
    /// TCP to the peer's 15008 failed.
    #[error("connecting to {peer}: {source}")]
    Connect {
        /// The peer.
        peer: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The TLS handshake failed (wrong SAN, unknown CA, not TLS, ...).
    #[error("TLS with {peer}: {source}")]
    Tls {
        /// The peer.
        peer: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The peer did not agree on ALPN `h2`.
    #[error("{0} did not negotiate ALPN h2")]
    NoAlpn(std::net::SocketAddr),
    /// HTTP/2 failure.
    #[error("HTTP/2 with {peer}: {source}")]
    H2 {
        /// The peer.
        peer: std::net::SocketAddr,
        /// Why.
        source: h2::Error,
    },
    /// The peer answered the CONNECT with a non-200 status.
    #[error("{peer} answered CONNECT {target} with {status}")]
    Status {
        /// The peer.
        peer: std::net::SocketAddr,
        /// The requested target.
        target: std::net::SocketAddr,
        /// The status.
        status: http::StatusCode,
    },
    /// Building the TLS configuration failed.
    #[error(transparent)]
    Config(#[from] crate::tls::TlsError),
    /// The source workload has no certificate (Istio's CA has not issued
    /// one); nothing is sent without it.
    #[error(transparent)]
    NoCertificate(#[from] crate::identity::IdentityError),
    /// The pod's socket factory failed.
    #[error(transparent)]
    Proxy(#[from] Box<crate::proxy::ProxyError>),
    /// Request building failed.
    #[error("bad CONNECT request: {0}")]
    Request(#[from] http::Error),
    /// A phase ran out of time.
    #[error(transparent)]
    TimedOut(#[from] crate::timeouts::TimedOut),
    /// Another stream's attempt to open a connection to this peer, which
    /// this one waited for, failed.
    #[error("opening an HBONE connection to {peer} failed: {reason}")]
    OpenFailed {
        /// The peer.
        peer: std::net::SocketAddr,
        /// Why the open failed.
        reason: String,
    },
    /// Every pooled connection filled up again each time this stream looked.
    #[error("no HBONE connection to {0} had room for another stream")]
    PoolBusy(std::net::SocketAddr),
}
