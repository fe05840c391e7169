//! Prometheus metrics.

use std::sync::{Arc, Mutex, atomic::AtomicI64};

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

/// Istio's standard TCP labels, the set Istio's ztunnel reports (in its
/// order), so that Istio's dashboards and Kiali read them as they are.
/// What is not known is `unknown`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TcpLabels {
    /// `source` (the client's ztunnel) or `destination` (the server's).
    pub reporter: String,
    /// Source workload (xDS `workload_name`, else the workload's name).
    pub source_workload: String,
    /// Source canonical service.
    pub source_canonical_service: String,
    /// Source canonical revision.
    pub source_canonical_revision: String,
    /// Source workload namespace.
    pub source_workload_namespace: String,
    /// Source SPIFFE id.
    pub source_principal: String,
    /// Source app (Istio: the canonical service).
    pub source_app: String,
    /// Source version (Istio: the canonical revision).
    pub source_version: String,
    /// Source cluster id.
    pub source_cluster: String,
    /// Destination service hostname (`name.namespace.svc.cluster.local`).
    pub destination_service: String,
    /// Destination service namespace.
    pub destination_service_namespace: String,
    /// Destination service name.
    pub destination_service_name: String,
    /// Destination workload.
    pub destination_workload: String,
    /// Destination canonical service.
    pub destination_canonical_service: String,
    /// Destination canonical revision.
    pub destination_canonical_revision: String,
    /// Destination workload namespace.
    pub destination_workload_namespace: String,
    /// Destination SPIFFE id.
    pub destination_principal: String,
    /// Destination app.
    pub destination_app: String,
    /// Destination version.
    pub destination_version: String,
    /// Destination cluster id.
    pub destination_cluster: String,
    /// `tcp`.
    pub request_protocol: String,
    /// `-`, or why the connection failed.
    pub response_flags: String,
    /// `mutual_tls`, or `unknown` for plain TCP (Istio's values).
    pub connection_security_policy: String,
}

/// Labels of policy denials.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DenialLabels {
    /// The policy (or `mtls_strict`, `no_allow_match`).
    pub policy: String,
}

/// Labels of config reloads.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    /// `accepted` or `rejected`.
    pub result: String,
    /// Why a reload was rejected (`unreadable`, `empty`, `syntax`,
    /// `invalid`); `-` when accepted.
    pub reason: String,
}

/// Labels of capture counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CaptureLabels {
    /// Counter name (`connect_redirected`, ...).
    pub event: String,
}

/// Labels of timeouts.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TimeoutLabels {
    /// Which phase ran out of time (`connect`, `tls_handshake`, ...; see
    /// [`crate::timeouts::Phase`]).
    pub phase: String,
}

/// Labels of failed `accept()` calls.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AcceptErrorLabels {
    /// Which listener (`outbound`, `inbound_plaintext`, `hbone`, `socks5`,
    /// `admin`, `metrics`, `readiness`, `enrolment`).
    pub listener: String,
    /// What failed (see [`crate::accept::AcceptErrorKind`]).
    pub kind: String,
}

/// Labels of limits reached.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabels {
    /// Which limit (see [`crate::limits::Limit`]).
    pub limit: String,
}

/// Labels of a pod's refusals by a limit.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodLimitLabels {
    /// The pod (enrolment uid).
    pub pod: String,
    /// Which limit (see [`crate::limits::Limit`]).
    pub limit: String,
}

/// Labels of a per-pod gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodLabels {
    /// The pod (enrolment uid).
    pub pod: String,
}

/// Labels of TLS handshakes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandshakeLabels {
    /// `client` (the HBONE pool) or `server` (port 15008).
    pub side: String,
    /// `ok`, `failed`, `timeout` or `evicted`.
    pub outcome: String,
}

/// Which end of an HBONE TLS handshake we were.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeSide {
    /// The pool, connecting to a peer's 15008.
    Client,
    /// A pod's 15008.
    Server,
}

