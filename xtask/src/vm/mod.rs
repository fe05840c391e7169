//! `cargo xtask vm-test`: the privileged suite on other kernels.
//!
//! Each kernel is Debian's generic package (see [`kernels`]), booted in
//! QEMU with an init of ours (see [`initramfs`]) that shares the host's
//! root read-only, so the guest runs the very test binaries the host just
//! built. The guest writes the binaries' output to a results folder under
//! `target/vm/results/<kernel>-<smoke|full>/`; the host counts it with the same rules
//! as `cargo xtask test` and prints one summary line per kernel.
//!
//! `host` runs the same job on this machine's kernel without a VM.

mod initramfs;
mod kernels;
mod qemu;

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

pub use kernels::Line;

use crate::tally::{LineCounter, Tally};

/// Which kernels `vm-test` runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Choice {
    /// Debian 12's 6.1 kernel in QEMU.
    #[value(name = "6.1")]
    V6_1,
    /// Debian 12 backports' 6.12 kernel in QEMU.
    #[value(name = "6.12")]
    V6_12,
    /// This machine's own kernel, no VM.
    Host,
    /// 6.1, 6.12 and host.
    All,
}

/// Options of `cargo xtask vm-test`.
#[derive(clap::Args)]
pub struct VmArgs {
    /// Kernels to run on (repeatable).
    #[arg(long, value_enum, default_values_t = [Choice::All])]
    kernel: Vec<Choice>,
    /// Only the smoke job (`ztunnel probe`, `capture_outbound` and
    /// `capture_enrol`), as `cargo xtask test` runs it.
    #[arg(long)]
    smoke: bool,
    /// Only integration tests whose name contains this.
    #[arg(long)]
    filter: Option<String>,
}

/// The test binaries of the smoke job: a whole capture round trip
/// (enrol, connect captured, original destination, removal) and the
/// enrolment socket with its counters.
const SMOKE_TESTS: &[&str] = &["capture_outbound", "capture_enrol"];

/// Bound of one kernel's smoke job under software emulation.
const SMOKE_DEADLINE: Duration = Duration::from_secs(600);
/// Bound of one kernel's full job.
const FULL_DEADLINE: Duration = Duration::from_secs(3600);

