//! A connection to a port nobody listens on in a meshed pod is refused at
//! once, on every path, as it would be without the mesh: ztunnel's own
//! connect to the application sees the pod's RST (which must come back to
//! ztunnel rather than leave the pod towards the foreign client IP), the
//! HBONE client gets a 503, and the application's captured connection is
//! reset.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use ztunnel_tests::{
    Cluster, Pod,
    flows::{self, ClientRun, WorkloadEntry},
    require_root,
    ztunnel::Ztunnel,
};

/// A port no process in the test listens on.
const CLOSED: u16 = 8099;
/// How long a refusal may take. Without the mesh it is one round trip on a
/// veth; the hang this guards against is the ~130 s of SYN retries.
const PROMPT: Duration = Duration::from_millis(1000);

/// Connects from `pod` to `dst` and returns what the client printed and
/// how long it took; the connection must fail with a reset or refusal.
fn refused(pod: &Pod, dst: SocketAddr, what: &str) -> Duration {
    let run = ClientRun {
        bytes: 100,
        connect_timeout: 20,
        limit: Duration::from_secs(40),
        ..ClientRun::default()
    };
    let started = Instant::now();
    let done = flows::client(pod, dst, &run);
    let took = started.elapsed();
    let out = done.stdout.clone();
    assert!(
        !out.contains("RESULT ok"),
        "{what}: a connection to a closed port succeeded: {done:?}"
    );
    assert!(
        out.contains("ConnectionRefused") || out.contains("ConnectionReset"),
        "{what}: the client was not refused or reset (a clean close hides the failure): {done:?}"
    );
    eprintln!("{what}: refused in {took:?}: {}", out.trim());
    took
}

#[test]
fn a_closed_port_in_a_meshed_pod_is_refused_at_once() {
    if !require_root("a_closed_port_in_a_meshed_pod_is_refused_at_once") {
        return;
    }
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    let b = cluster.add_node("node-b");
    cluster.add_pod(a, "a1");
    cluster.add_pod(a, "a2");
    cluster.add_pod(b, "b1");
    cluster.add_pod(b, "out");
    cluster.add_pod(a, "out2");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("a1", "node-a"),
            WorkloadEntry::enrolled("a2", "node-a"),
            WorkloadEntry::enrolled("b1", "node-b"),
            WorkloadEntry::outside("out", "node-b"),
            WorkloadEntry::outside("out2", "node-a"),
        ],
    );
    let config = config.to_str().expect("utf-8");
    let za = Ztunnel::start(&cluster, a, &["--config", config]);
    let zb = Ztunnel::start(&cluster, b, &["--config", config]);
    za.wait_for_log("pod enrolled pod=a1", Duration::from_secs(10));
    za.wait_for_log("pod enrolled pod=a2", Duration::from_secs(10));
    zb.wait_for_log("pod enrolled pod=b1", Duration::from_secs(10));
    let (a1, a2, b1, out) = (
        cluster.pod("a1"),
        cluster.pod("a2"),
        cluster.pod("b1"),
        cluster.pod("out"),
    );

    // The mesh works and the paths below are the captured ones.
    let open = SocketAddr::from((b1.ip, 8080));
    let _server = flows::server(b1, open, "echo");
    flows::assert_ok(&flows::client(a1, open, &ClientRun::default()));

    // Baseline, no mesh on either side: refused in one round trip.
    let baseline = refused(
        cluster.pod("out2"),
        SocketAddr::from((out.ip, CLOSED)),
        "outside the mesh",
    );

    // Across nodes: captured, HBONE CONNECT, b's ztunnel connects to the
    // closed port and answers 503, a resets the application's connection.
    let across = refused(a1, SocketAddr::from((b1.ip, CLOSED)), "across nodes (v4)");
    zb.wait_for_log("status=503", Duration::from_secs(5));
    let across6 = refused(a1, SocketAddr::from((b1.ip6, CLOSED)), "across nodes (v6)");
    // Same node: the client's ztunnel connects into a2 itself.
    let local = refused(a1, SocketAddr::from((a2.ip, CLOSED)), "same node");
    // From outside the mesh into a meshed pod: plaintext inbound (15006).
    let plain = refused(out, SocketAddr::from((b1.ip, CLOSED)), "plaintext inbound");
    let plain6 = refused(
        out,
        SocketAddr::from((b1.ip6, CLOSED)),
        "plaintext inbound (v6)",
    );

    let mesh = [across, across6, local, plain, plain6];
    for took in mesh {
        assert!(
            took < PROMPT + baseline,
            "a closed port in a meshed pod took {took:?} to refuse (baseline {baseline:?}): {mesh:?}"
        );
    }

    // The mesh still carries traffic afterwards.
    flows::assert_ok(&flows::client(a1, open, &ClientRun::default()));
}
