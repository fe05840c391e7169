//! `cargo xtask fuzz`: the libFuzzer targets in `ztunnel-userspace/fuzz/`
//! (see docs/fuzzing.md for what each asserts).
//!
//! All targets are built in one `cargo +nightly fuzz build` (address
//! sanitizer, debug assertions), then each binary is run directly, one at a
//! time, with two corpus folders: a working one under
//! `target/fuzz/corpus/<target>` that libFuzzer grows, and the seeds kept
//! in git (`ztunnel-userspace/fuzz/corpus/<target>`, read only). Crash
//! files go to `target/fuzz/artifacts/<target>/`, libFuzzer's output to
//! `target/fuzz/logs/<target>.log`; a summary line per target says how it
//! went. `--smoke` is the bounded run that `cargo xtask test` counts.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::ebpf_artifact::target_dir;

/// Every fuzz target, in the order they run.
pub const TARGETS: &[&str] = &[
    "zds_message",
    "socks5_request",
    "hbone_connect",
    "config_yaml",
    "policy_match",
];

/// Seconds per target in a smoke run: enough to replay the seeds and a few
/// ten thousand mutations even for the slowest target (config_yaml, about
/// 2k inputs/s under ASAN), which is what catches a parser that panics on
/// common malformed input; five of them plus the one build keep `cargo
/// xtask test` within its budget. Finding deep bugs is the long run's job.
const SMOKE_SECONDS: u64 = 15;
/// Executions per target in a long run (the figure docs/fuzzing.md reports).
const LONG_RUNS: u64 = 1_000_000;
/// Upper bound of a long run by executions, per target: the slowest target
/// needs about eight minutes for a million inputs; an hour means something
/// is wrong, and every run must end by itself.
const LONG_RUN_MAX_SECONDS: u64 = 3600;
/// One input running longer than this is reported as a hang. Every target
/// handles an input in well under 10 ms; 10 s leaves room for the sanitizer
/// and a loaded two-core machine without letting a real hang pass.
const INPUT_TIMEOUT_SECONDS: u64 = 10;
/// Memory limit of a fuzzer process: the sanitizer's quarantine alone
/// grows to about 500 MB; more than 2 GB is a leak or a blow-up worth a
/// report.
const RSS_LIMIT_MB: u64 = 2048;
/// How much longer than its own time limit a fuzzer process may take
/// (loading the corpus, writing a crash file) before it is killed.
const GRACE: Duration = Duration::from_secs(120);
/// Codegen units of the fuzz build: 16 lets the big crates (rustls, h2,
/// ztunnel-userspace itself) use both cores of our machines, at a small
/// cost in executions per second.
const CODEGEN_UNITS: &str = "16";

/// Options of `cargo xtask fuzz`.
#[derive(clap::Args)]
pub struct FuzzArgs {
    /// Each target for a bounded time (the step `cargo xtask test` runs).
    #[arg(long)]
    smoke: bool,
    /// Only this target.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(TARGETS))]
    target: Option<String>,
    /// Stop each target after N executions (default without --smoke: 1M).
    #[arg(long, conflicts_with = "seconds")]
    runs: Option<u64>,
    /// Stop each target after S seconds.
    #[arg(long)]
    seconds: Option<u64>,
}

/// When a target's run stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// After this many executions.
    Runs(u64),
    /// After this many seconds.
    Seconds(u64),
}

impl Limit {
    fn flags(self) -> Vec<String> {
        match self {
            Self::Runs(n) => vec![
                format!("-runs={n}"),
                format!("-max_total_time={LONG_RUN_MAX_SECONDS}"),
            ],
            Self::Seconds(s) => vec![format!("-max_total_time={s}")],
        }
    }

    fn deadline(self) -> Duration {
        let seconds = match self {
            Self::Runs(_) => LONG_RUN_MAX_SECONDS,
            Self::Seconds(s) => s,
        };
        Duration::from_secs(seconds + INPUT_TIMEOUT_SECONDS) + GRACE
    }
}

