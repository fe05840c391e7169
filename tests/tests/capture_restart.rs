//! Fail closed when ztunnel dies; take over without duplicates when it
//! comes back; leave nothing behind on a clean shutdown.

use std::{net::SocketAddr, time::Duration};

use aya::maps::{MapData, PerCpuArray};
use ztunnel_tests::{
    Cluster,
    cgroup::TestCgroup,
    flows::{self, ClientRun, WorkloadEntry},
    kernel::{attach_type, cgroup_program_count, ingress_programs},
    process::{PodProcess, command_in},
    require_root,
    ztunnel::{Ztunnel, ZtunnelPaths, pins_below, sibling_bin},
};

fn assert_single_attachments(cluster: &Cluster, pod_netns: &std::path::Path) {
    for ty in [
        attach_type::INET4_CONNECT,
        attach_type::INET6_CONNECT,
        attach_type::SOCK_OPS,
    ] {
        assert_eq!(
            cgroup_program_count(cluster.cgroup(), ty),
            1,
            "attach type {ty}"
        );
    }
    assert_eq!(
        ingress_programs(pod_netns),
        vec!["capture_ingress".to_owned()]
    );
    assert_eq!(
        cgroup_program_count(pod_netns, attach_type::SK_LOOKUP),
        1,
        "sk_lookup programs on the pod's namespace"
    );
}

#[test]
fn killed_ztunnel_fails_closed_and_a_restart_takes_over() {
    if !require_root("killed_ztunnel_fails_closed_and_a_restart_takes_over") {
        return;
    }
    kill_and_restart("auto");
}

/// The clsact path (kernels before 6.6 take it under `auto`): the filter a
/// killed ztunnel left must be taken over, not collide with the new one
/// (it did: "Filter already exists", the pod was never enrolled again).
#[test]
fn killed_ztunnel_fails_closed_and_a_restart_takes_over_netlink() {
    if !require_root("killed_ztunnel_fails_closed_and_a_restart_takes_over_netlink") {
        return;
    }
    kill_and_restart("netlink");
}

fn kill_and_restart(tc_mode: &str) {
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "app");
    cluster.add_pod(node, "other");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("app", "node-a"),
            WorkloadEntry::outside("other", "node-a"),
        ],
    );
    let config = config.to_str().expect("utf-8").to_owned();
    let args = ["--config", config.as_str(), "--tc-mode", tc_mode];
    let (app, other) = (cluster.pod("app"), cluster.pod("other"));
    let outbound_dst = SocketAddr::from((other.ip, 8080));
    let inbound_dst = SocketAddr::from((app.ip, 8080));
    let _other_server = flows::server(other, outbound_dst, "echo");
    let mut app_server = flows::server(app, inbound_dst, "echo");
    let run = ClientRun::default();

    let mut z1 = Ztunnel::start(&cluster, node, &args);
    z1.wait_for_log("pod enrolled", Duration::from_secs(10));
    flows::assert_ok(&flows::client(app, outbound_dst, &run));
    flows::assert_ok(&flows::client(other, inbound_dst, &run));
    let _ = flows::last_peer(&mut app_server);
    let pins_before = z1.pins();
    assert_single_attachments(&cluster, &app.netns_path());

    // SIGKILL: no cleanup runs. The pod's traffic must fail, not go direct.
    z1.kill();
    let quick = ClientRun {
        connect_timeout: 2,
        limit: Duration::from_secs(5),
        ..ClientRun::default()
    };
    let out = flows::client(app, outbound_dst, &quick);
    assert!(
        out.stdout.contains("CONNECT-ERROR ConnectionRefused"),
        "outbound went somewhere: {out:?}"
    );
    let inb = flows::client(other, inbound_dst, &quick);
    assert!(
        inb.stdout.contains("CONNECT-ERROR"),
        "inbound reached the app without ztunnel: {inb:?}"
    );
    assert_eq!(
        z1.pins(),
        pins_before,
        "pins changed while ztunnel was dead"
    );

    // Restart: same pins, same single attachments, traffic flows again.
    let mut z2 = Ztunnel::start(&cluster, node, &args);
    z2.wait_for_log("took_over=true", Duration::from_secs(5));
    z2.wait_for_log("pod enrolled", Duration::from_secs(10));
    flows::assert_ok(&flows::client(app, outbound_dst, &run));
    flows::assert_ok(&flows::client(other, inbound_dst, &run));
    assert_single_attachments(&cluster, &app.netns_path());
    // After the grace period nothing is considered stale.
    z2.wait_for_log("stale kernel state check done", Duration::from_secs(10));
    assert_eq!(z2.pins(), pins_before, "restart leaked or lost pins");

    // A clean stop with pods enrolled keeps the attachments (fail closed)...
    z2.stop();
    assert_eq!(z2.pins(), pins_before);
    // ... and `--cleanup` removes everything.
    let mut z3 = Ztunnel::start(&cluster, node, &[&args[..], &["--cleanup"]].concat());
    z3.wait_for_log("pod enrolled", Duration::from_secs(10));
    z3.stop();
    assert!(
        pins_below(&z3.bpffs).is_empty(),
        "pins left: {:?}",
        pins_below(&z3.bpffs)
    );
    for ty in [
        attach_type::INET4_CONNECT,
        attach_type::INET6_CONNECT,
        attach_type::SOCK_OPS,
    ] {
        assert_eq!(cgroup_program_count(cluster.cgroup(), ty), 0);
    }
    assert!(ingress_programs(&app.netns_path()).is_empty());
    let qdiscs = app.netns().exec("tc", &["qdisc", "show", "dev", "eth0"]);
    assert!(!qdiscs.contains("clsact"), "clsact qdisc left: {qdiscs}");
    // Without ztunnel and without attachments the pod talks directly again.
    flows::assert_ok(&flows::client(app, outbound_dst, &run));
}

