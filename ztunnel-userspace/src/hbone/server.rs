//! The HBONE server on a pod's port 15008.
//!
//! Per connection: TLS 1.3 with a required client certificate (its SPIFFE
//! id becomes the peer identity), ALPN `h2`, then one task per `CONNECT`
//! stream:
//! - not `CONNECT` -> 400; authority without a port -> 400; authority IP
//!   different from the address the connection arrived on -> 400;
//! - target is one of ztunnel's own ports -> 503;
//! - connecting to the application fails -> 503; takes longer than the
//!   connect timeout -> 504;
//! - otherwise 200, then bytes flow both ways until both sides are done,
//!   or until a new policy no longer allows the stream (it is then reset
//!   and the application's socket closed; see `proxy::connections`).
//!
//! A client that is not TLS, offers no `h2`, or presents a certificate we
//! do not trust fails the handshake; that is logged with its address and
//! the connection is closed. Nothing reaches the application. So is one
//! that does not finish the TLS or HTTP/2 handshake within its time limit
//! (`crate::timeouts`): a slowloris client cannot hold sockets here.

use std::{
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use bytes::Bytes;
use h2::server::SendResponse;

use super::linger::{LINGER, Lingering};
use http::{Method, Request, Response, StatusCode};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tracing::Instrument as _;

use super::{CONNECTION_WINDOW, MAX_FRAME, SERVER_MAX_STREAMS, STREAM_WINDOW};
use crate::{
    accept::{AcceptLoop, ListenerKind},
    identity::{Identity, identity_of},
    limits::HandshakePlace,
    proxy::{
        admission::{self, Arrival, RefusalKind},
        is_own_port, next_connection_id,
        socket_factory::SocketFactory,
    },
    telemetry::metrics::{HandshakeOutcome, HandshakeSide},
    timeouts::{Phase, TimedOut, within},
};

/// What the HBONE server of one pod needs.
#[derive(Clone)]
pub struct HboneServer {
    /// Pod uid, for logs.
    pub pod: String,
    /// The pod's identity (the certificate we present).
    pub identity: Identity,
    /// TLS configuration presenting that identity.
    pub tls: Arc<rustls::ServerConfig>,
    /// Creates sockets inside the pod.
    pub sockets: SocketFactory,
    /// State and metrics.
    pub shared: crate::proxy::Shared,
}

impl std::fmt::Debug for HboneServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HboneServer")
            .field("pod", &self.pod)
            .finish_non_exhaustive()
    }
}

/// Accepts HBONE connections forever (until the task is aborted). A
/// connection that finds its pod's handshake share taken
/// (`--max-pod-hbone-handshakes`), or the node's places taken with no
/// larger holder to make room (`limits::handshakes`), is reset at once.
pub async fn serve(listener: TcpListener, server: HboneServer) {
    // Shared by the pod's connections and their streams: a clone per
    // stream would copy the pod's names and every handle of `Shared` into
    // each stream's task.
    let server = Arc::new(server);
    let acceptor = TlsAcceptor::from(Arc::clone(&server.tls));
    let pod_limit = server.shared.limits.pod(&server.pod);
    let accept = AcceptLoop::pod(
        ListenerKind::Hbone,
        Arc::clone(&pod_limit),
        Arc::clone(&server.shared.metrics),
    );
    accept
        .run(listener, |tcp, peer| {
            // Counted and logged by the limit; reset like every refusal
            // of the accept loop.
            let Some(handshake) = pod_limit.handshake() else {
                let _ = tcp.set_zero_linger();
                return None;
            };
            let acceptor = acceptor.clone();
            let server = Arc::clone(&server);
            Some(async move {
                match connection(tcp, peer, acceptor, &server, handshake).await {
                    // Logged (with the phase) and counted where it happened.
                    Ok(()) | Err(ServerError::TimedOut(_)) => {}
                    Err(ServerError::Rejected(e)) => {
                        tracing::warn!(pod = %server.pod, %peer, error = %e, "HBONE connection rejected");
                    }
                }
            })
        })
        .await;
}

