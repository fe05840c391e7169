//! Same-node traffic (fast path on and off), SOCKS5, and certificate
//! rotation under load.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use ztunnel_tests::{
    Cluster,
    cgroup::TestCgroup,
    flows::{self, ClientRun, WorkloadEntry},
    require_root,
    ztunnel::Ztunnel,
};

/// `ztunnel_spliced_bytes_total` of node `node`'s ztunnel once it holds at
/// least `at_least` (connections add theirs when they close, just after the
/// client has its echo back), or the last value read after a bounded wait.
fn spliced_bytes(cluster: &Cluster, node: usize, at_least: u64) -> u64 {
    let cg = TestCgroup::create(&format!("{}/metrics-client", cluster.prefix()));
    let deadline = Instant::now() + ztunnel_tests::patience(Duration::from_secs(10));
    loop {
        let text = Ztunnel::metrics_of(cluster, node, &cg);
        let value = text
            .lines()
            .find_map(|l| l.strip_prefix("ztunnel_spliced_bytes_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if value >= at_least || Instant::now() >= deadline {
            return value;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn same_node(fastpath: &str, splice: &str) {
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    cluster.add_pod(a, "a1");
    cluster.add_pod(a, "a2");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("a1", "node-a"),
            WorkloadEntry::enrolled("a2", "node-a"),
        ],
    );
    let (a1, a2) = (cluster.pod("a1"), cluster.pod("a2"));
    let dst = SocketAddr::from((a2.ip, 8080));
    let mut server = flows::server(a2, dst, "echo");
    let z = Ztunnel::start(
        &cluster,
        a,
        &[
            "--local-fastpath",
            fastpath,
            "--splice",
            splice,
            "--config",
            config.to_str().expect("utf-8"),
        ],
    );
    z.wait_for_log("pod enrolled pod=a2", Duration::from_secs(10));
    z.wait_for_log("pod enrolled pod=a1", Duration::from_secs(10));
    let bytes = ztunnel_tests::scaled(1 << 30);
    flows::assert_ok(&flows::client(
        a1,
        dst,
        &ClientRun {
            bytes,
            chunk: 256 * 1024,
            io: "poll",
            limit: Duration::from_mins(3),
            ..ClientRun::default()
        },
    ));
    let peer = flows::last_peer(&mut server);
    assert!(
        peer.starts_with(&format!("{}:", a1.ip)),
        "server saw {peer}"
    );
    let path = if fastpath == "on" { "local" } else { "hbone" };
    z.wait_for_log(&format!("path=\"{path}\""), Duration::from_secs(5));
    let line = z
        .log()
        .lines()
        .find(|l| {
            l.contains("outbound connection opened") && l.contains(&format!("orig_dst={dst}"))
        })
        .map(str::to_owned)
        .expect("outbound log line");
    assert!(
        line.contains("src_identity=spiffe://cluster.local/ns/test/sa/a1"),
        "{line}"
    );
    assert!(
        line.contains("dst_identity=spiffe://cluster.local/ns/test/sa/a2"),
        "{line}"
    );
    assert!(line.contains(&format!("path=\"{path}\"")), "{line}");
    let handshakes = z.count_log_lines(&["HBONE connection established"]);
    assert_eq!(
        handshakes > 0,
        fastpath == "off",
        "{handshakes} TLS handshakes with fast path {fastpath}"
    );
    // The fast path's relay is TCP to TCP: a 256 KiB-write stream goes
    // through the kernel (splice) except its first reads, both ways (the
    // echo). Over HBONE, or with splicing off, nothing is spliced.
    if fastpath == "on" && splice == "on" {
        let spliced = spliced_bytes(&cluster, a, bytes);
        assert!(
            spliced >= bytes,
            "only {spliced} of {} bytes spliced",
            2 * bytes
        );
    } else {
        // Give a wrongly spliced count time to show before reading it.
        z.wait_for_log("bytes_sent=", Duration::from_secs(10));
        assert_eq!(spliced_bytes(&cluster, a, 1), 0);
    }
}

#[test]
fn same_node_fast_path_on_skips_tls_but_keeps_identities() {
    if !require_root("same_node_fast_path_on_skips_tls_but_keeps_identities") {
        return;
    }
    same_node("on", "on");
}

#[test]
fn same_node_fast_path_copies_when_splice_is_off() {
    if !require_root("same_node_fast_path_copies_when_splice_is_off") {
        return;
    }
    same_node("on", "off");
}

#[test]
fn same_node_fast_path_off_uses_hbone() {
    if !require_root("same_node_fast_path_off_uses_hbone") {
        return;
    }
    same_node("off", "on");
}

#[test]
fn socks5_clients_reach_addresses_and_mesh_names() {
    if !require_root("socks5_clients_reach_addresses_and_mesh_names") {
        return;
    }
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    let b = cluster.add_node("node-b");
    cluster.add_pod(a, "a1");
    cluster.add_pod(b, "b1");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("a1", "node-a"),
            WorkloadEntry::enrolled("b1", "node-b"),
        ],
    );
    let config = config.to_str().expect("utf-8");
    let (a1, b1) = (cluster.pod("a1"), cluster.pod("b1"));
    let v4 = SocketAddr::from((b1.ip, 8080));
    let v6 = SocketAddr::from((b1.ip6, 8080));
    let _s4 = flows::server(b1, v4, "echo");
    let _s6 = flows::server(b1, v6, "echo");
    let za = Ztunnel::start(&cluster, a, &["--config", config]);
    let _zb = Ztunnel::start(&cluster, b, &["--config", config]);
    za.wait_for_log("pod enrolled", Duration::from_secs(10));
    let proxy: SocketAddr = "127.0.0.1:15080".parse().expect("proxy");
    for (target, name) in [(v4, None), (v6, None), (v4, Some("b1.test".to_owned()))] {
        let run = ClientRun {
            socks: Some((proxy, name.clone())),
            ..ClientRun::default()
        };
        flows::assert_ok(&flows::client(a1, target, &run));
        za.wait_for_log(&format!("orig_dst={target}"), Duration::from_secs(5));
    }
    assert!(za.count_log_lines(&["via=\"socks5\"", "path=\"hbone\""]) >= 3);
    // An unknown name gets "host unreachable" (reply 4), not a guess.
    let run = ClientRun {
        socks: Some((proxy, Some("nowhere.test".to_owned()))),
        ..ClientRun::default()
    };
    let done = flows::client(a1, v4, &run);
    assert!(done.stdout.contains("SOCKS-REPLY 4"), "{done:?}");
}

