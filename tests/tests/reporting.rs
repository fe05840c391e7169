//! What ztunnel tells operators: the destination side's metrics name the
//! service a VIP connection was for, the `/logging` endpoint refuses a
//! filter it cannot use (and never silences the access log by accident),
//! and `ztunnel enrol add` names a path that is not a network namespace.

use std::{net::SocketAddr, process::Command, time::Duration};

use ztunnel::enrol::zds::{
    self, AddWorkload, WorkloadInfo, WorkloadRequest, ZdsError, workload_request::Payload,
};
use ztunnel_tests::{
    Cluster,
    cgroup::TestCgroup,
    flows::{self, ClientRun, WorkloadEntry},
    require_root,
    ztunnel::{Ztunnel, sibling_bin},
};

/// GET `path` from ztunnel's `addr` inside `node`'s namespace.
fn node_get(
    cluster: &Cluster,
    node: usize,
    cg: &TestCgroup,
    addr: &str,
    path: &str,
) -> (u16, String) {
    Ztunnel::http_get(&cluster.node(node).netns().path(), &cg.procs(), addr, path)
}

/// The value of the first `name{...}` series whose labels contain every
/// one of `labels`.
fn metric(text: &str, name: &str, labels: &[&str]) -> Option<u64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn the_destination_reports_the_service_a_vip_connection_was_for() {
    if !require_root("the_destination_reports_the_service_a_vip_connection_was_for") {
        return;
    }
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    let b = cluster.add_node("node-b");
    cluster.add_pod(a, "a1");
    cluster.add_pod(b, "b1");
    // b1 is behind two services with the same target port: guessing by
    // port would say `web` for both, so `api` on the destination side can
    // only come from what the client's ztunnel sent.
    let services = "services:\n  - {name: web, namespace: test, vips: [10.96.0.40], ports: [{port: 80, targetPort: 8080}], endpoints: [b1]}\n  - {name: api, namespace: test, vips: [10.96.0.41], ports: [{port: 80, targetPort: 8080}], endpoints: [b1]}\n";
    let config = flows::write_config_with(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("a1", "node-a"),
            WorkloadEntry::enrolled("b1", "node-b"),
        ],
        services,
    );
    let config = config.to_str().expect("utf-8");
    let (a1, b1) = (cluster.pod("a1"), cluster.pod("b1"));
    let _app = flows::server_with(b1, SocketAddr::from((b1.ip, 8080)), "echo", true);
    let _other = flows::server_with(b1, SocketAddr::from((b1.ip, 9090)), "echo", true);
    let za = Ztunnel::start(&cluster, a, &["--config", config]);
    let zb = Ztunnel::start(&cluster, b, &["--config", config]);
    za.wait_for_log("pod enrolled pod=a1", Duration::from_secs(10));
    zb.wait_for_log("pod enrolled pod=b1", Duration::from_secs(10));
    let run = ClientRun {
        limit: Duration::from_secs(20),
        ..ClientRun::default()
    };
    let api: SocketAddr = "10.96.0.41:80".parse().expect("vip");
    flows::assert_ok(&flows::client(a1, api, &run));
    // Straight to the pod, on a port no service has.
    flows::assert_ok(&flows::client(a1, SocketAddr::from((b1.ip, 9090)), &run));

    let cg = TestCgroup::create(&format!("{}/metrics-client", cluster.prefix()));
    let (status, text_b) = node_get(&cluster, b, &cg, "127.0.0.1:15020", "/metrics");
    assert_eq!(status, 200);
    let opened = "istio_tcp_connections_opened_total";
    assert_eq!(
        metric(
            &text_b,
            opened,
            &[
                "reporter=\"destination\"",
                "destination_service=\"api.test.svc.cluster.local\"",
                "destination_service_name=\"api\"",
                "destination_service_namespace=\"test\"",
            ]
        ),
        Some(1),
        "{text_b}"
    );
    assert_eq!(
        metric(
            &text_b,
            opened,
            &[
                "reporter=\"destination\"",
                "destination_service=\"unknown\""
            ]
        ),
        Some(1),
        "the connection to no service stays unknown: {text_b}"
    );
    assert_eq!(
        metric(&text_b, opened, &["destination_service_name=\"web\""]),
        None,
        "{text_b}"
    );
    let (_, text_a) = node_get(&cluster, a, &cg, "127.0.0.1:15020", "/metrics");
    assert_eq!(
        metric(
            &text_a,
            opened,
            &["reporter=\"source\"", "destination_service_name=\"api\""]
        ),
        Some(1),
        "{text_a}"
    );
}

