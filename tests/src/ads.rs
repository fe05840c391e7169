//! The fake istiod's xDS side: delta ADS as istiod serves it to ztunnel.
//! Each stream gets, per subscribed type, every resource whose version
//! differs from what the client said it has (`initial_resource_versions`)
//! and removals for what it has that is gone; later changes are pushed as
//! deltas. Every request is recorded (node, metadata, nonce, NACK detail,
//! credentials), and streams can be cut (`kick`) to test reconnects.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
};

use prost::Message as _;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use ztunnel::{
    proto::{
        envoy::service::discovery::v3::{
            DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
            aggregated_discovery_service_server::AggregatedDiscoveryService,
        },
        istio::{security::Authorization, workload::Address},
    },
    xds::{ADDRESS_TYPE, AUTHORIZATION_TYPE},
};

/// One request as the fake saw it.
#[derive(Debug, Clone)]
pub struct XdsRequestSeen {
    /// `type_url`.
    pub type_url: String,
    /// The stream it came on (numbered from 1).
    pub stream: u64,
    /// `node.id` of the stream (from its first request).
    pub node_id: Option<String>,
    /// `node.metadata`, string values.
    pub metadata: BTreeMap<String, String>,
    /// `response_nonce` (empty on a first request).
    pub nonce: String,
    /// `error_detail.message` of a NACK.
    pub error: Option<String>,
    /// `initial_resource_versions`.
    pub initial_versions: BTreeMap<String, String>,
    /// `authorization` header of the stream.
    pub authorization: Option<String>,
    /// `clusterid` header of the stream.
    pub cluster_id: Option<String>,
}

/// type -> name -> (version, body).
type Catalogue = BTreeMap<String, BTreeMap<String, (String, prost_types::Any)>>;

/// What the fake serves, shared with the test.
pub struct XdsState {
    resources: Mutex<Catalogue>,
    seen: Mutex<Vec<XdsRequestSeen>>,
    next_version: Mutex<u64>,
    streams: std::sync::atomic::AtomicU64,
    changed: watch::Sender<u64>,
    kicks: watch::Sender<u64>,
    /// While true, streams are answered nothing (an istiod that accepted
    /// the stream but has not pushed yet).
    silent: watch::Sender<bool>,
}

impl Default for XdsState {
    fn default() -> Self {
        Self {
            resources: Mutex::default(),
            seen: Mutex::default(),
            next_version: Mutex::default(),
            streams: std::sync::atomic::AtomicU64::new(0),
            changed: watch::Sender::new(0),
            kicks: watch::Sender::new(0),
            silent: watch::Sender::new(false),
        }
    }
}

impl XdsState {
    fn put(&self, type_url: &str, name: &str, value: Vec<u8>) {
        self.put_all(type_url, vec![(name.to_owned(), value)]);
    }

    /// Serves every `(name, body)` of `type_url` in one change, so that one
    /// push carries them all.
    fn put_all(&self, type_url: &str, items: Vec<(String, Vec<u8>)>) {
        {
            let mut resources = self.resources.lock().expect("resources");
            let of_type = resources.entry(type_url.to_owned()).or_default();
            let mut n = self.next_version.lock().expect("version");
            for (name, value) in items {
                *n += 1;
                let body = prost_types::Any {
                    type_url: type_url.to_owned(),
                    value,
                };
                of_type.insert(name, (format!("v{n}"), body));
            }
        }
        self.changed.send_modify(|g| *g += 1);
    }

    /// Serves `address` as `name` (a new version each time).
    pub fn set_address(&self, name: &str, address: &Address) {
        self.put(ADDRESS_TYPE, name, address.encode_to_vec());
    }

    /// Serves raw `Address` bodies (to send garbage), all in one push.
    pub fn set_address_bodies(&self, items: Vec<(String, Vec<u8>)>) {
        self.put_all(ADDRESS_TYPE, items);
    }

