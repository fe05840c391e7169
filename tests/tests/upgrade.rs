//! An upgrade without a gap: as a DaemonSet rolling update with
//! `maxSurge: 1` does it, a new ztunnel starts on the node while the old
//! one still runs, then the old one gets SIGTERM, drains and exits. Under
//! 200 new connections per second plus long-lived ones, no new connection
//! may be refused or fail, the long-lived ones must carry on to their end,
//! and the old process must leave everything the new one uses in place.

use std::{net::SocketAddr, time::Duration};

use nix::sys::signal::Signal;
use ztunnel_tests::{
    Cluster, Pod,
    flows::field,
    flows::{self, ClientRun, WorkloadEntry},
    probe_bin,
    process::PodProcess,
    require_root,
    ztunnel::Ztunnel,
};

/// New connections per second, in all, through the upgrades.
const RATE: u64 = 200;
/// How long the load runs. Both upgrades happen inside it.
const LOAD_SECS: u64 = 24;
/// How long the long-lived connections last (ending before the load).
const BEAT_SECS: u64 = 20;

fn connrate(pod: &Pod, dst: SocketAddr, rate: u64) -> PodProcess {
    let mut cmd = pod.command(&probe_bin());
    cmd.args([
        "connrate",
        "--connect",
        &dst.to_string(),
        "--seconds",
        &LOAD_SECS.to_string(),
        "--workers",
        "8",
        "--rate",
        &rate.to_string(),
    ]);
    PodProcess::spawn("connrate", cmd)
}

fn beat(pod: &Pod, dst: SocketAddr) -> PodProcess {
    let mut cmd = pod.command(&probe_bin());
    cmd.args([
        "beat",
        "--connect",
        &dst.to_string(),
        "--interval-ms",
        "50",
        "--seconds",
        &BEAT_SECS.to_string(),
        "--stall-seconds",
        "5",
    ]);
    PodProcess::spawn("beat", cmd)
}

/// Starts a second ztunnel for `node`, lets both run, then stops the old
/// one (SIGTERM, drain, exit 0) and returns the new one.
fn upgrade(cluster: &Cluster, node: usize, old: &mut Ztunnel, args: &[&str]) -> Ztunnel {
    let new = Ztunnel::start(cluster, node, args);
    new.wait_for_log("pod enrolled", Duration::from_secs(10));
    // Both serve for a moment, as during a rolling update.
    std::thread::sleep(Duration::from_secs(2));
    // The old one is stopped in its tracks for a moment first, so that
    // its listeners hold a queue of connections it has not accepted when
    // it closes them: those must move to the new one, not be reset.
    old.signal(Signal::SIGSTOP);
    std::thread::sleep(Duration::from_millis(500));
    old.signal(Signal::SIGTERM);
    old.signal(Signal::SIGCONT);
    old.wait_for_log("draining", Duration::from_secs(5));
    new
}

#[test]
fn an_upgrade_under_load_refuses_no_connection_and_keeps_long_ones() {
    if !require_root("an_upgrade_under_load_refuses_no_connection_and_keeps_long_ones") {
        return;
    }
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    let b = cluster.add_node("node-b");
    cluster.add_pod(a, "a1");
    cluster.add_pod(a, "a2");
    cluster.add_pod(b, "b1");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("a1", "node-a"),
            WorkloadEntry::enrolled("a2", "node-a"),
            WorkloadEntry::enrolled("b1", "node-b"),
        ],
    );
    let config = config.to_str().expect("utf-8");
    let args = ["--config", config, "--drain-timeout", "60"];
    let (a1, a2, b1) = (cluster.pod("a1"), cluster.pod("a2"), cluster.pod("b1"));
    let across = SocketAddr::from((b1.ip, 8080));
    let local = SocketAddr::from((a2.ip, 8080));
    let _servers = [
        flows::server_with(b1, across, "echo", true),
        flows::server_with(a2, local, "echo", true),
    ];
    let mut za = Ztunnel::start(&cluster, a, &args);
    let mut zb = Ztunnel::start(&cluster, b, &args);
    za.wait_for_log("pod enrolled pod=a2", Duration::from_secs(10));
    zb.wait_for_log("pod enrolled pod=b1", Duration::from_secs(10));
    flows::assert_ok(&flows::client(a1, across, &ClientRun::default()));
    flows::assert_ok(&flows::client(a1, local, &ClientRun::default()));
    // Queued connections of a closing listener move to the other ztunnel's.
    for pod in [a1, a2, b1] {
        let migrate = pod
            .netns()
            .exec("cat", &["/proc/sys/net/ipv4/tcp_migrate_req"]);
        assert_eq!(migrate.trim(), "1", "tcp_migrate_req in {}", pod.name);
    }

    let rate = ztunnel_tests::scaled(RATE).max(20);
    let loads = [
        connrate(a1, across, rate * 3 / 4),
        connrate(a1, local, rate / 4),
    ];
    let beats = [beat(a1, across), beat(a1, across), beat(a1, local)];
    std::thread::sleep(Duration::from_secs(3));

    // The client's node first (outbound capture, HBONE client), then the
    // server's (HBONE server, transparent legs to the application).
    let za2 = upgrade(&cluster, a, &mut za, &args);
    std::thread::sleep(Duration::from_secs(2));
    let zb2 = upgrade(&cluster, b, &mut zb, &args);

    let limit = Duration::from_secs(LOAD_SECS + 30);
    let mut beat_lines = Vec::new();
    for b in beats {
        let done = b.wait(limit);
        beat_lines.push(format!(
            "{} {}",
            done.status,
            done.stdout.lines().last().unwrap_or("")
        ));
        assert!(
            done.status.success() && done.stdout.contains("DONE"),
            "a long-lived connection did not survive the upgrade: {done:?}"
        );
    }
    let mut total = 0;
    for load in loads {
        let done = load.wait(limit);
        let line = done
            .stdout
            .lines()
            .find(|l| l.starts_with("CONN"))
            .unwrap_or_else(|| panic!("no CONN line: {done:?}"))
            .to_owned();
        eprintln!("load: {line}");
        assert_eq!(
            field(&line, "failed"),
            0,
            "connections failed across the upgrade: {line}"
        );
        total += field(&line, "ok");
    }
    eprintln!("long-lived: {beat_lines:?}");
    // The load really ran at (nearly) its rate the whole time.
    let expected = rate * LOAD_SECS;
    assert!(
        total * 10 >= expected * 8,
        "only {total} connections of the {expected} planned"
    );

    // The old processes drained, saw they had been replaced, left the
    // shared state alone and exited cleanly.
    for old in [&mut za, &mut zb] {
        old.stop();
        assert_eq!(
            old.count_log_lines(&["another ztunnel has taken over"]),
            1,
            "an old ztunnel did not notice its successor:\n{}",
            old.log()
        );
    }
    // The new ones carried the traffic after the switch, and still do: the
    // enrolment socket file is the new one's.
    for new in [&za2, &zb2] {
        assert!(new.count_log_lines(&["access: connection"]) > 0);
        assert!(new.socket.exists(), "the enrolment socket file was removed");
    }
    flows::assert_ok(&flows::client(a1, across, &ClientRun::default()));
    flows::assert_ok(&flows::client(a1, local, &ClientRun::default()));
}
