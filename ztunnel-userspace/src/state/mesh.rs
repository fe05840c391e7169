//! The mesh as the proxy sees it: indexes over the config and the routing
//! decision for an outbound connection.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, RwLock,
        atomic::{AtomicUsize, Ordering},
    },
};

use super::{
    Waypoint, Workload, WorkloadProtocol, local::LocalConfig, service::Service,
    waypoint::DEFAULT_HBONE_PORT,
};
use crate::identity::Identity;

/// Where an outbound connection goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// HBONE to `hbone` (a pod's port 15008, or a waypoint's HBONE port),
    /// `:authority` = `target`.
    Hbone {
        /// The `:authority`: the endpoint (pod IP and target port), or
        /// through a waypoint the address the application dialled.
        target: SocketAddr,
        /// Where the HBONE connection goes.
        hbone: SocketAddr,
        /// The identity the peer at `hbone` must present.
        identity: Identity,
        /// The uid of the workload at `hbone`.
        workload: String,
        /// `hbone` is the destination's waypoint.
        waypoint: bool,
    },
    /// Plain TCP to `target`.
    Passthrough {
        /// Where.
        target: SocketAddr,
    },
    /// Refused by the outbound traffic policy.
    Deny {
        /// Why.
        reason: &'static str,
    },
}

/// What to do with destinations the mesh does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum OutboundTrafficPolicy {
    /// Plain passthrough (Istio's default).
    #[default]
    AllowAny,
    /// Only known workloads and services; anything else is closed.
    RegistryOnly,
}

/// What an enroller said about a pod: how an enrolled pod is matched to
/// its workload when the control plane names workloads by another id than
/// the enrolment's uid (istiod's `Kubernetes//Pod/ns/name` against the pod
/// uid istio-cni sends): by node, namespace, service account and name, as
/// Istio's ztunnel does.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PodName {
    /// Kubernetes namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Service account.
    pub service_account: String,
}

/// Enrolled pods' names by enrolment uid, shared by every state published
/// through one [`StateHandle`] (pods come and go between pushes).
pub type PodDirectory = Arc<RwLock<HashMap<String, PodName>>>;

/// Indexed mesh state.
#[derive(Debug, Default)]
pub struct MeshState {
    config: LocalConfig,
    by_ip: HashMap<IpAddr, usize>,
    by_uid: HashMap<String, usize>,
    by_vip: HashMap<IpAddr, usize>,
    /// Services by hostname (waypoints are named by it).
    by_hostname: HashMap<String, usize>,
    round_robin: Vec<AtomicUsize>,
    /// This node's workloads by name (see [`PodName`]).
    by_pod_name: HashMap<PodName, usize>,
    pods: PodDirectory,
    /// The state of a ztunnel run from istiod before istiod's first push:
    /// it knows no workload and no policy, so it refuses every connection
    /// rather than guess (an empty state would send meshed traffic in
    /// clear as passthrough and admit any inbound).
    awaiting_control_plane: bool,
}

/// Why a connection is refused before istiod's first push.
pub const AWAITING_CONTROL_PLANE: &str =
    "no mesh state from istiod yet: refused until its first push (fail closed)";

impl MeshState {
    /// Builds the indexes.
    pub fn new(config: LocalConfig) -> Self {
        let mut by_ip = HashMap::new();
        let mut by_uid = HashMap::new();
        for (i, w) in config.workloads.iter().enumerate() {
            by_uid.insert(w.uid.clone(), i);
            for ip in &w.ips {
                by_ip.insert(*ip, i);
            }
        }
        let mut vip_index = HashMap::new();
        let mut by_hostname = HashMap::new();
        for (i, s) in config.services.iter().enumerate() {
            for vip in &s.vips {
                vip_index.insert(*vip, i);
            }
            by_hostname.insert(s.hostname(), i);
        }
        let round_robin = config
            .services
            .iter()
            .map(|_| AtomicUsize::new(0))
            .collect();
        Self {
            config,
            by_ip,
            by_uid,
            by_vip: vip_index,
            by_hostname,
            round_robin,
            by_pod_name: HashMap::new(),
            pods: PodDirectory::default(),
            awaiting_control_plane: false,
        }
    }

    /// The state before istiod's first push: every connection refused
    /// ([`AWAITING_CONTROL_PLANE`]).
    pub fn awaiting_control_plane(config: LocalConfig) -> Self {
        Self {
            awaiting_control_plane: true,
            ..Self::new(config)
        }
    }

