//! Limits and resource errors: connections per pod and per node, HBONE
//! handshakes in progress, enrolment clients, and accept loops that run
//! out of file descriptors. Each limit, when reached, must refuse at once
//! (not queue), be counted in `ztunnel_limit_reached_total{limit}`, be
//! logged naming the pod and the limit, and leave everyone else served.

use std::{
    net::SocketAddr,
    os::fd::{AsRawFd as _, OwnedFd},
    process::Command,
    time::{Duration, Instant},
};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
use ztunnel_tests::{
    Cluster,
    cgroup::TestCgroup,
    flows::{self, ClientRun, WorkloadEntry},
    probe_bin,
    process::PodProcess,
    require_root,
    ztunnel::{Ztunnel, sibling_bin},
};

/// The value of the series `series` (name and labels as printed), or 0.
fn value(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// `ztunnel_limit_reached_total{limit="<limit>"}`.
fn reached(text: &str, limit: &str) -> u64 {
    value(
        text,
        &format!("ztunnel_limit_reached_total{{limit=\"{limit}\"}}"),
    )
}

/// Waits until `series` reads `want` (bounded), returning the last text.
fn wait_for_value(
    cluster: &Cluster,
    node: usize,
    cg: &TestCgroup,
    series: &str,
    want: u64,
) -> String {
    let deadline = Instant::now() + ztunnel_tests::patience(Duration::from_secs(15));
    loop {
        let text = Ztunnel::metrics_of(cluster, node, cg);
        if value(&text, series) == want {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{series} never became {want}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `zt-probe hold`: `count` echoed connections from `pod` to `dst`, kept
/// open for a minute (or until dropped).
fn hold(pod: &ztunnel_tests::Pod, dst: SocketAddr, count: usize, name: &str) -> PodProcess {
    let mut cmd = pod.command(&probe_bin());
    cmd.args([
        "hold",
        "--connect",
        &dst.to_string(),
        "--count",
        &count.to_string(),
        "--seconds",
        "60",
    ]);
    PodProcess::spawn(name, cmd)
}

/// Holds `count` connections and waits until all are open and echoed.
fn held(pod: &ztunnel_tests::Pod, dst: SocketAddr, count: usize, name: &str) -> PodProcess {
    let mut p = hold(pod, dst, count, name);
    let line = p.read_line(Duration::from_secs(30));
    assert_eq!(line, format!("HELD {count}"), "{name}");
    p
}

/// One more connection that must be refused: returns how long it took.
fn refused(pod: &ztunnel_tests::Pod, dst: SocketAddr, name: &str) -> Duration {
    let started = Instant::now();
    let done = hold(pod, dst, 1, name).wait(Duration::from_secs(30));
    let took = started.elapsed();
    assert!(
        !done.status.success() && done.stdout.contains("HOLD-ERROR"),
        "{name}: a connection over the limit was served: {done:?}"
    );
    took
}

/// Runs `zt-hostile stall` from `pod`: `count` connections to `dst`, each
/// sending `bytes` of a TLS record header and then nothing.
fn stall(
    pod: &ztunnel_tests::Pod,
    dst: SocketAddr,
    count: usize,
    bytes: usize,
    wait_secs: u64,
) -> PodProcess {
    let mut cmd = pod.command(&sibling_bin("zt-hostile"));
    cmd.args(["stall", "--connect", &dst.to_string(), "--count"]);
    cmd.arg(count.to_string());
    cmd.args(["--bytes", &bytes.to_string()]);
    cmd.args(["--wait-secs", &wait_secs.to_string()]);
    PodProcess::spawn("stall", cmd)
}

/// Runs `zt-hostile stall` (see [`stall`]) and waits until all its
/// connections are open.
fn stall_opened(
    pod: &ztunnel_tests::Pod,
    dst: SocketAddr,
    count: usize,
    bytes: usize,
    wait_secs: u64,
) -> PodProcess {
    let mut p = stall(pod, dst, count, bytes, wait_secs);
    let opened = p.read_line(Duration::from_secs(30));
    assert!(opened.starts_with("OPENED "), "{opened}");
    p
}

/// `count` echoed connections from `from` to `to`, one after another, each
/// of which must succeed (`during` says what was going on, for the failure).
fn all_connect(from: &ztunnel_tests::Pod, to: SocketAddr, count: usize, during: &str) {
    for i in 0..count {
        let done = flows::client(
            from,
            to,
            &ClientRun {
                bytes: 1000,
                limit: Duration::from_secs(20),
                ..ClientRun::default()
            },
        );
        assert!(
            done.stdout.contains("RESULT ok"),
            "connection {i} to {to} failed {during}: {done:?}"
        );
    }
}

/// What a `zt-hostile stall` saw.
#[derive(Debug)]
struct Stalled {
    /// Connections whose connect (or first write) failed: a reset that
    /// came before the client saw its connect complete.
    failed: usize,
    /// Connections opened.
    opened: usize,
    /// Of those, closed by ztunnel within the wait.
    closed: usize,
    /// The longest any closed one was held.
    max_close_ms: u64,
}

impl Stalled {
    /// Refused by ztunnel, whichever way the client saw it.
    fn refused(&self) -> usize {
        self.failed + self.closed
    }
}

fn stall_result(p: PodProcess) -> Stalled {
    let done = p.wait(Duration::from_secs(60));
    let line = done
        .stdout
        .lines()
        .find(|l| l.starts_with("RESULT"))
        .unwrap_or_else(|| panic!("no RESULT: {done:?}"))
        .to_owned();
    eprintln!("{line}");
    let field = |key: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{key}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {line}"))
    };
    Stalled {
        failed: field("failed") as usize,
        opened: field("opened") as usize,
        closed: field("closed") as usize,
        max_close_ms: field("max_close_ms"),
    }
}

const PER_POD: usize = 3;
const PER_NODE: usize = 5;
/// "At once": process start-up and one round trip on a loaded machine; a
/// queued connection would wait for the 10 s read timeout of `hold`.
const AT_ONCE: Duration = Duration::from_secs(5);

#[test]
fn connections_over_the_pod_and_node_limits_are_refused_at_once() {
    if !require_root("connections_over_the_pod_and_node_limits_are_refused_at_once") {
        return;
    }
    let mut cluster = Cluster::new();
    let b = cluster.add_node("node-b");
    cluster.add_pod(b, "b1");
    cluster.add_pod(b, "b2");
    cluster.add_pod(b, "plain");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("b1", "node-b"),
            WorkloadEntry::enrolled("b2", "node-b"),
            WorkloadEntry::outside("plain", "node-b"),
        ],
    );
    let (b1, b2, plain) = (cluster.pod("b1"), cluster.pod("b2"), cluster.pod("plain"));
    let to_b1 = SocketAddr::from((b1.ip, 8080));
    let to_b2 = SocketAddr::from((b2.ip, 8080));
    let _s1 = flows::server_with(b1, to_b1, "echo", true);
    let _s2 = flows::server_with(b2, to_b2, "echo", true);
    let z = Ztunnel::start(
        &cluster,
        b,
        &[
            "--config",
            config.to_str().expect("utf-8"),
            "--max-connections-per-pod",
            &PER_POD.to_string(),
            "--max-connections-per-node",
            &PER_NODE.to_string(),
        ],
    );
    z.wait_for_log("pod enrolled pod=b1", Duration::from_secs(10));
    z.wait_for_log("pod enrolled pod=b2", Duration::from_secs(10));
    let cg = TestCgroup::create(&format!("{}/metrics-client", cluster.prefix()));
    let accepted = "ztunnel_accepted_connections";

    // b1 at its limit: one more is closed at once; b2 is still served.
    let b1_held = held(plain, to_b1, PER_POD, "b1-held");
    let took = refused(plain, to_b1, "b1-over");
    assert!(took < AT_ONCE, "the refusal took {took:?}");
    let quick = ClientRun {
        limit: Duration::from_secs(20),
        ..ClientRun::default()
    };
    flows::assert_ok(&flows::client(plain, to_b2, &quick));
    // Connections to b1 do not use up b1's own: its outbound has places of
    // its own (here over the same-node path, into b2).
    flows::assert_ok(&flows::client(b1, to_b2, &quick));
    z.wait_for_log("limit reached: connection refused", Duration::from_secs(5));
    assert_eq!(
        z.count_log_lines(&["limit reached", "pod=b1", "limit=\"pod_connections\""]),
        1,
        "one warning naming the pod and the limit"
    );

    // The node at its limit (3 of b1 + 2 of b2): b2, under its own
    // limit, is refused by the node's.
    wait_for_value(&cluster, b, &cg, accepted, PER_POD as u64);
    let b2_held = held(plain, to_b2, PER_NODE - PER_POD, "b2-held");
    let took = refused(plain, to_b2, "b2-over");
    assert!(took < AT_ONCE, "the refusal took {took:?}");
    z.wait_for_log("limit=\"node_connections\"", Duration::from_secs(5));
    assert!(
        z.count_log_lines(&["limit reached", "pod=b2", "limit=\"node_connections\""]) == 1,
        "the node limit's warning names the pod refused"
    );
    let text = Ztunnel::metrics_of(&cluster, b, &cg);
    eprintln!(
        "limits: {} pod, {} node refusals; {} open",
        reached(&text, "pod_connections"),
        reached(&text, "node_connections"),
        value(&text, accepted)
    );
    assert_eq!(reached(&text, "pod_connections"), 1, "{text}");
    assert_eq!(reached(&text, "node_connections"), 1, "{text}");
    assert_eq!(value(&text, accepted), PER_NODE as u64, "{text}");

    // A flood of refusals is one line per pod and limit per interval, and
    // every refusal is counted.
    for i in 0..3 {
        refused(plain, to_b1, &format!("b1-flood-{i}"));
    }
    let text = Ztunnel::metrics_of(&cluster, b, &cg);
    assert_eq!(reached(&text, "pod_connections"), 4, "{text}");
    assert_eq!(
        z.count_log_lines(&["limit reached", "pod=b1", "limit=\"pod_connections\""]),
        1
    );

    // Closed connections give their places back.
    drop(b1_held);
    drop(b2_held);
    wait_for_value(&cluster, b, &cg, accepted, 0);
    flows::assert_ok(&flows::client(plain, to_b1, &quick));
    let _again = held(plain, to_b1, PER_POD, "b1-again");
}

/// One node (`node-b`) with `enrolled` pods in the mesh and `outside` pods
/// outside it, its ztunnel started with `flags` and every enrolled pod
/// enrolled, and a cgroup to read `/metrics` from. Fields drop in order:
/// the cgroup and ztunnel before the cluster's namespaces.
struct OneNode {
    cg: TestCgroup,
    z: Ztunnel,
    cluster: Cluster,
    node: usize,
}

fn one_node(enrolled: &[&str], outside: &[&str], flags: &[&str]) -> OneNode {
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-b");
    for pod in enrolled.iter().chain(outside) {
        cluster.add_pod(node, pod);
    }
    let entries: Vec<WorkloadEntry> = enrolled
        .iter()
        .map(|pod| WorkloadEntry::enrolled(pod, "node-b"))
        .chain(
            outside
                .iter()
                .map(|pod| WorkloadEntry::outside(pod, "node-b")),
        )
        .collect();
    let config = flows::write_config(&cluster, "mesh.yaml", &entries);
    let mut args = vec!["--config", config.to_str().expect("utf-8")];
    args.extend_from_slice(flags);
    let z = Ztunnel::start(&cluster, node, &args);
    for pod in enrolled {
        z.wait_for_log(&format!("pod enrolled pod={pod}"), Duration::from_secs(10));
    }
    let cg = TestCgroup::create(&format!("{}/metrics-client", cluster.prefix()));
    OneNode {
        cg,
        z,
        cluster,
        node,
    }
}

/// `--max-connections-per-pod` in the streams test.
const STREAMS_PER_POD: usize = 4;

#[test]
fn hbone_streams_count_against_the_destination_pods_limit() {
    if !require_root("hbone_streams_count_against_the_destination_pods_limit") {
        return;
    }
    // a1 -> b1 goes through b1's 15008 as from a peer node: one pooled
    // HBONE connection carrying a stream per connection.
    let per_pod = STREAMS_PER_POD.to_string();
    let s = one_node(
        &["a1", "b1"],
        &["plain"],
        &[
            "--local-fastpath",
            "off",
            "--max-connections-per-pod",
            &per_pod,
        ],
    );
    let (cluster, z, cg, b) = (&s.cluster, &s.z, &s.cg, s.node);
    let (a1, b1) = (cluster.pod("a1"), cluster.pod("b1"));
    let to_b1 = SocketAddr::from((b1.ip, 8080));
    let _server = flows::server_with(b1, to_b1, "echo", true);

    // On b1's side the HBONE connection takes one place and each stream
    // one more: three streams fill b1's four.
    let held_streams = held(a1, to_b1, STREAMS_PER_POD - 1, "a1-held");
    let text = Ztunnel::metrics_of(cluster, b, cg);
    assert_eq!(value(&text, "ztunnel_hbone_pool_connections"), 1, "{text}");
    // A fourth stream on the same connection is refused by b1's limit (a1
    // holds only three of its own four places).
    let took = refused(a1, to_b1, "a1-over");
    assert!(took < AT_ONCE, "the refusal took {took:?}");
    let text = wait_for_value(
        cluster,
        b,
        cg,
        "ztunnel_pod_limit_reached_total{pod=\"b1\",limit=\"pod_connections\"}",
        1,
    );
    assert_eq!(
        value(
            &text,
            "ztunnel_pod_limit_reached_total{pod=\"a1\",limit=\"pod_connections\"}"
        ),
        0,
        "{text}"
    );
    z.wait_for_log("limit reached", Duration::from_secs(5));
    assert_eq!(
        z.count_log_lines(&["limit reached", "pod=b1", "limit=\"pod_connections\""]),
        1,
        "one warning naming the pod and the limit"
    );

    // Closed streams give their places back.
    drop(held_streams);
    let quick = ClientRun {
        limit: Duration::from_secs(20),
        ..ClientRun::default()
    };
    let deadline = Instant::now() + ztunnel_tests::patience(Duration::from_secs(10));
    loop {
        let text = Ztunnel::metrics_of(cluster, b, cg);
        // a1's outbound connections and b1's streams are gone; the pooled
        // HBONE connection may stay.
        if value(&text, "ztunnel_accepted_connections") <= 1 {
            break;
        }
        assert!(Instant::now() < deadline, "places not given back:\n{text}");
        std::thread::sleep(Duration::from_millis(200));
    }
    flows::assert_ok(&flows::client(a1, to_b1, &quick));
}

#[test]
fn same_node_connections_count_against_the_destination_pods_limit() {
    if !require_root("same_node_connections_count_against_the_destination_pods_limit") {
        return;
    }
    // The same-node fast path (the default): no HBONE, straight into b1.
    let per_pod = PER_POD.to_string();
    let s = one_node(
        &["a1", "a2", "b1"],
        &[],
        &["--max-connections-per-pod", &per_pod],
    );
    let (cluster, cg, b) = (&s.cluster, &s.cg, s.node);
    let (a1, a2, b1) = (cluster.pod("a1"), cluster.pod("a2"), cluster.pod("b1"));
    let to_b1 = SocketAddr::from((b1.ip, 8080));
    let _server = flows::server_with(b1, to_b1, "echo", true);

    // Two clients fill b1's places; each is under its own limit.
    let _a1_held = held(a1, to_b1, PER_POD - 1, "a1-held");
    let _a2_held = held(a2, to_b1, 1, "a2-held");
    let took = refused(a2, to_b1, "a2-over");
    assert!(took < AT_ONCE, "the refusal took {took:?}");
    let text = wait_for_value(
        cluster,
        b,
        cg,
        "ztunnel_pod_limit_reached_total{pod=\"b1\",limit=\"pod_connections\"}",
        1,
    );
    assert_eq!(
        value(
            &text,
            "ztunnel_pod_limit_reached_total{pod=\"a2\",limit=\"pod_connections\"}"
        ),
        0,
        "{text}"
    );
}

/// `--max-pod-pending-legs` in the legs test.
const LEGS_PER_POD: usize = 8;
/// Connections to the pod whose application never answers.
const LEGS_TRIED: usize = 20;

#[test]
fn legs_to_an_application_that_never_answers_hold_only_the_pods_share() {
    if !require_root("legs_to_an_application_that_never_answers_hold_only_the_pods_share") {
        return;
    }
    let per_pod = LEGS_PER_POD.to_string();
    // Legs hang for the whole test (connect timeout 60 s).
    let s = one_node(
        &["b1", "b2"],
        &["plain"],
        &[
            "--max-pod-pending-legs",
            &per_pod,
            "--connect-timeout-ms",
            "60000",
        ],
    );
    let (cluster, z, cg, b) = (&s.cluster, &s.z, &s.cg, s.node);
    let (b1, b2, plain) = (cluster.pod("b1"), cluster.pod("b2"), cluster.pod("plain"));
    let to_b1 = SocketAddr::from((b1.ip, 8080));
    let to_b2 = SocketAddr::from((b2.ip, 8080));
    let _s1 = flows::server_with(b1, to_b1, "echo", true);
    let _s2 = flows::server_with(b2, to_b2, "echo", true);

    // b1 drops the SYNs of ztunnel's legs to its application (they come
    // from inside the pod, over `lo`; the clients' own SYNs on eth0 still
    // reach ztunnel), so each leg's connect hangs holding its
    // INBOUND_LEGS entry.
    b1.netns().exec("nft", &["add table inet hog"]);
    b1.netns().exec(
        "nft",
        &["add chain inet hog in { type filter hook input priority 0 ; }"],
    );
    b1.netns().exec(
        "nft",
        &["add rule inet hog in iifname lo tcp dport 8080 drop"],
    );
    let mut cmd = plain.command(&sibling_bin("zt-hostile"));
    cmd.args(["hang", "--connect", &to_b1.to_string()]);
    cmd.args(["--count", &LEGS_TRIED.to_string(), "--hold-secs", "60"]);
    let mut hang = PodProcess::spawn("hang", cmd);
    let opened = hang.read_line(Duration::from_secs(30));
    assert_eq!(opened, format!("OPENED {LEGS_TRIED} failed=0"), "{opened}");

    // b1 holds its share of legs; every connection beyond it is refused
    // at once and counted against b1 by name.
    wait_for_value(
        cluster,
        b,
        cg,
        "ztunnel_pod_limit_reached_total{pod=\"b1\",limit=\"pod_pending_legs\"}",
        (LEGS_TRIED - LEGS_PER_POD) as u64,
    );
    z.wait_for_log("limit=\"pod_pending_legs\"", Duration::from_secs(5));
    // b2's legs are its own.
    let quick = ClientRun {
        limit: Duration::from_secs(20),
        ..ClientRun::default()
    };
    flows::assert_ok(&flows::client(plain, to_b2, &quick));
}

/// `--max-hbone-handshakes` in the handshake test.
const MAX_HANDSHAKES: usize = 4;
/// Stalled handshakes the slowloris opens (more than the limit).
const STALLED: usize = 10;

#[test]
fn hbone_handshakes_in_progress_are_limited_and_counted_on_the_server() {
    if !require_root("hbone_handshakes_in_progress_are_limited_and_counted_on_the_server") {
        return;
    }
    let mut cluster = Cluster::new();
    let b = cluster.add_node("node-b");
    cluster.add_pod(b, "a1");
    cluster.add_pod(b, "b1");
    cluster.add_pod(b, "plain");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("a1", "node-b"),
            WorkloadEntry::enrolled("b1", "node-b"),
            WorkloadEntry::outside("plain", "node-b"),
        ],
    );
    let (a1, b1) = (cluster.pod("a1"), cluster.pod("b1"));
    let to_b1 = SocketAddr::from((b1.ip, 8080));
    let _server = flows::server_with(b1, to_b1, "echo", true);
    let z = Ztunnel::start(
        &cluster,
        b,
        &[
            "--config",
            config.to_str().expect("utf-8"),
            // a1 -> b1 goes through b1's 15008, like a peer node would.
            "--local-fastpath",
            "off",
            "--max-hbone-handshakes",
            &MAX_HANDSHAKES.to_string(),
            // Stalled handshakes stay stalled for the whole test.
            "--tls-handshake-timeout-ms",
            "60000",
        ],
    );
    z.wait_for_log("pod enrolled pod=a1", Duration::from_secs(10));
    z.wait_for_log("pod enrolled pod=b1", Duration::from_secs(10));
    let cg = TestCgroup::create(&format!("{}/metrics-client", cluster.prefix()));

    let hbone = SocketAddr::from((b1.ip, 15008));
    let slowloris = stall_opened(cluster.pod("plain"), hbone, STALLED, 5, 8);
    let text = Ztunnel::metrics_of(&cluster, b, &cg);
    assert_eq!(
        value(&text, "ztunnel_hbone_pending_handshakes"),
        MAX_HANDSHAKES as u64,
        "{text}"
    );
    let result = stall_result(slowloris);
    // Those over the limit were refused at once; those within it were
    // held (the handshake timeout is a minute).
    assert_eq!(result.refused(), STALLED - MAX_HANDSHAKES, "{result:?}");
    assert_eq!(result.opened - result.closed, MAX_HANDSHAKES, "{result:?}");
    assert!(
        result.max_close_ms < AT_ONCE.as_millis() as u64,
        "refused handshakes were held {} ms",
        result.max_close_ms
    );
    let text = Ztunnel::metrics_of(&cluster, b, &cg);
    assert_eq!(
        reached(&text, "hbone_handshakes"),
        (STALLED - MAX_HANDSHAKES) as u64,
        "{text}"
    );
    z.wait_for_log("limit=\"hbone_handshakes\"", Duration::from_secs(5));
    assert!(
        z.count_log_lines(&["limit reached", "pod=b1", "limit=\"hbone_handshakes\""]) == 1,
        "one warning naming the pod and the limit"
    );

    // The stalled clients are gone: their places come back, and a meshed
    // client gets through. The server side counts its handshakes now
    // (the stalled ones failed when their clients left).
    wait_for_value(&cluster, b, &cg, "ztunnel_hbone_pending_handshakes", 0);
    flows::assert_ok(&flows::client(
        a1,
        to_b1,
        &ClientRun {
            limit: Duration::from_secs(20),
            ..ClientRun::default()
        },
    ));
    let text = Ztunnel::metrics_of(&cluster, b, &cg);
    let handshakes = |side: &str, outcome: &str| {
        value(
            &text,
            &format!("ztunnel_hbone_tls_handshakes_total{{side=\"{side}\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(handshakes("client", "ok"), 1, "{text}");
    assert_eq!(handshakes("server", "ok"), 1, "{text}");
    assert_eq!(
        handshakes("server", "failed"),
        MAX_HANDSHAKES as u64,
        "{text}"
    );
}

/// A raw client of the enrolment socket that connects and says nothing.
fn silent_enrol_client(socket: &std::path::Path) -> OwnedFd {
    let fd = socket_fd();
    connect(fd.as_raw_fd(), &UnixAddr::new(socket).expect("addr")).expect("connect");
    fd
}

fn socket_fd() -> OwnedFd {
    socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket")
}

/// `--max-enrol-clients` in the enrolment test.
const MAX_ENROL: usize = 2;

#[test]
fn enrolment_clients_over_the_limit_are_told_and_closed() {
    if !require_root("enrolment_clients_over_the_limit_are_told_and_closed") {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "app");
    let z = Ztunnel::start(
        &cluster,
        node,
        &["--max-enrol-clients", &MAX_ENROL.to_string()],
    );
    let cg = TestCgroup::create(&format!("{}/metrics-client", cluster.prefix()));
    let netns = cluster.pod("app").netns_path();
    let enrol = || {
        Command::new(sibling_bin("ztunnel"))
            .arg("enrol")
            .arg("--socket")
            .arg(&z.socket)
            .args(["add", "--uid", "app", "--namespace", "test"])
            .args(["--service-account", "app", "--netns"])
            .arg(&netns)
            .output()
            .expect("run ztunnel enrol")
    };

    let silent: Vec<OwnedFd> = (0..MAX_ENROL)
        .map(|_| silent_enrol_client(&z.socket))
        .collect();
    wait_for_value(
        &cluster,
        node,
        &cg,
        "ztunnel_enrol_clients",
        MAX_ENROL as u64,
    );
    let started = Instant::now();
    let out = enrol();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "enrolled past the limit: {out:?}");
    assert!(
        stderr.contains("too many enrolment clients"),
        "the client is told why: {stderr}"
    );
    assert!(took < AT_ONCE, "the refusal took {took:?}");
    z.wait_for_log("limit=\"enrol_clients\"", Duration::from_secs(5));
    let text = Ztunnel::metrics_of(&cluster, node, &cg);
    assert_eq!(reached(&text, "enrol_clients"), 1, "{text}");

    drop(silent);
    wait_for_value(&cluster, node, &cg, "ztunnel_enrol_clients", 0);
    let out = enrol();
    assert!(out.status.success(), "{out:?}");
    z.wait_for_log("pod enrolled pod=app", Duration::from_secs(10));
}

/// ztunnel's fixed limit per admin, metrics or readiness server
/// (`limits::ADMIN_CONNECTIONS_PER_LISTENER`).
const ADMIN_MAX: usize = 128;
/// Connections beyond it in the flood test.
const ADMIN_EXTRA: usize = 12;

#[test]
fn a_flood_on_the_metrics_port_is_capped_and_silent_clients_are_dropped() {
    if !require_root("a_flood_on_the_metrics_port_is_capped_and_silent_clients_are_dropped") {
        return;
    }
    let mut cluster = Cluster::new();
    let n = cluster.add_node("node-a");
    cluster.add_pod(n, "plain");
    let z = Ztunnel::start(&cluster, n, &[]);
    let plain = cluster.pod("plain");
    // 15020 listens on every address of the node, so a pod reaches it.
    let port = SocketAddr::from((cluster.node(n).ip, 15020));
    let mut holders = stall(plain, port, ADMIN_MAX, 0, 20);
    assert_eq!(
        holders.read_line(Duration::from_secs(30)),
        format!("OPENED {ADMIN_MAX}")
    );
    let over = stall_result(stall(plain, port, ADMIN_EXTRA, 0, 3));
    assert_eq!(
        over.refused(),
        ADMIN_EXTRA,
        "every connection over the limit is refused: {over:?}"
    );
    assert!(
        over.max_close_ms < AT_ONCE.as_millis() as u64,
        "refused connections were held {} ms",
        over.max_close_ms
    );
    // Another server of the node still answers meanwhile.
    let cg = TestCgroup::create(&format!("{}/metrics-client", cluster.prefix()));
    let (status, _) = Ztunnel::http_get(
        &cluster.node(n).netns().path(),
        &cg.procs(),
        "127.0.0.1:15021",
        "/healthz/ready",
    );
    assert_eq!(status, 200);
    // The holders never send a request: dropped after the header timeout
    // (10 s), not kept for as long as they like.
    let held = stall_result(holders);
    assert_eq!(
        held.closed, ADMIN_MAX,
        "silent clients are dropped: {held:?}"
    );
    assert!(
        (9_000..19_000).contains(&held.max_close_ms),
        "silent clients held {} ms",
        held.max_close_ms
    );
    let text = Ztunnel::metrics_of(&cluster, n, &cg);
    assert_eq!(
        reached(&text, "admin_connections"),
        ADMIN_EXTRA as u64,
        "{text}"
    );
    z.wait_for_log("limit=\"admin_connections\"", Duration::from_secs(5));
}

/// The lowest file descriptor number `pid` does not use: with
/// `RLIMIT_NOFILE` set to it, its next `accept()` fails with `EMFILE`.
fn lowest_free_fd(pid: u32) -> u64 {
    let used: std::collections::HashSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    (0..=used.len() as u64)
        .find(|n| !used.contains(n))
        .expect("a free fd")
}

/// Sets the soft `RLIMIT_NOFILE` of `pid`; returns the old one.
fn set_nofile(pid: u32, soft: u64) -> libc::rlimit {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reading the current limits into a valid struct.
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            std::ptr::null(),
            &raw mut old,
        )
    };
    assert_eq!(rc, 0, "prlimit get: {}", std::io::Error::last_os_error());
    let new = libc::rlimit {
        rlim_cur: soft,
        rlim_max: old.rlim_max,
    };
    // SAFETY: setting limits from a valid struct.
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &raw const new,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit set: {}", std::io::Error::last_os_error());
    old
}

