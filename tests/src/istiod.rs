//! A fake istiod: Istio's certificate service (`IstioCertificateService`)
//! and delta ADS ([`crate::ads`]),
//! over gRPC with TLS, inside a test namespace, checking what istiod checks
//! (the bearer token, the impersonated identity against the CSR's SAN) and
//! recording every request. Its root signs both its own TLS certificate
//! (IP SAN: its address) and the workload certificates, as istiod's
//! self-signed CA does. It can be taken down, and made to sign a wrong SAN,
//! to test ztunnel's side of failures.

use std::{
    net::{Ipv4Addr, SocketAddr},
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, SystemTime},
};

use ztunnel::proto::istio_ca::{
    IstioCertificateRequest, IstioCertificateResponse,
    istio_certificate_service_server::{IstioCertificateService, IstioCertificateServiceServer},
};

use crate::{
    ads::{Ads, XdsState},
    netns::TestNetns,
};
use ztunnel::proto::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;

/// istiod's port for xDS and the CA.
pub const ISTIOD_PORT: u16 = 15012;

/// One `CreateCertificate` call as the fake saw it.
#[derive(Debug, Clone)]
pub struct CsrSeen {
    /// The CSR's URI SAN.
    pub san: Option<String>,
    /// `metadata.ImpersonatedIdentity`.
    pub impersonated: Option<String>,
    /// `authorization` header.
    pub authorization: Option<String>,
    /// `clusterid` header.
    pub cluster_id: Option<String>,
    /// `validity_duration`, seconds.
    pub validity: i64,
    /// Whether a certificate was returned.
    pub granted: bool,
}

/// What the CA does with the next requests.
#[derive(Debug, Default)]
struct Behaviour {
    down: bool,
    wrong_san: bool,
}

#[derive(Default)]
struct Shared {
    seen: Mutex<Vec<CsrSeen>>,
    behaviour: Mutex<Behaviour>,
}

/// The running fake; stops on drop.
pub struct FakeIstiod {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The mesh root, PEM (`root-cert.pem`).
    pub root_cert: PathBuf,
    /// The token file ztunnel sends (`istio-token`).
    pub token_file: PathBuf,
    /// The token it wants.
    pub token: String,
    /// The xDS side: what it serves, what it was asked.
    pub xds: Arc<XdsState>,
    shared: Arc<Shared>,
    /// What a (re)started server serves.
    serving: Serving,
    stop: Option<tokio::sync::watch::Sender<bool>>,
    thread: Option<JoinHandle<()>>,
}

/// Everything a server thread needs; kept so that a restart serves the
/// same root, certificate and state.
#[derive(Clone)]
struct Serving {
    netns: PathBuf,
    addr: SocketAddr,
    identity: tonic::transport::Identity,
    ca: Arc<Ca>,
    ads: Arc<Ads>,
}

