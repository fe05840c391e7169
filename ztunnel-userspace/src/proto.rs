//! The wire contracts shared with Istio, generated at build time from the
//! `.proto` files in `proto/` (Istio's and Envoy's package names and field
//! numbers; `build.rs` compiles them with protox and tonic-prost-build).
//!
//! - [`zds`]: enrolment (`istio.workload.zds`), spoken with istio-cni and
//!   ztunnel-cni over the enrolment socket.
//! - [`istio_ca`]: istiod's certificate service (`istio.v1.auth`): the
//!   client ztunnel calls, and the server trait the tests' fake istiod
//!   implements.
//! - [`istio::workload`] and [`istio::security`]: the resources istiod
//!   pushes over xDS (workloads and services; authorization policies).
//! - [`envoy::service::discovery::v3`], with [`envoy::config::core::v3`]
//!   and [`google::rpc`]: the delta ADS stream that carries them.
//!
//! Packages that refer to each other are nested like their package names,
//! because prost writes those references as relative `super::` paths.

/// Package `istio.workload.zds`.
#[allow(clippy::pedantic, missing_docs)]
pub mod zds {
    include!(concat!(env!("OUT_DIR"), "/istio.workload.zds.rs"));
}

/// Package `istio.v1.auth`.
#[allow(clippy::pedantic, missing_docs)]
pub mod istio_ca {
    include!(concat!(env!("OUT_DIR"), "/istio.v1.auth.rs"));
}

/// Packages `istio.workload` and `istio.security` (xDS resources).
///
/// `Address` holds a `Workload` or a `Service` unboxed, as prost generates
/// it; the size difference is fine for a message decoded once per push.
#[allow(clippy::pedantic, clippy::large_enum_variant, missing_docs)]
pub mod istio {
    /// Package `istio.workload`: `Address` (a `Workload` or a `Service`),
    /// type URL `type.googleapis.com/istio.workload.Address`.
    pub mod workload {
        include!(concat!(env!("OUT_DIR"), "/istio.workload.rs"));
    }

    /// Package `istio.security`: `Authorization`, type URL
    /// `type.googleapis.com/istio.security.Authorization`.
    pub mod security {
        include!(concat!(env!("OUT_DIR"), "/istio.security.rs"));
    }
}

/// Envoy's xDS packages (the delta ADS subset ztunnel speaks).
#[allow(clippy::pedantic, missing_docs)]
pub mod envoy {
    /// `envoy.config.*`.
    pub mod config {
        /// `envoy.config.core.*`.
        pub mod core {
            /// Package `envoy.config.core.v3`: `Node`.
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.config.core.v3.rs"));
            }
        }
    }

    /// `envoy.service.*`.
    pub mod service {
        /// `envoy.service.discovery.*`.
        pub mod discovery {
            /// Package `envoy.service.discovery.v3`: the delta messages and
            /// `AggregatedDiscoveryService` (client and server).
            pub mod v3 {
                include!(concat!(env!("OUT_DIR"), "/envoy.service.discovery.v3.rs"));
            }
        }
    }
}

/// Google's RPC packages.
#[allow(clippy::pedantic, missing_docs)]
pub mod google {
    /// Package `google.rpc`: `Status`, the NACK detail.
    pub mod rpc {
        include!(concat!(env!("OUT_DIR"), "/google.rpc.rs"));
    }
}

#[cfg(test)]
mod tests {
    //! Golden bytes written by hand from the field numbers (tag byte =
    //! field number << 3 | wire type; 0 varint, 2 length-delimited), so a
    //! renumbered field in a `.proto` fails here instead of on istiod.

    use prost::Message;

    use super::envoy::config::core::v3::Node;
    use super::envoy::service::discovery::v3::DeltaDiscoveryRequest;
    use super::google::rpc::Status;
    use super::istio::security::{
        self, Action, Authorization, Clause, Rule, Scope, StringMatch, string_match::MatchType,
    };
    use super::istio::workload::{Address, TunnelProtocol, Workload, address};

