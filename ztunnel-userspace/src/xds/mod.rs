//! The control plane: istiod's xDS workload API.
//!
//! With `XDS_ADDRESS` set, ztunnel learns the mesh from istiod instead of
//! the local file: one delta ADS stream ([`client`]) subscribed (wildcard)
//! to `istio.workload.Address` and `istio.security.Authorization`, whose
//! resources [`convert`] turns into the same mesh state the file gives.

pub mod client;
pub mod convert;

use std::{collections::BTreeMap, path::PathBuf};

pub use client::{XdsClient, XdsSettings, XdsStatus, XdsStatusHandle};

/// Type URL of workloads and services.
pub const ADDRESS_TYPE: &str = "type.googleapis.com/istio.workload.Address";
/// Type URL of authorization policies.
pub const AUTHORIZATION_TYPE: &str = "type.googleapis.com/istio.security.Authorization";

/// Errors of the xDS client; each names what is at fault.
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    /// The address is not `host:port`.
    #[error("xDS address {address:?}: {message}")]
    Address {
        /// As configured.
        address: String,
        /// What is wrong.
        message: String,
    },
    /// The root certificate file.
    #[error("xDS root certificate {path}: {message}")]
    RootCert {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The stream could not be opened or broke.
    #[error("xDS stream to {address}: {message}")]
    Stream {
        /// istiod's address.
        address: String,
        /// What happened.
        message: String,
    },
}

/// Istio's node id for a ztunnel:
/// `ztunnel~{INSTANCE_IP}~{POD_NAME}.{POD_NAMESPACE}~{POD_NAMESPACE}.svc.cluster.local`.
pub fn node_id(instance_ip: &str, pod_name: &str, pod_namespace: &str) -> String {
    format!("ztunnel~{instance_ip}~{pod_name}.{pod_namespace}~{pod_namespace}.svc.cluster.local")
}

/// The node metadata istiod reads: `NAME`, `NAMESPACE`, `INSTANCE_IPS`,
/// `NODE_NAME`, `CLUSTER_ID`, and every `ISTIO_META_*` variable of
/// `env` (prefix removed), as Istio's proxies send them.
pub fn node_metadata(
    pod_name: &str,
    pod_namespace: &str,
    instance_ip: &str,
    node_name: &str,
    cluster_id: &str,
    env: impl IntoIterator<Item = (String, String)>,
) -> BTreeMap<String, String> {
    let mut meta: BTreeMap<String, String> = env
        .into_iter()
        .filter_map(|(k, v)| {
            k.strip_prefix("ISTIO_META_")
                .filter(|k| !k.is_empty())
                .map(|k| (k.to_owned(), v))
        })
        .collect();
    for (k, v) in [
        ("NAME", pod_name),
        ("NAMESPACE", pod_namespace),
        ("INSTANCE_IPS", instance_ip),
        ("NODE_NAME", node_name),
        ("CLUSTER_ID", cluster_id),
    ] {
        meta.insert(k.to_owned(), v.to_owned());
    }
    meta
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_id_and_metadata_are_istios() {
        assert_eq!(
            node_id("10.0.0.5", "ztunnel-abc", "istio-system"),
            "ztunnel~10.0.0.5~ztunnel-abc.istio-system~istio-system.svc.cluster.local"
        );
        let meta = node_metadata(
            "ztunnel-abc",
            "istio-system",
            "10.0.0.5",
            "node-1",
            "Kubernetes",
            [
                ("ISTIO_META_DNS_CAPTURE".to_owned(), "true".to_owned()),
                ("PATH".to_owned(), "/bin".to_owned()),
                ("ISTIO_META_CLUSTER_ID".to_owned(), "ignored".to_owned()),
            ],
        );
        assert_eq!(meta["DNS_CAPTURE"], "true");
        assert_eq!(meta["CLUSTER_ID"], "Kubernetes");
        assert_eq!(meta["NODE_NAME"], "node-1");
        assert_eq!(meta["INSTANCE_IPS"], "10.0.0.5");
        assert!(!meta.contains_key("PATH"));
    }
}
