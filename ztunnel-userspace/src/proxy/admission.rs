//! Inbound admission, in one place.
//!
//! Three paths deliver a connection to an enrolled pod's application:
//! plaintext on the pod's 15006, a `CONNECT` stream on its 15008, and the
//! same-node fast path of a client pod on this node. Each asks [`admit`],
//! which registers the connection (so a later policy reaches it), waits
//! for the pod's workload (bounded), and decides with [`decide`]: who the
//! peer is (plaintext never has an identity), whether the pod's policies
//! let it in, and what the access log and metrics say about both ends.
//! A denial is counted and logged here; the callers only give their
//! transport's answer (a reset, a 401 or 503, a refused connect).
//!
//! A rule about who may reach a pod is written here once, and the table
//! of cases in the tests below covers every arrival path.

use std::net::SocketAddr;

use super::{
    Shared,
    connections::{InboundConnection, Registration},
};
use crate::{
    identity::Identity,
    limits::ConnectionPermit,
    state::{MeshState, policy::Peer},
    telemetry::{self, Endpoint, connection::ServiceRef},
};

/// How a connection reached the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Plaintext on 15006.
    Plaintext,
    /// A `CONNECT` stream on 15008 (mutual TLS).
    Hbone,
    /// The same-node fast path from a client pod's 15001.
    SameNode,
}

impl Arrival {
    /// The `path` of log lines and of the open-connections registry.
    pub fn path(self) -> &'static str {
        match self {
            Self::Plaintext => "plaintext",
            Self::Hbone => "hbone",
            Self::SameNode => "local",
        }
    }

    /// The direction a denial is reported under: a same-node connection
    /// is the client pod's outbound one (its record is an outbound
    /// record).
    pub fn direction(self) -> &'static str {
        match self {
            Self::Plaintext | Self::Hbone => "inbound",
            Self::SameNode => "outbound",
        }
    }
}

/// What is asked of the destination pod.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The path it came by.
    pub arrival: Arrival,
    /// The destination pod (enrolled on this node).
    pub pod: &'a str,
    /// Its identity.
    pub pod_identity: &'a Identity,
    /// The client's address.
    pub peer: SocketAddr,
    /// The client's verified identity (ignored for plaintext).
    pub peer_identity: Option<&'a Identity>,
    /// The address the client asked for (its port is what policies match).
    pub target: SocketAddr,
    /// The service the client says it addressed (HBONE's `Forwarded`
    /// host), believed only if the pod is behind it.
    pub named_service: Option<&'a str>,
}

/// Why a connection is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// The pod cannot be served now: its workload is unknown, or it is at
    /// its connection limit.
    Unavailable,
    /// The pod's policies refuse this peer.
    Policy,
}

/// A refused connection: the policy (or rule) that refused it, why, and
/// both ends as the access log shows them.
#[derive(Debug, Clone)]
pub struct Denied {
    /// Which kind of refusal.
    pub kind: RefusalKind,
    /// The policy label (`workload_unknown`, `mtls_strict`, a DENY
    /// policy's name, `no_allow_match`, `pod_connections`, ...).
    pub policy: String,
    /// A sentence for the log.
    pub reason: String,
    /// The client.
    pub src: Endpoint,
    /// The destination.
    pub dst: Endpoint,
}

/// An admitted connection's ends, for its record.
#[derive(Debug, Clone)]
pub struct Allowed {
    /// The client (its identity only if verified).
    pub src: Endpoint,
    /// The destination pod.
    pub dst: Endpoint,
    /// The service the connection was addressed to, if known.
    pub service: Option<ServiceRef>,
}

