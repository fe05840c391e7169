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
        }
    }
}

impl XdsState {
    fn put(&self, type_url: &str, name: &str, value: Vec<u8>) {
        let version = {
            let mut n = self.next_version.lock().expect("version");
            *n += 1;
            format!("v{n}")
        };
        let body = prost_types::Any {
            type_url: type_url.to_owned(),
            value,
        };
        self.resources
            .lock()
            .expect("resources")
            .entry(type_url.to_owned())
            .or_default()
            .insert(name.to_owned(), (version, body));
        self.changed.send_modify(|g| *g += 1);
    }

    /// Serves `address` as `name` (a new version each time).
    pub fn set_address(&self, name: &str, address: &Address) {
        self.put(ADDRESS_TYPE, name, address.encode_to_vec());
    }

    /// Serves raw bytes as an `Address` named `name` (to send garbage).
    pub fn set_address_bytes(&self, name: &str, bytes: Vec<u8>) {
        self.put(ADDRESS_TYPE, name, bytes);
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
            let mut nonce = 0u64;
            loop {
                let mut out = Vec::new();
                tokio::select! {
                    req = inbound.message() => {
                        let Ok(Some(req)) = req else { break };
                        state.record(&req, &mut stream);
                        if req.response_nonce.is_empty() {
                            let have = sent.entry(req.type_url.clone()).or_default();
                            have.clone_from(&req.initial_resource_versions.into_iter().collect());
                            nonce += 1;
                            out.extend(state.diff(&req.type_url, have, nonce, true));
                        }
                    }
                    changed = generations.changed() => {
                        if changed.is_err() { break }
                        for (type_url, have) in &mut sent {
                            nonce += 1;
                            out.extend(state.diff(type_url, have, nonce, false));
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
