//! Read-only views of kernel state that tests assert on: programs attached
//! to a cgroup (`BPF_PROG_QUERY`) and tcx programs on a pod's interface.

use std::{fs::File, os::fd::AsRawFd as _, path::Path};

use aya::programs::{SchedClassifier, TcAttachType};
use ztunnel::netns::PodNetns;

/// `enum bpf_attach_type` values of the cgroup hooks we use.
pub mod attach_type {
    /// `BPF_CGROUP_SOCK_OPS`.
    pub const SOCK_OPS: u32 = 3;
    /// `BPF_CGROUP_INET4_CONNECT`.
    pub const INET4_CONNECT: u32 = 10;
    /// `BPF_CGROUP_INET6_CONNECT`.
    pub const INET6_CONNECT: u32 = 11;
    /// `BPF_SK_LOOKUP` (queried on a network namespace, not a cgroup).
    pub const SK_LOOKUP: u32 = 36;
}

/// Number of programs attached directly to `cgroup` for `attach_type`
/// (also works on a network namespace's path for [`attach_type::SK_LOOKUP`]).
pub fn cgroup_program_count(cgroup: &Path, attach_type: u32) -> u32 {
    const BPF_PROG_QUERY: libc::c_long = 16;
    #[repr(C)]
    #[derive(Default)]
    struct QueryAttr {
        target_fd: u32,
        attach_type: u32,
        query_flags: u32,
        attach_flags: u32,
        prog_ids: u64,
        prog_cnt: u32,
        _pad: u32,
        prog_attach_flags: u64,
        link_ids: u64,
        link_attach_flags: u64,
        revision: u64,
    }
    let dir = File::open(cgroup).unwrap_or_else(|e| panic!("open {}: {e}", cgroup.display()));
    let mut ids = [0u32; 64];
    let mut attr = QueryAttr {
        target_fd: dir.as_raw_fd() as u32,
        attach_type,
        prog_ids: ids.as_mut_ptr() as u64,
        prog_cnt: ids.len() as u32,
        ..QueryAttr::default()
    };
    // SAFETY: bpf(2) with a valid attr; `ids` outlives the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_QUERY,
            &raw mut attr,
            std::mem::size_of::<QueryAttr>(),
        )
    };
    assert_eq!(
        rc,
        0,
        "BPF_PROG_QUERY failed: {}",
        std::io::Error::last_os_error()
    );
    attr.prog_cnt
}

/// Names of the tcx programs on `eth0` ingress inside the namespace; none
/// on a kernel without tcx (before 6.6), where no tcx link can exist.
pub fn tcx_ingress_programs(netns_path: &Path) -> Vec<String> {
    tcx_programs(netns_path, TcAttachType::Ingress)
}

fn tcx_programs(netns_path: &Path, direction: TcAttachType) -> Vec<String> {
    if !ztunnel::probe::has_tcx() {
        return Vec::new();
    }
    let ns = PodNetns::open(netns_path).expect("open netns");
    ns.run(|| {
        let (_, programs) = SchedClassifier::query_tcx("eth0", direction).expect("query tcx");
        programs
            .iter()
            .map(|p| p.name_as_str().unwrap_or("?").to_owned())
            .collect::<Vec<_>>()
    })
    .expect("enter netns")
}

/// Names of the eBPF programs on `eth0` ingress inside the namespace,
/// however they are attached: tcx links (6.6+) and clsact `bpf` filters
/// (the fallback below 6.6). Tests assert on this so they hold on every
/// kernel we support.
pub fn ingress_programs(netns_path: &Path) -> Vec<String> {
    programs(netns_path, TcAttachType::Ingress, "ingress")
}

/// Like [`ingress_programs`], on `eth0` egress (where `guard_egress` goes).
pub fn egress_programs(netns_path: &Path) -> Vec<String> {
    programs(netns_path, TcAttachType::Egress, "egress")
}

fn programs(netns_path: &Path, direction: TcAttachType, word: &str) -> Vec<String> {
    let mut names = tcx_programs(netns_path, direction);
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net={}", netns_path.display()))
        .args(["tc", "filter", "show", "dev", "eth0", word])
        .output()
        .expect("run nsenter tc filter show");
    names.extend(clsact_bpf_names(&String::from_utf8_lossy(&out.stdout)));
    names
}

/// Program names in `tc filter show` output: the word after `handle 0x..`
/// on `bpf` lines (`... bpf chain 0 handle 0x1 capture_ingress direct-action ...`).
fn clsact_bpf_names(tc_output: &str) -> Vec<String> {
    tc_output
        .lines()
        .filter(|l| l.contains(" bpf "))
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            words.by_ref().find(|w| *w == "handle")?;
            words.next()?;
            let name = words.next()?;
            // A classic-BPF filter has no name: its next word is `flowid`
            // or `bytecode`.
            (!matches!(name, "flowid" | "bytecode" | "classid")).then(|| name.to_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::clsact_bpf_names;

    #[test]
    fn reads_program_names_from_tc_output() {
        let out = "filter protocol all pref 1 bpf chain 0 \n\
                   filter protocol all pref 1 bpf chain 0 handle 0x1 flowid 1:1 bytecode '1,6 0 0 0'\n\
                   filter protocol all pref 49152 bpf chain 0 \n\
                   filter protocol all pref 49152 bpf chain 0 handle 0x1 capture_ingress direct-action not_in_hw id 42 tag 0123 jited\n";
        assert_eq!(clsact_bpf_names(out), vec!["capture_ingress".to_owned()]);
    }
}
