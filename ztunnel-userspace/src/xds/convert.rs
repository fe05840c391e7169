//! istiod's resources into the one mesh state model ([`LocalConfig`]), so
//! that routing, policy, metrics labels and `config_dump` work the same
//! from xDS as from the local file.
//!
//! Each resource is checked on its own when it arrives ([`check_address`],
//! [`policy`]): one that does not validate is refused by name (the response
//! is NACKed, the resource's last good version kept) while the others of
//! the push apply. [`to_config`] then joins the accepted resources.
//!
//! How Istio's forms map onto ours:
//! - A workload's `services` map (`namespace/hostname` -> ports) makes it
//!   an endpoint of that service; a service port's `target_port` 0 takes
//!   the workload's target port for it (the first endpoint's: our model has
//!   one target port per service port).
//! - `Authorization` rules are kept in Istio's general form
//!   ([`Rule::clauses`]): every clause must match, any match of a clause.
//!   Principals arrive without `spiffe://` and are matched as SPIFFE ids;
//!   `service_accounts` become `*/ns/NS/sa/SA` principals.
//! - Scope: `GLOBAL` applies in the root namespace, `NAMESPACE` to its
//!   namespace, `WORKLOAD_SELECTOR` to the workloads that list the policy
//!   in `authorization_policies` (they carry the label
//!   [`SELECTED_BY_PREFIX`]`ns/name`, which the policy selects). Istio
//!   delivers STRICT mTLS as such a policy (DENY when no principal), so it
//!   needs nothing else here. `dry_run` policies are not enforced.
//! - A workload's or service's `waypoint` (by hostname or address) is kept
//!   as its [`Waypoint`]; the router sends its traffic there.
//! - Not supported yet, and refused rather than half-applied (traffic would
//!   otherwise skip what they stand for): network gateways, weighted
//!   waypoints, destination-IP matches.

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use crate::{
    capture::maps::Cidr,
    proto::istio::{security, workload as xds},
    state::{
        Service, Waypoint, Workload, WorkloadProtocol,
        local::LocalConfig,
        policy::{Action, Clause, Operation, Policy, ROOT_NAMESPACE, Rule, Source},
        service::ServicePort,
        waypoint::DEFAULT_HBONE_PORT,
    },
};

/// The label a workload carries for each `WORKLOAD_SELECTOR` policy that
/// lists it (`<prefix>namespace/name`).
pub const SELECTED_BY_PREFIX: &str = "xds.ztunnel.io/policy:";

/// What [`to_config`] builds from: the accepted resources, by name.
#[derive(Debug, Default, Clone)]
pub struct Resources {
    /// `istio.workload.Address` resources.
    pub addresses: BTreeMap<String, xds::Address>,
    /// Converted `istio.security.Authorization` resources (`None`: a dry
    /// run, kept so that its version is known but never enforced).
    pub policies: BTreeMap<String, Option<Policy>>,
}

fn ip(bytes: &[u8]) -> Result<IpAddr, String> {
    if let Ok(v4) = <[u8; 4]>::try_from(bytes) {
        Ok(IpAddr::V4(Ipv4Addr::from(v4)))
    } else if let Ok(v6) = <[u8; 16]>::try_from(bytes) {
        Ok(IpAddr::V6(Ipv6Addr::from(v6)))
    } else {
        Err(format!(
            "an address of {} bytes (4 or 16 expected)",
            bytes.len()
        ))
    }
}

fn port(value: u32, what: &str) -> Result<u16, String> {
    u16::try_from(value).map_err(|_| format!("{what} {value} is not a port"))
}

/// Checks one `Address` resource: what [`to_config`] needs is there and
/// well formed, and it uses nothing ztunnel does not enforce yet.
pub fn check_address(address: &xds::Address) -> Result<(), String> {
    match &address.r#type {
        None => Err("neither a workload nor a service".into()),
        Some(xds::address::Type::Workload(w)) => workload(w, &[]).map(|_| ()),
        Some(xds::address::Type::Service(s)) => service(s).map(|_| ()),
    }
}