/// The decision on `state`, without I/O.
pub fn decide(state: &MeshState, req: &Request<'_>) -> Result<Allowed, Box<Denied>> {
    // Plaintext carries no identity, whatever holds the client's address:
    // it would only be claimed (as in Istio's ztunnel).
    let peer_identity = match req.arrival {
        Arrival::Plaintext => None,
        Arrival::Hbone | Arrival::SameNode => req.peer_identity,
    };
    let src = Endpoint {
        identity: peer_identity.map(ToString::to_string),
        ..state.endpoint(req.peer)
    };
    let dst = Endpoint {
        identity: Some(req.pod_identity.to_string()),
        ..state.endpoint(req.target)
    };
    let who = Peer {
        identity: peer_identity,
        ip: req.peer.ip(),
    };
    match state.authorize_inbound(req.pod, &who, req.target.port()) {
        Ok(()) => Ok(Allowed {
            service: state
                .inbound_service(req.pod, req.target.port(), req.named_service)
                .map(ServiceRef::from),
            src,
            dst,
        }),
        Err((policy, reason)) => Err(Box::new(Denied {
            kind: if policy == "workload_unknown" {
                RefusalKind::Unavailable
            } else {
                RefusalKind::Policy
            },
            policy,
            reason,
            src,
            dst,
        })),
    }
}

/// An admitted connection: its registration among the open inbound
/// connections (it is closed if a later policy denies it), its ends, and
/// for the same-node path its place in the destination pod's limits.
#[derive(Debug)]
pub struct Admitted {
    /// Held while the connection is open.
    pub registration: Registration,
    /// Both ends and the service.
    pub allowed: Allowed,
    /// The destination pod's connection place (same-node path only: the
    /// other paths were counted where they were accepted).
    pub permit: Option<ConnectionPermit>,
}

