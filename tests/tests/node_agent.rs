//! ZDS as Istio's node agent speaks it: ztunnel dials a test agent
//! (`ztunnel_tests::node_agent`, whose messages are encoded by hand from
//! Istio's field numbers), says hello, takes the snapshot, then adds and
//! deletes; protocol errors, pending pods, readiness and agent restarts.

use std::{net::SocketAddr, time::Duration};

use ztunnel_common::Counter;
use ztunnel_tests::{
    Cluster, Pod,
    cgroup::TestCgroup,
    flows::{self, ClientRun},
    node_agent::{AgentPod, NodeAgent, encode_del, encode_keep, encode_snapshot_sent},
    require_root,
    ztunnel::Ztunnel,
};

fn agent_pod(pod: &Pod) -> AgentPod {
    AgentPod {
        uid: format!("{}-uid", pod.name),
        name: pod.name.clone(),
        namespace: "test".into(),
        service_account: pod.name.clone(),
        netns: pod.netns_path(),
    }
}

/// Starts ztunnel dialling the agent at `socket`, with a mesh state that
/// lists every pod of the cluster the way [`agent_pod`] names it (a pod
/// whose workload is unknown gets no traffic; the agent enrols them).
fn start(cluster: &Cluster, node: usize, socket: &str, pods: &[&str]) -> Ztunnel {
    let uids: Vec<String> = pods.iter().map(|p| format!("{p}-uid")).collect();
    let listed: Vec<flows::ListedPod<'_>> = pods
        .iter()
        .zip(&uids)
        .map(|(pod, uid)| flows::ListedPod {
            pod,
            uid,
            namespace: "test",
            service_account: pod,
            node: "node-a",
        })
        .collect();
    let config = flows::write_listed_pods(cluster, "mesh.yaml", &listed);
    Ztunnel::start(
        cluster,
        node,
        &[
            "--node-agent-socket",
            socket,
            "--config",
            config.to_str().expect("utf-8"),
        ],
    )
}

/// Whether a connection from `from` to `dst` went through ztunnel's
/// capture (the outbound redirect counter moved by one).
fn captured(z: &Ztunnel, from: &Pod, dst: SocketAddr) -> bool {
    let before = z.counters().get(Counter::ConnectRedirected);
    flows::assert_ok(&flows::client(from, dst, &ClientRun::default()));
    z.counters().get(Counter::ConnectRedirected) > before
}

fn readiness(cluster: &Cluster, cg: &TestCgroup) -> (u16, String) {
    Ztunnel::http_get(
        &cluster.node(0).netns().path(),
        &cg.procs(),
        "127.0.0.1:15021",
        "/healthz/ready",
    )
}

