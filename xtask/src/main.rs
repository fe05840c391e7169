//! `cargo xtask`: build, test and demo automation for ztunnel-rs.
//!
//! - `build-ebpf`: prepares nightly + bpf-linker, builds the (release)
//!   kernel object, places it for `ztunnel-userspace` to embed.
//! - `test`: the one test command (eBPF build, clippy, unit tests,
//!   privileged integration tests one at a time, summary line).
//! - `demo [--json] [--keep] [--clean]`: the main job for a new user.
//! - `bench [--quick] [--json] [--runs N] [--baseline REV]`: the benchmark,
//!   or an A/B run of the working tree against REV.
//! - `fuzz [--smoke] [--target NAME] [--runs N | --seconds S]`: the fuzz
//!   targets of `ztunnel-userspace/fuzz/`.
//! - `vm-test [--kernel 6.1|6.12|host|all] [--smoke]`: the privileged suite
//!   on Debian's kernels in QEMU and on the host's.
//! - `layout`: re-records the link order of the `ztunnel` binary.

mod baseline;
mod bench;
mod binaries;
mod chart;
mod demo;
mod ebpf;
mod ebpf_artifact;
mod fuzz;
mod layout;
mod packages;
mod tally;
mod test;
mod toolchain;
mod vm;

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "ztunnel-rs build and test automation")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the eBPF object (installs rust-src and builds bpf-linker if needed).
    /// Always the release profile: every kernel we tried rejects the dev-profile
    /// object, and one object path shared by two profiles let a dev build slip
    /// into release binaries.
    BuildEbpf {
        /// Accepted for old scripts; the object is always built with the
        /// release profile.
        #[arg(long, hide = true)]
        release: bool,
    },
    /// Run every check and test; ends with `N passed, N failed, N skipped`.
    Test(test::TestArgs),
    /// Build everything, then run a two-node mesh in network namespaces and
    /// show scripted flows (needs root).
    Demo(demo::DemoArgs),
    /// Measure direct vs a bare relay vs eBPF capture (defaults, and --sockmap on) vs
    /// iptables capture; or, with --baseline REV, this build against REV's.
    Bench(bench::BenchArgs),
    /// Build the fuzz targets (installs cargo-fuzz if needed) and run each:
    /// 1M executions, or --smoke for a bounded time.
    Fuzz(fuzz::FuzzArgs),
    /// Run the privileged suite on other kernels: Debian's 6.1 and 6.12 in
    /// QEMU (KVM when it works, else software emulation) and/or this
    /// machine's own kernel; one summary line per kernel.
    VmTest(vm::VmArgs),
    /// Record which functions of the release ztunnel run (valgrind, in the
    /// test topology; needs root) and rewrite the link order that packs
    /// them together (ztunnel-userspace/layout/ztunnel.order).
    Layout,
}

fn workspace_root() -> Result<PathBuf> {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map(PathBuf::from)
        .context("xtask has no parent directory")
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root()?;
    if std::env::var("CI").as_deref() == Ok("true")
        && std::env::var_os("CARGO_INCREMENTAL").is_none()
    {
        // A CI run builds a clean clone once: incremental state (3.5 GB of
        // the debug folder) is never reused there, only stored.
        // SAFETY: set before any thread is started.
        unsafe { std::env::set_var("CARGO_INCREMENTAL", "0") };
    }
    match cli.command {
        Cmd::BuildEbpf { release: _ } => ebpf::build(&root, true),
        Cmd::Test(args) => test::run(&root, &args),
        Cmd::Demo(args) => demo::run(&root, &args),
        Cmd::Bench(args) => bench::run(&root, &args),
        Cmd::Fuzz(args) => fuzz::run(&root, &args),
        Cmd::VmTest(args) => vm::run(&root, &args),
        Cmd::Layout => layout::run(&root),
    }
}
