//! `cargo xtask test`: the one test command.
//!
//! Steps, in order: build the eBPF object; `cargo fmt --check`; `cargo
//! clippy --all-targets -D warnings` on the host crates and, with nightly
//! for the BPF target, on `ztunnel-ebpf`; unit tests; the fuzz targets'
//! smoke run (one step per target); then the privileged
//! integration tests in `tests/`, one at a time, and `bench --quick` (`--test-threads=1`: they
//! share kernel state). Every step's outcome is counted, and the last line
//! printed is `N passed, N failed, N skipped`. A privileged test that skips
//! (only allowed outside root) is counted as skipped, and with `CI=true` as
//! failed.

use std::{
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

use crate::tally::{LineCounter, Tally};

/// Options of `cargo xtask test`.
#[derive(clap::Args)]
pub struct TestArgs {
    /// Only run integration tests whose name contains this.
    #[arg(long)]
    filter: Option<String>,
    /// Skip fmt and clippy (for quick iterations; CI never uses it).
    #[arg(long)]
    no_lint: bool,
    /// Skip the VM smoke runs on Debian's 6.1 and 6.12 kernels (they are
    /// also skipped with --filter).
    #[arg(long)]
    no_vm: bool,
}

/// Runs `cargo <args>` streaming its output, and adds up libtest's
/// `test result:` lines. Honest counting: a binary that crashes after its
/// `running N tests` line counts its unreported tests as failed, a result
/// line whose totals differ from the announced number is a failure, and a
/// failing cargo that reported no failure counts as one. Returns whether
/// cargo succeeded.
fn cargo_test(
    workspace: &Path,
    args: &[&str],
    extra_env: &[(&str, &str)],
    tally: &mut Tally,
    label: &str,
) -> Result<bool> {
    eprintln!("xtask: cargo {}", args.join(" "));
    let mut child = Command::new("cargo")
        .current_dir(workspace)
        .args(args)
        .envs(extra_env.iter().copied())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not run cargo {}", args.join(" ")))?;
    let stdout = child.stdout.take().context("piped stdout")?;
    let failed_before = tally.failed;
    let mut counter = LineCounter::default();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        counter.feed(&line, tally);
    }
    counter.finish(tally);
    let ok = child.wait()?.success();
    if !ok && tally.failed == failed_before {
        // Failed without a failing test: did not compile, or crashed
        // before any binary started. Count the whole step as one failure.
        tally.step(label, false);
    }
    Ok(ok)
}

fn check(workspace: &Path, name: &str, args: &[&str], tally: &mut Tally) -> Result<()> {
    eprintln!("xtask: {name}: cargo {}", args.join(" "));
    let ok = Command::new("cargo")
        .current_dir(workspace)
        .args(args)
        .status()
        .with_context(|| format!("could not run cargo {}", args.join(" ")))?
        .success();
    tally.step(name, ok);
    Ok(())
}

/// clippy on `ztunnel-ebpf`, for the BPF target with nightly, in a target
/// folder of its own (like `build-ebpf`, it must not share the host build's
/// flags or lock).
fn clippy_ebpf(workspace: &Path, tally: &mut Tally) -> Result<()> {
    let target_dir = workspace.join("target").join("ebpf-clippy");
    let args = [
        "+nightly",
        "clippy",
        "-p",
        "ztunnel-ebpf",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        "--release",
        "--target-dir",
        &target_dir.to_string_lossy(),
        "--",
        "-D",
        "warnings",
    ];
    eprintln!("xtask: clippy (ztunnel-ebpf): cargo {}", args.join(" "));
    let ok = Command::new("cargo")
        .current_dir(workspace)
        .args(args)
        // The outer cargo's toolchain and flags are for the host.
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("RUSTUP_TOOLCHAIN")
        .status()
        .context("could not run cargo +nightly clippy")?
        .success();
    tally.step("clippy (ztunnel-ebpf)", ok);
    Ok(())
}

/// Builds the `ztunnel` binary and the test helpers (`zt-probe`, ...) that
/// the integration tests run, here and in the VMs.
pub const BUILD_BINARIES: &[&str] = &[
    "build",
    "-p",
    "ztunnel-userspace",
    "-p",
    "ztunnel-tests",
    "--bins",
];

