//! Peers that stall: a slowloris on the HBONE port, a black-holed HBONE
//! peer. ztunnel must cut them off within its configured time limits,
//! count them in `ztunnel_timeouts_total{phase}`, and keep serving
//! everyone else.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use ztunnel_tests::{
    Cluster,
    cgroup::TestCgroup,
    flows::field,
    flows::{self, ClientRun, WorkloadEntry},
    probe_bin,
    process::PodProcess,
    require_root,
    ztunnel::{Ztunnel, sibling_bin},
};

/// Stalled connections the slowloris opens.
const STALLED: usize = 200;
/// The TLS handshake (and SOCKS5) limit the slowloris test gives
/// ztunnel, in ms.
const HANDSHAKE_MS: u64 = 1000;
/// Silent SOCKS5 clients in the slowloris test.
const SILENT_SOCKS: usize = 5;
/// The connect limit the black-hole test gives the client's ztunnel, in ms.
const CONNECT_MS: u64 = 1000;

/// Open file descriptors of process `pid`.
fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

/// The value of `ztunnel_timeouts_total{phase="<phase>"}` (0 when absent).
fn timeouts(text: &str, phase: &str) -> u64 {
    let prefix = format!("ztunnel_timeouts_total{{phase=\"{phase}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The `RESULT` line of a `zt-hostile` run.
fn result_line(done: &ztunnel_tests::process::Finished) -> &str {
    done.stdout
        .lines()
        .find(|l| l.starts_with("RESULT"))
        .unwrap_or_else(|| panic!("no RESULT: {done:?}"))
}

#[test]
fn a_slowloris_on_the_hbone_port_is_cut_off_and_counted() {
    if !require_root("a_slowloris_on_the_hbone_port_is_cut_off_and_counted") {
        return;
    }
    let mut cluster = Cluster::new();
    let b = cluster.add_node("node-b");
    cluster.add_pod(b, "b1");
    cluster.add_pod(b, "plain");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("b1", "node-b"),
            WorkloadEntry::outside("plain", "node-b"),
        ],
    );
    let zb = Ztunnel::start(
        &cluster,
        b,
        &[
            "--config",
            config.to_str().expect("utf-8"),
            "--tls-handshake-timeout-ms",
            &HANDSHAKE_MS.to_string(),
            "--socks5-timeout-ms",
            &HANDSHAKE_MS.to_string(),
        ],
    );
    zb.wait_for_log("pod enrolled pod=b1", Duration::from_secs(10));
    let before = fd_count(zb.pid());

    // From a pod outside the mesh: 200 connections to b1's HBONE port,
    // five bytes of a TLS record each, then silence.
    let hbone = SocketAddr::from((cluster.pod("b1").ip, 15008));
    let mut cmd = cluster.pod("plain").command(&sibling_bin("zt-hostile"));
    cmd.args([
        "stall",
        "--connect",
        &hbone.to_string(),
        "--count",
        &STALLED.to_string(),
        "--bytes",
        "5",
        "--wait-secs",
        "10",
    ]);
    let mut stall = PodProcess::spawn("stall", cmd);
    let opened = stall.read_line(Duration::from_secs(30));
    assert_eq!(opened, format!("OPENED {STALLED}"));
    eprintln!(
        "ztunnel fds: {before} before, {} with the stalled connections open",
        fd_count(zb.pid())
    );
    let done = stall.wait(Duration::from_secs(30));
    let result = result_line(&done);
    eprintln!("{result}");
    assert_eq!(
        field(result, "closed"),
        STALLED as u64,
        "ztunnel must close every stalled handshake: {result}"
    );
    // The limit plus scheduling slack on a busy machine; the kernel would
    // hold them for hours.
    assert!(
        field(result, "max_close_ms") < HANDSHAKE_MS + 4000,
        "stalled handshakes held too long: {result}"
    );

    // Every socket is released again (a few fds of slack for timers,
    // pooled connections or the metrics server).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut now = fd_count(zb.pid());
    while now > before + 5 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        now = fd_count(zb.pid());
    }
    assert!(
        now <= before + 5,
        "ztunnel holds {now} fds, {before} before the slowloris"
    );

    // SOCKS5 clients inside the pod that connect and say nothing are cut
    // off the same way.
    let mut cmd = cluster.pod("b1").command(&sibling_bin("zt-hostile"));
    cmd.args([
        "stall",
        "--connect",
        "127.0.0.1:15080",
        "--count",
        &SILENT_SOCKS.to_string(),
        "--bytes",
        "0",
        "--wait-secs",
        "10",
    ]);
    let done = PodProcess::spawn("socks-stall", cmd).wait(Duration::from_secs(30));
    let result = result_line(&done);
    assert_eq!(
        field(result, "closed"),
        SILENT_SOCKS as u64,
        "silent SOCKS5 clients must be closed: {result}"
    );

    let cg = TestCgroup::create(&format!("{}/metrics-client", cluster.prefix()));
    let text = Ztunnel::metrics_of(&cluster, b, &cg);
    assert_eq!(
        timeouts(&text, "tls_handshake"),
        STALLED as u64,
        "every stalled handshake is counted once"
    );
    assert_eq!(timeouts(&text, "socks5"), SILENT_SOCKS as u64);
    zb.wait_for_log("phase=\"tls_handshake\"", Duration::from_secs(5));
    assert!(
        zb.log()
            .contains(&format!("peer={}:", cluster.pod("plain").ip)),
        "the timeout warning names the client"
    );
}