/// The limit the options ask for.
fn limit(args: &FuzzArgs) -> Limit {
    match (args.runs, args.seconds) {
        (Some(n), _) => Limit::Runs(n),
        (None, Some(s)) => Limit::Seconds(s),
        (None, None) if args.smoke => Limit::Seconds(SMOKE_SECONDS),
        (None, None) => Limit::Runs(LONG_RUNS),
    }
}

/// How one target's run went.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Target name.
    pub target: String,
    /// Finished within its limit without a crash, hang or leak.
    pub ok: bool,
    /// What went wrong, if anything.
    pub problem: Option<String>,
    /// The input that crashed it, if libFuzzer wrote one.
    pub crash: Option<PathBuf>,
    /// libFuzzer's figures (from its last status line and final stats).
    pub stats: Stats,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// libFuzzer's full output.
    pub log: PathBuf,
}

/// Figures libFuzzer prints.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stats {
    /// Inputs executed.
    pub execs: Option<u64>,
    /// Executions per second.
    pub exec_per_sec: Option<u64>,
    /// Covered code edges (`cov:`).
    pub cov: Option<u64>,
    /// Features (`ft:`: edges with hit counts, comparisons, ...).
    pub ft: Option<u64>,
    /// Inputs in the corpus at the end.
    pub corpus: Option<u64>,
}

impl Outcome {
    /// One line for the summary.
    pub fn line(&self) -> String {
        let n = |v: Option<u64>| v.map_or_else(|| "?".to_owned(), |v| v.to_string());
        let figures = format!(
            "{} runs in {:.0?} ({}/s), cov {} ft {} corpus {}",
            n(self.stats.execs),
            self.elapsed,
            n(self.stats.exec_per_sec),
            n(self.stats.cov),
            n(self.stats.ft),
            n(self.stats.corpus),
        );
        if self.ok {
            format!("fuzz {}: ok, {figures}", self.target)
        } else {
            format!(
                "fuzz {}: FAILED: {}{}; {figures}; log {}",
                self.target,
                self.problem.as_deref().unwrap_or("failed"),
                self.crash
                    .as_ref()
                    .map(|c| format!("; crash file {}", c.display()))
                    .unwrap_or_default(),
                self.log.display()
            )
        }
    }
}

/// `cargo xtask fuzz`.
pub fn run(workspace: &Path, args: &FuzzArgs) -> Result<()> {
    // ztunnel-userspace embeds the eBPF object: the fuzz build needs it.
    crate::ebpf::build(workspace, true)?;
    let targets: Vec<&str> = match &args.target {
        Some(t) => vec![t.as_str()],
        None => TARGETS.to_vec(),
    };
    let outcomes = run_targets(workspace, &targets, limit(args))?;
    let failed: Vec<&str> = outcomes
        .iter()
        .filter(|o| !o.ok)
        .map(|o| o.target.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("fuzz targets failed: {}", failed.join(", "));
    }
    Ok(())
}

/// The smoke run of every target, as `cargo xtask test` counts it (one
/// outcome per target; a failed build fails every target).
pub fn smoke(workspace: &Path) -> Vec<Outcome> {
    run_targets(workspace, TARGETS, Limit::Seconds(SMOKE_SECONDS)).unwrap_or_else(|e| {
        eprintln!("xtask: fuzz: {e:#}");
        TARGETS
            .iter()
            .map(|t| Outcome {
                target: (*t).to_owned(),
                problem: Some(format!("{e:#}")),
                ..Outcome::default()
            })
            .collect()
    })
}

/// Builds all targets once, then runs each of `targets` with `limit`.
fn run_targets(workspace: &Path, targets: &[&str], limit: Limit) -> Result<Vec<Outcome>> {
    let started = Instant::now();
    ensure_cargo_fuzz()?;
    let out = target_dir(workspace).join("fuzz");
    build(workspace, &out)?;
    eprintln!("xtask: fuzz targets built in {:.0?}", started.elapsed());
    let binaries = out.join(host_triple()?).join("release");
    let mut outcomes = Vec::new();
    for target in targets {
        let outcome = run_one(workspace, &out, &binaries, target, limit)?;
        eprintln!("xtask: {}", outcome.line());
        outcomes.push(outcome);
    }
    eprintln!("xtask: fuzzing took {:.0?} in all", started.elapsed());
    for outcome in &outcomes {
        println!("{}", outcome.line());
    }
    Ok(outcomes)
}

