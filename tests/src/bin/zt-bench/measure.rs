//! The measurements of one scenario and placement, with the built-in load
//! generators (`zt-probe`), and the ztunnel CPU and memory readings.

use std::{net::SocketAddr, time::Duration};

use ztunnel_tests::{Cluster, Pod, probe_bin, process::PodProcess, ztunnel::Ztunnel};

use crate::Params;

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

/// CPU seconds used so far by each ztunnel process: the sum of every
/// thread's on-CPU time from `/proc/PID/task/*/schedstat` (nanoseconds;
/// `/proc/PID/stat` counts 10 ms ticks, too coarse for a 1k/s phase).
fn cpu_seconds(zs: &[Option<&Ztunnel>; 2]) -> Vec<f64> {
    zs.iter()
        .flatten()
        .map(|z| {
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", z.pid())) else {
                return 0.0;
            };
            tasks
                .flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
                .filter_map(|s| s.split_whitespace().next()?.parse::<f64>().ok())
                .sum::<f64>()
                / 1e9
        })
        .collect()
}

/// Runs one request/response probe and returns its output with the CPU
/// each ztunnel used meanwhile, as cores per 1,000 requests/s.
fn rr_with_cpu(
    client: &Pod,
    args: &[String],
    limit: Duration,
    zs: [Option<&Ztunnel>; 2],
) -> (String, Option<(f64, f64)>) {
    let cpu0 = cpu_seconds(&zs);
    let t0 = std::time::Instant::now();
    let out = probe(client, args, limit);
    let wall = t0.elapsed().as_secs_f64();
    let used: Vec<f64> = cpu_seconds(&zs)
        .iter()
        .zip(&cpu0)
        .map(|(b, a)| b - a)
        .collect();
    let rps = num(&out, "rps").unwrap_or(0.0);
    if used.is_empty() || rps <= 0.0 || wall <= 0.0 {
        return (out, None);
    }
    // Cores used per 1,000 requests/s: (cpu / wall) / (rps / 1000). The
    // probe's own start-up is inside `wall`, which only lowers the figure
    // by a few milliseconds' worth.
    let per_1k = |cpu: f64| (cpu / wall) / (rps / 1000.0);
    let total: f64 = used.iter().sum();
    let busiest = used.iter().copied().fold(0.0, f64::max);
    (out, Some((per_1k(total), per_1k(busiest))))
}

pub fn measure(
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
    if p.wants("bulk") {
        for (metric, streams) in [("throughput_gbps", "1"), ("throughput4_gbps", "4")] {
            let bulk = probe(
                client,
                &s(&[
                    "bulk",
                    "--connect",
                    &sink,
                    "--seconds",
                    &secs,
                    "--streams",
                    streams,
                ]),
                limit,
            );
            out.push((metric.into(), num(&bulk, "gbps").unwrap_or(0.0)));
        }
    }
    let count = p.rr_count.to_string();
    if p.wants("rr") {
        let args = s(&[
            "rr",
            "--connect",
            &echo,
            "--count",
            &count,
            "--size",
            "1024",
        ]);
        let (rr, cpu) = rr_with_cpu(client, &args, limit, zs);
        for (k, key) in [
            ("rr_p50_us", "p50_us"),
            ("rr_p99_us", "p99_us"),
            ("rr_p999_us", "p999_us"),
        ] {
            out.push((k.into(), num(&rr, key).unwrap_or(0.0)));
        }
        if let Some((total, busiest)) = cpu {
            out.push(("cpu_per_1k_rps_max_rate".into(), total));
            out.push(("cpu_per_1k_rps_max_rate_one".into(), busiest));
        }
    }
    if p.wants("rr-fixed") {
        let count = p.rr_fixed_count.to_string();
        let rate = p.rr_fixed_rate.to_string();
        let args = s(&[
            "rr",
            "--connect",
            &echo,
            "--count",
            &count,
            "--size",
            "1024",
            "--rate",
            &rate,
        ]);
        let (fixed, cpu) = rr_with_cpu(client, &args, limit, zs);
        for (k, key) in [
            ("rr_fixed_p50_us", "p50_us"),
            ("rr_fixed_p99_us", "p99_us"),
            ("rr_fixed_p999_us", "p999_us"),
        ] {
            out.push((k.into(), num(&fixed, key).unwrap_or(0.0)));
        }
        if let Some((total, busiest)) = cpu {
            out.push(("cpu_per_1k_rps".into(), total));
            out.push(("cpu_per_1k_rps_one".into(), busiest));
        }
    }
    if p.wants("connrate") {
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
    }
    out
}

/// ztunnel (node a) RSS in MiB while the client holds `n` connections.
pub fn hold_rss(client: &Pod, srv: &Pod, n: usize, z: &Ztunnel) -> f64 {
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
