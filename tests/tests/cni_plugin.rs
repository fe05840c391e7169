//! The `ztunnel-cni` plugin, invoked exactly as a container runtime does
//! (`CNI_*` variables, the network configuration with a bridge plugin's
//! `prevResult` on stdin, `CNI_NETNS` a test pod's namespace), against a
//! real ztunnel and a fake Kubernetes API server on the test's fabric.
//!
//! Layout: node-a runs ztunnel and the plugin (its namespace is the node's
//! "host"); node "apiserver" holds the fake API server at 10.244.0.2:6443.

use std::{
    net::{Ipv4Addr, SocketAddr},
    os::fd::AsRawFd as _,
    path::PathBuf,
    time::Duration,
};

use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, listen, socket,
};
use serde_json::{Value, json};

use ztunnel_common::Counter;
use ztunnel_tests::{
    Cluster,
    cni::{CniRun, FakeApiServer, bridge_result, net_conf, pod_env, run_plugin},
    flows::{self, ClientRun},
    require_root,
    ztunnel::Ztunnel,
};

/// The CNI error codes the tests expect (the specification's and ours).
mod code {
    pub const DECODE_FAILED: u64 = 6;
    pub const INVALID_CONFIG: u64 = 7;
    pub const TRY_AGAIN_LATER: u64 = 11;
    pub const ZTUNNEL_REFUSED: u64 = 100;
    pub const KUBERNETES: u64 = 101;
    pub const NOT_ENROLLED: u64 = 102;
}

const API_PORT: u16 = 6443;

/// A cluster with node-a (ztunnel, the plugin), the API server's node, and
/// the pods `names` on node-a.
struct Setup {
    cluster: Cluster,
    api: FakeApiServer,
    kubeconfig: PathBuf,
}

impl Setup {
    fn new(pods: &[&str]) -> Self {
        let mut cluster = Cluster::new();
        let node = cluster.add_node("node-a");
        let api_node = cluster.add_node("apiserver");
        for pod in pods {
            cluster.add_pod(node, pod);
        }
        let api_ip = cluster.node(api_node).ip;
        let api = FakeApiServer::start(cluster.node(api_node).netns(), api_ip, API_PORT);
        let kubeconfig = api.kubeconfig(cluster.dir(), api.addr, None);
        // Namespace "mesh" is in ambient mode; "plain" is not.
        api.namespace("mesh", &json!({"istio.io/dataplane-mode": "ambient"}));
        api.namespace("plain", &json!({"team": "web"}));
        Self {
            cluster,
            api,
            kubeconfig,
        }
    }

    /// Starts node-a's ztunnel with a mesh state that lists `pods` (pod,
    /// uid, namespace, service account): the plugin enrols them, and a pod
    /// whose workload is unknown gets no traffic.
    fn ztunnel(&self, pods: &[(&str, &str, &str, &str)]) -> Ztunnel {
        let listed: Vec<flows::ListedPod<'_>> = pods
            .iter()
            .map(|(pod, uid, namespace, service_account)| flows::ListedPod {
                pod,
                uid,
                namespace,
                service_account,
                node: "node-a",
            })
            .collect();
        let config = flows::write_listed_pods(&self.cluster, "mesh.yaml", &listed);
        Ztunnel::start(
            &self.cluster,
            0,
            &["--config", config.to_str().expect("utf-8")],
        )
    }

    /// Our keys of the conflist entry.
    fn keys(&self, z: Option<&Ztunnel>) -> Value {
        let socket = z.map_or_else(
            || self.cluster.dir().join("no-ztunnel.sock"),
            |z| z.socket.clone(),
        );
        // The records of node-a's pods, where its ztunnel reads them.
        let records = z.map_or_else(
            || self.cluster.dir().join("pods-node-a"),
            |z| z.pod_records.clone(),
        );
        json!({
            "ztunnelSocket": socket,
            "stateDir": records,
            "ztunnelTimeoutMs": 5000,
            "kubernetes": {"kubeconfig": self.kubeconfig, "timeoutMs": 2000},
        })
    }

