//! `cargo xtask layout`: regenerates the link order of the `ztunnel`
//! binary (`ztunnel-userspace/layout/ztunnel.order`) with `zt-layout`.
//!
//! The order names functions by their mangled symbols, which change with
//! the toolchain and the dependency versions (the hash in each name), so it
//! is regenerated when those change; stale names are ignored by the linker
//! and only cost idle memory (`cargo xtask bench` shows it).

use std::{path::Path, process::Command};

use anyhow::{Context as _, Result, bail};

/// The order the build script links with.
const ORDER: &str = "ztunnel-userspace/layout/ztunnel.order";

/// Builds the release binaries, runs `zt-layout` and rebuilds `ztunnel`
/// with the new order.
pub fn run(workspace: &Path) -> Result<()> {
    if !crate::packages::ensure(&[("valgrind", "valgrind")], "to record which functions run") {
        bail!("valgrind is needed (apt-get install valgrind)");
    }
    let bin = crate::binaries::build(workspace, true)?;
    let status = Command::new(bin.join("zt-layout"))
        .current_dir(workspace)
        .arg("--ztunnel")
        .arg(bin.join("ztunnel"))
        .arg("--out")
        .arg(workspace.join(ORDER))
        .status()
        .context("could not run zt-layout")?;
    if !status.success() {
        bail!("zt-layout failed");
    }
    // Link again with the order just written (the build script watches it).
    crate::binaries::build(workspace, true)?;
    Ok(())
}

/// Says whether the release `ztunnel` in `bin` was linked with an order
/// that still names its functions; a stale one is a warning (the binary is
/// correct, only its idle memory grows), shown before every benchmark.
pub fn check(workspace: &Path, bin: &Path) {
    let ok = Command::new(bin.join("zt-layout"))
        .arg("--check")
        .arg("--ztunnel")
        .arg(bin.join("ztunnel"))
        .arg("--out")
        .arg(workspace.join(ORDER))
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!(
            "xtask: warning: the link order is stale; run `cargo xtask layout` (root, valgrind)"
        );
    }
}
