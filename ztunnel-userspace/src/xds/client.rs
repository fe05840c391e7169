//! The delta ADS stream to istiod.
//!
//! - One stream, both types subscribed as wildcards (an empty subscription
//!   on the first request of each type), the node id and metadata on each
//!   first request.
//! - Each response is applied resource by resource: those that validate
//!   replace their previous version, removed names are dropped, and the
//!   whole state is rebuilt and published (open connections the new
//!   policies refuse are closed, as on a file reload). The reply echoes
//!   `type_url` and `response_nonce`: an ACK, or a NACK whose
//!   `error_detail` names every refused resource and why (those keep their
//!   last good version, or stay unknown).
//! - A broken stream is opened again after an exponential back-off
//!   (500 ms doubling to 30 s, reset once a stream delivered something),
//!   sending `initial_resource_versions` so istiod sends only what changed.
//!   Meanwhile the last state keeps being served.
//! - ztunnel is ready (15021) only once both types were ACKed once
//!   (`synced`). Every wait is bounded: opening the stream, the first push
//!   of each stream, and a silent istiod by HTTP/2 keep-alive.

use std::{
    collections::{BTreeMap, HashSet},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use prost::Message as _;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use super::{ADDRESS_TYPE, AUTHORIZATION_TYPE, XdsError, convert};
use crate::{
    istiod::{self, Calls, ChannelError, IstiodChannel},
    proto::{
        envoy::{
            config::core::v3::Node,
            service::discovery::v3::{
                DeltaDiscoveryRequest, DeltaDiscoveryResponse,
                aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
            },
        },
        google::rpc::Status,
        istio::{security::Authorization, workload::Address},
    },
    state::local::LocalConfig,
};

/// First back-off after a broken stream.
const INITIAL_BACKOFF: Duration = Duration::from_millis(500);
/// Longest back-off.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Opening the stream (connect, TLS, HTTP/2, response headers).
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);
/// A new stream whose first push has not come within this is opened again.
const FIRST_PUSH_TIMEOUT: Duration = Duration::from_secs(60);
/// HTTP/2 keep-alive on the channel: a PING every 30 s, 10 s to answer.
const KEEPALIVE: (Duration, Duration) = (Duration::from_secs(30), Duration::from_secs(10));
/// Largest response accepted (a big mesh's full push).
const MAX_MESSAGE: usize = 64 * 1024 * 1024;
/// `google.rpc.Code.INVALID_ARGUMENT`, the code of a NACK.
const INVALID_ARGUMENT: i32 = 3;

/// Where istiod is and who this ztunnel is.
#[derive(Debug, Clone)]
pub struct XdsSettings {
    /// `host:port` (an `https://` prefix is accepted).
    pub address: String,
    /// PEM root(s) istiod's certificate must chain to.
    pub root_cert: PathBuf,
    /// Bearer token file (read again for every stream).
    pub token: PathBuf,
    /// Sent as `clusterid`.
    pub cluster_id: String,
    /// [`super::node_id`].
    pub node_id: String,
    /// [`super::node_metadata`].
    pub metadata: BTreeMap<String, String>,
    /// The mesh's trust domain (for workloads that name none).
    pub trust_domain: String,
}

/// What `config_dump` shows of the stream.
#[derive(Debug, Default, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct XdsStatus {
    /// istiod's address.
    pub address: String,
    /// Whether a stream is open now.
    pub connected: bool,
    /// Streams opened again after one ended.
    pub reconnects: u64,
    /// Per type: resource name -> version held.
    pub versions: BTreeMap<&'static str, BTreeMap<String, String>>,
    /// Types ACKed at least once.
    pub acked: Vec<&'static str>,
    /// The last NACK sent.
    pub last_nack: Option<Nack>,
}

/// A NACK as sent.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Nack {
    /// The type of the refused push.
    pub type_url: String,
    /// Its nonce.
    pub nonce: String,
    /// The `error_detail` message (every refused resource and why).
    pub detail: String,
    /// When, seconds since the Unix epoch.
    pub at_unix_s: u64,
}

/// Shared view of [`XdsStatus`].
pub type XdsStatusHandle = Arc<Mutex<XdsStatus>>;

/// The client.
#[derive(Debug)]
pub struct XdsClient {
    settings: XdsSettings,
    channel: IstiodChannel,
    status: XdsStatusHandle,
}