fn workload(w: &xds::Workload, selected_by: &[&str]) -> Result<Workload, String> {
    if w.uid.is_empty() || w.name.is_empty() || w.namespace.is_empty() {
        return Err("a workload needs uid, name and namespace".into());
    }
    if w.network_gateway.is_some() {
        return Err(format!(
            "workload {}/{} uses a network gateway, which this ztunnel does not support yet",
            w.namespace, w.name
        ));
    }
    let waypoint = w
        .waypoint
        .as_ref()
        .map(waypoint)
        .transpose()
        .map_err(|e| format!("workload {}/{}: {e}", w.namespace, w.name))?;
    let ips = w
        .addresses
        .iter()
        .map(|a| ip(a))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("workload {}/{}: {e}", w.namespace, w.name))?;
    let protocol = if w.tunnel_protocol == xds::TunnelProtocol::Hbone as i32 {
        WorkloadProtocol::Hbone
    } else {
        WorkloadProtocol::Tcp
    };
    let labels = selected_by
        .iter()
        .map(|p| (format!("{SELECTED_BY_PREFIX}{p}"), "true".to_owned()))
        .collect();
    Ok(Workload {
        uid: w.uid.clone(),
        name: w.name.clone(),
        namespace: w.namespace.clone(),
        service_account: if w.service_account.is_empty() {
            "default".into()
        } else {
            w.service_account.clone()
        },
        node: w.node.clone(),
        ips,
        netns: None,
        protocol,
        capture: crate::state::CaptureOptOut::default(),
        labels,
        trust_domain: non_empty(&w.trust_domain),
        workload_name: non_empty(&w.workload_name),
        canonical_name: non_empty(&w.canonical_name),
        canonical_revision: non_empty(&w.canonical_revision),
        cluster_id: non_empty(&w.cluster_id),
        waypoint,
    })
}