#[test]
fn removing_every_pod_then_stopping_leaves_no_pins() {
    if !require_root("removing_every_pod_then_stopping_leaves_no_pins") {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "app");
    let path = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[WorkloadEntry::enrolled("app", "node-a")],
    );
    let mut z = Ztunnel::start(&cluster, node, &["--config", path.to_str().expect("utf-8")]);
    z.wait_for_log("pod enrolled", Duration::from_secs(10));
    assert_eq!(ingress_programs(&cluster.pod("app").netns_path()).len(), 1);

    // A bad edit is rejected and the pod stays.
    std::fs::write(&path, "workloads: [{uid: 1}]\n").expect("write");
    z.wait_for_log("config change rejected", Duration::from_secs(5));
    assert_eq!(ingress_programs(&cluster.pod("app").netns_path()).len(), 1);

    // Removing the pod from the config detaches it.
    std::fs::write(&path, "workloads: []\n").expect("write");
    z.wait_for_log("pods removed from config", Duration::from_secs(5));
    assert!(ingress_programs(&cluster.pod("app").netns_path()).is_empty());
    z.stop();
    assert!(
        pins_below(&z.bpffs).is_empty(),
        "pins left: {:?}",
        pins_below(&z.bpffs)
    );
}

#[test]
fn pins_from_an_incompatible_build_are_refused_by_name() {
    if !require_root("pins_from_an_incompatible_build_are_refused_by_name") {
        return;
    }
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    let paths = ZtunnelPaths::for_node(&cluster, node);
    // What an older build could have left: a counters map of another size.
    let maps = paths.bpffs.join("maps");
    std::fs::create_dir_all(&maps).expect("pin folder");
    let pin = maps.join(ztunnel_common::MAP_COUNTERS);
    PerCpuArray::<MapData, u64>::create(3, 0)
        .expect("create map")
        .pin(&pin)
        .expect("pin map");
    let cgroup = TestCgroup::create(&format!("{}/ztunnel-refused", cluster.prefix()));
    let mut cmd = command_in(
        &cluster.node(node).netns().path(),
        &cgroup.procs(),
        &sibling_bin("ztunnel"),
    );
    cmd.args(["run", "--node-name", "node-a"])
        .arg("--cgroup")
        .arg(cluster.cgroup())
        .arg("--bpffs")
        .arg(&paths.bpffs)
        .arg("--enrol-socket")
        .arg(&paths.socket)
        .arg("--cni-state-dir")
        .arg(&paths.pod_records)
        .arg("--ca-dir")
        .arg(cluster.dir().join("dev-ca"));
    let done = PodProcess::spawn("ztunnel-refused", cmd).wait(Duration::from_secs(30));
    assert!(
        !done.status.success(),
        "ztunnel started over a foreign pin: {done:?}"
    );
    assert!(
        done.stderr.contains("CAPTURE_COUNTERS") && done.stderr.contains("another ztunnel build"),
        "the error does not name the pin: {}",
        done.stderr
    );
    // It touched nothing: no program was attached to the cgroup.
    assert_eq!(
        cgroup_program_count(cluster.cgroup(), attach_type::INET4_CONNECT),
        0
    );
}