/// What has been accepted so far, kept across streams.
#[derive(Debug, Default)]
struct Store {
    resources: convert::Resources,
    /// Per type: resource name -> version.
    versions: BTreeMap<&'static str, BTreeMap<String, String>>,
    acked: HashSet<&'static str>,
}

impl XdsClient {
    /// Reads the root file and prepares the channel (dialled when
    /// [`Self::run`] starts).
    pub fn new(settings: XdsSettings) -> Result<Self, XdsError> {
        let channel = istiod::channel(
            &settings.address,
            &settings.root_cert,
            Calls::Streaming(KEEPALIVE.0, KEEPALIVE.1),
        )
        .map_err(|e| match e {
            ChannelError::Address(message) => XdsError::Address {
                address: settings.address.clone(),
                message,
            },
            ChannelError::Root(message) => XdsError::RootCert {
                path: settings.root_cert.clone(),
                message,
            },
        })?;
        let status = Arc::new(Mutex::new(XdsStatus {
            address: settings.address.clone(),
            ..XdsStatus::default()
        }));
        Ok(Self {
            settings,
            channel,
            status,
        })
    }

    /// The stream's status, kept current while [`Self::run`] runs.
    pub fn status(&self) -> XdsStatusHandle {
        Arc::clone(&self.status)
    }

    fn update_status(&self, f: impl FnOnce(&mut XdsStatus)) {
        f(&mut self
            .status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner));
    }

    /// The name istiod's certificate is checked against.
    pub fn server_name(&self) -> &str {
        &self.channel.host
    }

    /// Runs the stream for ever: every accepted change is handed to
    /// `publish` as a whole state; `synced` turns true once both types were
    /// ACKed.
    pub async fn run(
        self,
        publish: impl Fn(LocalConfig) + Send + Sync,
        synced: watch::Sender<bool>,
    ) {
        let mut store = Store::default();
        let mut backoff = INITIAL_BACKOFF;
        loop {
            let mut delivered = false;
            let outcome = self
                .stream(&mut store, &publish, &synced, &mut delivered)
                .await;
            if delivered {
                backoff = INITIAL_BACKOFF;
            }
            self.update_status(|s| {
                s.connected = false;
                s.reconnects += 1;
            });
            // Before the first sync there is no last state to serve: say
            // what happens instead (connections are refused).
            let meanwhile = if *synced.borrow() {
                "serving the last state until it is back"
            } else {
                "no mesh state yet: connections stay refused until istiod answers"
            };
            match outcome {
                Ok(()) => {
                    tracing::info!(xds = %self.settings.address, retry_in = ?backoff, "xDS stream closed by istiod; {meanwhile}");
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?backoff, "xDS stream failed; {meanwhile}");
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    fn node(&self) -> Node {
        let fields = self
            .settings
            .metadata
            .iter()
            .map(|(k, v)| {
                let value = prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(v.clone())),
                };
                (k.clone(), value)
            })
            .collect();
        Node {
            id: self.settings.node_id.clone(),
            cluster: self.settings.cluster_id.clone(),
            metadata: Some(prost_types::Struct { fields }),
            user_agent_name: "ztunnel-rs".into(),
            ..Node::default()
        }
    }

    /// One stream, until it ends.
    async fn stream(
        &self,
        store: &mut Store,
        publish: &(impl Fn(LocalConfig) + Send + Sync),
        synced: &watch::Sender<bool>,
        delivered: &mut bool,
    ) -> Result<(), XdsError> {
        let err = |message: String| XdsError::Stream {
            address: self.settings.address.clone(),
            message,
        };
        let (tx, rx) = mpsc::channel(8);
        for type_url in [ADDRESS_TYPE, AUTHORIZATION_TYPE] {
            let first = DeltaDiscoveryRequest {
                node: Some(self.node()),
                type_url: type_url.to_owned(),
                initial_resource_versions: store
                    .versions
                    .get(type_url)
                    .map(|v| v.clone().into_iter().collect())
                    .unwrap_or_default(),
                ..DeltaDiscoveryRequest::default()
            };
            // The channel has room for both first requests.
            tx.try_send(first)
                .map_err(|e| err(format!("queueing the first request: {e}")))?;
        }
        let mut request = tonic::Request::new(ReceiverStream::new(rx));
        istiod::authenticate(
            &mut request,
            &self.settings.token,
            &self.settings.cluster_id,
        )
        .map_err(err)?;
        let mut client = AggregatedDiscoveryServiceClient::new(self.channel.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE);
        let response =
            tokio::time::timeout(OPEN_TIMEOUT, client.delta_aggregated_resources(request))
                .await
                .map_err(|_| err(format!("not opened within {OPEN_TIMEOUT:?}")))?
                .map_err(|s| err(istiod::describe(&s)))?;
        tracing::info!(xds = %self.settings.address, "xDS stream open");
        self.update_status(|s| s.connected = true);
        let mut inbound = response.into_inner();
        let mut first = true;
        loop {
            let next = if first {
                tokio::time::timeout(FIRST_PUSH_TIMEOUT, inbound.message())
                    .await
                    .map_err(|_| err(format!("no push within {FIRST_PUSH_TIMEOUT:?}")))?
            } else {
                inbound.message().await
            };
            let response = match next {
                Ok(Some(response)) => response,
                Ok(None) => return Ok(()),
                Err(status) => return Err(err(istiod::describe(&status))),
            };
            first = false;
            *delivered = true;
            let (reply, changed) = store.apply(&response);
            self.update_status(|s| {
                s.versions.clone_from(&store.versions);
                s.acked = store.acked.iter().copied().collect();
                s.acked.sort_unstable();
                if let Some(error) = &reply.error_detail {
                    s.last_nack = Some(Nack {
                        type_url: reply.type_url.clone(),
                        nonce: reply.response_nonce.clone(),
                        detail: error.message.clone(),
                        at_unix_s: std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| d.as_secs()),
                    });
                }
            });
            if changed {
                publish(convert::to_config(
                    &self.settings.trust_domain,
                    &store.resources,
                ));
            }
            if store.acked.contains(ADDRESS_TYPE) && store.acked.contains(AUTHORIZATION_TYPE) {
                synced.send_if_modified(|s| !std::mem::replace(s, true));
            }
            // Bounded: an istiod that stops reading our ACKs (its HTTP/2
            // window full) while still answering PINGs would block here.
            tokio::time::timeout(OPEN_TIMEOUT, tx.send(reply))
                .await
                .map_err(|_| err(format!("istiod read no ACK within {OPEN_TIMEOUT:?}")))?
                .map_err(|_| err("the request stream closed".into()))?;
        }
    }
}

