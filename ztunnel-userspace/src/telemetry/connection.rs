//! The record of one proxied connection: metrics and the access log line.

use std::{net::SocketAddr, sync::Arc, time::Instant};

use prometheus_client::metrics::counter::Counter;

use super::metrics::{ActiveGuard, Metrics, TcpLabels};

/// One side of a connection as the access log and metrics show it.
#[derive(Debug, Clone, Default)]
pub struct Endpoint {
    /// Workload name (`unknown` outside the mesh state).
    pub workload: String,
    /// Workload namespace.
    pub namespace: String,
    /// Address.
    pub addr: Option<SocketAddr>,
    /// SPIFFE id, if known and verified.
    pub identity: Option<String>,
    /// What the metrics' workload labels show (empty outside the mesh).
    pub meta: WorkloadMeta,
}

/// A workload's metric labels ([`crate::state::Workload::meta`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkloadMeta {
    /// `*_workload`.
    pub workload_name: String,
    /// `*_canonical_service` and `*_app`.
    pub canonical_service: String,
    /// `*_canonical_revision` and `*_version`.
    pub canonical_revision: String,
    /// `*_cluster`.
    pub cluster: String,
}

/// The service a connection was addressed to, for the metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceRef {
    /// `name.namespace.svc.cluster.local`.
    pub hostname: String,
    /// Name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
}

impl From<&crate::state::Service> for ServiceRef {
    fn from(s: &crate::state::Service) -> Self {
        Self {
            hostname: s.hostname(),
            name: s.name.clone(),
            namespace: s.namespace.clone(),
        }
    }
}

impl Endpoint {
    fn or_unknown(s: &str) -> String {
        if s.is_empty() {
            "unknown".into()
        } else {
            s.to_owned()
        }
    }
}

/// A connection being proxied. Created when it opens (counted as opened);
/// [`ConnectionRecord::close`] counts bytes and closure and logs it.
#[derive(Debug)]
pub struct ConnectionRecord {
    /// This connection's series, looked up once at open: a connection
    /// keeps three counter handles, not its 23 labels.
    sent: Counter,
    received: Counter,
    closed: Counter,
    direction: &'static str,
    path: &'static str,
    src: Endpoint,
    dst: Endpoint,
    started: Instant,
    _active: ActiveGuard,
}

impl ConnectionRecord {
    /// Counts the connection as opened.
    pub fn open(
        metrics: &Arc<Metrics>,
        direction: &'static str,
        path: &'static str,
        mut src: Endpoint,
        mut dst: Endpoint,
        service: Option<&ServiceRef>,
    ) -> Self {
        let unknown = Endpoint::or_unknown;
        let workload = |e: &Endpoint| {
            if e.meta.workload_name.is_empty() {
                unknown(&e.workload)
            } else {
                e.meta.workload_name.clone()
            }
        };
        let service_field = |f: fn(&ServiceRef) -> &str| unknown(service.map_or("", f));
        let labels = TcpLabels {
            reporter: if direction == "outbound" {
                "source"
            } else {
                "destination"
            }
            .into(),
            source_workload: workload(&src),
            source_canonical_service: unknown(&src.meta.canonical_service),
            source_canonical_revision: unknown(&src.meta.canonical_revision),
            source_workload_namespace: unknown(&src.namespace),
            source_principal: src.identity.clone().unwrap_or_else(|| "unknown".into()),
            source_app: unknown(&src.meta.canonical_service),
            source_version: unknown(&src.meta.canonical_revision),
            source_cluster: unknown(&src.meta.cluster),
            destination_service: service_field(|s| &s.hostname),
            destination_service_namespace: service_field(|s| &s.namespace),
            destination_service_name: service_field(|s| &s.name),
            destination_workload: workload(&dst),
            destination_canonical_service: unknown(&dst.meta.canonical_service),
            destination_canonical_revision: unknown(&dst.meta.canonical_revision),
            destination_workload_namespace: unknown(&dst.namespace),
            destination_principal: dst.identity.clone().unwrap_or_else(|| "unknown".into()),
            destination_app: unknown(&dst.meta.canonical_service),
            destination_version: unknown(&dst.meta.canonical_revision),
            destination_cluster: unknown(&dst.meta.cluster),
            request_protocol: "tcp".into(),
            response_flags: "-".into(),
            connection_security_policy: if matches!(path, "hbone" | "local") {
                "mutual_tls"
            } else {
                "unknown"
            }
            .into(),
        };
        metrics.opened.get_or_create(&labels).inc();
        // The access log shows neither the workload labels nor more.
        src.meta = WorkloadMeta::default();
        dst.meta = WorkloadMeta::default();
        Self {
            sent: metrics.sent.get_or_create(&labels).clone(),
            received: metrics.received.get_or_create(&labels).clone(),
            closed: metrics.closed.get_or_create(&labels).clone(),
            direction,
            path,
            src,
            dst,
            started: Instant::now(),
            _active: ActiveGuard::new(metrics),
        }
    }

    /// Counts bytes and the closure, and writes the access log line.
    /// `sent` is client -> server, `received` server -> client.
    pub fn close(self, sent: u64, received: u64, result: &Result<(), String>) {
        self.sent.inc_by(sent);
        self.received.inc_by(received);
        self.closed.inc();
        let (outcome, reason) = match result {
            Ok(()) => ("ok", String::new()),
            Err(e) => ("error", e.clone()),
        };
        access_log(
            &self.src,
            &self.dst,
            self.direction,
            self.path,
            sent,
            received,
            self.started,
            outcome,
            &reason,
        );
    }
}

/// Writes an access log line for a connection that was refused before it
/// was proxied, and counts the denial.
pub fn denied(
    metrics: &Metrics,
    src: &Endpoint,
    dst: &Endpoint,
    direction: &'static str,
    policy: &str,
    reason: &str,
) {
    metrics.deny(policy);
    access_log(
        src,
        dst,
        direction,
        "denied",
        0,
        0,
        Instant::now(),
        "denied",
        reason,
    );
}

#[allow(clippy::too_many_arguments)] // one flat log line; a struct would only rename the fields
fn access_log(
    src: &Endpoint,
    dst: &Endpoint,
    direction: &str,
    path: &str,
    sent: u64,
    received: u64,
    started: Instant,
    result: &str,
    reason: &str,
) {
    let show = |a: &Option<SocketAddr>| a.map(|a| a.to_string()).unwrap_or_default();
    tracing::info!(
        target: "access",
        src_workload = %src.workload,
        src_namespace = %src.namespace,
        src_addr = %show(&src.addr),
        src_identity = %src.identity.as_deref().unwrap_or(""),
        dst_workload = %dst.workload,
        dst_namespace = %dst.namespace,
        dst_addr = %show(&dst.addr),
        dst_identity = %dst.identity.as_deref().unwrap_or(""),
        direction,
        path,
        bytes_sent = sent,
        bytes_received = received,
        duration_ms = started.elapsed().as_millis() as u64,
        result,
        reason,
        "connection"
    );
}
