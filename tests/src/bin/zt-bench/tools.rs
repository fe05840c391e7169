//! The load generators people already trust, used when they are installed
//! (`cargo xtask bench` installs them from Debian's packages for a full
//! run): `iperf3` for bulk throughput, `sockperf ping-pong` for
//! request/response latency (it reports half the round trip, like our
//! built-in probe), and `ab` against `nginx` serving a 1-byte file for new
//! connections per second. The choice is made once per benchmark run, so
//! every scenario is measured with the same tool. A tool that hangs is
//! killed and its figure is missing, which fails the run at the end
//! instead of stopping it midway.

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use ztunnel_tests::{Cluster, Pod, process::PodProcess};

/// Port of the iperf3 server in every server pod.
pub const IPERF3_PORT: u16 = 5201;
/// Port of the sockperf server.
pub const SOCKPERF_PORT: u16 = 11111;
/// Port nginx listens on.
pub const NGINX_PORT: u16 = 8081;

/// The external tools found on this machine (`None`: use the built-in
/// probe for that measurement).
#[derive(Debug, Default)]
pub struct Tools {
    pub iperf3: Option<PathBuf>,
    pub sockperf: Option<PathBuf>,
    /// `ab` and `nginx`, which only make sense together.
    pub ab_nginx: Option<(PathBuf, PathBuf)>,
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

impl Tools {
    /// Looks the tools up on `PATH` (and the sbin folders, for nginx).
    pub fn detect() -> Self {
        Self {
            iperf3: which("iperf3"),
            sockperf: which("sockperf"),
            ab_nginx: which("ab").zip(which("nginx")),
        }
    }

    /// Which generator measures what, for the report.
    pub fn describe(&self) -> String {
        let pick = |found: bool, tool: &str, builtin: &str| {
            if found {
                tool.to_owned()
            } else {
                format!("{builtin} (built-in zt-probe; {tool} not installed)")
            }
        };
        format!(
            "bulk: {}; request/response: {}; new connections: {}",
            pick(self.iperf3.is_some(), "iperf3", "zt-probe bulk"),
            pick(self.sockperf.is_some(), "sockperf ping-pong", "zt-probe rr"),
            pick(self.ab_nginx.is_some(), "ab + nginx", "zt-probe connrate"),
        )
    }

    /// Starts the servers of the found tools in `pod`; they stop when the
    /// returned processes are dropped.
    pub fn start_servers(&self, cluster: &Cluster, pod: &Pod) -> Vec<PodProcess> {
        let mut servers = Vec::new();
        let ip = pod.ip.to_string();
        let pod_ip = IpAddr::V4(pod.ip);
        if let Some(sockperf) = &self.sockperf {
            let mut cmd = pod.command(sockperf);
            cmd.args([
                "server",
                "--tcp",
                "-i",
                &ip,
                "-p",
                &SOCKPERF_PORT.to_string(),
            ]);
            servers.push(PodProcess::spawn("sockperf-server", cmd));
        }
        if let Some((_, nginx)) = &self.ab_nginx {
            let conf = nginx_config(cluster.dir(), &pod.name, pod_ip);
            let mut cmd = pod.command(nginx);
            cmd.arg("-c").arg(&conf).args(["-e", "stderr"]);
            servers.push(PodProcess::spawn("nginx", cmd));
        }
        // The servers bind their ports within milliseconds; give them a
        // moment so the first measurement does not race them.
        std::thread::sleep(Duration::from_millis(300));
        servers
    }
}

/// A single-process nginx serving `/1b` (one byte) on the pod's IP, with
/// every file it writes inside the cluster's scratch folder.
fn nginx_config(dir: &Path, pod: &str, ip: IpAddr) -> PathBuf {
    let root = dir.join("www");
    let _ = std::fs::create_dir_all(&root);
    let _ = std::fs::write(root.join("1b"), "x");
    let tmp = dir.join(format!("nginx-{pod}-tmp"));
    let _ = std::fs::create_dir_all(&tmp);
    let listen = match ip {
        IpAddr::V4(v4) => format!("{v4}:{NGINX_PORT}"),
        IpAddr::V6(v6) => format!("[{v6}]:{NGINX_PORT}"),
    };
    let conf = format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {pid};\nerror_log stderr warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {tmp}/body;\n  proxy_temp_path {tmp}/proxy;\n  \
         fastcgi_temp_path {tmp}/fastcgi;\n  uwsgi_temp_path {tmp}/uwsgi;\n  scgi_temp_path {tmp}/scgi;\n  \
         server {{ listen {listen}; root {root}; }}\n}}\n",
        pid = dir.join(format!("nginx-{pod}.pid")).display(),
        tmp = tmp.display(),
        root = root.display(),
    );
    let path = dir.join(format!("nginx-{pod}.conf"));
    let _ = std::fs::write(&path, conf);
    path
}

