//! ztunnel under istiod's control plane: workloads, services and policies
//! arrive over delta ADS from a (fake) istiod; pods enrolled over the
//! socket with istio-cni's uid are matched to istiod's workloads by name;
//! policy pushes apply to new connections; a resource that does not
//! validate is NACKed by name while the rest keeps working; a cut stream
//! resumes from the versions ztunnel holds.

use std::{
    net::SocketAddr,
    process::Command,
    time::{Duration, Instant},
};

use ztunnel::proto::istio::{
    security::{self, Authorization, string_match::MatchType},
    workload::{Address, TunnelProtocol, Workload, address},
};
use ztunnel_tests::{
    Cluster,
    ads::XdsRequestSeen,
    cgroup::TestCgroup,
    flows::{self, ClientRun},
    istiod::FakeIstiod,
    probe_bin,
    process::{Finished, PodProcess},
    require_root,
    ztunnel::{Ztunnel, sibling_bin},
};

/// node-a with a1 and a2, node-b with b1, and istiod's node.
struct Setup {
    cluster: Cluster,
    istiod: FakeIstiod,
    a: usize,
    b: usize,
}

fn uid(pod: &str) -> String {
    format!("Kubernetes//Pod/test/{pod}")
}

fn workload(cluster: &Cluster, pod: &str, node: &str, policies: &[&str]) -> Address {
    let p = cluster.pod(pod);
    Address {
        r#type: Some(address::Type::Workload(Workload {
            uid: uid(pod),
            name: pod.into(),
            namespace: "test".into(),
            addresses: vec![p.ip.octets().to_vec(), p.ip6.octets().to_vec()],
            tunnel_protocol: TunnelProtocol::Hbone as i32,
            trust_domain: "cluster.local".into(),
            service_account: pod.into(),
            node: node.into(),
            authorization_policies: policies.iter().map(|s| (*s).to_owned()).collect(),
            workload_name: format!("{pod}-deploy"),
            canonical_name: format!("{pod}-app"),
            canonical_revision: "v1".into(),
            cluster_id: "test-cluster".into(),
            ..Workload::default()
        })),
    }
}

/// ALLOW only `principal` to the workloads that list `test/only-a1`.
fn only_a1() -> Authorization {
    Authorization {
        name: "only-a1".into(),
        namespace: "test".into(),
        scope: security::Scope::WorkloadSelector as i32,
        action: security::Action::Allow as i32,
        rules: vec![security::Rule {
            clauses: vec![security::Clause {
                matches: vec![security::Match {
                    principals: vec![security::StringMatch {
                        match_type: Some(MatchType::Exact("cluster.local/ns/test/sa/a1".into())),
                    }],
                    ..security::Match::default()
                }],
            }],
        }],
        ..Authorization::default()
    }
}

/// DENY `principal` to every workload of namespace `test`.
fn deny(name: &str, principal: &str) -> Authorization {
    Authorization {
        name: name.into(),
        namespace: "test".into(),
        scope: security::Scope::Namespace as i32,
        action: security::Action::Deny as i32,
        rules: vec![security::Rule {
            clauses: vec![security::Clause {
                matches: vec![security::Match {
                    principals: vec![security::StringMatch {
                        match_type: Some(MatchType::Exact(principal.into())),
                    }],
                    ..security::Match::default()
                }],
            }],
        }],
        ..Authorization::default()
    }
}

/// A long-lived connection exchanging a little data every ~100 ms
/// (`zt-probe beat`), once its first exchange went through.
fn beat(from: &ztunnel_tests::Pod, dst: SocketAddr) -> PodProcess {
    let mut cmd = from.command(&probe_bin());
    cmd.args(["beat", "--connect", &dst.to_string(), "--seconds", "60"]);
    let mut process = PodProcess::spawn(&format!("beat-{}", from.name), cmd);
    let first = process.read_line(Duration::from_secs(15));
    assert!(first.starts_with("CONNECTED"), "{first}");
    let ok = process.read_line(Duration::from_secs(15));
    assert!(ok.starts_with("OK 0 "), "no data flowed: {ok}");
    process
}

/// The first line of `beat` that is not `OK ...` within `limit`.
fn beat_event(beat: &mut PodProcess, limit: Duration) -> Option<String> {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let line = beat.try_read_line(left)?;
        if !line.starts_with("OK ") {
            return Some(line);
        }
    }
}

