//! `cargo xtask test`: the one test command.
//!
//! Steps, in order: build the eBPF object; `cargo fmt --check`; `cargo
//! clippy --all-targets -D warnings`; unit tests; then the privileged
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

/// Options of `cargo xtask test`.
#[derive(clap::Args)]
pub struct TestArgs {
    /// Only run integration tests whose name contains this.
    #[arg(long)]
    filter: Option<String>,
    /// Skip fmt and clippy (for quick iterations; CI never uses it).
    #[arg(long)]
    no_lint: bool,
}

#[derive(Default)]
struct Tally {
    passed: u64,
    failed: u64,
    skipped: u64,
    failures: Vec<String>,
}

impl Tally {
    fn step(&mut self, name: &str, ok: bool) {
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
            self.failures.push(name.to_owned());
        }
    }
}

/// Runs `cargo <args>` streaming its output, and adds up libtest's
/// `test result:` lines. Returns whether cargo succeeded.
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
    let mut saw_result = false;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        if let Some((passed, failed)) = parse_result(&line) {
            saw_result = true;
            tally.passed += passed;
            tally.failed += failed;
        }
        if let Some(name) = line
            .strip_prefix("test ")
            .and_then(|l| l.strip_suffix(" ... FAILED"))
        {
            tally.failures.push(name.to_owned());
        }
    }
    let ok = child.wait()?.success();
    if !ok && !saw_result {
        // Did not even compile or start: count the whole step as one failure.
        tally.step(label, false);
    }
    Ok(ok)
}

/// `test result: ok. 4 passed; 0 failed; 1 ignored; ...` -> (4, 0).
fn parse_result(line: &str) -> Option<(u64, u64)> {
    let rest = line.trim().strip_prefix("test result: ")?;
    let number_before = |word: &str| {
        rest.split(';').find_map(|part| {
            part.trim()
                .strip_suffix(word)?
                .split_whitespace()
                .last()?
                .parse()
                .ok()
        })
    };
    Some((number_before(" passed")?, number_before(" failed")?))
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
        ],
        &[],
        &mut tally,
        "unit tests",
    )?;

    // The iptables backend's tests need the iptables commands; install them
    // from Debian's packages when missing (saying so).
    ensure_iptables();

    // The integration tests run the real `ztunnel` binary and the `zt-probe`
    // helper; build both first so a stale binary is never tested.
    check(
        workspace,
        "build binaries",
        &[
            "build",
            "-p",
            "ztunnel-userspace",
            "-p",
            "ztunnel-tests",
            "--bins",
        ],
        &mut tally,
    )?;

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
    // The benchmark's smoke run: every scenario measured once, briefly.
    if args.filter.is_none() {
        check(
            workspace,
            "bench --quick",
            &["run", "--quiet", "-p", "xtask", "--", "bench", "--quick"],
            &mut tally,
        )?;
    }

    let skipped: Vec<String> = std::fs::read_to_string(&skip_log)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect();
    // A skipped test returned early and libtest counted it as passed.
    tally.passed = tally.passed.saturating_sub(skipped.len() as u64);
    if ci {
        tally.failed += skipped.len() as u64;
        tally.failures.extend(
            skipped
                .iter()
                .map(|s| format!("{s} (skipped under CI=true)")),
        );
    } else {
        tally.skipped += skipped.len() as u64;
    }
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

fn finish(tally: &Tally) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::parse_result;

    #[test]
    fn parses_libtest_summary() {
        let line = "test result: ok. 4 passed; 1 failed; 2 ignored; 0 measured; 0 filtered out; finished in 1.6s";
        assert_eq!(parse_result(line), Some((4, 1)));
        assert_eq!(parse_result("running 4 tests"), None);
    }
}
