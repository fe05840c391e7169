//! The measurements of one scenario and placement, with the trusted tools
//! when installed ([`crate::tools`]) or the built-in load generators
//! (`zt-probe`), and the proxies' CPU and memory readings (the ztunnels',
//! or the relays' of `bare-relay`).

use std::{net::SocketAddr, time::Duration};

use ztunnel_tests::{Cluster, Pod, probe_bin, process::PodProcess, ztunnel::Ztunnel};

use crate::{
    Params,
    scenario::{DIGEST_PORT, Dial, ECHO_PORT},
    tools::{self, IPERF3_PORT, NGINX_PORT, RrFigures, SOCKPERF_PORT, Tools},
};

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

/// CPU seconds used so far by each proxy process: the sum of every
/// thread's on-CPU time from `/proc/PID/task/*/schedstat` (nanoseconds;
/// `/proc/PID/stat` counts 10 ms ticks, too coarse for a 1k/s phase).
fn cpu_seconds(pids: &[u32]) -> Vec<f64> {
    pids.iter()
        .filter(|pid| **pid != 0)
        .map(|pid| {
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
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

/// Runs `work` (one request/response phase) and returns its figures with
/// the CPU the proxies (`pids`) used meanwhile, as cores per 1,000
/// requests/s: (both together, the busier one).
fn with_cpu(
    pids: &[u32],
    work: impl FnOnce() -> Option<RrFigures>,
) -> (Option<RrFigures>, Option<(f64, f64)>) {
    let cpu0 = cpu_seconds(pids);
    let t0 = std::time::Instant::now();
    let figures = work();
    let wall = t0.elapsed().as_secs_f64();
    let used: Vec<f64> = cpu_seconds(pids)
        .iter()
        .zip(&cpu0)
        .map(|(b, a)| b - a)
        .collect();
    let rps = figures.map_or(0.0, |f| f.rps);
    if used.is_empty() || rps <= 0.0 || wall <= 0.0 {
        return (figures, None);
    }
    // (cpu / wall) / (rps / 1000). The load generator runs at a steady
    // rate for its whole life (sockperf's warm-up too), so its start-up is
    // the only part of `wall` without load: a few milliseconds.
    let per_1k = |cpu: f64| (cpu / wall) / (rps / 1000.0);
    let total: f64 = used.iter().sum();
    let busiest = used.iter().copied().fold(0.0, f64::max);
    (figures, Some((per_1k(total), per_1k(busiest))))
}

fn builtin_rr(client: &Pod, args: &[String], limit: Duration) -> Option<RrFigures> {
    let out = probe(client, args, limit);
    Some(RrFigures {
        p50_us: num(&out, "p50_us")?,
        p99_us: num(&out, "p99_us")?,
        p999_us: num(&out, "p999_us")?,
        rps: num(&out, "rps")?,
    })
}

/// Request/response at maximum rate (`rate` None) or at a fixed rate.
fn rr(client: &Pod, dial: Dial, p: &Params, tools: &Tools, rate: Option<u64>) -> Option<RrFigures> {
    let limit = Duration::from_secs(p.seconds * 4 + 60);
    if let Some(sockperf) = &tools.sockperf {
        let seconds = if rate.is_some() {
            p.rr_fixed_seconds
        } else {
            p.seconds
        };
        let (figures, out) =
            tools::sockperf(sockperf, client, dial.addr(SOCKPERF_PORT), seconds, rate);
        if figures.is_none() {
            eprintln!("zt-bench: sockperf gave no figures; its output:\n{out}");
        }
        return figures;
    }
    let echo = dial.addr(ECHO_PORT).to_string();
    let count = match rate {
        Some(_) => p.rr_fixed_count,
        None => p.rr_count,
    };
    let mut args: Vec<String> = [
        "rr",
        "--connect",
        &echo,
        "--count",
        &count.to_string(),
        "--size",
        "1024",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    if let Some(rate) = rate {
        args.extend(["--rate".to_owned(), rate.to_string()]);
    }
    builtin_rr(client, &args, limit)
}

/// Every measurement of one placement: the load generators run in the
/// client's pod and dial `dial` for the servers in `target`'s pod; the CPU
/// figures are those of the proxy processes `pids` (none: no CPU figures).
pub fn measure(
    cluster: &Cluster,
    target: &str,
    dial: Dial,
    p: &Params,
    tools: &Tools,
    pids: &[u32],
) -> Vec<(String, f64)> {
    let client = cluster.pod("client");
    let srv = cluster.pod(target);
    let echo = dial.addr(ECHO_PORT).to_string();
    let sink = dial.addr(DIGEST_PORT).to_string();
    let secs = p.seconds.to_string();
    let limit = Duration::from_secs(p.seconds * 4 + 60);
    let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<String>>();
    let mut out = Vec::new();
    if p.wants("bulk") {
        // The last one is the download direction (server to client): the
        // built-in probe has no sending server, so that figure needs iperf3.
        for (metric, streams, reverse) in [
            ("throughput_gbps", 1, false),
            ("throughput4_gbps", 4, false),
            ("throughput_rev_gbps", 1, true),
        ] {
            let gbps = if let Some(iperf3) = &tools.iperf3 {
                tools::iperf3(
                    iperf3,
                    client,
                    srv,
                    dial.addr(IPERF3_PORT),
                    p.seconds,
                    streams,
                    reverse,
                )
            } else if reverse {
                continue;
            } else {
                let streams = streams.to_string();
                let args = s(&[
                    "bulk",
                    "--connect",
                    &sink,
                    "--seconds",
                    &secs,
                    "--streams",
                    &streams,
                ]);
                num(&probe(client, &args, limit), "gbps")
            };
            out.push((metric.into(), gbps.unwrap_or(0.0)));
        }
    }
    for (wanted, rate, prefix, cpu_keys) in [
        (
            "rr",
            None,
            "rr",
            ["cpu_per_1k_rps_max_rate", "cpu_per_1k_rps_max_rate_one"],
        ),
        (
            "rr-fixed",
            Some(p.rr_fixed_rate),
            "rr_fixed",
            ["cpu_per_1k_rps", "cpu_per_1k_rps_one"],
        ),
    ] {
        if !p.wants(wanted) {
            continue;
        }
        let (figures, cpu) = with_cpu(pids, || rr(client, dial, p, tools, rate));
        let f = figures.unwrap_or(RrFigures {
            p50_us: 0.0,
            p99_us: 0.0,
            p999_us: 0.0,
            rps: 0.0,
        });
        out.push((format!("{prefix}_p50_us"), f.p50_us));
        out.push((format!("{prefix}_p99_us"), f.p99_us));
        out.push((format!("{prefix}_p999_us"), f.p999_us));
        if let Some((total, busiest)) = cpu {
            out.push((cpu_keys[0].into(), total));
            out.push((cpu_keys[1].into(), busiest));
        }
    }
    if p.wants("connrate") {
        let per_s = if let Some((ab, _)) = &tools.ab_nginx {
            tools::ab(ab, client, dial.addr(NGINX_PORT), p.ab_requests)
        } else {
            let args = s(&[
                "connrate",
                "--connect",
                &echo,
                "--seconds",
                &secs,
                "--workers",
                "4",
            ]);
            num(&probe(client, &args, limit), "per_s")
        };
        out.push(("conn_per_s".into(), per_s.unwrap_or(0.0)));
    }
    out
}

/// ztunnel (node a) RSS in MiB while the client holds `n` connections.
pub fn hold_rss(client: &Pod, srv: &Pod, n: usize, z: &Ztunnel) -> f64 {
    let mut cmd = client.command(&probe_bin());
    cmd.args([
        "hold",
        "--connect",
        &SocketAddr::from((srv.ip, ECHO_PORT)).to_string(),
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
