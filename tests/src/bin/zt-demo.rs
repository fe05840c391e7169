//! `zt-demo` (run by `cargo xtask demo`): builds a two-node cluster in
//! network namespaces, starts one real ztunnel per node, drives scripted
//! flows with real client and server processes, and reports what was
//! observed: what the server saw, what ztunnel logged, what the kernel
//! counted, and what crossed the fabric.

use std::{
    io::Write as _,
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use clap::Parser;
use serde_json::json;
use ztunnel_common::Counter;
use ztunnel_tests::{
    Cluster,
    flows::{self, ClientRun, WorkloadEntry},
    pattern,
    process::PodProcess,
    sniff::Sniffer,
    ztunnel::Ztunnel,
};

/// Where a kept demo records the processes `--clean` must stop.
const KEPT: &str = "/run/ztunnel-demo";
const BYTES: u64 = 1 << 20;
const VIP: &str = "10.96.0.10";

#[derive(Parser)]
#[command(about = "ztunnel-rs demo: a two-node mesh in network namespaces")]
struct Cli {
    /// Print one JSON object at the end (after the human output).
    #[arg(long)]
    json: bool,
    /// Leave the cluster running and print how to poke at it.
    #[arg(long)]
    keep: bool,
    /// Remove a cluster left by `--keep`, then exit.
    #[arg(long)]
    clean: bool,
}

struct Flow {
    name: &'static str,
    from: &'static str,
    to: String,
    dst: SocketAddr,
    expect: &'static str,
    /// Server whose ACCEPT line tells the peer it saw.
    server: Option<usize>,
    socks_name: Option<&'static str>,
}

fn say(msg: &str) {
    println!("{msg}");
    let _ = std::io::stdout().flush();
}

fn main() {
    let cli = Cli::parse();
    if cli.clean {
        clean();
        return;
    }
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "zt-demo needs root: it creates network namespaces, cgroups and loads eBPF programs"
        );
        std::process::exit(2);
    }
    let ok = run(&cli);
    std::process::exit(i32::from(!ok));
}

fn clean() {
    if let Ok(pids) = std::fs::read_to_string(Path::new(KEPT).join("pids")) {
        for pid in pids.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    ztunnel_tests::sweep::stale();
    let _ = std::fs::remove_dir_all(KEPT);
    say("demo cluster removed");
}

fn entries() -> Vec<WorkloadEntry> {
    let e = |pod: &str, node: &str, labels: &'static str| WorkloadEntry {
        namespace: "demo",
        extra: labels,
        ..WorkloadEntry::enrolled(pod, node)
    };
    vec![
        e("app-a1", "node-a", "    labels: {app: a1}"),
        e("app-a2", "node-a", "    labels: {app: a2}"),
        e("app-b1", "node-b", "    labels: {app: b1}"),
        e("app-b2", "node-b", "    labels: {app: b2}"),
        WorkloadEntry {
            namespace: "demo",
            ..WorkloadEntry::outside("plain-a", "node-a")
        },
        WorkloadEntry {
            namespace: "demo",
            ..WorkloadEntry::outside("plain-b", "node-b")
        },
    ]
}

const MESH_EXTRA: &str = "services:
  - {name: web, namespace: demo, vips: [10.96.0.10], ports: [{port: 80, targetPort: 8080}], endpoints: [app-b1, app-b2]}
