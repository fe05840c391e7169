//! Waypoints: a service or workload with a waypoint is reached through it,
//! over HBONE to the waypoint with `:authority` = the address the client
//! dialled; a waypoint that cannot be found refuses the connection; traffic
//! that goes around the waypoint meets the destination's L4 policy (Istio's
//! rule), which is how a mesh makes the waypoint mandatory.
//!
//! The waypoint is `zt-waypoint`: a small HBONE server in its own pod (not
//! enrolled, as Istio's waypoints are not) with the identity
//! `spiffe://cluster.local/ns/test/sa/waypoint`, which records what it
//! received and carries the stream on over HBONE to the destination.

use std::{net::SocketAddr, time::Duration};

use ztunnel_tests::{
    Cluster,
    flows::{self, ClientRun, WorkloadEntry},
    probe_bin,
    process::PodProcess,
    require_root,
    ztunnel::Ztunnel,
};

const WAYPOINT_ID: &str = "spiffe://cluster.local/ns/test/sa/waypoint";
const A1_ID: &str = "spiffe://cluster.local/ns/test/sa/a1";
const B1_ID: &str = "spiffe://cluster.local/ns/test/sa/b1";
/// The service with a waypoint (named by hostname).
const WEB_VIP: &str = "10.96.0.10:80";
/// A service whose waypoint does not exist.
const ORPHAN_VIP: &str = "10.96.0.11:80";

const SERVICES: &str = "services:
  - {name: web, namespace: test, vips: [10.96.0.10], ports: [{port: 80, targetPort: 8080}], endpoints: [b1], waypoint: {hostname: waypoint.test.svc.cluster.local, namespace: test}}
  - {name: waypoint, namespace: test, vips: [10.96.0.9], ports: [{port: 15008}], endpoints: [waypoint]}
  - {name: orphan, namespace: test, vips: [10.96.0.11], ports: [{port: 80, targetPort: 8080}], endpoints: [b1], waypoint: {hostname: missing.test.svc.cluster.local}}
