//! L4 authorization with Istio's semantics, and per-workload mTLS mode.
//!
//! ```yaml
//! policies:
//!   - name: only-frontend
//!     namespace: demo            # "istio-system" (the root namespace) = whole mesh
//!     selector: {app: web}       # optional; without it: every workload of the namespace
//!     action: ALLOW              # or DENY
//!     rules:
//!       - from: [{principals: ["spiffe://cluster.local/ns/demo/sa/frontend"]}]
//!         to: [{ports: [8080]}]
//! peerAuthentications:
//!   - {namespace: demo, selector: {app: web}, mode: STRICT}   # or PERMISSIVE (default)
//! ```
//!
//! - A rule matches when every part it has matches: `from` (any of its
//!   sources) and `to` (any of its operations). A source matches when all
//!   of its fields do: `principals`/`notPrincipals` (SPIFFE ids, or in
//!   Istio's form `td/ns/NS/sa/SA` without `spiffe://`; `*` and
//!   prefix/suffix `*` allowed), `namespaces`/`notNamespaces`,
//!   `ipBlocks`/`notIpBlocks`. An operation matches on `ports`/`notPorts`.
//!   A rule with neither part matches everything.
//! - Evaluation: any matching DENY policy denies. Otherwise, if ALLOW
//!   policies apply to the workload, one of them must match. With no
//!   policy, traffic is allowed. (An ALLOW policy without rules matches
//!   nothing, so it denies everything, as in Istio.)
//! - Plaintext connections (port 15006) have no principal and no
//!   namespace: rules on those never match them. `STRICT` mTLS refuses them
//!   outright.
//! - Policy is evaluated when a connection opens, and again for every open
//!   connection whenever the mesh state changes: like Istio's ztunnel, a
//!   connection the new policy denies is closed (a DENY added to stop a
//!   workload must stop what it already holds open, too). The open
//!   connections are tracked in `proxy::connections`.

use std::{collections::BTreeMap, net::IpAddr};

use serde::Deserialize;

use crate::{capture::maps::Cidr, identity::Identity};

/// Istio's root namespace: a policy there applies to the whole mesh.
pub const ROOT_NAMESPACE: &str = "istio-system";

/// ALLOW or DENY.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Action {
    /// Traffic must match one ALLOW policy (when any applies).
    Allow,
    /// Matching traffic is refused.
    Deny,
}

/// One source clause.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Source {
    /// SPIFFE ids (`*`, `prefix*`, `*suffix` allowed).
    #[serde(default)]
    pub principals: Vec<String>,
    /// Negated principals.
    #[serde(default)]
    pub not_principals: Vec<String>,
    /// Source namespaces (from the peer's identity).
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// Negated namespaces.
    #[serde(default)]
    pub not_namespaces: Vec<String>,
    /// Source address blocks.
    #[serde(default, deserialize_with = "cidrs", serialize_with = "show_cidrs")]
    pub ip_blocks: Vec<Cidr>,
    /// Negated address blocks.
    #[serde(default, deserialize_with = "cidrs", serialize_with = "show_cidrs")]
    pub not_ip_blocks: Vec<Cidr>,
}

/// One operation clause.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Operation {
    /// Destination ports.
    #[serde(default)]
    pub ports: Vec<u16>,
    /// Negated destination ports.
    #[serde(default)]
    pub not_ports: Vec<u16>,
}

/// A rule: `from` and `to`, and `clauses`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Sources (any may match).
    #[serde(default)]
    pub from: Vec<Source>,
    /// Operations (any may match).
    #[serde(default)]
    pub to: Vec<Operation>,
    /// Istio's general form, as xDS delivers it: every clause must match,
    /// and a clause matches when any of its rules does. `from`/`to` are the
    /// common case of two clauses; a policy written by hand rarely needs
    /// this.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clauses: Vec<Clause>,
}

/// One clause of [`Rule::clauses`]: any of its rules.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Clause {
    /// Alternatives (any may match).
    pub any: Vec<Rule>,
}

/// An authorization policy.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Policy {
    /// Name (reported when it denies).
    pub name: String,
    /// Namespace it lives in ([`ROOT_NAMESPACE`] = mesh-wide).
    pub namespace: String,
    /// Label selector (`matchLabels`); empty = every workload in scope.
    #[serde(default)]
    pub selector: BTreeMap<String, String>,
    /// ALLOW or DENY.
    pub action: Action,
    /// Rules.
    #[serde(default)]
    pub rules: Vec<Rule>,
}

