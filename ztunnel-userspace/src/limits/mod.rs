//! Limits on what clients can make ztunnel hold: open connections per pod
//! and per node, HBONE handshakes in progress, enrolment clients.
//!
//! Each is checked where the thing is accepted, and a connection over a
//! limit is reset at once (never queued: a queue would only move the
//! pile-up somewhere less visible). Every refusal is counted in
//! `ztunnel_limit_reached_total{limit}` and logged with the pod and the
//! limit, at most once per ten seconds per pod and limit
//! (`telemetry::throttle`).
//!
//! What counts as a connection: a TCP connection accepted on one of a pod's
//! listeners (15001, 15006, 15008, 15080), from accept to close, like
//! Envoy's downstream connection limits. The streams of one HBONE
//! connection are bounded by HTTP/2 (`SERVER_MAX_STREAMS`), not here.
//!
//! Permits are RAII guards: however a connection ends, its count goes
//! back.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicUsize, Ordering},
    },
};

use prometheus_client::metrics::gauge::Gauge;

use crate::telemetry::{Metrics, throttle::LogThrottle};

mod handshakes;

pub use handshakes::{Evicted, HandshakePlace};

/// Open connections one pod may have on each [`Side`]. A busy pod (a
/// gateway, a database proxy) holds thousands; sixteen thousand is well
/// above that, and a quarter of the node's limit, so one pod cannot take
/// all of it.
pub const DEFAULT_CONNECTIONS_PER_POD: usize = 16_384;
/// Open connections on the node. Each costs two file descriptors and 5 to
/// 16 KiB (docs/performance.md): 65,536 is 128 Ki fds and at most 1 GiB,
/// inside a node agent's usual budget and far above what nodes carry.
/// (Streaming TCP-to-TCP directions also hold a pipe, two more fds, from a
/// budget of their own: `--splice-pipes`, 1,024 by default.)
pub const DEFAULT_CONNECTIONS_PER_NODE: usize = 65_536;
/// HBONE connections in their TLS or HTTP/2 handshake at once. A handshake
/// takes about a millisecond of CPU and is bounded in time by the handshake
/// timeouts; a legitimate burst (every node reconnecting after a restart)
/// is a few hundred. 1,024 bounds what a slowloris holds to 1,024 sockets
/// for at most the handshake timeout.
pub const DEFAULT_HBONE_HANDSHAKES: usize = 1_024;
/// HBONE handshakes in progress to one pod. A quarter of the node's, as
/// for connections: a flood of silent connections to one pod's 15008 (a
/// hostile client needs no certificate to start a handshake) then holds
/// at most a quarter of the node's places, and every other pod's peers
/// still get through. A legitimate burst to one pod (its clients'
/// ztunnels reconnecting at once) is one connection per client node.
pub const DEFAULT_HBONE_HANDSHAKES_PER_POD: usize = 256;
/// ztunnel's transparent legs to one pod's application connecting at once,
/// each holding an entry of the node's 65,536-entry `INBOUND_LEGS` map
/// until its connect returns. An application that never accepts (or a pod
/// that drops its own SYNs) keeps them for the connect timeout; an eighth
/// of the map, as for pending connects, leaves the rest to the other pods.
/// A legitimate application accepts in microseconds.
pub const DEFAULT_PENDING_LEGS_PER_POD: usize = 8_192;
/// Clients connected to the enrolment socket at once. Enrolments run one at
/// a time anyway (the registry serialises them); this bounds the threads
/// that waiting clients hold while leaving room for a burst of CNI calls.
pub const DEFAULT_ENROL_CLIENTS: usize = 64;

/// Open connections on each of the admin (15000), metrics (15020) and
/// readiness (15021) servers. Scrapers and probes hold one or two at a
/// time; 128 leaves room for several of them while bounding what a pod
/// that can reach 15020 or 15021 can make ztunnel hold (each such server
/// also drops a client that sends no request headers within
/// `admin::HEADER_READ_TIMEOUT`).
pub const ADMIN_CONNECTIONS_PER_LISTENER: usize = 128;

