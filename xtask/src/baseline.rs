//! The baseline of `cargo xtask bench --baseline REV`: REV checked out in
//! a worktree of its own and built there, so its `ztunnel` can run next to
//! the working tree's in one benchmark.
//!
//! - Worktree: `target/bench-baseline/<full sha>` (`git worktree add
//!   --detach`), reused while it still holds that commit.
//! - Target dir: `target/bench-baseline/target`, shared by every baseline
//!   and never the main one, so an A/B run does not evict the working
//!   tree's build cache. ztunnel embeds its eBPF object at compile time
//!   (`include_bytes!` of `<target>/ebpf/ztunnel-ebpf.o`, found through
//!   `CARGO_TARGET_DIR`), so building REV's object with REV's own xtask
//!   into that target dir is what makes the baseline binary carry REV's
//!   kernel programs. The bpf-linker cache is the main target's (the same
//!   nightly needs the same linker).
//! - Binary: copied to `target/bench-baseline/ztunnel-<sha>`, so the
//!   shared target dir may move on to another baseline.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::ebpf_artifact::target_dir;

/// A built baseline.
pub struct Baseline {
    /// Its `ztunnel` binary.
    pub ztunnel: PathBuf,
    /// The short commit, for the report.
    pub label: String,
}

fn git(dir: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .current_dir(dir)
        .args(args)
        .output()
        .context("could not run git")?;
    if !out.status.success() {
        bail!(
            "git {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Resolves `rev`, prepares its worktree and builds its `ztunnel`.
pub fn build(workspace: &Path, rev: &str) -> Result<Baseline> {
    let sha = git(
        workspace,
        &["rev-parse", "--verify", &format!("{rev}^{{commit}}")],
    )
    .with_context(|| format!("--baseline {rev}: not a commit"))?;
    let label = git(workspace, &["rev-parse", "--short", &sha])?;
    let root = target_dir(workspace).join("bench-baseline");
    let tree = root.join(&sha);
    prepare_worktree(workspace, &tree, &sha)?;
    let target = root.join("target");
    eprintln!(
        "xtask: building the baseline {label} ({rev}) in {} (target dir {})",
        tree.display(),
        target.display()
    );
    let linker_cache = crate::toolchain::linker_cache(&target_dir(workspace));
    let cargo = |args: &[&str], what: &str| -> Result<()> {
        let status = Command::new("cargo")
            .current_dir(&tree)
            .args(args)
            .env("CARGO_TARGET_DIR", &target)
            .env("ZTUNNEL_BPF_LINKER_CACHE", &linker_cache)
            .status()
            .with_context(|| format!("could not run cargo for {what}"))?;
        if !status.success() {
            bail!("{what} of the baseline {label} failed (see above)");
        }
        Ok(())
    };
    cargo(&["xtask", "build-ebpf"], "the eBPF build")?;
    cargo(
        &[
            "build",
            "--quiet",
            "--release",
            "-p",
            "ztunnel-userspace",
            "--bin",
            "ztunnel",
        ],
        "the release build",
    )?;
    let ztunnel = root.join(format!("ztunnel-{sha}"));
    std::fs::copy(target.join("release").join("ztunnel"), &ztunnel)
        .with_context(|| format!("copying the baseline binary to {}", ztunnel.display()))?;
    Ok(Baseline { ztunnel, label })
}

/// `tree` checked out at `sha`: reused when it already is, else created.
fn prepare_worktree(workspace: &Path, tree: &Path, sha: &str) -> Result<()> {
    if tree.exists() {
        // The folder lies inside the main checkout: a folder that is no
        // worktree would answer with the main checkout's top and HEAD.
        let top = git(tree, &["rev-parse", "--show-toplevel"]).unwrap_or_default();
        let head = git(tree, &["rev-parse", "HEAD"]).unwrap_or_default();
        if Path::new(&top).canonicalize().ok() == tree.canonicalize().ok() && head == sha {
            eprintln!("xtask: reusing the baseline worktree {}", tree.display());
            return Ok(());
        }
        bail!(
            "{} exists but is not a worktree at {sha}: remove it (`git worktree remove --force {}`) \
             and run again",
            tree.display(),
            tree.display()
        );
    }
    // A worktree folder removed by hand stays registered until pruned, and
    // a registered path cannot be added again.
    git(workspace, &["worktree", "prune"])?;
    let path = tree.to_str().context("worktree path is not UTF-8")?;
    git(workspace, &["worktree", "add", "--detach", path, sha])?;
    Ok(())
}