/// User + system CPU time of `pid` so far, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // Fields after the command name (which may hold spaces): utime and
    // stime are the 12th and 13th after it.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime")
}

/// How long the CPU use is sampled while accept fails.
const SAMPLE: Duration = Duration::from_secs(4);

#[test]
fn accept_backs_off_when_out_of_file_descriptors_and_serves_again() {
    if !require_root("accept_backs_off_when_out_of_file_descriptors_and_serves_again") {
        return;
    }
    let mut cluster = Cluster::new();
    let b = cluster.add_node("node-b");
    cluster.add_pod(b, "b1");
    cluster.add_pod(b, "plain");
    let (b1, plain) = (cluster.pod("b1"), cluster.pod("plain"));
    let to_b1 = SocketAddr::from((b1.ip, 8080));
    let _server = flows::server_with(b1, to_b1, "echo", true);
    // The config only lists b1 (a pod whose workload is unknown gets no
    // traffic); the pod comes over the socket. While ztunnel has no
    // descriptor left its watcher cannot read the file either, and keeps
    // the state it has.
    let config = flows::write_listed_pods(
        &cluster,
        "mesh.yaml",
        &[flows::ListedPod {
            pod: "b1",
            uid: "b1",
            namespace: "test",
            service_account: "b1",
            node: "node-b",
        }],
    );
    let z = Ztunnel::start(&cluster, b, &["--config", config.to_str().expect("utf-8")]);
    let out = Command::new(sibling_bin("ztunnel"))
        .arg("enrol")
        .arg("--socket")
        .arg(&z.socket)
        .args(["add", "--uid", "b1", "--namespace", "test"])
        .args(["--service-account", "b1", "--netns"])
        .arg(b1.netns_path())
        .output()
        .expect("run ztunnel enrol");
    assert!(out.status.success(), "{out:?}");
    z.wait_for_log("pod enrolled pod=b1", Duration::from_secs(10));
    let run = ClientRun {
        limit: Duration::from_secs(30),
        connect_timeout: 10,
        ..ClientRun::default()
    };
    flows::assert_ok(&flows::client(plain, to_b1, &run));

    // No descriptor left: the next connection to b1 waits in the
    // listener's queue, and every accept() fails with EMFILE.
    let pid = z.pid();
    let old = set_nofile(pid, lowest_free_fd(pid));
    let mut cmd = plain.command(&probe_bin());
    cmd.args(["client", "--connect", &to_b1.to_string(), "--bytes", "1000"]);
    cmd.args(["--timeout", "30", "--connect-timeout", "10"]);
    let waiting = PodProcess::spawn("waiting-client", cmd);
    z.wait_for_log("accept failed: backing off", Duration::from_secs(10));
    let before = cpu_ticks(pid);
    std::thread::sleep(SAMPLE);
    let used = cpu_ticks(pid) - before;
    // SAFETY: sysconf has no preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap_or(100);
    let share = used as f64 / (hz as f64 * SAMPLE.as_secs_f64());
    let lines = z.count_log_lines(&["accept failed: backing off"]);
    eprintln!(
        "out of fds: ztunnel used {:.1}% of a core over {SAMPLE:?}, {lines} warning line(s)",
        share * 100.0
    );
    set_nofile(pid, old.rlim_cur);
    // A spinning loop takes a whole core; backing off, a few percent at
    // most even on a loaded machine.
    assert!(
        share < 0.10,
        "ztunnel spun at {:.0}% of a core",
        share * 100.0
    );
    assert!(lines <= 2, "{lines} warnings: the log is not rate-limited");

    // Descriptors are back: the waiting connection is served, and so are
    // new ones.
    let done = waiting.wait(Duration::from_secs(40));
    flows::assert_ok(&done);
    flows::assert_ok(&flows::client(plain, to_b1, &run));
    let cg = TestCgroup::create(&format!("{}/metrics-client", cluster.prefix()));
    let text = Ztunnel::metrics_of(&cluster, b, &cg);
    let errors = value(
        &text,
        "ztunnel_accept_errors_total{listener=\"inbound_plaintext\",kind=\"process_fd_limit\"}",
    );
    eprintln!("accept errors counted: {errors}");
    assert!(errors >= 1, "{text}");
}

