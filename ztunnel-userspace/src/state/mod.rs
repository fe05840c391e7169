//! What ztunnel knows about the mesh: workloads (and, later, services and
//! policies). In local mode it comes from one YAML file ([`local`]).

pub mod local;
pub mod workload;

pub use workload::{CaptureOptOut, Workload, WorkloadProtocol};
