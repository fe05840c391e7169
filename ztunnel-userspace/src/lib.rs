//! ztunnel-rs: an eBPF-accelerated node proxy for sidecar-less meshes.
//!
//! Components and how data flows between them:
//! - [`probe`] checks the kernel; [`loader`] loads the embedded object (from
//!   `ztunnel-ebpf`) with its maps pinned under [`bpffs`].
//! - [`capture`] attaches the programs: cgroup hooks on the capture cgroup
//!   ([`cgroup`] finds it), TC ingress inside each pod's namespace
//!   ([`netns`] enters it), and reads the kernel counters.
//! - The kernel programs steer an enrolled pod's connections onto ztunnel's
//!   listeners inside that pod; the proxy (later issues) carries them.
//! - [`cni`] is the CNI plugin (`ztunnel-cni`): a separate process that
//!   enrols new pods over the [`enrol`] socket.
//! - [`accept`] is the one accept loop of every listener (back-off on
//!   resource errors) and admits connections against [`limits`].

pub mod accept;
pub mod admin;
pub mod app;
pub mod bpffs;
pub mod capture;
pub mod cgroup;
pub mod cni;
pub mod enrol;
pub mod hbone;
pub mod identity;
pub mod istiod;
pub mod limits;
pub mod loader;
pub mod memory;
pub mod netns;
pub mod probe;
pub mod proto;
pub mod proxy;
pub mod state;
pub mod telemetry;
pub mod timeouts;
pub mod tls;
pub mod xds;