/// Runs a client in `pod` towards `dst` without waiting for it.
fn spawn_client(pod: &ztunnel_tests::Pod, dst: SocketAddr, name: &str) -> PodProcess {
    let mut cmd = pod.command(&probe_bin());
    cmd.args([
        "client",
        "--connect",
        &dst.to_string(),
        "--bytes",
        "1000",
        "--timeout",
        "30",
    ]);
    PodProcess::spawn(name, cmd)
}

/// Adds (`-I`) or removes (`-D`) a rule dropping every packet to `port`
/// inside `pod`'s namespace (one this test created; the rule goes away
/// with it, whatever happens).
fn black_hole(pod: &ztunnel_tests::Pod, port: u16, verb: &str) {
    pod.netns().exec(
        "iptables",
        &[
            "-w",
            verb,
            "INPUT",
            "-p",
            "tcp",
            "--dport",
            &port.to_string(),
            "-j",
            "DROP",
        ],
    );
}

/// Parallel streams towards the black-holed peer: with one open shared by
/// all and failing for all, they end together; queued one behind another
/// they would end one connect timeout apart.
const BLACK_HOLED_CLIENTS: usize = 6;

#[test]
fn a_black_holed_peer_fails_fast_and_stalls_no_other_destination() {
    if !require_root("a_black_holed_peer_fails_fast_and_stalls_no_other_destination") {
        return;
    }
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    let b = cluster.add_node("node-b");
    let c = cluster.add_node("node-c");
    cluster.add_pod(a, "a1");
    cluster.add_pod(b, "b1");
    cluster.add_pod(c, "c1");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("a1", "node-a"),
            WorkloadEntry::enrolled("b1", "node-b"),
            WorkloadEntry::enrolled("c1", "node-c"),
        ],
    );
    let config = config.to_str().expect("utf-8");
    let (a1, b1, c1) = (cluster.pod("a1"), cluster.pod("b1"), cluster.pod("c1"));
    let to_b = SocketAddr::from((b1.ip, 8080));
    let to_c = SocketAddr::from((c1.ip, 8080));
    let _server_b = flows::server(b1, to_b, "echo");
    let _server_c = flows::server(c1, to_c, "echo");
    let za = Ztunnel::start(
        &cluster,
        a,
        &[
            "--config",
            config,
            "--connect-timeout-ms",
            &CONNECT_MS.to_string(),
        ],
    );
    let zb = Ztunnel::start(&cluster, b, &["--config", config]);
    let zc = Ztunnel::start(&cluster, c, &["--config", config]);
    for (z, pod) in [(&za, "a1"), (&zb, "b1"), (&zc, "c1")] {
        z.wait_for_log(&format!("pod enrolled pod={pod}"), Duration::from_secs(10));
    }
    let quick = ClientRun {
        limit: Duration::from_secs(20),
        ..ClientRun::default()
    };
    flows::assert_ok(&flows::client(a1, to_c, &quick));

    black_hole(b1, 15008, "-I");
    let started = Instant::now();
    let stalled: Vec<PodProcess> = (0..BLACK_HOLED_CLIENTS)
        .map(|i| spawn_client(a1, to_b, &format!("to-b-{i}")))
        .collect();
    // Meanwhile a new connection to the healthy node goes through at once.
    let healthy = Instant::now();
    flows::assert_ok(&flows::client(a1, to_c, &quick));
    let healthy = healthy.elapsed();
    assert!(
        healthy < Duration::from_secs(3),
        "the healthy destination took {healthy:?} while another peer was black-holed"
    );
    for p in stalled {
        let done = p.wait(Duration::from_secs(40));
        assert!(
            !done.status.success() && !done.stdout.contains("RESULT ok"),
            "a connection through a black hole succeeded: {done:?}"
        );
    }
    let took = started.elapsed();
    eprintln!(
        "{BLACK_HOLED_CLIENTS} connections to a black-holed peer failed within {took:?}; \
         the healthy one took {healthy:?}"
    );
    // One connect timeout (shared by all of them) plus process start-up on
    // a busy machine; the kernel alone would retry its SYN for two minutes,
    // and streams queued behind each other would take one timeout each.
    assert!(
        took < Duration::from_millis(CONNECT_MS * 4),
        "connections to a black-holed peer took {took:?} to fail"
    );
    za.wait_for_log("phase=\"connect\"", Duration::from_secs(5));
    assert!(
        za.log().contains(&format!("peer={}:15008", b1.ip)),
        "the timeout warning names the peer"
    );
    let cg = TestCgroup::create(&format!("{}/metrics-client", cluster.prefix()));
    let text = Ztunnel::metrics_of(&cluster, a, &cg);
    let counted = timeouts(&text, "connect");
    assert!(
        (1..=BLACK_HOLED_CLIENTS as u64).contains(&counted),
        "connect timeouts counted: {counted}"
    );

    // The failure is not remembered: once the peer answers again, so does
    // the mesh.
    black_hole(b1, 15008, "-D");
    flows::assert_ok(&flows::client(a1, to_b, &quick));
}

