//! HBONE refusals that depend on trust and state, service spreading, and
//! live config reloads.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use ztunnel::{
    hbone::{
        HboneError,
        pool::{HbonePool, PoolKey, PoolSettings, hbone_addr},
    },
    identity::{CertManager, Identity, ca::CertificateAuthority},
    netns::PodNetns,
    proxy::socket_factory::{SocketFactory, SocketTables},
    telemetry::Metrics,
    timeouts::Timeouts,
};
use ztunnel_tests::{
    Cluster,
    flows::{self, ClientRun, WorkloadEntry},
    require_root,
    ztunnel::Ztunnel,
};

fn pods() -> (Cluster, usize, usize) {
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    let b = cluster.add_node("node-b");
    cluster.add_pod(a, "a1");
    cluster.add_pod(b, "b1");
    cluster.add_pod(b, "b2");
    (cluster, a, b)
}

#[test]
fn a_peer_from_another_ca_is_refused_both_ways() {
    if !require_root("a_peer_from_another_ca_is_refused_both_ways") {
        return;
    }
    let (cluster, a, b) = pods();
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
    let dst = SocketAddr::from((b1.ip, 8080));
    let _server = flows::server(b1, dst, "echo");
    // Node b issues from CA files of another CA (which also exercises
    // --ca-cert/--ca-key).
    let other = cluster.dir().join("other-ca");
    CertificateAuthority::development(&other, "cluster.local").expect("other CA");
    let (cert, key) = (other.join("ca-cert.pem"), other.join("ca-key.pem"));
    let za = Ztunnel::start(&cluster, a, &["--config", config]);
    let zb = Ztunnel::start(
        &cluster,
        b,
        &[
            "--config",
            config,
            "--ca-cert",
            cert.to_str().expect("utf-8"),
            "--ca-key",
            key.to_str().expect("utf-8"),
        ],
    );
    za.wait_for_log("pod enrolled", Duration::from_secs(10));
    zb.wait_for_log("pod enrolled", Duration::from_secs(10));
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
        "connection across CAs succeeded: {done:?}"
    );
    za.wait_for_log(
        "invalid peer certificate: UnknownIssuer",
        Duration::from_secs(5),
    );
    zb.wait_for_log("HBONE connection rejected", Duration::from_secs(5));
}

#[test]
fn a_connect_to_a_target_that_is_not_the_pod_gets_400() {
    if !require_root("a_connect_to_a_target_that_is_not_the_pod_gets_400") {
        return;
    }
    let (cluster, a, b) = pods();
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("a1", "node-a"),
            WorkloadEntry::enrolled("b1", "node-b"),
        ],
    );
    let zb = Ztunnel::start(&cluster, b, &["--config", config.to_str().expect("utf-8")]);
    zb.wait_for_log("pod enrolled", Duration::from_secs(10));
    let _ = a;
    let (a1, b1, b2) = (cluster.pod("a1"), cluster.pod("b1"), cluster.pod("b2"));
    // A hand-driven HBONE client in the test process, with a certificate from
    // the same CA, asking b1's ztunnel for b2's address.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let ca_dir = cluster.dir().join("dev-ca");
    let ca = CertificateAuthority::development(&ca_dir, "cluster.local").expect("ca");
    let pool = HbonePool::new(
        Arc::new(CertManager::new(ca, Duration::from_secs(3600))),
        PoolSettings {
            idle_timeout: Duration::from_secs(5),
            timeouts: Timeouts::default(),
        },
        Metrics::new(),
    );
    let sockets = SocketFactory::new(
        &PodNetns::open(&a1.netns_path()).expect("netns"),
        SocketTables::default(),
    )
    .expect("factory");
    let key = PoolKey {
        src_ip: a1.ip.into(),
        src: Identity::new("cluster.local", "test", "a1"),
        dst: hbone_addr(b1.ip.into()),
        dst_identity: Identity::new("cluster.local", "test", "b1"),
    };
    let client = SocketAddr::from((a1.ip, 40000));
    let result = runtime.block_on(pool.connect(
        key.clone(),
        &sockets,
        SocketAddr::from((b2.ip, 8080)),
        client,
        None,
        None,
    ));
    match result {
        Err(HboneError::Status { status, .. }) => assert_eq!(status.as_u16(), 400),
        Err(other) => panic!("expected 400, got {other}"),
        Ok(_) => panic!("a CONNECT to another pod's address was accepted"),
    }
    // And one of ztunnel's own ports on the right pod gets 503.
    let result = runtime.block_on(pool.connect(
        key,
        &sockets,
        SocketAddr::from((b1.ip, 15001)),
        client,
        None,
        None,
    ));
    match result {
        Err(HboneError::Status { status, .. }) => assert_eq!(status.as_u16(), 503),
        Err(other) => panic!("expected 503, got {other}"),
        Ok(_) => panic!("a CONNECT to ztunnel's own port was accepted"),
    }
    zb.wait_for_log(
        "authority IP is not the address this connection arrived on",
        Duration::from_secs(5),
    );
}

