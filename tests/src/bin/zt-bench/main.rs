//! `zt-bench` (run by `cargo xtask bench`): the same two-node topology for
//! every scenario, scenarios interleaved, each measured `--runs` times;
//! medians are reported, with the direct (no mesh) baseline from the same
//! run.
//!
//! Scenarios: `direct` (no ztunnel), `mesh-ebpf` (sockmap on),
//! `mesh-ebpf-nosockmap`, `mesh-iptables` (`--capture iptables`). Each is
//! measured same-node (client and server pods on node a) and cross-node.
//! Load generators: iperf3 (bulk, 1 and 4 streams), sockperf ping-pong
//! (half round trip of 1 KiB requests on one connection) and ab against
//! nginx (new connection per request) when installed; otherwise the
//! built-in `zt-probe bulk|rr|connrate` modes, which measure the same
//! things, so the benchmark also runs on a bare machine. `zt-probe hold`
//! opens the connections of the memory measurement.

mod measure;
mod report;
mod tools;

use std::{collections::BTreeMap, io::Write as _, net::SocketAddr, path::PathBuf, time::Duration};

use clap::Parser;
use serde_json::{Value, json};
use ztunnel_tests::{
    Cluster,
    flows::{self, WorkloadEntry},
    ztunnel::Ztunnel,
};

use measure::{hold_rss, measure};
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
}

pub(crate) const SCENARIOS: [&str; 4] = [
    "direct",
    "mesh-ebpf",
    "mesh-ebpf-nosockmap",
    "mesh-iptables",
];
const METRICS: [&str; 15] = [
    "throughput_gbps",
    "throughput4_gbps",
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
            SocketAddr::from((pod.ip, 8080)),
            "echo",
            true,
        ));
        servers.push(flows::server_with(
            pod,
            SocketAddr::from((pod.ip, 9000)),
            "digest",
            true,
        ));
        servers.extend(tools.start_servers(&cluster, pod));
    }

    // samples[scenario][placement][metric] = values over runs
    let mut samples: BTreeMap<String, BTreeMap<String, BTreeMap<String, Vec<f64>>>> =
        BTreeMap::new();
    for run in 1..=runs {
        for scenario in SCENARIOS {
            if !cli.scenarios.is_empty() && !cli.scenarios.iter().any(|s| s == scenario) {
                continue;
            }
            say(&format!("run {run}/{runs}: {scenario} ..."));
            let (za, zb) = start(&cluster, [na, nb], scenario, &config, &cli.ztunnel_args);
            let rss_idle = za.as_ref().map_or(0.0, |z| z.rss_kib() as f64 / 1024.0);
            for (placement, target) in [("same_node", "srv-a"), ("cross_node", "srv-b")] {
                if cli.placement.as_ref().is_some_and(|p| p != placement) {
                    continue;
                }
                let m = measure(&cluster, target, &p, &tools, [za.as_ref(), zb.as_ref()]);
                let slot = samples
                    .entry(scenario.into())
                    .or_default()
                    .entry(placement.into())
                    .or_default();
                for (k, v) in m {
                    slot.entry(k).or_default().push(v);
                }
                if za.is_some() {
                    slot.entry("rss_idle_mb".into()).or_default().push(rss_idle);
                }
            }
            if let Some(z) = za.as_ref().filter(|_| p.wants("hold")) {
                let mb = hold_rss(cluster.pod("client"), cluster.pod("srv-b"), p.hold, z);
                for placement in ["same_node", "cross_node"] {
                    samples
                        .entry(scenario.into())
                        .or_default()
                        .entry(placement.into())
                        .or_default()
                        .entry("rss_10k_conns_mb".into())
                        .or_default()
                        .push(mb);
                }
            }
            stop(za, zb);
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
    let result = json!({
        "runs": runs,
        "load_generators": generators,
        "quick": cli.quick,
        "hold_connections": p.hold,
        "targets": report::targets(&scen),
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

fn round(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn raise_nofile() {
    let lim = libc::rlimit {
        rlim_cur: 65536,
        rlim_max: 65536,
    };
    // SAFETY: plain setrlimit with a valid struct.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim) };
}

fn start(
    cluster: &Cluster,
    [na, nb]: [usize; 2],
    scenario: &str,
    config: &str,
    more: &[String],
) -> (Option<Ztunnel>, Option<Ztunnel>) {
    let extra: Vec<&str> = match scenario {
        "mesh-ebpf" => vec!["--sockmap", "on"],
        "mesh-ebpf-nosockmap" => vec!["--sockmap", "off"],
        "mesh-iptables" => vec!["--capture", "iptables"],
        _ => return (None, None),
    };
    let mut args = vec![
        "--config",
        config,
        "--cleanup",
        "--drain-timeout",
        "1",
        "--log",
        "warn,access=off,ztunnel::app=info,ztunnel::enrol=info",
    ];
    args.extend(extra);
    args.extend(more.iter().map(String::as_str));
    let za = Ztunnel::start(cluster, na, &args);
    let zb = Ztunnel::start(cluster, nb, &args);
    za.wait_for_log("pod enrolled pod=srv-a", Duration::from_secs(15));
    za.wait_for_log("pod enrolled pod=client", Duration::from_secs(15));
    zb.wait_for_log("pod enrolled pod=srv-b", Duration::from_secs(15));
    (Some(za), Some(zb))
}

fn stop(za: Option<Ztunnel>, zb: Option<Ztunnel>) {
    for mut z in [za, zb].into_iter().flatten() {
        z.stop();
    }
}