    /// Lets [`Self::workload`] find this node's workloads by the names
    /// enrollers gave (`pods`) when their uid is not the workload's.
    fn attach_pods(&mut self, pods: PodDirectory, node: &str) {
        self.by_pod_name = self
            .config
            .workloads
            .iter()
            .enumerate()
            .filter(|(_, w)| !node.is_empty() && w.node == node)
            .map(|(i, w)| {
                let name = PodName {
                    namespace: w.namespace.clone(),
                    name: w.name.clone(),
                    service_account: w.service_account.clone(),
                };
                (name, i)
            })
            .collect();
        self.pods = pods;
    }

    /// The config it was built from.
    pub fn config(&self) -> &LocalConfig {
        &self.config
    }

    /// The trust domain.
    pub fn trust_domain(&self) -> &str {
        &self.config.trust_domain
    }

    /// The workload owning `ip`.
    pub fn workload_by_ip(&self, ip: IpAddr) -> Option<&Workload> {
        self.by_ip.get(&ip).map(|i| &self.config.workloads[*i])
    }

    /// The workload with `uid`, or the one of this node an enrolled pod
    /// with that uid is matched to by name ([`PodName`]).
    pub fn workload(&self, uid: &str) -> Option<&Workload> {
        let index = self.by_uid.get(uid).copied().or_else(|| {
            let pods = self
                .pods
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            pods.get(uid)
                .and_then(|name| self.by_pod_name.get(name))
                .copied()
        })?;
        self.config.workloads.get(index)
    }

    /// The identity of a workload (in its own trust domain, if it has one).
    pub fn identity(&self, w: &Workload) -> Identity {
        Identity::new(
            w.trust_domain
                .as_deref()
                .unwrap_or(&self.config.trust_domain),
            &w.namespace,
            &w.service_account,
        )
    }

    /// Resolves a name (a workload name, `name.namespace`, or a service
    /// `name.namespace.svc...`) to an address, for SOCKS5 clients.
    pub fn resolve_name(&self, name: &str, port: u16, v6: bool) -> Option<SocketAddr> {
        let mut parts = name.split('.');
        let (first, ns) = (parts.next()?, parts.next());
        let matches_ns = |n: &str| ns.is_none_or(|ns| ns == n);
        let pick = |ips: &[IpAddr]| {
            ips.iter()
                .find(|ip| ip.is_ipv6() == v6)
                .or(ips.first())
                .copied()
        };
        if let Some(s) = self
            .config
            .services
            .iter()
            .find(|s| s.name == first && matches_ns(&s.namespace))
        {
            return pick(&s.vips).map(|ip| SocketAddr::new(ip, port));
        }
        self.config
            .workloads
            .iter()
            .find(|w| w.name == first && matches_ns(&w.namespace))
            .and_then(|w| pick(&w.ips))
            .map(|ip| SocketAddr::new(ip, port))
    }

    /// Decides where a captured connection to `dst` goes, for a client
    /// that is none of the mesh's waypoints ([`Self::route_from`]).
    pub fn route(&self, dst: SocketAddr) -> Route {
        self.route_from(&[], dst)
    }

    /// Decides where a captured connection from a pod with the addresses
    /// `source` to `dst` goes.
    ///
    /// A service VIP with a waypoint goes to the waypoint; otherwise to one
    /// of its endpoints, picked round-robin among the listed workloads that
    /// have an address of the destination's family (every listed endpoint
    /// is considered healthy: there are no health checks). A workload's IP
    /// with a waypoint goes to that waypoint, unless the client is the
    /// waypoint itself (which would loop). As in Istio, a workload reached
    /// through its service does not go through the workload's waypoint.
    pub fn route_from(&self, source: &[IpAddr], dst: SocketAddr) -> Route {
        if self.awaiting_control_plane {
            return Route::Deny {
                reason: AWAITING_CONTROL_PLANE,
            };
        }
        if let Some(&si) = self.by_vip.get(&dst.ip()) {
            let service = &self.config.services[si];
            if let Some(waypoint) = &service.waypoint
                && let Some(route) = self.through_waypoint(waypoint, dst, source)
            {
                return route;
            }
            let Some(target_port) = service.target_port(dst.port()) else {
                return Route::Deny {
                    reason: "service has no such port",
                };
            };
            let Some((w, ip)) = self.pick_endpoint(si, dst.is_ipv6()) else {
                return Route::Deny {
                    reason: "service has no endpoints",
                };
            };
            return self.to_workload(w, SocketAddr::new(ip, target_port));
        }
        if let Some(w) = self.workload_by_ip(dst.ip()) {
            if let Some(waypoint) = &w.waypoint
                && let Some(route) = self.through_waypoint(waypoint, dst, source)
            {
                return route;
            }
            return self.to_workload(w, dst);
        }
        match self.config.outbound_traffic_policy {
            OutboundTrafficPolicy::AllowAny => Route::Passthrough { target: dst },
            OutboundTrafficPolicy::RegistryOnly => Route::Deny {
                reason: "destination not in the mesh registry (REGISTRY_ONLY)",
            },
        }
    }