/// One step of a job: a plain command (counted by its exit status) or a
/// libtest binary (counted test by test).
struct Step {
    name: String,
    kind: StepKind,
    argv: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum StepKind {
    Command,
    Tests,
}

/// Runs `cargo xtask vm-test`.
pub fn run(workspace: &Path, args: &VmArgs) -> Result<()> {
    let mut lines: Vec<Line> = Vec::new();
    let mut host = false;
    for choice in &args.kernel {
        match choice {
            Choice::V6_1 => lines.push(Line::V6_1),
            Choice::V6_12 => lines.push(Line::V6_12),
            Choice::Host => host = true,
            Choice::All => {
                lines.extend(Line::ALL);
                host = true;
            }
        }
    }
    lines.dedup();
    let steps = prepare(workspace, args.smoke, args.filter.as_deref())?;
    let mut total = Tally::default();
    let mut summaries = Vec::new();
    if host {
        let (tally, summary) = run_host(workspace, &steps)?;
        summaries.push(summary);
        total.absorb(tally, "host");
    }
    for line in lines {
        let (deadline, job) = if args.smoke {
            (SMOKE_DEADLINE, "smoke")
        } else {
            (FULL_DEADLINE, "full")
        };
        let (tally, summary) = run_vm(workspace, line, &steps, deadline, job);
        summaries.push(summary);
        total.absorb(tally, &format!("vm {}", line.label()));
    }
    for summary in &summaries {
        println!("{summary}");
    }
    crate::test::finish(&total)
}

/// The smoke job on every kernel line, for `cargo xtask test` (prepared
/// once for both: packages, builds and the list of test binaries). Never
/// fails as a whole: what went wrong is in each line's tally.
pub fn smoke(workspace: &Path) -> Vec<(Line, Tally)> {
    let steps = prepare(workspace, true, None);
    Line::ALL
        .into_iter()
        .map(|line| {
            let tally = match &steps {
                Ok(steps) => {
                    let (tally, summary) = run_vm(workspace, line, steps, SMOKE_DEADLINE, "smoke");
                    eprintln!("xtask: {summary}");
                    tally
                }
                Err(e) => {
                    let mut tally = Tally::default();
                    tally.step(&format!("vm smoke could not be prepared: {e:#}"), false);
                    tally
                }
            };
            (line, tally)
        })
        .collect()
}

/// Installs what the VMs need, builds the binaries and lists the job.
fn prepare(workspace: &Path, smoke: bool, filter: Option<&str>) -> Result<Vec<Step>> {
    if !crate::packages::ensure(
        &[
            ("qemu-system-x86_64", "qemu-system-x86"),
            ("busybox", "busybox-static"),
            ("modprobe", "kmod"),
            ("cpio", "cpio"),
            ("xz", "xz-utils"),
        ],
        "to boot test kernels",
    ) {
        bail!("could not install qemu-system-x86, busybox-static, kmod, cpio and xz-utils");
    }
    crate::test::ensure_iptables();
    crate::ebpf::build(workspace, true)?;
    let built = Command::new("cargo")
        .current_dir(workspace)
        .args(crate::test::BUILD_BINARIES)
        .status()
        .context("run cargo build")?
        .success();
    if !built {
        bail!("building ztunnel and the test helpers failed");
    }
    let tests = test_executables(workspace)?;
    let ztunnel = crate::ebpf_artifact::target_dir(workspace)
        .join("debug")
        .join("ztunnel");
    let mut steps = vec![Step {
        name: "ztunnel probe".into(),
        kind: StepKind::Command,
        argv: vec![ztunnel.to_string_lossy().into_owned(), "probe".into()],
    }];
    for (name, exe) in tests {
        if smoke && !SMOKE_TESTS.contains(&name.as_str()) {
            continue;
        }
        let mut argv = vec![
            exe.to_string_lossy().into_owned(),
            "--test-threads=1".into(),
        ];
        if let Some(f) = filter {
            argv.push(f.to_owned());
        }
        steps.push(Step {
            name,
            kind: StepKind::Tests,
            argv,
        });
    }
    if smoke && steps.len() != 1 + SMOKE_TESTS.len() {
        bail!("the smoke job needs the test binaries {SMOKE_TESTS:?}; some were not built");
    }
    Ok(steps)
}

/// `(name, executable)` of every integration test binary of `tests/`.
fn test_executables(workspace: &Path) -> Result<Vec<(String, PathBuf)>> {
    let out = Command::new("cargo")
        .current_dir(workspace)
        .args([
            "test",
            "-p",
            "ztunnel-tests",
            "--test",
            "*",
            "--no-run",
            "--message-format=json",
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("run cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the integration tests failed");
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let is_test = msg["target"]["kind"]
            .as_array()
            .is_some_and(|k| k.iter().any(|v| v == "test"));
        if let (true, Some(exe), Some(name)) = (
            is_test,
            msg["executable"].as_str(),
            msg["target"]["name"].as_str(),
        ) {
            found.push((name.to_owned(), PathBuf::from(exe)));
        }
    }
    found.sort();
    Ok(found)
}

/// The job script. Output of every step goes to `$R/stdout.log` and
/// `$R/stderr.log`; after each step a `ZT_STEP` line records its status.
fn job_script(workspace: &Path, steps: &[Step], emulated: bool) -> String {
    let ci = std::env::var("CI").unwrap_or_default();
    // Tests shrink their volumes (bulk transfers, churn) on an emulated CPU
    // (`ztunnel_tests::scaled`).
    let emulated = u8::from(emulated);
    let mut s = String::new();
    let _ = write!(
        s,
        "R=${{1:-/tmp/results}}\n\
         export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n\
         export HOME=/root RUST_BACKTRACE=1 CI='{ci}' ZTUNNEL_SKIP_LOG=\"$R/skipped.log\"\n\
         export ZTUNNEL_TESTS_EMULATED={emulated}\n\
         cd '{}' || exit 90\n\
         echo \"ZT_VM kernel $(uname -r)\"\n",
        workspace.display()
    );
    for step in steps {
        let argv: Vec<String> = step.argv.iter().map(|a| format!("'{a}'")).collect();
        let tag = match step.kind {
            StepKind::Command => "cmd",
            StepKind::Tests => "tests",
        };
        let _ = write!(
            s,
            "echo \"ZT_VM step {name}\"\n\
             echo \"ZT_STEP_START {tag}:{name}\" >> \"$R/stdout.log\"\n\
             {argv} >> \"$R/stdout.log\" 2>> \"$R/stderr.log\"\n\
             rc=$?\n\
             echo \"ZT_STEP {tag}:{name} rc=$rc\" >> \"$R/stdout.log\"\n\
             echo \"ZT_VM step {name} rc=$rc\"\n",
            name = step.name,
            argv = argv.join(" "),
        );
    }
    s.push_str("dmesg > \"$R/dmesg.log\" 2>/dev/null\nexit 0\n");
    s
}

/// Counts a job's `stdout.log`: libtest lines as tests, `ZT_STEP` lines of
/// commands as steps, a test binary that failed without a failing test as
/// one failure, and every planned step without a `ZT_STEP` line as failed.
fn count(stdout: &str, steps: &[Step], skip_log: &str, ci: bool) -> Tally {
    let mut tally = Tally::default();
    let mut counter = LineCounter::default();
    let mut failed_before = 0;
    let mut finished: Vec<String> = Vec::new();
    for line in stdout.lines() {
        if line.starts_with("ZT_STEP_START ") {
            failed_before = tally.failed;
            continue;
        }
        if let Some(rest) = line.strip_prefix("ZT_STEP ") {
            let Some((id, rc)) = rest.rsplit_once(" rc=") else {
                continue;
            };
            let ok = rc.trim() == "0";
            std::mem::take(&mut counter).finish(&mut tally);
            if let Some(name) = id.strip_prefix("cmd:") {
                tally.step(name, ok);
                finished.push(name.to_owned());
            } else if let Some(name) = id.strip_prefix("tests:") {
                if !ok && tally.failed == failed_before {
                    tally.step(&format!("{name} exited with status {rc}"), false);
                }
                finished.push(name.to_owned());
            }
            continue;
        }
        counter.feed(line, &mut tally);
    }
    counter.finish(&mut tally);
    for step in steps {
        if !finished.contains(&step.name) {
            tally.step(&format!("{} did not finish", step.name), false);
        }
    }
    tally.account_skips(skip_log, ci);
    tally
}

fn results_dir(workspace: &Path, name: &str) -> Result<PathBuf> {
    let dir = crate::ebpf_artifact::target_dir(workspace)
        .join("vm")
        .join("results")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    Ok(dir)
}

fn run_host(workspace: &Path, steps: &[Step]) -> Result<(Tally, String)> {
    let results = results_dir(workspace, "host")?;
    std::fs::write(results.join("job.sh"), job_script(workspace, steps, false))?;
    let start = Instant::now();
    let status = Command::new("sh")
        .arg(results.join("job.sh"))
        .arg(&results)
        .status()
        .context("run the job on the host")?;
    if !status.success() {
        eprintln!("xtask: vm-test: host job exited with {status}");
    }
    let tally = read_results(&results, steps);
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let summary = summary_line(
        &format!("host {}", release.trim()),
        "no vm",
        &tally,
        start.elapsed().as_secs_f64(),
    );
    Ok((tally, summary))
}

fn read_results(results: &Path, steps: &[Step]) -> Tally {
    let stdout = std::fs::read_to_string(results.join("stdout.log")).unwrap_or_default();
    let skips = std::fs::read_to_string(results.join("skipped.log")).unwrap_or_default();
    let ci = std::env::var("CI").as_deref() == Ok("true");
    let tally = count(&stdout, steps, &skips, ci);
    if tally.failed > 0 {
        eprintln!(
            "xtask: vm-test: output and kernel log kept in {} (stdout.log, stderr.log, dmesg.log)",
            results.display()
        );
    }
    tally
}

/// Runs the job on one kernel in QEMU. Everything that goes wrong, from
/// fetching the kernel to a guest that never powers off, is a failure in
/// the returned tally.
fn run_vm(
    workspace: &Path,
    line: Line,
    steps: &[Step],
    deadline: Duration,
    job: &str,
) -> (Tally, String) {
    let label = format!("vm {}", line.label());
    match try_run_vm(workspace, line, steps, deadline, job) {
        Ok(done) => done,
        Err(e) => {
            let mut tally = Tally::default();
            tally.step(&format!("{label}: {e:#}"), false);
            let summary = summary_line(&label, "not booted", &tally, 0.0);
            (tally, summary)
        }
    }
}

fn try_run_vm(
    workspace: &Path,
    line: Line,
    steps: &[Step],
    deadline: Duration,
    job: &str,
) -> Result<(Tally, String)> {
    let vm_dir = crate::ebpf_artifact::target_dir(workspace).join("vm");
    let kernel = kernels::fetch(&vm_dir, line)?;
    let initrd = initramfs::build(&vm_dir, &kernel)?;
    let trial = vm_dir
        .join("results")
        .join(format!("kvm-trial.{}", std::process::id()));
    let accel = qemu::choose_accel(&kernel, &initrd, &trial);
    let _ = std::fs::remove_dir_all(&trial);
    let results = results_dir(workspace, &format!("{}-{job}", line.label()))?;
    std::fs::write(
        results.join("job.sh"),
        job_script(workspace, steps, accel == qemu::Accel::Tcg),
    )?;
    eprintln!(
        "xtask: vm: booting {} ({}) for {} step(s), at most {} s",
        kernel.release,
        accel.label(),
        steps.len(),
        deadline.as_secs()
    );
    let prefix = format!("[vm {}]", line.label());
    let boot = qemu::boot(&kernel, &initrd, &results, accel, deadline, Some(&prefix))?;
    let mut tally = read_results(&results, steps);
    if boot.job_status.is_none() {
        tally.step(
            &format!(
                "the {} guest did not finish its job; console ended with: {}",
                kernel.release,
                boot.tail.join(" | ")
            ),
            false,
        );
    }
    let summary = summary_line(
        &format!("vm {} {}", line.label(), kernel.release),
        accel.label(),
        &tally,
        boot.seconds,
    );
    Ok((tally, summary))
}

fn summary_line(what: &str, how: &str, tally: &Tally, seconds: f64) -> String {
    format!(
        "{what} ({how}): {} passed, {} failed, {} skipped in {seconds:.0} s",
        tally.passed, tally.failed, tally.skipped
    )
}

#[cfg(test)]
mod tests {
    use super::{Step, StepKind, count};

    fn steps() -> Vec<Step> {
        vec![
            Step {
                name: "ztunnel probe".into(),
                kind: StepKind::Command,
                argv: vec![],
            },
            Step {
                name: "capture_enrol".into(),
                kind: StepKind::Tests,
                argv: vec![],
            },
        ]
    }

    #[test]
    fn a_clean_job_counts_commands_and_tests() {
        let out = "ZT_STEP_START cmd:ztunnel probe\nZT_STEP cmd:ztunnel probe rc=0\n\
                   ZT_STEP_START tests:capture_enrol\nrunning 2 tests\ntest a ... ok\ntest b ... ok\n\
                   test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out\n\
                   ZT_STEP tests:capture_enrol rc=0\n";
        let t = count(out, &steps(), "", true);
        assert_eq!((t.passed, t.failed), (3, 0));
    }

    #[test]
    fn a_guest_that_stopped_half_way_fails_what_did_not_finish() {
        let out = "ZT_STEP_START cmd:ztunnel probe\nZT_STEP cmd:ztunnel probe rc=0\n\
                   ZT_STEP_START tests:capture_enrol\nrunning 2 tests\ntest a ... ok\n";
        let t = count(out, &steps(), "", true);
        // probe passed; the open binary's unreported test and the missing
        // step line are failures.
        assert_eq!(t.passed, 1);
        assert_eq!(t.failed, 2);
    }

    #[test]
    fn a_failing_command_and_a_crashing_binary_fail() {
        let out = "ZT_STEP_START cmd:ztunnel probe\nZT_STEP cmd:ztunnel probe rc=1\n\
                   ZT_STEP_START tests:capture_enrol\nZT_STEP tests:capture_enrol rc=101\n";
        let t = count(out, &steps(), "", false);
        assert_eq!((t.passed, t.failed), (0, 2));
    }

    #[test]
    fn skips_fail_under_ci() {
        let out = "ZT_STEP_START tests:capture_enrol\nrunning 1 test\ntest a ... ok\n\
                   test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out\n\
                   ZT_STEP tests:capture_enrol rc=0\nZT_STEP cmd:ztunnel probe rc=0\n";
        let t = count(out, &steps(), "capture_enrol::a: not root\n", true);
        assert_eq!((t.passed, t.failed, t.skipped), (1, 1, 0));
        let t = count(out, &steps(), "capture_enrol::a: not root\n", false);
        assert_eq!((t.passed, t.failed, t.skipped), (1, 0, 1));
    }
}
