//! Waypoints: the L7 proxies a workload or service is reached through.
//!
//! A workload or service with a waypoint is not connected to directly: the
//! client's ztunnel opens HBONE to the waypoint (its address, its HBONE
//! port) with `:authority` = the address the application dialled (the
//! service VIP and port, or the workload's IP and port), as Istio's ztunnel
//! does. The waypoint applies its policies and carries the connection on to
//! a destination of its choosing. See docs/hbone.md for the whole path and
//! for inbound traffic that did not come through the waypoint.

use std::net::IpAddr;

use serde::Deserialize;

/// Istio's HBONE port, a waypoint's default.
pub const DEFAULT_HBONE_PORT: u16 = ztunnel_common::INBOUND_HBONE_PORT;

/// Where a waypoint is (Istio's `GatewayAddress`): exactly one of
/// `hostname` (a service) and `address` (a workload IP or a service VIP).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Waypoint {
    /// The waypoint's service by hostname
    /// (`name.namespace.svc.cluster.local`); its endpoints are the
    /// waypoint's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// The namespace of `hostname`'s service, when given (xDS always does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Or the waypoint by address: a waypoint pod's IP or its service's VIP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<IpAddr>,
    /// The waypoint's HBONE (mTLS) port.
    #[serde(default = "default_port")]
    pub hbone_port: u16,
}

fn default_port() -> u16 {
    DEFAULT_HBONE_PORT
}

impl Waypoint {
    /// What is wrong with it, if anything (for config validation).
    pub fn problem(&self) -> Option<&'static str> {
        match (&self.hostname, &self.address) {
            (Some(_), Some(_)) => Some("give either hostname or address, not both"),
            (None, None) => Some("needs a hostname (its service) or an address"),
            (Some(h), None) if h.trim().is_empty() => Some("hostname must not be empty"),
            _ if self.hbone_port == 0 => Some("hbonePort must not be 0"),
            _ => None,
        }
    }
}

impl std::fmt::Display for Waypoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.hostname, &self.address) {
            (Some(h), _) => write!(f, "{h}:{}", self.hbone_port),
            (None, Some(ip)) => write!(f, "{}", std::net::SocketAddr::new(*ip, self.hbone_port)),
            (None, None) => write!(f, "(none):{}", self.hbone_port),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waypoint_is_named_one_way_only() {
        let by_host: Waypoint =
            serde_yaml::from_str("{hostname: wp.demo.svc.cluster.local}").expect("parse");
        assert_eq!(by_host.problem(), None);
        assert_eq!(by_host.hbone_port, 15008);
        assert_eq!(by_host.to_string(), "wp.demo.svc.cluster.local:15008");
        let by_ip: Waypoint =
            serde_yaml::from_str("{address: 10.0.0.9, hbonePort: 15009}").expect("parse");
        assert_eq!(by_ip.problem(), None);
        assert_eq!(by_ip.to_string(), "10.0.0.9:15009");
        let both: Waypoint =
            serde_yaml::from_str("{hostname: wp, address: 10.0.0.9}").expect("parse");
        assert!(both.problem().is_some());
        let neither: Waypoint = serde_yaml::from_str("{hbonePort: 15008}").expect("parse");
        assert!(neither.problem().is_some());
        let zero: Waypoint =
            serde_yaml::from_str("{address: 10.0.0.9, hbonePort: 0}").expect("parse");
        assert!(zero.problem().is_some());
    }
}
