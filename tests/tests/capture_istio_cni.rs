//! `--capture istio-cni`: on a node where Istio's node agent (istio-cni)
//! owns the capture. The test puts istio-cni's in-pod rules into each pod
//! (reproduced from Istio's chains, ports and marks: mangle and nat
//! `ISTIO_PRERT`/`ISTIO_OUTPUT`, `REDIRECT` to 15001 and 15006, connmark
//! 0x111 for packets marked 0x539, `ip rule fwmark 0x111/0xfff lookup 100`
//! with a local route), and a test node agent hands the pods to ztunnel
//! over ZDS. ztunnel attaches nothing and installs nothing in the pods.

use std::{net::SocketAddr, path::Path, time::Duration};

use ztunnel_tests::{
    Cluster, Pod,
    flows::{self, ClientRun, WorkloadEntry},
    kernel::{attach_type, cgroup_program_count},
    node_agent::{AgentPod, NodeAgent},
    require_root,
    ztunnel::Ztunnel,
};

/// istio-cni's in-pod iptables rules (IPv4; the IPv6 set is the same with
/// `::1/128`). DNS capture (UDP/TCP 53 to 15053) is left out: it needs
/// Istio's DNS proxy, which ztunnel-rs does not have (docs: set istio-cni's
/// DNS capture off).
fn iptables_rules(loopback: &str) -> String {
    format!(
        "*mangle
:ISTIO_OUTPUT - [0:0]
:ISTIO_PRERT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
COMMIT
*nat
:ISTIO_OUTPUT - [0:0]
:ISTIO_PRERT - [0:0]
-A OUTPUT -j ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT
-A ISTIO_OUTPUT ! -d {loopback} -o lo -j ACCEPT
-A ISTIO_OUTPUT ! -d {loopback} -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001
-A ISTIO_PRERT ! -d {loopback} -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006
COMMIT
"
    )
}

/// Does what istio-cni does when a pod joins the ambient mesh.
fn install_istio_cni_rules(cluster: &Cluster, pod: &Pod) {
    for (tool, loopback, family, any) in [
        ("iptables-restore", "127.0.0.1/32", "-4", "0.0.0.0/0"),
        ("ip6tables-restore", "::1/128", "-6", "::/0"),
    ] {
        let file = cluster.dir().join(format!("{}-{tool}.rules", pod.name));
        std::fs::write(&file, iptables_rules(loopback)).expect("write rules");
        pod.netns()
            .exec(tool, &["--noflush", file.to_str().expect("utf-8")]);
        pod.netns().exec(
            "ip",
            &[
                family,
                "rule",
                "add",
                "fwmark",
                "0x111/0xfff",
                "pref",
                "32764",
                "lookup",
                "100",
            ],
        );
        pod.netns().exec(
            "ip",
            &[
                family, "route", "add", "local", any, "dev", "lo", "table", "100",
            ],
        );
    }
}

fn agent_pod(pod: &Pod) -> AgentPod {
    AgentPod {
        // The config's uid for the pod, so that its identity and routing
        // come from the mesh state.
        uid: pod.name.clone(),
        name: pod.name.clone(),
        namespace: "test".into(),
        service_account: pod.name.clone(),
        netns: pod.netns_path(),
    }
}

fn start(cluster: &Cluster, node: usize, agent: &Path, config: &Path) -> Ztunnel {
    Ztunnel::start(
        cluster,
        node,
        &[
            "--capture",
            "istio-cni",
            "--node-agent-socket",
            agent.to_str().expect("utf-8"),
            "--config",
            config.to_str().expect("utf-8"),
        ],
    )
}

