//! L4 authorization (state::policy): policies, peer authentications, a peer
//! and a destination built from fuzzed input, evaluated the way the inbound
//! paths do (`MeshState::authorize_inbound`) and directly.
//!
//! Names, identities and ports are drawn mostly from small pools so that
//! rules and peers meet often; raw strings and numbers are in the mix too.
//! CIDRs go through the same parser as the config file.
//!
//! Asserts: no panic; CIDRs read back from their text; `authorize_inbound`
//! (the mesh state built from a config with these policies) agrees with `mtls_mode` +
//! `authorize`; and Istio's semantics as metamorphic relations: no policy
//! allows; policies that do not apply to the destination change nothing; a
//! catch-all DENY denies; a catch-all ALLOW allows exactly when no DENY
//! matches; the order of policies does not change allow vs deny; an ALLOW
//! on one IP block allows exactly the peers inside it.

#![no_main]

use std::{collections::BTreeMap, net::IpAddr};

use libfuzzer_sys::{
    arbitrary::{self, Arbitrary},
    fuzz_target,
};
use ztunnel::{
    capture::maps::Cidr,
    identity::Identity,
    state::{
        CaptureOptOut, MeshState, Workload, WorkloadProtocol,
        local::LocalConfig,
        policy::{
            Action, Decision, MtlsMode, Operation, Peer, PeerAuthentication, Policy,
            ROOT_NAMESPACE, Rule, Source, Target, authorize, mtls_mode,
        },
    },
};

const TRUST_DOMAIN: &str = "cluster.local";

#[derive(Debug, Clone, Arbitrary)]
enum Name {
    Demo,
    Other,
    Root,
    Web,
    Raw(String),
}

impl Name {
    fn get(&self) -> String {
        match self {
            Self::Demo => "demo".into(),
            Self::Other => "other".into(),
            Self::Root => ROOT_NAMESPACE.into(),
            Self::Web => "web".into(),
            Self::Raw(s) => s.clone(),
        }
    }
}

#[derive(Debug, Clone, Arbitrary)]
struct FuzzIdentity {
    namespace: Name,
    service_account: Name,
}

impl FuzzIdentity {
    /// `None` when the names make no valid SPIFFE id (a peer's identity
    /// comes from its certificate and always parses).
    fn get(&self) -> Option<Identity> {
        let id = Identity::new(
            TRUST_DOMAIN,
            &self.namespace.get(),
            &self.service_account.get(),
        );
        Identity::parse(&id.to_string())
            .ok()
            .filter(|parsed| *parsed == id)
    }

    fn uri(&self) -> String {
        Identity::new(
            TRUST_DOMAIN,
            &self.namespace.get(),
            &self.service_account.get(),
        )
        .to_string()
    }
}

#[derive(Debug, Clone, Arbitrary)]
enum Pattern {
    Any,
    Exact(FuzzIdentity),
    /// The identity cut after this many bytes, then `*`.
    Prefix(FuzzIdentity, u8),
    /// `*`, then the identity from this many bytes on.
    Suffix(FuzzIdentity, u8),
    Raw(String),
}

