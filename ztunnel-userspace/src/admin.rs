//! Admin (127.0.0.1:15000), metrics (:15020) and readiness (:15021), on a
//! small current-thread runtime of their own, so that a slow scrape or a
//! big config dump never takes a worker from the data plane.
//!
//! - `GET /config_dump` (admin): JSON with the workloads, services,
//!   policies, certificates (identity and validity only; never keys),
//!   enrolled pods, the attached programs with their map entry counts, and
//!   with xDS the stream's state (resource versions held, types ACKed,
//!   the last NACK).
//! - `GET|POST /logging?level=FILTER` (admin): changes the log filter
//!   (URL-decoded and checked first: `telemetry::log_filter`).
//! - `GET /healthz` (admin): 200 while the process runs.
//! - `GET /metrics` (metrics): Prometheus text.
//! - `GET /healthz/ready` (readiness): 200 once the programs are attached,
//!   the certificates of the enrolled pods are issued and the first config
//!   is applied (with xDS: istiod's first workloads and policies ACKed);
//!   503 before that and while draining.

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::{
    accept::{AcceptLoop, ListenerKind},
    capture,
    enrol::PodRegistry,
    telemetry::{Metrics, log_filter},
};

/// Changes the log filter at runtime.
pub type LogControl = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// Where the three servers listen.
#[derive(Debug, Clone, Copy)]
pub struct Addresses {
    /// Admin (config dump, logging, healthz).
    pub admin: SocketAddr,
    /// Prometheus metrics.
    pub metrics: SocketAddr,
    /// Readiness.
    pub readiness: SocketAddr,
}

/// What the servers read.
pub struct AdminState {
    /// The pods and programs.
    pub registry: Arc<PodRegistry>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Readiness flag.
    pub ready: Arc<AtomicBool>,
    /// Log filter control.
    pub log_control: LogControl,
    /// The capture cgroup.
    pub cgroup: std::path::PathBuf,
    /// The node agent connection, when ztunnel dials one: readiness waits
    /// for its snapshot and for its pending pods.
    pub node_agent: Option<Arc<crate::enrol::zds::node_agent::NodeAgentStatus>>,
    /// The xDS stream, when ztunnel runs from istiod.
    pub xds: Option<crate::xds::XdsStatusHandle>,
}

impl std::fmt::Debug for AdminState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminState").finish_non_exhaustive()
    }
}

/// Errors starting the servers.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// Binding failed.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

/// How long a client of the admin, metrics or readiness server may take to
/// send its request headers. Scrapers and probes send them at once; ten
/// seconds, like the handshake timeouts, keeps a silent client (these
/// ports are reachable from pods) from holding a place for long.
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

type Body = Full<Bytes>;

fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(body.into()))
        .unwrap_or_default()
}

/// A listener on `addr` that a second ztunnel on the node can open too
/// (`SO_REUSEPORT`): during an upgrade the new one starts while the old one
/// drains, and a port the old one holds must not stop it. While both run,
/// each request is answered by one of them.
fn shared_listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.cloexec(),
        Some(Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    socket.listen(128)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// Binds the three listeners (so errors surface at start-up) and serves
/// them on a dedicated thread with its own runtime.
pub fn start(addrs: Addresses, state: Arc<AdminState>) -> Result<(), AdminError> {
    let bind = |addr: SocketAddr| {
        shared_listener(addr).map_err(|source| AdminError::Bind { addr, source })
    };
    let listeners = [
        (bind(addrs.admin)?, Kind::Admin),
        (bind(addrs.metrics)?, Kind::Metrics),
        (bind(addrs.readiness)?, Kind::Readiness),
    ];
    std::thread::Builder::new()
        .name("admin".into())
        .spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                tracing::error!("admin runtime could not start");
                return;
            };
            runtime.block_on(async move {
                let mut tasks = Vec::new();
                for (listener, kind) in listeners {
                    let Ok(listener) = TcpListener::from_std(listener) else {
                        continue;
                    };
                    tasks.push(tokio::spawn(serve(listener, kind, Arc::clone(&state))));
                }
                for t in tasks {
                    let _ = t.await;
                }
            });
        })
        .map_err(|source| AdminError::Bind {
            addr: addrs.admin,
            source,
        })?;
    Ok(())
}