/// A `GatewayAddress` naming a waypoint. The network of an address is not
/// checked: this ztunnel knows one network (network gateways are refused).
fn waypoint(g: &xds::GatewayAddress) -> Result<Waypoint, String> {
    let hbone_port = match g.hbone_mtls_port {
        0 => DEFAULT_HBONE_PORT,
        p => port(p, "waypoint HBONE port")?,
    };
    let named = match &g.destination {
        Some(xds::gateway_address::Destination::Hostname(h)) if !h.hostname.is_empty() => {
            Waypoint {
                hostname: Some(h.hostname.clone()),
                namespace: non_empty(&h.namespace),
                address: None,
                hbone_port,
            }
        }
        Some(xds::gateway_address::Destination::Address(a)) => Waypoint {
            hostname: None,
            namespace: None,
            address: Some(ip(&a.address).map_err(|e| format!("waypoint: {e}"))?),
            hbone_port,
        },
        _ => return Err("a waypoint without hostname or address".into()),
    };
    Ok(named)
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

fn service(s: &xds::Service) -> Result<Service, String> {
    if s.name.is_empty() || s.namespace.is_empty() || s.hostname.is_empty() {
        return Err("a service needs name, namespace and hostname".into());
    }
    if !s.weighted_waypoints.is_empty() {
        return Err(format!(
            "service {}/{} splits its traffic over weighted waypoints, which this ztunnel does not support yet",
            s.namespace, s.name
        ));
    }
    let at = |e: String| format!("service {}/{}: {e}", s.namespace, s.name);
    let waypoint = s.waypoint.as_ref().map(waypoint).transpose().map_err(at)?;
    let vips = s
        .addresses
        .iter()
        .map(|a| ip(&a.address))
        .collect::<Result<Vec<_>, _>>()
        .map_err(at)?;
    let ports = s
        .ports
        .iter()
        .map(|p| {
            Ok(ServicePort {
                port: port(p.service_port, "service port").map_err(at)?,
                target_port: match p.target_port {
                    0 => None,
                    t => Some(port(t, "target port").map_err(at)?),
                },
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Service {
        name: s.name.clone(),
        namespace: s.namespace.clone(),
        vips,
        ports,
        endpoints: Vec::new(),
        hostname: Some(s.hostname.clone()),
        waypoint,
    })
}

/// Joins the accepted resources into one state. Only resources that
/// passed [`check_address`] are stored, so nothing here can fail.
pub fn to_config(trust_domain: &str, resources: &Resources) -> LocalConfig {
    let mut config = LocalConfig {
        trust_domain: trust_domain.to_owned(),
        ..LocalConfig::default()
    };
    let mut services = Vec::new();
    // Service key (`namespace/hostname`) -> (workload uid, its ports).
    let mut members: HashMap<String, Vec<(String, &xds::PortList)>> = HashMap::new();
    for address in resources.addresses.values() {
        match &address.r#type {
            Some(xds::address::Type::Workload(w)) => {
                let selected: Vec<&str> = w
                    .authorization_policies
                    .iter()
                    .map(String::as_str)
                    .collect();
                if let Ok(converted) = workload(w, &selected) {
                    for (key, ports) in &w.services {
                        members
                            .entry(key.clone())
                            .or_default()
                            .push((w.uid.clone(), ports));
                    }
                    config.workloads.push(converted);
                }
            }
            Some(xds::address::Type::Service(s)) => {
                if let Ok(converted) = service(s) {
                    services.push((format!("{}/{}", s.namespace, s.hostname), converted));
                }
            }
            None => {}
        }
    }
    for (key, mut service) in services {
        let endpoints = members.remove(&key).unwrap_or_default();
        for p in &mut service.ports {
            if p.target_port.is_none() {
                p.target_port = endpoints
                    .iter()
                    .flat_map(|(_, list)| &list.ports)
                    .find(|wp| u32::from(p.port) == wp.service_port && wp.target_port != 0)
                    .and_then(|wp| u16::try_from(wp.target_port).ok());
            }
        }
        service.endpoints = endpoints.into_iter().map(|(uid, _)| uid).collect();
        config.services.push(service);
    }
    config.policies = resources.policies.values().flatten().cloned().collect();
    config
}

/// Converts one `Authorization` resource; `Ok(None)` for a dry run.
pub fn policy(a: &security::Authorization) -> Result<Option<Policy>, String> {
    if a.name.is_empty() || a.namespace.is_empty() {
        return Err("a policy needs name and namespace".into());
    }
    let at = |e: String| format!("policy {}/{}: {e}", a.namespace, a.name);
    let action = match security::Action::try_from(a.action) {
        Ok(security::Action::Allow) => Action::Allow,
        Ok(security::Action::Deny) => Action::Deny,
        Err(_) => return Err(at(format!("unknown action {}", a.action))),
    };
    let (namespace, selector) = match security::Scope::try_from(a.scope) {
        Ok(security::Scope::Global) => (ROOT_NAMESPACE.to_owned(), BTreeMap::new()),
        Ok(security::Scope::Namespace) => (a.namespace.clone(), BTreeMap::new()),
        Ok(security::Scope::WorkloadSelector) => (
            a.namespace.clone(),
            BTreeMap::from([(
                format!("{SELECTED_BY_PREFIX}{}/{}", a.namespace, a.name),
                "true".to_owned(),
            )]),
        ),
        Err(_) => return Err(at(format!("unknown scope {}", a.scope))),
    };
    let rules = a
        .rules
        .iter()
        .map(|r| {
            let clauses = r
                .clauses
                .iter()
                .map(|c| {
                    let any = c
                        .matches
                        .iter()
                        .map(one_match)
                        .collect::<Result<Vec<_>, _>>()?;
                    Ok(Clause { any })
                })
                .collect::<Result<Vec<_>, String>>()?;
            Ok(Rule {
                clauses,
                ..Rule::default()
            })
        })
        .collect::<Result<Vec<_>, String>>()
        .map_err(at)?;
    if a.dry_run {
        return Ok(None);
    }
    Ok(Some(Policy {
        name: a.name.clone(),
        namespace,
        selector,
        action,
        rules,
    }))
}

/// One `Match` (all its fields must hold) as a rule of one source and one
/// operation.
fn one_match(m: &security::Match) -> Result<Rule, String> {
    if !m.destination_ips.is_empty() || !m.not_destination_ips.is_empty() {
        return Err("destination IP matches are not supported yet".into());
    }
    let principals = |list: &[security::StringMatch]| {
        list.iter()
            .map(|s| string_match(s, "spiffe://"))
            .collect::<Result<Vec<_>, _>>()
    };
    let namespaces = |list: &[security::StringMatch]| {
        list.iter()
            .map(|s| string_match(s, ""))
            .collect::<Result<Vec<_>, _>>()
    };
    let accounts = |list: &[security::ServiceAccountMatch]| {
        list.iter()
            .map(|a| format!("*/ns/{}/sa/{}", a.namespace, a.service_account))
            .collect::<Vec<_>>()
    };
    let blocks = |list: &[security::Address]| {
        list.iter()
            .map(|a| {
                let addr = ip(&a.address)?;
                let max = if addr.is_ipv4() { 32 } else { 128 };
                let prefix = u8::try_from(a.length)
                    .ok()
                    .filter(|p| *p <= max)
                    .ok_or_else(|| format!("prefix length {} for {addr}", a.length))?;
                Ok(Cidr { addr, prefix })
            })
            .collect::<Result<Vec<_>, String>>()
    };
    let ports = |list: &[u32]| {
        list.iter()
            .map(|p| port(*p, "destination port"))
            .collect::<Result<Vec<_>, _>>()
    };
    let mut all_principals = principals(&m.principals)?;
    all_principals.extend(accounts(&m.service_accounts));
    let mut not_principals = principals(&m.not_principals)?;
    not_principals.extend(accounts(&m.not_service_accounts));
    let source = Source {
        principals: all_principals,
        not_principals,
        namespaces: namespaces(&m.namespaces)?,
        not_namespaces: namespaces(&m.not_namespaces)?,
        ip_blocks: blocks(&m.source_ips)?,
        not_ip_blocks: blocks(&m.not_source_ips)?,
    };
    let operation = Operation {
        ports: ports(&m.destination_ports)?,
        not_ports: ports(&m.not_destination_ports)?,
    };
    Ok(Rule {
        from: if source == Source::default() {
            Vec::new()
        } else {
            vec![source]
        },
        to: if operation == Operation::default() {
            Vec::new()
        } else {
            vec![operation]
        },
        clauses: Vec::new(),
    })
}

/// A `StringMatch` as one of our `*` patterns; `scheme` is put in front of
/// exact and prefix values (principals arrive without `spiffe://`).
fn string_match(s: &security::StringMatch, scheme: &str) -> Result<String, String> {
    use security::string_match::MatchType;
    match &s.match_type {
        Some(MatchType::Exact(v)) => Ok(format!("{scheme}{v}")),
        Some(MatchType::Prefix(v)) => Ok(format!("{scheme}{v}*")),
        Some(MatchType::Suffix(v)) => Ok(format!("*{v}")),
        Some(MatchType::Presence(())) => Ok("*".into()),
        None => Err("a string match without a value".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        identity::Identity,
        state::{
            MeshState, Route,
            policy::{Peer, Target, authorize},
        },
    };
    use security::string_match::MatchType;

    fn pod(uid: &str, name: &str, ip: [u8; 4], services: &[(&str, u32, u32)]) -> xds::Address {
        xds::Address {
            r#type: Some(xds::address::Type::Workload(xds::Workload {
                uid: uid.into(),
                name: name.into(),
                namespace: "test".into(),
                addresses: vec![ip.to_vec()],
                tunnel_protocol: xds::TunnelProtocol::Hbone as i32,
                trust_domain: "cluster.local".into(),
                service_account: name.into(),
                node: "node-b".into(),
                services: services
                    .iter()
                    .map(|(key, sp, tp)| {
                        (
                            (*key).to_owned(),
                            xds::PortList {
                                ports: vec![xds::Port {
                                    service_port: *sp,
                                    target_port: *tp,
                                    app_protocol: 0,
                                }],
                            },
                        )
                    })
                    .collect(),
                authorization_policies: vec!["test/only-a1".into()],
                ..xds::Workload::default()
            })),
        }
    }

    fn web() -> xds::Address {
        xds::Address {
            r#type: Some(xds::address::Type::Service(xds::Service {
                name: "web".into(),
                namespace: "test".into(),
                hostname: "web.test.svc.cluster.local".into(),
                addresses: vec![xds::NetworkAddress {
                    network: String::new(),
                    address: vec![10, 96, 0, 1],
                    ..xds::NetworkAddress::default()
                }],
                ports: vec![xds::Port {
                    service_port: 80,
                    target_port: 0,
                    app_protocol: 0,
                }],
                ..xds::Service::default()
            })),
        }
    }

    fn exact(v: &str) -> security::StringMatch {
        security::StringMatch {
            match_type: Some(MatchType::Exact(v.into())),
        }
    }

    #[test]
    fn workloads_and_services_become_one_state_with_routes() {
        let mut r = Resources::default();
        r.addresses.insert(
            "Kubernetes//Pod/test/b1".into(),
            pod(
                "Kubernetes//Pod/test/b1",
                "b1",
                [10, 0, 0, 2],
                &[("test/web.test.svc.cluster.local", 80, 8080)],
            ),
        );
        r.addresses
            .insert("test/web.test.svc.cluster.local".into(), web());
        let state = MeshState::new(to_config("cluster.local", &r));
        match state.route("10.96.0.1:80".parse().expect("vip")) {
            Route::Hbone {
                target, identity, ..
            } => {
                assert_eq!(target, "10.0.0.2:8080".parse().expect("target"));
                assert_eq!(identity, Identity::new("cluster.local", "test", "b1"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn waypoints_by_hostname_or_address_route_through_the_waypoint() {
        let mut r = Resources::default();
        let mut b1 = pod(
            "Kubernetes//Pod/test/b1",
            "b1",
            [10, 0, 0, 2],
            &[("test/web.test.svc.cluster.local", 80, 8080)],
        );
        if let Some(xds::address::Type::Workload(w)) = &mut b1.r#type {
            w.waypoint = Some(xds::GatewayAddress {
                destination: Some(xds::gateway_address::Destination::Address(
                    xds::NetworkAddress {
                        address: vec![10, 0, 0, 9],
                        ..xds::NetworkAddress::default()
                    },
                )),
                hbone_mtls_port: 15008,
            });
        }
        let mut web = web();
        if let Some(xds::address::Type::Service(s)) = &mut web.r#type {
            s.waypoint = Some(xds::GatewayAddress {
                destination: Some(xds::gateway_address::Destination::Hostname(
                    xds::NamespacedHostname {
                        namespace: "test".into(),
                        hostname: "wp.test.svc.cluster.local".into(),
                    },
                )),
                hbone_mtls_port: 0,
            });
        }
        let mut wp_svc = self::web();
        if let Some(xds::address::Type::Service(s)) = &mut wp_svc.r#type {
            s.name = "wp".into();
            s.hostname = "wp.test.svc.cluster.local".into();
            s.addresses[0].address = vec![10, 96, 0, 9];
        }
        for a in [
            b1,
            web,
            wp_svc,
            pod(
                "Kubernetes//Pod/test/wp",
                "wp",
                [10, 0, 0, 9],
                &[("test/wp.test.svc.cluster.local", 80, 15008)],
            ),
        ] {
            check_address(&a).expect("valid");
            let key = format!("{}", r.addresses.len());
            r.addresses.insert(key, a);
        }
        let state = MeshState::new(to_config("cluster.local", &r));
        for dst in ["10.96.0.1:80", "10.0.0.2:8080"] {
            match state.route(dst.parse().expect("addr")) {
                Route::Hbone {
                    target,
                    hbone,
                    identity,
                    waypoint: true,
                    ..
                } => {
                    assert_eq!(target, dst.parse().expect("addr"));
                    assert_eq!(hbone, "10.0.0.9:15008".parse().expect("addr"));
                    assert_eq!(identity, Identity::new("cluster.local", "test", "wp"));
                }
                other => panic!("{dst}: {other:?}"),
            }
        }
    }

    #[test]
    fn malformed_or_unsupported_resources_are_refused_by_name() {
        let mut bad = pod("u", "b1", [10, 0, 0, 2], &[]);
        if let Some(xds::address::Type::Workload(w)) = &mut bad.r#type {
            w.addresses = vec![vec![1, 2, 3]];
        }
        let e = check_address(&bad).expect_err("3-byte address");
        assert!(e.contains("test/b1") && e.contains("3 bytes"), "{e}");
        let mut waypoint = web();
        if let Some(xds::address::Type::Service(s)) = &mut waypoint.r#type {
            s.waypoint = Some(xds::GatewayAddress::default());
        }
        let e = check_address(&waypoint).expect_err("waypoint");
        assert!(e.contains("test/web") && e.contains("waypoint"), "{e}");
        assert!(check_address(&xds::Address::default()).is_err());
    }

    fn decide(p: &Policy, id: Option<&str>, labels: &BTreeMap<String, String>) -> bool {
        let identity = id.map(|s| Identity::parse(s).expect("id"));
        let peer = Peer {
            identity: identity.as_ref(),
            ip: "10.0.0.1".parse().expect("ip"),
        };
        let target = Target {
            namespace: "test",
            labels,
            port: 8080,
        };
        authorize(std::slice::from_ref(p), &peer, &target) == crate::state::policy::Decision::Allow
    }

    #[test]
    fn an_istio_allow_policy_selects_its_workloads_and_matches_principals() {
        let a = security::Authorization {
            name: "only-a1".into(),
            namespace: "test".into(),
            scope: security::Scope::WorkloadSelector as i32,
            action: security::Action::Allow as i32,
            rules: vec![security::Rule {
                clauses: vec![
                    security::Clause {
                        matches: vec![security::Match {
                            principals: vec![exact("cluster.local/ns/test/sa/a1")],
                            ..security::Match::default()
                        }],
                    },
                    security::Clause {
                        matches: vec![security::Match {
                            destination_ports: vec![8080],
                            ..security::Match::default()
                        }],
                    },
                ],
            }],
            ..security::Authorization::default()
        };
        let p = policy(&a).expect("valid").expect("enforced");
        let selected =
            BTreeMap::from([(format!("{SELECTED_BY_PREFIX}test/only-a1"), "true".into())]);
        assert!(decide(
            &p,
            Some("spiffe://cluster.local/ns/test/sa/a1"),
            &selected
        ));
        assert!(!decide(
            &p,
            Some("spiffe://cluster.local/ns/test/sa/a2"),
            &selected
        ));
        assert!(!decide(&p, None, &selected));
        // A workload that does not list the policy is not under it.
        assert!(decide(
            &p,
            Some("spiffe://cluster.local/ns/test/sa/a2"),
            &BTreeMap::new()
        ));
    }

    #[test]
    fn istio_strict_mtls_arrives_as_a_deny_without_principal() {
        let a = security::Authorization {
            name: "istio_converted_static_strict".into(),
            namespace: "istio-system".into(),
            scope: security::Scope::Global as i32,
            action: security::Action::Deny as i32,
            rules: vec![security::Rule {
                clauses: vec![security::Clause {
                    matches: vec![security::Match {
                        not_principals: vec![security::StringMatch {
                            match_type: Some(MatchType::Presence(())),
                        }],
                        ..security::Match::default()
                    }],
                }],
            }],
            ..security::Authorization::default()
        };
        let p = policy(&a).expect("valid").expect("enforced");
        let none = BTreeMap::new();
        assert!(!decide(&p, None, &none), "plaintext must be denied");
        assert!(decide(&p, Some("spiffe://cluster.local/ns/x/sa/y"), &none));
    }

    #[test]
    fn bad_policies_are_refused_and_dry_runs_not_enforced() {
        let mut a = security::Authorization {
            name: "p".into(),
            namespace: "test".into(),
            action: 7,
            ..security::Authorization::default()
        };
        assert!(policy(&a).expect_err("action").contains("test/p"));
        a.action = security::Action::Deny as i32;
        a.rules = vec![security::Rule {
            clauses: vec![security::Clause {
                matches: vec![security::Match {
                    destination_ips: vec![security::Address {
                        address: vec![10, 0, 0, 1],
                        length: 32,
                    }],
                    ..security::Match::default()
                }],
            }],
        }];
        assert!(policy(&a).expect_err("dst ip").contains("destination IP"));
        a.rules.clear();
        a.dry_run = true;
        assert_eq!(policy(&a).expect("valid"), None);
    }
}