/// Admits a connection to an enrolled pod, or refuses it (counted and
/// logged). Waits at most `state::mesh::WORKLOAD_WAIT` for the pod's
/// workload.
pub async fn admit(shared: &Shared, req: Request<'_>) -> Result<Admitted, Box<Denied>> {
    // A same-node connection enters the destination pod like one arriving
    // on its 15006: it counts against the pod's and the node's connection
    // limits (counted and logged by the limit).
    let permit = if req.arrival == Arrival::SameNode {
        let Some(permit) = shared
            .limits
            .pod(req.pod)
            .admit(crate::limits::Side::Inbound)
        else {
            let state = shared.state.current();
            return Err(Box::new(Denied {
                kind: RefusalKind::Unavailable,
                policy: crate::limits::Limit::PodConnections.as_str().to_owned(),
                reason: "the destination pod or the node is at its connection limit".into(),
                src: state.endpoint(req.peer),
                dst: state.endpoint(req.target),
            }));
        };
        Some(permit)
    } else {
        None
    };
    // Registered before the state is read: a policy published from here on
    // reaches this connection (see `connections`).
    let registration = shared.connections.register(InboundConnection {
        pod: req.pod.to_owned(),
        pod_identity: req.pod_identity.clone(),
        peer_identity: match req.arrival {
            Arrival::Plaintext => None,
            Arrival::Hbone | Arrival::SameNode => req.peer_identity.cloned(),
        },
        src: req.peer,
        dst: req.target,
        path: req.arrival.path(),
    });
    let state = shared
        .state
        .current_for(req.pod, crate::state::mesh::WORKLOAD_WAIT)
        .await;
    match decide(&state, &req) {
        Ok(allowed) => Ok(Admitted {
            registration,
            allowed,
            permit,
        }),
        Err(denied) => {
            telemetry::connection::denied(
                &shared.metrics,
                &denied.src,
                &denied.dst,
                req.arrival.direction(),
                &denied.policy,
                &denied.reason,
            );
            Err(denied)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::local::parse;

    const MESH: &str = "
workloads:
  - {uid: app, name: app, namespace: demo, node: n1, ips: [10.0.0.1], labels: {app: strict}}
  - {uid: open, name: open, namespace: demo, node: n1, ips: [10.0.0.2], labels: {app: open}}
  - {uid: client, name: client, namespace: demo, node: n1, ips: [10.0.0.3], serviceAccount: client}
peerAuthentications:
  - {namespace: demo, selector: {app: strict}, mode: STRICT}
policies:
  - {name: no-client, namespace: demo, action: DENY, selector: {app: open}, rules: [{from: [{principals: [cluster.local/ns/demo/sa/client]}]}]}
";

    fn state(text: &str) -> MeshState {
        MeshState::new(parse(text, std::path::Path::new("t")).expect("valid"))
    }

    fn id(sa: &str) -> Identity {
        Identity {
            trust_domain: "cluster.local".into(),
            namespace: "demo".into(),
            service_account: sa.into(),
        }
    }

    fn ask<'a>(
        arrival: Arrival,
        pod: &'a str,
        pod_identity: &'a Identity,
        peer_identity: Option<&'a Identity>,
    ) -> Request<'a> {
        Request {
            arrival,
            pod,
            pod_identity,
            peer: "10.0.0.3:40000".parse().expect("addr"),
            peer_identity,
            target: "10.0.0.1:8080".parse().expect("addr"),
            named_service: None,
        }
    }

    /// (arrival, pod, its identity, the peer's identity, the refusing
    /// policy or `None` when allowed)
    type Case<'a> = (
        Arrival,
        &'a str,
        &'a Identity,
        Option<&'a Identity>,
        Option<&'a str>,
    );

    #[test]
    fn every_arrival_path_gets_the_same_answer() {
        let mesh = state(MESH);
        let (app, open, client, stranger) = (id("app"), id("open"), id("client"), id("x"));
        let cases: &[Case<'_>] = &[
            // STRICT: plaintext is refused, mTLS peers are let in.
            (Arrival::Plaintext, "app", &app, None, Some("mtls_strict")),
            // A plaintext caller cannot bring an identity along.
            (
                Arrival::Plaintext,
                "app",
                &app,
                Some(&client),
                Some("mtls_strict"),
            ),
            (Arrival::Hbone, "app", &app, Some(&client), None),
            (Arrival::SameNode, "app", &app, Some(&client), None),
            // DENY by principal, on every path that has one.
            (
                Arrival::Hbone,
                "open",
                &open,
                Some(&client),
                Some("demo/no-client"),
            ),
            (
                Arrival::SameNode,
                "open",
                &open,
                Some(&client),
                Some("demo/no-client"),
            ),
            (Arrival::Hbone, "open", &open, Some(&stranger), None),
            (Arrival::Plaintext, "open", &open, None, None),
            // An enrolled pod whose workload is unknown gets nothing.
            (
                Arrival::Plaintext,
                "ghost",
                &stranger,
                None,
                Some("workload_unknown"),
            ),
            (
                Arrival::Hbone,
                "ghost",
                &stranger,
                Some(&client),
                Some("workload_unknown"),
            ),
            (
                Arrival::SameNode,
                "ghost",
                &stranger,
                Some(&client),
                Some("workload_unknown"),
            ),
        ];
        for (arrival, pod, pod_identity, peer_identity, refused) in cases {
            let got = decide(&mesh, &ask(*arrival, pod, pod_identity, *peer_identity));
            match (refused, got) {
                (None, Ok(allowed)) => {
                    assert_eq!(
                        allowed.src.identity,
                        peer_identity.map(ToString::to_string),
                        "{arrival:?} {pod}"
                    );
                    assert_eq!(allowed.dst.identity, Some(pod_identity.to_string()));
                }
                (Some(policy), Err(denied)) => {
                    assert_eq!(denied.policy, *policy, "{arrival:?} {pod}");
                    assert_eq!(
                        denied.kind == RefusalKind::Unavailable,
                        *policy == "workload_unknown",
                        "{arrival:?} {pod}"
                    );
                    if *arrival == Arrival::Plaintext {
                        assert_eq!(denied.src.identity, None, "plaintext has no identity");
                    }
                }
                (want, got) => panic!("{arrival:?} to {pod}: wanted {want:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn paths_name_themselves_and_their_direction() {
        assert_eq!(Arrival::Plaintext.path(), "plaintext");
        assert_eq!(Arrival::Hbone.path(), "hbone");
        assert_eq!(Arrival::SameNode.path(), "local");
        assert_eq!(Arrival::SameNode.direction(), "outbound");
        assert_eq!(Arrival::Hbone.direction(), "inbound");
    }
}