/// mTLS modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, serde::Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum MtlsMode {
    /// Plaintext accepted (with no identity).
    #[default]
    Permissive,
    /// Plaintext refused.
    Strict,
}

/// A peer authentication (mTLS mode) for a namespace or selected workloads.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct PeerAuthentication {
    /// Namespace ([`ROOT_NAMESPACE`] = mesh-wide).
    pub namespace: String,
    /// Label selector; empty = the whole namespace.
    #[serde(default)]
    pub selector: BTreeMap<String, String>,
    /// The mode.
    pub mode: MtlsMode,
}

fn cidrs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Cidr>, D::Error> {
    let raw: Vec<String> = Vec::deserialize(d)?;
    raw.iter()
        .map(|s| s.parse().map_err(serde::de::Error::custom))
        .collect()
}

fn show_cidrs<S: serde::Serializer>(cidrs: &[Cidr], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(cidrs.iter().map(ToString::to_string))
}

/// Who is connecting, as far as the destination side knows.
#[derive(Debug, Clone)]
pub struct Peer<'a> {
    /// Verified identity; `None` for plaintext.
    pub identity: Option<&'a Identity>,
    /// Source address.
    pub ip: IpAddr,
}

/// The destination workload.
#[derive(Debug, Clone)]
pub struct Target<'a> {
    /// Its namespace.
    pub namespace: &'a str,
    /// Its labels.
    pub labels: &'a BTreeMap<String, String>,
    /// Destination port.
    pub port: u16,
}

/// The outcome of [`authorize`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Allowed.
    Allow,
    /// Denied, with the reason (naming the policy).
    Deny(String),
}

fn applies(namespace: &str, selector: &BTreeMap<String, String>, target: &Target<'_>) -> bool {
    (namespace == ROOT_NAMESPACE || namespace == target.namespace)
        && selector
            .iter()
            .all(|(k, v)| target.labels.get(k) == Some(v))
}

/// Whether `id` (a SPIFFE id) matches a principal `pattern`, written as a
/// SPIFFE id or in Istio's form without the scheme.
fn principal_matches(pattern: &str, id: &str) -> bool {
    let id = if pattern.starts_with("spiffe://") || pattern.starts_with('*') {
        id
    } else {
        id.strip_prefix("spiffe://").unwrap_or(id)
    };
    glob_matches(pattern, id)
}

/// `*`, `prefix*`, `*suffix` or an exact value.
fn glob_matches(pattern: &str, id: &str) -> bool {
    if pattern == "*" {
        true
    } else if let Some(prefix) = pattern.strip_suffix('*') {
        id.starts_with(prefix)
    } else if let Some(suffix) = pattern.strip_prefix('*') {
        id.ends_with(suffix)
    } else {
        pattern == id
    }
}

fn in_cidrs(cidrs: &[Cidr], ip: IpAddr) -> bool {
    cidrs.iter().any(|c| cidr_contains(c, ip))
}

fn cidr_contains(c: &Cidr, ip: IpAddr) -> bool {
    match (c.addr, ip) {
        (IpAddr::V4(net), IpAddr::V4(ip)) => {
            let bits = u32::from(c.prefix);
            let mask = if bits == 0 {
                0
            } else {
                u32::MAX << (32 - bits)
            };
            u32::from(net) & mask == u32::from(ip) & mask
        }
        (IpAddr::V6(net), IpAddr::V6(ip)) => {
            let bits = u32::from(c.prefix);
            let mask = if bits == 0 {
                0
            } else {
                u128::MAX << (128 - bits)
            };
            u128::from(net) & mask == u128::from(ip) & mask
        }
        _ => false,
    }
}

impl Source {
    fn matches(&self, peer: &Peer<'_>) -> bool {
        let id = peer.identity.map(ToString::to_string);
        let ns = peer.identity.map(|i| i.namespace.as_str());
        let any = |list: &[String], value: Option<&str>, f: fn(&str, &str) -> bool| {
            value.is_some_and(|v| list.iter().any(|p| f(p, v)))
        };
        // Namespaces take the same `*` patterns as principals (Istio's
        // prefix/suffix/presence matches arrive that way from xDS).
        (self.principals.is_empty() || any(&self.principals, id.as_deref(), principal_matches))
            && !any(&self.not_principals, id.as_deref(), principal_matches)
            && (self.namespaces.is_empty() || any(&self.namespaces, ns, glob_matches))
            && !any(&self.not_namespaces, ns, glob_matches)
            && (self.ip_blocks.is_empty() || in_cidrs(&self.ip_blocks, peer.ip))
            && !in_cidrs(&self.not_ip_blocks, peer.ip)
    }
}

