//! The kernel programs load on this kernel, attach to a pod's cgroup and
//! `eth0`, count real traffic, and detach leaving nothing behind. A filter
//! someone else put on the interface survives our attach and detach.

use std::time::Duration;

use ztunnel::{
    bpffs::PinRoot,
    capture::{
        self,
        tc::{TcHook, TcMode},
    },
    loader,
    netns::PodNetns,
};
use ztunnel_common::Counter;
use ztunnel_tests::{
    Cluster,
    kernel::{ingress_programs, tcx_ingress_programs},
    netns, probe_bin,
    process::PodProcess,
    require_root,
};

const SERVER_PORT: u16 = 8080;

/// On a kernel without tcx (before 6.6), `--tc-mode tcx` must be refused
/// with an error naming the kernel, and leave nothing behind.
fn tcx_refused_by_name() {
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "pod");
    let pod = cluster.pod("pod");
    let pins = PinRoot::prepare(&cluster.bpffs().path().join("ztunnel")).expect("pin root");
    let mut programs = loader::load(&pins).expect("load the eBPF object");
    let netns = PodNetns::open(&pod.netns_path()).expect("open pod netns");
    let err = capture::tc::attach(
        &mut programs.ebpf,
        &pins,
        &netns,
        "pod",
        "eth0",
        TcMode::Tcx,
        TcHook::Ingress,
    )
    .expect_err("tcx attach must be refused on a kernel without tcx");
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    let message = err.to_string();
    assert!(
        message.contains("6.6") && message.contains(release.trim()),
        "{message}"
    );
    assert!(ingress_programs(&pod.netns_path()).is_empty());
    assert!(
        pins.links()
            .read_dir()
            .map_or(true, |mut d| d.next().is_none())
    );
    drop(programs);
    pins.remove_all().expect("remove pins");
}

fn run_client(cluster: &Cluster, from: &str, to: std::net::Ipv4Addr) -> std::process::ExitStatus {
    let mut cmd = cluster.pod(from).command(&probe_bin());
    cmd.args([
        "client",
        "--connect",
        &format!("{to}:{SERVER_PORT}"),
        "--bytes",
        "100000",
        "--timeout",
        "10",
    ]);
    let done = PodProcess::spawn("client", cmd).wait(Duration::from_secs(30));
    assert!(
        done.stdout.contains("RESULT ok") || !done.status.success(),
        "{done:?}"
    );
    done.status
}

fn attach_count_detach(mode: TcMode) {
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "client");
    cluster.add_pod(node, "server");
    let names: Vec<String> = ["client", "server", "fabric", "node-a"]
        .iter()
        .map(|n| format!("{}-{n}", cluster.prefix()))
        .collect();
    let server_ip = cluster.pod("server").ip;

    let mut cmd = cluster.pod("server").command(&probe_bin());
    cmd.args(["server", "--listen", &format!("{server_ip}:{SERVER_PORT}")]);
    let mut server = PodProcess::spawn("server", cmd);
    assert!(
        server
            .read_line(Duration::from_secs(10))
            .starts_with("READY")
    );

    let pins = PinRoot::prepare(&cluster.bpffs().path().join("ztunnel")).expect("pin root");
    let mut programs = loader::load(&pins).expect("load the eBPF object");
    let client = cluster.pod("client");
    capture::cgroup::attach(
        &mut programs.ebpf,
        &pins,
        client.cgroup(),
        capture::cgroup::KernelSettings::default(),
    )
    .expect("attach cgroup programs");
    let netns = PodNetns::open(&client.netns_path()).expect("open pod netns");
    let ingress = capture::tc::attach(
        &mut programs.ebpf,
        &pins,
        &netns,
        "client",
        "eth0",
        mode,
        TcHook::Ingress,
    )
    .expect("attach TC");
    if mode == TcMode::Tcx {
        assert_eq!(
            tcx_ingress_programs(&client.netns_path()),
            vec!["capture_ingress".to_owned()]
        );
    } else {
        let filters = client
            .netns()
            .exec("tc", &["filter", "show", "dev", "eth0", "ingress"]);
        assert!(filters.contains("capture_ingress"), "{filters}");
    }

    // Real TCP traffic from a process in the pod (pod not enrolled: counted,
    // not captured, so the connection goes straight to the server).
    assert!(run_client(&cluster, "client", server_ip).success());
    let counters = capture::counters::read(&programs.ebpf).expect("read counters");
    assert!(counters.get(Counter::Connect4Seen) >= 1, "{counters:?}");
    assert!(
        counters.get(Counter::ConnectNotEnrolled) >= 1,
        "{counters:?}"
    );
    assert_eq!(counters.get(Counter::ConnectRedirected), 0, "{counters:?}");
    assert!(counters.get(Counter::IngressTcpSeen) >= 1, "{counters:?}");
    assert!(
        counters.get(Counter::SockopsEstablished) >= 1,
        "{counters:?}"
    );

    // Detach everything.
    capture::tc::detach(&netns, &ingress).expect("detach TC");
    capture::cgroup::unpin(&pins).expect("unpin cgroup links");
    let before = capture::counters::read(&programs.ebpf).expect("read counters");
    assert!(run_client(&cluster, "client", server_ip).success());
    let after = capture::counters::read(&programs.ebpf).expect("read counters");
    assert_eq!(
        before.get(Counter::Connect4Seen),
        after.get(Counter::Connect4Seen),
        "connect4 still runs after detach"
    );
    assert_eq!(
        before.get(Counter::IngressTcpSeen),
        after.get(Counter::IngressTcpSeen),
        "TC program still runs after detach"
    );
    assert!(
        tcx_ingress_programs(&client.netns_path()).is_empty(),
        "a tcx link is left on eth0"
    );
    let qdiscs = client.netns().exec("tc", &["qdisc", "show", "dev", "eth0"]);
    assert!(
        !qdiscs.contains("clsact"),
        "a clsact qdisc is left: {qdiscs}"
    );
    let filters = client
        .netns()
        .exec("tc", &["filter", "show", "dev", "eth0", "ingress"]);
    assert!(filters.trim().is_empty(), "a filter is left: {filters}");

    drop(programs);
    pins.remove_all().expect("remove pins");
    assert!(
        cluster.bpffs().pins().is_empty(),
        "pins left: {:?}",
        cluster.bpffs().pins()
    );

    drop(netns);
    drop(server);
    drop(cluster);
    for name in &names {
        assert!(!netns::exists(name), "namespace {name} left behind");
    }
}