policies:
  - {name: only-through-waypoint, namespace: test, selector: {app: guarded}, action: ALLOW, rules: [{from: [{principals: [\"spiffe://cluster.local/ns/test/sa/waypoint\"]}]}]}
";

/// A `RECORD` line of the waypoint, or a panic naming what it printed.
fn record(waypoint: &mut PodProcess) -> String {
    for _ in 0..20 {
        let line = waypoint.read_line(Duration::from_secs(10));
        if line.starts_with("RECORD") {
            return line;
        }
        eprintln!("waypoint: {line}");
    }
    panic!("no RECORD line from the waypoint");
}

/// One `CONNECT` from the rogue pod straight to b1's 15008 as `identity`.
fn direct(cluster: &Cluster, identity: &str) -> String {
    let b1 = cluster.pod("b1");
    let mut cmd = cluster
        .pod("rogue")
        .command(&probe_bin().with_file_name("zt-waypoint"));
    cmd.arg("--ca-dir")
        .arg(cluster.dir().join("dev-ca"))
        .args(["--identity", identity, "connect", "--to"])
        .arg(format!("{}:15008", b1.ip))
        .arg("--authority")
        .arg(format!("{}:8080", b1.ip))
        .args(["--expect", B1_ID]);
    let done = PodProcess::spawn("rogue", cmd).wait(Duration::from_secs(60));
    assert!(done.status.success(), "zt-waypoint connect: {done:?}");
    done.stdout
        .lines()
        .find(|l| l.starts_with("RESULT"))
        .unwrap_or_else(|| panic!("no RESULT: {done:?}"))
        .to_owned()
}

#[test]
fn waypoints_carry_traffic_addressed_to_their_service_or_workload() {
    if !require_root("waypoints_carry_traffic_addressed_to_their_service_or_workload") {
        return;
    }
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    let b = cluster.add_node("node-b");
    cluster.add_pod(a, "a1");
    cluster.add_pod(a, "waypoint");
    cluster.add_pod(b, "b1");
    cluster.add_pod(b, "rogue");
    let config = flows::write_config_with(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("a1", "node-a"),
            // Not enrolled (Istio does not capture waypoints), but in the
            // mesh: peers reach it over HBONE with its identity.
            WorkloadEntry {
                enrolled: false,
                ..WorkloadEntry::enrolled("waypoint", "node-a")
            },
            // b1's workload waypoint names the waypoint's service by VIP.
            WorkloadEntry {
                extra: "    labels: {app: guarded}\n    waypoint: {address: 10.96.0.9}",
                ..WorkloadEntry::enrolled("b1", "node-b")
            },
            WorkloadEntry::outside("rogue", "node-b"),
        ],
        SERVICES,
    );
    let config = config.to_str().expect("utf-8");
    let za = Ztunnel::start(&cluster, a, &["--config", config]);
    let zb = Ztunnel::start(&cluster, b, &["--config", config]);
    za.wait_for_log("pod enrolled pod=a1", Duration::from_secs(10));
    zb.wait_for_log("pod enrolled pod=b1", Duration::from_secs(10));

    let (a1, b1, wp) = (
        cluster.pod("a1"),
        cluster.pod("b1"),
        cluster.pod("waypoint"),
    );
    let b1_addr = SocketAddr::from((b1.ip, 8080));
    let mut server = flows::server(b1, b1_addr, "echo");
    let mut cmd = wp.command(&probe_bin().with_file_name("zt-waypoint"));
    cmd.arg("--ca-dir")
        .arg(cluster.dir().join("dev-ca"))
        .args(["--identity", WAYPOINT_ID, "serve", "--route"])
        .arg(format!("{WEB_VIP}={b1_addr}"))
        .args(["--upstream-identity", B1_ID]);
    let mut waypoint = PodProcess::spawn("waypoint", cmd);
    let ready = waypoint.read_line(Duration::from_secs(10));
    assert!(ready.starts_with("READY"), "{ready}");
    let run = ClientRun {
        bytes: 200_000,
        limit: Duration::from_secs(30),
        ..ClientRun::default()
    };

    // To the service: through its waypoint (by hostname), which sees the
    // VIP as authority, the client's identity and the service's hostname.
    flows::assert_ok(&flows::client(a1, WEB_VIP.parse().expect("vip"), &run));
    let seen = record(&mut waypoint);
    assert!(seen.contains(&format!("authority={WEB_VIP} ")), "{seen}");
    assert!(seen.contains(&format!("peer={A1_ID} ")), "{seen}");
    assert!(seen.contains("host=web.test.svc.cluster.local"), "{seen}");
    // b1 was reached by the waypoint, not by a1.
    let peer = flows::last_peer(&mut server);
    assert!(peer.starts_with(&format!("{}:", wp.ip)), "b1 saw {peer}");
    let opened = za
        .log()
        .lines()
        .find(|l| l.contains("outbound connection opened") && l.contains(WEB_VIP))
        .map(str::to_owned)
        .expect("outbound log line");
    assert!(
        opened.contains("waypoint=true")
            && opened.contains(&format!("hbone_peer={}:15008", wp.ip))
            && opened.contains(&format!("dst_identity={WAYPOINT_ID}")),
        "{opened}"
    );

    // To the workload's own address: through its waypoint (by the
    // waypoint service's VIP), authority = the pod's address.
    flows::assert_ok(&flows::client(a1, b1_addr, &run));
    let seen = record(&mut waypoint);
    assert!(seen.contains(&format!("authority={b1_addr} ")), "{seen}");
    assert!(seen.contains(&format!("peer={A1_ID} ")), "{seen}");
    let peer = flows::last_peer(&mut server);
    assert!(peer.starts_with(&format!("{}:", wp.ip)), "b1 saw {peer}");

    // A waypoint that cannot be found: refused, never sent around it.
    let done = flows::client(a1, ORPHAN_VIP.parse().expect("vip"), &run);
    assert!(
        !done.stdout.contains("RESULT ok"),
        "a service whose waypoint is missing was reached: {done:?}"
    );
    za.wait_for_log(
        "the destination's waypoint is not in the mesh state",
        Duration::from_secs(5),
    );

    // Around the waypoint, straight to b1's 15008: b1's ztunnel applies
    // its L4 policy, which admits only the waypoint. The same request
    // with the waypoint's identity passes, so it is the policy that
    // refused a1's.
    let bypass = direct(&cluster, A1_ID);
    assert!(
        bypass.contains("echoed=false") && !bypass.contains("status=200"),
        "a request around the waypoint reached b1: {bypass}"
    );
    let allowed = direct(&cluster, WAYPOINT_ID);
    assert!(
        allowed.contains("status=200 echoed=true"),
        "the waypoint's own identity was refused: {allowed}"
    );
    zb.wait_for_log("only-through-waypoint", Duration::from_secs(5));
}
