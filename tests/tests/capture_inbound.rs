//! Inbound capture and exclusions end to end.

use std::{net::SocketAddr, time::Duration};

use ztunnel_common::Counter;
use ztunnel_tests::{
    Cluster,
    flows::{self, ClientRun, WorkloadEntry},
    require_root,
    ztunnel::Ztunnel,
};

fn sa(ip: impl Into<std::net::IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

#[test]
fn inbound_connections_reach_the_plaintext_listener_with_their_original_destination() {
    if !require_root(
        "inbound_connections_reach_the_plaintext_listener_with_their_original_destination",
    ) {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "server");
    cluster.add_pod(node, "client");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("server", "node-a"),
            WorkloadEntry::outside("client", "node-a"),
        ],
    );
    let (server_pod, client) = (cluster.pod("server"), cluster.pod("client"));
    let targets = [sa(server_pod.ip, 8080), sa(server_pod.ip6, 8080)];
    let mut servers: Vec<_> = targets
        .iter()
        .map(|t| flows::server(server_pod, *t, "echo"))
        .collect();
    let z = Ztunnel::start(
        &cluster,
        node,
        &["--config", config.to_str().expect("utf-8")],
    );
    z.wait_for_log("pod enrolled", Duration::from_secs(10));

    for (i, dst) in targets.iter().enumerate() {
        let before = z.counters();
        let run = ClientRun {
            bytes: 1 << 20,
            ..ClientRun::default()
        };
        flows::assert_ok(&flows::client(client, *dst, &run));
        let after = z.counters();
        assert_eq!(
            after.get(Counter::LookupSteeredPlaintext)
                - before.get(Counter::LookupSteeredPlaintext),
            1,
            "{after:?}"
        );
        // ztunnel's accepted socket carried the original destination.
        z.wait_for_log(
            &format!("orig_dst={dst} path=\"plaintext\""),
            Duration::from_secs(5),
        );
        // The application saw the real client address (ztunnel's leg to it
        // is transparent), not ztunnel's or its own.
        let peer = flows::last_peer(&mut servers[i]);
        let client_ip = if dst.is_ipv6() {
            client.ip6.to_string()
        } else {
            client.ip.to_string()
        };
        assert!(
            peer.contains(&client_ip),
            "app saw {peer}, expected {client_ip}"
        );
    }

    // SYNs to 15008 reach ztunnel's HBONE listener, not the plaintext one.
    let before = z.counters();
    let done = flows::client(
        client,
        sa(server_pod.ip, 15008),
        &ClientRun {
            bytes: 10,
            ..ClientRun::default()
        },
    );
    assert!(
        !done.stdout.contains("CONNECT-ERROR"),
        "15008 refused: {done:?}"
    );
    z.wait_for_log(
        "TLS handshake failed (not an HBONE client?)",
        Duration::from_secs(5),
    );
    let after = z.counters();
    assert!(after.get(Counter::LookupSteeredHbone) > before.get(Counter::LookupSteeredHbone));
    assert_eq!(
        after.get(Counter::LookupSteeredPlaintext),
        before.get(Counter::LookupSteeredPlaintext)
    );
}

#[test]
fn exclusions_and_opt_outs_pass_untouched() {
    if !require_root("exclusions_and_opt_outs_pass_untouched") {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    for pod in ["app", "other", "prober", "optout"] {
        cluster.add_pod(node, pod);
    }
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("app", "node-a"),
            WorkloadEntry::outside("other", "node-a"),
            WorkloadEntry::outside("prober", "node-a"),
            WorkloadEntry {
                outbound: false,
                inbound: false,
                ..WorkloadEntry::enrolled("optout", "node-a")
            },
        ],
    );
    let (app, other, prober, optout) = (
        cluster.pod("app"),
        cluster.pod("other"),
        cluster.pod("prober"),
        cluster.pod("optout"),
    );
    let _s1 = flows::server(other, sa(other.ip, 8080), "echo");
    let _s2 = flows::server(other, sa(other.ip, 9090), "echo");
    let _s3 = flows::server(app, sa(app.ip, 8080), "echo");
    let _s4 = flows::server(app, sa(app.ip, 8081), "echo");
    let _s5 = flows::server(app, sa(std::net::Ipv4Addr::LOCALHOST, 7070), "echo");
    let _s6 = flows::server(optout, sa(optout.ip, 8080), "echo");
    let prober_cidr = format!("{}/32", prober.ip);
    let z = Ztunnel::start(
        &cluster,
        node,
        &[
            "--config",
            config.to_str().expect("utf-8"),
            "--exclude-outbound-ports",
            "9090",
            "--exclude-inbound-ports",
            "8081",
            "--exclude-inbound-cidrs",
            &prober_cidr,
        ],
    );
    z.wait_for_log("pod enrolled pod=optout", Duration::from_secs(10));
    let run = ClientRun::default();
    let check = |from: &ztunnel_tests::Pod, to: SocketAddr, counter: Counter, redirected: bool| {
        let before = z.counters();
        flows::assert_ok(&flows::client(from, to, &run));
        let after = z.counters();
        assert!(
            after.get(counter) > before.get(counter),
            "{counter:?} did not move for {}->{to}: {after:?}",
            from.name
        );
        let moved = after.get(Counter::ConnectRedirected) > before.get(Counter::ConnectRedirected)
            || after.get(Counter::LookupSteeredPlaintext)
                > before.get(Counter::LookupSteeredPlaintext);
        assert_eq!(
            moved, redirected,
            "{}->{to}: captured={moved}, expected {redirected}",
            from.name
        );
    };
    // Outbound: excluded destination port; loopback inside the pod.
    check(app, sa(other.ip, 9090), Counter::ConnectExcluded, false);
    check(
        app,
        sa(std::net::Ipv4Addr::LOCALHOST, 7070),
        Counter::ConnectExcluded,
        false,
    );
    // Outbound control: a non-excluded port is captured.
    check(app, sa(other.ip, 8080), Counter::ConnectRedirected, true);
    // Inbound: excluded port, excluded source CIDR (the "health prober").
    check(other, sa(app.ip, 8081), Counter::LookupExcluded, false);
    check(prober, sa(app.ip, 8080), Counter::LookupExcluded, false);
    // Inbound control: the same port from another source is captured.
    check(
        other,
        sa(app.ip, 8080),
        Counter::LookupSteeredPlaintext,
        true,
    );
    // A pod that opted out of both directions.
    check(
        optout,
        sa(other.ip, 8080),
        Counter::ConnectNotEnrolled,
        false,
    );
    let before = z.counters();
    flows::assert_ok(&flows::client(other, sa(optout.ip, 8080), &run));
    assert_eq!(
        z.counters().get(Counter::IngressTcpSeen),
        before.get(Counter::IngressTcpSeen),
        "opted-out pod has no TC program"
    );
}