/// The node's handshake places in the flood test.
const FLOOD_NODE: usize = 8;
/// One pod's share of them.
const FLOOD_PER_POD: usize = 4;
/// Silent connections the flood opens against one pod: more than the node has.
const FLOOD_COUNT: usize = 12;

/// A flood of silent connections to one pod's 15008 holds at most that
/// pod's share of the node's handshake places, and a second flood that
/// fills the node's places makes room for a pod holding fewer: while both
/// last, another pod's peers open new HBONE connections to the same node,
/// every one.
#[test]
fn a_handshake_flood_against_some_pods_leaves_the_others_reachable() {
    if !require_root("a_handshake_flood_against_some_pods_leaves_the_others_reachable") {
        return;
    }
    let node_places = FLOOD_NODE.to_string();
    let pod_places = FLOOD_PER_POD.to_string();
    let OneNode {
        cg,
        z: _z,
        cluster,
        node: b,
    } = one_node(
        &["a1", "b1", "b2", "b3"],
        &["plain"],
        &[
            // a1 -> b2 goes through b2's 15008, like a peer node would.
            "--local-fastpath",
            "off",
            "--max-hbone-handshakes",
            &node_places,
            "--max-pod-hbone-handshakes",
            &pod_places,
            "--tls-handshake-timeout-ms",
            "60000",
        ],
    );
    let (a1, b1, b2, b3) = (
        cluster.pod("a1"),
        cluster.pod("b1"),
        cluster.pod("b2"),
        cluster.pod("b3"),
    );
    let to_b2 = SocketAddr::from((b2.ip, 8080));
    let _server = flows::server_with(b2, to_b2, "echo", true);

    // More silent connections to b1 than the whole node has places.
    let flood = stall_opened(
        cluster.pod("plain"),
        SocketAddr::from((b1.ip, 15008)),
        FLOOD_COUNT,
        5,
        20,
    );
    // The client's connects are done; ztunnel may still be accepting them.
    let series = "ztunnel_pod_limit_reached_total{pod=\"b1\",limit=\"pod_hbone_handshakes\"}";
    wait_for_value(
        &cluster,
        b,
        &cg,
        series,
        (FLOOD_COUNT - FLOOD_PER_POD) as u64,
    );
    let text = wait_for_value(
        &cluster,
        b,
        &cg,
        "ztunnel_hbone_pending_handshakes",
        FLOOD_PER_POD as u64,
    );
    assert_eq!(reached(&text, "hbone_handshakes"), 0, "{text}");
    // A second flood, within b3's share, takes the rest of the node's.
    let second = stall_opened(
        cluster.pod("plain"),
        SocketAddr::from((b3.ip, 15008)),
        FLOOD_NODE - FLOOD_PER_POD,
        5,
        20,
    );
    wait_for_value(
        &cluster,
        b,
        &cg,
        "ztunnel_hbone_pending_handshakes",
        FLOOD_NODE as u64,
    );

    // Meanwhile b2's peers connect: the first opens an HBONE connection to
    // b2, taking the oldest place of a flooded pod (b2 holds none), the
    // others ride on it.
    all_connect(a1, to_b2, 10, "during the floods against b1 and b3");
    let text = Ztunnel::metrics_of(&cluster, b, &cg);
    assert_eq!(
        value(&text, series),
        (FLOOD_COUNT - FLOOD_PER_POD) as u64,
        "{text}"
    );
    assert_eq!(reached(&text, "hbone_handshakes"), 0, "{text}");
    let evicted = |pod: &str| {
        value(
            &text,
            &format!(
                "ztunnel_pod_handshakes_evicted_total{{pod=\"{pod}\",limit=\"hbone_handshakes\"}}"
            ),
        )
    };
    assert_eq!(evicted("b1") + evicted("b3"), 1, "{text}");
    assert_eq!(
        value(
            &text,
            "ztunnel_hbone_tls_handshakes_total{side=\"server\",outcome=\"evicted\"}"
        ),
        1,
        "{text}"
    );
    // The floods saw it: one of their held connections was closed early.
    let (first, second) = (stall_result(flood), stall_result(second));
    assert_eq!(
        first.refused() + second.refused(),
        FLOOD_COUNT - FLOOD_PER_POD + 1,
        "{first:?} {second:?}"
    );
}

