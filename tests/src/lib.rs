//! Test harness for ztunnel's privileged integration tests.
//!
//! It builds small "clusters" out of network namespaces: a fabric namespace
//! holding a bridge, a namespace per node, and a namespace per pod whose
//! `eth0` is a veth into the fabric bridge, each pod with its own cgroup v2
//! directory. Processes run inside a pod (its namespace and its cgroup) with
//! a time bound. Everything carries a unique prefix (`zt-<pid>-<n>`) and is
//! removed on drop, even when the test panics; [`sweep::stale`] removes what
//! a crashed earlier run left behind, and only that.
//!
//! Tests touch only addresses inside namespaces they created (`10.244.0.0/16`
//! and `fd00:10:244::/64` on the fabric bridge).

pub mod ads;
pub mod bpffs;
pub mod cgroup;
pub mod cluster;
pub mod cni;
pub mod flows;
pub mod istiod;
pub mod kernel;
pub mod netns;
pub mod node_agent;
pub mod pattern;
pub mod process;
pub mod raw_tcp;
pub mod skip;
pub mod sniff;
pub mod sweep;
pub mod ztunnel;

pub use cluster::{Cluster, Pod};
pub use skip::require_root;

use std::{
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

/// Prefix of every object any test run creates.
pub const PREFIX: &str = "zt-";

/// A fresh unique prefix for one test: `zt-<pid>-<n>`.
pub fn unique_prefix() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{PREFIX}{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Runs a command, panicking with its output if it fails.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command for cleanup: failures are logged, never panicked on
/// (panicking inside `Drop` while unwinding would abort the test binary).
pub fn run_quiet(cmd: &mut Command) {
    match cmd.output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => eprintln!(
            "cleanup: {cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => eprintln!("cleanup: cannot run {cmd:?}: {e}"),
    }
}

/// Lets this process, and the processes it starts (they inherit it), open
/// `wanted` file descriptors where it may: the hard `RLIMIT_NOFILE` is
/// raised to `wanted` when lower and this process has `CAP_SYS_RESOURCE`
/// (root in the test VMs, whose init leaves the kernel's 4,096; not on
/// every host), and the soft one to the hard one. Returns the hard limit.
pub fn raise_nofile(wanted: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut lim);
        if lim.rlim_max < wanted {
            let raised = libc::rlimit {
                rlim_cur: wanted,
                rlim_max: wanted,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raw const raised) == 0 {
                lim = raised;
            }
        }
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim);
    }
    lim.rlim_max
}

/// A test's volume (bytes of a bulk transfer, connections of a churn):
/// `full` on real hardware, a sixteenth when the CPU is emulated
/// (`ZTUNNEL_TESTS_EMULATED=1`, set by `cargo xtask vm-test` when QEMU runs
/// without KVM), where a gigabyte each way through two TLS proxies or 100k
/// connections outlast any sane time limit. What is checked (every byte
/// checksummed, every connection counted) is the same.
pub fn scaled(full: u64) -> u64 {
    if std::env::var("ZTUNNEL_TESTS_EMULATED").as_deref() == Ok("1") {
        full / 16
    } else {
        full
    }
}

/// How long to wait for ztunnel to do something: `limit` on real
/// hardware, six times it on an emulated CPU (`ZTUNNEL_TESTS_EMULATED=1`),
/// where one `iptables` call can take seconds. Only waits for ztunnel's own
/// progress stretch; a limit that is the behaviour under test (a timeout,
/// a deadline) does not go through here.
pub fn patience(limit: std::time::Duration) -> std::time::Duration {
    if std::env::var("ZTUNNEL_TESTS_EMULATED").as_deref() == Ok("1") {
        limit * 6
    } else {
        limit
    }
}

/// Path of the test helper binary (client/server processes run in pods).
pub fn probe_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // Integration test binaries live in target/<profile>/deps, the helper
    // binaries (and the demo) in target/<profile>.
    let dir = exe.parent().expect("exe dir");
    let bin = if dir.ends_with("deps") {
        dir.parent().expect("target dir").join("zt-probe")
    } else {
        dir.join("zt-probe")
    };
    assert!(
        bin.is_file(),
        "{} missing: build the ztunnel-tests package's binaries",
        bin.display()
    );
    bin
}
