//! The demo (`cargo xtask demo --json`) runs end to end and every flow
//! behaves as expected; its JSON has the promised shape.

use std::{process::Command, time::Duration};

use ztunnel_tests::{process::PodProcess, require_root};

#[test]
fn the_demo_passes_and_reports_observed_facts() {
    if !require_root("the_demo_passes_and_reports_observed_facts") {
        return;
    }
    let demo = ztunnel_tests::probe_bin().with_file_name("zt-demo");
    let mut cmd = Command::new(&demo);
    cmd.arg("--json");
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
            "src_identity",
            "dst_identity",
            "server_saw_peer",
            "bytes",
            "checksum_ok",
            "plaintext_on_wire",
        ] {
            assert!(f.get(key).is_some(), "flow without {key}: {f}");
        }
        assert_eq!(f["result"], f["expect"], "{f}");
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
    assert_eq!(by_name("same-node")["path"], "local");
    assert_eq!(
        by_name("passthrough")["plaintext_on_wire"],
        true,
        "the sniffer must see plain TCP"
    );
    assert_eq!(by_name("policy-denied")["path"], "denied");
}