/// `--max-connections-per-node` in the node-pressure test.
const PRESSURE_NODE: usize = 6;

/// When the node's open connections are all taken, connections still in
/// their HBONE handshake are the first to go: silent connections to b1's
/// 15008 that fill the node make room, oldest first, for a1's connections
/// to b2 (its outbound connection, the HBONE connection and its stream).
#[test]
fn under_node_pressure_connections_in_their_handshake_go_first() {
    if !require_root("under_node_pressure_connections_in_their_handshake_go_first") {
        return;
    }
    let per_node = PRESSURE_NODE.to_string();
    let OneNode {
        cg,
        z,
        cluster,
        node: b,
    } = one_node(
        &["a1", "b1", "b2"],
        &["plain"],
        &[
            "--local-fastpath",
            "off",
            "--max-connections-per-node",
            &per_node,
            "--tls-handshake-timeout-ms",
            "60000",
        ],
    );
    let (a1, b1, b2) = (cluster.pod("a1"), cluster.pod("b1"), cluster.pod("b2"));
    let to_b2 = SocketAddr::from((b2.ip, 8080));
    let _server = flows::server_with(b2, to_b2, "echo", true);
    let flood = stall_opened(
        cluster.pod("plain"),
        SocketAddr::from((b1.ip, 15008)),
        PRESSURE_NODE,
        5,
        20,
    );
    wait_for_value(
        &cluster,
        b,
        &cg,
        "ztunnel_accepted_connections",
        PRESSURE_NODE as u64,
    );
    all_connect(a1, to_b2, 10, "while silent handshakes filled the node");
    let text = Ztunnel::metrics_of(&cluster, b, &cg);
    assert_eq!(reached(&text, "node_connections"), 0, "{text}");
    // The first client needed three places (15001, the HBONE connection,
    // its stream); later ones reuse what the earlier ones gave back, unless
    // an evicted connection had not closed yet when they came.
    let evicted = value(
        &text,
        "ztunnel_pod_handshakes_evicted_total{pod=\"b1\",limit=\"node_connections\"}",
    );
    assert!((3..=PRESSURE_NODE as u64).contains(&evicted), "{text}");
    z.wait_for_log("HBONE handshake evicted", Duration::from_secs(5));
    assert!(
        z.count_log_lines(&["node under pressure", "pod=b1", "for_pod=a1"]) == 1,
        "one warning naming both pods"
    );
    // The flood saw exactly those connections closed, and no other.
    let flood = stall_result(flood);
    assert_eq!(flood.closed as u64, evicted, "{flood:?}");
    assert_eq!(flood.failed, 0, "{flood:?}");
}