impl Setup {
    fn new() -> Self {
        let mut cluster = Cluster::new();
        let a = cluster.add_node("node-a");
        let b = cluster.add_node("node-b");
        cluster.add_pod(a, "a1");
        cluster.add_pod(a, "a2");
        cluster.add_pod(b, "b1");
        let istiod = FakeIstiod::on_new_node(&mut cluster);
        for (pod, node, policies) in [
            ("a1", "node-a", &[][..]),
            ("a2", "node-a", &[][..]),
            ("b1", "node-b", &["test/only-a1"][..]),
        ] {
            istiod
                .xds
                .set_address(&uid(pod), &workload(&cluster, pod, node, policies));
        }
        istiod.xds.set_policy(&only_a1());
        Self {
            cluster,
            istiod,
            a,
            b,
        }
    }

    /// ztunnel's flags for `node` run from istiod (xDS and CA), no
    /// config file.
    fn args(&self, node: usize) -> Vec<String> {
        let n = self.cluster.node(node);
        let mut args = self.istiod.ztunnel_args();
        args.extend(self.istiod.xds_args());
        args.extend([
            "--instance-ip".into(),
            n.ip.to_string(),
            "--pod-name".into(),
            format!("ztunnel-{}", n.name),
        ]);
        args
    }

    /// ztunnel of `node` run from istiod, once it is ready.
    fn ztunnel(&self, node: usize) -> Ztunnel {
        let args = self.args(node);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Ztunnel::start(&self.cluster, node, &args)
    }

    /// `/healthz/ready` of `node`'s ztunnel: the status code.
    fn readiness(&self, node: usize) -> u16 {
        let cg = TestCgroup::create(&format!("{}/ready-{node}", self.cluster.prefix()));
        Ztunnel::http_get(
            &self.cluster.node(node).netns().path(),
            &cg.procs(),
            "127.0.0.1:15021",
            "/healthz/ready",
        )
        .0
    }

    /// Enrols `pod` into `z` the way istio-cni does: its own uid (not
    /// istiod's), with name, namespace and service account.
    fn enrol(&self, z: &Ztunnel, pod: &str) {
        let netns = self.cluster.pod(pod).netns_path();
        let out = Command::new(sibling_bin("ztunnel"))
            .arg("enrol")
            .arg("--socket")
            .arg(&z.socket)
            .args(["add", "--uid", &format!("k8s-uid-{pod}"), "--netns"])
            .arg(netns)
            .args([
                "--name",
                pod,
                "--namespace",
                "test",
                "--service-account",
                pod,
            ])
            .output()
            .expect("run ztunnel enrol");
        assert!(out.status.success(), "enrol {pod}: {out:?}");
    }

    fn flow(&self, from: &str) -> Finished {
        flows::client(
            self.cluster.pod(from),
            SocketAddr::from((self.cluster.pod("b1").ip, 8080)),
            &ClientRun {
                bytes: 5_000,
                limit: Duration::from_secs(20),
                ..ClientRun::default()
            },
        )
    }

