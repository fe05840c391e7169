//! Kernel feature probes, run before anything is loaded, so that a kernel
//! without a hook we need produces one clear error instead of a verifier or
//! attach failure halfway through start-up.

use std::path::Path;

use aya::{
    maps::MapType,
    programs::ProgramType,
    sys::{is_map_supported, is_program_supported},
};

/// Where the kernel exposes its own BTF.
pub const KERNEL_BTF: &str = "/sys/kernel/btf/vmlinux";

/// A hook or map type the kernel lacks, and what it costs us.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingHook {
    /// The kernel facility, as the kernel names it.
    pub hook: &'static str,
    /// What ztunnel cannot do without it.
    pub why: &'static str,
}

/// Why ztunnel cannot run its kernel side on this machine.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// Loading programs and entering namespaces needs root.
    #[error(
        "ztunnel must run as root (effective uid is {0}): loading eBPF programs, attaching them \
         to cgroups and interfaces and entering pod network namespaces need CAP_BPF, \
         CAP_NET_ADMIN and CAP_SYS_ADMIN"
    )]
    NotRoot(u32),
    /// The kernel was built without BTF.
    #[error(
        "the kernel has no BTF ({KERNEL_BTF} is missing; it needs CONFIG_DEBUG_INFO_BTF=y): \
         ztunnel requires it so that its programs' types are checked against this kernel's \
         and so that verifier errors can be reported with source lines"
    )]
    NoBtf,
    /// One or more hooks are missing.
    #[error("the kernel lacks hooks ztunnel needs:{}", list(.0))]
    HookUnsupported(Vec<MissingHook>),
}

fn list(missing: &[MissingHook]) -> String {
    use std::fmt::Write as _;
    missing.iter().fold(String::new(), |mut out, m| {
        let _ = write!(out, "\n  - {}: {}", m.hook, m.why);
        out
    })
}

/// Program types ztunnel loads, with the reason each matters.
const PROGRAMS: &[(ProgramType, &str, &str)] = &[
    (
        ProgramType::CgroupSockAddr,
        "BPF_PROG_TYPE_CGROUP_SOCK_ADDR (cgroup/connect4, cgroup/connect6)",
        "outbound capture: pods' connect() calls cannot be redirected to ztunnel",
    ),
    (
        ProgramType::SockOps,
        "BPF_PROG_TYPE_SOCK_OPS",
        "the original destination of captured connections cannot be recorded",
    ),
    (
        ProgramType::SkLookup,
        "BPF_PROG_TYPE_SK_LOOKUP (kernel >= 5.9; ingress_ifindex >= 5.17)",
        "inbound capture: connections to pods cannot be steered to ztunnel at socket lookup",
    ),
    (
        ProgramType::SchedClassifier,
        "BPF_PROG_TYPE_SCHED_CLS (TC ingress)",
        "inbound packet counters (fragments, IPv6 extension headers) are unavailable",
    ),
    (
        ProgramType::SkMsg,
        "BPF_PROG_TYPE_SK_MSG",
        "sockmap acceleration of pod-local legs is unavailable",
    ),
];

/// Map types ztunnel creates, with the reason each matters.
const MAPS: &[(MapType, &str, &str)] = &[
    (
        MapType::LpmTrie,
        "BPF_MAP_TYPE_LPM_TRIE",
        "CIDR exclusions cannot be expressed",
    ),
    (
        MapType::SockHash,
        "BPF_MAP_TYPE_SOCKHASH",
        "sockmap acceleration of pod-local legs is unavailable",
    ),
    (
        MapType::LruHash,
        "BPF_MAP_TYPE_LRU_HASH",
        "sockmap acceleration cannot remember which directions must stay on TCP",
    ),
    (
        MapType::SkStorage,
        "BPF_MAP_TYPE_SK_STORAGE",
        "the original destination of a captured socket cannot live as long as the socket",
    ),
];

/// Runs every probe and reports all problems of the first kind found.
pub fn check_kernel() -> Result<(), ProbeError> {
    let euid = nix::unistd::geteuid().as_raw();
    if euid != 0 {
        return Err(ProbeError::NotRoot(euid));
    }
    if !Path::new(KERNEL_BTF).exists() {
        return Err(ProbeError::NoBtf);
    }
    let mut missing = Vec::new();
    if aya::util::KernelVersion::current()
        .is_ok_and(|v| v < aya::util::KernelVersion::new(MIN_KERNEL.0, MIN_KERNEL.1, 0))
    {
        missing.push(MissingHook {
            hook: "sk_lookup ingress_ifindex (kernel >= 5.17)",
            why: "inbound capture cannot tell traffic from outside the pod from its loopback",
        });
    }
    for (ty, hook, why) in PROGRAMS {
        if !is_program_supported(*ty).unwrap_or(false) {
            missing.push(MissingHook { hook, why });
        }
    }
    for (ty, hook, why) in MAPS {
        if !is_map_supported(*ty).unwrap_or(false) {
            missing.push(MissingHook { hook, why });
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(ProbeError::HookUnsupported(missing))
    }
}

/// The oldest kernel whose `sk_lookup` context has `ingress_ifindex`, which
/// `capture_lookup` needs to tell traffic from outside the pod from the
/// pod's own loopback traffic.
pub const MIN_KERNEL: (u8, u8) = (5, 17);

/// Whether tcx links (kernel >= 6.6) are available; otherwise TC programs are
/// attached as clsact filters.
pub fn has_tcx() -> bool {
    aya::util::KernelVersion::current().is_ok_and(|v| v >= aya::util::KernelVersion::new(6, 6, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_hooks_are_listed_one_per_line_with_reasons() {
        let err = ProbeError::HookUnsupported(vec![
            MissingHook {
                hook: "A",
                why: "a is needed",
            },
            MissingHook {
                hook: "B",
                why: "b is needed",
            },
        ]);
        let text = err.to_string();
        assert!(text.contains("\n  - A: a is needed"), "{text}");
        assert!(text.contains("\n  - B: b is needed"), "{text}");
    }

    #[test]
    fn not_root_and_no_btf_are_distinct_messages() {
        let a = ProbeError::NotRoot(1000).to_string();
        let b = ProbeError::NoBtf.to_string();
        assert!(a.contains("root") && a.contains("1000"), "{a}");
        assert!(b.contains("BTF") && b.contains(KERNEL_BTF), "{b}");
        assert_ne!(a, b);
    }
}
