//! `zt-bench` (run by `cargo xtask bench`): the same two-node topology for
//! every scenario, scenarios interleaved, each measured `--runs` times;
//! medians are reported, with the direct (no mesh) baseline from the same
//! run.
//!
//! Scenarios: `direct` (no ztunnel), `mesh-ebpf` (sockmap on),
//! `mesh-ebpf-nosockmap`, `mesh-iptables` (`--capture iptables`). Each is
//! measured same-node (client and server pods on node a) and cross-node.
//! Load generators are built in (`zt-probe bulk|rr|connrate|hold`), so the
//! benchmark runs without extra packages; they measure the same things as
//! iperf3 (bulk, 1 and 4 streams), sockperf ping-pong (half round trip of
//! 1 KiB requests on one connection) and ab (new connection per request).

use std::{
    collections::BTreeMap, fmt::Write as _, io::Write as _, net::SocketAddr, path::PathBuf,
    time::Duration,
};

use clap::Parser;
use serde_json::{Value, json};
use ztunnel_tests::{
    Cluster, Pod,
    flows::{self, WorkloadEntry},
    probe_bin,
    process::PodProcess,
    ztunnel::Ztunnel,
};

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
}

const SCENARIOS: [&str; 4] = [
    "direct",
    "mesh-ebpf",
    "mesh-ebpf-nosockmap",
    "mesh-iptables",
];
const METRICS: [&str; 12] = [
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
    "rss_idle_mb",
    "rss_10k_conns_mb",
];