/// Access log lines (target `access`) in `z`'s log so far.
fn access_lines(z: &Ztunnel) -> usize {
    z.count_log_lines(&["access:", "src_workload="])
}

#[test]
fn the_logging_endpoint_decodes_checks_and_keeps_the_access_log() {
    if !require_root("the_logging_endpoint_decodes_checks_and_keeps_the_access_log") {
        return;
    }
    let mut cluster = Cluster::new();
    let n = cluster.add_node("node-a");
    cluster.add_pod(n, "a1");
    cluster.add_pod(n, "a2");
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
    let _server = flows::server_with(a2, dst, "echo", true);
    let z = Ztunnel::start(&cluster, n, &["--config", config.to_str().expect("utf-8")]);
    z.wait_for_log("pod enrolled pod=a1", Duration::from_secs(10));
    z.wait_for_log("pod enrolled pod=a2", Duration::from_secs(10));
    let cg = TestCgroup::create(&format!("{}/admin-client", cluster.prefix()));
    let get = |path: &str| node_get(&cluster, n, &cg, "127.0.0.1:15000", path);
    let run = ClientRun {
        limit: Duration::from_secs(20),
        ..ClientRun::default()
    };
    // One connection, and its access line shows up.
    let connect_and_see_access_log = |why: &str| {
        let before = access_lines(&z);
        flows::assert_ok(&flows::client(a1, dst, &run));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while access_lines(&z) == before {
            assert!(
                std::time::Instant::now() < deadline,
                "no access log line {why}; log:\n{}",
                z.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    connect_and_see_access_log("at start");

    // A bare word is refused, named; nothing changes.
    let (status, body) = get("/logging?level=garbage");
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("\"garbage\"") && body.contains("no level"),
        "{body}"
    );
    connect_and_see_access_log("after a refused filter");

    // At the shipped level a connection writes its access line only: the
    // line when it opens is at debug, as in Istio's ztunnel.
    let opened = || z.count_log_lines(&["connection opened"]);
    let (status, body) = get("/logging?level=info");
    assert_eq!(status, 200, "{body}");
    let before = opened();
    connect_and_see_access_log("at info");
    assert_eq!(opened(), before, "a connection-opened line at info");

    // URL-encoded: decoded, and completed with a default level.
    let (status, body) = get("/logging?level=ztunnel%3Ddebug");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body.trim(), "log filter set to info,ztunnel=debug");
    let before = opened();
    connect_and_see_access_log("at ztunnel=debug");
    assert!(opened() > before, "no connection-opened line at debug");
    let (status, body) = get("/logging?level=info%2Cztunnel%3Dverbose");
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("\"verbose\" is not a level"), "{body}");

    // Quieter logs keep the access log unless it is named.
    let (status, body) = get("/logging?level=warn");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body.trim(), "log filter set to warn,access=info");
    connect_and_see_access_log("at warn");
    let (status, _) = get("/logging?level=warn,access%3Doff");
    assert_eq!(status, 200);
    let before = access_lines(&z);
    flows::assert_ok(&flows::client(a1, dst, &run));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(access_lines(&z), before, "access=off is honoured");
}

#[test]
fn enrolling_a_path_that_is_not_a_network_namespace_names_it() {
    if !require_root("enrolling_a_path_that_is_not_a_network_namespace_names_it") {
        return;
    }
    let mut cluster = Cluster::new();
    let n = cluster.add_node("node-a");
    let z = Ztunnel::start(&cluster, n, &[]);
    let out = Command::new(sibling_bin("ztunnel"))
        .arg("enrol")
        .arg("--socket")
        .arg(&z.socket)
        .args(["add", "--uid", "x", "--namespace", "test"])
        .args(["--service-account", "x", "--netns", "/etc/passwd"])
        .output()
        .expect("run ztunnel enrol");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        stderr.contains("/etc/passwd is not a network namespace: it is a regular file"),
        "{stderr}"
    );

    // A client that sends such an fd anyway is refused by the daemon, which
    // names the pod and what it got.
    let file = std::fs::File::open("/etc/passwd").expect("open");
    let add = WorkloadRequest {
        payload: Some(Payload::Add(AddWorkload {
            uid: "x".into(),
            workload_info: Some(WorkloadInfo {
                name: "x".into(),
                namespace: "test".into(),
                service_account: "x".into(),
            }),
        })),
    };
    match zds::request(&z.socket, vec![(add, Some(file.into()))]) {
        Err(ZdsError::Refused(message)) => assert!(
            message.contains("add x: test/x is not a network namespace: it is a regular file"),
            "{message}"
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(!z.log().contains("pod enrolled"), "{}", z.log());
}
