//! Operating ztunnel: authorization policy, metrics, access logs, admin,
//! readiness and drain, each with real connections.

use std::{net::SocketAddr, time::Duration};

use nix::sys::signal::Signal;
use ztunnel_tests::{
    Cluster,
    cgroup::TestCgroup,
    flows::{self, ClientRun, WorkloadEntry},
    require_root,
    ztunnel::Ztunnel,
};

/// node-a: clients `a` (ns test, sa a), `b` (ns other, sa b), `plain`
/// (outside the mesh). node-b: `web` (labels app=web) serving 8080, 9090.
fn mesh() -> (Cluster, usize, usize) {
    let mut cluster = Cluster::new();
    let na = cluster.add_node("node-a");
    let nb = cluster.add_node("node-b");
    for pod in ["a", "b", "plain"] {
        cluster.add_pod(na, pod);
    }
    cluster.add_pod(nb, "web");
    (cluster, na, nb)
}

fn entries() -> Vec<WorkloadEntry> {
    vec![
        WorkloadEntry::enrolled("a", "node-a"),
        WorkloadEntry {
            namespace: "other",
            ..WorkloadEntry::enrolled("b", "node-a")
        },
        WorkloadEntry::outside("plain", "node-a"),
        WorkloadEntry {
            extra: "    labels: {app: web}",
            ..WorkloadEntry::enrolled("web", "node-b")
        },
    ]
}

/// One row of the policy table: (name, extra config, [(client, port, allowed)]).
type Case = (&'static str, String, Vec<(&'static str, u16, bool)>);

fn write(cluster: &Cluster, extra: &str) -> std::path::PathBuf {
    flows::write_config_with(cluster, "mesh.yaml", &entries(), extra)
}

