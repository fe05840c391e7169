//! Enrolment: which pods ztunnel captures, and the ways to say so.
//!
//! - [`registry`]: the enrolled pods and everything each owns (map entry,
//!   TC attachment, listeners, socket factory). Idempotent enrol/remove and
//!   snapshot reconciliation.
//! - [`addresses`]: which addresses a pod is enrolled with (the mesh
//!   state's, checked against its interfaces once).
//! - [`rollback`]: undoing the steps of an enrolment that failed half way.
//! - [`pod_record`]: the pods `ztunnel-cni` enrolled, kept on the node so
//!   that a restarted ztunnel enrols them again.
//! - [`zds`]: the protobuf messages (Istio's ZDS semantics) and the unix
//!   socket server a CNI plugin or `ztunnel enrol` talks to, with the pod's
//!   netns fd passed as `SCM_RIGHTS`.

pub mod addresses;
pub mod pod_record;
pub mod registry;
mod rollback;
pub mod zds;

pub use registry::{EnrolError, EnrolRequest, PodRegistry, Source};