    /// Serves `policy` as `namespace/name`.
    pub fn set_policy(&self, policy: &Authorization) {
        let name = format!("{}/{}", policy.namespace, policy.name);
        self.put(AUTHORIZATION_TYPE, &name, policy.encode_to_vec());
    }

    /// Stops serving `name` of `type_url`.
    pub fn remove(&self, type_url: &str, name: &str) {
        if let Some(of_type) = self.resources.lock().expect("resources").get_mut(type_url) {
            of_type.remove(name);
        }
        self.changed.send_modify(|g| *g += 1);
    }

    /// Holds every push (first ones included) while `silent`; when it
    /// ends, each stream gets what it subscribed to at once.
    pub fn set_silent(&self, silent: bool) {
        self.silent.send_replace(silent);
    }

    /// Cuts every open stream (the client sees istiod close it).
    pub fn kick(&self) {
        self.kicks.send_modify(|g| *g += 1);
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<XdsRequestSeen> {
        self.seen.lock().expect("seen").clone()
    }

    fn record(&self, req: &DeltaDiscoveryRequest, stream: &mut Stream) {
        if let Some(node) = &req.node {
            stream.node_id = Some(node.id.clone());
        }
        let metadata = req
            .node
            .as_ref()
            .and_then(|n| n.metadata.as_ref())
            .map(|m| {
                m.fields
                    .iter()
                    .filter_map(|(k, v)| match &v.kind {
                        Some(prost_types::value::Kind::StringValue(s)) => {
                            Some((k.clone(), s.clone()))
                        }
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        self.seen.lock().expect("seen").push(XdsRequestSeen {
            type_url: req.type_url.clone(),
            stream: stream.id,
            node_id: stream.node_id.clone(),
            metadata,
            nonce: req.response_nonce.clone(),
            error: req.error_detail.as_ref().map(|e| e.message.clone()),
            initial_versions: req.initial_resource_versions.clone().into_iter().collect(),
            authorization: stream.authorization.clone(),
            cluster_id: stream.cluster_id.clone(),
        });
    }

    /// What `type_url` holds now that differs from `sent`, as a response
    /// (`None` when nothing differs and `always` is false); `sent` becomes
    /// what the client has after it.
    fn diff(
        &self,
        type_url: &str,
        sent: &mut BTreeMap<String, String>,
        nonce: u64,
        always: bool,
    ) -> Option<DeltaDiscoveryResponse> {
        let all = self.resources.lock().expect("resources");
        let empty = BTreeMap::new();
        let current = all.get(type_url).unwrap_or(&empty);
        let resources: Vec<Resource> = current
            .iter()
            .filter(|(name, (version, _))| sent.get(*name) != Some(version))
            .map(|(name, (version, body))| Resource {
                name: name.clone(),
                version: version.clone(),
                resource: Some(body.clone()),
                ..Resource::default()
            })
            .collect();
        let removed: Vec<String> = sent
            .keys()
            .filter(|name| !current.contains_key(*name))
            .cloned()
            .collect();
        if resources.is_empty() && removed.is_empty() && !always {
            return None;
        }
        *sent = current
            .iter()
            .map(|(name, (version, _))| (name.clone(), version.clone()))
            .collect();
        Some(DeltaDiscoveryResponse {
            type_url: type_url.to_owned(),
            nonce: format!("nonce-{nonce}"),
            resources,
            removed_resources: removed,
            ..DeltaDiscoveryResponse::default()
        })
    }
}

/// What the fake knows of one stream.
struct Stream {
    id: u64,
    node_id: Option<String>,
    authorization: Option<String>,
    cluster_id: Option<String>,
}

/// The ADS service.
pub struct Ads {
    /// What it serves.
    pub state: Arc<XdsState>,
    /// The bearer token it wants.
    pub token: String,
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type DeltaAggregatedResourcesStream =
        ReceiverStream<Result<DeltaDiscoveryResponse, tonic::Status>>;

    async fn delta_aggregated_resources(
        &self,
        request: tonic::Request<tonic::Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<tonic::Response<Self::DeltaAggregatedResourcesStream>, tonic::Status> {
        let header = |k: &str| {
            request
                .metadata()
                .get(k)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let (authorization, cluster_id) = (header("authorization"), header("clusterid"));
        if authorization.as_deref() != Some(format!("Bearer {}", self.token).as_str()) {
            return Err(tonic::Status::unauthenticated(
                "bad or missing bearer token",
            ));
        }
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let state = Arc::clone(&self.state);
        let mut stream = Stream {
            id: state
                .streams
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                + 1,
            node_id: None,
            authorization,
            cluster_id,
        };
        tokio::spawn(async move {
            let mut sent: HashMap<String, BTreeMap<String, String>> = HashMap::new();
            let mut generations = state.changed.subscribe();
            let mut kicks = state.kicks.subscribe();
            kicks.borrow_and_update();
            let mut silent = state.silent.subscribe();
            let mut nonce = 0u64;
            loop {
                let mut out = Vec::new();
                let quiet = *silent.borrow_and_update();
                tokio::select! {
                    req = inbound.message() => {
                        let Ok(Some(req)) = req else { break };
                        state.record(&req, &mut stream);
                        if req.response_nonce.is_empty() {
                            let have = sent.entry(req.type_url.clone()).or_default();
                            have.clone_from(&req.initial_resource_versions.into_iter().collect());
                            if !quiet {
                                nonce += 1;
                                out.extend(state.diff(&req.type_url, have, nonce, true));
                            }
                        }
                    }
                    changed = generations.changed() => {
                        if changed.is_err() { break }
                        if !quiet {
                            for (type_url, have) in &mut sent {
                                nonce += 1;
                                out.extend(state.diff(type_url, have, nonce, false));
                            }
                        }
                    }
                    changed = silent.changed() => {
                        if changed.is_err() { break }
                        // Released: everything subscribed so far, at once.
                        if !*silent.borrow_and_update() {
                            for (type_url, have) in &mut sent {
                                nonce += 1;
                                out.extend(state.diff(type_url, have, nonce, true));
                            }
                        }
                    }
                    _ = kicks.changed() => break,
                }
                for response in out {
                    if tx.send(Ok(response)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// A waypoint as istiod names it.
fn gateway(w: &ztunnel::state::Waypoint) -> ztunnel::proto::istio::workload::GatewayAddress {
    use ztunnel::proto::istio::workload as xds;
    let destination = match (&w.hostname, &w.address) {
        (Some(hostname), _) => {
            xds::gateway_address::Destination::Hostname(xds::NamespacedHostname {
                namespace: w.namespace.clone().unwrap_or_default(),
                hostname: hostname.clone(),
            })
        }
        (None, address) => xds::gateway_address::Destination::Address(xds::NetworkAddress {
            address: address.as_ref().map(ip_bytes).unwrap_or_default(),
            ..xds::NetworkAddress::default()
        }),
    };
    xds::GatewayAddress {
        destination: Some(destination),
        hbone_mtls_port: u32::from(w.hbone_port),
    }
}

/// What istiod would send for a local-mode config, so that the same YAML
/// fixtures drive both modes: every workload (named as istiod names pods,
/// `Kubernetes//Pod/NS/NAME`, not by the config's uid), every service, and
/// the policies. Label selectors become `WORKLOAD_SELECTOR` policies listed
/// in the selected workloads' `authorization_policies`, the way istiod
/// resolves them; a STRICT peer authentication becomes the DENY-without-
/// principal policy istiod sends for it (PERMISSIVE sends nothing, so a
/// PERMISSIVE exception under a STRICT namespace is not expressed).
pub fn from_local(
    config: &ztunnel::state::local::LocalConfig,
) -> (Vec<(String, Address)>, Vec<Authorization>) {
    use ztunnel::{
        proto::istio::{security, workload as xds},
        state::policy::{Action, MtlsMode, ROOT_NAMESPACE},
    };
    let selects =
        |namespace: &str, selector: &BTreeMap<String, String>, w: &ztunnel::state::Workload| {
            !selector.is_empty()
                && namespace == w.namespace
                && selector.iter().all(|(k, v)| w.labels.get(k) == Some(v))
        };
    let strict: Vec<_> = config
        .peer_authentications
        .iter()
        .filter(|p| p.mode == MtlsMode::Strict)
        .enumerate()
        .map(|(i, p)| (format!("converted-strict-{i}"), p))
        .collect();
    let mut addresses = Vec::new();
    for w in &config.workloads {
        let mut selected: Vec<String> = config
            .policies
            .iter()
            .filter(|p| selects(&p.namespace, &p.selector, w))
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect();
        selected.extend(
            strict
                .iter()
                .filter(|(_, p)| selects(&p.namespace, &p.selector, w))
                .map(|(name, p)| format!("{}/{name}", p.namespace)),
        );
        let services = config
            .services
            .iter()
            .filter(|s| s.endpoints.contains(&w.uid))
            .map(|s| {
                let ports = s.ports.iter().copied().map(port).collect();
                (
                    format!("{}/{}", s.namespace, s.hostname()),
                    xds::PortList { ports },
                )
            })
            .collect();
        let uid = format!("Kubernetes//Pod/{}/{}", w.namespace, w.name);
        let workload = xds::Workload {
            uid: uid.clone(),
            name: w.name.clone(),
            namespace: w.namespace.clone(),
            addresses: w.ips.iter().map(ip_bytes).collect(),
            tunnel_protocol: if w.protocol == ztunnel::state::WorkloadProtocol::Hbone {
                xds::TunnelProtocol::Hbone as i32
            } else {
                xds::TunnelProtocol::None as i32
            },
            trust_domain: config.trust_domain.clone(),
            service_account: w.service_account.clone(),
            node: w.node.clone(),
            canonical_name: w.labels.get("app").cloned().unwrap_or_default(),
            services,
            authorization_policies: selected,
            waypoint: w.waypoint.as_ref().map(gateway),
            ..xds::Workload::default()
        };
        addresses.push((
            uid,
            Address {
                r#type: Some(xds::address::Type::Workload(workload)),
            },
        ));
    }
    for s in &config.services {
        let service = xds::Service {
            name: s.name.clone(),
            namespace: s.namespace.clone(),
            hostname: s.hostname(),
            addresses: s
                .vips
                .iter()
                .map(|ip| xds::NetworkAddress {
                    address: ip_bytes(ip),
                    ..xds::NetworkAddress::default()
                })
                .collect(),
            ports: s.ports.iter().copied().map(port).collect(),
            waypoint: s.waypoint.as_ref().map(gateway),
            ..xds::Service::default()
        };
        addresses.push((
            format!("{}/{}", s.namespace, s.hostname()),
            Address {
                r#type: Some(xds::address::Type::Service(service)),
            },
        ));
    }
    let scope = |namespace: &str, selector: &BTreeMap<String, String>| {
        if !selector.is_empty() {
            security::Scope::WorkloadSelector
        } else if namespace == ROOT_NAMESPACE {
            security::Scope::Global
        } else {
            security::Scope::Namespace
        }
    };
    let mut policies: Vec<Authorization> = config
        .policies
        .iter()
        .map(|p| Authorization {
            name: p.name.clone(),
            namespace: p.namespace.clone(),
            scope: scope(&p.namespace, &p.selector) as i32,
            action: match p.action {
                Action::Allow => security::Action::Allow,
                Action::Deny => security::Action::Deny,
            } as i32,
            rules: p.rules.iter().map(rule).collect(),
            ..Authorization::default()
        })
        .collect();
    policies.extend(strict.iter().map(|(name, p)| Authorization {
        name: name.clone(),
        namespace: p.namespace.clone(),
        scope: scope(&p.namespace, &p.selector) as i32,
        action: security::Action::Deny as i32,
        rules: vec![security::Rule {
            clauses: vec![security::Clause {
                matches: vec![security::Match {
                    not_principals: vec![presence()],
                    ..security::Match::default()
                }],
            }],
        }],
        ..Authorization::default()
    }));
    (addresses, policies)
}

fn port(p: ztunnel::state::service::ServicePort) -> ztunnel::proto::istio::workload::Port {
    ztunnel::proto::istio::workload::Port {
        service_port: u32::from(p.port),
        target_port: u32::from(p.target_port.unwrap_or(p.port)),
        app_protocol: 0,
    }
}

fn ip_bytes(ip: &std::net::IpAddr) -> Vec<u8> {
    match ip {
        std::net::IpAddr::V4(v4) => v4.octets().to_vec(),
        std::net::IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn presence() -> ztunnel::proto::istio::security::StringMatch {
    use ztunnel::proto::istio::security::{StringMatch, string_match::MatchType};
    StringMatch {
        match_type: Some(MatchType::Presence(())),
    }
}

/// One of our patterns (`*`, `prefix*`, `*suffix`, exact) as istiod's
/// string match, principals without `spiffe://`.
fn pattern(p: &str) -> ztunnel::proto::istio::security::StringMatch {
    use ztunnel::proto::istio::security::{StringMatch, string_match::MatchType};
    let bare = |s: &str| s.strip_prefix("spiffe://").unwrap_or(s).to_owned();
    let match_type = if p == "*" {
        return presence();
    } else if let Some(prefix) = p.strip_suffix('*') {
        MatchType::Prefix(bare(prefix))
    } else if let Some(suffix) = p.strip_prefix('*') {
        MatchType::Suffix(suffix.to_owned())
    } else {
        MatchType::Exact(bare(p))
    };
    StringMatch {
        match_type: Some(match_type),
    }
}

fn rule(r: &ztunnel::state::policy::Rule) -> ztunnel::proto::istio::security::Rule {
    use ztunnel::proto::istio::security::{self, Clause, Match};
    let block = |c: &ztunnel::capture::maps::Cidr| security::Address {
        address: ip_bytes(&c.addr),
        length: u32::from(c.prefix),
    };
    let mut clauses = Vec::new();
    if !r.from.is_empty() {
        clauses.push(Clause {
            matches: r
                .from
                .iter()
                .map(|s| Match {
                    principals: s.principals.iter().map(|p| pattern(p)).collect(),
                    not_principals: s.not_principals.iter().map(|p| pattern(p)).collect(),
                    namespaces: s.namespaces.iter().map(|p| pattern(p)).collect(),
                    not_namespaces: s.not_namespaces.iter().map(|p| pattern(p)).collect(),
                    source_ips: s.ip_blocks.iter().map(block).collect(),
                    not_source_ips: s.not_ip_blocks.iter().map(block).collect(),
                    ..Match::default()
                })
                .collect(),
        });
    }
    if !r.to.is_empty() {
        clauses.push(Clause {
            matches: r
                .to
                .iter()
                .map(|o| Match {
                    destination_ports: o.ports.iter().map(|p| u32::from(*p)).collect(),
                    not_destination_ports: o.not_ports.iter().map(|p| u32::from(*p)).collect(),
                    ..Match::default()
                })
                .collect(),
        });
    }
    clauses.extend(r.clauses.iter().map(|c| {
        Clause {
            matches: c
                .any
                .iter()
                .flat_map(|inner| {
                    let converted = rule(inner).clauses;
                    assert!(
                        converted.len() <= 1,
                        "a clause alternative with both from and to has no single xDS match: {inner:?}"
                    );
                    converted.into_iter().flat_map(|c| c.matches)
                })
                .collect(),
        }
    }));
    security::Rule { clauses }
}