/// Polls readiness until it answers `status`, at most `limit`.
fn wait_readiness(cluster: &Cluster, cg: &TestCgroup, status: u16, limit: Duration) -> String {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let (got, body) = readiness(cluster, cg);
        if got == status {
            return body;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "readiness still {got} ({body}) after {limit:?}, expected {status}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn ztunnel_dials_the_agent_says_hello_and_follows_snapshot_add_and_del() {
    if !require_root("ztunnel_dials_the_agent_says_hello_and_follows_snapshot_add_and_del") {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    for name in ["app", "other", "third"] {
        cluster.add_pod(node, name);
    }
    let (app, other, third) = (
        cluster.pod("app"),
        cluster.pod("other"),
        cluster.pod("third"),
    );
    let dst = SocketAddr::from((other.ip, 8080));
    let _server = flows::server(other, dst, "echo");
    let agent = NodeAgent::start(&cluster.dir().join("agent.sock"), vec![agent_pod(app)]);
    let socket = agent.path().to_str().expect("utf-8").to_owned();
    let z = start(&cluster, node, &socket, &["app", "third"]);
    let cg = TestCgroup::create(&format!("{}/ready-client", cluster.prefix()));

    agent.wait_for_hellos(1, Duration::from_secs(10));
    assert_eq!(agent.hellos()[0], [0x08, 0x01], "ZdsHello{{version: V1}}");
    wait_readiness(&cluster, &cg, 200, Duration::from_secs(10));
    assert!(captured(&z, app, dst), "the snapshot's pod is not captured");
    assert!(!captured(&z, third, dst), "a pod nobody sent is captured");

    assert_eq!(agent.add(agent_pod(third)), Ok(String::new()));
    assert!(captured(&z, third, dst), "an added pod is not captured");

    // Istio's DelWorkload carries the uid in field 2. A uid in field 1 (what
    // our first, hand-written message used) is not a uid at all: refused,
    // not acknowledged as a success that removes nothing.
    let field_one = [0x12, 0x0b, 0x0a, 0x09];
    let wrong = [&field_one[..], b"third-uid"].concat();
    let ack = agent.send_raw(&wrong, None).expect("an answer");
    assert!(ack.contains("uid is empty"), "{ack}");
    assert!(captured(&z, third, dst));

    assert_eq!(agent.del("app-uid"), vec![Ok(String::new())]);
    z.wait_for_log("pod removed pod=app-uid", Duration::from_secs(5));
    assert!(!captured(&z, app, dst), "a deleted pod is still captured");
    assert!(captured(&z, third, dst));
    assert_eq!(agent.hellos().len(), 1, "ztunnel reconnected without cause");
}

#[test]
fn protocol_errors_close_the_connection_and_ztunnel_comes_back_for_a_snapshot() {
    if !require_root("protocol_errors_close_the_connection_and_ztunnel_comes_back_for_a_snapshot") {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "app");
    cluster.add_pod(node, "other");
    let (app, other) = (cluster.pod("app"), cluster.pod("other"));
    let dst = SocketAddr::from((other.ip, 8080));
    let _server = flows::server(other, dst, "echo");
    let agent = NodeAgent::start(&cluster.dir().join("agent.sock"), vec![agent_pod(app)]);
    let socket = agent.path().to_str().expect("utf-8").to_owned();
    let z = start(&cluster, node, &socket, &["app"]);
    agent.wait_for_hellos(1, Duration::from_secs(10));

    let cases: [(&str, Vec<u8>, bool, &str); 4] = [
        (
            "second snapshot_sent",
            encode_snapshot_sent(),
            false,
            "already received",
        ),
        (
            "keep after the snapshot",
            encode_keep("app-uid"),
            false,
            "only valid before snapshot_sent",
        ),
        (
            "del with an fd",
            encode_del("app-uid"),
            true,
            "del must carry 0 fd",
        ),
        (
            "not a WorkloadRequest",
            vec![0xff, 0xff, 0xff],
            false,
            "malformed ZDS message",
        ),
    ];
    for (i, (what, bytes, with_fd, expected)) in cases.into_iter().enumerate() {
        let netns = app.netns_path();
        let ack = agent
            .send_raw(&bytes, with_fd.then_some(netns.as_path()))
            .unwrap_or_else(|e| panic!("{what}: no answer: {e}"));
        assert!(ack.contains(expected), "{what}: {ack}");
        // ztunnel closed that connection and dialled again: a new hello,
        // and the snapshot again, which keeps the pod (re-adding it with
        // the same netns is a no-op).
        agent.wait_for_hellos(i + 2, Duration::from_secs(10));
    }
    assert!(captured(&z, app, dst), "the pod was lost across reconnects");
    assert_eq!(z.count_log_lines(&["pod enrolled", "app-uid"]), 1);
    assert_eq!(z.count_log_lines(&["pod removed", "app-uid"]), 0);
}

#[test]
fn readiness_waits_for_the_agent_and_a_pod_that_cannot_start_is_retried() {
    if !require_root("readiness_waits_for_the_agent_and_a_pod_that_cannot_start_is_retried") {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "app");
    cluster.add_pod(node, "other");
    let (app, other) = (cluster.pod("app"), cluster.pod("other"));
    let dst = SocketAddr::from((other.ip, 8080));
    let _server = flows::server(other, dst, "echo");
    let path = cluster.dir().join("agent.sock");
    let socket = path.to_str().expect("utf-8").to_owned();
    let z = start(&cluster, node, &socket, &["app"]);
    let cg = TestCgroup::create(&format!("{}/ready-client", cluster.prefix()));

    // No agent yet: not ready, and saying why.
    let body = wait_readiness(&cluster, &cg, 503, Duration::from_secs(5));
    assert!(body.contains("not connected to the node agent"), "{body}");

    // The pod's outbound port is taken by one of its own processes (bound
    // without SO_REUSEPORT): ztunnel cannot open its listener there.
    let blocker = flows::server(app, "127.0.0.1:15001".parse().expect("addr"), "echo");
    let agent = NodeAgent::start(&path, vec![agent_pod(app)]);
    agent.wait_for_hellos(1, Duration::from_secs(20));
    let body = wait_readiness(&cluster, &cg, 503, Duration::from_secs(5));
    assert!(
        body.contains("1 pod(s) from the node agent could not be enrolled yet"),
        "{body}"
    );
    z.wait_for_log("kept pending", Duration::from_secs(5));

    // The port comes free: the retry (every 5 s) enrols the pod, and
    // ztunnel becomes ready.
    drop(blocker);
    wait_readiness(&cluster, &cg, 200, Duration::from_secs(12));
    z.wait_for_log("pending pod enrolled on retry", Duration::from_secs(2));
    assert!(captured(&z, app, dst));
}

#[test]
fn a_restarted_agent_sends_a_new_snapshot_and_pods_it_lost_are_removed() {
    if !require_root("a_restarted_agent_sends_a_new_snapshot_and_pods_it_lost_are_removed") {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    for name in ["app", "other", "server"] {
        cluster.add_pod(node, name);
    }
    let (app, other, server) = (
        cluster.pod("app"),
        cluster.pod("other"),
        cluster.pod("server"),
    );
    let dst = SocketAddr::from((server.ip, 8080));
    let _server = flows::server(server, dst, "echo");
    let path = cluster.dir().join("agent.sock");
    let socket = path.to_str().expect("utf-8").to_owned();
    let agent = NodeAgent::start(&path, vec![agent_pod(app), agent_pod(other)]);
    let z = start(&cluster, node, &socket, &["app", "other"]);
    agent.wait_for_hellos(1, Duration::from_secs(10));
    assert!(captured(&z, app, dst) && captured(&z, other, dst));

    // The agent goes away: nothing changes for the pods meanwhile.
    drop(agent);
    z.wait_for_log("node agent connection ended", Duration::from_secs(10));
    assert!(captured(&z, app, dst) && captured(&z, other, dst));

    // Back, without `app` (deleted while it was away).
    let agent = NodeAgent::start(&path, vec![agent_pod(other)]);
    agent.wait_for_hellos(1, Duration::from_secs(20));
    z.wait_for_log("pod removed pod=app-uid", Duration::from_secs(5));
    assert!(
        !captured(&z, app, dst),
        "a pod missing from the snapshot is still captured"
    );
    assert!(captured(&z, other, dst));
    assert_eq!(z.count_log_lines(&["pod enrolled", "other-uid"]), 1);
}