struct Params {
    seconds: u64,
    rr_count: usize,
    rr_fixed_count: usize,
    rr_fixed_rate: u64,
    hold: usize,
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
            seconds: 1,
            rr_count: 2000,
            rr_fixed_count: 500,
            rr_fixed_rate: 1000,
            hold: 1000,
        }
    } else {
        Params {
            seconds: 4,
            rr_count: 10000,
            rr_fixed_count: 3000,
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
    }

    // samples[scenario][placement][metric] = values over runs
    let mut samples: BTreeMap<String, BTreeMap<String, BTreeMap<String, Vec<f64>>>> =
        BTreeMap::new();
    for run in 1..=runs {
        for scenario in SCENARIOS {
            say(&format!("run {run}/{runs}: {scenario} ..."));
            let (za, zb) = start(&cluster, na, nb, scenario, &config);
            let rss_idle = za.as_ref().map_or(0.0, |z| z.rss_kib() as f64 / 1024.0);
            for (placement, target) in [("same_node", "srv-a"), ("cross_node", "srv-b")] {
                let m = measure(&cluster, target, &p, [za.as_ref(), zb.as_ref()]);
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
            if let Some(z) = &za {
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
    let result =
        json!({"runs": runs, "quick": cli.quick, "hold_connections": p.hold, "scenarios": scen});
    let report = markdown(&result);
    println!("{report}");
    if let Some(path) = &cli.report {
        let _ = std::fs::write(path, &report);
    }
    if cli.json {
        println!("{result}");
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
    na: usize,
    nb: usize,
    scenario: &str,
    config: &str,
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
        "warn,ztunnel::app=info,ztunnel::enrol=info",
    ];
    args.extend(extra);
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

fn probe(pod: &Pod, args: &[String], limit: Duration) -> String {
    let mut cmd = pod.command(&probe_bin());
    cmd.args(args);
    PodProcess::spawn("bench-probe", cmd).wait(limit).stdout
}

fn num(out: &str, key: &str) -> Option<f64> {
    out.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
}

/// CPU seconds used so far by the ztunnel processes.
fn cpu_seconds(zs: &[Option<&Ztunnel>; 2]) -> f64 {
    zs.iter()
        .flatten()
        .map(|z| {
            let stat =
                std::fs::read_to_string(format!("/proc/{}/stat", z.pid())).unwrap_or_default();
            let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let fields: Vec<&str> = after.split_whitespace().collect();
            let ticks: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
                + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
            ticks / 100.0
        })
        .sum()
}

fn measure(
    cluster: &Cluster,
    target: &str,
    p: &Params,
    zs: [Option<&Ztunnel>; 2],
) -> Vec<(String, f64)> {
    let client = cluster.pod("client");
    let srv = cluster.pod(target);
    let echo = SocketAddr::from((srv.ip, 8080)).to_string();
    let sink = SocketAddr::from((srv.ip, 9000)).to_string();
    let secs = p.seconds.to_string();
    let limit = Duration::from_secs(p.seconds * 4 + 60);
    let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<String>>();
    let mut out = Vec::new();
    let bulk1 = probe(
        client,
        &s(&[
            "bulk",
            "--connect",
            &sink,
            "--seconds",
            &secs,
            "--streams",
            "1",
        ]),
        limit,
    );
    out.push(("throughput_gbps".into(), num(&bulk1, "gbps").unwrap_or(0.0)));
    let bulk4 = probe(
        client,
        &s(&[
            "bulk",
            "--connect",
            &sink,
            "--seconds",
            &secs,
            "--streams",
            "4",
        ]),
        limit,
    );
    out.push((
        "throughput4_gbps".into(),
        num(&bulk4, "gbps").unwrap_or(0.0),
    ));
    let cpu0 = cpu_seconds(&zs);
    let t0 = std::time::Instant::now();
    let rr = probe(
        client,
        &s(&[
            "rr",
            "--connect",
            &echo,
            "--count",
            &p.rr_count.to_string(),
            "--size",
            "1024",
        ]),
        limit,
    );
    let (cpu, wall) = (cpu_seconds(&zs) - cpu0, t0.elapsed().as_secs_f64());
    for (k, key) in [
        ("rr_p50_us", "p50_us"),
        ("rr_p99_us", "p99_us"),
        ("rr_p999_us", "p999_us"),
    ] {
        out.push((k.into(), num(&rr, key).unwrap_or(0.0)));
    }
    if zs[0].is_some() {
        let rps = num(&rr, "rps").unwrap_or(0.0);
        if rps > 0.0 && wall > 0.0 {
            // CPU cores used per 1,000 requests/s: (cpu / wall) / (rps / 1000).
            out.push(("cpu_per_1k_rps".into(), (cpu / wall) / (rps / 1000.0)));
        }
    }
    let fixed = probe(
        client,
        &s(&[
            "rr",
            "--connect",
            &echo,
            "--count",
            &p.rr_fixed_count.to_string(),
            "--size",
            "1024",
            "--rate",
            &p.rr_fixed_rate.to_string(),
        ]),
        limit,
    );
    for (k, key) in [
        ("rr_fixed_p50_us", "p50_us"),
        ("rr_fixed_p99_us", "p99_us"),
        ("rr_fixed_p999_us", "p999_us"),
    ] {
        out.push((k.into(), num(&fixed, key).unwrap_or(0.0)));
    }
    let conn = probe(
        client,
        &s(&[
            "connrate",
            "--connect",
            &echo,
            "--seconds",
            &secs,
            "--workers",
            "4",
        ]),
        limit,
    );
    out.push(("conn_per_s".into(), num(&conn, "per_s").unwrap_or(0.0)));
    out
}

/// ztunnel (node a) RSS in MiB while the client holds `n` connections.
fn hold_rss(client: &Pod, srv: &Pod, n: usize, z: &Ztunnel) -> f64 {
    let mut cmd = client.command(&probe_bin());
    cmd.args([
        "hold",
        "--connect",
        &SocketAddr::from((srv.ip, 8080)).to_string(),
        "--count",
        &n.to_string(),
        "--seconds",
        "30",
    ]);
    let mut holder = PodProcess::spawn("hold", cmd);
    let line = holder
        .try_read_line(Duration::from_secs(180))
        .unwrap_or_default();
    let mb = if line.starts_with("HELD") {
        z.rss_kib() as f64 / 1024.0
    } else {
        0.0
    };
    drop(holder);
    std::thread::sleep(Duration::from_millis(500));
    mb
}

fn markdown(result: &Value) -> String {
    let mut out = String::new();
    let sc = &result["scenarios"];
    let hold = result["hold_connections"].as_u64().unwrap_or(0);
    let _ = writeln!(
        out,
        "| scenario | placement | Gbit/s 1 stream | Gbit/s 4 streams | RR p50 µs | RR p99 µs | RR p999 µs | RR@1k/s p50 µs | RR@1k/s p99 µs | conn/s | ztunnel CPU per 1k rps | RSS idle MiB | RSS with {hold} conns MiB |"
    );
    out.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for scenario in SCENARIOS {
        for placement in ["same_node", "cross_node"] {
            let m = &sc[scenario][placement];
            let f = |k: &str| m[k].as_f64().map_or("-".to_owned(), |v| format!("{v}"));
            let _ = writeln!(
                out,
                "| {scenario} | {placement} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                f("throughput_gbps"),
                f("throughput4_gbps"),
                f("rr_p50_us"),
                f("rr_p99_us"),
                f("rr_p999_us"),
                f("rr_fixed_p50_us"),
                f("rr_fixed_p99_us"),
                f("conn_per_s"),
                f("cpu_per_1k_rps"),
                f("rss_idle_mb"),
                f("rss_10k_conns_mb"),
            );
        }
    }
    let get = |s: &str, k: &str| sc[s]["cross_node"][k].as_f64().unwrap_or(0.0);
    let ratio = |a: f64, b: f64| {
        if b > 0.0 {
            format!("{:.2}x", a / b)
        } else {
            "-".into()
        }
    };
    out.push_str("\nCross-node ratios (same run):\n\n");
    let _ = writeln!(
        out,
        "- mesh-ebpf / mesh-iptables conn/s: {} (target >= 1.3x)",
        ratio(
            get("mesh-ebpf", "conn_per_s"),
            get("mesh-iptables", "conn_per_s")
        )
    );
    let _ = writeln!(
        out,
        "- mesh-ebpf / mesh-iptables RR p50: {} (target <= 0.8x)",
        ratio(
            get("mesh-ebpf", "rr_p50_us"),
            get("mesh-iptables", "rr_p50_us")
        )
    );
    let _ = writeln!(
        out,
        "- mesh-ebpf / mesh-iptables throughput: {} (target >= 1.0x)",
        ratio(
            get("mesh-ebpf", "throughput_gbps"),
            get("mesh-iptables", "throughput_gbps")
        )
    );
    let _ = writeln!(
        out,
        "- mesh-ebpf / direct throughput: {} (target >= 0.5x)",
        ratio(
            get("mesh-ebpf", "throughput_gbps"),
            get("direct", "throughput_gbps")
        )
    );
    let _ = writeln!(
        out,
        "- mesh-ebpf ztunnel CPU per 1k rps: {:.4} cores (target <= 0.03)",
        get("mesh-ebpf", "cpu_per_1k_rps")
    );
    let _ = writeln!(
        out,
        "- mesh-ebpf ztunnel RSS idle: {:.1} MiB (target <= 8)",
        sc["mesh-ebpf"]["cross_node"]["rss_idle_mb"]
            .as_f64()
            .unwrap_or(0.0)
    );
    out
}
