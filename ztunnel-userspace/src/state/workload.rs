//! A workload: what the control plane says about one pod.

use std::{net::IpAddr, path::PathBuf};

use serde::Deserialize;

/// How a workload's traffic is carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, serde::Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum WorkloadProtocol {
    /// Captured by ztunnel; peers reach it over HBONE.
    #[default]
    Hbone,
    /// Not in the mesh; peers reach it with plain TCP.
    Tcp,
}

/// Per-pod opt-outs of capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct CaptureOptOut {
    /// Capture the pod's own outbound connections.
    #[serde(default = "yes")]
    pub outbound: bool,
    /// Capture connections arriving at the pod.
    #[serde(default = "yes")]
    pub inbound: bool,
}

fn yes() -> bool {
    true
}

impl Default for CaptureOptOut {
    fn default() -> Self {
        Self {
            outbound: true,
            inbound: true,
        }
    }
}

/// One workload.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Workload {
    /// Unique id (Kubernetes: the pod uid).
    pub uid: String,
    /// Pod name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Service account; with the namespace it forms the SPIFFE identity.
    #[serde(default = "default_sa")]
    pub service_account: String,
    /// Node the pod runs on.
    pub node: String,
    /// The pod's addresses.
    #[serde(default)]
    pub ips: Vec<IpAddr>,
    /// Path of the pod's network namespace on the node. Workloads of this
    /// node that have one are enrolled (captured) on load.
    #[serde(default)]
    pub netns: Option<PathBuf>,
    /// HBONE (meshed) or TCP (not meshed).
    #[serde(default)]
    pub protocol: WorkloadProtocol,
    /// Capture opt-outs.
    #[serde(default)]
    pub capture: CaptureOptOut,
    /// Labels (for policy selectors).
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
    /// The workload's own trust domain, when it is not the mesh's (xDS
    /// carries one per workload; multi-cluster meshes differ).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust_domain: Option<String>,
    /// The workload (Deployment, ...) the pod belongs to; metrics'
    /// `*_workload` (default: `name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_name: Option<String>,
    /// Canonical service (default: the `app` label, else the workload).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canonical_name: Option<String>,
    /// Canonical revision (default: the `version` label, else `latest`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canonical_revision: Option<String>,
    /// Cluster id (metrics' `*_cluster`; default: unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_id: Option<String>,
    /// The waypoint connections addressed to this workload's IPs go
    /// through (not those addressed to one of its services: the service's
    /// own waypoint decides those).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<super::Waypoint>,
}

fn default_sa() -> String {
    "default".into()
}

impl Workload {
    /// The labels metrics show for this workload, with Istio's defaults.
    pub fn meta(&self) -> crate::telemetry::WorkloadMeta {
        let workload_name = self
            .workload_name
            .clone()
            .unwrap_or_else(|| self.name.clone());
        crate::telemetry::WorkloadMeta {
            canonical_service: self
                .canonical_name
                .clone()
                .or_else(|| self.labels.get("app").cloned())
                .unwrap_or_else(|| workload_name.clone()),
            canonical_revision: self
                .canonical_revision
                .clone()
                .or_else(|| self.labels.get("version").cloned())
                .unwrap_or_else(|| "latest".to_owned()),
            cluster: self.cluster_id.clone().unwrap_or_default(),
            workload_name,
        }
    }

    /// The SPIFFE identity of the workload: in its own trust domain if it
    /// has one, else in the mesh's `trust_domain`.
    pub fn identity(&self, trust_domain: &str) -> String {
        format!(
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain.as_deref().unwrap_or(trust_domain),
            self.namespace,
            self.service_account
        )
    }
}