#[derive(Clone, Copy)]
enum Kind {
    Admin,
    Metrics,
    Readiness,
}

async fn serve(listener: TcpListener, kind: Kind, state: Arc<AdminState>) {
    let name = match kind {
        Kind::Admin => ListenerKind::Admin,
        Kind::Metrics => ListenerKind::Metrics,
        Kind::Readiness => ListenerKind::Readiness,
    };
    let accept = AcceptLoop::node(name, Arc::clone(&state.metrics));
    accept
        .run(listener, |stream, _| {
            let state = Arc::clone(&state);
            Some(async move {
                let service = service_fn(move |req| {
                    let state = Arc::clone(&state);
                    async move { Ok::<_, Infallible>(route(kind, &req, &state)) }
                });
                let _ = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_READ_TIMEOUT)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            })
        })
        .await;
}

fn route(kind: Kind, req: &Request<Incoming>, state: &AdminState) -> Response<Body> {
    let path = req.uri().path();
    match (kind, path) {
        (Kind::Admin, "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n"),
        (Kind::Admin, "/config_dump") => {
            reply(StatusCode::OK, "application/json", config_dump(state))
        }
        (Kind::Admin, "/logging") => logging(req, state),
        (Kind::Metrics, "/metrics") => {
            refresh_gauges(state);
            reply(
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                state.metrics.encode(),
            )
        }
        (Kind::Readiness, "/healthz/ready") => {
            let agent = state
                .node_agent
                .as_ref()
                .map_or(Ok(()), |agent| agent.ready());
            if !state.ready.load(Ordering::Acquire) {
                reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "not ready\n")
            } else if let Err(why) = agent {
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("not ready: {why}\n"),
                )
            } else {
                reply(StatusCode::OK, "text/plain", "ready\n")
            }
        }
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
    }
}

/// `/logging?level=FILTER`: the value is URL-decoded and checked
/// (`telemetry::log_filter`); a filter that is refused changes nothing and
/// is answered 400 naming it and what is wrong. The answer and the log line
/// show the filter as installed (with the default level and the access log
/// added when the filter left them out).
fn logging(req: &Request<Incoming>, state: &AdminState) -> Response<Body> {
    let Some(raw) = req
        .uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .find_map(|kv| kv.strip_prefix("level="))
    else {
        return reply(
            StatusCode::BAD_REQUEST,
            "text/plain",
            "usage: /logging?level=<filter>\n",
        );
    };
    let refused = |reason: String| {
        tracing::warn!(filter = %raw, %reason, "log filter change refused");
        reply(
            StatusCode::BAD_REQUEST,
            "text/plain",
            format!("invalid log filter {raw:?}: {reason}\n"),
        )
    };
    let filter = match log_filter::url_decode(raw).and_then(|f| log_filter::complete(&f)) {
        Ok(filter) => filter,
        Err(e) => return refused(e.to_string()),
    };
    match (state.log_control)(&filter) {
        Ok(()) => {
            tracing::info!(%filter, "log filter changed");
            reply(
                StatusCode::OK,
                "text/plain",
                format!("log filter set to {filter}\n"),
            )
        }
        Err(e) => refused(e),
    }
}

fn refresh_gauges(state: &AdminState) {
    let m = &state.metrics;
    if let Ok(Ok(counters)) = state
        .registry
        .with_programs(|p| capture::counters::read(&p.ebpf))
    {
        for (counter, value) in counters.iter() {
            let labels = crate::telemetry::metrics::CaptureLabels {
                event: counter.name().to_owned(),
            };
            m.capture.get_or_create(&labels).set(value as i64);
        }
    }
    let pods = state.registry.list();
    let _ = state.registry.with_programs(|p| {
        for pod in &pods {
            if let Ok(seen) = capture::maps::pod_pending(&p.ebpf, pod.netns_cookie) {
                m.pod_pending_seen(&pod.uid, seen.pending, seen.refused);
            }
        }
    });
    let shared = state.registry.shared();
    m.pool_connections
        .set(shared.pool.open_connections() as i64);
    m.pool_reused.set(shared.pool.reused() as i64);
    m.ca_failures.set(shared.certs.ca_failures() as i64);
    m.cert_rotations.set(shared.certs.rotations() as i64);
    for cert in shared.certs.dump() {
        let labels = crate::telemetry::metrics::CertLabels {
            identity: cert.identity,
        };
        m.cert_expiry
            .get_or_create(&labels)
            .set(cert.not_after as i64);
    }
}

