//! `cargo xtask bench [--quick] [--json] [--runs N]`: builds everything and
//! runs `zt-bench` (in the tests crate, next to the harness it uses). It
//! installs the iptables package when missing (the `mesh-iptables`
//! scenario needs it). Load generators are built in, so nothing else is
//! required. A full run writes `docs/benchmarks.md`.

use std::{path::Path, process::Command};

use anyhow::{Context as _, Result, bail};

/// Options of `cargo xtask bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// One short run of every scenario (smoke test, under 2 minutes).
    #[arg(long)]
    pub quick: bool,
    /// Print the JSON result after the table.
    #[arg(long)]
    pub json: bool,
    /// Repetitions of every scenario (medians are reported).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
}

/// Builds and runs the benchmark.
pub fn run(workspace: &Path, args: &BenchArgs) -> Result<()> {
    crate::test::ensure_iptables();
    // Release: the figures must describe the optimised proxy.
    let bench = crate::binaries::build(workspace, true)?.join("zt-bench");
    let mut cmd = Command::new(&bench);
    cmd.arg("--runs").arg(args.runs.to_string());
    if args.quick {
        cmd.arg("--quick");
    } else {
        cmd.arg("--report")
            .arg(workspace.join("target").join("benchmarks-table.md"));
    }
    if args.json {
        cmd.arg("--json");
    }
    let status = cmd
        .status()
        .with_context(|| format!("could not run {}", bench.display()))?;
    if !status.success() {
        bail!("the benchmark failed");
    }
    if !args.quick {
        let table = std::fs::read_to_string(workspace.join("target").join("benchmarks-table.md"))
            .unwrap_or_default();
        let machine = machine();
        let doc = format!(
            "# Benchmarks\n\nWritten by `cargo xtask bench --runs {}` (medians of {} interleaved runs; every scenario on \
             the same two-node topology in network namespaces; direct baseline from the same run). The load generators \
             are ztunnel-rs's own (`zt-probe`): bulk send (iperf3-style, 1 and 4 streams), 1 KiB request/response on \
             one connection reported as half round trips (sockperf ping-pong style), at maximum rate and at 1,000/s, and \
             new connections per second with one 64-byte echo each from 4 workers (ab-style). ztunnel CPU is measured \
             from `/proc` over the maximum-rate request/response phase, both nodes' ztunnels together, as cores per \
             1,000 requests/s. The client, the servers and both ztunnels share the machine's cores, so absolute figures \
             are low; compare ratios within a run.\n\nMachine: {machine}\n\n{table}\n",
            args.runs, args.runs
        );
        std::fs::write(workspace.join("docs").join("benchmarks.md"), doc)?;
        eprintln!("xtask: wrote docs/benchmarks.md");
    }
    Ok(())
}

fn machine() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    format!("Linux {}, {cores} cores ({cpu})", kernel.trim())
}
