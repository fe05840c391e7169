//! The outbound listener (15001): connections an enrolled pod's application
//! made, redirected here by `cgroup/connect4/6`.
//!
//! For each accepted connection the original destination is taken from the
//! kernel's `ORIG_DST` map (keyed by the pod's netns cookie and the client's
//! address as `accept()` reports it), then routed with the mesh state:
//! a meshed workload (or a service endpoint that is one) goes over HBONE to
//! its pod's port 15008, a workload or service with a waypoint over HBONE
//! to the waypoint (`:authority` = the address dialled), anything else as
//! plain TCP from inside the pod, and a destination the outbound policy
//! refuses (or whose waypoint is unknown) is closed.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument as _;

use super::{
    PodContext, ProxyError, Shared,
    admission::{self, Arrival, RefusalKind},
    connect_within,
    connections::Registration,
    next_connection_id, relay,
};
use crate::{
    accept::{AcceptLoop, ListenerKind},
    capture::maps::OrigDstTable,
    hbone::{
        copy,
        pool::{PoolKey, Tunnel},
    },
    limits::ConnectionPermit,
    state::{MeshState, Route},
    telemetry::{self, ConnectionRecord, Endpoint},
};

/// What the outbound path of one pod needs.
#[derive(Debug, Clone)]
pub struct OutboundContext {
    /// The pod.
    pub pod: PodContext,
    /// Shared `ORIG_DST` map.
    /// `None` when no programs are loaded (`--capture istio-cni`).
    pub orig_dst: Option<Arc<Mutex<OrigDstTable>>>,
    /// State, certificates, pool.
    pub shared: Shared,
}

/// Accepts forever (until the task is aborted on pod removal).
pub async fn serve(listener: TcpListener, ctx: OutboundContext) {
    // Shared by the pod's connections: a clone per connection would copy
    // the pod's names and addresses into every one of them.
    let ctx = Arc::new(ctx);
    let accept = AcceptLoop::pod(
        ListenerKind::Outbound,
        ctx.shared.limits.pod(&ctx.pod.uid),
        Arc::clone(&ctx.shared.metrics),
    );
    accept
        .run(listener, |stream, client| {
            let orig = if ctx.pod.orig_dst_sockopt {
                crate::capture::iptables::original_dst(&stream, client.is_ipv6()).ok()
            } else {
                ctx.orig_dst
                    .as_ref()
                    .and_then(|table| table.lock().ok())
                    .and_then(|mut table| table.take_entry(ctx.pod.netns_cookie, client))
            };
            let id = next_connection_id();
            let span = tracing::info_span!("conn", id, pod = %ctx.pod.uid, direction = "outbound", src = %client, dst = tracing::field::Empty);
            let ctx = Arc::clone(&ctx);
            Some(
                async move {
                    let result = if let Some(dst) = orig {
                        tracing::Span::current().record("dst", tracing::field::display(dst));
                        handle(stream, dst, &ctx).await
                    } else {
                        // No record: the connect hook or sock_ops could not
                        // store one (map full, allocation failure) or the
                        // client closed before we accepted. We cannot know
                        // where it was going, and guessing would bypass the
                        // mesh: reset it so the application sees a failure
                        // at once instead of a hang.
                        let _ = stream.set_zero_linger();
                        drop(stream);
                        Err(ProxyError::NoOrigDst(client))
                    };
                    if let Err(e) = result {
                        tracing::warn!(error = %e, result = "error", "outbound connection failed");
                    }
                }
                .instrument(span),
            )
        })
        .await;
}

/// The other end of an outbound connection once it is open.
pub enum Upstream {
    /// Plain TCP (passthrough).
    Tcp(TcpStream),
    /// The same-node fast path: TCP into the destination pod, where this
    /// node enforces the destination's policy, so it stays registered and
    /// is closed when a new policy denies it.
    Local {
        /// The connection into the destination pod.
        stream: TcpStream,
        /// Its entry among the open inbound connections.
        policy: Registration,
        /// Its place in the destination pod's connection limits.
        permit: Option<ConnectionPermit>,
    },
    /// An HBONE `CONNECT` stream.
    Tunnel(Tunnel),
}