    /// Runs the plugin on node-a for `pod` of `namespace`.
    fn plugin(
        &self,
        command: &str,
        pod: &str,
        namespace: &str,
        uid: Option<&str>,
        keys: &Value,
    ) -> CniRun {
        let pod = self.cluster.pod(pod);
        run_plugin(
            &self.cluster.node(0).netns().path(),
            &pod_env(command, pod, namespace, uid),
            &net_conf(&bridge_result(pod), keys),
        )
    }
}

/// Whether a connection from `from` to `dst` went through ztunnel's
/// outbound capture (the connect hook's counter moved by one).
fn captured(z: &Ztunnel, from: &ztunnel_tests::Pod, dst: SocketAddr) -> bool {
    let before = z.counters().get(Counter::ConnectRedirected);
    flows::assert_ok(&flows::client(from, dst, &ClientRun::default()));
    let after = z.counters().get(Counter::ConnectRedirected);
    assert!(after <= before + 1, "other traffic was captured meanwhile");
    after == before + 1
}

#[test]
fn add_enrols_a_selected_pod_check_confirms_and_del_removes_it() {
    if !require_root("add_enrols_a_selected_pod_check_confirms_and_del_removes_it") {
        return;
    }
    let s = Setup::new(&["app", "other"]);
    s.api
        .pod("mesh", "app", "uid-app", "app-sa", &json!({"app": "app"}));
    let (app, other) = (s.cluster.pod("app"), s.cluster.pod("other"));
    let dst = SocketAddr::from((other.ip, 8080));
    let _server = flows::server(other, dst, "echo");
    let z = s.ztunnel(&[("app", "uid-app", "mesh", "app-sa")]);
    let keys = s.keys(Some(&z));
    assert!(!captured(&z, app, dst), "captured before ADD");

    let add = s.plugin("ADD", "app", "mesh", Some("uid-app"), &keys);
    add.assert_ok();
    assert_eq!(
        add.stdout,
        bridge_result(app),
        "ADD must print prevResult unchanged"
    );
    eprintln!("ADD took {:?}", add.took);
    // Enrolled under the runtime's uid, with the identity of the service
    // account the API server gave.
    assert_eq!(
        z.count_log_lines(&[
            "pod enrolled",
            "uid-app",
            "spiffe://cluster.local/ns/mesh/sa/app-sa"
        ]),
        1,
        "{}",
        z.log()
    );
    assert!(
        captured(&z, app, dst),
        "the pod's outbound TCP is not captured after ADD"
    );
    assert!(
        s.api
            .requests()
            .contains(&"GET /api/v1/namespaces/mesh/pods/app".to_owned()),
        "{:?}",
        s.api.requests()
    );

    // CHECK asks ztunnel's admin endpoint (127.0.0.1:15000 in the node).
    let check = s.plugin("CHECK", "app", "mesh", Some("uid-app"), &keys);
    check.assert_ok();
    assert_eq!(check.stdout, Value::Null, "CHECK prints nothing on success");
    assert!(check.stderr.contains("is enrolled"), "{}", check.stderr);

    let del = s.plugin("DEL", "app", "mesh", Some("uid-app"), &keys);
    del.assert_ok();
    assert_eq!(del.stdout, Value::Null);
    z.wait_for_log("pod removed pod=uid-app", Duration::from_secs(5));
    assert!(!captured(&z, app, dst), "still captured after DEL");
    // DEL is idempotent.
    s.plugin("DEL", "app", "mesh", Some("uid-app"), &keys)
        .assert_ok();
    // CHECK now sees the pod missing from ztunnel.
    let msg = s
        .plugin("CHECK", "app", "mesh", Some("uid-app"), &keys)
        .assert_error(code::NOT_ENROLLED);
    assert!(msg.contains("uid-app"), "{msg}");
}