/// Runs a tool in `pod`; its stdout, or `None` when it had to be killed
/// after `limit`.
fn run(pod: &Pod, program: &Path, args: &[String], limit: Duration) -> Option<String> {
    let mut cmd = pod.command(program);
    cmd.args(args);
    let done = PodProcess::spawn("bench-tool", cmd).try_wait(limit);
    if done.is_none() {
        eprintln!(
            "zt-bench: {} {} hung; killed after {limit:?}",
            program.display(),
            args.join(" ")
        );
    }
    done.map(|d| d.stdout)
}

/// One iperf3 measurement: a fresh one-off server (`-s -1`) in `server`
/// and a client in `client` dialling `dial` (the server's port, or a relay
/// in front of it); Gbit/s received over `seconds`. A stale
/// long-lived iperf3 server can wedge a later test (seen once in a
/// 16-minute run), so every attempt starts its own, and a failed attempt
/// is retried once.
pub fn iperf3(
    iperf3: &Path,
    client: &Pod,
    server: &Pod,
    dial: SocketAddr,
    seconds: u64,
    streams: usize,
    reverse: bool,
) -> Option<f64> {
    let port = IPERF3_PORT.to_string();
    let ip = server.ip.to_string();
    for attempt in 1..=2 {
        let mut cmd = server.command(iperf3);
        cmd.args(["-s", "-1", "-B", &ip, "-p", &port]);
        let listener = PodProcess::spawn("iperf3-server", cmd);
        std::thread::sleep(Duration::from_millis(200));
        let mut args: Vec<String> = [
            "-c",
            &dial.ip().to_string(),
            "-p",
            &dial.port().to_string(),
            "-t",
            &seconds.to_string(),
            "-P",
            &streams.to_string(),
            "--connect-timeout",
            "5000",
            "-J",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        if reverse {
            // The server sends: the client still opens the connection (so
            // the client's ztunnel captures it), but the bytes flow back
            // through the server's ztunnel's HTTP/2 writes.
            args.push("-R".into());
        }
        let out =
            run(client, iperf3, &args, Duration::from_secs(seconds * 3 + 30)).unwrap_or_default();
        drop(listener);
        if let Some(gbps) = parse_iperf3(&out) {
            return Some(gbps);
        }
        eprintln!("zt-bench: iperf3 attempt {attempt} gave no figure; its output:\n{out}");
    }
    None
}

fn parse_iperf3(json: &str) -> Option<f64> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .map(|bps| bps / 1e9)
}

/// Request/response figures: half round trips in µs, and requests/s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RrFigures {
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub rps: f64,
}