/// The nightly cargo, with none of the outer cargo's toolchain or flags.
fn nightly_cargo(workspace: &Path) -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(workspace)
        .arg("+nightly")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("RUSTUP_TOOLCHAIN");
    cmd
}

/// Installs cargo-fuzz when `cargo fuzz` is missing (saying so).
fn ensure_cargo_fuzz() -> Result<()> {
    let have = Command::new("cargo")
        .args(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if have {
        return Ok(());
    }
    eprintln!(
        "xtask: installing cargo-fuzz (cargo install cargo-fuzz --locked) to build the fuzz targets"
    );
    let status = Command::new("cargo")
        .args(["install", "cargo-fuzz", "--locked"])
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .status()
        .context("could not run `cargo install cargo-fuzz`")?;
    if !status.success() {
        bail!("installing cargo-fuzz failed (is the crates.io registry reachable?)");
    }
    Ok(())
}

fn build(workspace: &Path, out: &Path) -> Result<()> {
    let mut cmd = nightly_cargo(&workspace.join("ztunnel-userspace"));
    cmd.args(["fuzz", "build", "--fuzz-dir", "fuzz"])
        .args(["--codegen-units", CODEGEN_UNITS])
        .arg("--target-dir")
        .arg(out);
    eprintln!("xtask: fuzz: {cmd:?}");
    let status = cmd
        .status()
        .context("could not run cargo +nightly fuzz build")?;
    if !status.success() {
        bail!("building the fuzz targets failed (see the compiler output above)");
    }
    Ok(())
}

/// The host triple (cargo fuzz builds for it, into `<out>/<triple>/`).
fn host_triple() -> Result<String> {
    let out = Command::new("rustc")
        .args(["+nightly", "-vV"])
        .output()
        .context("could not run rustc +nightly -vV")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host:"))
        .map(|h| h.trim().to_owned())
        .context("rustc +nightly -vV printed no host")
}

fn run_one(
    workspace: &Path,
    out: &Path,
    binaries: &Path,
    target: &str,
    limit: Limit,
) -> Result<Outcome> {
    let fuzz_dir = workspace.join("ztunnel-userspace").join("fuzz");
    let corpus = out.join("corpus").join(target);
    let artifacts = out.join("artifacts").join(target);
    let logs = out.join("logs");
    for dir in [&corpus, &artifacts, &logs] {
        fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let log = logs.join(format!("{target}.log"));
    let mut cmd = Command::new(binaries.join(target));
    cmd.args(limit.flags())
        .arg(format!("-timeout={INPUT_TIMEOUT_SECONDS}"))
        .arg(format!("-rss_limit_mb={RSS_LIMIT_MB}"))
        .arg("-print_final_stats=1")
        // The trailing slash makes it a folder: crash-<sha1> goes inside.
        .arg(format!("-artifact_prefix={}/", artifacts.display()));
    let dict = fuzz_dir.join("dicts").join(format!("{target}.dict"));
    if dict.is_file() {
        cmd.arg(format!("-dict={}", dict.display()));
    }
    // The first folder is the one libFuzzer writes new inputs to.
    cmd.arg(&corpus);
    let seeds = fuzz_dir.join("corpus").join(target);
    if seeds.is_dir() {
        cmd.arg(&seeds);
    }
    let log_file =
        fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
    cmd.stdout(log_file.try_clone()?).stderr(log_file);
    eprintln!("xtask: fuzz {target}: {cmd:?}");
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("could not run {}", binaries.join(target).display()))?;
    let deadline = limit.deadline();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let text = fs::read_to_string(&log).unwrap_or_default();
    let crash = crash_file(&text);
    let problem = match status {
        None => Some(format!(
            "still running after {deadline:.0?}, killed (a hang outside one input?)"
        )),
        Some(s) if s.success() && crash.is_none() => None,
        Some(s) => Some(format!(
            "{} ({s})",
            failure_reason(&text).unwrap_or("libFuzzer stopped with an error")
        )),
    };
    if problem.is_some() {
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        for line in tail.iter().rev() {
            eprintln!("  {line}");
        }
    }
    Ok(Outcome {
        target: target.to_owned(),
        ok: problem.is_none(),
        problem,
        crash,
        stats: parse_stats(&text),
        elapsed: started.elapsed(),
        log,
    })
}

/// `... Test unit written to <path>` -> the path.
fn crash_file(log: &str) -> Option<PathBuf> {
    log.lines()
        .rev()
        .find_map(|l| l.split("Test unit written to ").nth(1))
        .map(|p| PathBuf::from(p.trim()))
}

/// What kind of failure libFuzzer reported.
fn failure_reason(log: &str) -> Option<&'static str> {
    [
        ("panicked at", "a panic (assertion or bug)"),
        ("ERROR: libFuzzer: timeout", "an input hung"),
        ("out-of-memory", "out of memory"),
        (
            "ERROR: AddressSanitizer",
            "a memory error (AddressSanitizer)",
        ),
        ("ERROR: LeakSanitizer", "a leak"),
        ("deadly signal", "a crash (deadly signal)"),
    ]
    .into_iter()
    .find(|(needle, _)| log.contains(needle))
    .map(|(_, reason)| reason)
}