    /// The next endpoint of service `si` with an address of the family.
    fn pick_endpoint(&self, si: usize, v6: bool) -> Option<(&Workload, IpAddr)> {
        let candidates: Vec<(&Workload, IpAddr)> = self.config.services[si]
            .endpoints
            .iter()
            .filter_map(|uid| self.workload(uid))
            .filter_map(|w| {
                w.ips
                    .iter()
                    .find(|ip| ip.is_ipv6() == v6)
                    .map(|ip| (w, *ip))
            })
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let n = self.round_robin[si].fetch_add(1, Ordering::Relaxed) % candidates.len();
        Some(candidates[n])
    }

    /// The route to `dst` through `waypoint`; `None` when the client is
    /// the waypoint (it goes on directly). A waypoint that cannot be found
    /// or reached refuses the connection: going around it would skip the
    /// policies it is there to apply.
    fn through_waypoint(
        &self,
        waypoint: &Waypoint,
        dst: SocketAddr,
        source: &[IpAddr],
    ) -> Option<Route> {
        const NOT_FOUND: Route = Route::Deny {
            reason: "the destination's waypoint is not in the mesh state (fail closed)",
        };
        let v6 = dst.is_ipv6();
        let service = match (&waypoint.hostname, waypoint.address) {
            (Some(host), _) => match self.by_hostname.get(host) {
                Some(&si)
                    if waypoint
                        .namespace
                        .as_ref()
                        .is_none_or(|ns| *ns == self.config.services[si].namespace) =>
                {
                    Some(si)
                }
                _ => return Some(NOT_FOUND),
            },
            (None, Some(ip)) => self.by_vip.get(&ip).copied(),
            (None, None) => return Some(NOT_FOUND),
        };
        // The client is one of the waypoint's pods: it is carrying the
        // connection on after applying its policies.
        let is_waypoint = |w: &Workload| w.ips.iter().any(|ip| source.contains(ip));
        let (w, ip) = match (service, waypoint.address) {
            (Some(si), _) => {
                let service = &self.config.services[si];
                if service
                    .endpoints
                    .iter()
                    .filter_map(|uid| self.workload(uid))
                    .any(is_waypoint)
                {
                    return None;
                }
                match self.pick_endpoint(si, v6) {
                    Some(found) => found,
                    None => {
                        return Some(Route::Deny {
                            reason: "the destination's waypoint has no endpoint of its address family",
                        });
                    }
                }
            }
            (None, Some(ip)) => match self.workload_by_ip(ip) {
                Some(w) if is_waypoint(w) => return None,
                Some(w) => (w, ip),
                None => return Some(NOT_FOUND),
            },
            (None, None) => return Some(NOT_FOUND),
        };
        // hbone_port is never 0: the YAML's validation refuses it and the
        // xDS conversion maps istiod's 0 to the default.
        Some(Route::Hbone {
            target: dst,
            hbone: SocketAddr::new(ip, waypoint.hbone_port),
            identity: self.identity(w),
            workload: w.uid.clone(),
            waypoint: true,
        })
    }

    fn to_workload(&self, w: &Workload, target: SocketAddr) -> Route {
        match w.protocol {
            WorkloadProtocol::Hbone => Route::Hbone {
                target,
                hbone: SocketAddr::new(target.ip(), DEFAULT_HBONE_PORT),
                identity: self.identity(w),
                workload: w.uid.clone(),
                waypoint: false,
            },
            WorkloadProtocol::Tcp => Route::Passthrough { target },
        }
    }