/// Routes and carries one captured connection to its original destination.
pub async fn handle(
    stream: TcpStream,
    dst: SocketAddr,
    ctx: &OutboundContext,
) -> Result<(), ProxyError> {
    stream.set_nodelay(true)?;
    let client_port = stream.peer_addr().map_or(0, |a| a.port());
    // Opening (routing, a connect, and when no pooled connection has room
    // the TLS and HTTP/2 handshakes) is a future of several KiB, which
    // would stay in the connection's task for its whole life, idle or not;
    // boxed, it is freed once the upstream is open.
    let (upstream, record) = match Box::pin(open(dst, client_port, ctx, Some(&stream))).await {
        Ok(opened) => opened,
        Err(e) => {
            // The application's connect already succeeded (to us): a reset
            // is how it learns that the destination refused or could not
            // be reached. An application that connects and reads at once
            // can see it as ECONNRESET from connect() itself.
            if e.is_upstream_failure() {
                let _ = stream.set_zero_linger();
            }
            return Err(e);
        }
    };
    carry(&ctx.shared, &ctx.pod.uid, stream, upstream, record).await
}

fn source(
    ctx: &OutboundContext,
    state: &MeshState,
    src_ip: Option<std::net::IpAddr>,
    port: u16,
) -> Endpoint {
    let workload = state.workload(&ctx.pod.uid);
    Endpoint {
        workload: workload.map_or_else(|| ctx.pod.uid.clone(), |w| w.name.clone()),
        namespace: ctx.pod.identity.namespace.clone(),
        addr: src_ip
            .or_else(|| ctx.pod.ips.first().copied())
            .map(|ip| SocketAddr::new(ip, port)),
        identity: Some(ctx.pod.identity.to_string()),
        meta: workload
            .map(crate::state::Workload::meta)
            .unwrap_or_default(),
    }
}