/// Why an HBONE connection ended before or between its streams.
#[derive(Debug, thiserror::Error)]
enum ServerError {
    /// A handshake ran out of time.
    #[error(transparent)]
    TimedOut(#[from] TimedOut),
    /// The client is not an HBONE client we accept, or broke the protocol.
    #[error("{0}")]
    Rejected(String),
}

impl From<String> for ServerError {
    fn from(reason: String) -> Self {
        Self::Rejected(reason)
    }
}

impl From<&str> for ServerError {
    fn from(reason: &str) -> Self {
        Self::Rejected(reason.to_owned())
    }
}

/// One HBONE connection. `handshake` is its place among the node's
/// handshakes in progress, given back once TLS and HTTP/2 are done.
async fn connection(
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
    server: &Arc<HboneServer>,
    handshake_place: HandshakePlace,
) -> Result<(), ServerError> {
    let local = tcp.local_addr().map_err(|e| e.to_string())?;
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    let timeouts = server.shared.timeouts;
    let metrics = &server.shared.metrics;
    let count = |outcome| metrics.handshake(HandshakeSide::Server, outcome);
    // Everything before the first stream runs in the handshake's place,
    // which node pressure may take (`limits::handshakes`): the connection
    // then closes, having carried nothing.
    let handshakes = async {
        // Without a certificate to present (Istio's CA has not issued it yet)
        // the handshake could only fail: wait for it, bounded.
        let own_cert = server
            .shared
            .certs
            .wait_ready(&server.identity, timeouts.tls_handshake)
            .await
            .map_err(|e| e.to_string())?;
        // Dropping the handshake on expiry closes the socket.
        let tls = match within(
            Phase::TlsHandshake,
            timeouts.tls_handshake,
            peer,
            metrics,
            acceptor.accept(tcp),
        )
        .await
        {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                count(HandshakeOutcome::Failed);
                return Err(format!("TLS handshake failed (not an HBONE client?): {e}").into());
            }
            Err(timed_out) => {
                count(HandshakeOutcome::Timeout);
                return Err(timed_out.into());
            }
        };
        let Some(peer_identity) = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .and_then(|c| identity_of(c))
        else {
            count(HandshakeOutcome::Failed);
            return Err("client presented no SPIFFE identity".into());
        };
        count(HandshakeOutcome::Ok);
        let expires =
            crate::identity::connection_expiry(&own_cert, tls.get_ref().1.peer_certificates());
        let expiry = tokio::time::Instant::now()
            + expires
                .duration_since(std::time::SystemTime::now())
                .unwrap_or_default();
        let handshake = h2::server::Builder::new()
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_frame_size(MAX_FRAME)
            .max_concurrent_streams(SERVER_MAX_STREAMS)
            // Its shutdown waits for the client's end of stream: a close with
            // the client's last frames unread would reset the connection and
            // lose the tail of the last stream (see `linger`).
            .handshake::<_, Bytes>(Lingering::new(tls, LINGER));
        let h2 = within(
            Phase::H2Handshake,
            timeouts.h2_handshake,
            peer,
            metrics,
            handshake,
        )
        .await?
        .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
        Ok::<_, ServerError>((h2, peer_identity, expiry))
    };
    // Boxed: the handshakes (the TLS state, then HTTP/2's) are the
    // largest state of the connection's future, and inline they would size
    // its task for its whole life (release build: 13.7 KiB inline, 3.3 KiB
    // boxed).
    let (mut h2, peer_identity, expiry) = match handshake_place.run(Box::pin(handshakes)).await {
        Ok(done) => done?,
        Err(evicted) => {
            count(HandshakeOutcome::Evicted);
            tracing::debug!(pod = %server.pod, %peer, "HBONE handshake {evicted}");
            return Ok(());
        }
    };
    // Each stream is a connection to the pod (a task, a socket to the
    // application, buffers): it counts against the pod's and the node's
    // connection limits like one that arrived on its own, on top of the
    // HBONE connection carrying it.
    let pod_limit = server.shared.limits.pod(&server.pod);
    tracing::debug!(pod = %server.pod, %peer, peer_identity = %peer_identity, "HBONE connection accepted");
    let mut draining = server.shared.draining.subscribe();
    let mut goaway_sent = false;
    loop {
        let next = tokio::select! {
            next = h2.accept() => next,
            // Drain: tell the peer (GOAWAY) to open no new streams here; the
            // open ones finish while the connection keeps being polled.
            changed = draining.changed(), if !goaway_sent => {
                if changed.is_ok() && *draining.borrow() {
                    h2.graceful_shutdown();
                    goaway_sent = true;
                }
                continue;
            }
            // A certificate of this connection expired: the client must
            // open new streams on a connection with current ones.
            () = tokio::time::sleep_until(expiry), if !goaway_sent => {
                tracing::info!(pod = %server.pod, %peer, "a certificate of this HBONE connection expired: no new streams on it");
                h2.graceful_shutdown();
                goaway_sent = true;
                continue;
            }
        };
        let Some(next) = next else { break };
        let (request, mut respond) = next.map_err(|e| format!("HTTP/2: {e}"))?;
        let Some(permit) = pod_limit.admit(crate::limits::Side::Inbound) else {
            // Counted and logged (throttled) by the limit; 503 as for any
            // stream the pod cannot take now.
            let response = Response::builder()
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .body(())
                .unwrap_or_default();
            let _ = respond.send_response(response, true);
            continue;
        };
        let id = next_connection_id();
        let span = tracing::info_span!("conn", id, pod = %server.pod, direction = "inbound", src = %peer, src_identity = %peer_identity, dst = tracing::field::Empty);
        let server = Arc::clone(server);
        let peer_identity = peer_identity.clone();
        tokio::spawn(
            async move {
                let _permit = permit;
                stream(request, respond, peer, local, &server, &peer_identity).await;
            }
            .instrument(span),
        );
    }
    Ok(())
}