#[test]
fn programs_attach_count_and_detach_cleanly_tcx() {
    if !require_root("programs_attach_count_and_detach_cleanly_tcx") {
        return;
    }
    if !ztunnel::probe::has_tcx() {
        tcx_refused_by_name();
        return;
    }
    attach_count_detach(TcMode::Tcx);
}

#[test]
fn programs_attach_count_and_detach_cleanly_netlink() {
    if !require_root("programs_attach_count_and_detach_cleanly_netlink") {
        return;
    }
    attach_count_detach(TcMode::Netlink);
}

fn foreign_filter_survives(mode: TcMode) {
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "pod");
    let pod = cluster.pod("pod");
    // Someone else's clsact qdisc and filter (a classic-BPF filter that
    // matches nothing), at priority 1.
    pod.netns()
        .exec("tc", &["qdisc", "add", "dev", "eth0", "clsact"]);
    pod.netns().exec(
        "tc",
        &[
            "filter",
            "add",
            "dev",
            "eth0",
            "ingress",
            "prio",
            "1",
            "protocol",
            "all",
            "bpf",
            "bytecode",
            "1,6 0 0 0,",
            "flowid",
            "1:1",
        ],
    );
    let foreign = |ns: &ztunnel_tests::netns::TestNetns| {
        let out = ns.exec("tc", &["filter", "show", "dev", "eth0", "ingress"]);
        out.lines()
            .any(|l| l.contains("pref 1 ") && l.contains("bytecode '1,6 0 0 0'"))
    };
    assert!(foreign(pod.netns()));

    let pins = PinRoot::prepare(&cluster.bpffs().path().join("ztunnel")).expect("pin root");
    let mut programs = loader::load(&pins).expect("load");
    let netns = PodNetns::open(&pod.netns_path()).expect("open netns");
    let ingress = capture::tc::attach(
        &mut programs.ebpf,
        &pins,
        &netns,
        "pod",
        "eth0",
        mode,
        TcHook::Ingress,
    )
    .expect("attach");
    assert!(foreign(pod.netns()), "foreign filter gone after attach");
    capture::tc::detach(&netns, &ingress).expect("detach");
    assert!(foreign(pod.netns()), "foreign filter gone after detach");
    let qdiscs = pod.netns().exec("tc", &["qdisc", "show", "dev", "eth0"]);
    assert!(
        qdiscs.contains("clsact"),
        "foreign clsact qdisc removed: {qdiscs}"
    );
    let ours = pod
        .netns()
        .exec("tc", &["filter", "show", "dev", "eth0", "ingress"]);
    assert!(!ours.contains("capture_ingress"), "our filter left: {ours}");
    assert!(tcx_ingress_programs(&pod.netns_path()).is_empty());
    drop(programs);
    pins.remove_all().expect("remove pins");
}

#[test]
fn foreign_tc_filter_survives_tcx_attach_and_detach() {
    if !require_root("foreign_tc_filter_survives_tcx_attach_and_detach") {
        return;
    }
    if !ztunnel::probe::has_tcx() {
        tcx_refused_by_name();
        return;
    }
    foreign_filter_survives(TcMode::Tcx);
}

#[test]
fn foreign_tc_filter_survives_netlink_attach_and_detach() {
    if !require_root("foreign_tc_filter_survives_netlink_attach_and_detach") {
        return;
    }
    foreign_filter_survives(TcMode::Netlink);
}
