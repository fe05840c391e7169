//! Services: VIPs and ports in front of workloads.

use std::net::IpAddr;

use serde::Deserialize;

/// One port of a service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ServicePort {
    /// Port on the VIP.
    pub port: u16,
    /// Port on the endpoints (defaults to `port`).
    #[serde(default)]
    pub target_port: Option<u16>,
}

/// A service.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Service {
    /// Name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Virtual IPs.
    pub vips: Vec<IpAddr>,
    /// Ports.
    pub ports: Vec<ServicePort>,
    /// Workload uids behind the service.
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// The hostname, when it is not `name.namespace.svc.cluster.local`
    /// (istiod sends each service's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// The waypoint connections to the VIPs go through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<super::Waypoint>,
}

/// The cluster's DNS domain, the suffix of service hostnames. Kubernetes'
/// default; Istio's ztunnel names services by `name.namespace.svc.<domain>`
/// on the wire (`Forwarded: host=`), so we use the same form.
pub const CLUSTER_DOMAIN: &str = "cluster.local";

impl Service {
    /// `name.namespace.svc.cluster.local`: how a client names the service
    /// to the destination's ztunnel.
    pub fn hostname(&self) -> String {
        self.hostname
            .clone()
            .unwrap_or_else(|| format!("{}.{}.svc.{CLUSTER_DOMAIN}", self.name, self.namespace))
    }

    /// The target port for `port`, if the service exposes it.
    pub fn target_port(&self, port: u16) -> Option<u16> {
        self.ports
            .iter()
            .find(|p| p.port == port)
            .map(|p| p.target_port.unwrap_or(p.port))
    }
}
