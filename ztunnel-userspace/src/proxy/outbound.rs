//! The outbound listener (15001): connections an enrolled pod's application
//! made, redirected here by `cgroup/connect4/6`.
//!
//! For each accepted connection the original destination is taken from the
//! kernel's `ORIG_DST` map (keyed by the pod's netns cookie and the client's
//! address as `accept()` reports it), then the connection is carried to it.
//! Today that is plain TCP from inside the pod with a marked socket; the
//! HBONE path for meshed destinations plugs in here.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use tokio::net::TcpListener;
use tracing::Instrument as _;

use super::{ProxyError, next_connection_id, relay, socket_factory::SocketFactory};
use crate::capture::maps::OrigDstTable;

/// What the outbound path of one pod needs.
#[derive(Debug, Clone)]
pub struct OutboundContext {
    /// Pod uid, for logs.
    pub pod: String,
    /// The pod's netns cookie (part of the `ORIG_DST` key).
    pub netns_cookie: u64,
    /// Shared `ORIG_DST` map.
    pub orig_dst: Arc<Mutex<OrigDstTable>>,
    /// Creates marked sockets inside the pod.
    pub sockets: SocketFactory,
}

/// Accepts forever (until the task is aborted on pod removal).
pub async fn serve(listener: TcpListener, ctx: OutboundContext) {
    loop {
        let (stream, client) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(pod = %ctx.pod, error = %e, "outbound accept failed");
                continue;
            }
        };
        let orig = ctx
            .orig_dst
            .lock()
            .ok()
            .and_then(|mut table| table.take_entry(ctx.netns_cookie, client));
        let id = next_connection_id();
        let span = tracing::info_span!("conn", id, pod = %ctx.pod, direction = "outbound", src = %client, dst = tracing::field::Empty);
        let ctx = ctx.clone();
        tokio::spawn(
            async move {
                let result = match orig {
                    Some(dst) => {
                        tracing::Span::current().record("dst", tracing::field::display(dst));
                        passthrough(stream, dst, &ctx).await
                    }
                    None => Err(ProxyError::NoOrigDst(client)),
                };
                if let Err(e) = result {
                    tracing::warn!(error = %e, "outbound connection failed");
                }
            }
            .instrument(span),
        );
    }
}

async fn passthrough(
    stream: tokio::net::TcpStream,
    dst: SocketAddr,
    ctx: &OutboundContext,
) -> Result<(), ProxyError> {
    stream.set_nodelay(true)?;
    let upstream = ctx.sockets.connect(dst).await?;
    tracing::info!(orig_dst = %dst, path = "passthrough", "outbound connection opened");
    relay(stream, upstream).await.map(|_| ())
}
