//! `zt-demo` (run by `cargo xtask demo`): builds a two-node cluster in
//! network namespaces, starts one real ztunnel per node, drives scripted
//! flows with real client and server processes, and reports what was
//! observed: what the server saw, what ztunnel logged, what the kernel
//! counted, and what crossed the fabric.
//!
//! Every column is an observation of that one connection, never a guess
//! from the client's exit status. The client prints its local port, and
//! ztunnel's access-log lines are matched by it (`src_addr` of the source
//! node's outbound leg and of a plaintext inbound leg); an HBONE inbound leg
//! logs the tunnel's address instead, which `ss` finds in the client pod.
//! Flows run one at a time, so the capture counters' deltas and the
//! servers' `ACCEPT` lines during a flow belong to it. A flow is `ok` when
//! every observed fact equals what it is expected to show, and the demo is
//! `ok` when every flow is and both ztunnels still run at the end.

use std::{
    collections::HashMap,
    io::Write as _,
    net::{IpAddr, SocketAddr},
    path::Path,
    time::{Duration, Instant},
};

use clap::Parser;
use serde_json::{Value, json};
use ztunnel::capture::counters::CounterSnapshot;
use ztunnel_common::{Counter, INBOUND_HBONE_PORT, SOCKS5_PORT};
use ztunnel_tests::{
    Cluster, Pod,
    flows::{self, ClientRun, WorkloadEntry},
    istiod::FakeIstiod,
    pattern,
    process::PodProcess,
    sniff::Sniffer,
    ztunnel::Ztunnel,
};

/// Where a kept demo records the processes `--clean` must stop.
const KEPT: &str = "/run/ztunnel-demo";
const BYTES: u64 = 1 << 20;
const VIP: [u8; 4] = [10, 96, 0, 10];
const NODES: [&str; 2] = ["node-a", "node-b"];
/// The pods running an echo server on 8080.
const SERVER_PODS: [&str; 4] = ["app-a2", "app-b1", "app-b2", "plain-b"];
/// What ztunnel's access log writes before the fields of one connection.
const ACCESS_LINE: &str = " access: connection ";
/// Prefix of the demo's SPIFFE identities (service account = pod name).
const SPIFFE: &str = "spiffe://cluster.local/ns/demo/sa/";
/// How long to wait for a connection's access-log lines: an allowed
/// connection's line is written when ztunnel closes it, just after the
/// client's last read, a denial's before the client sees the failure.
/// Seconds are far above both even on a busy 2-core runner.
const ACCESS_WAIT: Duration = Duration::from_secs(3);
/// Once a line of the connection is there, how long the set must stay
/// unchanged: the other node's leg of the same connection is written
/// within milliseconds of the first.
const ACCESS_SETTLE: Duration = Duration::from_millis(300);
/// How long a server is polled for one more `ACCEPT` line. It prints the
/// line on accept, long before the client has its 1 MiB echoed.
const ACCEPT_POLL: Duration = Duration::from_millis(50);
/// Upper bound for `ss` listing the client pod's sockets.
const SS_WAIT: Duration = Duration::from_secs(5);

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
    /// Where the mesh comes from: `local` (the YAML file) or `xds` (the
    /// same YAML served by a fake istiod over delta ADS, with its CA; pods
    /// enrolled over the socket).
    #[arg(long, value_enum, default_value_t = ControlPlane::Local)]
    control_plane: ControlPlane,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ControlPlane {
    Local,
    Xds,
}

struct Flow {
    name: &'static str,
    from: &'static str,
    to: &'static str,
    dst: SocketAddr,
    socks_name: Option<&'static str>,
    expect: Expect,
}

/// What a flow must show; each field is compared with its observation.
struct Expect {
    /// `allowed` or `denied`.
    result: &'static str,
    /// The `path` ztunnel logs for it (`denied` for a denial).
    path: &'static str,
    /// The capture hooks that count it, `hook@node`, `+`-joined (see
    /// [`capture`]); `none` when the application dials ztunnel itself (SOCKS5).
    capture: &'static str,
    /// Pods whose identity may be logged as its source; empty: no identity.
    src: &'static [&'static str],
    /// Pods whose identity may be logged as its destination; empty: none.
    dst: &'static [&'static str],
    /// Servers that may accept it; empty: no server may see it.
    servers: &'static [&'static str],
    /// Whether the payload's marker crosses the fabric in clear; `None`: not
    /// asserted (a refused plaintext client may have sent some before the reset).
    clear: Option<bool>,
}

