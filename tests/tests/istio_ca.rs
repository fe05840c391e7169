//! Certificates from Istio's CA: ztunnel asks a (fake) istiod for every
//! workload certificate, over TLS with the bearer token, impersonating the
//! workload; keeps serving with the old certificate while the CA is down;
//! refuses an answer for the wrong identity; holds no CA key.

use std::{net::SocketAddr, time::Duration};

use ztunnel_tests::{
    Cluster,
    cgroup::TestCgroup,
    flows::{self, ClientRun, WorkloadEntry},
    istiod::FakeIstiod,
    require_root,
    ztunnel::Ztunnel,
};

const A1: &str = "spiffe://cluster.local/ns/test/sa/a1";
const B1: &str = "spiffe://cluster.local/ns/test/sa/b1";

/// node-a with a1, node-b with b1 (both meshed), and istiod's node.
struct Setup {
    cluster: Cluster,
    istiod: FakeIstiod,
    config: String,
    a: usize,
    b: usize,
}

impl Setup {
    fn new() -> Self {
        let mut cluster = Cluster::new();
        let a = cluster.add_node("node-a");
        let b = cluster.add_node("node-b");
        cluster.add_pod(a, "a1");
        cluster.add_pod(b, "b1");
        let istiod = FakeIstiod::on_new_node(&mut cluster);
        let config = flows::write_config(
            &cluster,
            "mesh.yaml",
            &[
                WorkloadEntry::enrolled("a1", "node-a"),
                WorkloadEntry::enrolled("b1", "node-b"),
            ],
        );
        Self {
            cluster,
            istiod,
            config: config.display().to_string(),
            a,
            b,
        }
    }

    /// ztunnel of `node` with the CA given by flags plus `extra`.
    fn ztunnel(&self, node: usize, extra: &[&str]) -> Ztunnel {
        let mut args: Vec<String> = vec!["--config".into(), self.config.clone()];
        args.extend(self.istiod.ztunnel_args());
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Ztunnel::start(&self.cluster, node, &args)
    }

    fn dst(&self) -> SocketAddr {
        SocketAddr::from((self.cluster.pod("b1").ip, 8080))
    }

    /// One short echo flow a1 -> b1.
    fn flow(&self) -> ztunnel_tests::process::Finished {
        flows::client(
            self.cluster.pod("a1"),
            self.dst(),
            &ClientRun {
                bytes: 10_000,
                limit: Duration::from_secs(30),
                ..ClientRun::default()
            },
        )
    }