    /// Polls `cond` every 100 ms for at most `limit`.
    fn wait_until(&self, what: &str, limit: Duration, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + limit;
        while !cond() {
            assert!(
                Instant::now() < deadline,
                "gave up after {limit:?} waiting until {what}; istiod saw {:#?}",
                self.istiod.xds.requests()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The requests of `node`'s streams.
    fn requests_from(&self, node: usize) -> Vec<XdsRequestSeen> {
        let ip = format!("~{}~", self.cluster.node(node).ip);
        self.istiod
            .xds
            .requests()
            .into_iter()
            .filter(|r| r.node_id.as_deref().is_some_and(|id| id.contains(&ip)))
            .collect()
    }
}

#[test]
fn workloads_and_policies_from_istiod_route_and_authorize_and_pushes_apply() {
    if !require_root("workloads_and_policies_from_istiod_route_and_authorize_and_pushes_apply") {
        return;
    }
    let s = Setup::new();
    let b1 = s.cluster.pod("b1");
    let _server = flows::server(b1, SocketAddr::from((b1.ip, 8080)), "echo");
    let za = s.ztunnel(s.a);
    let zb = s.ztunnel(s.b);
    // Ready only after istiod's first push of both types.
    for z in [&za, &zb] {
        let log = z.log();
        let ready = log.find("ztunnel ready").expect("ready");
        let pushes = log[..ready].matches("xDS push applied").count();
        assert!(pushes >= 2, "ready before both types were pushed:\n{log}");
    }
    // The node as istiod knows it, and the credentials of the stream.
    let first = s
        .requests_from(s.a)
        .into_iter()
        .find(|r| r.node_id.is_some())
        .expect("a first request from node-a");
    let ip = s.cluster.node(s.a).ip;
    assert_eq!(
        first.node_id.as_deref(),
        Some(
            format!("ztunnel~{ip}~ztunnel-node-a.istio-system~istio-system.svc.cluster.local")
                .as_str()
        )
    );
    assert_eq!(
        first.metadata.get("NODE_NAME").map(String::as_str),
        Some("node-a")
    );
    assert_eq!(
        first.metadata.get("CLUSTER_ID").map(String::as_str),
        Some("test-cluster")
    );
    assert_eq!(first.metadata.get("INSTANCE_IPS"), Some(&ip.to_string()));
    assert_eq!(first.cluster_id.as_deref(), Some("test-cluster"));
    assert_eq!(
        first.authorization.as_deref(),
        Some(format!("Bearer {}", s.istiod.token).as_str())
    );
    for type_url in [ztunnel::xds::ADDRESS_TYPE, ztunnel::xds::AUTHORIZATION_TYPE] {
        assert!(
            s.requests_from(s.a)
                .iter()
                .any(|r| r.type_url == type_url && !r.nonce.is_empty() && r.error.is_none()),
            "no ACK of {type_url}"
        );
    }

    // Certificates for node-a's workloads are asked for as istiod lists
    // them, before any pod connects (or is even enrolled).
    for sa in ["a1", "a2"] {
        let san = format!("spiffe://cluster.local/ns/test/sa/{sa}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.istiod.granted(&san) == 0 {
            assert!(
                Instant::now() < deadline,
                "no certificate asked for {san}: {:#?}",
                s.istiod.requests()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // config_dump shows what istiod sent, with versions.
    let dump = Ztunnel::config_dump_of(&s.cluster, s.a);
    let xds = &dump["xds"];
    assert_eq!(xds["connected"], true, "{xds}");
    assert!(
        xds["versions"][ztunnel::xds::ADDRESS_TYPE][uid("b1")].is_string(),
        "{xds}"
    );
    assert_eq!(xds["acked"].as_array().map(Vec::len), Some(2), "{xds}");
    assert!(
        dump["workloads"]
            .as_array()
            .is_some_and(|w| w.iter().any(|w| w["uid"] == uid("b1"))),
        "{dump}"
    );

    for pod in ["a1", "a2"] {
        s.enrol(&za, pod);
    }
    s.enrol(&zb, "b1");

    // a1 is allowed by the pushed policy, over HBONE with its identity.
    flows::assert_ok(&s.flow("a1"));
    zb.wait_for_log(
        "src_identity=spiffe://cluster.local/ns/test/sa/a1",
        Duration::from_secs(5),
    );
    // Istio's labels, filled from the xDS workload fields.
    let labels = [
        "reporter=\"destination\"",
        "source_workload=\"a1-deploy\"",
        "source_canonical_service=\"a1-app\"",
        "source_canonical_revision=\"v1\"",
        "source_app=\"a1-app\"",
        "source_version=\"v1\"",
        "source_cluster=\"test-cluster\"",
        "destination_workload=\"b1-deploy\"",
        "destination_canonical_service=\"b1-app\"",
        "destination_cluster=\"test-cluster\"",
        "destination_principal=\"spiffe://cluster.local/ns/test/sa/b1\"",
        "request_protocol=\"tcp\"",
        "connection_security_policy=\"mutual_tls\"",
    ];
    let metrics = Ztunnel::node_get(&s.cluster, s.b, "127.0.0.1:15020", "/metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("istio_tcp_connections_opened_total{")
                && labels.iter().all(|want| l.contains(want))),
        "no istio_tcp_connections_opened_total with {labels:?}:\n{metrics}"
    );
    // a2 is not: the policy selects b1 (matched by name to istiod's
    // workload, though enrolled with another uid).
    let denied = s.flow("a2");
    assert!(!denied.status.success(), "a2 got through: {denied:?}");
    zb.wait_for_log("no ALLOW policy matched", Duration::from_secs(5));

    // istiod drops the policy: the push applies to the next connection.
    s.istiod
        .xds
        .remove(ztunnel::xds::AUTHORIZATION_TYPE, "test/only-a1");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let done = s.flow("a2");
        if done.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a2 still refused after the policy was removed: {done:?}\n{}",
            zb.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // Tightening applies to what is open: a DENY pushed for a2 closes its
    // open connection.
    let b1_dst = SocketAddr::from((b1.ip, 8080));
    let mut open = beat(s.cluster.pod("a2"), b1_dst);
    s.istiod
        .xds
        .set_policy(&deny("no-a2", "cluster.local/ns/test/sa/a2"));
    let event = beat_event(&mut open, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("a2's open connection survived the DENY; log:\n{}", zb.log()));
    assert!(event.starts_with("CLOSED"), "{event}");
    zb.wait_for_log(
        "open connection closed: the new policy denies it",
        Duration::from_secs(5),
    );
}

#[test]
fn a_bad_resource_is_nacked_by_name_and_a_cut_stream_resumes_from_its_versions() {
    if !require_root("a_bad_resource_is_nacked_by_name_and_a_cut_stream_resumes_from_its_versions")
    {
        return;
    }
    let s = Setup::new();
    let b1 = s.cluster.pod("b1");
    let _server = flows::server(b1, SocketAddr::from((b1.ip, 8080)), "echo");
    let za = s.ztunnel(s.a);
    let zb = s.ztunnel(s.b);
    s.enrol(&za, "a1");
    s.enrol(&zb, "b1");
    flows::assert_ok(&s.flow("a1"));

    // A workload with a 3-byte address, and bytes that are no protobuf.
    let mut bad = workload(&s.cluster, "a2", "node-a", &[]);
    if let Some(address::Type::Workload(w)) = &mut bad.r#type {
        w.addresses = vec![vec![10, 0, 0]];
    }
    // Both in one push: one NACK must name both.
    s.istiod.xds.set_address_bodies(vec![
        ("bad-workload".into(), prost::Message::encode_to_vec(&bad)),
        ("garbage".into(), vec![0xff, 0xff, 0xff]),
    ]);
    s.wait_until("node-a NACKs both by name", Duration::from_secs(10), || {
        s.requests_from(s.a).iter().any(|r| {
            r.error.as_deref().is_some_and(|e| {
                e.contains("bad-workload") && e.contains("3 bytes") && e.contains("garbage")
            })
        })
    });
    za.wait_for_log("xDS resources refused (NACK)", Duration::from_secs(5));
    let nack = &Ztunnel::config_dump_of(&s.cluster, s.a)["xds"]["lastNack"];
    assert!(
        nack["detail"]
            .as_str()
            .is_some_and(|d| d.contains("bad-workload")),
        "{nack}"
    );
    // The good state keeps working.
    flows::assert_ok(&s.flow("a1"));

    // istiod cuts the stream: ztunnel comes back with what it holds, and
    // keeps serving meanwhile.
    let mut open = beat(s.cluster.pod("a1"), SocketAddr::from((b1.ip, 8080)));
    let before = s.requests_from(s.a).len();
    s.istiod.xds.kick();
    s.wait_until(
        "node-a reconnects with its resource versions",
        Duration::from_secs(15),
        || {
            s.requests_from(s.a)[before..].iter().any(|r| {
                r.nonce.is_empty()
                    && r.type_url == ztunnel::xds::ADDRESS_TYPE
                    && r.initial_versions.contains_key(&uid("b1"))
                    && !r.initial_versions.contains_key("bad-workload")
            })
        },
    );
    za.wait_for_log("xDS stream closed by istiod", Duration::from_secs(5));
    flows::assert_ok(&s.flow("a1"));
    // The connection open across the cut kept flowing.
    assert_eq!(
        beat_event(&mut open, Duration::from_secs(2)),
        None,
        "the open connection broke when istiod's stream was cut"
    );
}

/// A connection of `from` to `dst` carrying a little data.
fn small_flow(from: &ztunnel_tests::Pod, dst: SocketAddr) -> Finished {
    flows::client(
        from,
        dst,
        &ClientRun {
            bytes: 5_000,
            connect_timeout: 3,
            limit: Duration::from_secs(15),
            ..ClientRun::default()
        },
    )
}

#[test]
fn before_istiods_first_push_every_connection_is_refused() {
    if !require_root("before_istiods_first_push_every_connection_is_refused") {
        return;
    }
    // istiod accepts the stream and says nothing: the window a pod can be
    // enrolled in (istio-cni sends its snapshot at once) while ztunnel
    // knows no workload and no policy. b1 has no ztunnel yet and serves in
    // plain text: an empty state would pass a1's connection to it in clear.
    let s = Setup::new();
    s.istiod.xds.set_silent(true);
    let (a1, a2, b1) = (
        s.cluster.pod("a1"),
        s.cluster.pod("a2"),
        s.cluster.pod("b1"),
    );
    let b1_addr = SocketAddr::from((b1.ip, 8080));
    let a1_addr = SocketAddr::from((a1.ip, 9090));
    let mut b1_server = flows::server(b1, b1_addr, "echo");
    let mut a1_server = flows::server(a1, a1_addr, "echo");
    let args = s.args(s.a);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let za = Ztunnel::start_unready(&s.cluster, s.a, &args);
    za.wait_for_log("enrolment socket listening", Duration::from_secs(20));
    s.enrol(&za, "a1");
    za.wait_for_log("pod enrolled pod=k8s-uid-a1", Duration::from_secs(10));
    assert_eq!(s.readiness(s.a), 503, "ready before istiod pushed anything");

    // Outbound from the enrolled pod, to a meshed destination istiod has
    // not described yet: refused, and nothing reaches b1.
    let out = small_flow(a1, b1_addr);
    assert!(
        !out.stdout.contains("RESULT ok"),
        "outbound passed before the first push: {out:?}"
    );
    assert_eq!(
        b1_server.try_read_line(Duration::from_secs(1)),
        None,
        "b1 was reached in clear before the first push"
    );
    // Inbound to the enrolled pod from a pod outside the mesh: refused.
    let inbound = small_flow(a2, a1_addr);
    assert!(
        !inbound.stdout.contains("RESULT ok"),
        "inbound passed before the first push: {inbound:?}"
    );
    assert_eq!(
        a1_server.try_read_line(Duration::from_secs(1)),
        None,
        "a1 was reached before the first push"
    );
    za.wait_for_log("no mesh state from istiod yet", Duration::from_secs(5));
    assert_eq!(s.readiness(s.a), 503, "ready before istiod pushed anything");

    // istiod speaks: ready, and the same flow goes through the mesh.
    s.istiod.xds.set_silent(false);
    za.wait_for_log("ztunnel ready", Duration::from_secs(20));
    let zb = s.ztunnel(s.b);
    s.enrol(&zb, "b1");
    zb.wait_for_log("pod enrolled pod=k8s-uid-b1", Duration::from_secs(10));
    flows::assert_ok(&small_flow(a1, b1_addr));
    let peer = flows::last_peer(&mut b1_server);
    assert!(peer.starts_with(&format!("{}:", a1.ip)), "b1 saw {peer}");
    assert!(
        zb.log()
            .contains("src_identity=spiffe://cluster.local/ns/test/sa/a1"),
        "b1's connection did not come over HBONE"
    );
}

/// `args` with the value after `flag` replaced.
fn with_flag(mut args: Vec<String>, flag: &str, value: &str) -> Vec<String> {
    let at = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    value.clone_into(&mut args[at + 1]);
    args
}

#[test]
fn an_istiod_with_a_foreign_certificate_or_a_refused_token_is_never_trusted() {
    if !require_root("an_istiod_with_a_foreign_certificate_or_a_refused_token_is_never_trusted") {
        return;
    }
    let s = Setup::new();
    let dir = s.cluster.dir();
    // node-a: a token istiod refuses (re-read on each call, so fixing the
    // file is enough). node-b: a root that did not sign istiod's
    // certificate (an impostor, or a rotated root ztunnel does not have).
    let token = dir.join("wrong-token");
    std::fs::write(&token, "not-the-token\n").expect("write token");
    let other = rcgen::generate_simple_self_signed(vec!["istiod.istio-system.svc".to_owned()])
        .expect("other root");
    let root = dir.join("other-root.pem");
    std::fs::write(&root, other.cert.pem()).expect("write root");
    let a_args = with_flag(s.args(s.a), "--auth-token", token.to_str().expect("utf-8"));
    let b_args = with_flag(
        s.args(s.b),
        "--xds-root-cert",
        root.to_str().expect("utf-8"),
    );
    let a_args: Vec<&str> = a_args.iter().map(String::as_str).collect();
    let b_args: Vec<&str> = b_args.iter().map(String::as_str).collect();
    let za = Ztunnel::start_unready(&s.cluster, s.a, &a_args);
    let zb = Ztunnel::start_unready(&s.cluster, s.b, &b_args);
    za.wait_for_log("xDS stream failed", Duration::from_secs(20));
    zb.wait_for_log("xDS stream failed", Duration::from_secs(20));
    // Each names what is wrong.
    let failure = |z: &Ztunnel| {
        z.log()
            .lines()
            .find(|l| l.contains("xDS stream failed"))
            .map(str::to_owned)
            .unwrap_or_default()
    };
    let (a_failure, b_failure) = (failure(&za), failure(&zb));
    assert!(
        a_failure.contains("Unauthenticated") && a_failure.contains("token"),
        "{a_failure}"
    );
    assert!(
        b_failure.contains("invalid peer certificate: UnknownIssuer"),
        "{b_failure}"
    );
    for line in [&a_failure, &b_failure] {
        assert!(line.contains("connections stay refused"), "{line}");
    }
    // Never ready, and it keeps trying (bounded back-off, not a crash).
    assert_eq!(s.readiness(s.a), 503);
    assert_eq!(s.readiness(s.b), 503);
    za.wait_for_log("retry_in=1s", Duration::from_secs(10));
    zb.wait_for_log("retry_in=1s", Duration::from_secs(10));
    // node-b's ztunnel never completed a handshake with the real istiod,
    // so istiod saw no request from it; node-a's were refused before any.
    assert!(
        s.requests_from(s.b).is_empty(),
        "{:?}",
        s.requests_from(s.b)
    );
    assert!(
        s.requests_from(s.a).is_empty(),
        "{:?}",
        s.requests_from(s.a)
    );

    // The right token in the same file: the next attempt gets through.
    std::fs::write(&token, format!("{}\n", s.istiod.token)).expect("fix token");
    za.wait_for_log("ztunnel ready", Duration::from_secs(40));
    assert_eq!(s.readiness(s.a), 200);
    assert_eq!(s.readiness(s.b), 503);
}

#[test]
fn an_istiod_restart_loses_no_connection_and_the_new_stream_resumes_from_versions() {
    if !require_root(
        "an_istiod_restart_loses_no_connection_and_the_new_stream_resumes_from_versions",
    ) {
        return;
    }
    let mut s = Setup::new();
    let b1 = s.cluster.pod("b1");
    let b1_dst = SocketAddr::from((b1.ip, 8080));
    let _server = flows::server(b1, b1_dst, "echo");
    let za = s.ztunnel(s.a);
    let zb = s.ztunnel(s.b);
    s.enrol(&za, "a1");
    s.enrol(&zb, "b1");
    flows::assert_ok(&s.flow("a1"));
    let mut open = beat(s.cluster.pod("a1"), b1_dst);
    let before = s.requests_from(s.a).len();

    // istiod goes away for 3 s (every stream and connection cut, new ones
    // refused) and comes back with the same state.
    s.istiod.restart(Duration::from_secs(3));
    let cuts = za.count_log_lines(&["xDS stream closed by istiod"])
        + za.count_log_lines(&["xDS stream failed"]);
    assert!(cuts > 0, "the restart did not cut node-a's stream");
    // While it was down and since: the last state serves new connections.
    flows::assert_ok(&s.flow("a1"));
    s.wait_until(
        "node-a resubscribes with the versions it holds",
        Duration::from_secs(20),
        || {
            s.requests_from(s.a)[before..].iter().any(|r| {
                r.nonce.is_empty()
                    && r.type_url == ztunnel::xds::ADDRESS_TYPE
                    && r.initial_versions.contains_key(&uid("b1"))
            })
        },
    );
    assert_eq!(
        beat_event(&mut open, Duration::from_secs(1)),
        None,
        "the open connection broke across istiod's restart"
    );
    // The new stream is live: a push after the restart applies.
    s.istiod
        .xds
        .set_policy(&deny("no-a1", "cluster.local/ns/test/sa/a1"));
    let event = beat_event(&mut open, Duration::from_secs(15)).unwrap_or_else(|| {
        panic!(
            "a DENY pushed after the restart did not apply; log:\n{}",
            zb.log()
        )
    });
    assert!(event.starts_with("CLOSED"), "{event}");
    assert!(
        !s.flow("a1").stdout.contains("RESULT ok"),
        "a1 still connects after the DENY"
    );
}
