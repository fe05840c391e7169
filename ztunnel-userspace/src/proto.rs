//! The wire contracts shared with Istio, generated at build time from the
//! `.proto` files in `proto/` (Istio's package names and field numbers;
//! `build.rs` compiles them with protox and tonic-prost-build).
//!
//! - [`zds`]: enrolment (`istio.workload.zds`), spoken with istio-cni and
//!   ztunnel-cni over the enrolment socket.
//! - [`istio_ca`]: istiod's certificate service (`istio.v1.auth`): the
//!   client ztunnel calls, and the server trait the tests' fake istiod
//!   implements.

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