/// One access-log line of the connection: the event's fields (not the span's).
struct AccessLine {
    node: &'static str,
    fields: HashMap<String, String>,
}

impl AccessLine {
    fn get(&self, key: &str) -> &str {
        self.fields.get(key).map_or("", String::as_str)
    }
}

/// What was observed of one flow's connection.
struct Observed {
    /// The client's last line (`RESULT ...`, `READ-ERROR ...`, ...).
    client: String,
    /// The client's connection as ztunnel logs its source.
    key: Option<SocketAddr>,
    checksum_ok: bool,
    /// Its lines in ztunnel's access log.
    legs: Vec<AccessLine>,
    /// See [`capture`].
    capture: Vec<(String, u64)>,
    /// `ACCEPT` lines the servers printed: (server pod, peer IP).
    accepts: Vec<(&'static str, String)>,
    clear: bool,
}

impl Observed {
    /// The leg that decides path and identities: the source node's outbound
    /// leg, or the inbound one when there is none (plaintext client, or a
    /// stream refused at the destination).
    fn leg(&self) -> Option<&AccessLine> {
        self.legs
            .iter()
            .find(|l| l.get("direction") == "outbound")
            .or(self.legs.first())
    }

    /// `denied` only when ztunnel logged a denial of this connection; a
    /// client failure without one is an unexplained `error`.
    fn result(&self) -> &'static str {
        if self.legs.iter().any(|l| l.get("result") == "denied") {
            "denied"
        } else if self.checksum_ok {
            "allowed"
        } else {
            "error"
        }
    }

    fn path(&self) -> &str {
        self.leg().map_or("unobserved", |l| l.get("path"))
    }

    fn identity(&self, key: &str) -> &str {
        self.leg().map_or("", |l| l.get(key))
    }

    /// The capture hooks that moved, `+`-joined, or `none`.
    fn captured(&self) -> String {
        let hooks: Vec<&str> = self.capture.iter().map(|(h, _)| h.as_str()).collect();
        if hooks.is_empty() {
            "none".to_owned()
        } else {
            hooks.join("+")
        }
    }