impl Operation {
    fn matches(&self, port: u16) -> bool {
        (self.ports.is_empty() || self.ports.contains(&port)) && !self.not_ports.contains(&port)
    }
}

impl Rule {
    fn matches(&self, peer: &Peer<'_>, port: u16) -> bool {
        (self.from.is_empty() || self.from.iter().any(|s| s.matches(peer)))
            && (self.to.is_empty() || self.to.iter().any(|o| o.matches(port)))
            && self
                .clauses
                .iter()
                .all(|c| c.any.iter().any(|r| r.matches(peer, port)))
    }
}

impl Policy {
    fn matches(&self, peer: &Peer<'_>, port: u16) -> bool {
        self.rules.iter().any(|r| r.matches(peer, port))
    }
}

/// Decides whether `peer` may connect to `target`.
pub fn authorize(policies: &[Policy], peer: &Peer<'_>, target: &Target<'_>) -> Decision {
    let applicable: Vec<&Policy> = policies
        .iter()
        .filter(|p| applies(&p.namespace, &p.selector, target))
        .collect();
    if let Some(deny) = applicable
        .iter()
        .find(|p| p.action == Action::Deny && p.matches(peer, target.port))
    {
        return Decision::Deny(format!(
            "denied by DENY policy {}/{}",
            deny.namespace, deny.name
        ));
    }
    let allows: Vec<&&Policy> = applicable
        .iter()
        .filter(|p| p.action == Action::Allow)
        .collect();
    if allows.is_empty() || allows.iter().any(|p| p.matches(peer, target.port)) {
        Decision::Allow
    } else {
        let names: Vec<String> = allows
            .iter()
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect();
        Decision::Deny(format!(
            "no ALLOW policy matched (applicable: {})",
            names.join(", ")
        ))
    }
}

