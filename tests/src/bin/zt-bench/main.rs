//! `zt-bench` (run by `cargo xtask bench`): the same two-node topology for
//! every scenario, scenarios interleaved, each measured `--runs` times;
//! medians are reported, with the direct (no mesh) baseline from the same
//! run.
//!
//! Scenarios ([`scenario`]): `direct` (no ztunnel), `bare-relay` (a
//! minimal TCP relay in each pod: the floor), `mesh-ebpf` (the defaults:
//! sockmap off), `mesh-ebpf-sockmap` (the opt-in `--sockmap on`),
//! `mesh-iptables` (`--capture iptables`); ztunnel
//! runs as shipped (no `--log`). Each is measured same-node (client and
//! server pods on node a) and cross-node. The order is reversed every
//! other run, so no scenario always runs first or last.
//!
//! A/B mode (`--baseline-ztunnel PATH`): `direct`, `bare-relay`,
//! `mesh-ebpf` with this build and `mesh-ebpf@baseline` with the binary at
//! PATH (and `--baseline-arg`s), interleaved the same way; the report adds
//! their ratios.
//! Load generators: iperf3 (bulk, 1 and 4 streams, and 1 stream with the
//! server sending, `-R`), sockperf ping-pong (half round trip of 1 KiB
//! requests on one connection) and ab against nginx (new connection per
//! request) when installed; otherwise the built-in `zt-probe
//! bulk|rr|connrate` modes, which measure the same things but the download
//! direction, so the benchmark also runs on a bare machine. `zt-probe hold`
//! opens the connections of the memory measurement.

mod measure;
mod report;
mod scenario;
mod tools;

use std::{collections::BTreeMap, io::Write as _, net::SocketAddr, path::PathBuf};

use clap::Parser;
use serde_json::{Value, json};
use ztunnel_tests::{
    Cluster,
    flows::{self, WorkloadEntry},
};

use measure::{hold_rss, measure};
use scenario::{Binaries, DIGEST_PORT, Dial, ECHO_PORT, Mesh, Relays, Scenario};
use tools::Tools;

#[derive(Parser)]
#[command(about = "ztunnel-rs benchmark")]
struct Cli {
    /// Repetitions of every scenario (medians are reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Short measurements and 1 run: a smoke test, under 2 minutes.
    #[arg(long)]
    quick: bool,
    /// Print the JSON result on stdout after the table.
    #[arg(long)]
    json: bool,
    /// Write the markdown report here.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Write the JSON result here (what `cargo xtask bench` draws from).
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// Only these scenarios (repeatable; default: all). For profiling one
    /// path; the ratios need the full set.
    #[arg(long = "scenario")]
    scenarios: Vec<String>,
    /// Only these measurements (repeatable: bulk, rr, rr-fixed, connrate,
    /// hold; default: all).
    #[arg(long = "measure")]
    measures: Vec<String>,
    /// Only this placement (same_node or cross_node; default: both).
    #[arg(long)]
    placement: Option<String>,
    /// Extra arguments for every ztunnel (repeatable), e.g.
    /// `--ztunnel-arg=--worker-threads=1`, to compare settings.
    #[arg(long = "ztunnel-arg", allow_hyphen_values = true)]
    ztunnel_args: Vec<String>,
    /// Use only the built-in load generators, even when iperf3, sockperf
    /// and ab/nginx are installed.
    #[arg(long)]
    builtin: bool,
    /// Requests of the maximum-rate request/response phase (default:
    /// 10000, 2000 with --quick); raise it to profile that phase.
    #[arg(long)]
    rr_count: Option<usize>,
    /// A/B mode: a second ztunnel binary (another revision's build), run
    /// as `mesh-ebpf@baseline` next to this build's `mesh-ebpf`.
    #[arg(long)]
    baseline_ztunnel: Option<PathBuf>,
    /// What to call the baseline in the report (e.g. its short commit).
    #[arg(long, default_value = "baseline", requires = "baseline_ztunnel")]
    baseline_label: String,
    /// Extra arguments for the baseline's ztunnels alone (repeatable). With
    /// this build's own binary as the baseline it is an A/B of a setting:
    /// `--baseline-ztunnel target/release/ztunnel
    /// --baseline-arg=--worker-threads=1`.
    #[arg(
        long = "baseline-arg",
        allow_hyphen_values = true,
        requires = "baseline_ztunnel"
    )]
    baseline_args: Vec<String>,
}

pub(crate) const METRICS: [&str; 17] = [
    "throughput_gbps",
    "throughput4_gbps",
    "throughput_rev_gbps",
    "rr_p50_us",
    "rr_p99_us",
    "rr_p999_us",
    "rr_fixed_p50_us",
    "rr_fixed_p99_us",
    "rr_fixed_p999_us",
    "conn_per_s",
    "cpu_per_1k_rps",
    "cpu_per_1k_rps_one",
    "cpu_per_1k_rps_max_rate",
    "cpu_per_1k_rps_max_rate_one",
    "rss_idle_mb",
    "rss_idle_anon_mb",
    "rss_10k_conns_mb",
];

