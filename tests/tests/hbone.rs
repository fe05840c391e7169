//! HBONE between two nodes: mutual TLS with SPIFFE identities, HTTP/2
//! CONNECT, pooling, services, and refusals.

use std::{net::SocketAddr, process::Command, time::Duration};

use ztunnel_tests::{
    Cluster,
    flows::{self, ClientRun, WorkloadEntry},
    probe_bin,
    process::PodProcess,
    require_root,
    sniff::Sniffer,
    ztunnel::Ztunnel,
};

/// Two nodes; a1 on node-a, b1 on node-b, both meshed; `plain` on node-b
/// outside the mesh.
fn two_nodes() -> (Cluster, usize, usize) {
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    let b = cluster.add_node("node-b");
    cluster.add_pod(a, "a1");
    cluster.add_pod(b, "b1");
    cluster.add_pod(b, "plain");
    (cluster, a, b)
}

fn entries() -> Vec<WorkloadEntry> {
    vec![
        WorkloadEntry::enrolled("a1", "node-a"),
        WorkloadEntry::enrolled("b1", "node-b"),
        WorkloadEntry::outside("plain", "node-b"),
    ]
}

#[test]
fn cross_node_traffic_is_carried_over_mutual_tls_hbone() {
    if !require_root("cross_node_traffic_is_carried_over_mutual_tls_hbone") {
        return;
    }
    let (cluster, a, b) = two_nodes();
    let (a1, b1) = (cluster.pod("a1"), cluster.pod("b1"));
    let vip = "10.96.0.10";
    let services = format!(
        "services:\n  - name: web\n    namespace: test\n    vips: [{vip}]\n    ports: [{{port: 80, targetPort: 8080}}]\n    endpoints: [b1]\n"
    );
    let config = flows::write_config_with(&cluster, "mesh.yaml", &entries(), &services);
    let config = config.to_str().expect("utf-8");
    let dst = SocketAddr::from((b1.ip, 8080));
    let mut server = flows::server(b1, dst, "echo");
    let za = Ztunnel::start(&cluster, a, &["--config", config]);
    let zb = Ztunnel::start(&cluster, b, &["--config", config]);
    za.wait_for_log("pod enrolled", Duration::from_secs(10));
    zb.wait_for_log("pod enrolled", Duration::from_secs(10));

    // A marker that must never be seen in clear on the fabric.
    let marker = "ZT-MARKER-5f3a9c1e-plaintext-must-not-leak";
    let sniffer = Sniffer::start(&cluster.fabric().path(), marker.as_bytes());
    let mut cmd = a1.command(&probe_bin());
    cmd.args([
        "burst",
        "--connect",
        &dst.to_string(),
        "--count",
        "1",
        "--payload",
        marker,
    ]);
    let done = PodProcess::spawn("marker", cmd).wait(Duration::from_secs(30));
    assert!(done.stdout.contains("BURST ok=1 failed=0"), "{done:?}");
    let (seen, frames) = sniffer.finish();
    assert!(frames > 0, "the sniffer saw no frames at all");
    assert!(!seen, "the marker crossed the fabric in clear");

    // 1 GiB each way, checksummed; the server sees a1's own IP.
    flows::assert_ok(&flows::client(
        a1,
        dst,
        &ClientRun {
            bytes: ztunnel_tests::scaled(1 << 30),
            chunk: 256 * 1024,
            io: "poll",
            limit: Duration::from_mins(3),
            ..ClientRun::default()
        },
    ));
    let _ = flows::last_peer(&mut server);
    let peer = flows::last_peer(&mut server);
    assert!(
        peer.starts_with(&format!("{}:", a1.ip)),
        "server saw {peer}"
    );

    let a_id = "spiffe://cluster.local/ns/test/sa/a1";
    let b_id = "spiffe://cluster.local/ns/test/sa/b1";
    za.wait_for_log(&format!("dst_identity={b_id}"), Duration::from_secs(5));
    assert!(za.count_log_lines(&["path=\"hbone\"", &format!("orig_dst={dst}")]) >= 2);
    zb.wait_for_log(&format!("src_identity={a_id}"), Duration::from_secs(5));
    assert!(zb.count_log_lines(&["inbound connection opened", "path=\"hbone\""]) >= 2);

    // Through the service VIP: the endpoint and target port are chosen by
    // ztunnel, the app still talks to the VIP.
    let via_vip = flows::client(
        a1,
        format!("{vip}:80").parse().expect("vip"),
        &ClientRun::default(),
    );
    flows::assert_ok(&via_vip);
    za.wait_for_log(
        &format!("orig_dst={vip}:80 target={dst}"),
        Duration::from_secs(5),
    );

    // A pod outside the mesh is reached with plain TCP.
    let plain = cluster.pod("plain");
    let plain_dst = SocketAddr::from((plain.ip, 9090));
    let _plain_server = flows::server(plain, plain_dst, "echo");
    // Control for the sniffer: passthrough traffic is in clear, and it sees it.
    let sniffer = Sniffer::start(&cluster.fabric().path(), marker.as_bytes());
    let mut cmd = a1.command(&probe_bin());
    cmd.args([
        "burst",
        "--connect",
        &plain_dst.to_string(),
        "--count",
        "1",
        "--payload",
        marker,
    ]);
    let done = PodProcess::spawn("marker-plain", cmd).wait(Duration::from_secs(30));
    assert!(done.stdout.contains("BURST ok=1 failed=0"), "{done:?}");
    assert!(sniffer.finish().0, "the sniffer missed a plaintext marker");
    za.wait_for_log(
        &format!("orig_dst={plain_dst} target={plain_dst} path=\"passthrough\""),
        Duration::from_secs(5),
    );
}

