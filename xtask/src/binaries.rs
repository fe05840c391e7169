//! Building the host binaries the demo and the benchmark run.

use std::{path::Path, path::PathBuf, process::Command};

use anyhow::{Context as _, Result, bail};

use crate::ebpf_artifact::target_dir;

/// Builds the eBPF object, `ztunnel` and the tests crate's programs
/// (`zt-probe`, `zt-demo`, `zt-bench`); returns the folder holding them.
pub fn build(workspace: &Path, release: bool) -> Result<PathBuf> {
    crate::ebpf::build(workspace, true)?;
    eprintln!(
        "xtask: building ztunnel and its companion programs{}",
        if release { " (release)" } else { "" }
    );
    let mut cmd = Command::new("cargo");
    cmd.current_dir(workspace).args([
        "build",
        "--quiet",
        "-p",
        "ztunnel-userspace",
        "-p",
        "ztunnel-tests",
        "--bins",
    ]);
    if release {
        cmd.arg("--release");
    }
    if !cmd.status().context("could not run cargo build")?.success() {
        bail!("building ztunnel failed");
    }
    Ok(target_dir(workspace).join(if release { "release" } else { "debug" }))
}
