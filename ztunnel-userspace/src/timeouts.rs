//! Time limits on every step where a peer can stall ztunnel.
//!
//! A peer that stops talking half-way through a handshake costs us a file
//! descriptor, a task and its buffers for as long as we wait. Without a
//! limit, 200 clients that each send five bytes of a TLS record hold 200
//! sockets forever (a slowloris), and one black-holed node holds every
//! connection towards it for the kernel's SYN retry time (about two
//! minutes). So each phase below runs under [`within`]: on expiry the
//! connection is closed, a warning names the peer and the phase, and
//! `ztunnel_timeouts_total{phase}` counts it.

use std::{future::Future, net::SocketAddr, time::Duration};

use crate::telemetry::Metrics;

/// TCP connect upstream (a peer's 15008, an application inside a pod, a
/// passthrough destination). A SYN on a healthy network is answered in
/// milliseconds; five seconds survives a lost SYN (first retransmission
/// after one second, the second after three) and still fails long before
/// the kernel's own two minutes.
pub const DEFAULT_CONNECT: Duration = Duration::from_secs(5);
/// TLS handshake, either side. Ten seconds: a full handshake is two round
/// trips plus certificate checks; this leaves room for a loaded node and a
/// slow network while bounding what a slowloris client can hold.
pub const DEFAULT_TLS_HANDSHAKE: Duration = Duration::from_secs(10);
/// HTTP/2 handshake (preface and SETTINGS), either side. Same reasoning as
/// TLS: one round trip on an already working connection.
pub const DEFAULT_H2_HANDSHAKE: Duration = Duration::from_secs(10);
/// From sending a `CONNECT` to its response. The server answers once its
/// own connect to the application is done, which is bounded by its connect
/// timeout (5 s by default): ten seconds lets that finish and answer.
pub const DEFAULT_CONNECT_RESPONSE: Duration = Duration::from_secs(10);
/// SOCKS5 greeting and request. A real client sends both at once; ten
/// seconds is generous for anything but a stalled or hostile one.
pub const DEFAULT_SOCKS5: Duration = Duration::from_secs(10);

/// The limits, one per phase (built from flags by `main`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Upstream TCP connect.
    pub connect: Duration,
    /// TLS handshake (client and server).
    pub tls_handshake: Duration,
    /// HTTP/2 handshake (client and server).
    pub h2_handshake: Duration,
    /// Waiting for a stream slot and the answer to a `CONNECT`.
    pub connect_response: Duration,
    /// SOCKS5 negotiation.
    pub socks5: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: DEFAULT_CONNECT,
            tls_handshake: DEFAULT_TLS_HANDSHAKE,
            h2_handshake: DEFAULT_H2_HANDSHAKE,
            connect_response: DEFAULT_CONNECT_RESPONSE,
            socks5: DEFAULT_SOCKS5,
        }
    }
}

impl Timeouts {
    /// The longest one pooled HBONE connection may take to open (connect,
    /// TLS, HTTP/2): what a stream waiting on another opener waits at most.
    pub fn hbone_open(&self) -> Duration {
        self.connect + self.tls_handshake + self.h2_handshake
    }
}

/// A phase with a time limit (the `phase` label of the metric).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Upstream TCP connect.
    Connect,
    /// TLS handshake.
    TlsHandshake,
    /// HTTP/2 handshake.
    H2Handshake,
    /// Stream slot and `CONNECT` response.
    ConnectResponse,
    /// SOCKS5 negotiation.
    Socks5,
    /// Waiting for another stream's HBONE connection to open.
    PoolWait,
}

impl Phase {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::TlsHandshake => "tls_handshake",
            Self::H2Handshake => "h2_handshake",
            Self::ConnectResponse => "connect_response",
            Self::Socks5 => "socks5",
            Self::PoolWait => "pool_wait",
        }
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A phase ran out of time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{phase} with {peer} timed out after {}ms", limit.as_millis())]
pub struct TimedOut {
    /// Which phase.
    pub phase: Phase,
    /// With whom.
    pub peer: SocketAddr,
    /// The limit that ran out.
    pub limit: Duration,
}

/// Runs `work` for at most `limit`. On expiry `work` is dropped (which
/// closes whatever sockets it owns), the timeout is logged with the peer and
/// counted, and [`TimedOut`] returned.
pub async fn within<T>(
    phase: Phase,
    limit: Duration,
    peer: SocketAddr,
    metrics: &Metrics,
    work: impl Future<Output = T>,
) -> Result<T, TimedOut> {
    if let Ok(done) = tokio::time::timeout(limit, work).await {
        Ok(done)
    } else {
        metrics.timed_out(phase);
        tracing::warn!(%peer, phase = phase.as_str(), limit_ms = limit.as_millis() as u64, "timed out: closing");
        Err(TimedOut { phase, peer, limit })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expired_phase_is_counted_and_named() {
        let metrics = Metrics::new();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let peer: SocketAddr = "10.0.0.1:15008".parse().expect("addr");
        let limit = Duration::from_millis(20);
        let stalled = runtime.block_on(within(
            Phase::TlsHandshake,
            limit,
            peer,
            &metrics,
            std::future::pending::<()>(),
        ));
        assert_eq!(
            stalled,
            Err(TimedOut {
                phase: Phase::TlsHandshake,
                peer,
                limit
            })
        );
        let quick = runtime.block_on(within(Phase::Connect, limit, peer, &metrics, async { 7 }));
        assert_eq!(quick, Ok(7));
        let text = metrics.encode();
        assert!(
            text.contains("ztunnel_timeouts_total{phase=\"tls_handshake\"} 1"),
            "{text}"
        );
        assert!(!text.contains("phase=\"connect\""), "{text}");
    }
}