/// `--splice-pipes` in the pipes test.
const PIPES_NODE: usize = 8;
/// `--max-pod-splice-pipes` there.
const PIPES_PER_POD: usize = 2;
/// Connections the hostile pod streams into a peer that never reads: more
/// than the node has pipes.
const PIPES_PUSHED: usize = 10;

/// A pod whose connections stream into a peer that never reads holds each
/// one's pipe for as long as it likes; it holds its share of the node's
/// splice pipes and no more (its other connections copy), and another
/// pod's streaming connection still splices.
#[test]
fn a_pod_streaming_into_a_stalled_peer_holds_only_its_share_of_splice_pipes() {
    if !require_root("a_pod_streaming_into_a_stalled_peer_holds_only_its_share_of_splice_pipes") {
        return;
    }
    let (node_pipes, pod_pipes) = (PIPES_NODE.to_string(), PIPES_PER_POD.to_string());
    let OneNode {
        cg,
        z: _z,
        cluster,
        node: b,
    } = one_node(
        &["a1", "b1"],
        &["plain"],
        &[
            "--splice-pipes",
            &node_pipes,
            "--max-pod-splice-pipes",
            &pod_pipes,
        ],
    );
    let (a1, b1, plain) = (cluster.pod("a1"), cluster.pod("b1"), cluster.pod("plain"));
    let deaf_addr = SocketAddr::from((plain.ip, 8080));
    let mut deaf_cmd = plain.command(&sibling_bin("zt-hostile"));
    deaf_cmd.args([
        "deaf",
        "--bind",
        &deaf_addr.to_string(),
        "--hold-secs",
        "300",
    ]);
    let mut deaf = PodProcess::spawn("deaf", deaf_cmd);
    let ready = deaf.read_line(Duration::from_secs(10));
    assert!(ready.starts_with("LISTENING"), "{ready}");
    let to_digest = SocketAddr::from((plain.ip, 8081));
    let _digest = flows::server_with(plain, to_digest, "digest", true);

    let mut push_cmd = a1.command(&sibling_bin("zt-hostile"));
    push_cmd.args(["push", "--connect", &deaf_addr.to_string(), "--count"]);
    push_cmd.arg(PIPES_PUSHED.to_string());
    push_cmd.args(["--hold-secs", "300"]);
    let mut push = PodProcess::spawn("push", push_cmd);
    let opened = push.read_line(Duration::from_secs(120));
    assert!(opened.starts_with("OPENED "), "{opened}");
    eprintln!("{opened}");
    let text = Ztunnel::metrics_of(&cluster, b, &cg);
    let held = value(&text, "ztunnel_pod_splice_pipes{pod=\"a1\"}");
    let refused = value(
        &text,
        "ztunnel_pod_limit_reached_total{pod=\"a1\",limit=\"pod_splice_pipes\"}",
    );
    eprintln!(
        "a1 holds {held} pipes, refused {refused}; node {}",
        value(&text, "ztunnel_splice_pipes")
    );
    assert!(held <= PIPES_PER_POD as u64, "{text}");
    assert!(refused >= 1, "a1 never wanted more than its share:\n{text}");

    // b1 streams to a reading server: its relay splices from the pipes a1
    // could not take (the count grows when its connection closes).
    let before = value(
        &Ztunnel::metrics_of(&cluster, b, &cg),
        "ztunnel_spliced_bytes_total",
    );
    let done = flows::client(
        b1,
        to_digest,
        &ClientRun {
            bytes: 32 << 20,
            chunk: 64 * 1024,
            mode: "digest",
            limit: Duration::from_secs(60),
            ..ClientRun::default()
        },
    );
    flows::assert_ok(&done);
    let text = Ztunnel::metrics_of(&cluster, b, &cg);
    let spliced = value(&text, "ztunnel_spliced_bytes_total") - before;
    eprintln!("b1 spliced {spliced} bytes");
    assert!(spliced > 0, "b1's stream found no pipe:\n{text}");
    // a1's own new connections still work: past its share they copy.
    flows::assert_ok(&flows::client(
        a1,
        to_digest,
        &ClientRun {
            bytes: 4 << 20,
            chunk: 64 * 1024,
            mode: "digest",
            limit: Duration::from_secs(60),
            ..ClientRun::default()
        },
    ));
    assert!(
        value(
            &Ztunnel::metrics_of(&cluster, b, &cg),
            "ztunnel_pod_splice_pipes{pod=\"a1\"}"
        ) <= PIPES_PER_POD as u64
    );
    // The stalled relays hold their pipes until their peer goes: the
    // client's close is queued behind the bytes the deaf server never
    // read. Once it goes, every pipe comes back.
    drop(push);
    drop(deaf);
    wait_for_value(&cluster, b, &cg, "ztunnel_splice_pipes", 0);
    let text = wait_for_value(&cluster, b, &cg, "ztunnel_accepted_connections", 0);
    assert!(!text.contains("ztunnel_pod_splice_pipes{"), "{text}");
}