/// `sockperf ping-pong` to `dial` (the sockperf server's port or a relay
/// in front of it) with 1 KiB messages for `seconds`, at maximum rate or
/// `rate` messages per second. Returns the figures and sockperf's whole
/// output (for the log when parsing fails).
pub fn sockperf(
    sockperf: &Path,
    client: &Pod,
    dial: SocketAddr,
    seconds: u64,
    rate: Option<u64>,
) -> (Option<RrFigures>, String) {
    let mut args: Vec<String> = [
        "ping-pong",
        "--tcp",
        "-i",
        &dial.ip().to_string(),
        "-p",
        &dial.port().to_string(),
        "-m",
        "1024",
        "-t",
        &seconds.to_string(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    if let Some(rate) = rate {
        args.push(format!("--mps={rate}"));
    }
    let out = run(
        client,
        sockperf,
        &args,
        Duration::from_secs(seconds * 3 + 30),
    )
    .unwrap_or_default();
    (parse_sockperf(&out), out)
}

fn parse_sockperf(out: &str) -> Option<RrFigures> {
    let percentile = |p: &str| {
        out.lines()
            .find(|l| l.contains(&format!("percentile {p} =")))
            .and_then(|l| l.rsplit('=').next())
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    // "[Valid Duration] RunTime=0.550 sec; SentMessages=17013; ReceivedMessages=17013"
    let valid = out.lines().find(|l| l.contains("[Valid Duration]"))?;
    let field = |key: &str| {
        valid
            .split(';')
            .find_map(|part| {
                part.trim()
                    .split_once('=')
                    .filter(|(k, _)| k.ends_with(key))
            })
            .and_then(|(_, v)| v.trim().trim_end_matches(" sec").parse::<f64>().ok())
    };
    let runtime = field("RunTime")?;
    let received = field("ReceivedMessages")?;
    Some(RrFigures {
        p50_us: percentile("50.000")?,
        p99_us: percentile("99.000")?,
        p999_us: percentile("99.900")?,
        rps: if runtime > 0.0 {
            received / runtime
        } else {
            0.0
        },
    })
}

/// `ab -n requests -c 4` for `/1b` on nginx at `dial` (nginx's port or a
/// relay in front of it): new connections (HTTP/1.0, one request each) per
/// second; `None` when any request failed.
pub fn ab(ab: &Path, client: &Pod, dial: SocketAddr, requests: usize) -> Option<f64> {
    // SocketAddr's Display brackets an IPv6 address, as a URL needs.
    let url = format!("http://{dial}/1b");
    let args = vec![
        "-q".to_owned(),
        "-n".to_owned(),
        requests.to_string(),
        "-c".to_owned(),
        "4".to_owned(),
        url,
    ];
    let out = run(client, ab, &args, Duration::from_secs(120))?;
    parse_ab(&out)
}

fn parse_ab(out: &str) -> Option<f64> {
    let value = |key: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    if value("Failed requests:")? > 0.0 || value("Non-2xx responses:").is_some() {
        return None;
    }
    value("Requests per second:")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sockperf_summary() {
        let out = "sockperf: [Total Run] RunTime=1.000 sec; Warm up time=400 msec; SentMessages=30956; ReceivedMessages=30955\n\
            sockperf: ========= Printing statistics for Server No: 0\n\
            sockperf: [Valid Duration] RunTime=0.550 sec; SentMessages=17013; ReceivedMessages=17013\n\
            sockperf: ---> percentile 99.999 =  794.037\n\
            sockperf: ---> percentile 99.900 =   65.602\n\
            sockperf: ---> percentile 99.000 =   30.421\n\
            sockperf: ---> percentile 50.000 =   15.058\n";
        let f = parse_sockperf(out).expect("parsed");
        assert!((f.p50_us - 15.058).abs() < 1e-9);
        assert!((f.p99_us - 30.421).abs() < 1e-9);
        assert!((f.p999_us - 65.602).abs() < 1e-9);
        assert!((f.rps - 17013.0 / 0.55).abs() < 1e-6);
        assert_eq!(parse_sockperf("sockperf: ERROR: connect failed"), None);
    }

    #[test]
    fn parses_iperf3_json() {
        let json = r#"{"end": {"sum_received": {"bits_per_second": 2500000000.0}}}"#;
        assert_eq!(parse_iperf3(json), Some(2.5));
        assert_eq!(parse_iperf3(r#"{"error": "unable to connect"}"#), None);
    }

    #[test]
    fn parses_ab_and_refuses_failures() {
        let ok = "Complete requests:      3000\nFailed requests:        0\nRequests per second:    1234.56 [#/sec] (mean)\n";
        assert_eq!(parse_ab(ok), Some(1234.56));
        let failed = "Complete requests:      3000\nFailed requests:        3\nRequests per second:    1234.56 [#/sec] (mean)\n";
        assert_eq!(parse_ab(failed), None);
    }
}