/// Decides the route for `dst` and opens the upstream side; the returned
/// record has counted the connection as opened. Over HBONE, what `app` (the
/// application's connection) writes meanwhile goes ahead of the peer's
/// answer (see [`crate::hbone::early`]).
pub async fn open(
    dst: SocketAddr,
    client_port: u16,
    ctx: &OutboundContext,
    app: Option<&TcpStream>,
) -> Result<(Upstream, ConnectionRecord), ProxyError> {
    let state = ctx
        .shared
        .state
        .current_for(&ctx.pod.uid, crate::state::mesh::WORKLOAD_WAIT)
        .await;
    if state.workload(&ctx.pod.uid).is_none() {
        // Without its workload the pod's own policies (and which traffic
        // it may send) are unknown: nothing leaves it until the mesh state
        // lists it.
        let reason = crate::state::mesh::WORKLOAD_UNKNOWN;
        tracing::info!(orig_dst = %dst, path = "denied", %reason, result = "denied", "outbound connection denied");
        let src = source(ctx, &state, None, client_port);
        telemetry::connection::denied(
            &ctx.shared.metrics,
            &src,
            &state.endpoint(dst),
            "outbound",
            "workload_unknown",
            reason,
        );
        return Err(ProxyError::Denied(reason));
    }
    let vip_service = state.service_by_vip(dst.ip());
    let service = vip_service.map(crate::telemetry::connection::ServiceRef::from);
    let service_host = vip_service.map(crate::state::service::Service::hostname);
    let route = state.route_from(&ctx.pod.ips, dst);
    let metrics = &ctx.shared.metrics;
    match route {
        Route::Passthrough { target } => {
            let upstream = connect_within(&ctx.shared, &ctx.pod.sockets, target, None).await?;
            tracing::debug!(orig_dst = %dst, target = %target, path = "passthrough", "outbound connection opened");
            let src = source(ctx, &state, None, client_port);
            let record = ConnectionRecord::open(
                metrics,
                "outbound",
                "passthrough",
                src,
                state.endpoint(target),
                service.as_ref(),
            );
            Ok((Upstream::Tcp(upstream), record))
        }
        Route::Hbone {
            target,
            hbone,
            identity,
            workload,
            waypoint,
        } => {
            let family = if hbone.is_ipv6() { "IPv6" } else { "IPv4" };
            let src_ip = ctx
                .pod
                .ip_like(hbone.ip())
                .ok_or(ProxyError::NoPodAddress(family))?;
            let src = source(ctx, &state, Some(src_ip), client_port);
            // Through a waypoint the peer is the waypoint (Istio reports
            // it as the destination workload, with the service dialled).
            let mut dst_end = state.endpoint(if waypoint { hbone } else { target });
            dst_end.identity = Some(identity.to_string());
            // A waypoint is always reached over HBONE: the fast path would
            // connect into the destination and skip it.
            let local = (!waypoint)
                .then(|| ctx.shared.local_pod(target.ip()))
                .flatten();
            if let Some(local) = local {
                // Same node: no TLS needed, the identities are known here.
                // The destination's policy is applied here, as its 15008
                // would, and the connection is made inside the destination
                // pod from the client pod's IP, like an HBONE inbound leg.
                if local.identity != identity {
                    return Err(ProxyError::Denied(
                        "same-node destination has another identity than expected",
                    ));
                }
                let ask = admission::Request {
                    arrival: Arrival::SameNode,
                    pod: &local.uid,
                    pod_identity: &local.identity,
                    peer: SocketAddr::new(src_ip, client_port),
                    peer_identity: Some(&ctx.pod.identity),
                    target,
                    named_service: None,
                };
                let admitted = match admission::admit(&ctx.shared, ask).await {
                    Ok(admitted) => admitted,
                    Err(denied) => {
                        return Err(match denied.kind {
                            RefusalKind::Policy => {
                                ProxyError::Denied("authorization policy (same node)")
                            }
                            RefusalKind::Unavailable => ProxyError::Unavailable(
                                "the destination pod cannot take the connection (same node)",
                            ),
                        });
                    }
                };
                let upstream =
                    connect_within(&ctx.shared, &local.sockets, target, Some(src_ip)).await?;
                tracing::debug!(
                    orig_dst = %dst,
                    target = %target,
                    dst_workload = %workload,
                    src_identity = %ctx.pod.identity,
                    dst_identity = %identity,
                    path = "local",
                    "outbound connection opened"
                );
                let record = ConnectionRecord::open(
                    metrics,
                    "outbound",
                    "local",
                    src,
                    dst_end,
                    service.as_ref(),
                );
                return Ok((
                    Upstream::Local {
                        stream: upstream,
                        policy: admitted.registration,
                        permit: admitted.permit,
                    },
                    record,
                ));
            }
            let key = PoolKey {
                src_ip,
                src: ctx.pod.identity.clone(),
                dst: hbone,
                dst_identity: identity.clone(),
            };
            let client = SocketAddr::new(src_ip, client_port);
            let tunnel = ctx
                .shared
                .pool
                .connect(
                    key,
                    &ctx.pod.sockets,
                    target,
                    client,
                    service_host.as_deref(),
                    app,
                )
                .await?;
            // Debug, as in Istio's ztunnel: the access log line at close is the
            // per-connection record, and a second line per connection costs
            // connection rate (docs/performance.md).
            tracing::debug!(
                orig_dst = %dst,
                target = %target,
                dst_workload = %workload,
                src_identity = %ctx.pod.identity,
                dst_identity = %identity,
                hbone_connection = tunnel.connection,
                hbone_peer = %hbone,
                waypoint,
                path = "hbone",
                "outbound connection opened"
            );
            let record = ConnectionRecord::open(
                metrics,
                "outbound",
                "hbone",
                src,
                dst_end,
                service.as_ref(),
            );
            Ok((Upstream::Tunnel(tunnel), record))
        }
        Route::Deny { reason } => {
            tracing::info!(orig_dst = %dst, path = "denied", %reason, result = "denied", "outbound connection denied");
            let src = source(ctx, &state, None, client_port);
            telemetry::connection::denied(
                metrics,
                &src,
                &state.endpoint(dst),
                "outbound",
                "outbound_traffic_policy",
                reason,
            );
            Err(ProxyError::Denied(reason))
        }
    }
}

/// Copies both ways between the application's connection (of pod `pod`)
/// and `upstream`, then closes the record.
pub async fn carry(
    shared: &Shared,
    pod: &str,
    stream: TcpStream,
    upstream: Upstream,
    record: ConnectionRecord,
) -> Result<(), ProxyError> {
    // The TCP-to-TCP relay's future (its record, the policy watch, both
    // sockets; 2.5 KiB in release) is several times the HBONE copy's:
    // inline, every outbound connection's task would be sized for it, HBONE
    // ones included (2,784 B; boxed 2,088 B). Only TCP-to-TCP connections
    // pay for it now.
    match upstream {
        Upstream::Tcp(upstream) => {
            Box::pin(relay(shared, pod, stream, upstream, record, None)).await
        }
        Upstream::Local {
            stream: upstream,
            policy,
            permit,
        } => {
            let done = Box::pin(relay(shared, pod, stream, upstream, record, Some(policy))).await;
            drop(permit);
            done
        }
        Upstream::Tunnel(tunnel) => match copy::tcp_to_h2(stream, tunnel.send, tunnel.recv).await {
            Ok((sent, received)) => {
                record.close(tunnel.early + sent, received, &Ok(()));
                Ok(())
            }
            Err(e) => {
                record.close(0, 0, &Err(e.to_string()));
                Err(e.into())
            }
        },
    }
}