#[test]
fn services_spread_reloads_apply_and_unknown_destinations_can_be_closed() {
    if !require_root("services_spread_reloads_apply_and_unknown_destinations_can_be_closed") {
        return;
    }
    let (cluster, a, b) = pods();
    let (a1, b1, b2) = (cluster.pod("a1"), cluster.pod("b1"), cluster.pod("b2"));
    let mut s1 = flows::server(b1, SocketAddr::from((b1.ip, 8080)), "echo");
    let mut s2 = flows::server(b2, SocketAddr::from((b2.ip, 8080)), "echo");
    let svc = "services:\n  - {name: web, namespace: test, vips: [10.96.0.20], ports: [{port: 80, targetPort: 8080}], endpoints: [b1, b2]}\n";
    // b2 is not in the mesh yet.
    let entries = vec![
        WorkloadEntry::enrolled("a1", "node-a"),
        WorkloadEntry::enrolled("b1", "node-b"),
        WorkloadEntry::outside("b2", "node-b"),
    ];
    let path = flows::write_config_with(&cluster, "mesh.yaml", &entries, svc);
    let config = path.to_str().expect("utf-8");
    let za = Ztunnel::start(&cluster, a, &["--config", config]);
    let zb = Ztunnel::start(&cluster, b, &["--config", config]);
    za.wait_for_log("pod enrolled", Duration::from_secs(10));
    zb.wait_for_log("pod enrolled", Duration::from_secs(10));

    // The VIP spreads connections over both endpoints.
    let vip: SocketAddr = "10.96.0.20:80".parse().expect("vip");
    for _ in 0..4 {
        flows::assert_ok(&flows::client(a1, vip, &ClientRun::default()));
    }
    for server in [&mut s1, &mut s2] {
        for _ in 0..2 {
            let _ = flows::last_peer(server);
        }
    }
    assert_eq!(
        za.count_log_lines(&["orig_dst=10.96.0.20:80", "path=\"hbone\""]),
        2,
        "b1 via HBONE"
    );
    assert_eq!(
        za.count_log_lines(&["orig_dst=10.96.0.20:80", "path=\"passthrough\""]),
        2,
        "b2 (not meshed) as plain TCP"
    );

    // A live reload puts b2 in the mesh; the next connection to it uses HBONE.
    let entries = vec![
        WorkloadEntry::enrolled("a1", "node-a"),
        WorkloadEntry::enrolled("b1", "node-b"),
        WorkloadEntry::enrolled("b2", "node-b"),
    ];
    let extra = format!("{svc}outboundTrafficPolicy: REGISTRY_ONLY\n");
    flows::write_config_with(&cluster, "mesh.yaml", &entries, &extra);
    zb.wait_for_log("pod enrolled pod=b2", Duration::from_secs(10));
    za.wait_for_log("config changed: applying", Duration::from_secs(10));
    let b2_dst = SocketAddr::from((b2.ip, 8080));
    flows::assert_ok(&flows::client(a1, b2_dst, &ClientRun::default()));
    za.wait_for_log(
        &format!("orig_dst={b2_dst} target={b2_dst} dst_workload=b2"),
        Duration::from_secs(5),
    );

    // Under REGISTRY_ONLY an unknown destination is closed, and logged.
    let unknown: SocketAddr = "10.244.9.9:80".parse().expect("addr");
    let done = flows::client(
        a1,
        unknown,
        &ClientRun {
            limit: Duration::from_secs(5),
            ..ClientRun::default()
        },
    );
    assert!(!done.status.success(), "{done:?}");
    za.wait_for_log("outbound connection denied", Duration::from_secs(5));
}
