//! Prepares what building eBPF needs on a fresh machine: the nightly
//! toolchain's `rust-src`, and a `bpf-linker` built against the nightly
//! toolchain's own libLLVM (so its LLVM is exactly rustc's).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

/// bpf-linker release known to build and link with LLVM 21-23 here.
const BPF_LINKER_VERSION: &str = "0.13.0";

/// Facts about the nightly toolchain that the linker must match.
pub struct Nightly {
    /// `rustc +nightly --print sysroot`.
    pub sysroot: PathBuf,
    /// LLVM major version rustc uses (`LLVM version: N.x`).
    pub llvm_major: u32,
    /// First 12 hex digits of rustc's commit: a new nightly gets a new linker.
    pub commit: String,
}

/// Runs `cmd` and returns its stdout, or an error naming the command.
fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("could not run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Checks the nightly toolchain exists and reads its sysroot and LLVM.
pub fn nightly() -> Result<Nightly> {
    let version = output(Command::new("rustc").args(["+nightly", "-vV"])).map_err(|e| {
        anyhow::anyhow!(
            "the nightly Rust toolchain is missing (needed to build eBPF with \
             -Z build-std): install it with `rustup toolchain install nightly \
             --component rust-src` ({e})"
        )
    })?;
    let field = |name: &str| {
        version
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .map(str::to_owned)
    };
    let llvm = field("LLVM version:").context("`rustc +nightly -vV` printed no LLVM version")?;
    let llvm_major = llvm
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .with_context(|| format!("unparsable LLVM version {llvm:?}"))?;
    let commit = field("commit-hash:").unwrap_or_else(|| "unknown".into());
    let sysroot = PathBuf::from(
        output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?.trim(),
    );
    Ok(Nightly {
        sysroot,
        llvm_major,
        commit: commit.chars().take(12).collect(),
    })
}

/// Adds `rust-src` to nightly if it is not there yet.
pub fn ensure_rust_src(nightly: &Nightly) -> Result<()> {
    let marker = nightly
        .sysroot
        .join("lib/rustlib/src/rust/library/core/Cargo.toml");
    if marker.is_file() {
        return Ok(());
    }
    eprintln!("xtask: adding the nightly `rust-src` component (needed for -Z build-std=core)");
    let status = Command::new("rustup")
        .args(["+nightly", "component", "add", "rust-src"])
        .status()
        .context(
            "could not run rustup: install rustup, then `rustup +nightly component add rust-src`",
        )?;
    if !status.success() {
        bail!(
            "`rustup +nightly component add rust-src` failed (is the rustup distribution server reachable?)"
        );
    }
    Ok(())
}

/// Cache folder for built linkers: `$ZTUNNEL_BPF_LINKER_CACHE`, else
/// `<target>/bpf-linker`. Each nightly gets its own sub-folder.
pub fn linker_cache(target: &Path) -> PathBuf {
    std::env::var_os("ZTUNNEL_BPF_LINKER_CACHE")
        .filter(|v| !v.is_empty())
        .map_or_else(|| target.join("bpf-linker"), PathBuf::from)
}

/// Returns the folder holding a usable `bpf-linker`, building one if needed.
/// `$BPF_LINKER` (a path to the binary) overrides everything.
pub fn ensure_bpf_linker(nightly: &Nightly, target: &Path) -> Result<PathBuf> {
    if let Some(explicit) = std::env::var_os("BPF_LINKER").filter(|v| !v.is_empty()) {
        let path = PathBuf::from(explicit);
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        if !path.is_file() {
            bail!("BPF_LINKER={} does not exist", path.display());
        }
        return Ok(dir);
    }
    let root = linker_cache(target).join(format!("llvm-{}-{}", nightly.llvm_major, nightly.commit));
    let bin = root.join("bin");
    if bin.join("bpf-linker").is_file()
        && Command::new(bin.join("bpf-linker"))
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    {
        return Ok(bin);
    }
    build_bpf_linker(nightly, &root)?;
    Ok(bin)
}

fn build_bpf_linker(nightly: &Nightly, root: &Path) -> Result<()> {
    let lib = nightly.sysroot.join("lib");
    let libllvm = fs::read_dir(&lib)
        .with_context(|| format!("cannot list {}", lib.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM.so.") && fs::metadata(p).is_ok_and(|m| m.len() > 1_000_000))
        })
        .with_context(|| {
            format!(
                "no libLLVM.so.* in {}: this nightly does not ship a shared LLVM to link bpf-linker against",
                lib.display()
            )
        })?;
    if Command::new("cc").arg("--version").output().is_err() {
        bail!(
            "no C compiler (`cc`) found: bpf-linker's build needs one; install gcc (e.g. `apt-get install gcc`)"
        );
    }

    // LLVM_PREFIX/lib must hold libLLVM.so (what llvm-sys links with) and the
    // versioned name (what the binary's rpath resolves at run time). Both are
    // symlinks into the toolchain, and the prefix stays in the cache so the
    // rpath recorded in the binary keeps working.
    let prefix = root.join("llvm");
    let prefix_lib = prefix.join("lib");
    fs::create_dir_all(&prefix_lib)?;
    let file_name = libllvm.file_name().context("libLLVM path has no name")?;
    for name in [std::ffi::OsStr::new("libLLVM.so"), file_name] {
        let link = prefix_lib.join(name);
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&libllvm, &link)
            .with_context(|| format!("cannot create {}", link.display()))?;
    }

    let feature = format!("llvm-{}", nightly.llvm_major);
    eprintln!(
        "xtask: building bpf-linker {BPF_LINKER_VERSION} against {} ({feature}) into {} (about a minute, once)",
        libllvm.display(),
        root.display()
    );
    let started = Instant::now();
    let status = Command::new("cargo")
        .args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION])
        .args(["--no-default-features", "--features", &feature, "--root"])
        .arg(root)
        .env("LLVM_PREFIX", &prefix)
        // Never let a workspace-level target dir or rustflags leak in.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .status()
        .context("could not run `cargo install bpf-linker`")?;
    if !status.success() {
        bail!(
            "building bpf-linker failed: it needs the crates.io registry (`cargo install bpf-linker`), \
             a C compiler, and an LLVM {} that the `{feature}` feature supports",
            nightly.llvm_major
        );
    }
    eprintln!("xtask: bpf-linker built in {:.0?}", started.elapsed());
    Ok(())
}
