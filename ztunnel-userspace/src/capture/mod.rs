//! Capture management: attaching the kernel programs, enrolling pods into
//! the maps, and reading the counters.
//!
//! - [`cgroup`]: `connect4`/`connect6`/`sock_ops` on the capture cgroup
//!   (multi-attach links, pinned), and `sk_msg` on the local-leg sockhash.
//! - [`lookup`]: `sk_lookup` in each enrolled pod's network namespace, which
//!   hands new inbound connections to the pod's 15006/15008 listeners.
//! - [`tc`]: the counting-only ingress program on each enrolled pod's `eth0`
//!   (tcx link, pinned; or a clsact filter with our own priority and handle).
//! - [`counters`]: the per-CPU counters, summed.

pub mod cgroup;
pub mod counters;
pub mod iptables;
pub mod lookup;
pub mod maps;
pub mod tc;

use std::{io, path::PathBuf};

/// Which mechanism steers pods' traffic to ztunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Backend {
    /// The eBPF programs (the product).
    #[default]
    Ebpf,
    /// iptables REDIRECT rules inside each pod (fallback and benchmark
    /// baseline).
    Iptables,
    /// Istio's node agent (istio-cni) has put its own rules in each pod
    /// and hands the pods over by ZDS: ztunnel captures nothing itself,
    /// opens the same in-pod listeners and reads `SO_ORIGINAL_DST`.
    IstioCni,
}

impl Backend {
    /// Whether the original destination comes from `SO_ORIGINAL_DST`
    /// (iptables `REDIRECT`, ours or istio-cni's) rather than the eBPF
    /// records.
    pub fn original_dst_from_sockopt(self) -> bool {
        self != Self::Ebpf
    }

    /// Whether ztunnel sets up the reply routing in each pod (istio-cni
    /// brings its own: a connmark and route table 100).
    pub fn owns_pod_routing(self) -> bool {
        self != Self::IstioCni
    }
}

/// Errors of capture management; each names the object at fault.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// A program could not be attached.
    #[error("attaching {program} to {target} failed: {}", error_chain(source))]
    Attach {
        /// The program.
        program: &'static str,
        /// Where it was being attached.
        target: String,
        /// What aya or the kernel said.
        source: aya::programs::ProgramError,
    },
    /// `--tc-mode tcx` on a kernel without tcx (before 6.6).
    #[error(
        "--tc-mode tcx needs Linux 6.6 or newer (tcx links); this kernel is {kernel}. \
         Use --tc-mode auto (the default) or netlink, which attach a clsact filter instead"
    )]
    TcxUnavailable {
        /// The running kernel's release.
        kernel: String,
    },
    /// A link could not be pinned, opened or updated.
    #[error("link {path}: {message}")]
    Link {
        /// The pin path.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A map is missing or has the wrong type.
    #[error("map {name}: {message}")]
    Map {
        /// The map.
        name: &'static str,
        /// What went wrong.
        message: String,
    },
    /// Namespace trouble.
    #[error(transparent)]
    Netns(#[from] crate::netns::NetnsError),
    /// Loader trouble (a program missing from the object).
    #[error(transparent)]
    Loader(#[from] crate::loader::LoaderError),
    /// Opening the cgroup or running `tc` failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: io::Error,
    },
}

/// A pod id as a single, safe path component for pin names: any uid works.
pub fn pin_component(pod_id: &str) -> String {
    pod_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Helper: a map error from anything displayable.
pub(crate) fn map_err(name: &'static str, e: impl std::fmt::Display) -> CaptureError {
    CaptureError::Map {
        name,
        message: e.to_string(),
    }
}

/// An error and its sources on one line: aya's syscall errors keep the OS
/// error (the part an operator needs) in `source()`.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
}