pub(crate) struct Params {
    /// Measurements to run (empty: all).
    pub measures: Vec<String>,
    pub seconds: u64,
    pub rr_count: usize,
    pub rr_fixed_count: usize,
    /// Length of a sockperf fixed-rate phase.
    pub rr_fixed_seconds: u64,
    /// Requests of an `ab` run.
    pub ab_requests: usize,
    pub rr_fixed_rate: u64,
    pub hold: usize,
}

fn say(msg: &str) {
    eprintln!("{msg}");
    let _ = std::io::stderr().flush();
}

fn main() {
    let cli = Cli::parse();
    if !nix::unistd::geteuid().is_root() {
        eprintln!("zt-bench needs root");
        std::process::exit(2);
    }
    raise_nofile();
    let p = if cli.quick {
        Params {
            measures: cli.measures.clone(),
            seconds: 1,
            rr_count: cli.rr_count.unwrap_or(2000),
            rr_fixed_count: 500,
            rr_fixed_seconds: 1,
            ab_requests: 500,
            rr_fixed_rate: 1000,
            hold: 1000,
        }
    } else {
        Params {
            measures: cli.measures.clone(),
            seconds: 4,
            rr_count: cli.rr_count.unwrap_or(10000),
            rr_fixed_count: 3000,
            rr_fixed_seconds: 3,
            ab_requests: 3000,
            rr_fixed_rate: 1000,
            hold: 10000,
        }
    };
    let runs = if cli.quick { 1 } else { cli.runs.max(1) };
    let scenarios: &[Scenario] = if cli.baseline_ztunnel.is_some() {
        &scenario::AB
    } else {
        &scenario::NORMAL
    };
    if let Some(unknown) = cli
        .scenarios
        .iter()
        .find(|s| !scenarios.iter().any(|k| k.name() == s.as_str()))
    {
        eprintln!(
            "zt-bench: no scenario {unknown:?} in this mode; there are: {}",
            scenarios
                .iter()
                .map(|s| s.name())
                .collect::<Vec<_>>()
                .join(", ")
        );
        std::process::exit(2);
    }
    if let Some(path) = cli.baseline_ztunnel.as_ref().filter(|p| !p.is_file()) {
        eprintln!(
            "zt-bench: --baseline-ztunnel {}: no such file",
            path.display()
        );
        std::process::exit(2);
    }
    let binaries = Binaries::new(cli.baseline_ztunnel.clone(), cli.baseline_args.clone());

    let mut cluster = Cluster::new();
    let na = cluster.add_node("node-a");
    let nb = cluster.add_node("node-b");
    cluster.add_pod(na, "client");
    cluster.add_pod(na, "srv-a");
    cluster.add_pod(nb, "srv-b");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("client", "node-a"),
            WorkloadEntry::enrolled("srv-a", "node-a"),
            WorkloadEntry::enrolled("srv-b", "node-b"),
        ],
    );
    let config = config.to_str().unwrap_or_default().to_owned();
    let tools = if cli.builtin {
        Tools::default()
    } else {
        Tools::detect()
    };
    let generators = tools.describe();
    say(&format!("load generators: {generators}"));
    let mut servers = Vec::new();
    for name in ["srv-a", "srv-b"] {
        let pod = cluster.pod(name);
        servers.push(flows::server_with(
            pod,
            SocketAddr::from((pod.ip, ECHO_PORT)),
            "echo",
            true,
        ));
        servers.push(flows::server_with(
            pod,
            SocketAddr::from((pod.ip, DIGEST_PORT)),
            "digest",
            true,
        ));
        servers.extend(tools.start_servers(&cluster, pod));
    }

    // samples[scenario][placement][metric] = values over runs
    let mut samples: BTreeMap<String, BTreeMap<String, BTreeMap<String, Vec<f64>>>> =
        BTreeMap::new();
    for run in 1..=runs {
        for &scenario in &run_order(scenarios, run) {
            let name = scenario.name();
            if !cli.scenarios.is_empty() && !cli.scenarios.iter().any(|s| s == name) {
                continue;
            }
            say(&format!("run {run}/{runs}: {name} ..."));
            let mesh = Mesh::start(
                &cluster,
                [na, nb],
                scenario,
                &binaries,
                &config,
                &cli.ztunnel_args,
            );
            // All resident pages, and the process's own (heap and stacks,
            // without the binary's and libraries' pages, which are page
            // cache shared with every other process mapping them).
            let rss_idle = mesh.as_ref().map(|m| {
                let mib = |kib: u64| kib as f64 / 1024.0;
                (mib(m.a.rss_kib()), mib(m.a.anon_kib()))
            });
            let client = cluster.pod("client");
            for (placement, target) in [("same_node", "srv-a"), ("cross_node", "srv-b")] {
                if cli.placement.as_ref().is_some_and(|p| p != placement) {
                    continue;
                }
                let srv = cluster.pod(target);
                // Relays per placement: the client pod's relay forwards
                // every port to one server pod.
                let relays = (scenario == Scenario::BareRelay).then(|| Relays::start(client, srv));
                let (dial, pids) = match (&mesh, &relays) {
                    (_, Some(r)) => (Dial::via_relay(client), r.pids()),
                    (Some(m), None) => (Dial::direct(srv), m.pids()),
                    (None, None) => (Dial::direct(srv), Vec::new()),
                };
                let m = measure(&cluster, target, dial, &p, &tools, &pids);
                drop(relays);
                let slot = samples
                    .entry(name.into())
                    .or_default()
                    .entry(placement.into())
                    .or_default();
                for (k, v) in m {
                    slot.entry(k).or_default().push(v);
                }
                if let Some((rss, anon)) = rss_idle {
                    slot.entry("rss_idle_mb".into()).or_default().push(rss);
                    slot.entry("rss_idle_anon_mb".into())
                        .or_default()
                        .push(anon);
                }
            }
            if let Some(m) = mesh.as_ref().filter(|_| p.wants("hold")) {
                let mb = hold_rss(client, cluster.pod("srv-b"), p.hold, &m.a);
                for placement in ["same_node", "cross_node"] {
                    samples
                        .entry(name.into())
                        .or_default()
                        .entry(placement.into())
                        .or_default()
                        .entry("rss_10k_conns_mb".into())
                        .or_default()
                        .push(mb);
                }
            }
            if let Some(m) = mesh {
                m.stop();
            }
        }
    }
    drop(servers);

    let mut scen = serde_json::Map::new();
    for (scenario, placements) in &samples {
        let mut pj = serde_json::Map::new();
        for (placement, metrics) in placements {
            let mut mj = serde_json::Map::new();
            for name in METRICS {
                let v = metrics
                    .get(name)
                    .map_or(Value::Null, |vals| json!(round(median(vals))));
                mj.insert(name.into(), v);
            }
            pj.insert(placement.clone(), Value::Object(mj));
        }
        scen.insert(scenario.clone(), Value::Object(pj));
    }
    let scen = Value::Object(scen);
    let order: Vec<&str> = scenarios.iter().map(|s| s.name()).collect();
    let baseline = cli.baseline_ztunnel.as_ref().map(|path| {
        json!({
            "label": cli.baseline_label,
            "ztunnel": path.display().to_string(),
            "args": cli.baseline_args,
            "ab": report::ab(&scen),
            "targets": report::targets(&scen, Scenario::MeshEbpfBaseline.name()),
        })
    });
    let result = json!({
        "runs": runs,
        "load_generators": generators,
        "quick": cli.quick,
        "hold_connections": p.hold,
        "scenario_order": order,
        "targets": report::targets(&scen, Scenario::MeshEbpf.name()),
        "information": report::information(&scen),
        "baseline": baseline,
        "scenarios": scen,
    });
    let report = report::markdown(&result);
    println!("{report}");
    for (path, text) in [(&cli.report, report), (&cli.json_out, result.to_string())] {
        if let Some(path) = path
            && let Err(e) = std::fs::write(path, text)
        {
            eprintln!("zt-bench: could not write {}: {e}", path.display());
            std::process::exit(1);
        }
    }
    if cli.json {
        println!("{result}");
    }
}