/// The limits (built from flags by `main`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Open connections per pod.
    pub connections_per_pod: usize,
    /// Open connections on the node.
    pub connections_per_node: usize,
    /// HBONE connections in their handshakes.
    pub hbone_handshakes: usize,
    /// HBONE connections in their handshakes to one pod.
    pub hbone_handshakes_per_pod: usize,
    /// Transparent legs to one pod's application connecting at once.
    pub pending_legs_per_pod: usize,
    /// Enrolment socket clients.
    pub enrol_clients: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connections_per_pod: DEFAULT_CONNECTIONS_PER_POD,
            connections_per_node: DEFAULT_CONNECTIONS_PER_NODE,
            hbone_handshakes: DEFAULT_HBONE_HANDSHAKES,
            hbone_handshakes_per_pod: DEFAULT_HBONE_HANDSHAKES_PER_POD,
            pending_legs_per_pod: DEFAULT_PENDING_LEGS_PER_POD,
            enrol_clients: DEFAULT_ENROL_CLIENTS,
        }
    }
}

/// Which limit refused something (the `limit` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    /// `--max-connections-per-pod`.
    PodConnections,
    /// `--max-connections-per-node`.
    NodeConnections,
    /// `--max-hbone-handshakes`.
    HboneHandshakes,
    /// `--max-pod-hbone-handshakes`.
    PodHboneHandshakes,
    /// `--max-pod-pending-connects` (enforced in the kernel; counted from
    /// its `POD_PENDING` map when `/metrics` is read).
    PodPendingConnects,
    /// `--max-pod-pending-legs`.
    PodPendingLegs,
    /// `--max-pod-splice-pipes` (a relay past it copies instead of
    /// splicing: counted, not refused).
    PodSplicePipes,
    /// `--max-enrol-clients`.
    EnrolClients,
    /// [`ADMIN_CONNECTIONS_PER_LISTENER`].
    AdminConnections,
}

impl Limit {
    /// Number of limits.
    pub const COUNT: usize = Self::AdminConnections as usize + 1;
    /// The limits that refuse a pod's connections (counted by pod).
    pub const POD: [Self; 7] = [
        Self::PodConnections,
        Self::NodeConnections,
        Self::HboneHandshakes,
        Self::PodHboneHandshakes,
        Self::PodPendingConnects,
        Self::PodPendingLegs,
        Self::PodSplicePipes,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PodConnections => "pod_connections",
            Self::NodeConnections => "node_connections",
            Self::HboneHandshakes => "hbone_handshakes",
            Self::PodHboneHandshakes => "pod_hbone_handshakes",
            Self::PodPendingConnects => "pod_pending_connects",
            Self::PodPendingLegs => "pod_pending_legs",
            Self::PodSplicePipes => "pod_splice_pipes",
            Self::EnrolClients => "enrol_clients",
            Self::AdminConnections => "admin_connections",
        }
    }
}

/// Which of a pod's two counts a connection takes a place in. Each side
/// has the whole `--max-connections-per-pod`: connections *to* a pod
/// (which anyone who can reach it may open) never use up the places of
/// its own outbound connections, and the reverse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Connections to the pod: 15006, 15008 (the connection and each
    /// stream), the same-node path into it.
    Inbound,
    /// The pod's own connections: 15001, 15080.
    Outbound,
}

/// The node's counters, and the pods' (shared by every listener of one
/// pod, found by uid).
#[derive(Debug)]
pub struct NodeLimits {
    limits: Limits,
    metrics: Arc<Metrics>,
    pods: Mutex<HashMap<String, Weak<PodLimit>>>,
    /// HBONE handshakes in progress, by pod, oldest first.
    handshakes: Mutex<handshakes::Book>,
    enrol_log: LogThrottle,
    evict_log: LogThrottle,
}

