//! The iptables capture backend (`--capture iptables`): same proxy, capture
//! by REDIRECT rules inside the pod and `SO_ORIGINAL_DST`.

use std::{net::SocketAddr, time::Duration};

use ztunnel_common::Counter;
use ztunnel_tests::{
    Cluster,
    flows::{self, ClientRun, WorkloadEntry},
    require_root,
    ztunnel::Ztunnel,
};

#[test]
fn iptables_backend_captures_both_ways_with_original_destinations() {
    if !require_root("iptables_backend_captures_both_ways_with_original_destinations") {
        return;
    }
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
    let (app, other) = (cluster.pod("app"), cluster.pod("other"));
    let out_dst = SocketAddr::from((other.ip, 8080));
    let in_dst = SocketAddr::from((app.ip, 8080));
    let _s1 = flows::server(other, out_dst, "echo");
    let mut s2 = flows::server(app, in_dst, "echo");
    let mut z = Ztunnel::start(
        &cluster,
        node,
        &[
            "--capture",
            "iptables",
            "--config",
            config.to_str().expect("utf-8"),
        ],
    );
    z.wait_for_log("pod enrolled", Duration::from_secs(10));
    let rules = app.netns().exec("iptables", &["-t", "nat", "-S"]);
    assert!(
        rules.contains("ZTUNNEL_OUTPUT") && rules.contains("REDIRECT"),
        "{rules}"
    );

    flows::assert_ok(&flows::client(app, out_dst, &ClientRun::default()));
    z.wait_for_log(
        &format!("orig_dst={out_dst} target={out_dst} path=\"passthrough\""),
        Duration::from_secs(5),
    );
    flows::assert_ok(&flows::client(other, in_dst, &ClientRun::default()));
    z.wait_for_log(
        &format!("orig_dst={in_dst} path=\"plaintext\""),
        Duration::from_secs(5),
    );
    let peer = flows::last_peer(&mut s2);
    assert!(
        peer.starts_with(&format!("{}:", other.ip)),
        "app saw {peer}"
    );
    // The eBPF programs are loaded but not attached: they captured nothing.
    let c = z.counters();
    assert_eq!(c.get(Counter::ConnectRedirected), 0, "{c:?}");
    assert_eq!(c.get(Counter::LookupSteeredPlaintext), 0, "{c:?}");

    // Removing the pod removes the rules.
    std::fs::write(&config, "workloads: []\n").expect("write");
    z.wait_for_log("pods removed from config", Duration::from_secs(5));
    let rules = app.netns().exec("iptables", &["-t", "nat", "-S"]);
    assert!(!rules.contains("ZTUNNEL"), "{rules}");
    z.stop();
}
