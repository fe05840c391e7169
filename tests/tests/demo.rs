//! The demo (`cargo xtask demo --json`) runs end to end, every flow shows
//! what it is expected to show, and its JSON has the promised shape. The
//! demo compares each flow with its expectation itself; this test checks
//! again the facts a demo that guessed instead of observing would get wrong:
//! a denial needs ztunnel's access-log line, an allowed flow needs the
//! server to have seen the client, and both ztunnels must still run.

use std::{net::SocketAddr, process::Command, time::Duration};

use serde_json::json;
use ztunnel_tests::{process::PodProcess, require_root};

#[test]
fn the_demo_passes_and_reports_observed_facts() {
    if !require_root("the_demo_passes_and_reports_observed_facts") {
        return;
    }
    demo_passes("local");
}

/// The same flows with the mesh served by the fake istiod (delta ADS and
/// its CA) from the same YAML, and the pods enrolled over the socket.
#[test]
fn the_demo_passes_with_the_mesh_from_istiod() {
    if !require_root("the_demo_passes_with_the_mesh_from_istiod") {
        return;
    }
    demo_passes("xds");
}

fn demo_passes(control_plane: &str) {
    let demo = ztunnel_tests::probe_bin().with_file_name("zt-demo");
    let mut cmd = Command::new(&demo);
    cmd.args(["--json", "--control-plane", control_plane]);
    let done = PodProcess::spawn("zt-demo", cmd).wait(Duration::from_mins(3));
    assert!(
        done.status.success(),
        "demo failed:\n{}\n{}",
        done.stdout,
        done.stderr
    );
    let json_line = done.stdout.lines().last().expect("output");
    let v: serde_json::Value = serde_json::from_str(json_line).expect("last line is JSON");
    assert_eq!(v["ok"], true);
    assert_eq!(v["capture"], "ebpf");
    assert_eq!(v["control_plane"], control_plane);
    assert_eq!(
        v["ztunnels_running"],
        json!({"node-a": true, "node-b": true})
    );
    let flows = v["flows"].as_array().expect("flows");
    assert_eq!(flows.len(), 8);
    for f in flows {
        for key in [
            "name",
            "from",
            "to",
            "dst",
            "expect",
            "result",
            "path",
            "captured",
            "capture",
            "src_identity",
            "dst_identity",
            "client_addr",
            "server_saw_peer",
            "bytes",
            "checksum_ok",
            "plaintext_on_wire",
            "access_log",
            "ok",
            "mismatches",
        ] {
            assert!(f.get(key).is_some(), "flow without {key}: {f}");
        }
        assert_eq!(f["ok"], true, "{f}");
        assert_eq!(f["mismatches"], json!([]), "{f}");
        assert_eq!(f["result"], f["expect"], "{f}");
        let logged_denial = f["access_log"].as_array().is_some_and(|legs| {
            legs.iter()
                .any(|l| l.as_str().is_some_and(|l| l.contains("result=denied")))
        });
        if f["result"] == "denied" {
            assert!(logged_denial, "denied without ztunnel's line: {f}");
            assert_eq!(
                f["server_saw_peer"], "",
                "a denied flow reached a server: {f}"
            );
        } else {
            // A refused connect may be reset before the client learns its
            // port (the demo then finds its legs by address); an allowed
            // one always has it.
            let client_ip = f["client_addr"]
                .as_str()
                .and_then(|a| a.parse::<SocketAddr>().ok())
                .map_or_else(|| panic!("no client address: {f}"), |a| a.ip().to_string());
            assert!(!logged_denial, "{f}");
            assert_eq!(f["server_saw_peer"], client_ip.as_str(), "{f}");
            assert_eq!(f["checksum_ok"], true, "{f}");
        }
        if f["path"] == "hbone" {
            assert_eq!(f["plaintext_on_wire"], false, "{f}");
            assert!(
                f["dst_identity"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("spiffe://")),
                "{f}"
            );
        }
    }
    let by_name = |n: &str| flows.iter().find(|f| f["name"] == n).expect("flow");
    assert_eq!(by_name("cross-node")["path"], "hbone");
    assert_eq!(by_name("cross-node")["capture"], "connect@node-a");
    assert_eq!(by_name("same-node")["path"], "local");
    assert_eq!(by_name("passthrough")["path"], "passthrough");
    assert_eq!(
        by_name("passthrough")["plaintext_on_wire"],
        true,
        "the sniffer must see plain TCP"
    );
    assert_eq!(by_name("plaintext-permissive")["path"], "plaintext");
    assert_eq!(
        by_name("plaintext-permissive")["capture"],
        "sk_lookup@node-b"
    );
    assert_eq!(by_name("plaintext-strict")["capture"], "sk_lookup@node-b");
    assert_eq!(by_name("policy-denied")["path"], "denied");
    assert_eq!(by_name("policy-denied")["captured"], true);
    assert_eq!(
        by_name("socks5")["captured"],
        false,
        "a SOCKS5 client dials ztunnel itself"
    );
}