impl NodeLimits {
    /// Counters for `limits`, reported in `metrics`.
    pub fn new(limits: Limits, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            limits,
            metrics,
            pods: Mutex::default(),
            handshakes: Mutex::default(),
            enrol_log: LogThrottle::default(),
            evict_log: LogThrottle::default(),
        })
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The counter of pod `uid`, shared by all its listeners (and kept as
    /// long as any of them or its connections hold it, so a re-enrolment
    /// while old connections drain keeps counting them).
    pub fn pod(self: &Arc<Self>, uid: &str) -> Arc<PodLimit> {
        let mut pods = self
            .pods
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(pod) = pods.get(uid).and_then(Weak::upgrade) {
            return pod;
        }
        // Pods that left: their entries go with the next new one.
        pods.retain(|_, pod| pod.strong_count() > 0);
        let pod = Arc::new(PodLimit {
            uid: uid.to_owned(),
            open: [AtomicUsize::new(0), AtomicUsize::new(0)],
            legs: AtomicUsize::new(0),
            node: Arc::clone(self),
            logs: Default::default(),
        });
        pods.insert(uid.to_owned(), Arc::downgrade(&pod));
        pod
    }

    /// A place among the enrolment socket's clients, or `None` (counted
    /// and logged) when they are all taken.
    pub fn enrol_client(&self) -> Option<Slot> {
        let slot = Slot::take(&self.metrics.enrol_clients, self.limits.enrol_clients);
        if slot.is_none() {
            self.metrics.limit_reached(Limit::EnrolClients.as_str());
            if let Some(suppressed) = self.enrol_log.allow() {
                tracing::warn!(
                    limit = Limit::EnrolClients.as_str(),
                    max = self.limits.enrol_clients,
                    suppressed,
                    "limit reached: enrolment client refused"
                );
            }
        }
        slot
    }

    fn book(&self) -> std::sync::MutexGuard<'_, handshakes::Book> {
        self.handshakes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Makes room for a connection of `pod` when the node's open
    /// connections are all taken: closes the oldest HBONE handshake of the
    /// pod holding the most (the first to go under pressure). Whether one
    /// was closed.
    fn evict_for_connection(&self, pod: &PodLimit) -> bool {
        let evicted = self
            .book()
            .evict_largest(0, Limit::NodeConnections, &self.metrics);
        let Some((victim, _handshake)) = evicted else {
            return false;
        };
        self.evicted(&victim, pod, Limit::NodeConnections);
        true
    }

    fn evicted(&self, victim: &str, for_pod: &PodLimit, pressure: Limit) {
        if let Some(suppressed) = self.evict_log.allow() {
            tracing::warn!(
                pod = %victim,
                for_pod = %for_pod.uid,
                limit = pressure.as_str(),
                suppressed,
                "node under pressure: HBONE handshake evicted"
            );
        }
    }

    fn refused(&self, pod: &PodLimit, limit: Limit, max: usize) {
        self.metrics.limit_reached(limit.as_str());
        self.metrics.pod_limit_reached(&pod.uid, limit.as_str());
        let log = &pod.logs[limit as usize];
        if let Some(suppressed) = log.allow() {
            tracing::warn!(
                pod = %pod.uid,
                limit = limit.as_str(),
                max,
                suppressed,
                "limit reached: connection refused"
            );
        }
    }
}

/// One pod's open connections.
#[derive(Debug)]
pub struct PodLimit {
    uid: String,
    /// Open connections by [`Side`] (inbound, outbound).
    open: [AtomicUsize; 2],
    /// Transparent legs to this pod's application connecting now.
    legs: AtomicUsize,
    node: Arc<NodeLimits>,
    /// One throttle per [`Limit`] (indexed by it), so that one limit's
    /// flood does not hide another's first line.
    logs: [LogThrottle; Limit::COUNT],
}

impl PodLimit {
    /// The pod.
    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// Connections of this pod open now on `side`.
    pub fn open(&self, side: Side) -> usize {
        self.open[side as usize].load(Ordering::Acquire)
    }

    /// Admits one more connection of this pod on `side`, or refuses it
    /// (counted and logged) when that side of the pod or the node is at
    /// its limit.
    pub fn admit(self: &Arc<Self>, side: Side) -> Option<ConnectionPermit> {
        let open = &self.open[side as usize];
        let max = self.node.limits.connections_per_pod;
        if open.fetch_add(1, Ordering::AcqRel) >= max {
            open.fetch_sub(1, Ordering::AcqRel);
            self.node.refused(self, Limit::PodConnections, max);
            return None;
        }
        let max = self.node.limits.connections_per_node;
        let node = match Slot::take(&self.node.metrics.accepted, max) {
            Some(node) => node,
            // The evicted connection gives its place back when its task
            // ends, a moment later: until then the node holds one more
            // than its limit (at most as many more as handshakes evicted
            // and not yet closed).
            None if self.node.evict_for_connection(self) => {
                Slot::force(&self.node.metrics.accepted)
            }
            None => {
                open.fetch_sub(1, Ordering::AcqRel);
                self.node.refused(self, Limit::NodeConnections, max);
                return None;
            }
        };
        Some(ConnectionPermit {
            pod: Arc::clone(self),
            side,
            _node: node,
        })
    }

