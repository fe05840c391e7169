//! Outbound capture end to end: a real ztunnel, real pods, real processes.

use std::{net::SocketAddr, time::Duration};

use ztunnel_common::Counter;
use ztunnel_tests::{
    Cluster,
    cgroup::TestCgroup,
    flows::{self, ClientRun, WorkloadEntry},
    probe_bin,
    process::{PodProcess, command_in},
    require_root,
    ztunnel::Ztunnel,
};

fn sa(ip: impl Into<std::net::IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

#[test]
fn outbound_connects_are_captured_with_exact_original_destination() {
    if !require_root("outbound_connects_are_captured_with_exact_original_destination") {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "client");
    cluster.add_pod(node, "server1");
    cluster.add_pod(node, "server2");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("client", "node-a"),
            WorkloadEntry::outside("server1", "node-a"),
            WorkloadEntry::outside("server2", "node-a"),
        ],
    );
    let (s1, s2, client) = (
        cluster.pod("server1"),
        cluster.pod("server2"),
        cluster.pod("client"),
    );
    let targets = [sa(s1.ip, 8080), sa(s1.ip6, 8080), sa(s2.ip, 9090)];
    let mut servers: Vec<_> = [(s1, targets[0]), (s1, targets[1]), (s2, targets[2])]
        .into_iter()
        .map(|(pod, addr)| flows::server(pod, addr, "echo"))
        .collect();

    let z = Ztunnel::start(
        &cluster,
        node,
        &["--config", config.to_str().expect("utf-8")],
    );
    z.wait_for_log("pod enrolled", Duration::from_secs(10));
    let before = z.counters();

    for (i, dst) in targets.iter().enumerate() {
        let done = flows::client(client, *dst, &ClientRun::default());
        flows::assert_ok(&done);
        // The application believes it talked to the server directly ...
        assert!(
            done.stdout.contains(&format!("peer={dst}")),
            "{}",
            done.stdout
        );
        // ... the server saw the client pod's address (ztunnel connects from
        // inside the pod) ...
        let peer = flows::last_peer(&mut servers[i]);
        let expected_ip = if dst.is_ipv6() {
            client.ip6.to_string()
        } else {
            client.ip.to_string()
        };
        assert!(
            peer.contains(&expected_ip),
            "server saw {peer}, expected {expected_ip}"
        );
        // ... and ztunnel recovered exactly this destination.
        z.wait_for_log(&format!("orig_dst={dst}"), Duration::from_secs(5));
    }
    let after = z.counters();
    let delta = |c| after.get(c) - before.get(c);
    assert_eq!(delta(Counter::ConnectRedirected), 3, "{after:?}");
    assert_eq!(delta(Counter::OrigDstRecorded), 3, "{after:?}");
    // ztunnel runs inside the capture cgroup: its own three upstream
    // connects went through the hook and were let go because it listed
    // their sockets as its own (the mark alone exempts nothing).
    assert!(delta(Counter::ConnectSkippedOwn) >= 3, "{after:?}");
    assert_eq!(delta(Counter::ConnectForgedMark), 0, "{after:?}");

    // A pod that is not enrolled is untouched.
    let before = z.counters();
    let done = flows::client(s2, targets[0], &ClientRun::default());
    flows::assert_ok(&done);
    let after = z.counters();
    assert_eq!(
        after.get(Counter::ConnectRedirected),
        before.get(Counter::ConnectRedirected)
    );
    assert!(after.get(Counter::ConnectNotEnrolled) > before.get(Counter::ConnectNotEnrolled));

    // A process in the node's namespace (inside the capture cgroup, so the
    // hook does run for it) is untouched as well.
    let node_cgroup = TestCgroup::create(&format!("{}/node-procs", cluster.prefix()));
    let mut cmd = command_in(
        &cluster.node(node).netns().path(),
        &node_cgroup.procs(),
        &probe_bin(),
    );
    cmd.args([
        "client",
        "--connect",
        &targets[0].to_string(),
        "--bytes",
        "1000",
        "--connect-timeout",
        "5",
    ]);
    let before = z.counters();
    let done = PodProcess::spawn("node-client", cmd).wait(Duration::from_secs(30));
    flows::assert_ok(&done);
    let after = z.counters();
    assert_eq!(
        after.get(Counter::ConnectRedirected),
        before.get(Counter::ConnectRedirected)
    );
    assert!(after.get(Counter::ConnectNotEnrolled) > before.get(Counter::ConnectNotEnrolled));
    assert_eq!(z.count_log_lines(&["outbound connection opened"]), 3);
}