#[test]
fn a_burst_of_connections_shares_few_tls_connections() {
    if !require_root("a_burst_of_connections_shares_few_tls_connections") {
        return;
    }
    let (cluster, a, b) = two_nodes();
    let config = flows::write_config(&cluster, "mesh.yaml", &entries());
    let config = config.to_str().expect("utf-8");
    let (a1, b1) = (cluster.pod("a1"), cluster.pod("b1"));
    let dst = SocketAddr::from((b1.ip, 8080));
    let _server = flows::server(b1, dst, "echo");
    let za = Ztunnel::start(&cluster, a, &["--config", config]);
    let zb = Ztunnel::start(&cluster, b, &["--config", config]);
    za.wait_for_log("pod enrolled", Duration::from_secs(10));

    let mut cmd = a1.command(&probe_bin());
    cmd.args([
        "burst",
        "--connect",
        &dst.to_string(),
        "--count",
        "500",
        "--bytes",
        "2000",
    ]);
    let done = PodProcess::spawn("burst", cmd).wait(Duration::from_secs(120));
    if !done.stdout.contains("BURST ok=500 failed=0") {
        // Why streams failed is in the warnings of either side.
        let log = za.log() + &zb.log();
        let warnings: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .take(20)
            .collect();
        panic!("{done:?}\nwarnings:\n{}", warnings.join("\n"));
    }
    let handshakes = za.count_log_lines(&["HBONE connection established"]);
    // 500 streams at most 100 per connection: at least 1, never 500.
    assert!(
        (1..=10).contains(&handshakes),
        "{handshakes} TLS connections for 500 streams"
    );
    eprintln!("500 simultaneous connects used {handshakes} HBONE connection(s)");
}

#[test]
fn a_server_with_the_wrong_identity_is_refused() {
    if !require_root("a_server_with_the_wrong_identity_is_refused") {
        return;
    }
    let (cluster, a, b) = two_nodes();
    let (a1, b1) = (cluster.pod("a1"), cluster.pod("b1"));
    let honest = flows::write_config(&cluster, "mesh.yaml", &entries());
    // Node a believes b1 runs as another service account.
    let lying = flows::write_config(&cluster, "mesh-a.yaml", &entries());
    let text = std::fs::read_to_string(&lying).expect("read");
    std::fs::write(
        &lying,
        text.replace("serviceAccount: b1", "serviceAccount: payments"),
    )
    .expect("write");
    let dst = SocketAddr::from((b1.ip, 8080));
    let _server = flows::server(b1, dst, "echo");
    let za = Ztunnel::start(&cluster, a, &["--config", lying.to_str().expect("utf-8")]);
    let _zb = Ztunnel::start(&cluster, b, &["--config", honest.to_str().expect("utf-8")]);
    za.wait_for_log("pod enrolled", Duration::from_secs(10));
    let done = flows::client(
        a1,
        dst,
        &ClientRun {
            limit: Duration::from_secs(10),
            ..ClientRun::default()
        },
    );
    assert!(
        !done.status.success(),
        "connection to an impostor succeeded: {done:?}"
    );
    za.wait_for_log(
        "peer did not present the expected SAN",
        Duration::from_secs(5),
    );
}

#[test]
fn hbone_port_rejects_plaintext_and_other_protocols_cleanly() {
    if !require_root("hbone_port_rejects_plaintext_and_other_protocols_cleanly") {
        return;
    }
    let (cluster, _a, b) = two_nodes();
    let config = flows::write_config(&cluster, "mesh.yaml", &entries());
    let zb = Ztunnel::start(&cluster, b, &["--config", config.to_str().expect("utf-8")]);
    zb.wait_for_log("pod enrolled pod=b1", Duration::from_secs(10));
    let b1 = cluster.pod("b1");
    let plain = cluster.pod("plain");
    // A plain HTTP request to 15008 from a pod outside the mesh.
    let out = Command::new("ip")
        .args(["netns", "exec", plain.netns().name(), "bash", "-c"])
        .arg(format!("exec 3<>/dev/tcp/{}/15008; printf 'GET / HTTP/1.1\\r\\n\\r\\n' >&3; timeout 5 cat <&3 | head -c 100 | od -c | head -3", b1.ip))
        .output()
        .expect("bash");
    assert!(out.status.success(), "{out:?}");
    zb.wait_for_log(
        "TLS handshake failed (not an HBONE client?)",
        Duration::from_secs(5),
    );
    assert!(
        zb.log().contains(&format!("peer={}", plain.ip)),
        "the log names the client"
    );
}
