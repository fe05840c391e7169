//! `cargo xtask bench [--quick] [--json] [--runs N] [--baseline REV]
//! [--baseline-arg ARG]...`:
//! builds everything and runs `zt-bench` (in the tests crate, next to the
//! harness it uses). It installs the iptables package when missing (the
//! `mesh-iptables` scenario needs it). Load generators are built in, so
//! nothing else is required. Every run draws `target/benchmarks.svg` from
//! the JSON result; a full run writes `docs/benchmarks.md` and
//! `docs/benchmarks.svg`.
//!
//! With `--baseline REV` it is an A/B run instead: REV is built in a
//! worktree of its own ([`crate::baseline`]) and its ztunnel runs as
//! `mesh-ebpf@baseline` next to the working tree's `mesh-ebpf`, both
//! interleaved in every run; the result goes to `target/bench-ab.md` and
//! `target/bench-ab.json`, never to docs/. `--baseline-arg` adds arguments
//! to the baseline's ztunnels alone; without `--baseline` the baseline is
//! this build's own binary, so the run compares a setting.

use std::{ffi::OsString, path::Path, process::Command};

use anyhow::{Context as _, Result, bail};

/// Options of `cargo xtask bench`.
#[derive(clap::Args)]
#[command(
    after_help = "A/B: `cargo xtask bench --baseline REV [--runs N | --quick]` builds REV \
(any commit git resolves: HEAD~1, a branch, a sha) in the worktree target/bench-baseline/<sha> with \
its own target dir (target/bench-baseline/target), its own eBPF object and a release ztunnel, then \
measures direct, bare-relay, mesh-ebpf with this working tree's build (\"current\") and with REV's, \
interleaved in every run (the order reversed every other run). It prints both, current/baseline \
per figure and each one's ratio to direct, and writes target/bench-ab.md and target/bench-ab.json; \
docs/ is left alone. A/B of a setting: `cargo xtask bench --baseline-arg=--worker-threads=1` runs this \
build's ztunnel twice, the baseline with the extra arguments (repeatable; with --baseline REV they go \
to REV's ztunnel)."
)]
pub struct BenchArgs {
    /// One short run of every scenario (smoke test, about 2 minutes).
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
    #[arg(long, conflicts_with = "baseline")]
    pub redraw: bool,
    /// A/B run against this git revision (built in a worktree; see below).
    #[arg(long, value_name = "REV")]
    pub baseline: Option<String>,
    /// Extra ztunnel argument for the baseline alone (repeatable); without
    /// --baseline the baseline is this build with these arguments.
    #[arg(
        long = "baseline-arg",
        value_name = "ARG",
        allow_hyphen_values = true,
        conflicts_with = "redraw"
    )]
    pub baseline_args: Vec<String>,
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
    let bin = crate::binaries::build(workspace, true)?;
    crate::layout::check(workspace, &bin);
    let bench = bin.join("zt-bench");
    if args.baseline.is_some() || !args.baseline_args.is_empty() {
        return run_ab(workspace, args, &bench);
    }
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
    run_bench(&mut cmd, args.json, "the benchmark")?;
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
             - Bulk: iperf3, 1 and 4 streams from client to server, and 1 stream from server to client \
             (\"download\", `-R`).\n\
             - Request/response: 1 KiB messages on one connection, half round trips (as sockperf reports them), \
             at maximum rate and at 1,000/s.\n\
             - ztunnel CPU: on-CPU time of every ztunnel thread (`/proc/PID/task/*/schedstat`) over a \
             request/response phase, as cores per 1,000 requests/s; \"busier\" is the ztunnel that used more, \
             \"both\" the two nodes' ztunnels together.\n\
             - RSS: node a's ztunnel, idle after start-up and while the client holds the connections.\n\n\
             - ztunnel runs as shipped: release build, no `--log` (so `info`, with the access log on).\n\
             - bare-relay: a minimal TCP relay (`zt-relay`, no TLS) in the client's and the server's pod, the \
             floor of a two-hop userspace proxy; its CPU figures are the two relays'.\n\n\
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

/// The A/B run: builds the baseline, runs zt-bench with both binaries and
/// keeps the result in target/ (docs/ describe the working tree alone).
fn run_ab(workspace: &Path, args: &BenchArgs, bench: &Path) -> Result<()> {
    let target = workspace.join("target");
    let baseline = match &args.baseline {
        Some(rev) => crate::baseline::build(workspace, rev)?,
        // A setting's A/B: this build twice, the baseline with its args.
        None => crate::baseline::Baseline {
            ztunnel: bench.with_file_name("ztunnel"),
            label: args.baseline_args.join(" "),
        },
    };
    let json_path = target.join("bench-ab.json");
    let report = target.join("bench-ab.md");
    let mut cmd = Command::new(bench);
    cmd.args(ab_args(args, &baseline, &json_path, &report));
    run_bench(&mut cmd, args.json, "the A/B benchmark")?;
    check_figures(&read_result(&json_path)?)?;
    eprintln!(
        "xtask: wrote {} and {}",
        report.display(),
        json_path.display()
    );
    Ok(())
}

/// zt-bench's arguments for an A/B run.
fn ab_args(
    args: &BenchArgs,
    baseline: &crate::baseline::Baseline,
    json_path: &Path,
    report: &Path,
) -> Vec<OsString> {
    let mut out: Vec<OsString> = vec![
        "--runs".into(),
        args.runs.to_string().into(),
        "--baseline-ztunnel".into(),
        baseline.ztunnel.clone().into(),
        // One token: a setting's label such as `--worker-threads=1` would
        // otherwise be read as a flag.
        format!("--baseline-label={}", baseline.label).into(),
        "--json-out".into(),
        json_path.into(),
        "--report".into(),
        report.into(),
    ];
    if args.quick {
        out.push("--quick".into());
    }
    // Likewise: each value is itself a flag of ztunnel's.
    out.extend(
        args.baseline_args
            .iter()
            .map(|arg| format!("--baseline-arg={arg}").into()),
    );
    out
}

/// Scenarios of a normal run, and what each must produce beyond the
/// always-required figures.
const NORMAL: [&str; 5] = [
    "direct",
    "bare-relay",
    "mesh-ebpf",
    "mesh-ebpf-sockmap",
    "mesh-iptables",
];
/// Scenarios of an A/B run (`--baseline`).
const AB: [&str; 4] = ["direct", "bare-relay", "mesh-ebpf", "mesh-ebpf@baseline"];

/// Every scenario must have produced every figure: a load generator that
/// failed reports 0 or nothing, and a benchmark with holes must not pass
/// (this is what makes `bench --quick` in `cargo xtask test` a real check).
/// The relays of `bare-relay` have CPU figures but no memory ones. The
/// download figure exists only when iperf3 ran (the built-in probe has no
/// sending server).
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
    let iperf3 = result["load_generators"]
        .as_str()
        // zt-bench's own wording (`Tools::describe`); without iperf3 it
        // reads "bulk: zt-probe bulk (built-in zt-probe; iperf3 not installed)".
        .is_some_and(|g| g.starts_with("bulk: iperf3;"));
    let download: &[&str] = if iperf3 {
        &["throughput_rev_gbps"]
    } else {
        &[]
    };
    let mut missing = Vec::new();
    let scenarios = if result["baseline"].is_object() {
        &AB[..]
    } else {
        &NORMAL[..]
    };
    for scenario in scenarios {
        for placement in ["same_node", "cross_node"] {
            let figures = &result["scenarios"][scenario][placement];
            let more = match *scenario {
                "direct" => &[][..],
                "bare-relay" => &MESH[..2],
                _ => &MESH[..],
            };
            for key in ALWAYS.iter().chain(download).chain(more) {
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

/// Runs zt-bench (`--json` when asked); `what` names it in the error.
fn run_bench(cmd: &mut Command, json: bool, what: &str) -> Result<()> {
    if json {
        cmd.arg("--json");
    }
    let status = cmd
        .status()
        .with_context(|| format!("could not run {}", cmd.get_program().to_string_lossy()))?;
    if !status.success() {
        bail!("{what} failed");
    }
    Ok(())
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
    use std::path::{Path, PathBuf};

    use serde_json::json;

    /// zt-bench's A/B options as it declares them (clap defaults: a value
    /// that looks like a flag is refused unless it is joined with `=`).
    fn zt_bench_parser() -> clap::Command {
        let value = |name: &'static str| clap::Arg::new(name).long(name);
        clap::Command::new("zt-bench")
            .arg(value("runs"))
            .arg(
                clap::Arg::new("quick")
                    .long("quick")
                    .action(clap::ArgAction::SetTrue),
            )
            .arg(value("baseline-ztunnel"))
            .arg(value("baseline-label"))
            .arg(value("baseline-arg").action(clap::ArgAction::Append))
            .arg(value("json-out"))
            .arg(value("report"))
    }

    /// A setting's A/B (`--baseline-arg=--worker-threads=1`): the label and
    /// the argument are themselves flags, and must reach zt-bench whole.
    #[test]
    fn ab_args_carry_flag_like_values_whole() {
        let args = super::BenchArgs {
            quick: true,
            json: false,
            runs: 3,
            redraw: false,
            baseline: None,
            baseline_args: vec!["--worker-threads=1".into(), "--log=warn".into()],
        };
        let baseline = crate::baseline::Baseline {
            ztunnel: PathBuf::from("/t/ztunnel"),
            label: args.baseline_args.join(" "),
        };
        let tokens = super::ab_args(
            &args,
            &baseline,
            Path::new("/t/ab.json"),
            Path::new("/t/ab.md"),
        );
        let m = zt_bench_parser()
            .try_get_matches_from(std::iter::once("zt-bench".into()).chain(tokens))
            .expect("zt-bench accepts the A/B arguments");
        let one = |id: &str| m.get_one::<String>(id).cloned();
        assert_eq!(
            one("baseline-label").as_deref(),
            Some("--worker-threads=1 --log=warn")
        );
        assert_eq!(one("baseline-ztunnel").as_deref(), Some("/t/ztunnel"));
        assert_eq!(one("runs").as_deref(), Some("3"));
        let passed: Vec<&String> = m.get_many("baseline-arg").expect("baseline args").collect();
        assert_eq!(passed, ["--worker-threads=1", "--log=warn"]);
        assert!(m.get_flag("quick"));
    }

    /// The parser above is strict enough to catch the old bug: the label as
    /// a separate token after its flag.
    #[test]
    fn split_flag_like_label_is_refused() {
        let argv = ["zt-bench", "--baseline-label", "--worker-threads=1"];
        assert!(zt_bench_parser().try_get_matches_from(argv).is_err());
    }

    fn complete() -> serde_json::Value {
        let figures = json!({
            "throughput_gbps": 1.0, "throughput4_gbps": 1.0, "rr_p50_us": 50.0,
            "rr_fixed_p50_us": 60.0, "conn_per_s": 1000.0, "cpu_per_1k_rps": 0.1,
            "cpu_per_1k_rps_one": 0.05, "rss_idle_mb": 8.0, "rss_10k_conns_mb": 90.0
        });
        let both = json!({"same_node": figures, "cross_node": figures});
        json!({"scenarios": {"direct": both, "bare-relay": both, "mesh-ebpf": both,
                             "mesh-ebpf-sockmap": both, "mesh-iptables": both}})
    }

    #[test]
    fn complete_result_passes() {
        super::check_figures(&complete()).expect("complete result");
    }

    #[test]
    fn the_relay_needs_no_memory_figures() {
        let mut result = complete();
        for placement in ["same_node", "cross_node"] {
            let relay = result["scenarios"]["bare-relay"][placement]
                .as_object_mut()
                .expect("object");
            relay.remove("rss_idle_mb");
            relay.remove("rss_10k_conns_mb");
        }
        super::check_figures(&result).expect("the relay has no RSS figures");
        result["scenarios"]["bare-relay"]["cross_node"]["throughput_gbps"] = json!(null);
        let err = super::check_figures(&result).expect_err("throughput is required");
        assert!(
            err.to_string()
                .contains("bare-relay/cross_node/throughput_gbps"),
            "{err}"
        );
    }

    #[test]
    fn the_download_figure_is_needed_when_iperf3_ran() {
        let mut result = complete();
        super::check_figures(&result).expect("no generators named: no download figure");
        result["load_generators"] = json!(
            "bulk: zt-probe bulk (built-in zt-probe; iperf3 not installed); \
             request/response: sockperf ping-pong; new connections: ab + nginx"
        );
        super::check_figures(&result).expect("built-in bulk probe: no download figure");
        result["load_generators"] = json!(
            "bulk: iperf3; request/response: sockperf ping-pong; new connections: ab + nginx"
        );
        let err = super::check_figures(&result).expect_err("iperf3 ran");
        assert!(
            err.to_string()
                .contains("mesh-ebpf/cross_node/throughput_rev_gbps"),
            "{err}"
        );
        for scenario in result["scenarios"]
            .as_object_mut()
            .expect("object")
            .values_mut()
        {
            for placement in ["same_node", "cross_node"] {
                scenario[placement]["throughput_rev_gbps"] = json!(1.0);
            }
        }
        super::check_figures(&result).expect("every download figure is there");
    }

    #[test]
    fn an_ab_result_needs_the_baseline_not_the_other_meshes() {
        let mut result = complete();
        let scenarios = result["scenarios"].as_object_mut().expect("object");
        let mesh = scenarios["mesh-ebpf"].clone();
        scenarios.remove("mesh-iptables");
        scenarios.remove("mesh-ebpf-sockmap");
        result["baseline"] = json!({"label": "abc1234"});
        let err = super::check_figures(&result).expect_err("baseline missing");
        assert!(
            err.to_string()
                .contains("mesh-ebpf@baseline/cross_node/conn_per_s"),
            "{err}"
        );
        result["scenarios"]["mesh-ebpf@baseline"] = mesh;
        super::check_figures(&result).expect("complete A/B result");
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