impl Params {
    pub(crate) fn wants(&self, measure: &str) -> bool {
        self.measures.is_empty() || self.measures.iter().any(|m| m == measure)
    }
}

/// Three decimals, or four significant digits for figures below 1: CPU per
/// 1k requests/s is about 0.03, where three decimals would hide a 3%
/// difference between the two builds of an A/B run.
fn round(v: f64) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let decimals = (3 - v.abs().log10().floor() as i32).clamp(3, 9);
    let scale = 10f64.powi(decimals);
    (v * scale).round() / scale
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

/// The scenarios in the order of run `run` (from 1): as listed in odd
/// runs, reversed in even ones, so that in an A/B run neither build always
/// goes first and each meets the machine in both states as often.
fn run_order(scenarios: &[Scenario], run: usize) -> Vec<Scenario> {
    let mut order = scenarios.to_vec();
    if run.is_multiple_of(2) {
        order.reverse();
    }
    order
}

fn raise_nofile() {
    let lim = libc::rlimit {
        rlim_cur: 65536,
        rlim_max: 65536,
    };
    // SAFETY: plain setrlimit with a valid struct.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim) };
}

#[cfg(test)]
mod tests {
    #[test]
    fn small_figures_keep_four_significant_digits() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(super::round(0.031_234_5), 0.031_23));
        assert!(close(super::round(31_645.574_9), 31_645.575));
        assert!(close(super::round(1.234_56), 1.235));
        assert!(close(super::round(0.0), 0.0));
    }

    #[test]
    fn every_other_run_goes_in_reverse() {
        use crate::scenario::{AB, Scenario};
        assert_eq!(super::run_order(&AB, 1), AB.to_vec());
        let second = super::run_order(&AB, 2);
        assert_eq!(second.first(), Some(&Scenario::MeshEbpfBaseline));
        assert_eq!(second.last(), Some(&Scenario::Direct));
        assert_eq!(super::run_order(&AB, 3), AB.to_vec());
    }
}
