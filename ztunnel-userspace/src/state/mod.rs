//! What ztunnel knows about the mesh: workloads (and, later, services and
//! policies). In local mode it comes from one YAML file ([`local`]).

pub mod local;
pub mod mesh;
pub mod policy;
pub mod service;
pub mod waypoint;
pub mod workload;

pub use mesh::{MeshState, PodDirectory, PodName, Route, StateHandle};
pub use service::Service;
pub use waypoint::Waypoint;
pub use workload::{CaptureOptOut, Workload, WorkloadProtocol};