/// Runs everything and prints the summary line.
pub fn run(workspace: &Path, args: &TestArgs) -> Result<()> {
    let mut tally = Tally::default();
    let ci = std::env::var("CI").as_deref() == Ok("true");

    match crate::ebpf::build(workspace, true) {
        Ok(()) => tally.step("build-ebpf", true),
        Err(e) => {
            eprintln!("xtask: build-ebpf failed: {e:#}");
            tally.step("build-ebpf", false);
            return finish(&tally);
        }
    }
    if !args.no_lint {
        check(
            workspace,
            "fmt",
            &["fmt", "--all", "--", "--check"],
            &mut tally,
        )?;
        check(
            workspace,
            "clippy",
            &["clippy", "--all-targets", "--", "-D", "warnings"],
            &mut tally,
        )?;
        // The kernel crate only builds for the BPF target with nightly, so
        // the host clippy above never sees it.
        clippy_ebpf(workspace, &mut tally)?;
    }

    // Unit tests: every default member's library, binaries and doc-free
    // targets except the privileged integration tests.
    cargo_test(
        workspace,
        &[
            "test",
            "-p",
            "ztunnel-common",
            "-p",
            "ztunnel-userspace",
            "-p",
            "xtask",
            "-p",
            "ztunnel-tests",
            "--lib",
            "--bins",
            "--no-fail-fast",
        ],
        &[],
        &mut tally,
        "unit tests",
    )?;

    // Fuzz smoke run: every target for a bounded time (one build for all),
    // each counted as a step; a crash names the target and its input file.
    // Like the bench smoke run, left out of `--filter` iterations.
    if args.filter.is_none() {
        for outcome in crate::fuzz::smoke(workspace) {
            tally.step(&outcome.line(), outcome.ok);
        }
    }

    // The iptables backend's tests need the iptables commands; install them
    // from Debian's packages when missing (saying so).
    ensure_iptables();

    // The integration tests run the real `ztunnel` binary and the `zt-probe`
    // helper; build both first so a stale binary is never tested.
    check(workspace, "build binaries", BUILD_BINARIES, &mut tally)?;

    // Privileged integration tests, one at a time.
    let skip_log = workspace.join("target").join("xtask-skipped.log");
    let _ = std::fs::remove_file(&skip_log);
    let skip_log_str = skip_log.to_string_lossy().into_owned();
    let mut test_args = vec![
        "test",
        "-p",
        "ztunnel-tests",
        "--test",
        "*",
        "--no-fail-fast",
        "--",
        "--test-threads=1",
    ];
    if let Some(filter) = &args.filter {
        test_args.push(filter);
    }
    cargo_test(
        workspace,
        &test_args,
        &[("ZTUNNEL_SKIP_LOG", &skip_log_str), ("RUST_BACKTRACE", "1")],
        &mut tally,
        "integration tests",
    )?;
    // The same binaries on the oldest and the newest kernel line we claim,
    // in QEMU: `ztunnel probe` and the capture smoke tests (the full matrix
    // is `cargo xtask vm-test --kernel all`).
    if args.filter.is_none() && !args.no_vm {
        for (line, vm) in crate::vm::smoke(workspace) {
            tally.absorb(vm, &format!("vm {}", line.label()));
        }
    }

    // The benchmark's smoke run: every scenario measured once, briefly.
    if args.filter.is_none() {
        check(
            workspace,
            "bench --quick",
            &["run", "--quiet", "-p", "xtask", "--", "bench", "--quick"],
            &mut tally,
        )?;
    }

    let skip_lines = std::fs::read_to_string(&skip_log).unwrap_or_default();
    tally.account_skips(&skip_lines, ci);
    finish(&tally)
}

/// Installs Debian's `iptables` package if `iptables` is not on PATH.
pub fn ensure_iptables() {
    if !crate::packages::ensure(
        &[("iptables", "iptables")],
        "for the iptables capture backend",
    ) {
        eprintln!("xtask: could not install iptables; the iptables-backend tests will fail");
    }
}

/// Prints the failures and the summary line; an error when any failed.
pub fn finish(tally: &Tally) -> Result<()> {
    for failure in &tally.failures {
        eprintln!("xtask: FAILED: {failure}");
    }
    println!(
        "{} passed, {} failed, {} skipped",
        tally.passed, tally.failed, tally.skipped
    );
    if tally.failed > 0 {
        bail!("{} failed", tally.failed);
    }
    Ok(())
}