/// Reads the figures from libFuzzer's last status line
/// (`#1000000 DONE cov: 812 ft: 2203 corp: 480/33Kb ... exec/s: 28788 ...`)
/// and its final stats (`stat::number_of_executed_units: N`).
fn parse_stats(log: &str) -> Stats {
    let mut stats = Stats::default();
    let after = |line: &str, key: &str| -> Option<u64> {
        let rest = line.split(key).nth(1)?.trim_start();
        rest.split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    if let Some(status) = log
        .lines()
        .rev()
        .find(|l| l.starts_with('#') && l.contains(" cov: "))
    {
        stats.execs = after(status, "#");
        stats.cov = after(status, " cov: ");
        stats.ft = after(status, " ft: ");
        stats.corpus = after(status, " corp: ");
        stats.exec_per_sec = after(status, " exec/s: ");
    }
    for line in log.lines() {
        if let Some(n) = after(line, "stat::number_of_executed_units:") {
            stats.execs = Some(n);
        }
        if let Some(n) = after(line, "stat::average_exec_per_sec:") {
            stats.exec_per_sec = Some(n);
        }
    }
    stats
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libfuzzer_figures_and_crash_files() {
        let log = "\
#2\tINITED cov: 10 ft: 11 corp: 1/1b exec/s: 0 rss: 30Mb
#1324267\tDONE   cov: 814 ft: 2155 corp: 481/33Kb lim: 4096 exec/s: 28788 rss: 482Mb
stat::number_of_executed_units: 1324268
stat::average_exec_per_sec:     28788
";
        assert_eq!(
            parse_stats(log),
            Stats {
                execs: Some(1_324_268),
                exec_per_sec: Some(28788),
                cov: Some(814),
                ft: Some(2155),
                corpus: Some(481),
            }
        );
        let crashed = "thread '<unnamed>' panicked at fuzz_targets/zds_message.rs:48:13:\n\
            ==1== ERROR: libFuzzer: deadly signal\n\
            artifact_prefix='/t/'; Test unit written to /t/crash-2036\n";
        assert_eq!(crash_file(crashed), Some(PathBuf::from("/t/crash-2036")));
        assert_eq!(failure_reason(crashed), Some("a panic (assertion or bug)"));
        assert_eq!(crash_file(log), None);
    }

    #[test]
    fn limits_follow_the_options() {
        let args = |smoke, runs, seconds| FuzzArgs {
            smoke,
            target: None,
            runs,
            seconds,
        };
        assert_eq!(
            limit(&args(true, None, None)),
            Limit::Seconds(SMOKE_SECONDS)
        );
        assert_eq!(limit(&args(false, None, None)), Limit::Runs(LONG_RUNS));
        assert_eq!(limit(&args(true, Some(5), None)), Limit::Runs(5));
        assert_eq!(limit(&args(false, None, Some(7))), Limit::Seconds(7));
        assert!(Limit::Seconds(7).deadline() > Duration::from_secs(7));
    }
}
