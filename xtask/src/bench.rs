//! `cargo xtask bench [--quick] [--json] [--runs N]`: builds everything and
//! runs `zt-bench` (in the tests crate, next to the harness it uses). It
//! installs the iptables package when missing (the `mesh-iptables`
//! scenario needs it). Load generators are built in, so nothing else is
//! required. Every run draws `target/benchmarks.svg` from the JSON result;
//! a full run writes `docs/benchmarks.md` and `docs/benchmarks.svg`.

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
    /// Do not measure: redraw the chart from the last result
    /// (target/benchmarks.json) into target/benchmarks.svg.
    #[arg(long)]
    pub redraw: bool,
}

/// Builds and runs the benchmark.
pub fn run(workspace: &Path, args: &BenchArgs) -> Result<()> {
    let target = workspace.join("target");
    let json_path = target.join("benchmarks.json");
    if args.redraw {
        let svg = target.join("benchmarks.svg");
        crate::chart::render(&read_result(&json_path)?, &svg)?;
        eprintln!("xtask: drew {}", svg.display());
        return Ok(());
    }
    crate::test::ensure_iptables();
    // The load generators other meshes are measured with. Without them
    // (no registry) zt-bench falls back to its built-in ones and says so.
    if !crate::packages::ensure(
        &[
            ("iperf3", "iperf3"),
            ("sockperf", "sockperf"),
            ("ab", "apache2-utils"),
            ("nginx", "nginx-light"),
        ],
        "as the benchmark's load generators",
    ) {
        eprintln!(
            "xtask: some load generators are missing; zt-bench uses its built-in ones for those"
        );
    }
    // Release: the figures must describe the optimised proxy.
    let bench = crate::binaries::build(workspace, true)?.join("zt-bench");
    let mut cmd = Command::new(&bench);
    cmd.arg("--runs")
        .arg(args.runs.to_string())
        .arg("--json-out")
        .arg(&json_path);
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
    let result = read_result(&json_path)?;
    check_figures(&result)?;
    let svg = if args.quick {
        target.join("benchmarks.svg")
    } else {
        workspace.join("docs").join("benchmarks.svg")
    };
    crate::chart::render(&result, &svg)?;
    eprintln!("xtask: drew {}", svg.display());
    if !args.quick {
        let table = std::fs::read_to_string(workspace.join("target").join("benchmarks-table.md"))
            .unwrap_or_default();
        let machine = machine();
        let generators = result["load_generators"].as_str().unwrap_or("built-in");
        let doc = format!(
            "# Benchmarks\n\n\
             Written by `cargo xtask bench --runs {runs}`: medians of {runs} interleaved runs, every scenario on \
             the same two-node topology in network namespaces, the direct (no mesh) baseline from the same run. \
             How it measures, what the figures mean and what stands between them and the targets: \
             [performance.md](performance.md).\n\n\
             - Machine: {machine}\n\
             - Load generators: {generators}\n\
             - Request/response: 1 KiB messages on one connection, half round trips (as sockperf reports them), \
             at maximum rate and at 1,000/s.\n\
             - ztunnel CPU: on-CPU time of every ztunnel thread (`/proc/PID/task/*/schedstat`) over a \
             request/response phase, as cores per 1,000 requests/s; \"busier\" is the ztunnel that used more, \
             \"both\" the two nodes' ztunnels together.\n\
             - RSS: node a's ztunnel, idle after start-up and while the client holds the connections.\n\n\
             The client, the servers and both ztunnels share the machine's two cores, so compare ratios within a \
             run rather than absolute figures across machines.\n\n\
             ![ratios of this run](benchmarks.svg)\n\n{table}\n",
            runs = args.runs,
        );
        std::fs::write(workspace.join("docs").join("benchmarks.md"), doc)?;
        eprintln!("xtask: wrote docs/benchmarks.md");
    }
    Ok(())
}

/// Every scenario must have produced every figure: a load generator that
/// failed reports 0 or nothing, and a benchmark with holes must not pass
/// (this is what makes `bench --quick` in `cargo xtask test` a real check).
fn check_figures(result: &serde_json::Value) -> Result<()> {
    const ALWAYS: [&str; 5] = [
        "throughput_gbps",
        "throughput4_gbps",
        "rr_p50_us",
        "rr_fixed_p50_us",
        "conn_per_s",
    ];
    const MESH: [&str; 4] = [
        "cpu_per_1k_rps",
        "cpu_per_1k_rps_one",
        "rss_idle_mb",
        "rss_10k_conns_mb",
    ];
    let mut missing = Vec::new();
    for scenario in [
        "direct",
        "mesh-ebpf",
        "mesh-ebpf-nosockmap",
        "mesh-iptables",
    ] {
        for placement in ["same_node", "cross_node"] {
            let figures = &result["scenarios"][scenario][placement];
            let mesh = if scenario == "direct" {
                &[][..]
            } else {
                &MESH[..]
            };
            for key in ALWAYS.iter().chain(mesh) {
                if !figures[*key].as_f64().is_some_and(|v| v > 0.0) {
                    missing.push(format!("{scenario}/{placement}/{key}"));
                }
            }
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        bail!(
            "the benchmark produced no figure (or 0) for: {}",
            missing.join(", ")
        )
    }
}

fn read_result(path: &Path) -> Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    fn complete() -> serde_json::Value {
        let figures = json!({
            "throughput_gbps": 1.0, "throughput4_gbps": 1.0, "rr_p50_us": 50.0,
            "rr_fixed_p50_us": 60.0, "conn_per_s": 1000.0, "cpu_per_1k_rps": 0.1,
            "cpu_per_1k_rps_one": 0.05, "rss_idle_mb": 8.0, "rss_10k_conns_mb": 90.0
        });
        let both = json!({"same_node": figures, "cross_node": figures});
        json!({"scenarios": {"direct": both, "mesh-ebpf": both,
                             "mesh-ebpf-nosockmap": both, "mesh-iptables": both}})
    }

    #[test]
    fn complete_result_passes() {
        super::check_figures(&complete()).expect("complete result");
    }

    #[test]
    fn a_zero_or_missing_figure_is_named() {
        let mut result = complete();
        result["scenarios"]["mesh-iptables"]["cross_node"]["conn_per_s"] = json!(0.0);
        result["scenarios"]["direct"]["same_node"]
            .as_object_mut()
            .expect("object")
            .remove("rr_p50_us");
        let err = super::check_figures(&result)
            .expect_err("holes must fail")
            .to_string();
        assert!(err.contains("mesh-iptables/cross_node/conn_per_s"), "{err}");
        assert!(err.contains("direct/same_node/rr_p50_us"), "{err}");
    }
}