#[test]
fn add_fails_while_ztunnel_cannot_enrol_the_pod() {
    if !require_root("add_fails_while_ztunnel_cannot_enrol_the_pod") {
        return;
    }
    let s = Setup::new(&["app", "other"]);
    s.api.pod("mesh", "app", "uid-app", "app-sa", &json!({}));
    // No ztunnel: no socket. The error names it; the runtime may retry.
    let keys = s.keys(None);
    let run = s.plugin("ADD", "app", "mesh", Some("uid-app"), &keys);
    let msg = run.assert_error(code::TRY_AGAIN_LATER);
    let missing = s.cluster.dir().join("no-ztunnel.sock");
    assert!(
        msg.contains("ztunnel is not running") && msg.contains(&missing.display().to_string()),
        "{msg}"
    );
    // DEL while ztunnel is down succeeds (documented in ztunnel::remove).
    s.plugin("DEL", "app", "mesh", Some("uid-app"), &keys)
        .assert_ok();
    // CHECK does not: nothing confirms the pod is protected.
    s.plugin("CHECK", "app", "mesh", Some("uid-app"), &keys)
        .assert_error(code::TRY_AGAIN_LATER);

    // A ztunnel that takes the connection but never answers: bounded by
    // ztunnelTimeoutMs.
    let hung = s.cluster.dir().join("hung.sock");
    let listener = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    bind(listener.as_raw_fd(), &UnixAddr::new(&hung).expect("addr")).expect("bind");
    listen(&listener, Backlog::new(8).expect("backlog")).expect("listen");
    let mut hung_keys = keys.clone();
    hung_keys["ztunnelSocket"] = json!(hung);
    hung_keys["ztunnelTimeoutMs"] = json!(500);
    let run = s.plugin("ADD", "app", "mesh", Some("uid-app"), &hung_keys);
    let msg = run.assert_error(code::TRY_AGAIN_LATER);
    assert!(
        msg.contains("did not answer") && msg.contains("500ms"),
        "{msg}"
    );
    assert!(run.took < Duration::from_secs(5), "took {:?}", run.took);
    drop(listener);

    // A running ztunnel that refuses: the error carries its reason.
    let z = s.ztunnel(&[("app", "uid-app", "mesh", "app-sa")]);
    let keys = s.keys(Some(&z));
    // A service account ztunnel cannot make an identity of.
    s.api.pod("mesh", "app", "uid-app", "a/b", &json!({}));
    let msg = s
        .plugin("ADD", "app", "mesh", Some("uid-app"), &keys)
        .assert_error(code::ZTUNNEL_REFUSED);
    assert!(
        msg.contains("ztunnel refused")
            && msg.contains("workload_info.service_account")
            && msg.contains("'/'"),
        "{msg}"
    );
    // CNI_NETNS that is not a network namespace.
    s.api.pod("mesh", "app", "uid-app", "app-sa", &json!({}));
    let app = s.cluster.pod("app");
    let file = s.cluster.dir().join("not-a-netns");
    std::fs::write(&file, "").expect("file");
    let mut env = pod_env("ADD", app, "mesh", Some("uid-app"));
    for (k, v) in &mut env {
        if *k == "CNI_NETNS" {
            *v = file.display().to_string();
        }
    }
    let run = run_plugin(
        &s.cluster.node(0).netns().path(),
        &env,
        &net_conf(&bridge_result(app), &keys),
    );
    let msg = run.assert_error(code::ZTUNNEL_REFUSED);
    assert!(msg.contains("is not a network namespace"), "{msg}");
    assert_eq!(z.count_log_lines(&["pod enrolled"]), 0, "{}", z.log());
}

#[test]
fn version_and_malformed_configurations() {
    if !require_root("version_and_malformed_configurations") {
        return;
    }
    let s = Setup::new(&["app"]);
    let node = s.cluster.node(0).netns().path();
    let version = run_plugin(
        &node,
        &[("CNI_COMMAND", "VERSION".to_owned())],
        r#"{"cniVersion":"1.0.0"}"#,
    );
    version.assert_ok();
    assert_eq!(version.stdout["cniVersion"], "1.0.0");
    let supported = version.stdout["supportedVersions"]
        .as_array()
        .expect("list");
    for v in ["0.3.1", "0.4.0", "1.0.0"] {
        assert!(supported.contains(&json!(v)), "{v} not in {supported:?}");
    }

    let app = s.cluster.pod("app");
    let env = pod_env("ADD", app, "mesh", Some("uid-app"));
    let run = run_plugin(&node, &env, "{\"cniVersion\": \"1.0.0\", ");
    run.assert_error(code::DECODE_FAILED);
    let bad = net_conf(
        &bridge_result(app),
        &json!({"ztunnelTimeoutMs": "soon", "kubernetes": {"kubeconfig": 3}}),
    );
    let msg = run_plugin(&node, &env, &bad).assert_error(code::INVALID_CONFIG);
    assert!(
        msg.contains("ztunnelTimeoutMs") && msg.contains("kubernetes.kubeconfig"),
        "{msg}"
    );
    // Not chained: no prevResult.
    let unchained = json!({"cniVersion": "1.0.0", "name": "n", "type": "ztunnel-cni"}).to_string();
    let msg = run_plugin(&node, &env, &unchained).assert_error(code::INVALID_CONFIG);
    assert!(msg.contains("prevResult"), "{msg}");
    // No API request was made for any of these.
    assert!(s.api.requests().is_empty(), "{:?}", s.api.requests());
}