    /// A place among this pod's transparent legs connecting at once, or
    /// `None` (counted and logged) when its share is taken.
    pub fn leg(self: &Arc<Self>) -> Option<LegPlace> {
        let max = self.node.limits.pending_legs_per_pod;
        if self.legs.fetch_add(1, Ordering::AcqRel) >= max {
            self.legs.fetch_sub(1, Ordering::AcqRel);
            self.node.refused(self, Limit::PodPendingLegs, max);
            return None;
        }
        Some(LegPlace {
            pod: Arc::clone(self),
        })
    }

    /// A place among this pod's and the node's HBONE handshakes for a
    /// connection on the pod's 15008, or `None` (counted and logged, by pod
    /// too) when the pod's share is taken, or the node's places are and
    /// this pod holds as many as any other (`handshakes` module docs).
    pub fn handshake(self: &Arc<Self>) -> Option<HandshakePlace> {
        let node = &self.node;
        let mut book = node.book();
        let held = book.held(&self.uid);
        let max = node.limits.hbone_handshakes_per_pod;
        if held >= max {
            drop(book);
            node.refused(self, Limit::PodHboneHandshakes, max);
            return None;
        }
        let max = node.limits.hbone_handshakes;
        let (slot, victim) = if let Some(slot) = Slot::take(&node.metrics.pending_handshakes, max) {
            (slot, None)
        } else if let Some((victim, slot)) =
            book.evict_largest(held + 1, Limit::HboneHandshakes, &node.metrics)
        {
            (slot, Some(victim))
        } else {
            drop(book);
            node.refused(self, Limit::HboneHandshakes, max);
            return None;
        };
        let (number, evicted) = book.book(&self.uid, slot);
        drop(book);
        if let Some(victim) = victim {
            node.evicted(&victim, self, Limit::HboneHandshakes);
        }
        Some(HandshakePlace {
            pod: Arc::clone(self),
            number,
            evicted,
        })
    }
}

/// One transparent leg connecting: counted against its pod until dropped.
#[derive(Debug)]
pub struct LegPlace {
    pod: Arc<PodLimit>,
}

impl Drop for LegPlace {
    fn drop(&mut self) {
        self.pod.legs.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The open connections of one admin, metrics or readiness server.
#[derive(Debug)]
pub struct ListenerLimit {
    listener: &'static str,
    max: usize,
    open: Gauge<i64, std::sync::atomic::AtomicI64>,
    metrics: Arc<Metrics>,
    log: LogThrottle,
}

impl ListenerLimit {
    /// At most `max` open connections on `listener` (a name for the log).
    pub fn new(listener: &'static str, max: usize, metrics: Arc<Metrics>) -> Self {
        Self {
            listener,
            max,
            open: Gauge::default(),
            metrics,
            log: LogThrottle::default(),
        }
    }

    /// Admits one more connection, or refuses it (counted and logged).
    pub fn admit(&self) -> Option<Slot> {
        let slot = Slot::take(&self.open, self.max);
        if slot.is_none() {
            self.metrics.limit_reached(Limit::AdminConnections.as_str());
            if let Some(suppressed) = self.log.allow() {
                tracing::warn!(
                    listener = self.listener,
                    limit = Limit::AdminConnections.as_str(),
                    max = self.max,
                    suppressed,
                    "limit reached: connection refused"
                );
            }
        }
        slot
    }
}

/// One admitted connection: counted against its pod and the node until
/// dropped.
#[derive(Debug)]
pub struct ConnectionPermit {
    pod: Arc<PodLimit>,
    side: Side,
    _node: Slot,
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        self.pod.open[self.side as usize].fetch_sub(1, Ordering::AcqRel);
    }
}

/// One place in a node-wide count whose gauge is exported; given back on
/// drop.
#[derive(Debug)]
pub struct Slot(Gauge<i64, std::sync::atomic::AtomicI64>);

impl Slot {
    /// Takes a place in `gauge` if it holds fewer than `max`. (Concurrent
    /// takers may see the gauge above `max` for an instant; none of them
    /// keeps a place beyond it.)
    fn take(gauge: &Gauge<i64, std::sync::atomic::AtomicI64>, max: usize) -> Option<Self> {
        let before = gauge.inc();
        if usize::try_from(before).unwrap_or(0) >= max {
            gauge.dec();
            return None;
        }
        Some(Self(gauge.clone()))
    }