    /// Polls `cond` every 100 ms for at most `limit`.
    fn wait_until(&self, what: &str, limit: Duration, cond: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + limit;
        while !cond() {
            assert!(
                std::time::Instant::now() < deadline,
                "gave up after {limit:?} waiting until {what}; the CA saw {:#?}",
                self.istiod.requests()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn workload_certificates_come_from_the_istio_ca_and_no_ca_key_is_on_the_node() {
    if !require_root("workload_certificates_come_from_the_istio_ca_and_no_ca_key_is_on_the_node") {
        return;
    }
    let s = Setup::new();
    let _server = flows::server(s.cluster.pod("b1"), s.dst(), "echo");
    // node-a by flags, node-b by Istio's environment variable names (the
    // DaemonSet env of Istio's chart).
    let za = s.ztunnel(s.a, &[]);
    let root = s.istiod.root_cert.display().to_string();
    let token = s.istiod.token_file.display().to_string();
    let addr = s.istiod.addr.to_string();
    let zb = Ztunnel::start_full(
        &s.cluster,
        s.b,
        "info",
        &["--config", &s.config],
        &[
            ("CA_ADDRESS", addr.as_str()),
            ("CA_ROOT_CA", root.as_str()),
            ("AUTH_TOKEN", token.as_str()),
            ("ISTIO_META_CLUSTER_ID", "test-cluster"),
            ("SECRET_TTL", "12h"),
            ("POD_NAMESPACE", "istio-system"),
            ("SERVICE_ACCOUNT", "ztunnel"),
        ],
    );
    flows::assert_ok(&s.flow());

    // Each workload's certificate was asked for by its node's ztunnel,
    // impersonating it, with the token and cluster id, for SECRET_TTL.
    s.wait_until(
        "a1 and b1 have certificates",
        Duration::from_secs(20),
        || s.istiod.granted(A1) >= 1 && s.istiod.granted(B1) >= 1,
    );
    for r in s.istiod.requests() {
        assert_eq!(
            r.impersonated, r.san,
            "impersonation names the CSR's identity: {r:?}"
        );
        assert_eq!(
            r.authorization.as_deref(),
            Some(format!("Bearer {}", s.istiod.token).as_str()),
            "{r:?}"
        );
        assert_eq!(r.cluster_id.as_deref(), Some("test-cluster"), "{r:?}");
        let expected = if r.san.as_deref() == Some(B1) {
            12 * 3600
        } else {
            24 * 3600
        };
        assert_eq!(r.validity, expected, "{r:?}");
        assert!(r.granted, "{r:?}");
    }
    let dump = Ztunnel::config_dump_of(&s.cluster, s.a);
    let certs = dump["certificates"].as_array().expect("certificates");
    let a1 = certs
        .iter()
        .find(|c| c["identity"] == A1)
        .unwrap_or_else(|| panic!("no a1 certificate in {certs:?}"));
    assert_eq!(a1["source"], "istio", "{a1}");
    assert_eq!(a1["chain_length"], 1, "the root is not sent to peers: {a1}");
    // No CA key anywhere ztunnel keeps one: the development CA folder the
    // harness names was never created.
    assert!(
        !s.cluster.dir().join("dev-ca").exists(),
        "a CA folder was created in Istio CA mode"
    );
    assert!(!za.log().contains("generated a development CA"));
    assert!(!zb.log().contains("generated a development CA"));
}

#[test]
fn a_ca_outage_at_renewal_keeps_the_old_certificate_and_retries() {
    if !require_root("a_ca_outage_at_renewal_keeps_the_old_certificate_and_retries") {
        return;
    }
    let s = Setup::new();
    let _server = flows::server(s.cluster.pod("b1"), s.dst(), "echo");
    // 30 s certificates: renewal is due after 15 s.
    let za = s.ztunnel(s.a, &["--cert-lifetime", "30"]);
    let _zb = s.ztunnel(s.b, &["--cert-lifetime", "30"]);
    flows::assert_ok(&s.flow());
    s.wait_until("a1 has a certificate", Duration::from_secs(20), || {
        s.istiod.granted(A1) >= 1
    });
    s.istiod.set_down(true);
    s.wait_until(
        "ztunnel retried the renewal twice",
        Duration::from_secs(25),
        || {
            s.istiod
                .requests()
                .iter()
                .filter(|r| !r.granted && r.san.as_deref() == Some(A1))
                .count()
                >= 2
        },
    );
    za.wait_for_log("certificate request failed", Duration::from_secs(5));
    // The old certificate is still valid and still used.
    flows::assert_ok(&s.flow());
    let cg = TestCgroup::create(&format!("{}/metrics-client", s.cluster.prefix()));
    let metrics = Ztunnel::metrics_of(&s.cluster, s.a, &cg);
    let failed = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ztunnel_certificate_requests_failed "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no ztunnel_certificate_requests_failed in {metrics}"));
    assert!(failed >= 2, "failed requests counted: {failed}");
    assert!(
        za.log().contains("current_certificate_kept=true"),
        "the log does not say the old certificate is kept"
    );
    s.istiod.set_down(false);
    s.wait_until(
        "a1's certificate is renewed",
        Duration::from_secs(20),
        || s.istiod.granted(A1) >= 2,
    );
    za.wait_for_log(
        "certificate renewed by the Istio CA",
        Duration::from_secs(5),
    );
    flows::assert_ok(&s.flow());
}

#[test]
fn a_bad_token_or_a_certificate_for_someone_else_fails_closed_until_fixed() {
    if !require_root("a_bad_token_or_a_certificate_for_someone_else_fails_closed_until_fixed") {
        return;
    }
    let s = Setup::new();
    let _server = flows::server(s.cluster.pod("b1"), s.dst(), "echo");
    let _zb = s.ztunnel(s.b, &[]);
    // node-a's token file holds the wrong token, and the CA signs the
    // wrong identity.
    std::fs::write(&s.istiod.token_file, "not-the-token\n").expect("write token");
    s.istiod.set_wrong_san(true);
    let za = s.ztunnel(s.a, &[]);
    za.wait_for_log("Unauthenticated", Duration::from_secs(20));
    let refused = s.flow();
    assert!(
        !refused.stdout.contains("RESULT ok"),
        "a1 reached b1 without a certificate: {refused:?}"
    );
    // The token file is read for every request: fixing it is enough.
    std::fs::write(&s.istiod.token_file, format!("{}\n", s.istiod.token)).expect("write token");
    za.wait_for_log(
        "the CA signed spiffe://cluster.local/ns/intruder-test/sa/a1, not the identity asked for",
        Duration::from_secs(30),
    );
    let refused = s.flow();
    assert!(
        !refused.stdout.contains("RESULT ok"),
        "a1 reached b1 with a certificate for another identity: {refused:?}"
    );
    s.istiod.set_wrong_san(false);
    // Retries back off (doubling from 500 ms), so this can take a while.
    za.wait_for_log(
        "certificate issued by the Istio CA",
        Duration::from_secs(60),
    );
    flows::assert_ok(&s.flow());
}

#[test]
fn an_expired_certificate_is_never_presented() {
    if !require_root("an_expired_certificate_is_never_presented") {
        return;
    }
    let s = Setup::new();
    let _server = flows::server(s.cluster.pod("b1"), s.dst(), "echo");
    // 8 s certificates for a1; b1's last long.
    let za = s.ztunnel(s.a, &["--cert-lifetime", "8"]);
    let _zb = s.ztunnel(s.b, &[]);
    flows::assert_ok(&s.flow());
    let issued = std::time::Instant::now();
    s.istiod.set_down(true);
    // Past a1's expiry (with margin for the CA's clock skew allowance of
    // none: the fake sets not_after = now + validity).
    std::thread::sleep(Duration::from_secs(9).saturating_sub(issued.elapsed()));
    let refused = s.flow();
    assert!(
        !refused.stdout.contains("RESULT ok"),
        "a1 reached b1 with an expired certificate: {refused:?}"
    );
    za.wait_for_log(
        "certificate expired and not renewed",
        Duration::from_secs(5),
    );
    s.istiod.set_down(false);
    za.wait_for_log(
        "certificate renewed by the Istio CA",
        Duration::from_secs(90),
    );
    flows::assert_ok(&s.flow());
}