    fn server_saw(&self) -> String {
        let peers: Vec<&str> = self.accepts.iter().map(|(_, p)| p.as_str()).collect();
        peers.join(",")
    }
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

/// Enrols `pod` into `z` over the socket, as istio-cni would.
fn enrol(z: &Ztunnel, cluster: &Cluster, pod: &str, namespace: &str) {
    let out = std::process::Command::new(ztunnel_tests::ztunnel::sibling_bin("ztunnel"))
        .arg("enrol")
        .arg("--socket")
        .arg(&z.socket)
        .args(["add", "--uid", pod, "--netns"])
        .arg(cluster.pod(pod).netns_path())
        .args([
            "--name",
            pod,
            "--namespace",
            namespace,
            "--service-account",
            pod,
        ])
        .output()
        .unwrap_or_else(|e| panic!("ztunnel enrol: {e}"));
    assert!(out.status.success(), "enrol {pod}: {out:?}");
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

#[allow(clippy::too_many_lines)] // the script: one flow per entry, read top to bottom
fn flows(cluster: &Cluster) -> Vec<Flow> {
    let at = |pod: &str| SocketAddr::from((cluster.pod(pod).ip, 8080));
    vec![
        Flow {
            name: "cross-node",
            from: "app-a1",
            to: "node-b/app-b1",
            dst: at("app-b1"),
            socks_name: None,
            expect: Expect {
                result: "allowed",
                path: "hbone",
                capture: "connect@node-a",
                src: &["app-a1"],
                dst: &["app-b1"],
                servers: &["app-b1"],
                clear: Some(false),
            },
        },
        Flow {
            name: "same-node",
            from: "app-a1",
            to: "node-a/app-a2",
            dst: at("app-a2"),
            socks_name: None,
            expect: Expect {
                result: "allowed",
                path: "local",
                capture: "connect@node-a",
                src: &["app-a1"],
                dst: &["app-a2"],
                servers: &["app-a2"],
                clear: Some(false),
            },
        },
        Flow {
            name: "service-vip",
            from: "app-a1",
            to: "service web.demo",
            dst: SocketAddr::from((VIP, 80)),
            socks_name: None,
            expect: Expect {
                result: "allowed",
                path: "hbone",
                capture: "connect@node-a",
                src: &["app-a1"],
                dst: &["app-b1", "app-b2"],
                servers: &["app-b1", "app-b2"],
                clear: Some(false),
            },
        },
        Flow {
            name: "passthrough",
            from: "app-a1",
            to: "node-b/plain-b",
            dst: at("plain-b"),
            socks_name: None,
            expect: Expect {
                result: "allowed",
                path: "passthrough",
                capture: "connect@node-a",
                src: &["app-a1"],
                dst: &[],
                servers: &["plain-b"],
                clear: Some(true),
            },
        },
        Flow {
            name: "plaintext-permissive",
            from: "plain-a",
            to: "node-b/app-b1",
            dst: at("app-b1"),
            socks_name: None,
            expect: Expect {
                result: "allowed",
                path: "plaintext",
                capture: "sk_lookup@node-b",
                src: &[],
                dst: &["app-b1"],
                servers: &["app-b1"],
                clear: Some(true),
            },
        },
        Flow {
            name: "plaintext-strict",
            from: "plain-a",
            to: "node-b/app-b2",
            dst: at("app-b2"),
            socks_name: None,
            expect: Expect {
                result: "denied",
                path: "denied",
                capture: "sk_lookup@node-b",
                src: &[],
                dst: &["app-b2"],
                servers: &[],
                clear: None,
            },
        },
        Flow {
            name: "policy-denied",
            from: "app-a2",
            to: "node-b/app-b2",
            dst: at("app-b2"),
            socks_name: None,
            expect: Expect {
                result: "denied",
                path: "denied",
                capture: "connect@node-a",
                src: &["app-a2"],
                dst: &["app-b2"],
                servers: &[],
                clear: Some(false),
            },
        },
        Flow {
            name: "socks5",
            from: "app-a1",
            to: "node-b/app-b1 (name app-b1.demo)",
            dst: at("app-b1"),
            socks_name: Some("app-b1.demo"),
            expect: Expect {
                result: "allowed",
                path: "hbone",
                capture: "none",
                src: &["app-a1"],
                dst: &["app-b1"],
                servers: &["app-b1"],
                clear: Some(false),
            },
        },
    ]
}

/// A table line; `say_row(&HEADER)` prints the header.
fn say_row(c: &[&str; 13]) {
    say(&format!(
        "{:<22} {:<16} {:<34} {:<8} {:<8} {:<12} {:<17} {:<40} {:<40} {:<14} {:<9} {:<6} {}",
        c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], c[12]
    ));
}

const HEADER: [&str; 13] = [
    "flow",
    "from",
    "to",
    "expect",
    "result",
    "path",
    "captured",
    "src identity",
    "dst identity",
    "server saw",
    "bytes ok",
    "clear?",
    "check",
];

fn run(cli: &Cli) -> bool {
    let started = Instant::now();
    say("[1/4] building the cluster: fabric bridge, 2 nodes, 6 pods ...");
    let mut cluster = Cluster::new();
    let na = cluster.add_node(NODES[0]);
    let nb = cluster.add_node(NODES[1]);
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
    let mut servers: Vec<(&'static str, PodProcess)> = SERVER_PODS
        .iter()
        .map(|p| {
            let pod = cluster.pod(p);
            (
                *p,
                flows::server(pod, SocketAddr::from((pod.ip, 8080)), "echo"),
            )
        })
        .collect();
    // With xDS the fake istiod runs on a third node of the fabric.
    let istiod = (cli.control_plane == ControlPlane::Xds).then(|| {
        let istiod = FakeIstiod::on_new_node(&mut cluster);
        let mesh =
            ztunnel::state::local::load(Path::new(&config)).unwrap_or_else(|e| panic!("{e}"));
        let (addresses, policies) = ztunnel_tests::ads::from_local(&mesh);
        for (name, address) in &addresses {
            istiod.xds.set_address(name, address);
        }
        for policy in &policies {
            istiod.xds.set_policy(policy);
        }
        istiod
    });
    let (za, zb) = match &istiod {
        None => (
            Ztunnel::start(&cluster, na, &["--config", &config]),
            Ztunnel::start(&cluster, nb, &["--config", &config]),
        ),
        Some(istiod) => {
            let mut args = istiod.ztunnel_args();
            args.extend(istiod.xds_args());
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let za = Ztunnel::start(&cluster, na, &args);
            let zb = Ztunnel::start(&cluster, nb, &args);
            // istio-cni's part: each meshed pod enrolled with its own uid.
            for w in entries().iter().filter(|w| w.enrolled) {
                let z = if w.node == NODES[0] { &za } else { &zb };
                enrol(z, &cluster, &w.pod, w.namespace);
            }
            (za, zb)
        }
    };
    za.wait_for_log("pod enrolled pod=app-a2", Duration::from_secs(15));
    zb.wait_for_log("pod enrolled pod=app-b2", Duration::from_secs(15));
    let zs = [&za, &zb];

    say("[3/4] running the flows (1 MiB echoed each way, checksummed; fabric sniffed) ...");
    say_row(&HEADER);
    let marker = pattern::slice(BYTES / 2, 48);
    let mut rows = Vec::new();
    for flow in &flows(&cluster) {
        let obs = observe(flow, &cluster, zs, &mut servers, &marker);
        let mismatches = check(flow, &obs, &cluster);
        let node = &cluster.node(cluster.pod(flow.from).node).name;
        say_row(&[
            flow.name,
            &format!("{node}/{}", flow.from),
            flow.to,
            flow.expect.result,
            obs.result(),
            obs.path(),
            &obs.captured(),
            obs.identity("src_identity"),
            obs.identity("dst_identity"),
            &obs.server_saw(),
            if obs.checksum_ok { "yes" } else { "-" },
            if obs.clear { "CLEAR" } else { "no" },
            if mismatches.is_empty() {
                "ok"
            } else {
                "MISMATCH"
            },
        ]);
        rows.push(row(flow, &obs, &cluster, &mismatches));
    }
    for row in rows.iter().filter(|r| r["ok"] != true) {
        let why: Vec<&str> = row["mismatches"]
            .as_array()
            .map(|m| m.iter().filter_map(|v| v.as_str()).collect())
            .unwrap_or_default();
        say(&format!(
            "  {}: {}",
            row["name"].as_str().unwrap_or_default(),
            why.join("; ")
        ));
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
    let running = zs.map(|z| alive(z.pid()));
    say(&format!(
        "ztunnel still running: {} {}, {} {}",
        NODES[0],
        if running[0] { "yes" } else { "NO" },
        NODES[1],
        if running[1] { "yes" } else { "NO" },
    ));
    let differing: Vec<&str> = rows
        .iter()
        .filter(|r| r["ok"] != true)
        .filter_map(|r| r["name"].as_str())
        .collect();
    let all_ok = differing.is_empty() && !hbone_clear && running.iter().all(|r| *r);
    say(&format!(
        "done in {:.1?}: {}",
        started.elapsed(),
        if all_ok {
            "every flow as expected".to_owned()
        } else if differing.is_empty() {
            "SOMETHING DIFFERS FROM EXPECTATIONS (see above)".to_owned()
        } else {
            format!("FLOWS DIFFER FROM EXPECTATIONS: {}", differing.join(", "))
        }
    ));

    if cli.keep {
        let processes: Vec<u32> = servers.iter().map(|(_, p)| p.pid()).collect();
        keep(&cluster, &za, &zb, &processes);
        std::mem::forget(servers);
        std::mem::forget(za);
        std::mem::forget(zb);
        std::mem::forget(cluster);
    }
    if cli.json {
        let kernel = nix::sys::utsname::uname()
            .map(|u| u.release().to_string_lossy().into_owned())
            .unwrap_or_default();
        let out = json!({
            "ok": all_ok,
            "kernel": kernel,
            "capture": "ebpf",
            "control_plane": if istiod.is_some() { "xds" } else { "local" },
            "ztunnels_running": {NODES[0]: running[0], NODES[1]: running[1]},
            "flows": rows,
        });
        println!("{out}");
    }
    all_ok
}

/// Runs `flow`'s client and gathers what the servers, ztunnel's access
/// log, the capture counters and the fabric's sniffer saw of it.
fn observe(
    flow: &Flow,
    cluster: &Cluster,
    zs: [&Ztunnel; 2],
    servers: &mut [(&'static str, PodProcess)],
    marker: &[u8],
) -> Observed {
    let from = cluster.pod(flow.from);
    let counters_before = zs.map(Ztunnel::counters);
    let access_before = zs.map(|z| z.count_log_lines(&[ACCESS_LINE]));
    let _late = accepts(servers); // nothing of an earlier flow counts
    let sniffer = Sniffer::start(&cluster.fabric().path(), marker);
    let run = ClientRun {
        bytes: BYTES,
        limit: Duration::from_secs(20),
        connect_timeout: 3,
        socks: flow.socks_name.map(|n| {
            (
                SocketAddr::from(([127, 0, 0, 1], SOCKS5_PORT)),
                Some(n.to_owned()),
            )
        }),
        ..ClientRun::default()
    };
    let done = flows::client(from, flow.dst, &run);
    let (clear, _frames) = sniffer.finish();
    let key = client_key(&done.stdout, from);
    let legs = access_legs(
        zs,
        access_before,
        key.ok_or((IpAddr::from(from.ip), flow.dst)),
        &tunnels(from),
    );
    Observed {
        client: done.stdout.lines().last().unwrap_or_default().to_owned(),
        key,
        checksum_ok: done.status.success() && done.stdout.contains("RESULT ok"),
        legs,
        capture: capture(&counters_before, &zs.map(Ztunnel::counters)),
        accepts: accepts(servers),
        clear,
    }
}

/// The flow's JSON object: the table's columns plus what they came from.
fn row(flow: &Flow, obs: &Observed, cluster: &Cluster, mismatches: &[String]) -> Value {
    let from = cluster.pod(flow.from);
    json!({
        "name": flow.name,
        "from": format!("{}/{}", cluster.node(from.node).name, flow.from),
        "to": flow.to,
        "dst": flow.dst.to_string(),
        "expect": flow.expect.result,
        "result": obs.result(),
        "path": obs.path(),
        "captured": !obs.capture.is_empty(),
        "capture": obs.captured(),
        "capture_counts": obs.capture.iter().cloned().collect::<HashMap<_, _>>(),
        "src_identity": obs.identity("src_identity"),
        "dst_identity": obs.identity("dst_identity"),
        "client_addr": obs.key.map(|k| k.to_string()).unwrap_or_default(),
        "client_said": obs.client,
        "server": obs.accepts.iter().map(|(s, _)| *s).collect::<Vec<_>>().join(","),
        "server_saw_peer": obs.server_saw(),
        "bytes": if obs.checksum_ok { BYTES } else { 0 },
        "checksum_ok": obs.checksum_ok,
        "plaintext_on_wire": obs.clear,
        "access_log": obs.legs.iter().map(describe).collect::<Vec<_>>(),
        "expected": {
            "result": flow.expect.result,
            "path": flow.expect.path,
            "capture": flow.expect.capture,
            "src_identity": flow.expect.src,
            "dst_identity": flow.expect.dst,
            "servers": flow.expect.servers,
            "plaintext_on_wire": flow.expect.clear,
        },
        "ok": mismatches.is_empty(),
        "mismatches": mismatches,
    })
}

/// Every difference between what `flow` must show and what was observed.
fn check(flow: &Flow, obs: &Observed, cluster: &Cluster) -> Vec<String> {
    let e = &flow.expect;
    let mut m = Vec::new();
    let mut differs = |what: &str, seen: &str, want: &str| {
        if seen != want {
            m.push(format!("{what}: observed {seen:?}, expected {want:?}"));
        }
    };
    differs("result", obs.result(), e.result);
    differs("path", obs.path(), e.path);
    differs("captured", &obs.captured(), e.capture);
    let allowed = if e.result == "allowed" { "yes" } else { "no" };
    differs(
        "bytes ok",
        if obs.checksum_ok { "yes" } else { "no" },
        allowed,
    );
    if let Some(clear) = e.clear {
        differs("clear", &obs.clear.to_string(), &clear.to_string());
    }
    for (key, pods) in [("src_identity", e.src), ("dst_identity", e.dst)] {
        let seen = obs.identity(key);
        let fits = if pods.is_empty() {
            seen.is_empty()
        } else {
            pods.iter().any(|p| seen == format!("{SPIFFE}{p}"))
        };
        if !fits {
            m.push(format!(
                "{key}: observed {seen:?}, expected that of {pods:?}"
            ));
        }
    }
    let client_ip = IpAddr::from(cluster.pod(flow.from).ip);
    match (obs.accepts.as_slice(), e.servers) {
        ([], []) => {}
        (seen, []) => m.push(format!("servers: {seen:?} accepted it, expected none")),
        ([(server, peer)], servers) => {
            if !servers.contains(server) {
                m.push(format!(
                    "servers: {server} accepted it, expected one of {servers:?}"
                ));
            }
            if peer.parse::<IpAddr>().ok() != Some(client_ip) {
                m.push(format!(
                    "server saw peer {peer:?}, expected the client's {client_ip}"
                ));
            }
            let logged = obs.leg().map(|l| l.get("dst_addr")).unwrap_or_default();
            let logged_ip = logged.parse::<SocketAddr>().ok().map(|a| a.ip());
            if logged_ip != Some(IpAddr::from(cluster.pod(server).ip)) {
                m.push(format!(
                    "servers: {server} accepted it, ztunnel logged dst_addr {logged:?}"
                ));
            }
        }
        (seen, _) => m.push(format!("servers: expected one ACCEPT, observed {seen:?}")),
    }
    // A refused connect can be reset before the client learns its port;
    // its legs were then found by address (see `access_legs`).
    let refused_early = flow.expect.result == "denied" && !obs.legs.is_empty();
    if obs.key.is_none() && !refused_early {
        m.push(format!("client printed no local address: {:?}", obs.client));
    }
    m
}

/// The client's connection as ztunnel logs its source: the pod's address
/// and the client's local port (a captured client's socket is bound to
/// 127.0.0.1; ztunnel logs the pod's address with the same port).
fn client_key(stdout: &str, pod: &Pod) -> Option<SocketAddr> {
    let local: SocketAddr = stdout
        .split_whitespace()
        .find_map(|w| w.strip_prefix("local="))?
        .parse()
        .ok()?;
    Some(SocketAddr::from((pod.ip, local.port())))
}

/// Local addresses of the pod's HBONE tunnels (established connections to
/// port 15008): the source that an HBONE inbound leg logs, since the
/// destination sees the tunnel, not the client's port. Pooled tunnels live
/// for minutes, so the one that carried the flow is still there.
fn tunnels(pod: &Pod) -> Vec<SocketAddr> {
    let mut cmd = pod.command(Path::new("ss"));
    cmd.args(["-Htn", "state", "established"]);
    let Some(done) = PodProcess::spawn("ss", cmd).try_wait(SS_WAIT) else {
        return Vec::new();
    };
    done.stdout
        .lines()
        .filter_map(|line| {
            let addrs: Vec<SocketAddr> = line
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            match addrs[..] {
                [local, peer] if peer.port() == INBOUND_HBONE_PORT => Some(local),
                _ => None,
            }
        })
        .collect()
}

/// The access-log lines written since `skip` (per ztunnel) whose `src_addr`
/// is the client's connection or one of its pod's tunnels; waits for them
/// to appear and settle, at most [`ACCESS_WAIT`]. A client whose connect
/// itself was reset (a fast refusal on a loaded machine) printed no local
/// port: then `key` is `Err((pod IP, destination))` and the lines from
/// that pod's address to that destination are its (flows run one at a
/// time, and `skip` leaves out the earlier ones).
fn access_legs(
    zs: [&Ztunnel; 2],
    skip: [usize; 2],
    key: Result<SocketAddr, (IpAddr, SocketAddr)>,
    tunnels: &[SocketAddr],
) -> Vec<AccessLine> {
    let mine = |l: &AccessLine| {
        let src = l.get("src_addr").parse::<SocketAddr>();
        match key {
            Ok(key) => src.is_ok_and(|a| a == key || tunnels.contains(&a)),
            Err((pod, dst)) => {
                src.is_ok_and(|a| a.ip() == pod)
                    && l.get("dst_addr").parse::<SocketAddr>() == Ok(dst)
            }
        }
    };
    let deadline = Instant::now() + ACCESS_WAIT;
    let mut seen = Vec::new();
    let mut unchanged_since = Instant::now();
    loop {
        let now: Vec<AccessLine> = (0..2)
            .flat_map(|i| {
                zs[i]
                    .log()
                    .lines()
                    .filter_map(|l| l.split_once(ACCESS_LINE))
                    .skip(skip[i])
                    .map(|(_, event)| AccessLine {
                        node: NODES[i],
                        fields: fields(event),
                    })
                    .collect::<Vec<_>>()
            })
            .filter(|l| mine(l))
            .collect();
        if now.len() != seen.len() {
            seen = now;
            unchanged_since = Instant::now();
        }
        if (!seen.is_empty() && unchanged_since.elapsed() >= ACCESS_SETTLE)
            || Instant::now() >= deadline
        {
            return seen;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `key=value` and `key="quoted value"` pairs of a log event.
fn fields(event: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut rest = event.trim_start();
    while let Some((key, after)) = rest.split_once('=') {
        let (value, next) = if let Some(quoted) = after.strip_prefix('"') {
            // Debug-quoted: ends at the first quote not escaped by a backslash.
            let mut escaped = false;
            let end = quoted
                .char_indices()
                .find(|&(_, c)| {
                    let closes = c == '"' && !escaped;
                    escaped = c == '\\' && !escaped;
                    closes
                })
                .map_or(quoted.len(), |(i, _)| i);
            (&quoted[..end], quoted.get(end + 1..).unwrap_or_default())
        } else {
            after.split_at(after.find(' ').unwrap_or(after.len()))
        };
        out.insert(key.trim().to_owned(), value.to_owned());
        rest = next.trim_start();
    }
    out
}

fn describe(l: &AccessLine) -> String {
    format!(
        "{} {} path={} result={} src_addr={} dst_addr={}",
        l.node,
        l.get("direction"),
        l.get("path"),
        l.get("result"),
        l.get("src_addr"),
        l.get("dst_addr")
    )
}

/// The capture hooks that counted something during the flow, as
/// (`hook@node`, count): the connect hook redirecting a pod's connect to its
/// outbound listener, and `sk_lookup` steering a plaintext connection into
/// the destination pod's inbound listener. Only which hooks moved is
/// compared: `sk_lookup` also runs for segments that arrive after ztunnel
/// closed a refused connection (its client still sending), so its count is
/// per lookup, not per connection. HBONE steering is left out: tunnels are
/// pooled, so it counts tunnels, not connections.
fn capture(before: &[CounterSnapshot; 2], after: &[CounterSnapshot; 2]) -> Vec<(String, u64)> {
    let mut hooks = Vec::new();
    for ((node, before), after) in NODES.iter().zip(before).zip(after) {
        for (counter, hook) in [
            (Counter::ConnectRedirected, "connect"),
            (Counter::LookupSteeredPlaintext, "sk_lookup"),
        ] {
            let n = after.get(counter).saturating_sub(before.get(counter));
            if n > 0 {
                hooks.push((format!("{hook}@{node}"), n));
            }
        }
    }
    hooks
}

/// The `ACCEPT` lines the servers printed since the last call, as (server
/// pod, peer IP).
fn accepts(servers: &mut [(&'static str, PodProcess)]) -> Vec<(&'static str, String)> {
    let mut seen = Vec::new();
    for (pod, server) in servers {
        while let Some(line) = server.try_read_line(ACCEPT_POLL) {
            if let Some(peer) = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("peer="))
            {
                let ip = peer.rsplit_once(':').map_or(peer, |(ip, _)| ip);
                seen.push((*pod, ip.trim_matches(['[', ']']).to_owned()));
            }
        }
    }
    seen
}

/// Whether `pid` still runs: a crashed ztunnel stays a zombie until reaped.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with(['Z', 'X']))
    })
}

fn keep(cluster: &Cluster, za: &Ztunnel, zb: &Ztunnel, servers: &[u32]) {
    let _ = std::fs::create_dir_all(KEPT);
    let pids: Vec<String> = [za.pid(), zb.pid()]
        .into_iter()
        .chain(servers.iter().copied())
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