    /// Takes a place in `gauge` whatever it holds (a place handed over
    /// from a connection that is closing).
    fn force(gauge: &Gauge<i64, std::sync::atomic::AtomicI64>) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(per_pod: usize, per_node: usize) -> Arc<NodeLimits> {
        NodeLimits::new(
            Limits {
                connections_per_pod: per_pod,
                connections_per_node: per_node,
                hbone_handshakes: 1,
                hbone_handshakes_per_pod: 1,
                pending_legs_per_pod: 2,
                enrol_clients: 1,
            },
            Metrics::new(),
        )
    }

    /// `per_node` HBONE handshake places, `per_pod` of them to one pod.
    fn handshake_places(per_node: usize, per_pod: usize) -> Arc<NodeLimits> {
        NodeLimits::new(
            Limits {
                hbone_handshakes: per_node,
                hbone_handshakes_per_pod: per_pod,
                ..Limits::default()
            },
            Metrics::new(),
        )
    }

    #[test]
    fn a_pods_legs_share_is_its_own_and_comes_back() {
        let node = limits(10, 10);
        let (a, b) = (node.pod("a"), node.pod("b"));
        let held = [a.leg(), a.leg()];
        assert!(held.iter().all(Option::is_some));
        assert!(a.leg().is_none(), "a third leg of a");
        assert!(b.leg().is_some(), "b has its own share");
        drop(held);
        assert!(a.leg().is_some(), "places come back");
    }