fn config_dump(state: &AdminState) -> String {
    let shared = state.registry.shared();
    let mesh = shared.state.current();
    let config = mesh.config();
    let programs = state
        .registry
        .with_programs(|p| {
            let counters = capture::counters::read(&p.ebpf).ok();
            let maps: serde_json::Map<String, serde_json::Value> = p
                .ebpf
                .maps()
                .map(|(name, map)| (name.to_owned(), serde_json::json!(map_entries(map))))
                .collect();
            serde_json::json!({
                "programs": p.ebpf.programs().map(|(name, _)| name).collect::<Vec<_>>(),
                "maps": maps,
                "counters": counters.map(|c| c.iter().map(|(k, v)| (k.name().to_owned(), v)).collect::<std::collections::BTreeMap<_, _>>()),
            })
        })
        .unwrap_or_default();
    let dump = serde_json::json!({
        "trustDomain": config.trust_domain,
        "workloads": config.workloads,
        "services": config.services,
        "policies": config.policies,
        "peerAuthentications": config.peer_authentications,
        "outboundTrafficPolicy": config.outbound_traffic_policy,
        "certificates": shared.certs.dump(),
        "enrolledPods": state.registry.list(),
        // Enrolled pods that get no traffic because the mesh state does not
        // list their workload (`state::mesh::WORKLOAD_UNKNOWN`).
        "podsWithoutWorkload": state
            .registry
            .list()
            .into_iter()
            .filter(|p| mesh.workload(&p.uid).is_none())
            .map(|p| p.uid)
            .collect::<Vec<_>>(),
        "capture": {
            "cgroup": state.cgroup,
            "pins": state.registry.pins().pinned_objects(),
            "kernel": programs,
        },
        "hbonePool": {
            "slots": shared.pool.slots(),
            "openConnections": shared.pool.open_connections(),
            "tlsHandshakes": shared.pool.handshakes(),
            "reusedStreams": shared.pool.reused(),
        },
        "activeConnections": state.metrics.active_connections(),
        "xds": state.xds.as_ref().map(|x| {
            x.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
        }),
    });
    serde_json::to_string_pretty(&dump).unwrap_or_default()
}

/// Entries in a hash-like map (arrays report their size; others `null`).
fn map_entries(map: &aya::maps::Map) -> Option<usize> {
    use aya::maps::Map;
    match map {
        Map::HashMap(data) | Map::LruHashMap(data) | Map::LpmTrie(data) => count_keys(data),
        _ => None,
    }
}

/// Counts the keys of a hash map by walking `BPF_MAP_GET_NEXT_KEY`.
fn count_keys(data: &aya::maps::MapData) -> Option<usize> {
    let info = data.info().ok()?;
    let key_size = info.key_size() as usize;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&std::os::fd::AsFd::as_fd(data.fd()));
    let mut key = vec![0u8; key_size];
    let mut next = vec![0u8; key_size];
    let mut count = 0usize;
    let mut first = true;
    // Bounded: never more than the map can hold.
    for _ in 0..=info.max_entries() {
        #[repr(C)]
        struct Attr {
            map_fd: u32,
            _pad: u32,
            key: u64,
            next_key: u64,
        }
        let attr = Attr {
            map_fd: fd as u32,
            _pad: 0,
            key: if first { 0 } else { key.as_ptr() as u64 },
            next_key: next.as_mut_ptr() as u64,
        };
        // SAFETY: BPF_MAP_GET_NEXT_KEY (4) with buffers of the map's key size.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                4,
                &raw const attr,
                std::mem::size_of::<Attr>(),
            )
        };
        if rc != 0 {
            break;
        }
        count += 1;
        first = false;
        key.copy_from_slice(&next);
    }
    Some(count)
}

/// Marks ready/unready.
pub fn set_ready(flag: &AtomicBool, ready: bool) {
    flag.store(ready, Ordering::Release);
}