#[test]
fn istio_cni_captured_pods_are_carried_over_hbone_with_original_addresses() {
    if !require_root("istio_cni_captured_pods_are_carried_over_hbone_with_original_addresses") {
        return;
    }
    let mut cluster = Cluster::new();
    let a = cluster.add_node("node-a");
    let b = cluster.add_node("node-b");
    cluster.add_pod(a, "a1");
    cluster.add_pod(b, "b1");
    cluster.add_pod(b, "plain");
    // Meshed, but enrolled by the node agent, not by the config.
    let meshed = |pod: &str, node: &str| WorkloadEntry {
        enrolled: false,
        ..WorkloadEntry::enrolled(pod, node)
    };
    let config = flows::write_config(
        &cluster,
        "mesh.yaml",
        &[
            meshed("a1", "node-a"),
            meshed("b1", "node-b"),
            WorkloadEntry::outside("plain", "node-b"),
        ],
    );
    let (a1, b1, plain) = (cluster.pod("a1"), cluster.pod("b1"), cluster.pod("plain"));
    install_istio_cni_rules(&cluster, a1);
    install_istio_cni_rules(&cluster, b1);
    let dst = SocketAddr::from((b1.ip, 8080));
    let mut server = flows::server(b1, dst, "echo");
    let agent_a = NodeAgent::start(&cluster.dir().join("agent-a.sock"), vec![agent_pod(a1)]);
    let agent_b = NodeAgent::start(&cluster.dir().join("agent-b.sock"), vec![agent_pod(b1)]);
    let za = start(&cluster, a, agent_a.path(), &config);
    let zb = start(&cluster, b, agent_b.path(), &config);
    za.wait_for_log("pod enrolled pod=a1", Duration::from_secs(10));
    zb.wait_for_log("pod enrolled pod=b1", Duration::from_secs(10));

    // ztunnel put nothing of its own in the pods.
    let nat = a1.netns().exec("iptables", &["-t", "nat", "-S"]);
    assert!(!nat.contains("ZTUNNEL"), "{nat}");
    let rules = a1.netns().exec("ip", &["rule", "show"]);
    assert!(
        !rules.contains("lookup 1337"),
        "ztunnel's own reply rule: {rules}"
    );

    // Outbound through istio-cni's REDIRECT to 15001, HBONE between the
    // nodes, delivered to the app from a1's own address.
    flows::assert_ok(&flows::client(a1, dst, &ClientRun::default()));
    let peer = flows::last_peer(&mut server);
    assert!(
        peer.starts_with(&format!("{}:", a1.ip)),
        "server saw {peer}"
    );
    za.wait_for_log(
        "dst_identity=spiffe://cluster.local/ns/test/sa/b1",
        Duration::from_secs(5),
    );
    assert!(za.count_log_lines(&["path=\"hbone\"", &format!("orig_dst={dst}")]) >= 1);
    zb.wait_for_log(
        "src_identity=spiffe://cluster.local/ns/test/sa/a1",
        Duration::from_secs(5),
    );

    // Inbound plaintext from outside the mesh, through istio-cni's REDIRECT
    // to 15006: the app sees the client's own address.
    flows::assert_ok(&flows::client(plain, dst, &ClientRun::default()));
    let peer = flows::last_peer(&mut server);
    assert!(
        peer.starts_with(&format!("{}:", plain.ip)),
        "server saw {peer}"
    );
    zb.wait_for_log(
        &format!("orig_dst={dst} path=\"plaintext\""),
        Duration::from_secs(5),
    );

    // ztunnel loaded no eBPF at all: nothing pinned, no cgroup program.
    for z in [&za, &zb] {
        assert!(!z.bpffs.exists(), "{} was created", z.bpffs.display());
    }
    assert_eq!(
        cgroup_program_count(cluster.cgroup(), attach_type::INET4_CONNECT),
        0
    );

    // The agent deletes a1: ztunnel closes its listeners. istio-cni's rules
    // (still in place until istio-cni removes them) then lead nowhere: the
    // pod's connections are refused, never let around the mesh.
    assert_eq!(agent_a.del("a1"), vec![Ok(String::new())]);
    za.wait_for_log("pod removed pod=a1", Duration::from_secs(5));
    let refused = flows::client(
        a1,
        dst,
        &ClientRun {
            connect_timeout: 3,
            limit: Duration::from_secs(20),
            ..ClientRun::default()
        },
    );
    assert!(
        !refused.stdout.contains("RESULT ok"),
        "a removed pod's connection went through: {refused:?}"
    );
    let refused_text = format!("{}{}", refused.stdout, refused.stderr);
    assert!(refused_text.contains("refused"), "{refused_text}");
}