/// Why a `CONNECT` stream is refused before anything is opened for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConnectRefusal {
    /// Only `CONNECT` opens a tunnel.
    #[error("method is not CONNECT")]
    NotConnect,
    /// The `:authority` must be `ip:port` (HBONE never carries names).
    #[error("authority is not ip:port")]
    BadAuthority,
    /// The target is not the address the connection arrived on: a peer
    /// must not use one pod's port 15008 to reach another address.
    #[error("authority IP is not the address this connection arrived on")]
    NotArrivalAddress(SocketAddr),
    /// The target is one of ztunnel's own listeners.
    #[error("target is one of ztunnel's own ports")]
    OwnPort(SocketAddr),
}

impl ConnectRefusal {
    /// The HTTP status the client is answered with.
    pub fn status(self) -> StatusCode {
        match self {
            Self::NotConnect | Self::BadAuthority | Self::NotArrivalAddress(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::OwnPort(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The requested target, when the authority named one.
    pub fn target(self) -> Option<SocketAddr> {
        match self {
            Self::NotArrivalAddress(target) | Self::OwnPort(target) => Some(target),
            Self::NotConnect | Self::BadAuthority => None,
        }
    }
}

/// The target of a `CONNECT` request that arrived on a connection to
/// `local`, or why it is refused. Pure (no I/O) so that the fuzz target
/// checks the rule the server applies.
///
/// Headers, `forwarded` included, are deliberately not read: the source
/// address comes from the connection and the identity from the client's
/// certificate, never from what the client claims about itself.
pub fn connect_target<B>(
    request: &Request<B>,
    local: IpAddr,
) -> Result<SocketAddr, ConnectRefusal> {
    if request.method() != Method::CONNECT {
        return Err(ConnectRefusal::NotConnect);
    }
    let target = request
        .uri()
        .authority()
        .and_then(|a| a.as_str().parse::<SocketAddr>().ok())
        .ok_or(ConnectRefusal::BadAuthority)?;
    if target.ip() != local {
        return Err(ConnectRefusal::NotArrivalAddress(target));
    }
    if is_own_port(target.port()) {
        return Err(ConnectRefusal::OwnPort(target));
    }
    Ok(target)
}

/// The `host` parameter of a `CONNECT`'s `Forwarded` header (RFC 7239):
/// the hostname of the service the client addressed, which Istio's ztunnel
/// sends when the connection went to a service VIP (the `:authority` must
/// be the pod's own address, so the VIP is lost there). Only the first
/// element is read; quotes are removed.
pub fn forwarded_host<B>(request: &Request<B>) -> Option<String> {
    let value = request
        .headers()
        .get(http::header::FORWARDED)?
        .to_str()
        .ok()?;
    let first = value.split(',').next()?;
    first.split(';').find_map(|pair| {
        let (key, value) = pair.trim().split_once('=')?;
        key.trim()
            .eq_ignore_ascii_case("host")
            .then(|| value.trim().trim_matches('"').to_owned())
            .filter(|host| !host.is_empty())
    })
}

fn refuse(mut respond: SendResponse<Bytes>, status: StatusCode, reason: &str) {
    tracing::info!(status = status.as_u16(), %reason, result = "refused", "inbound HBONE stream refused");
    let response = Response::builder()
        .status(status)
        .body(())
        .unwrap_or_default();
    let _ = respond.send_response(response, true);
}

async fn stream(
    request: Request<h2::RecvStream>,
    respond: SendResponse<Bytes>,
    peer: SocketAddr,
    local: SocketAddr,
    server: &HboneServer,
    peer_identity: &Identity,
) {
    let target = match connect_target(&request, local.ip()) {
        Ok(target) => target,
        Err(refusal) => {
            if let Some(target) = refusal.target() {
                tracing::Span::current().record("dst", tracing::field::display(target));
            }
            return refuse(respond, refusal.status(), &refusal.to_string());
        }
    };
    tracing::Span::current().record("dst", tracing::field::display(target));
    // For the metrics only: the client may name the service it addressed,
    // but only one this pod is behind is believed (`inbound_service`).
    let named = forwarded_host(&request);
    let ask = admission::Request {
        arrival: Arrival::Hbone,
        pod: &server.pod,
        pod_identity: &server.identity,
        peer,
        peer_identity: Some(peer_identity),
        target,
        named_service: named.as_deref(),
    };
    // Boxed, as the connect and the copy below: what a state holds only
    // while it runs is freed after it, rather than every stream's task
    // keeping room for it (release build: the task went from 4.3 KiB to
    // 2.8 KiB with these boxes and the shared `HboneServer`).
    let admitted = match Box::pin(admission::admit(&server.shared, ask)).await {
        Ok(admitted) => admitted,
        Err(denied) => {
            // A pod whose workload is unknown cannot be served at all (503,
            // as Istio's ztunnel answers when it cannot find its local
            // workload); a policy that refuses this peer is 401.
            let status = match denied.kind {
                RefusalKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
                RefusalKind::Policy => StatusCode::UNAUTHORIZED,
            };
            return refuse(respond, status, &denied.reason);
        }
    };
    let (registration, allowed) = (admitted.registration, admitted.allowed);
    let connect = server.sockets.connect_from(target, Some(peer.ip()));
    let timeouts = server.shared.timeouts;
    let upstream = match Box::pin(within(
        Phase::Connect,
        timeouts.connect,
        target,
        &server.shared.metrics,
        connect,
    ))
    .await
    {
        Ok(Ok(upstream)) => upstream,
        Ok(Err(e)) => return refuse(respond, StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
        Err(e) => return refuse(respond, StatusCode::GATEWAY_TIMEOUT, &e.to_string()),
    };
    let mut respond = respond;
    let send = match respond.send_response(
        Response::builder()
            .status(StatusCode::OK)
            .body(())
            .unwrap_or_default(),
        false,
    ) {
        Ok(send) => send,
        Err(e) => {
            tracing::warn!(error = %e, "could not answer CONNECT");
            return;
        }
    };
    tracing::debug!(src_identity = %peer_identity, dst_identity = %server.identity, path = "hbone", "inbound connection opened");
    let record = crate::telemetry::ConnectionRecord::open(
        &server.shared.metrics,
        "inbound",
        "hbone",
        allowed.src,
        allowed.dst,
        allowed.service.as_ref(),
    );
    // tcp_to_h2 counts (app -> stream, stream -> app); for the record the
    // client is the remote peer: sent = from the client, received = to it.
    let copy = super::copy::tcp_to_h2(upstream, send, request.into_body());
    // A revocation drops the copy: the application's socket is closed and
    // the stream reset, which the client's ztunnel passes on to its app.
    // Boxed: the copy and the policy watch around it (1.2 KiB) would
    // otherwise sit in the task beside the opening states.
    match Box::pin(registration.unless_revoked(copy)).await {
        Ok((to_client, from_client)) => record.close(from_client, to_client, &Ok(())),
        Err(e) => record.close(0, 0, &Err(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connect(uri: &str) -> Request<()> {
        Request::builder()
            .method(Method::CONNECT)
            .uri(uri)
            .header("forwarded", "for=\"10.9.9.9\"")
            .body(())
            .expect("request")
    }

    #[test]
    fn the_forwarded_host_is_the_service_the_client_named() {
        let with = |value: &str| {
            Request::builder()
                .method(Method::CONNECT)
                .uri("10.0.0.1:8080")
                .header("forwarded", value)
                .body(())
                .expect("request")
        };
        assert_eq!(
            forwarded_host(&with(
                "for=\"10.0.0.9:4000\";host=web.test.svc.cluster.local"
            )),
            Some("web.test.svc.cluster.local".into())
        );
        assert_eq!(
            forwarded_host(&with("Host=\"web.test.svc.cluster.local\"; for=x")),
            Some("web.test.svc.cluster.local".into())
        );
        assert_eq!(forwarded_host(&with("for=\"10.0.0.9:4000\"")), None);
        assert_eq!(forwarded_host(&with("for=a, host=second")), None);
        assert_eq!(forwarded_host(&connect("10.0.0.1:8080")), None);
    }

    #[test]
    fn connect_checks_method_authority_arrival_address_and_port() {
        let local: IpAddr = "10.0.0.1".parse().expect("ip");
        assert_eq!(
            connect_target(&connect("10.0.0.1:8080"), local),
            Ok("10.0.0.1:8080".parse().expect("addr"))
        );
        let get = Request::builder()
            .uri("http://10.0.0.1:8080/")
            .body(())
            .expect("request");
        assert_eq!(connect_target(&get, local), Err(ConnectRefusal::NotConnect));
        assert_eq!(
            connect_target(&connect("web:8080"), local),
            Err(ConnectRefusal::BadAuthority)
        );
        let other = "10.0.0.2:8080".parse().expect("addr");
        assert_eq!(
            connect_target(&connect("10.0.0.2:8080"), local),
            Err(ConnectRefusal::NotArrivalAddress(other))
        );
        let own = connect_target(&connect("10.0.0.1:15008"), local).expect_err("own port");
        assert_eq!(own.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(own.to_string(), "target is one of ztunnel's own ports");
    }
}