    /// How logs and metrics show the owner of `addr`.
    pub fn endpoint(&self, addr: SocketAddr) -> crate::telemetry::Endpoint {
        self.workload_by_ip(addr.ip()).map_or_else(
            || crate::telemetry::Endpoint {
                addr: Some(addr),
                ..Default::default()
            },
            |w| crate::telemetry::Endpoint {
                workload: w.name.clone(),
                namespace: w.namespace.clone(),
                addr: Some(addr),
                identity: (w.protocol == WorkloadProtocol::Hbone)
                    .then(|| self.identity(w).to_string()),
                meta: w.meta(),
            },
        )
    }

    /// Authorizes a connection to the local pod `uid` from `peer` on
    /// `port`: the pod's workload must be known, then the mTLS mode
    /// (plaintext under STRICT is refused), then the authorization
    /// policies. The error names what refused it: (policy label for
    /// metrics, reason).
    pub fn authorize_inbound(
        &self,
        uid: &str,
        peer: &super::policy::Peer<'_>,
        port: u16,
    ) -> Result<(), (String, String)> {
        if self.awaiting_control_plane {
            return Err((
                "awaiting_control_plane".into(),
                AWAITING_CONTROL_PLANE.into(),
            ));
        }
        // Without its workload the pod's labels are unknown, and every
        // policy that selects it by label (STRICT, DENY, ALLOW) would
        // silently stop applying: refuse instead.
        let Some(workload) = self.workload(uid) else {
            return Err(("workload_unknown".into(), WORKLOAD_UNKNOWN.into()));
        };
        let target = super::policy::Target {
            namespace: workload.namespace.as_str(),
            labels: &workload.labels,
            port,
        };
        if peer.identity.is_none()
            && super::policy::mtls_mode(&self.config.peer_authentications, &target)
                == super::policy::MtlsMode::Strict
        {
            return Err((
                "mtls_strict".into(),
                "STRICT mTLS: plaintext connections are refused".into(),
            ));
        }
        match super::policy::authorize(&self.config.policies, peer, &target) {
            super::policy::Decision::Allow => Ok(()),
            super::policy::Decision::Deny(reason) => {
                let label = reason
                    .strip_prefix("denied by DENY policy ")
                    .map_or_else(|| "no_allow_match".to_owned(), ToOwned::to_owned);
                Err((label, reason))
            }
        }
    }

    /// The service a connection to the local pod `uid` on `port` was
    /// addressed to, for the destination's metrics (the VIP itself never
    /// reaches this node: the client's ztunnel picked the endpoint). Like
    /// Istio's ztunnel: the service the client named (`named`, its
    /// hostname) if the pod is behind it, so a client cannot make us report
    /// any other; else the first service of the pod with `port` as a
    /// target port; else none.
    pub fn inbound_service(&self, uid: &str, port: u16, named: Option<&str>) -> Option<&Service> {
        let mut of_pod = self
            .config
            .services
            .iter()
            .filter(|s| s.endpoints.iter().any(|e| e == uid));
        if let Some(named) = named
            && let Some(found) = of_pod.clone().find(|s| s.hostname() == named)
        {
            return Some(found);
        }
        of_pod.find(|s| {
            s.ports
                .iter()
                .any(|p| p.target_port.unwrap_or(p.port) == port)
        })
    }

    /// The service named by a VIP, for logs and metrics.
    pub fn service_by_vip(&self, ip: IpAddr) -> Option<&Service> {
        self.by_vip.get(&ip).map(|i| &self.config.services[*i])
    }
}

/// Why a connection of an enrolled pod whose workload is not in the mesh
/// state is refused (see [`StateHandle::current_for`]).
pub const WORKLOAD_UNKNOWN: &str =
    "the pod is enrolled but its workload is not in the mesh state: no traffic until it is";