#[test]
fn certificates_rotate_without_dropping_open_connections() {
    if !require_root("certificates_rotate_without_dropping_open_connections") {
        return;
    }
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    let b = cluster.add_node("node-b");
    cluster.add_pod(a, "a1");
    cluster.add_pod(b, "b1");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("a1", "node-a"),
            WorkloadEntry::enrolled("b1", "node-b"),
        ],
    );
    let config = config.to_str().expect("utf-8");
    let (a1, b1) = (cluster.pod("a1"), cluster.pod("b1"));
    let to_b = SocketAddr::from((b1.ip, 8080));
    let to_a = SocketAddr::from((a1.ip, 8080));
    let _sb = flows::server(b1, to_b, "echo");
    let _sa = flows::server(a1, to_a, "echo");
    // Certificates live 4 s and are replaced after 2 s.
    let za = Ztunnel::start(&cluster, a, &["--config", config, "--cert-lifetime", "4"]);
    let zb = Ztunnel::start(&cluster, b, &["--config", config, "--cert-lifetime", "4"]);
    za.wait_for_log("pod enrolled", Duration::from_secs(10));
    zb.wait_for_log("pod enrolled", Duration::from_secs(10));

    // A long transfer a1 -> b1 that outlives a1's first certificate.
    let long = std::thread::scope(|scope| {
        let long = scope.spawn(|| {
            let run = ClientRun {
                bytes: ztunnel_tests::scaled(3 << 30),
                chunk: 256 * 1024,
                io: "poll",
                limit: Duration::from_mins(3),
                ..ClientRun::default()
            };
            flows::client(a1, to_b, &run)
        });
        // Not a wait for something to happen: the clock itself is the
        // condition (the 4 s certificate passes its half-life at 2 s).
        std::thread::sleep(Duration::from_secs(3));
        // A new connection the other way needs a1's certificate again (as a
        // server now): it is past half-life and gets replaced.
        flows::assert_ok(&flows::client(b1, to_a, &ClientRun::default()));
        long.join().expect("long transfer thread")
    });
    za.wait_for_log(
        "certificate past half-life: rotating",
        Duration::from_secs(5),
    );
    flows::assert_ok(&long);
}
