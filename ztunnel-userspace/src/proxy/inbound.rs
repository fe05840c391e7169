//! The inbound listeners of a pod.
//!
//! - 15006 (plaintext): `capture_ingress` assigned the SYN here with
//!   `bpf_sk_assign`, so the accepted socket's local address is the original
//!   destination. The connection is carried to the application from inside
//!   the pod with a marked socket. Like every inbound path, it stays
//!   registered in `connections` while open, so a policy change (e.g. STRICT
//!   mTLS) closes it.
//! - 15008 (HBONE) is served by [`crate::hbone::server`].

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument as _;

use crate::accept::{AcceptLoop, ListenerKind};

use super::{
    PodContext, ProxyError,
    admission::{self, Arrival},
    connect_within, is_own_port, next_connection_id, relay,
    socket_factory::SocketFactory,
};

/// What the inbound path of one pod needs.
#[derive(Debug, Clone)]
pub struct InboundContext {
    /// Pod uid, for logs.
    pub pod: String,
    /// The pod's identity.
    pub identity: crate::identity::Identity,
    /// Creates marked sockets inside the pod.
    pub sockets: SocketFactory,
    /// State, metrics.
    pub shared: super::Shared,
    /// Original destinations from `SO_ORIGINAL_DST` (iptables backend).
    pub orig_dst_sockopt: bool,
}

impl InboundContext {
    /// The inbound context of `pod`.
    pub fn new(pod: &PodContext, shared: &super::Shared) -> Self {
        Self {
            pod: pod.uid.clone(),
            identity: pod.identity.clone(),
            sockets: pod.sockets.clone(),
            shared: shared.clone(),
            orig_dst_sockopt: pod.orig_dst_sockopt,
        }
    }
}

/// Accepts plaintext inbound connections forever.
pub async fn serve_plaintext(listener: TcpListener, ctx: InboundContext) {
    let accept = AcceptLoop::pod(
        ListenerKind::InboundPlaintext,
        ctx.shared.limits.pod(&ctx.pod),
        std::sync::Arc::clone(&ctx.shared.metrics),
    );
    accept
        .run(listener, |stream, client| {
            // eBPF capture: the socket was assigned with the original
            // 4-tuple, so its local address is the destination. iptables:
            // REDIRECT rewrote it; ask conntrack.
            let dst = if ctx.orig_dst_sockopt {
                crate::capture::iptables::original_dst(&stream, client.is_ipv6())
            } else {
                stream.local_addr()
            };
            let id = next_connection_id();
            let span = tracing::info_span!("conn", id, pod = %ctx.pod, direction = "inbound", src = %client, dst = tracing::field::Empty);
            let ctx = ctx.clone();
            Some(
                async move {
                    let result = match dst {
                        Ok(dst) => {
                            tracing::Span::current().record("dst", tracing::field::display(dst));
                            plaintext(stream, client, dst, &ctx).await
                        }
                        Err(e) => Err(e.into()),
                    };
                    if let Err(e) = result {
                        tracing::warn!(error = %e, "inbound connection failed");
                    }
                }
                .instrument(span),
            )
        })
        .await;
}

async fn plaintext(
    stream: TcpStream,
    client: SocketAddr,
    dst: SocketAddr,
    ctx: &InboundContext,
) -> Result<(), ProxyError> {
    if is_own_port(dst.port()) {
        return Err(ProxyError::OwnPort(dst));
    }
    stream.set_nodelay(true)?;
    let request = admission::Request {
        arrival: Arrival::Plaintext,
        pod: &ctx.pod,
        pod_identity: &ctx.identity,
        peer: client,
        peer_identity: None,
        target: dst,
        named_service: None,
    };
    let admitted = match admission::admit(&ctx.shared, request).await {
        Ok(admitted) => admitted,
        Err(denied) => {
            tracing::info!(orig_dst = %dst, path = "plaintext", reason = %denied.reason, result = "denied", "inbound connection denied");
            return Err(ProxyError::Denied("authorization policy"));
        }
    };
    // From the client's own IP (transparent), so the application sees it.
    let upstream = match connect_within(&ctx.shared, &ctx.sockets, dst, Some(client.ip())).await {
        Ok(upstream) => upstream,
        Err(e) => {
            // A reset tells the client at once that nobody is there, as the
            // application's own refusal would have.
            let _ = stream.set_zero_linger();
            return Err(e);
        }
    };
    tracing::debug!(orig_dst = %dst, path = "plaintext", "inbound connection opened");
    let allowed = admitted.allowed;
    let record = crate::telemetry::ConnectionRecord::open(
        &ctx.shared.metrics,
        "inbound",
        "plaintext",
        allowed.src,
        allowed.dst,
        allowed.service.as_ref(),
    );
    relay(
        &ctx.shared,
        &ctx.pod,
        stream,
        upstream,
        record,
        Some(admitted.registration),
    )
    .await
}