/// Rewrites the config and waits until both ztunnels applied it.
fn apply(cluster: &Cluster, zs: &[&Ztunnel], extra: &str) {
    let before: Vec<usize> = zs
        .iter()
        .map(|z| z.count_log_lines(&["config changed: applying"]))
        .collect();
    write(cluster, extra);
    for (z, n) in zs.iter().zip(before) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while z.count_log_lines(&["config changed: applying"]) <= n {
            assert!(
                std::time::Instant::now() < deadline,
                "config not applied; log:\n{}",
                z.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[test]
fn authorization_policies_table() {
    if !require_root("authorization_policies_table") {
        return;
    }
    let (cluster, na, nb) = mesh();
    let config = write(&cluster, "");
    let config = config.to_str().expect("utf-8").to_owned();
    let web = cluster.pod("web");
    let _s1 = flows::server(web, SocketAddr::from((web.ip, 8080)), "echo");
    let _s2 = flows::server(web, SocketAddr::from((web.ip, 9090)), "echo");
    let za = Ztunnel::start(&cluster, na, &["--config", &config]);
    let zb = Ztunnel::start(&cluster, nb, &["--config", &config]);
    za.wait_for_log("pod enrolled pod=b", Duration::from_secs(10));
    zb.wait_for_log("pod enrolled pod=web", Duration::from_secs(10));

    let a_ip = cluster.pod("a").ip;
    let pa = "spiffe://cluster.local/ns/test/sa/a";
    let allow = |rule: &str| {
        format!(
            "policies:\n  - {{name: p, namespace: test, selector: {{app: web}}, action: ALLOW, rules: [{rule}]}}\n"
        )
    };
    let cases: Vec<Case> = vec![
        (
            "no policy",
            String::new(),
            vec![("a", 8080, true), ("b", 8080, true), ("plain", 8080, true)],
        ),
        (
            "principals",
            allow(&format!("{{from: [{{principals: [\"{pa}\"]}}]}}")),
            vec![("a", 8080, true), ("b", 8080, false)],
        ),
        (
            "notPrincipals",
            allow(&format!("{{from: [{{notPrincipals: [\"{pa}\"]}}]}}")),
            vec![("a", 8080, false), ("b", 8080, true)],
        ),
        (
            "namespaces",
            allow("{from: [{namespaces: [other]}]}"),
            vec![("a", 8080, false), ("b", 8080, true)],
        ),
        (
            "notNamespaces",
            allow("{from: [{notNamespaces: [other]}]}"),
            vec![("a", 8080, true), ("b", 8080, false)],
        ),
        (
            "ipBlocks",
            allow(&format!("{{from: [{{ipBlocks: [\"{a_ip}/32\"]}}]}}")),
            vec![("a", 8080, true), ("b", 8080, false)],
        ),
        (
            "notIpBlocks",
            allow(&format!("{{from: [{{notIpBlocks: [\"{a_ip}/32\"]}}]}}")),
            vec![("a", 8080, false), ("b", 8080, true)],
        ),
        (
            "ports",
            allow("{to: [{ports: [8080]}]}"),
            vec![("a", 8080, true), ("a", 9090, false)],
        ),
        (
            "notPorts",
            allow("{to: [{notPorts: [8080]}]}"),
            vec![("a", 8080, false), ("a", 9090, true)],
        ),
        (
            "DENY over ALLOW",
            format!(
                "policies:\n  - {{name: all, namespace: test, action: ALLOW, rules: [{{}}]}}\n  - {{name: no-a, namespace: istio-system, action: DENY, rules: [{{from: [{{principals: [\"{pa}\"]}}]}}]}}\n"
            ),
            vec![("a", 8080, false), ("b", 8080, true)],
        ),
        (
            "STRICT",
            "peerAuthentications:\n  - {namespace: test, selector: {app: web}, mode: STRICT}\n"
                .into(),
            vec![("plain", 8080, false), ("a", 8080, true)],
        ),
        (
            "PERMISSIVE",
            "peerAuthentications:\n  - {namespace: test, mode: PERMISSIVE}\n".into(),
            vec![("plain", 8080, true)],
        ),
    ];
    let run = ClientRun {
        bytes: 1000,
        limit: Duration::from_secs(10),
        connect_timeout: 3,
        ..ClientRun::default()
    };
    for (name, extra, checks) in &cases {
        apply(&cluster, &[&za, &zb], extra);
        for (client, port, allowed) in checks {
            let done = flows::client(cluster.pod(client), SocketAddr::from((web.ip, *port)), &run);
            let ok = done.status.success() && done.stdout.contains("RESULT ok");
            assert_eq!(
                ok, *allowed,
                "case {name:?}: {client} -> web:{port}: {done:?}"
            );
        }
    }
    // The access log says which policy denied, and why.
    assert!(
        zb.count_log_lines(&[
            "access",
            "result=\"denied\"",
            "denied by DENY policy istio-system/no-a"
        ]) >= 1,
        "no access log line for the DENY; log:\n{}",
        zb.log()
    );
    assert!(zb.count_log_lines(&["access", "result=\"denied\"", "STRICT mTLS"]) >= 1);
}

fn node_get(
    cluster: &Cluster,
    node: usize,
    cg: &TestCgroup,
    addr: &str,
    path: &str,
) -> (u16, String) {
    Ztunnel::http_get(&cluster.node(node).netns().path(), &cg.procs(), addr, path)
}

/// The value of the first metric line starting with `name{` containing all
/// `labels`.
fn metric(text: &str, name: &str, labels: &[&str]) -> Option<u64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn metrics_admin_readiness_and_drain() {
    if !require_root("metrics_admin_readiness_and_drain") {
        return;
    }
    let (cluster, na, nb) = mesh();
    let config = write(&cluster, "");
    let config = config.to_str().expect("utf-8").to_owned();
    let (a, web) = (cluster.pod("a"), cluster.pod("web"));
    let dst = SocketAddr::from((web.ip, 8080));
    let _server = flows::server(web, dst, "echo");
    let za = Ztunnel::start(&cluster, na, &["--config", &config]);
    let mut zb = Ztunnel::start(
        &cluster,
        nb,
        // The deadline bounds how long a drain may take, not how fast the
        // machine is: generous, so a loaded CI machine cannot cut the
        // transfer the test expects to complete.
        &["--config", &config, "--drain-timeout", "120"],
    );
    zb.wait_for_log("pod enrolled pod=web", Duration::from_secs(10));
    za.wait_for_log("pod enrolled pod=a", Duration::from_secs(10));
    let cg = TestCgroup::create(&format!("{}/admin-client", cluster.prefix()));

    // Readiness.
    let (status, _) = node_get(&cluster, nb, &cg, "127.0.0.1:15021", "/healthz/ready");
    assert_eq!(status, 200);

    // Exactly three connections of 1000 bytes each way.
    for _ in 0..3 {
        flows::assert_ok(&flows::client(
            a,
            dst,
            &ClientRun {
                bytes: 1000,
                ..ClientRun::default()
            },
        ));
    }
    let labels = [
        "reporter=\"destination\"",
        "source_workload=\"a\"",
        "source_workload_namespace=\"test\"",
        "source_principal=\"spiffe://cluster.local/ns/test/sa/a\"",
        "destination_workload=\"web\"",
        "destination_principal=\"spiffe://cluster.local/ns/test/sa/web\"",
        "connection_security_policy=\"mutual_tls\"",
        // Istio's defaults where the config says nothing more.
        "source_canonical_service=\"a\"",
        "source_canonical_revision=\"latest\"",
        "source_app=\"a\"",
        "source_version=\"latest\"",
        "source_cluster=\"unknown\"",
        "destination_canonical_service=\"web\"",
        "request_protocol=\"tcp\"",
    ];
    // The server side records a connection when its copy ends, a moment
    // after the client is done: wait for all three (bounded), then check.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let (status, text) = node_get(&cluster, nb, &cg, "127.0.0.1:15020", "/metrics");
        assert_eq!(status, 200);
        let closed = metric(&text, "istio_tcp_connections_closed_total", &labels);
        if closed == Some(3) || std::time::Instant::now() >= deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        metric(&text, "istio_tcp_connections_opened_total", &labels),
        Some(3),
        "{text}"
    );
    assert_eq!(
        metric(&text, "istio_tcp_connections_closed_total", &labels),
        Some(3),
        "{text}"
    );
    assert_eq!(
        metric(&text, "istio_tcp_sent_bytes_total", &labels),
        Some(3000),
        "{text}"
    );
    assert_eq!(
        metric(&text, "istio_tcp_received_bytes_total", &labels),
        Some(3000),
        "{text}"
    );
    assert!(
        metric(
            &text,
            "ztunnel_capture_events",
            &["event=\"lookup_steered_hbone\""]
        )
        .is_some_and(|v| v >= 1),
        "{text}"
    );
    let (_, text_a) = node_get(&cluster, na, &cg, "127.0.0.1:15020", "/metrics");
    let source_labels = [
        "reporter=\"source\"",
        "destination_workload=\"web\"",
        "source_workload=\"a\"",
    ];
    assert_eq!(
        metric(
            &text_a,
            "istio_tcp_connections_opened_total",
            &source_labels
        ),
        Some(3),
        "{text_a}"
    );
    assert_eq!(
        metric(&text_a, "istio_tcp_sent_bytes_total", &source_labels),
        Some(3000),
        "{text_a}"
    );
    assert!(
        metric(
            &text_a,
            "ztunnel_hbone_tls_handshakes_total",
            &["side=\"client\"", "outcome=\"ok\""]
        )
        .is_some_and(|v| v >= 1),
        "{text_a}"
    );

    // Admin: a config dump that parses, lists the pod, and has no keys.
    let (status, dump) = node_get(&cluster, nb, &cg, "127.0.0.1:15000", "/config_dump");
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_str(&dump).expect("config_dump is JSON");
    let pods = json["enrolledPods"].as_array().expect("enrolledPods");
    assert!(pods.iter().any(|p| p["uid"] == "web"), "{dump}");
    assert!(
        json["certificates"]
            .as_array()
            .is_some_and(|c| !c.is_empty()),
        "{dump}"
    );
    for secret in ["PRIVATE KEY", "BEGIN", "private"] {
        assert!(!dump.contains(secret), "config_dump contains {secret:?}");
    }
    assert!(!zb.log().contains("PRIVATE KEY"), "a key reached the log");
    // Runtime log level change.
    let (status, _) = node_get(&cluster, nb, &cg, "127.0.0.1:15000", "/logging?level=debug");
    assert_eq!(status, 200);
    zb.wait_for_log("log filter changed filter=debug", Duration::from_secs(5));
    // Back to the harness's filter: at debug every HTTP/2 frame of the
    // drain's transfer is a log line, which slowed it past the drain deadline
    // on a loaded machine; and the drain below waits for the debug line that
    // says the transfer opened on this node.
    let (status, _) = node_get(
        &cluster,
        nb,
        &cg,
        "127.0.0.1:15000",
        "/logging?level=info%2Cztunnel%3Ddebug",
    );
    assert_eq!(status, 200);
    // Admin is not reachable from a pod: not on the node's fabric address,
    // and the pod's own loopback is its own.
    let node_ip = cluster.node(nb).ip;
    for addr in [format!("{node_ip}:15000"), "127.0.0.1:15000".to_owned()] {
        let (status, _) = Ztunnel::http_get(&a.netns_path(), &cg.procs(), &addr, "/config_dump");
        assert_eq!(status, 0, "admin answered a pod on {addr}");
    }

    // Drain: a long transfer in flight finishes after SIGTERM; a new
    // connection during the drain is refused; exit status 0.
    drain(&cluster, &mut zb, a, dst);
}

fn drain(cluster: &Cluster, zb: &mut Ztunnel, a: &ztunnel_tests::Pod, dst: SocketAddr) {
    let opened_before = zb.count_log_lines(&["inbound connection opened"]);
    std::thread::scope(|scope| {
        let long = scope.spawn(|| {
            let run = ClientRun {
                bytes: ztunnel_tests::scaled(1 << 30),
                chunk: 256 * 1024,
                io: "poll",
                limit: Duration::from_mins(3),
                ..ClientRun::default()
            };
            flows::client(a, dst, &run)
        });
        // Once it is open on node b (the server side), ask that ztunnel to
        // stop.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while zb.count_log_lines(&["inbound connection opened"]) <= opened_before {
            assert!(
                std::time::Instant::now() < deadline,
                "the long transfer never opened on node b:\n{}",
                zb.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        zb.signal(Signal::SIGTERM);
        zb.wait_for_log("draining", Duration::from_secs(5));
        // The pod's listeners are closed: a new connection into web fails.
        let other = cluster.pod("plain");
        let quick = ClientRun {
            connect_timeout: 2,
            limit: Duration::from_secs(5),
            ..ClientRun::default()
        };
        let refused = flows::client(other, dst, &quick);
        assert!(
            !refused.status.success(),
            "new connection accepted during drain: {refused:?}"
        );
        let done = long.join().expect("long transfer");
        flows::assert_ok(&done);
    });
    zb.wait_for_log("drained: no connection left", Duration::from_secs(10));
    zb.stop();
}