    #[test]
    fn proto_workload_address_decodes_from_istio_field_numbers() {
        #[rustfmt::skip]
        let wire: &[u8] = &[
            0x0a, 34,                             // Address.workload (1), 34 bytes
            0xa2, 0x01, 2, b'u', b'1',            // uid (20): tag 162 as a two-byte varint
            0x0a, 3, b'w', b'e', b'b',            // name (1)
            0x12, 2, b'n', b's',                  // namespace (2)
            0x1a, 4, 10, 0, 0, 5,                 // addresses (3): 10.0.0.5
            0x28, 1,                              // tunnel_protocol (5): HBONE
            0x32, 2, b't', b'd',                  // trust_domain (6)
            0x3a, 2, b's', b'a',                  // service_account (7)
            0x4a, 2, b'n', b'1',                  // node (9)
        ];
        let decoded = Address::decode(wire).expect("valid Address");
        let expected = Address {
            r#type: Some(address::Type::Workload(Workload {
                uid: "u1".into(),
                name: "web".into(),
                namespace: "ns".into(),
                addresses: vec![vec![10, 0, 0, 5]],
                tunnel_protocol: TunnelProtocol::Hbone as i32,
                trust_domain: "td".into(),
                service_account: "sa".into(),
                node: "n1".into(),
                ..Default::default()
            })),
        };
        assert_eq!(decoded, expected);
    }

    #[test]
    fn proto_authorization_decodes_from_istio_field_numbers() {
        #[rustfmt::skip]
        let wire: &[u8] = &[
            0x0a, 1, b'p',                        // name (1)
            0x12, 2, b'n', b's',                  // namespace (2)
            0x18, 1,                              // scope (3): NAMESPACE
            0x20, 1,                              // action (4): DENY
            0x2a, 20,                             // rules (5), 20 bytes
            0x0a, 18,                             //   Rule.clauses (1), 18 bytes
            0x12, 16,                             //     Clause.matches (2), 16 bytes
            0x1a, 14,                             //       Match.principals (3), 14 bytes
            0x0a, 12,                             //         StringMatch.exact (1), 12 bytes
            b't', b'd', b'/', b'n', b's', b'/', b'x', b'/', b's', b'a', b'/', b'y',
        ];
        let decoded = Authorization::decode(wire).expect("valid Authorization");
        let expected = Authorization {
            name: "p".into(),
            namespace: "ns".into(),
            scope: Scope::Namespace as i32,
            action: Action::Deny as i32,
            rules: vec![Rule {
                clauses: vec![Clause {
                    matches: vec![security::Match {
                        principals: vec![StringMatch {
                            match_type: Some(MatchType::Exact("td/ns/x/sa/y".into())),
                        }],
                        ..Default::default()
                    }],
                }],
            }],
            ..Default::default()
        };
        assert_eq!(decoded, expected);
    }

    #[test]
    fn proto_delta_request_encodes_to_envoy_field_numbers() {
        let request = DeltaDiscoveryRequest {
            node: Some(Node {
                id: "z".into(),
                ..Default::default()
            }),
            type_url: "type.googleapis.com/istio.workload.Address".into(),
            response_nonce: "n1".into(),
            error_detail: Some(Status {
                code: 3,
                message: "bad".into(),
                details: Vec::new(),
            }),
            ..Default::default()
        };
        let mut wire = Vec::new();
        // node (1), 3 bytes: Node.id (1) = "z"
        wire.extend_from_slice(&[0x0a, 3, 0x0a, 1, b'z']);
        // type_url (2), 42 bytes
        wire.extend_from_slice(&[0x12, 42]);
        wire.extend_from_slice(b"type.googleapis.com/istio.workload.Address");
        // response_nonce (6)
        wire.extend_from_slice(&[0x32, 2, b'n', b'1']);
        // error_detail (7), 7 bytes: Status.code (1) = 3, Status.message (2) = "bad"
        wire.extend_from_slice(&[0x3a, 7, 0x08, 3, 0x12, 3, b'b', b'a', b'd']);

        assert_eq!(request.encode_to_vec(), wire);
        assert_eq!(
            DeltaDiscoveryRequest::decode(wire.as_slice()).expect("valid request"),
            request
        );
    }

    /// Never run: it only has to compile, proving tonic generated the ADS
    /// client and server with the expected names.
    #[allow(dead_code)]
    fn proto_ads_service_is_generated() {
        use super::envoy::service::discovery::v3::{
            aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
            aggregated_discovery_service_server::{
                AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
            },
        };
        fn server<S: AggregatedDiscoveryService>(s: S) -> AggregatedDiscoveryServiceServer<S> {
            AggregatedDiscoveryServiceServer::new(s)
        }
        let _ = AggregatedDiscoveryServiceClient::<tonic::transport::Channel>::new;
    }
}
