//! The record of one proxied connection: metrics and the access log line.

use std::{net::SocketAddr, sync::Arc, time::Instant};

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
    metrics: Arc<Metrics>,
    labels: TcpLabels,
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
        src: Endpoint,
        dst: Endpoint,
        service: Option<&str>,
    ) -> Self {
        let labels = TcpLabels {
            reporter: if direction == "outbound" {
                "source"
            } else {
                "destination"
            }
            .into(),
            source_workload: Endpoint::or_unknown(&src.workload),
            source_workload_namespace: Endpoint::or_unknown(&src.namespace),
            source_principal: src.identity.clone().unwrap_or_else(|| "unknown".into()),
            destination_workload: Endpoint::or_unknown(&dst.workload),
            destination_workload_namespace: Endpoint::or_unknown(&dst.namespace),
            destination_principal: dst.identity.clone().unwrap_or_else(|| "unknown".into()),
            destination_service: service.unwrap_or("unknown").to_owned(),
            connection_security_policy: if matches!(path, "hbone" | "local") {
                "mutual_tls"
            } else {
                "none"
            }
            .into(),
            response_flags: "-".into(),
        };
        metrics.opened.get_or_create(&labels).inc();
        Self {
            metrics: Arc::clone(metrics),
            labels,
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
        self.metrics.sent.get_or_create(&self.labels).inc_by(sent);
        self.metrics
            .received
            .get_or_create(&self.labels)
            .inc_by(received);
        self.metrics.closed.get_or_create(&self.labels).inc();
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