#[test]
fn the_api_server_decides_which_pods_are_enrolled() {
    if !require_root("the_api_server_decides_which_pods_are_enrolled") {
        return;
    }
    let s = Setup::new(&["web", "optout", "picked", "other"]);
    s.api
        .pod("plain", "web", "uid-web", "web", &json!({"app": "web"}));
    s.api.pod(
        "mesh",
        "optout",
        "uid-optout",
        "optout",
        &json!({"istio.io/dataplane-mode": "none"}),
    );
    s.api.pod(
        "plain",
        "picked",
        "uid-picked",
        "picked-sa",
        &json!({"istio.io/dataplane-mode": "ambient"}),
    );
    let other = s.cluster.pod("other");
    let dst = SocketAddr::from((other.ip, 8080));
    let _server = flows::server(other, dst, "echo");
    let z = s.ztunnel(&[("picked", "uid-picked", "plain", "picked-sa")]);
    let keys = s.keys(Some(&z));

    // Unlabelled pod in an unlabelled namespace, and a pod that opts out
    // of an ambient namespace: passed through, not enrolled.
    for (pod, ns) in [("web", "plain"), ("optout", "mesh")] {
        let run = s.plugin("ADD", pod, ns, None, &keys);
        run.assert_ok();
        assert_eq!(run.stdout, bridge_result(s.cluster.pod(pod)), "{pod}");
        assert!(run.stderr.contains("not enrolled"), "{pod}: {}", run.stderr);
        assert!(!captured(&z, s.cluster.pod(pod), dst), "{pod} captured");
    }
    assert_eq!(z.count_log_lines(&["pod enrolled"]), 0, "{}", z.log());
    // The opt-out label decided without the namespace.
    assert!(
        !s.api
            .requests()
            .contains(&"GET /api/v1/namespaces/mesh".to_owned()),
        "{:?}",
        s.api.requests()
    );

    // A pod labelled into the mesh, without K8S_POD_UID in CNI_ARGS: the
    // uid comes from the API server.
    s.plugin("ADD", "picked", "plain", None, &keys).assert_ok();
    assert_eq!(
        z.count_log_lines(&["pod enrolled", "uid-picked", "/ns/plain/sa/picked-sa"]),
        1,
        "{}",
        z.log()
    );
    assert!(captured(&z, s.cluster.pod("picked"), dst));

    // A namespace in excludeNamespaces is never asked about.
    let mut excluded = keys.clone();
    excluded["excludeNamespaces"] = json!(["plain"]);
    let before = s.api.requests().len();
    s.plugin("ADD", "web", "plain", None, &excluded).assert_ok();
    assert_eq!(s.api.requests().len(), before);

    // The API server unreachable: refused, then silent. Fail closed, naming
    // the server.
    let api_ip = s.cluster.node(1).ip;
    let mut refused = keys.clone();
    let refused_addr = SocketAddr::from((api_ip, API_PORT + 1));
    refused["kubernetes"]["kubeconfig"] =
        json!(s.api.kubeconfig(s.cluster.dir(), refused_addr, None));
    let msg = s
        .plugin("ADD", "web", "plain", Some("uid-web"), &refused)
        .assert_error(code::TRY_AGAIN_LATER);
    assert!(
        msg.contains(&format!("https://{refused_addr}")) && msg.contains("unreachable"),
        "{msg}"
    );
    // An address on the fabric nobody holds: the connect never completes.
    let silent_addr = SocketAddr::from((Ipv4Addr::new(10, 244, 0, 250), API_PORT));
    let mut silent = keys.clone();
    silent["kubernetes"]["kubeconfig"] =
        json!(s.api.kubeconfig(s.cluster.dir(), silent_addr, None));
    silent["kubernetes"]["timeoutMs"] = json!(700);
    let run = s.plugin("ADD", "web", "plain", Some("uid-web"), &silent);
    let msg = run.assert_error(code::TRY_AGAIN_LATER);
    assert!(
        msg.contains("10.244.0.250") && msg.contains("700ms"),
        "{msg}"
    );
    assert!(run.took < Duration::from_secs(5), "took {:?}", run.took);
    // A wrong token: the server's 401 is named.
    let mut denied = keys.clone();
    denied["kubernetes"]["kubeconfig"] =
        json!(s.api.kubeconfig(s.cluster.dir(), s.api.addr, Some("wrong")));
    let msg = s
        .plugin("ADD", "web", "plain", Some("uid-web"), &denied)
        .assert_error(code::KUBERNETES);
    assert!(msg.contains("401"), "{msg}");
    // A pod the API server does not know: not decided, not started.
    let msg = s
        .plugin("ADD", "other", "plain", Some("uid-other"), &keys)
        .assert_error(code::KUBERNETES);
    assert!(msg.contains("404") && msg.contains("plain/other"), "{msg}");
    assert_eq!(z.count_log_lines(&["pod enrolled"]), 1, "{}", z.log());
}