impl Store {
    /// Applies one response; returns the ACK or NACK for it and whether
    /// the state changed.
    fn apply(&mut self, response: &DeltaDiscoveryResponse) -> (DeltaDiscoveryRequest, bool) {
        let reply = |error: Option<String>| DeltaDiscoveryRequest {
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            error_detail: error.map(|message| Status {
                code: INVALID_ARGUMENT,
                message,
                details: Vec::new(),
            }),
            ..DeltaDiscoveryRequest::default()
        };
        let type_url = match response.type_url.as_str() {
            ADDRESS_TYPE => ADDRESS_TYPE,
            AUTHORIZATION_TYPE => AUTHORIZATION_TYPE,
            other => {
                tracing::warn!(
                    type_url = other,
                    "xDS push of a type ztunnel did not subscribe to: NACK"
                );
                return (
                    reply(Some(format!("type {other} was not subscribed"))),
                    false,
                );
            }
        };
        let mut refused = Vec::new();
        let mut changed = false;
        let versions = self.versions.entry(type_url).or_default();
        for resource in &response.resources {
            let name = resource.name.as_str();
            match accept(type_url, resource) {
                Err(why) => refused.push(format!("{name}: {why}")),
                Ok(accepted) => {
                    match accepted {
                        Accepted::Address(a) => {
                            self.resources.addresses.insert(name.to_owned(), *a);
                        }
                        Accepted::Policy(p) => {
                            self.resources.policies.insert(name.to_owned(), p);
                        }
                    }
                    versions.insert(name.to_owned(), resource.version.clone());
                    changed = true;
                }
            }
        }
        for name in &response.removed_resources {
            let removed = if type_url == ADDRESS_TYPE {
                self.resources.addresses.remove(name).is_some()
            } else {
                self.resources.policies.remove(name).is_some()
            };
            versions.remove(name);
            changed |= removed;
        }
        tracing::info!(
            type_url,
            updated = response.resources.len() - refused.len(),
            removed = response.removed_resources.len(),
            refused = refused.len(),
            "xDS push applied"
        );
        if refused.is_empty() {
            self.acked.insert(type_url);
            (reply(None), changed)
        } else {
            let detail = refused.join("; ");
            tracing::warn!(type_url, refused = %detail, "xDS resources refused (NACK); their last good version stays");
            (reply(Some(detail)), changed)
        }
    }
}