    #[test]
    fn a_pod_at_its_limit_is_refused_and_others_are_not() {
        let node = limits(2, 10);
        let a = node.pod("a");
        let held: Vec<_> = (0..2)
            .map(|_| a.admit(Side::Inbound).expect("under the limit"))
            .collect();
        assert!(a.admit(Side::Inbound).is_none(), "a third connection of a");
        assert!(
            node.pod("b").admit(Side::Inbound).is_some(),
            "b has its own count"
        );
        assert_eq!(
            node.pod("a").open(Side::Inbound),
            2,
            "listeners of a share one count"
        );
        // Its outbound side is its own: connections to a pod never block
        // the pod's own.
        let out = a.admit(Side::Outbound).expect("outbound has its places");
        assert_eq!(a.open(Side::Outbound), 1);
        drop(out);
        drop(held);
        assert_eq!(a.open(Side::Inbound), 0);
        assert!(a.admit(Side::Inbound).is_some(), "places come back");
        let text = node.metrics.encode();
        assert!(
            text.contains("ztunnel_limit_reached_total{limit=\"pod_connections\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn the_node_limit_counts_every_pod() {
        let node = limits(10, 3);
        let (a, b) = (node.pod("a"), node.pod("b"));
        let _held = [
            a.admit(Side::Inbound),
            a.admit(Side::Inbound),
            b.admit(Side::Inbound),
        ];
        assert!(b.admit(Side::Inbound).is_none());
        assert_eq!(
            b.open(Side::Inbound),
            1,
            "a refused connection leaves no count behind"
        );
        assert_eq!(node.metrics.accepted.get(), 3);
        let text = node.metrics.encode();
        assert!(
            text.contains("ztunnel_limit_reached_total{limit=\"node_connections\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn handshakes_and_enrolment_clients_have_node_wide_places() {
        let node = limits(10, 10);
        let a = node.pod("a");
        let shake = a.handshake().expect("one place");
        assert!(node.pod("b").handshake().is_none());
        drop(shake);
        assert!(a.handshake().is_some());
        let client = node.enrol_client().expect("one place");
        assert!(node.enrol_client().is_none());
        drop(client);
        assert_eq!(node.metrics.enrol_clients.get(), 0);
    }

    #[test]
    fn a_pod_flooded_with_handshakes_leaves_the_rest_of_the_node_to_others() {
        let node = handshake_places(4, 2);
        let (victim, other) = (node.pod("victim"), node.pod("other"));
        let flood: Vec<_> = (0..2)
            .map(|_| victim.handshake().expect("within the pod's share"))
            .collect();
        assert!(victim.handshake().is_none(), "past the pod's share");
        let others: Vec<_> = (0..2)
            .map(|_| other.handshake().expect("the node has room for other pods"))
            .collect();
        assert!(other.handshake().is_none(), "its own share is 2 as well");
        assert_eq!(node.metrics.pending_handshakes.get(), 4);
        drop((flood, others));
        assert_eq!(node.metrics.pending_handshakes.get(), 0);
        assert!(victim.handshake().is_some(), "places come back");
        let text = node.metrics.encode();
        assert!(
            text.contains(
                "ztunnel_pod_limit_reached_total{pod=\"victim\",limit=\"pod_hbone_handshakes\"} 1"
            ),
            "{text}"
        );
    }

    /// Whether `place` was told to close.
    fn evicted(place: &mut HandshakePlace) -> bool {
        place.evicted.try_recv().is_ok()
    }

    #[test]
    fn when_the_nodes_handshake_places_are_full_the_largest_holder_makes_room() {
        let node = handshake_places(4, 2);
        let (a, b) = (node.pod("a"), node.pod("b"));
        let mut flood: Vec<_> = [&a, &a, &b, &b]
            .iter()
            .map(|pod| pod.handshake().expect("within the shares"))
            .collect();
        // c holds none: the oldest place of a largest holder is its.
        let c = node.pod("c");
        let _c1 = c.handshake().expect("room is made");
        let gone: Vec<usize> = (0..4).filter(|&i| evicted(&mut flood[i])).collect();
        assert!(gone == [0] || gone == [2], "the oldest of a or b: {gone:?}");
        assert_eq!(node.metrics.pending_handshakes.get(), 4);
        // d too: the other flooded pod still holds two.
        let _d1 = node.pod("d").handshake().expect("room is made");
        assert_eq!(
            (0..4).filter(|&i| evicted(&mut flood[i])).count(),
            1,
            "one more"
        );
        // Now every pod holds one: nobody is larger, so no more churn.
        assert!(c.handshake().is_none(), "c would take an equal's place");
        assert!(node.pod("e").handshake().is_none());
        assert_eq!(node.metrics.pending_handshakes.get(), 4);
        // The evicted places hand nothing back twice.
        drop(flood);
        assert_eq!(node.metrics.pending_handshakes.get(), 2);
        let text = node.metrics.encode();
        for pod in ["a", "b"] {
            assert!(
                text.contains(&format!(
                    "ztunnel_pod_handshakes_evicted_total{{pod=\"{pod}\",limit=\"hbone_handshakes\"}} 1"
                )),
                "{text}"
            );
        }
        assert!(
            text.contains("ztunnel_limit_reached_total{limit=\"hbone_handshakes\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn when_the_nodes_connections_are_full_a_handshake_goes_first() {
        let node = limits(10, 2);
        let a = node.pod("a");
        let mut shake = a.handshake().expect("a place");
        let _held = [a.admit(Side::Inbound), a.admit(Side::Inbound)];
        let b = node.pod("b");
        let permit = b.admit(Side::Outbound).expect("the handshake makes room");
        assert!(evicted(&mut shake));
        // Until the evicted connection closes, the node holds one more.
        assert_eq!(node.metrics.accepted.get(), 3);
        assert_eq!(node.metrics.pending_handshakes.get(), 0);
        assert!(b.admit(Side::Outbound).is_none(), "no handshake left");
        drop((shake, permit));
        let text = node.metrics.encode();
        assert!(
            text.contains(
                "ztunnel_pod_handshakes_evicted_total{pod=\"a\",limit=\"node_connections\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("ztunnel_limit_reached_total{limit=\"node_connections\"} 1"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn an_evicted_handshake_stops_at_once() {
        let node = limits(10, 1);
        let a = node.pod("a");
        let place = a.handshake().expect("a place");
        let _conn = a.admit(Side::Inbound).expect("a connection");
        let run = tokio::spawn(place.run(std::future::pending::<()>()));
        let _room = node.pod("b").admit(Side::Inbound).expect("room is made");
        let out = tokio::time::timeout(std::time::Duration::from_secs(5), run)
            .await
            .expect("stops at once")
            .expect("no panic");
        assert_eq!(out, Err(Evicted));
        assert_eq!(node.metrics.pending_handshakes.get(), 0);
    }

    #[test]
    fn an_admin_listener_has_its_own_places() {
        let metrics = Metrics::new();
        let admin = ListenerLimit::new("metrics", 1, Arc::clone(&metrics));
        let held = admin.admit().expect("one place");
        assert!(admin.admit().is_none());
        drop(held);
        assert!(admin.admit().is_some());
        assert!(
            metrics
                .encode()
                .contains("ztunnel_limit_reached_total{limit=\"admin_connections\"} 1")
        );
    }

    #[test]
    fn pods_that_left_are_forgotten() {
        let node = limits(10, 10);
        drop(node.pod("gone"));
        let _kept = node.pod("kept");
        let pods = node.pods.lock().expect("lock");
        assert_eq!(pods.keys().collect::<Vec<_>>(), vec!["kept"]);
    }
}