impl Pattern {
    fn get(&self) -> String {
        let cut = |s: String, at: u8| {
            let at = usize::from(at).min(s.len());
            (
                s.get(..at).unwrap_or("").to_owned(),
                s.get(at..).unwrap_or("").to_owned(),
            )
        };
        match self {
            Self::Any => "*".into(),
            Self::Exact(id) => id.uri(),
            Self::Prefix(id, at) => format!("{}*", cut(id.uri(), *at).0),
            Self::Suffix(id, at) => format!("*{}", cut(id.uri(), *at).1),
            Self::Raw(s) => s.clone(),
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Port {
    Http,
    Alt,
    Raw(u16),
}

impl Port {
    fn get(self) -> u16 {
        match self {
            Self::Http => 80,
            Self::Alt => 8080,
            Self::Raw(p) => p,
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Ip {
    Near(u8),
    Far(u8),
    V6(u8),
    Raw(IpAddr),
}

impl Ip {
    fn get(self) -> IpAddr {
        match self {
            Self::Near(b) => IpAddr::from([10, 0, 0, b]),
            Self::Far(b) => IpAddr::from([10, 1, b, 7]),
            Self::V6(b) => IpAddr::from([0xfd00, 0, 0, 0, 0, 0, 0, u16::from(b)]),
            Self::Raw(ip) => ip,
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
struct FuzzCidr(Ip, u8);

impl FuzzCidr {
    /// Through the config file's parser, which refuses bad prefixes; what
    /// it accepts is shown (config dumps, logs) as text that parses back
    /// to the same block.
    fn get(self) -> Option<Cidr> {
        let cidr: Cidr = format!("{}/{}", self.0.get(), self.1).parse().ok()?;
        assert_eq!(cidr.to_string().parse::<Cidr>().ok(), Some(cidr));
        Some(cidr)
    }
}

#[derive(Debug, Clone, Arbitrary)]
struct FuzzSource {
    principals: Vec<Pattern>,
    not_principals: Vec<Pattern>,
    namespaces: Vec<Name>,
    not_namespaces: Vec<Name>,
    ip_blocks: Vec<FuzzCidr>,
    not_ip_blocks: Vec<FuzzCidr>,
}

#[derive(Debug, Clone, Arbitrary)]
struct FuzzRule {
    from: Vec<FuzzSource>,
    to: Vec<(Vec<Port>, Vec<Port>)>,
}

#[derive(Debug, Clone, Arbitrary)]
struct FuzzPolicy {
    namespace: Name,
    selector: Vec<(Name, Name)>,
    deny: bool,
    rules: Vec<FuzzRule>,
}

#[derive(Debug, Clone, Arbitrary)]
struct FuzzAuth {
    namespace: Name,
    selector: Vec<(Name, Name)>,
    strict: bool,
}

#[derive(Debug, Arbitrary)]
struct Input {
    policies: Vec<FuzzPolicy>,
    auths: Vec<FuzzAuth>,
    peer: Option<FuzzIdentity>,
    peer_ip: Ip,
    namespace: Name,
    labels: Vec<(Name, Name)>,
    port: Port,
    block: FuzzCidr,
}

fn names(list: &[Name]) -> Vec<String> {
    list.iter().map(Name::get).collect()
}

fn cidrs(list: &[FuzzCidr]) -> Vec<Cidr> {
    list.iter().filter_map(|c| c.get()).collect()
}

fn labels(list: &[(Name, Name)]) -> BTreeMap<String, String> {
    list.iter().map(|(k, v)| (k.get(), v.get())).collect()
}

fn policy(i: usize, p: &FuzzPolicy) -> Policy {
    Policy {
        name: format!("p{i}"),
        namespace: p.namespace.get(),
        selector: labels(&p.selector),
        action: if p.deny { Action::Deny } else { Action::Allow },
        rules: p
            .rules
            .iter()
            .map(|r| Rule {
                from: r
                    .from
                    .iter()
                    .map(|s| Source {
                        principals: s.principals.iter().map(Pattern::get).collect(),
                        not_principals: s.not_principals.iter().map(Pattern::get).collect(),
                        namespaces: names(&s.namespaces),
                        not_namespaces: names(&s.not_namespaces),
                        ip_blocks: cidrs(&s.ip_blocks),
                        not_ip_blocks: cidrs(&s.not_ip_blocks),
                    })
                    .collect(),
                to: r
                    .to
                    .iter()
                    .map(|(ports, not_ports)| Operation {
                        ports: ports.iter().map(|p| p.get()).collect(),
                        not_ports: not_ports.iter().map(|p| p.get()).collect(),
                    })
                    .collect(),
                clauses: Vec::new(),
            })
            .collect(),
    }
}

/// Istio's scope rule, written out independently of the matcher.
fn applies(p: &Policy, target: &Target<'_>) -> bool {
    (p.namespace == ROOT_NAMESPACE || p.namespace == target.namespace)
        && p.selector
            .iter()
            .all(|(k, v)| target.labels.get(k) == Some(v))
}

fn catch_all(name: &str, namespace: &str, action: Action) -> Policy {
    Policy {
        name: name.into(),
        namespace: namespace.into(),
        selector: BTreeMap::new(),
        action,
        rules: vec![Rule::default()],
    }
}

/// Whether `ip` is inside `c`, by comparing bits one at a time.
fn inside(c: Cidr, ip: IpAddr) -> bool {
    let bits = |ip: IpAddr| -> Vec<bool> {
        let bytes = match ip {
            IpAddr::V4(v4) => v4.octets().to_vec(),
            IpAddr::V6(v6) => v6.octets().to_vec(),
        };
        bytes
            .iter()
            .flat_map(|b| (0..8).rev().map(move |i| b >> i & 1 == 1))
            .collect()
    };
    c.addr.is_ipv4() == ip.is_ipv4()
        && bits(c.addr)[..usize::from(c.prefix)] == bits(ip)[..usize::from(c.prefix)]
}

fn allowed(d: &Decision) -> bool {
    *d == Decision::Allow
}

fuzz_target!(|input: Input| {
    let policies: Vec<Policy> = input
        .policies
        .iter()
        .enumerate()
        .map(|(i, p)| policy(i, p))
        .collect();
    let auths: Vec<PeerAuthentication> = input
        .auths
        .iter()
        .map(|a| PeerAuthentication {
            namespace: a.namespace.get(),
            selector: labels(&a.selector),
            mode: if a.strict {
                MtlsMode::Strict
            } else {
                MtlsMode::Permissive
            },
        })
        .collect();
    let identity = input.peer.as_ref().and_then(FuzzIdentity::get);
    let peer = Peer {
        identity: identity.as_ref(),
        ip: input.peer_ip.get(),
    };
    let namespace = input.namespace.get();
    let target_labels = labels(&input.labels);
    let port = input.port.get();
    let target = Target {
        namespace: &namespace,
        labels: &target_labels,
        port,
    };

    let decision = authorize(&policies, &peer, &target);
    let mode = mtls_mode(&auths, &target);

    // The production path of an inbound connection: the mesh state built
    // from a config holding these policies and the destination workload.
    // (That policies survive the config file unchanged is config_yaml's
    // round trip; YAML here would cost nine in ten executions.)
    let workload = Workload {
        uid: "target".into(),
        name: "target".into(),
        namespace: namespace.clone(),
        service_account: "target".into(),
        node: "node-a".into(),
        ips: vec![IpAddr::from([10, 9, 9, 9])],
        netns: None,
        protocol: WorkloadProtocol::Hbone,
        capture: CaptureOptOut::default(),
        labels: target_labels.clone(),
        trust_domain: None,
        workload_name: None,
        canonical_name: None,
        canonical_revision: None,
        cluster_id: None,
        waypoint: None,
    };
    let config = LocalConfig {
        workloads: vec![workload],
        policies: policies.clone(),
        peer_authentications: auths.clone(),
        ..LocalConfig::default()
    };
    let state = MeshState::new(config);
    let inbound = state.authorize_inbound("target", &peer, port);
    let expected = !(identity.is_none() && mode == MtlsMode::Strict) && allowed(&decision);
    assert_eq!(
        inbound.is_ok(),
        expected,
        "{inbound:?} vs {mode:?} {decision:?}"
    );

    // No policy allows.
    assert!(allowed(&authorize(&[], &peer, &target)));
    if auths.is_empty() {
        assert_eq!(mode, MtlsMode::Permissive);
    }

    // Policies that do not apply change nothing, reasons included.
    let applicable: Vec<Policy> = policies
        .iter()
        .filter(|p| applies(p, &target))
        .cloned()
        .collect();
    assert_eq!(authorize(&applicable, &peer, &target), decision);
    if let Decision::Deny(reason) = &decision {
        assert!(
            !applicable.is_empty(),
            "denied by no applicable policy: {reason}"
        );
    }

    // A catch-all DENY on the destination denies.
    let mut with_deny = policies.clone();
    with_deny.push(catch_all("deny-all", &namespace, Action::Deny));
    assert!(!allowed(&authorize(&with_deny, &peer, &target)));

    // A catch-all ALLOW allows exactly when no DENY matches.
    let denies: Vec<Policy> = policies
        .iter()
        .filter(|p| p.action == Action::Deny)
        .cloned()
        .collect();
    let mut with_allow = policies.clone();
    with_allow.push(catch_all("allow-all", ROOT_NAMESPACE, Action::Allow));
    assert_eq!(
        allowed(&authorize(&with_allow, &peer, &target)),
        allowed(&authorize(&denies, &peer, &target))
    );

    // Order does not decide allow vs deny.
    let mut reversed = policies.clone();
    reversed.reverse();
    assert_eq!(
        allowed(&authorize(&reversed, &peer, &target)),
        allowed(&decision)
    );

    // One ALLOW on one IP block: exactly the peers inside it.
    if let Some(block) = input.block.get() {
        let mut only = catch_all("block", &namespace, Action::Allow);
        only.rules[0].from = vec![Source {
            ip_blocks: vec![block],
            ..Source::default()
        }];
        assert_eq!(
            allowed(&authorize(&[only], &peer, &target)),
            inside(block, peer.ip),
            "{block} vs {}",
            peer.ip
        );
    }

    // A pod whose workload is unknown is refused, whatever the policies.
    let unknown = state.authorize_inbound("unknown", &peer, port);
    assert_eq!(
        unknown.map_err(|(label, _)| label),
        Err("workload_unknown".to_owned())
    );
});