enum Accepted {
    Address(Box<Address>),
    Policy(Option<crate::state::policy::Policy>),
}

/// Decodes and checks one resource of type `type_url`.
fn accept(
    type_url: &str,
    resource: &crate::proto::envoy::service::discovery::v3::Resource,
) -> Result<Accepted, String> {
    if resource.name.is_empty() {
        return Err("a resource without a name".into());
    }
    let body = resource
        .resource
        .as_ref()
        .ok_or_else(|| "no resource body".to_owned())?;
    if body.type_url != type_url {
        return Err(format!(
            "body of type {} in a {type_url} push",
            body.type_url
        ));
    }
    if type_url == ADDRESS_TYPE {
        let address =
            Address::decode(body.value.as_slice()).map_err(|e| format!("undecodable: {e}"))?;
        convert::check_address(&address)?;
        Ok(Accepted::Address(Box::new(address)))
    } else {
        let policy = Authorization::decode(body.value.as_slice())
            .map_err(|e| format!("undecodable: {e}"))?;
        Ok(Accepted::Policy(convert::policy(&policy)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{
        envoy::service::discovery::v3::Resource,
        istio::workload::{self, address},
    };

    fn workload_resource(name: &str, addr: Vec<u8>) -> Resource {
        let a = Address {
            r#type: Some(address::Type::Workload(workload::Workload {
                uid: name.into(),
                name: "b1".into(),
                namespace: "test".into(),
                addresses: vec![addr],
                ..workload::Workload::default()
            })),
        };
        Resource {
            name: name.into(),
            version: "v1".into(),
            resource: Some(prost_types::Any {
                type_url: ADDRESS_TYPE.into(),
                value: a.encode_to_vec(),
            }),
            ..Resource::default()
        }
    }

    #[test]
    fn a_bad_resource_is_nacked_by_name_and_the_good_ones_apply() {
        let mut store = Store::default();
        let response = DeltaDiscoveryResponse {
            type_url: ADDRESS_TYPE.into(),
            nonce: "n1".into(),
            resources: vec![
                workload_resource("good", vec![10, 0, 0, 2]),
                workload_resource("bad", vec![1, 2, 3]),
            ],
            ..DeltaDiscoveryResponse::default()
        };
        let (reply, changed) = store.apply(&response);
        assert!(changed);
        assert_eq!(reply.response_nonce, "n1");
        assert_eq!(reply.type_url, ADDRESS_TYPE);
        let detail = reply.error_detail.expect("a NACK");
        assert!(detail.message.starts_with("bad:"), "{}", detail.message);
        assert!(store.resources.addresses.contains_key("good"));
        assert!(!store.resources.addresses.contains_key("bad"));
        assert!(!store.acked.contains(ADDRESS_TYPE));

        // The next push is clean: ACK, and a removal takes the workload out.
        let response = DeltaDiscoveryResponse {
            type_url: ADDRESS_TYPE.into(),
            nonce: "n2".into(),
            removed_resources: vec!["good".into()],
            ..DeltaDiscoveryResponse::default()
        };
        let (reply, changed) = store.apply(&response);
        assert!(changed && reply.error_detail.is_none());
        assert!(store.acked.contains(ADDRESS_TYPE));
        assert!(store.resources.addresses.is_empty());
        assert!(store.versions[ADDRESS_TYPE].is_empty());
    }

    #[test]
    fn a_push_of_an_unsubscribed_type_or_mismatched_body_is_refused() {
        let mut store = Store::default();
        let (reply, changed) = store.apply(&DeltaDiscoveryResponse {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            nonce: "n".into(),
            ..DeltaDiscoveryResponse::default()
        });
        assert!(!changed && reply.error_detail.is_some());
        let mut wrong = workload_resource("w", vec![10, 0, 0, 2]);
        if let Some(body) = &mut wrong.resource {
            body.type_url = AUTHORIZATION_TYPE.into();
        }
        let (reply, _) = store.apply(&DeltaDiscoveryResponse {
            type_url: ADDRESS_TYPE.into(),
            resources: vec![wrong],
            ..DeltaDiscoveryResponse::default()
        });
        assert!(
            reply
                .error_detail
                .expect("NACK")
                .message
                .contains("body of type")
        );
    }
}