#[test]
fn an_application_that_never_accepts_gets_the_hbone_client_a_504() {
    if !require_root("an_application_that_never_accepts_gets_the_hbone_client_a_504") {
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
    let dst = SocketAddr::from((b1.ip, 8080));
    let _server = flows::server(b1, dst, "echo");
    let za = Ztunnel::start(&cluster, a, &["--config", config]);
    let zb = Ztunnel::start(
        &cluster,
        b,
        &[
            "--config",
            config,
            "--connect-timeout-ms",
            &CONNECT_MS.to_string(),
        ],
    );
    za.wait_for_log("pod enrolled pod=a1", Duration::from_secs(10));
    zb.wait_for_log("pod enrolled pod=b1", Duration::from_secs(10));
    let run = ClientRun {
        limit: Duration::from_secs(20),
        ..ClientRun::default()
    };
    flows::assert_ok(&flows::client(a1, dst, &run));

    // The application's port stops answering SYNs; HBONE still works, so
    // the CONNECT reaches b's ztunnel, whose connect to the app stalls.
    black_hole(b1, 8080, "-I");
    let started = Instant::now();
    let done = flows::client(a1, dst, &run);
    let took = started.elapsed();
    assert!(
        !done.status.success() && !done.stdout.contains("RESULT ok"),
        "a connection to an application that never accepts succeeded: {done:?}"
    );
    assert!(
        took < Duration::from_millis(CONNECT_MS * 4),
        "the client waited {took:?}"
    );
    zb.wait_for_log("status=504", Duration::from_secs(5));
    za.wait_for_log("504 Gateway Timeout", Duration::from_secs(5));
    let cg = TestCgroup::create(&format!("{}/metrics-client", cluster.prefix()));
    assert_eq!(
        timeouts(&Ztunnel::metrics_of(&cluster, b, &cg), "connect"),
        1
    );
}