struct Ca {
    shared: Arc<Shared>,
    token: String,
    root_pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

#[tonic::async_trait]
impl IstioCertificateService for Ca {
    async fn create_certificate(
        &self,
        request: tonic::Request<IstioCertificateRequest>,
    ) -> Result<tonic::Response<IstioCertificateResponse>, tonic::Status> {
        let header = |name: &str| {
            request
                .metadata()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let (authorization, cluster_id) = (header("authorization"), header("clusterid"));
        let body = request.into_inner();
        let impersonated = body
            .metadata
            .as_ref()
            .and_then(|m| m.fields.get("ImpersonatedIdentity"))
            .and_then(|v| match &v.kind {
                Some(prost_types::value::Kind::StringValue(s)) => Some(s.clone()),
                _ => None,
            });
        let csr = rcgen::CertificateSigningRequestParams::from_pem(&body.csr);
        let san = csr.as_ref().ok().and_then(|c| {
            c.params.subject_alt_names.iter().find_map(|s| match s {
                rcgen::SanType::URI(uri) => Some(uri.as_str().to_owned()),
                _ => None,
            })
        });
        let mut seen = CsrSeen {
            san: san.clone(),
            impersonated,
            authorization,
            cluster_id,
            validity: body.validity_duration,
            granted: false,
        };
        let answer = self.answer(
            csr,
            san,
            seen.impersonated.as_deref(),
            seen.authorization.as_deref(),
            body.validity_duration,
        );
        seen.granted = answer.is_ok();
        self.shared.seen.lock().expect("seen").push(seen);
        answer.map(tonic::Response::new)
    }
}

impl Ca {
    fn answer(
        &self,
        csr: Result<rcgen::CertificateSigningRequestParams, rcgen::Error>,
        san: Option<String>,
        impersonated: Option<&str>,
        authorization: Option<&str>,
        validity: i64,
    ) -> Result<IstioCertificateResponse, tonic::Status> {
        let (down, wrong_san) = {
            let b = self.shared.behaviour.lock().expect("behaviour");
            (b.down, b.wrong_san)
        };
        if down {
            return Err(tonic::Status::unavailable("fake istiod: CA is down"));
        }
        if authorization != Some(format!("Bearer {}", self.token).as_str()) {
            return Err(tonic::Status::unauthenticated("fake istiod: bad token"));
        }
        let mut csr =
            csr.map_err(|e| tonic::Status::invalid_argument(format!("CSR does not parse: {e}")))?;
        let Some(san) = san else {
            return Err(tonic::Status::invalid_argument("CSR has no URI SAN"));
        };
        // istiod signs for the impersonated identity only when the CSR asks
        // for exactly that one.
        if impersonated.is_some_and(|i| i != san) {
            return Err(tonic::Status::permission_denied(
                "impersonated identity differs from the CSR",
            ));
        }
        let signed_san = if wrong_san {
            san.replace("/ns/", "/ns/intruder-")
        } else {
            san
        };
        let params = &mut csr.params;
        params.subject_alt_names = vec![rcgen::SanType::URI(
            signed_san
                .try_into()
                .map_err(|_| tonic::Status::invalid_argument("SAN"))?,
        )];
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::DigitalSignature,
            rcgen::KeyUsagePurpose::KeyEncipherment,
        ];
        params.use_authority_key_identifier_extension = true;
        let now = SystemTime::now();
        let validity = Duration::from_secs(u64::try_from(validity.max(1)).unwrap_or(1));
        params.not_before = (now - Duration::from_secs(60)).into();
        params.not_after = (now + validity).into();
        let leaf = csr
            .signed_by(&self.issuer)
            .map_err(|e| tonic::Status::internal(format!("signing: {e}")))?;
        Ok(IstioCertificateResponse {
            cert_chain: vec![leaf.pem(), self.root_pem.clone()],
        })
    }
}

impl FakeIstiod {
    /// Starts on `ip:15012` inside `netns` (which must hold `ip`), writing
    /// `root-cert.pem` and `istio-token` into `dir`.
    pub fn start(netns: &TestNetns, ip: Ipv4Addr, dir: &Path) -> Self {
        let root_key = rcgen::KeyPair::generate().expect("root key");
        let mut root_params = rcgen::CertificateParams::new(Vec::new()).expect("root params");
        root_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        root_params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        root_params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "cluster.local");
        root_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "fake istiod root");
        let root = root_params.self_signed(&root_key).expect("root cert");
        let issuer = rcgen::Issuer::new(root_params, root_key);