policies:
  - name: deny-a2-to-b2
    namespace: demo
    selector: {app: b2}
    action: DENY
    rules: [{from: [{principals: [\"spiffe://cluster.local/ns/demo/sa/app-a2\"]}]}]
peerAuthentications:
  - {namespace: demo, selector: {app: b2}, mode: STRICT}
";

#[allow(clippy::too_many_lines)] // one scripted story, easier to read in one piece
fn run(cli: &Cli) -> bool {
    let started = Instant::now();
    say("[1/4] building the cluster: fabric bridge, 2 nodes, 6 pods ...");
    let mut cluster = Cluster::new();
    let na = cluster.add_node("node-a");
    let nb = cluster.add_node("node-b");
    for (node, pod) in [
        (na, "app-a1"),
        (na, "app-a2"),
        (na, "plain-a"),
        (nb, "app-b1"),
        (nb, "app-b2"),
        (nb, "plain-b"),
    ] {
        cluster.add_pod(node, pod);
    }
    let config = flows::write_config_with(&cluster, "mesh.yaml", &entries(), MESH_EXTRA);
    let config = config.to_str().unwrap_or_default().to_owned();

    say("[2/4] starting servers and one ztunnel per node ...");
    let server_pods = ["app-a2", "app-b1", "app-b2", "plain-b"];
    let mut servers: Vec<PodProcess> = server_pods
        .iter()
        .map(|p| {
            let pod = cluster.pod(p);
            flows::server(pod, SocketAddr::from((pod.ip, 8080)), "echo")
        })
        .collect();
    let za = Ztunnel::start(&cluster, na, &["--config", &config]);
    let zb = Ztunnel::start(&cluster, nb, &["--config", &config]);
    za.wait_for_log("pod enrolled pod=app-a2", Duration::from_secs(15));
    zb.wait_for_log("pod enrolled pod=app-b2", Duration::from_secs(15));
    let ip = |p: &str| cluster.pod(p).ip;
    let flows_list = vec![
        Flow {
            name: "cross-node",
            from: "app-a1",
            to: "node-b/app-b1".into(),
            dst: SocketAddr::from((ip("app-b1"), 8080)),
            expect: "allowed",
            server: Some(1),
            socks_name: None,
        },
        Flow {
            name: "same-node",
            from: "app-a1",
            to: "node-a/app-a2".into(),
            dst: SocketAddr::from((ip("app-a2"), 8080)),
            expect: "allowed",
            server: Some(0),
            socks_name: None,
        },
        Flow {
            name: "service-vip",
            from: "app-a1",
            to: "service web.demo".into(),
            dst: format!("{VIP}:80")
                .parse()
                .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0))),
            expect: "allowed",
            server: None,
            socks_name: None,
        },
        Flow {
            name: "passthrough",
            from: "app-a1",
            to: "node-b/plain-b".into(),
            dst: SocketAddr::from((ip("plain-b"), 8080)),
            expect: "allowed",
            server: Some(3),
            socks_name: None,
        },
        Flow {
            name: "plaintext-permissive",
            from: "plain-a",
            to: "node-b/app-b1".into(),
            dst: SocketAddr::from((ip("app-b1"), 8080)),
            expect: "allowed",
            server: Some(1),
            socks_name: None,
        },
        Flow {
            name: "plaintext-strict",
            from: "plain-a",
            to: "node-b/app-b2".into(),
            dst: SocketAddr::from((ip("app-b2"), 8080)),
            expect: "denied",
            server: None,
            socks_name: None,
        },
        Flow {
            name: "policy-denied",
            from: "app-a2",
            to: "node-b/app-b2".into(),
            dst: SocketAddr::from((ip("app-b2"), 8080)),
            expect: "denied",
            server: None,
            socks_name: None,
        },
        Flow {
            name: "socks5",
            from: "app-a1",
            to: "node-b/app-b1 (name app-b1.demo)".into(),
            dst: SocketAddr::from((ip("app-b1"), 8080)),
            expect: "allowed",
            server: Some(1),
            socks_name: Some("app-b1.demo"),
        },
    ];

    say("[3/4] running the flows (1 MiB echoed each way, checksummed; fabric sniffed) ...");
    say(&format!(
        "{:<22} {:<16} {:<34} {:<8} {:<8} {:<12} {:<40} {:<40} {:<16} {:<9} {:<6}",
        "flow",
        "from",
        "to",
        "expect",
        "result",
        "path",
        "src identity",
        "dst identity",
        "server saw",
        "bytes ok",
        "clear?"
    ));
    let marker = pattern::slice(BYTES / 2, 48);
    let mut rows = Vec::new();
    let mut all_ok = true;
    for flow in &flows_list {
        let from = cluster.pod(flow.from);
        let (src_z, dst_z) = if from.node == na {
            (&za, &zb)
        } else {
            (&zb, &za)
        };
        let before_src = src_z.counters();
        let before_dst = [za.counters(), zb.counters()];
        let access_before = [
            za.count_log_lines(&["access"]),
            zb.count_log_lines(&["access"]),
        ];
        let sniffer = Sniffer::start(&cluster.fabric().path(), &marker);
        let run = ClientRun {
            bytes: BYTES,
            limit: Duration::from_secs(20),
            connect_timeout: 3,
            socks: flow.socks_name.map(|n| {
                (
                    "127.0.0.1:15080".parse().unwrap_or(flow.dst),
                    Some(n.to_owned()),
                )
            }),
            ..ClientRun::default()
        };
        let done = flows::client(from, flow.dst, &run);
        let (clear, _frames) = sniffer.finish();
        let checksum_ok = done.status.success() && done.stdout.contains("RESULT ok");
        let result = if checksum_ok { "allowed" } else { "denied" };
        let server_saw = if checksum_ok {
            match flow.server {
                Some(i) => flows::last_peer(&mut servers[i]),
                None => peer_from_any(&mut servers, &[1, 2]),
            }
        } else {
            String::new()
        };
        std::thread::sleep(Duration::from_millis(150));
        let after_src = src_z.counters();
        let after_dst = [za.counters(), zb.counters()];
        let captured = after_src.get(Counter::ConnectRedirected)
            > before_src.get(Counter::ConnectRedirected)
            || (0..2).any(|i| {
                after_dst[i].get(Counter::LookupSteeredPlaintext)
                    > before_dst[i].get(Counter::LookupSteeredPlaintext)
            });
        let access = newest_access(
            &[(&za, access_before[0]), (&zb, access_before[1])],
            flow.dst,
            dst_z,
        );
        // ztunnel's own words, mapped onto the demo's vocabulary: a
        // plaintext inbound leg is not tunnelled, so it is "passthrough".
        let path = if checksum_ok {
            match field(&access, "path").as_deref() {
                Some("hbone") => "hbone".to_owned(),
                Some("local") => "local".to_owned(),
                _ => "passthrough".to_owned(),
            }
        } else {
            "denied".to_owned()
        };
        let row = json!({
            "name": flow.name,
            "from": format!("{}/{}", cluster.node(from.node).name, flow.from),
            "to": flow.to,
            "dst": flow.dst.to_string(),
            "expect": flow.expect,
            "result": result,
            "path": path,
            "captured": captured,
            "src_identity": field(&access, "src_identity").unwrap_or_default(),
            "dst_identity": field(&access, "dst_identity").unwrap_or_default(),
            "server_saw_peer": server_saw.rsplit_once(':').map_or(server_saw.clone(), |(ip, _)| ip.trim_matches(['[', ']']).to_owned()),
            "bytes": if checksum_ok { BYTES } else { 0 },
            "checksum_ok": checksum_ok,
            "plaintext_on_wire": clear,
        });
        all_ok &= result == flow.expect;
        say(&format!(
            "{:<22} {:<16} {:<34} {:<8} {:<8} {:<12} {:<40} {:<40} {:<16} {:<9} {:<6}",
            flow.name,
            row["from"].as_str().unwrap_or_default(),
            flow.to,
            flow.expect,
            result,
            row["path"].as_str().unwrap_or_default(),
            row["src_identity"].as_str().unwrap_or_default(),
            row["dst_identity"].as_str().unwrap_or_default(),
            row["server_saw_peer"].as_str().unwrap_or_default(),
            if checksum_ok { "yes" } else { "-" },
            if clear { "CLEAR" } else { "no" },
        ));
        rows.push(row);
    }
    let hbone_clear = rows
        .iter()
        .any(|r| r["path"] == "hbone" && r["plaintext_on_wire"] == true);
    say(&format!(
        "[4/4] fabric check: marker seen in clear on an HBONE flow: {} (plain TCP flows show it, as they should: {})",
        if hbone_clear { "YES (bad)" } else { "never" },
        rows.iter()
            .filter(|r| r["plaintext_on_wire"] == true)
            .count()
    ));
    all_ok &= !hbone_clear;
    say(&format!(
        "done in {:.1?}: {}",
        started.elapsed(),
        if all_ok {
            "every flow as expected"
        } else {
            "SOME FLOWS DIFFER FROM EXPECTATIONS"
        }
    ));

    if cli.keep {
        keep(&cluster, &za, &zb, &servers);
        std::mem::forget(servers);
        std::mem::forget(za);
        std::mem::forget(zb);
        std::mem::forget(cluster);
    }
    if cli.json {
        let kernel = nix::sys::utsname::uname()
            .map(|u| u.release().to_string_lossy().into_owned())
            .unwrap_or_default();
        let out = json!({"ok": all_ok, "kernel": kernel, "capture": "ebpf", "flows": rows});
        println!("{out}");
    }
    all_ok
}

fn peer_from_any(servers: &mut [PodProcess], candidates: &[usize]) -> String {
    for &i in candidates {
        if let Some(line) = servers[i].try_read_line(Duration::from_millis(300))
            && let Some(peer) = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("peer="))
        {
            return peer.to_owned();
        }
    }
    String::new()
}

/// The newest access-log line (since the flow started) about `dst` or its
/// endpoint, preferring the destination node's record.
fn newest_access(zs: &[(&Ztunnel, usize)], dst: SocketAddr, prefer: &Ztunnel) -> String {
    let lines = |z: &Ztunnel, skip: usize| -> Vec<String> {
        z.log()
            .lines()
            .filter(|l| l.contains("access"))
            .skip(skip)
            .map(str::to_owned)
            .collect()
    };
    let mut found = String::new();
    for (z, skip) in zs {
        let mine = lines(z, *skip);
        let pick = mine
            .iter()
            .rev()
            .find(|l| l.contains(&dst.to_string()))
            .or_else(|| mine.last())
            .cloned()
            .unwrap_or_default();
        if !pick.is_empty() && (found.is_empty() || std::ptr::eq(*z, prefer)) {
            found = pick;
        }
    }
    found
}

/// `key=value` or `key="value"` from a log line.
fn field(line: &str, key: &str) -> Option<String> {
    let start = line.find(&format!(" {key}="))? + key.len() + 2;
    let rest = &line[start..];
    if rest.is_empty() || rest.starts_with(' ') {
        return None;
    }
    let value = if let Some(quoted) = rest.strip_prefix('"') {
        quoted.split('"').next()?
    } else {
        rest.split_whitespace().next()?
    };
    (!value.is_empty()).then(|| value.to_owned())
}

fn keep(cluster: &Cluster, za: &Ztunnel, zb: &Ztunnel, servers: &[PodProcess]) {
    let _ = std::fs::create_dir_all(KEPT);
    let pids: Vec<String> = [za.pid(), zb.pid()]
        .into_iter()
        .chain(servers.iter().map(PodProcess::pid))
        .map(|p| p.to_string())
        .collect();
    let _ = std::fs::write(Path::new(KEPT).join("pids"), pids.join("\n"));
    let node = |i: usize| cluster.node(i).netns().name().to_owned();
    let pod = |p: &str| cluster.pod(p).netns().name().to_owned();
    say("\nThe cluster stays up. Try:");
    say(&format!(
        "  ip netns exec {} curl -s 127.0.0.1:15000/config_dump | head",
        node(0)
    ));
    say(&format!(
        "  ip netns exec {} curl -s 127.0.0.1:15020/metrics | grep istio_tcp",
        node(1)
    ));
    say(&format!(
        "  ip netns exec {} bash   # a shell inside pod app-a1",
        pod("app-a1")
    ));
    say(&format!("  ztunnel logs: {}", cluster.dir().display()));
    say("  cargo xtask demo --clean   # removes it");
}
