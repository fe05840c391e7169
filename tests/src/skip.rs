//! The one place a privileged test may skip, and how it says so.

use std::io::Write as _;

/// Returns `true` when the test can run. Outside root it prints why it skips
/// and records the skip for `cargo xtask test`'s summary. With `CI=true` a
/// skip is a failure, so it panics instead.
pub fn require_root(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    let reason = "needs root: creates network namespaces, cgroups and loads eBPF programs";
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test}: {reason}; CI=true forbids skipping privileged tests"
    );
    eprintln!("SKIPPED {test}: {reason}");
    if let Some(log) = std::env::var_os("ZTUNNEL_SKIP_LOG")
        && let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
    {
        let _ = writeln!(f, "{test}\t{reason}");
    }
    false
}