        let server_key = rcgen::KeyPair::generate().expect("server key");
        let mut server_params = rcgen::CertificateParams::new(Vec::new()).expect("params");
        server_params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress(ip.into()));
        server_params
            .subject_alt_names
            .push(rcgen::SanType::DnsName(
                "istiod.istio-system.svc".try_into().expect("dns"),
            ));
        let server_cert = server_params
            .signed_by(&server_key, &issuer)
            .expect("server cert");

        std::fs::create_dir_all(dir).expect("istiod dir");
        let root_cert = dir.join("root-cert.pem");
        std::fs::write(&root_cert, root.pem()).expect("write root");
        let token = format!("istio-token-{}", std::process::id());
        let token_file = dir.join("istio-token");
        std::fs::write(&token_file, format!("{token}\n")).expect("write token");

        let shared = Arc::new(Shared::default());
        let ca = Ca {
            shared: Arc::clone(&shared),
            token: token.clone(),
            root_pem: root.pem(),
            issuer,
        };
        let xds = Arc::new(XdsState::default());
        let ads = Ads {
            state: Arc::clone(&xds),
            token: token.clone(),
        };
        let identity = tonic::transport::Identity::from_pem(
            format!("{}{}", server_cert.pem(), root.pem()),
            server_key.serialize_pem(),
        );
        let addr = SocketAddr::from((ip, ISTIOD_PORT));
        let serving = Serving {
            netns: netns.path(),
            addr,
            identity,
            ca: Arc::new(ca),
            ads: Arc::new(ads),
        };
        let (stop, thread) = serve(serving.clone());
        Self {
            addr,
            root_cert,
            token_file,
            token,
            xds,
            shared,
            serving,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Stops serving (open streams are cut, new connections refused), stays
    /// down for `down`, then serves again on the same address with the same
    /// root, certificate, token and resources: an istiod restart.
    pub fn restart(&mut self, down: Duration) {
        self.halt();
        std::thread::sleep(down);
        let (stop, thread) = serve(self.serving.clone());
        self.stop = Some(stop);
        self.thread = Some(thread);
    }

    fn halt(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            eprintln!("cleanup: the fake istiod's thread panicked");
        }
    }

    /// Starts on a new node `istiod` of `cluster` (its scratch folder
    /// holds the root and token).
    pub fn on_new_node(cluster: &mut crate::Cluster) -> Self {
        let node = cluster.add_node("istiod");
        Self::start(
            cluster.node(node).netns(),
            cluster.node(node).ip,
            &cluster.dir().join("istiod"),
        )
    }

    /// ztunnel's flags for this CA (cluster id `test-cluster`).
    pub fn ztunnel_args(&self) -> Vec<String> {
        vec![
            "--ca-address".into(),
            self.addr.to_string(),
            "--ca-root-cert".into(),
            self.root_cert.display().to_string(),
            "--auth-token".into(),
            self.token_file.display().to_string(),
            "--cluster-id".into(),
            "test-cluster".into(),
        ]
    }

    /// ztunnel's flags for this istiod's xDS (with [`Self::ztunnel_args`],
    /// which carry the token and cluster id).
    pub fn xds_args(&self) -> Vec<String> {
        vec![
            "--xds-address".into(),
            self.addr.to_string(),
            "--xds-root-cert".into(),
            self.root_cert.display().to_string(),
        ]
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<CsrSeen> {
        self.shared.seen.lock().expect("seen").clone()
    }

    /// Granted requests for `san`.
    pub fn granted(&self, san: &str) -> usize {
        self.requests()
            .iter()
            .filter(|r| r.granted && r.san.as_deref() == Some(san))
            .count()
    }

    /// Refused requests so far.
    pub fn refused(&self) -> usize {
        self.requests().iter().filter(|r| !r.granted).count()
    }

    /// Answers `UNAVAILABLE` while `down`.
    pub fn set_down(&self, down: bool) {
        self.shared.behaviour.lock().expect("behaviour").down = down;
    }

    /// Signs a different identity than the CSR's while `wrong`.
    pub fn set_wrong_san(&self, wrong: bool) {
        self.shared.behaviour.lock().expect("behaviour").wrong_san = wrong;
    }
}

impl Drop for FakeIstiod {
    fn drop(&mut self) {
        self.halt();
    }
}

/// Runs the gRPC server on its own thread inside the namespace until the
/// returned sender says stop; returns once it listens. A stop cuts what is
/// open: streams get at most a second to end on their own, as when the
/// process goes away.
fn serve(serving: Serving) -> (tokio::sync::watch::Sender<bool>, JoinHandle<()>) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    let ns = std::fs::File::open(&serving.netns).expect("open netns");
    let thread = std::thread::spawn(move || {
        // The listener is made inside the namespace; the runtime runs on
        // this thread only.
        nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
            .expect("enter istiod's namespace");
        let listener = bind_retrying(serving.addr);
        listener.set_nonblocking(true).expect("nonblocking");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            bound_tx.send(()).expect("report bound");
            let (mut graceful, mut hard) = (stop_rx.clone(), stop_rx);
            let served = tonic::transport::Server::builder()
                .tls_config(tonic::transport::ServerTlsConfig::new().identity(serving.identity))
                .expect("server TLS")
                .timeout(Duration::from_secs(10))
                .add_service(IstioCertificateServiceServer::from_arc(serving.ca))
                .add_service(AggregatedDiscoveryServiceServer::from_arc(serving.ads))
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = graceful.wait_for(|stop| *stop).await;
                });
            tokio::select! {
                served = served => {
                    if let Err(e) = served {
                        eprintln!("fake istiod stopped: {e}");
                    }
                }
                () = async move {
                    let _ = hard.wait_for(|stop| *stop).await;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                } => {}
            }
        });
    });
    bound_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("fake istiod listening");
    (stop_tx, thread)
}

/// Binds `addr`, retrying for up to 5 s while a previous server's socket
/// still holds it.
fn bind_retrying(addr: SocketAddr) -> std::net::TcpListener {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match std::net::TcpListener::bind(addr) {
            Ok(listener) => return listener,
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("fake istiod: bind {addr}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("bind fake istiod on {addr}: {e}"),
        }
    }
}
