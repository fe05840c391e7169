//! `cargo xtask demo`: builds everything, then runs `zt-demo` (the demo
//! lives in the tests crate, next to the namespace harness it uses; xtask
//! cannot depend on it because that crate embeds the eBPF object that xtask
//! itself builds).

use std::{path::Path, process::Command};

use anyhow::{Context as _, Result, bail};

/// Options of `cargo xtask demo`.
#[derive(clap::Args)]
pub struct DemoArgs {
    /// Print one JSON object at the end, after the human output.
    #[arg(long)]
    json: bool,
    /// Leave the cluster running and print how to poke at it.
    #[arg(long)]
    keep: bool,
    /// Remove a cluster left by `--keep`.
    #[arg(long)]
    clean: bool,
    /// Where the mesh comes from: `local` (the YAML file) or `xds` (the
    /// same YAML served by a fake istiod over delta ADS, with its CA).
    #[arg(long, default_value = "local", value_parser = ["local", "xds"])]
    control_plane: String,
}

/// Builds and runs the demo.
pub fn run(workspace: &Path, args: &DemoArgs) -> Result<()> {
    if !nix_is_root() {
        bail!(
            "the demo needs root: it creates network namespaces and cgroups and loads eBPF programs (try sudo)"
        );
    }
    let demo = crate::binaries::build(workspace, false)?.join("zt-demo");
    let mut cmd = Command::new(&demo);
    for (on, flag) in [
        (args.json, "--json"),
        (args.keep, "--keep"),
        (args.clean, "--clean"),
    ] {
        if on {
            cmd.arg(flag);
        }
    }
    cmd.args(["--control-plane", &args.control_plane]);
    let status = cmd
        .status()
        .with_context(|| format!("could not run {}", demo.display()))?;
    if !status.success() {
        bail!("the demo reported flows that did not behave as expected");
    }
    Ok(())
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}