/// Connects the hog starts: more than the node's whole `ORIG_DST` map.
const HANG_COUNT: usize = 70_000;
/// ... from this many processes.
const HANG_PROCESSES: usize = 4;

#[test]
fn a_pod_whose_connects_hang_holds_only_its_share_of_pending_records() {
    if !require_root("a_pod_whose_connects_hang_holds_only_its_share_of_pending_records") {
        return;
    }
    // The default share (`--max-pod-pending-connects`).
    let s = one_node(&["hog", "victim"], &["server"], &[]);
    let (cluster, z, cg, n) = (&s.cluster, &s.z, &s.cg, s.node);
    let (hog, victim, server) = (
        cluster.pod("hog"),
        cluster.pod("victim"),
        cluster.pod("server"),
    );
    let dst = SocketAddr::from((server.ip, 8080));
    let _server = flows::server_with(server, dst, "echo", true);

    // The hog drops its own SYNs to its outbound listener, so every connect
    // it starts stays in SYN_SENT holding its record (a pod may do this to
    // itself: it only needs CAP_NET_ADMIN in its own namespace). The wider
    // port range gives it 64,512 connects per family to that listener.
    let ns = hog.netns();
    ns.sysctl("net.ipv4.ip_local_port_range", "1024 65535");
    // Its connects give up only after hours (default: ~2 min, shorter than
    // opening 70,000 of them takes on an emulated CPU; a socket that gives
    // up leaves SYN_SENT and rightly gives its place back).
    ns.sysctl("net.ipv4.tcp_syn_retries", "12");
    ns.exec("nft", &["add table inet hog"]);
    ns.exec(
        "nft",
        &["add chain inet hog out { type filter hook output priority 0 ; }"],
    );
    ns.exec("nft", &["add rule inet hog out tcp dport 15001 drop"]);
    // Several processes: each may hold as many descriptors as its hard
    // limit allows (20,000 here), and a pod may run as many as it likes.
    let per_process = HANG_COUNT / HANG_PROCESSES;
    let hard = ztunnel_tests::raise_nofile(per_process as u64 + 64);
    assert!(
        hard > per_process as u64,
        "RLIMIT_NOFILE's hard limit is {hard}"
    );
    let hangs: Vec<PodProcess> = (0..HANG_PROCESSES)
        .map(|i| {
            let mut cmd = hog.command(&sibling_bin("zt-hostile"));
            cmd.args(["hang", "--connect", &dst.to_string()]);
            cmd.args([
                "--connect",
                &SocketAddr::from((server.ip6, 8080)).to_string(),
            ]);
            // Held until dropped (killed): opening all of them takes
            // minutes on an emulated CPU.
            cmd.args(["--count", &per_process.to_string(), "--hold-secs", "900"]);
            let mut hang = PodProcess::spawn(&format!("hang-{i}"), cmd);
            let opened = hang.read_line(ztunnel_tests::patience(Duration::from_secs(60)));
            assert_eq!(opened, format!("OPENED {per_process} failed=0"), "{opened}");
            hang
        })
        .collect();

    // The hog holds its share and no more; every connect beyond it was
    // given no record, and counted against the hog by name.
    let share = u64::from(ztunnel_common::DEFAULT_MAX_POD_PENDING);
    let text = wait_for_value(
        cluster,
        n,
        cg,
        "ztunnel_pod_pending_connects{pod=\"hog\"}",
        share,
    );
    let refused = value(
        &text,
        "ztunnel_pod_limit_reached_total{pod=\"hog\",limit=\"pod_pending_connects\"}",
    );
    assert_eq!(refused, HANG_COUNT as u64 - share, "{text}");
    let counters = z.counters();
    assert_eq!(
        counters.get(ztunnel_common::Counter::OrigDstPodShareFull),
        refused,
        "{counters:?}"
    );

    // Meanwhile the victim's new connections all go through.
    let run = ClientRun {
        bytes: 1000,
        connect_timeout: 3,
        limit: Duration::from_secs(10),
        ..ClientRun::default()
    };
    for i in 0..20 {
        let done = flows::client(victim, dst, &run);
        assert!(
            done.stdout.contains("RESULT ok"),
            "the victim's connection {i} failed while the hog held its share: {done:?}"
        );
    }
    let text = Ztunnel::metrics_of(cluster, n, cg);
    assert_eq!(
        value(&text, "ztunnel_pod_pending_connects{pod=\"victim\"}"),
        0,
        "{text}"
    );

    // The hog's sockets close: every place comes back (nothing leaks), and
    // with its SYNs flowing again the hog's own connections work.
    drop(hangs);
    wait_for_value(
        cluster,
        n,
        cg,
        "ztunnel_pod_pending_connects{pod=\"hog\"}",
        0,
    );
    ns.exec("nft", &["delete table inet hog"]);
    flows::assert_ok(&flows::client(hog, dst, &run));
}
