//! `cargo xtask build-ebpf`: the one builder of the kernel object.

use std::{fs, path::Path, process::Command, time::Instant};

use anyhow::{Context as _, Result, bail};

use crate::{
    ebpf_artifact::{Artifact, input_hash, target_dir},
    toolchain,
};

/// eBPF target triple (little-endian BPF).
const TARGET: &str = "bpfel-unknown-none";

/// Builds `ztunnel-ebpf` (if its inputs changed) and places the object where
/// `ztunnel-userspace`'s build script embeds it from.
pub fn build(workspace: &Path, release: bool) -> Result<()> {
    let started = Instant::now();
    let nightly = toolchain::nightly()?;
    toolchain::ensure_rust_src(&nightly)?;
    let target = target_dir(workspace);
    let linker_dir = toolchain::ensure_bpf_linker(&nightly, &target)?;

    let artifact = Artifact::locate(workspace);
    let profile = if release { "release" } else { "dev" };
    let stamp = input_hash(workspace);
    let profile_stamp = artifact.stamp.with_extension("profile");
    if artifact.check_current(workspace).is_ok()
        && fs::read_to_string(&profile_stamp).is_ok_and(|p| p.trim() == profile)
    {
        eprintln!(
            "xtask: eBPF object up to date ({})",
            artifact.object.display()
        );
        return Ok(());
    }

    let path = std::env::join_paths(std::iter::once(linker_dir.clone()).chain(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
    ))?;
    // A target dir of its own: the eBPF build uses another toolchain and
    // std, and must never contend for the host build's lock.
    let ebpf_target = target.join("ebpf-build");
    let mut cmd = Command::new("cargo");
    cmd.current_dir(workspace)
        .args([
            "+nightly",
            "build",
            "--package",
            "ztunnel-ebpf",
            "--target",
            TARGET,
        ])
        .args(["-Z", "build-std=core"])
        .arg("--target-dir")
        .arg(&ebpf_target)
        .env("PATH", path)
        // BTF for readable verifier logs; the linker is found on PATH.
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            ["-Cdebuginfo=2", "-Clink-arg=--btf"].join("\x1f"),
        )
        .env_remove("RUSTFLAGS")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("RUSTUP_TOOLCHAIN");
    if release {
        cmd.arg("--release");
    }
    let status = cmd.status().context("could not run cargo +nightly build")?;
    if !status.success() {
        bail!("building ztunnel-ebpf failed (see the compiler output above)");
    }

    let dir = if release { "release" } else { "debug" };
    let built = ebpf_target.join(TARGET).join(dir).join("ztunnel-ebpf");
    let out_dir = artifact.object.parent().context("artifact has no parent")?;
    fs::create_dir_all(out_dir)?;
    fs::copy(&built, &artifact.object).with_context(|| {
        format!(
            "cannot copy {} to {}",
            built.display(),
            artifact.object.display()
        )
    })?;
    fs::write(&artifact.stamp, &stamp)?;
    fs::write(&profile_stamp, profile)?;
    eprintln!(
        "xtask: built {} ({profile}) in {:.1?}",
        artifact.object.display(),
        started.elapsed()
    );
    Ok(())
}