/// The mTLS mode of `target`: the most specific peer authentication wins
/// (workload selector over namespace over mesh-wide).
pub fn mtls_mode(auths: &[PeerAuthentication], target: &Target<'_>) -> MtlsMode {
    let rank = |a: &PeerAuthentication| {
        if !a.selector.is_empty() {
            3
        } else if a.namespace == ROOT_NAMESPACE {
            1
        } else {
            2
        }
    };
    auths
        .iter()
        .filter(|a| applies(&a.namespace, &a.selector, target))
        .max_by_key(|a| rank(a))
        .map_or(MtlsMode::Permissive, |a| a.mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policies(yaml: &str) -> Vec<Policy> {
        serde_yaml::from_str(yaml).expect("policies")
    }

    fn check(ps: &[Policy], id: Option<&str>, ip: &str, port: u16) -> bool {
        let identity = id.map(|s| Identity::parse(s).expect("id"));
        let labels = BTreeMap::from([("app".to_owned(), "web".to_owned())]);
        let peer = Peer {
            identity: identity.as_ref(),
            ip: ip.parse().expect("ip"),
        };
        let target = Target {
            namespace: "demo",
            labels: &labels,
            port,
        };
        authorize(ps, &peer, &target) == Decision::Allow
    }

    const A: &str = "spiffe://cluster.local/ns/demo/sa/a";
    const B: &str = "spiffe://cluster.local/ns/other/sa/b";

    #[test]
    fn no_policy_allows() {
        assert!(check(&[], Some(A), "10.0.0.1", 80));
        assert!(check(&[], None, "10.0.0.1", 80));
    }

    #[test]
    fn match_kinds_and_negations() {
        let p = |rule: &str| {
            policies(&format!(
                "- {{name: p, namespace: demo, action: ALLOW, rules: [{rule}]}}"
            ))
        };
        let principal = p(&format!("{{from: [{{principals: [\"{A}\"]}}]}}"));
        assert!(check(&principal, Some(A), "10.0.0.1", 80));
        assert!(!check(&principal, Some(B), "10.0.0.1", 80));
        assert!(!check(&principal, None, "10.0.0.1", 80));
        let not_principal = p(&format!("{{from: [{{notPrincipals: [\"{A}\"]}}]}}"));
        assert!(!check(&not_principal, Some(A), "10.0.0.1", 80));
        assert!(check(&not_principal, Some(B), "10.0.0.1", 80));
        let ns = p("{from: [{namespaces: [other]}]}");
        assert!(check(&ns, Some(B), "10.0.0.1", 80));
        assert!(!check(&ns, Some(A), "10.0.0.1", 80));
        let not_ns = p("{from: [{notNamespaces: [other]}]}");
        assert!(check(&not_ns, Some(A), "10.0.0.1", 80));
        assert!(!check(&not_ns, Some(B), "10.0.0.1", 80));
        let ip = p("{from: [{ipBlocks: [10.0.0.0/24]}]}");
        assert!(check(&ip, None, "10.0.0.7", 80));
        assert!(!check(&ip, None, "10.0.1.7", 80));
        let not_ip = p("{from: [{notIpBlocks: [10.0.0.0/24]}]}");
        assert!(!check(&not_ip, None, "10.0.0.7", 80));
        let ports = p("{to: [{ports: [8080]}]}");
        assert!(check(&ports, None, "10.0.0.7", 8080));
        assert!(!check(&ports, None, "10.0.0.7", 80));
        let not_ports = p("{to: [{notPorts: [8080]}]}");
        assert!(!check(&not_ports, None, "10.0.0.7", 8080));
        let wildcard = p("{from: [{principals: [\"spiffe://cluster.local/ns/demo/*\"]}]}");
        assert!(check(&wildcard, Some(A), "10.0.0.1", 80));
        // Istio's form, without the scheme, exact and as a prefix.
        let istio = p(&format!(
            "{{from: [{{principals: [\"{}\"]}}]}}",
            A.trim_start_matches("spiffe://")
        ));
        assert!(check(&istio, Some(A), "10.0.0.1", 80));
        assert!(!check(&istio, Some(B), "10.0.0.1", 80));
        let istio_prefix = p("{from: [{principals: [\"cluster.local/ns/demo/*\"]}]}");
        assert!(check(&istio_prefix, Some(A), "10.0.0.1", 80));
    }

    #[test]
    fn deny_wins_over_allow_and_scoping_works() {
        let ps = policies(&format!(
            "- {{name: allow-all, namespace: demo, action: ALLOW, rules: [{{}}]}}\n\
             - {{name: no-b, namespace: istio-system, action: DENY, rules: [{{from: [{{principals: [\"{B}\"]}}]}}]}}\n\
             - {{name: elsewhere, namespace: prod, action: DENY, rules: [{{}}]}}\n\
             - {{name: other-app, namespace: demo, selector: {{app: db}}, action: DENY, rules: [{{}}]}}"
        ));
        assert!(check(&ps, Some(A), "10.0.0.1", 80));
        assert!(!check(&ps, Some(B), "10.0.0.1", 80));
        // A workload without the `app: db` label in `demo` is not hit by the
        // selector-scoped DENY, and `prod`'s DENY does not reach `demo`.
        let labels = BTreeMap::new();
        let a = Identity::parse(A).expect("id");
        let peer = Peer {
            identity: Some(&a),
            ip: "10.0.0.1".parse().expect("ip"),
        };
        assert_eq!(
            authorize(
                &ps,
                &peer,
                &Target {
                    namespace: "demo",
                    labels: &labels,
                    port: 1
                }
            ),
            Decision::Allow
        );
        let denied = authorize(
            &ps,
            &peer,
            &Target {
                namespace: "prod",
                labels: &labels,
                port: 1,
            },
        );
        assert_eq!(
            denied,
            Decision::Deny("denied by DENY policy prod/elsewhere".into())
        );
        let ps = policies("- {name: empty, namespace: demo, action: ALLOW}");
        assert!(
            !check(&ps, Some(A), "10.0.0.1", 80),
            "ALLOW without rules denies"
        );
    }

    #[test]
    fn the_most_specific_mtls_mode_wins() {
        let auths: Vec<PeerAuthentication> = serde_yaml::from_str(
            "- {namespace: istio-system, mode: STRICT}\n- {namespace: demo, mode: PERMISSIVE}\n- {namespace: demo, selector: {app: web}, mode: STRICT}",
        )
        .expect("auths");
        let web = BTreeMap::from([("app".to_owned(), "web".to_owned())]);
        let db = BTreeMap::from([("app".to_owned(), "db".to_owned())]);
        assert_eq!(
            mtls_mode(
                &auths,
                &Target {
                    namespace: "demo",
                    labels: &web,
                    port: 1
                }
            ),
            MtlsMode::Strict
        );
        assert_eq!(
            mtls_mode(
                &auths,
                &Target {
                    namespace: "demo",
                    labels: &db,
                    port: 1
                }
            ),
            MtlsMode::Permissive
        );
        assert_eq!(
            mtls_mode(
                &auths,
                &Target {
                    namespace: "prod",
                    labels: &db,
                    port: 1
                }
            ),
            MtlsMode::Strict
        );
    }
}