/// How long a connection of an enrolled pod whose workload the mesh state
/// does not list yet waits for it before it is refused. A pod is enrolled
/// when its sandbox is made, and istiod may list it a moment later; its
/// first connections should not fail for that. Istio's ztunnel waits the
/// same 5 s (hard-coded in its `wait_for_workload`).
pub const WORKLOAD_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Shared, swappable mesh state (replaced whole on config reload or xDS
/// push), with the directory of enrolled pods every state is given.
#[derive(Debug, Clone, Default)]
pub struct StateHandle {
    current: Arc<RwLock<Arc<MeshState>>>,
    pods: PodDirectory,
    node: Arc<str>,
    /// Bumped by every [`Self::replace`], for those waiting for a change.
    generation: Arc<tokio::sync::watch::Sender<u64>>,
}

impl StateHandle {
    /// A handle holding `state`, matching pods by name on no node.
    pub fn new(state: MeshState) -> Self {
        Self::for_node(state, "")
    }

    /// A handle holding `state` for node `node`: its pods are matched to
    /// workloads by the names in [`Self::pods`] too.
    pub fn for_node(mut state: MeshState, node: &str) -> Self {
        let pods = PodDirectory::default();
        state.attach_pods(Arc::clone(&pods), node);
        Self {
            current: Arc::new(RwLock::new(Arc::new(state))),
            pods,
            node: node.into(),
            generation: Arc::default(),
        }
    }

    /// The enrolled pods' names, filled by the enrollers.
    pub fn pods(&self) -> &PodDirectory {
        &self.pods
    }

    /// The current state.
    pub fn current(&self) -> Arc<MeshState> {
        Arc::clone(
            &self
                .current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Replaces the state.
    pub fn replace(&self, mut state: MeshState) {
        state.attach_pods(Arc::clone(&self.pods), &self.node);
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(state);
        self.generation.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// The current state for a connection of the enrolled pod `uid`: when
    /// it does not list the pod's workload yet, the newest state within
    /// `limit` that does, or the newest one after `limit` (whose policy
    /// checks then refuse the connection: [`WORKLOAD_UNKNOWN`]).
    pub async fn current_for(&self, uid: &str, limit: std::time::Duration) -> Arc<MeshState> {
        // The common case costs one read; only an unknown pod subscribes
        // (and reads again after subscribing, so no change is missed).
        let state = self.current();
        if state.workload(uid).is_some() {
            return state;
        }
        let mut changes = self.generation.subscribe();
        let state = self.current();
        if state.workload(uid).is_some() {
            return state;
        }
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {
                    let state = self.current();
                    if state.workload(uid).is_some() {
                        return state;
                    }
                }
                // Timed out, or the sender is gone (never while a handle
                // exists): what there is now decides.
                _ => return self.current(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::local::parse;

    const MESH: &str = "
workloads:
  - {uid: a, name: a, namespace: demo, serviceAccount: sa-a, node: n1, ips: [10.0.0.1]}
  - {uid: b, name: b, namespace: demo, serviceAccount: sa-b, node: n2, ips: [10.0.0.2]}
  - {uid: c, name: c, namespace: demo, node: n2, ips: [10.0.0.3], protocol: TCP}
services:
  - {name: web, namespace: demo, vips: [10.96.0.1], ports: [{port: 80, targetPort: 8080}], endpoints: [a, b]}
";

    fn state(extra: &str) -> MeshState {
        MeshState::new(parse(&format!("{MESH}{extra}"), std::path::Path::new("t")).expect("valid"))
    }

    #[test]
    fn meshed_workloads_get_hbone_with_their_identity() {
        let s = state("");
        let dst: SocketAddr = "10.0.0.2:9000".parse().expect("addr");
        assert_eq!(
            s.route(dst),
            Route::Hbone {
                target: dst,
                hbone: "10.0.0.2:15008".parse().expect("addr"),
                identity: Identity::new("cluster.local", "demo", "sa-b"),
                workload: "b".into(),
                waypoint: false,
            }
        );
    }

    /// A mesh where `b` and the service `web` have waypoints; `wp` is the
    /// waypoint's pod behind its service `waypoint`.
    fn waypointed(workload_wp: &str, service_wp: &str) -> MeshState {
        let yaml = format!(
            "
workloads:
  - {{uid: a, name: a, namespace: demo, serviceAccount: sa-a, node: n1, ips: [10.0.0.1]}}
  - {{uid: b, name: b, namespace: demo, serviceAccount: sa-b, node: n2, ips: [10.0.0.2, 'fd00::2'], waypoint: {workload_wp}}}
  - {{uid: wp, name: wp, namespace: demo, serviceAccount: waypoint, node: n2, ips: [10.0.0.9]}}
services:
  - {{name: web, namespace: demo, vips: [10.96.0.1], ports: [{{port: 80, targetPort: 8080}}], endpoints: [b], waypoint: {service_wp}}}
  - {{name: waypoint, namespace: demo, vips: [10.96.0.9], ports: [{{port: 15008}}], endpoints: [wp]}}
"
        );
        MeshState::new(parse(&yaml, std::path::Path::new("t")).expect("valid"))
    }

    fn through(s: &MeshState, source: &[IpAddr], dst: &str) -> Route {
        s.route_from(source, dst.parse().expect("addr"))
    }

    #[test]
    fn a_destination_with_a_waypoint_is_reached_through_it_with_the_dialled_authority() {
        let waypoint = Identity::new("cluster.local", "demo", "waypoint");
        for (workload_wp, service_wp) in [
            ("{address: 10.0.0.9}", "{address: 10.96.0.9}"),
            (
                "{hostname: waypoint.demo.svc.cluster.local}",
                "{hostname: waypoint.demo.svc.cluster.local, namespace: demo}",
            ),
        ] {
            let s = waypointed(workload_wp, service_wp);
            let a = ["10.0.0.1".parse().expect("ip")];
            for dst in ["10.96.0.1:80", "10.0.0.2:8080"] {
                assert_eq!(
                    through(&s, &a, dst),
                    Route::Hbone {
                        target: dst.parse().expect("addr"),
                        hbone: "10.0.0.9:15008".parse().expect("addr"),
                        identity: waypoint.clone(),
                        workload: "wp".into(),
                        waypoint: true,
                    },
                    "{dst} with waypoints {workload_wp} {service_wp}"
                );
            }
            // The waypoint itself goes on to the destination, not to itself.
            let wp = ["10.0.0.9".parse().expect("ip")];
            assert!(matches!(
                through(&s, &wp, "10.0.0.2:8080"),
                Route::Hbone { waypoint: false, ref workload, .. } if workload == "b"
            ));
            assert!(matches!(
                through(&s, &wp, "10.96.0.1:80"),
                Route::Hbone { waypoint: false, ref workload, .. } if workload == "b"
            ));
            // An IPv6 destination: a waypoint named by its (IPv4) address
            // is used as named (as Istio does); one named by hostname has
            // no IPv6 endpoint, and the connection is refused, never sent
            // around it.
            let v6 = through(&s, &a, "[fd00::2]:8080");
            if workload_wp.contains("address") {
                assert!(
                    matches!(v6, Route::Hbone { waypoint: true, hbone, .. } if hbone.ip().is_ipv4()),
                    "{v6:?}"
                );
            } else {
                assert!(matches!(v6, Route::Deny { .. }), "{v6:?}");
            }
        }
    }

    #[test]
    fn a_waypoint_that_cannot_be_found_refuses_the_connection() {
        let a = ["10.0.0.1".parse().expect("ip")];
        for (workload_wp, service_wp) in [
            ("{address: 10.0.0.77}", "{address: 10.96.0.77}"),
            (
                "{hostname: nowhere.demo.svc.cluster.local}",
                "{hostname: waypoint.demo.svc.cluster.local, namespace: elsewhere}",
            ),
        ] {
            let s = waypointed(workload_wp, service_wp);
            for dst in ["10.96.0.1:80", "10.0.0.2:8080"] {
                assert!(
                    matches!(through(&s, &a, dst), Route::Deny { reason } if reason.contains("waypoint")),
                    "{dst} with waypoints {workload_wp} {service_wp}"
                );
            }
        }
    }

    #[test]
    fn a_workload_reached_through_its_service_skips_its_own_waypoint() {
        // Istio's rule: the service's waypoint (none here) decides.
        let s = waypointed("{address: 10.0.0.9}", "null");
        assert!(matches!(
            through(&s, &["10.0.0.1".parse().expect("ip")], "10.96.0.1:80"),
            Route::Hbone { waypoint: false, ref workload, .. } if workload == "b"
        ));
    }

    #[test]
    fn unmeshed_and_unknown_destinations_pass_through_unless_registry_only() {
        let s = state("");
        let c: SocketAddr = "10.0.0.3:80".parse().expect("addr");
        let x: SocketAddr = "192.0.2.1:80".parse().expect("addr");
        assert_eq!(s.route(c), Route::Passthrough { target: c });
        assert_eq!(s.route(x), Route::Passthrough { target: x });
        let strict = state("outboundTrafficPolicy: REGISTRY_ONLY\n");
        assert!(matches!(strict.route(x), Route::Deny { .. }));
    }

    fn name(svc: Option<&Service>) -> Option<&str> {
        svc.map(|s| s.name.as_str())
    }

    #[test]
    fn the_destination_reports_the_named_service_only_if_its_pod_is_behind_it() {
        let s = state(
            "  - {name: api, namespace: demo, vips: [10.96.0.2], ports: [{port: 80, targetPort: 8080}], endpoints: [b]}\n  - {name: other, namespace: demo, vips: [10.96.0.3], ports: [{port: 80}], endpoints: [c]}\n",
        );

        assert_eq!(
            name(s.inbound_service("b", 8080, Some("api.demo.svc.cluster.local"))),
            Some("api")
        );
        // Without a name (or with one the pod is not behind): the first
        // service of the pod with that target port.
        assert_eq!(name(s.inbound_service("b", 8080, None)), Some("web"));
        assert_eq!(
            name(s.inbound_service("b", 8080, Some("other.demo.svc.cluster.local"))),
            Some("web")
        );
        assert_eq!(name(s.inbound_service("b", 9000, None)), None);
        assert_eq!(name(s.inbound_service("c", 80, None)), Some("other"));
    }

    #[test]
    fn before_istiods_first_push_every_connection_is_refused() {
        let s = MeshState::awaiting_control_plane(
            parse(MESH, std::path::Path::new("t")).expect("valid"),
        );
        // Even a destination the config would route (a meshed workload) and
        // one it would pass through.
        for dst in ["10.0.0.2:9000", "192.0.2.1:80"] {
            assert_eq!(
                s.route(dst.parse().expect("addr")),
                Route::Deny {
                    reason: AWAITING_CONTROL_PLANE
                }
            );
        }
        let peer = super::super::policy::Peer {
            identity: None,
            ip: "10.0.0.1".parse().expect("ip"),
        };
        let refused = s.authorize_inbound("b", &peer, 80).expect_err("refused");
        assert_eq!(refused.0, "awaiting_control_plane");
        // The first push replaces it with a state that routes.
        let handle = StateHandle::new(s);
        handle.replace(state(""));
        assert!(matches!(
            handle
                .current()
                .route("10.0.0.2:9000".parse().expect("addr")),
            Route::Hbone { .. }
        ));
    }

    #[test]
    fn enrolled_pods_are_matched_by_name_on_this_node_only() {
        let name = |n: &str, sa: &str| PodName {
            namespace: "demo".into(),
            name: n.into(),
            service_account: sa.into(),
        };
        let handle = StateHandle::for_node(state(""), "n2");
        handle
            .pods()
            .write()
            .expect("pods")
            .insert("uid-of-b".into(), name("b", "sa-b"));
        // a runs on n1: this node (n2) must not take it for one of its pods.
        handle
            .pods()
            .write()
            .expect("pods")
            .insert("uid-of-a".into(), name("a", "sa-a"));
        // Same name, another service account: not the same workload.
        handle
            .pods()
            .write()
            .expect("pods")
            .insert("uid-of-c".into(), name("c", "sa-x"));
        let s = handle.current();
        assert_eq!(s.workload("uid-of-b").map(|w| w.uid.as_str()), Some("b"));
        assert!(s.workload("uid-of-a").is_none());
        assert!(s.workload("uid-of-c").is_none());
        // A new state keeps matching (the directory is the handle's).
        handle.replace(state(""));
        assert!(handle.current().workload("uid-of-b").is_some());
    }

    #[test]
    fn service_vips_round_robin_over_endpoints_with_the_target_port() {
        let s = state("");
        let vip: SocketAddr = "10.96.0.1:80".parse().expect("addr");
        let mut targets: Vec<SocketAddr> = (0..4)
            .map(|_| match s.route(vip) {
                Route::Hbone { target, .. } => target,
                other => panic!("{other:?}"),
            })
            .collect();
        targets.sort();
        targets.dedup();
        assert_eq!(
            targets,
            vec![
                "10.0.0.1:8080".parse().expect("a"),
                "10.0.0.2:8080".parse().expect("b")
            ]
        );
        assert!(matches!(
            s.route("10.96.0.1:81".parse().expect("addr")),
            Route::Deny { .. }
        ));
    }
}
