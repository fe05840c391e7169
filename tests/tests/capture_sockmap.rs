//! sk_msg/sockhash acceleration of the pod-local leg: byte-for-byte
//! correct with it on and off, for bulk transfers both ways and for many
//! tiny writes ending in a half-close.

use std::{net::SocketAddr, time::Duration};

use ztunnel_common::Counter;
use ztunnel_tests::{
    Cluster,
    flows::{self, ClientRun, WorkloadEntry},
    require_root,
    ztunnel::Ztunnel,
};

const GIB: u64 = 1 << 30;

fn transfers(sockmap: &str) {
    let mut cluster = Cluster::new();
    let node = cluster.add_node("node-a");
    cluster.add_pod(node, "client");
    cluster.add_pod(node, "server");
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            WorkloadEntry::enrolled("client", "node-a"),
            WorkloadEntry::outside("server", "node-a"),
        ],
    );
    let (client, server) = (cluster.pod("client"), cluster.pod("server"));
    let dst = SocketAddr::from((server.ip, 8080));
    let _server = flows::server(server, dst, "echo");
    let z = Ztunnel::start(
        &cluster,
        node,
        &[
            "--sockmap",
            sockmap,
            "--config",
            config.to_str().expect("utf-8"),
        ],
    );
    z.wait_for_log("pod enrolled", Duration::from_secs(10));

    // 1 GiB out and the same 1 GiB echoed back, checksummed on both ends.
    // The client is an event-loop application (non-blocking, poll(2)).
    let bulk = ClientRun {
        bytes: ztunnel_tests::scaled(GIB),
        chunk: 256 * 1024,
        io: "poll",
        limit: Duration::from_mins(5),
        ..ClientRun::default()
    };
    let started = std::time::Instant::now();
    flows::assert_ok(&flows::client(client, dst, &bulk));
    eprintln!(
        "sockmap={sockmap}: 1 GiB each way in {:.1?}",
        started.elapsed()
    );

    // Many tiny writes (7 bytes each), then half-close; the echo must come
    // back complete and in order, and EOF must arrive after it.
    let tiny = ClientRun {
        bytes: 70_000,
        chunk: 7,
        io: "poll",
        ..ClientRun::default()
    };
    flows::assert_ok(&flows::client(client, dst, &tiny));

    let counters = z.counters();
    if sockmap == "on" {
        assert!(counters.get(Counter::LocalLegInserted) >= 4, "{counters:?}");
        assert!(
            counters.get(Counter::LocalLegRedirected) > 0,
            "{counters:?}"
        );
    } else {
        assert_eq!(counters.get(Counter::LocalLegInserted), 0, "{counters:?}");
        assert_eq!(counters.get(Counter::LocalLegRedirected), 0, "{counters:?}");
    }
}

#[test]
fn sockmap_on_is_byte_exact() {
    if !require_root("sockmap_on_is_byte_exact") {
        return;
    }
    transfers("on");
}

#[test]
fn sockmap_off_is_byte_exact() {
    if !require_root("sockmap_off_is_byte_exact") {
        return;
    }
    transfers("off");
}