/// How an HBONE TLS handshake ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeOutcome {
    /// Done, and the peer is one we accept (ALPN `h2`, a SPIFFE identity).
    Ok,
    /// Refused or broken (not TLS, untrusted certificate, no `h2`).
    Failed,
    /// Ran out of time.
    Timeout,
    /// Closed to make room under node pressure (server side only; see
    /// `limits::handshakes`).
    Evicted,
}

/// Labels of certificate expiry.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CertLabels {
    /// SPIFFE id.
    pub identity: String,
}

/// Every metric ztunnel exports.
pub struct Metrics {
    registry: Mutex<Registry>,
    /// `istio_tcp_connections_opened_total`.
    pub opened: Family<TcpLabels, Counter>,
    /// `istio_tcp_connections_closed_total`.
    pub closed: Family<TcpLabels, Counter>,
    /// `istio_tcp_sent_bytes_total` (client -> server).
    pub sent: Family<TcpLabels, Counter>,
    /// `istio_tcp_received_bytes_total` (server -> client).
    pub received: Family<TcpLabels, Counter>,
    /// `ztunnel_policy_denials_total`.
    pub denials: Family<DenialLabels, Counter>,
    /// `ztunnel_config_reloads_total`.
    pub reloads: Family<ReloadLabels, Counter>,
    /// `ztunnel_connections_closed_by_policy_total`: open connections closed
    /// because a new state no longer allows them (refusals at open are in
    /// `denials`).
    pub policy_closes: Family<DenialLabels, Counter>,
    /// `ztunnel_timeouts_total`: connections closed because a peer stalled
    /// a phase past its limit.
    pub timeouts: Family<TimeoutLabels, Counter>,
    /// `ztunnel_capture_events_total` (from the kernel maps, set at scrape).
    pub capture: Family<CaptureLabels, Gauge>,
    /// `ztunnel_hbone_pool_connections` (set at scrape).
    pub pool_connections: Gauge,
    /// `ztunnel_hbone_tls_handshakes_total{side,outcome}`.
    pub handshakes: Family<HandshakeLabels, Counter>,
    /// `ztunnel_accept_errors_total{listener,kind}`.
    pub accept_errors: Family<AcceptErrorLabels, Counter>,
    /// `ztunnel_limit_reached_total{limit}`: connections and clients
    /// refused because a limit was reached.
    pub limits_reached: Family<LimitLabels, Counter>,
    /// The same refusals of pods' connections, by pod: which pod is over
    /// its share.
    pub pod_limits_reached: Family<PodLimitLabels, Counter>,
    /// `ztunnel_pod_handshakes_evicted_total{pod,limit}`: a pod's HBONE
    /// connections closed in their handshake to make room while the
    /// node's `limit` was reached.
    pub pod_handshakes_evicted: Family<PodLimitLabels, Counter>,
    /// `ztunnel_pod_pending_connects{pod}`: the pod's captured connects in
    /// `SYN_SENT` holding a kernel record (its use of
    /// `--max-pod-pending-connects`; set at scrape).
    pub pod_pending: Family<PodLabels, Gauge>,
    /// `ztunnel_pod_splice_pipes{pod}`: splice pipes a pod's relays hold
    /// (its use of `--max-pod-splice-pipes`; pods holding none are not
    /// listed).
    pub pod_pipes: Family<PodLabels, Gauge>,
    /// `ztunnel_splice_pipes`: splice pipes in use on the node (of
    /// `--splice-pipes`).
    pub splice_pipes: Gauge,
    /// `ztunnel_accepted_connections`: connections accepted on the pods'
    /// listeners and still open (what `--max-connections-per-node` counts).
    pub accepted: Gauge<i64, AtomicI64>,
    /// `ztunnel_hbone_pending_handshakes`: connections on the pods' 15008
    /// still in their TLS or HTTP/2 handshake.
    pub pending_handshakes: Gauge<i64, AtomicI64>,
    /// `ztunnel_enrol_clients`: clients connected to the enrolment socket.
    pub enrol_clients: Gauge<i64, AtomicI64>,
    /// `ztunnel_hbone_pool_reused_streams_total` (set at scrape).
    pub pool_reused: Gauge,
    /// `ztunnel_certificate_expiry_seconds` (unix time, set at scrape).
    pub cert_expiry: Family<CertLabels, Gauge>,
    /// `ztunnel_certificate_requests_failed_total` (Istio's CA; set at
    /// scrape).
    pub ca_failures: Gauge,
    /// `ztunnel_certificate_rotations_total` (set at scrape).
    pub cert_rotations: Gauge,
    /// `ztunnel_active_connections`.
    pub active: Gauge<i64, AtomicI64>,
    /// `ztunnel_spliced_bytes_total`: bytes of TCP-to-TCP relays the kernel
    /// moved between the two sockets (`splice`), counted when the relay
    /// ends without an error, as the `istio_tcp_*_bytes` totals (which
    /// include them) are.
    pub spliced: Counter,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Registers everything.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::default();
        let this = Self {
            registry: Mutex::new(Registry::default()),
            opened: Family::default(),
            closed: Family::default(),
            sent: Family::default(),
            received: Family::default(),
            denials: Family::default(),
            reloads: Family::default(),
            policy_closes: Family::default(),
            timeouts: Family::default(),
            capture: Family::default(),
            pool_connections: Gauge::default(),
            handshakes: Family::default(),
            accept_errors: Family::default(),
            limits_reached: Family::default(),
            pod_limits_reached: Family::default(),
            pod_handshakes_evicted: Family::default(),
            pod_pending: Family::default(),
            pod_pipes: Family::default(),
            splice_pipes: Gauge::default(),
            accepted: Gauge::default(),
            pending_handshakes: Gauge::default(),
            enrol_clients: Gauge::default(),
            pool_reused: Gauge::default(),
            cert_expiry: Family::default(),
            ca_failures: Gauge::default(),
            cert_rotations: Gauge::default(),
            active: Gauge::default(),
            spliced: Counter::default(),
        };
        registry.register(
            "istio_tcp_connections_opened",
            "TCP connections opened",
            this.opened.clone(),
        );
        registry.register(
            "istio_tcp_connections_closed",
            "TCP connections closed",
            this.closed.clone(),
        );
        registry.register(
            "istio_tcp_sent_bytes",
            "Bytes sent by the client",
            this.sent.clone(),
        );
        registry.register(
            "istio_tcp_received_bytes",
            "Bytes received by the client",
            this.received.clone(),
        );
        registry.register(
            "ztunnel_policy_denials",
            "Connections denied, by policy",
            this.denials.clone(),
        );
        registry.register(
            "ztunnel_config_reloads",
            "Config reloads, by result",
            this.reloads.clone(),
        );
        registry.register(
            "ztunnel_connections_closed_by_policy",
            "Open connections closed because a policy change no longer allows them, by policy",
            this.policy_closes.clone(),
        );
        registry.register(
            "ztunnel_timeouts",
            "Connections closed because a peer stalled a phase past its time limit, by phase",
            this.timeouts.clone(),
        );
        registry.register(
            "ztunnel_capture_events",
            "Kernel capture counters (summed over CPUs), by event",
            this.capture.clone(),
        );
        registry.register(
            "ztunnel_spliced_bytes",
            "Bytes of plain TCP relays (passthrough, plaintext inbound, same node) moved by the kernel with splice instead of copied through ztunnel",
            this.spliced.clone(),
        );
        registry.register(
            "ztunnel_hbone_pool_connections",
            "Open pooled HBONE connections",
            this.pool_connections.clone(),
        );
        registry.register(
            "ztunnel_hbone_tls_handshakes",
            "HBONE TLS handshakes, by side (client: the pool; server: port 15008) and outcome",
            this.handshakes.clone(),
        );
        registry.register(
            "ztunnel_accept_errors",
            "Failed accept() calls, by listener and kind (resource errors back off)",
            this.accept_errors.clone(),
        );
        registry.register(
            "ztunnel_limit_reached",
            "Connections or clients refused because a limit was reached, by limit",
            this.limits_reached.clone(),
        );
        registry.register(
            "ztunnel_pod_limit_reached",
            "Connections of a pod refused because it or the node reached a limit, by pod and limit",
            this.pod_limits_reached.clone(),
        );
        registry.register(
            "ztunnel_pod_handshakes_evicted",
            "HBONE connections to a pod closed in their handshake to make room while the node's limit was reached, by pod and limit",
            this.pod_handshakes_evicted.clone(),
        );
        registry.register(
            "ztunnel_pod_splice_pipes",
            "Splice pipes a pod's relays hold, by pod",
            this.pod_pipes.clone(),
        );
        registry.register(
            "ztunnel_splice_pipes",
            "Splice pipes the node's relays hold",
            this.splice_pipes.clone(),
        );
        registry.register(
            "ztunnel_pod_pending_connects",
            "Captured connects of a pod waiting for their handshake with its outbound listener (kernel records held), by pod",
            this.pod_pending.clone(),
        );
        registry.register(
            "ztunnel_accepted_connections",
            "Connections accepted on the pods' listeners and still open",
            this.accepted.clone(),
        );
        registry.register(
            "ztunnel_hbone_pending_handshakes",
            "Connections on the pods' HBONE port still in their TLS or HTTP/2 handshake",
            this.pending_handshakes.clone(),
        );
        registry.register(
            "ztunnel_enrol_clients",
            "Clients connected to the enrolment socket",
            this.enrol_clients.clone(),
        );
        registry.register(
            "ztunnel_hbone_pool_reused_streams",
            "Streams carried on an existing pooled connection",
            this.pool_reused.clone(),
        );
        registry.register(
            "ztunnel_certificate_expiry_seconds",
            "Expiry of each workload certificate (unix time; 0 while the first is awaited)",
            this.cert_expiry.clone(),
        );
        registry.register(
            "ztunnel_certificate_requests_failed",
            "Certificate requests to Istio's CA that failed (retried with back-off)",
            this.ca_failures.clone(),
        );
        registry.register(
            "ztunnel_certificate_rotations",
            "Workload certificates replaced at half-life",
            this.cert_rotations.clone(),
        );
        registry.register(
            "ztunnel_active_connections",
            "Connections being proxied now",
            this.active.clone(),
        );
        *this
            .registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = registry;
        Arc::new(this)
    }

    /// Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let registry = self
            .registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = encode(&mut out, &registry);
        out
    }

    /// Open connections right now.
    pub fn active_connections(&self) -> i64 {
        self.active.get()
    }

    /// Counts a denial.
    pub fn deny(&self, policy: &str) {
        self.denials
            .get_or_create(&DenialLabels {
                policy: policy.to_owned(),
            })
            .inc();
    }

    /// Counts a config reload: `Ok(())` when applied, `Err(reason)` when
    /// rejected (the last good state stays).
    pub fn reload(&self, outcome: Result<(), &str>) {
        let (result, reason) = match outcome {
            Ok(()) => ("accepted", "-"),
            Err(reason) => ("rejected", reason),
        };
        self.reloads
            .get_or_create(&ReloadLabels {
                result: result.into(),
                reason: reason.into(),
            })
            .inc();
    }

    /// Counts a phase that ran out of time.
    pub fn timed_out(&self, phase: crate::timeouts::Phase) {
        self.timeouts
            .get_or_create(&TimeoutLabels {
                phase: phase.as_str().to_owned(),
            })
            .inc();
    }

    /// Counts a TLS handshake of an HBONE connection.
    pub fn handshake(&self, side: HandshakeSide, outcome: HandshakeOutcome) {
        let side = match side {
            HandshakeSide::Client => "client",
            HandshakeSide::Server => "server",
        };
        let outcome = match outcome {
            HandshakeOutcome::Ok => "ok",
            HandshakeOutcome::Failed => "failed",
            HandshakeOutcome::Timeout => "timeout",
            HandshakeOutcome::Evicted => "evicted",
        };
        self.handshakes
            .get_or_create(&HandshakeLabels {
                side: side.into(),
                outcome: outcome.into(),
            })
            .inc();
    }

    /// Counts a failed `accept()` on `listener`.
    pub fn accept_failed(&self, listener: &str, kind: &str) {
        self.accept_errors
            .get_or_create(&AcceptErrorLabels {
                listener: listener.into(),
                kind: kind.into(),
            })
            .inc();
    }

    /// Counts a connection or client refused by `limit`.
    pub fn limit_reached(&self, limit: &str) {
        self.limits_reached
            .get_or_create(&LimitLabels {
                limit: limit.into(),
            })
            .inc();
    }

    /// Counts a refusal of one of pod `pod`'s connections by `limit`.
    pub fn pod_limit_reached(&self, pod: &str, limit: &str) {
        self.pod_limits_reached
            .get_or_create(&PodLimitLabels {
                pod: pod.into(),
                limit: limit.into(),
            })
            .inc();
    }

    /// Counts one of pod `pod`'s HBONE handshakes evicted while the node's
    /// `limit` was reached.
    pub fn pod_handshake_evicted(&self, pod: &str, limit: &str) {
        self.pod_handshakes_evicted
            .get_or_create(&PodLimitLabels {
                pod: pod.into(),
                limit: limit.into(),
            })
            .inc();
    }

    /// Shows that pod `pod` holds `held` splice pipes (none: the series
    /// goes, so pods that left leave nothing behind).
    pub fn pod_pipes_held(&self, pod: &str, held: usize) {
        let labels = PodLabels { pod: pod.into() };
        if held == 0 {
            self.pod_pipes.remove(&labels);
        } else {
            self.pod_pipes
                .get_or_create(&labels)
                .set(i64::try_from(held).unwrap_or(i64::MAX));
        }
    }

    /// Publishes what the kernel counted for pod `pod` (`POD_PENDING`):
    /// its pending connects, and its connects refused at its share, which
    /// only ever grow, as that pod's `pod_pending_connects` refusals.
    pub fn pod_pending_seen(&self, pod: &str, pending: u64, refused: u64) {
        self.pod_pending
            .get_or_create(&PodLabels { pod: pod.into() })
            .set(i64::try_from(pending).unwrap_or(i64::MAX));
        if refused == 0 {
            return;
        }
        let counter = self.pod_limits_reached.get_or_create(&PodLimitLabels {
            pod: pod.into(),
            limit: crate::limits::Limit::PodPendingConnects.as_str().into(),
        });
        let seen = counter.get();
        if refused > seen {
            counter.inc_by(refused - seen);
        }
    }

    /// Drops pod `pod`'s refusal counts (it left the node): the series
    /// would otherwise grow with every pod that ever hit a limit.
    pub fn forget_pod_limits(&self, pod: &str) {
        self.pod_pending.remove(&PodLabels { pod: pod.into() });
        for limit in crate::limits::Limit::POD {
            self.pod_limits_reached.remove(&PodLimitLabels {
                pod: pod.into(),
                limit: limit.as_str().into(),
            });
            self.pod_handshakes_evicted.remove(&PodLimitLabels {
                pod: pod.into(),
                limit: limit.as_str().into(),
            });
        }
    }

    /// Counts an open connection closed because `policy` no longer allows it.
    pub fn closed_by_policy(&self, policy: &str) {
        self.policy_closes
            .get_or_create(&DenialLabels {
                policy: policy.to_owned(),
            })
            .inc();
    }
}

/// Keeps `ztunnel_active_connections` honest: +1 now, -1 on drop.
#[derive(Debug)]
pub struct ActiveGuard(Arc<Metrics>);

impl ActiveGuard {
    /// Counts one active connection.
    pub fn new(metrics: &Arc<Metrics>) -> Self {
        metrics.active.inc();
        Self(Arc::clone(metrics))
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.dec();
    }
}