#[test]
fn pods_the_plugin_enrolled_stay_captured_across_a_restart_and_a_del_meanwhile_holds() {
    if !require_root(
        "pods_the_plugin_enrolled_stay_captured_across_a_restart_and_a_del_meanwhile_holds",
    ) {
        return;
    }
    let s = Setup::new(&["app", "web", "other"]);
    s.api.pod("mesh", "app", "uid-app", "app-sa", &json!({}));
    s.api.pod("mesh", "web", "uid-web", "web-sa", &json!({}));
    let (app, web, other) = (
        s.cluster.pod("app"),
        s.cluster.pod("web"),
        s.cluster.pod("other"),
    );
    let dst = SocketAddr::from((other.ip, 8080));
    let _server = flows::server(other, dst, "echo");
    let mut z = s.ztunnel(&[
        ("app", "uid-app", "mesh", "app-sa"),
        ("web", "uid-web", "mesh", "web-sa"),
    ]);
    let keys = s.keys(Some(&z));
    for (pod, uid) in [("app", "uid-app"), ("web", "uid-web")] {
        s.plugin("ADD", pod, "mesh", Some(uid), &keys).assert_ok();
        assert!(z.pod_records.join(format!("{uid}.json")).exists());
    }
    assert!(captured(&z, app, dst) && captured(&z, web, dst));

    // ztunnel stops (an upgrade, a crash); web is deleted meanwhile: its
    // DEL succeeds and drops its record, though nobody could be told.
    z.stop();
    s.plugin("DEL", "web", "mesh", Some("uid-web"), &keys)
        .assert_ok();
    assert!(!z.pod_records.join("uid-web.json").exists());
    assert!(z.pod_records.join("uid-app.json").exists());

    // The next ztunnel enrols app again from its record, before its sweep
    // (1 s grace here) removes what nobody re-enrolled: app stays in the
    // mesh, web's stale capture goes.
    let z = s.ztunnel(&[
        ("app", "uid-app", "mesh", "app-sa"),
        ("web", "uid-web", "mesh", "web-sa"),
    ]);
    z.wait_for_log(
        "pods recorded by ztunnel-cni enrolled again enrolled=1 gone=0 failed=0",
        Duration::from_secs(5),
    );
    z.wait_for_log(
        "removed kernel state of pods no longer enrolled",
        Duration::from_secs(10),
    );
    assert!(
        captured(&z, app, dst),
        "a recorded pod lost its capture at restart"
    );
    assert!(
        !captured(&z, web, dst),
        "a pod deleted while ztunnel was down came back"
    );
}
