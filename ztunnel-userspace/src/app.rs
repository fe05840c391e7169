//! The daemon: wires the parts together and runs until a signal.
//!
//! Start-up: probe and load the kernel programs (maps pinned), attach the
//! cgroup programs (or take over pinned ones), write the exclusions, enrol
//! this node's pods from the config file, start the enrolment socket and the
//! config watcher. After `reconcile_grace`, kernel state an earlier ztunnel
//! left for pods that nobody re-enrolled is removed.
//!
//! Shutdown (SIGTERM/SIGINT): stop accepting. With `cleanup`, or when no pod
//! is enrolled, every attachment and pin is removed; otherwise they stay so
//! that enrolled pods fail closed until the next ztunnel takes over.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use crate::{
    bpffs::{BpffsError, PinRoot},
    capture::{self, CaptureError, maps::Exclusions, tc::TcMode},
    cgroup::{self, CgroupError},
    enrol::{self, EnrolError, EnrolRequest, PodRegistry, Source, zds::ZdsError},
    hbone::pool::{HbonePool, PoolSettings},
    identity::{CertManager, Identity, ca::CertificateAuthority, istio_ca::IstioCaSettings},
    loader::{self, LoaderError},
    netns::PodNetns,
    proxy::Shared,
    state::{
        MeshState, StateHandle,
        local::{self, ConfigError, LocalConfig},
    },
};

/// Everything the daemon is configured with (built from flags by `main`).
// Each bool is an independent `on|off` flag of the command line; enums
// would only rename them.
#[allow(clippy::struct_excessive_bools)]
#[derive(Debug, Clone)]
pub struct Settings {
    /// cgroup v2 directory for the connect/sock_ops programs (None: the root).
    pub cgroup: Option<PathBuf>,
    /// Pin folder on bpffs.
    pub bpffs: PathBuf,
    /// sk_msg acceleration of pod-local legs.
    pub sockmap: bool,
    /// A pod's share of the kernel's pending-connect records
    /// (`--max-pod-pending-connects`).
    pub max_pod_pending_connects: u32,
    /// Pipes for splicing streaming directions of TCP-to-TCP relays (0:
    /// never; ignored while `sockmap` is on).
    pub splice_pipes: usize,
    /// Of those, pipes one pod's relays may hold at once.
    pub splice_pipes_per_pod: usize,
    /// How to attach TC programs.
    pub tc_mode: TcMode,
    /// Remove every attachment and pin on shutdown.
    pub cleanup: bool,
    /// Local-mode config file.
    pub config: Option<PathBuf>,
    /// istiod's xDS instead of the config file.
    pub xds: Option<Xds>,
    /// Overrides the config's trust domain.
    pub trust_domain: Option<String>,
    /// This node's name (workloads with this `node` are enrolled).
    pub node_name: String,
    /// Capture exclusions.
    pub exclusions: Exclusions,
    /// Enrolment socket path ztunnel listens on (None: disabled).
    pub enrol_socket: Option<PathBuf>,
    /// Who besides root may use the enrolment socket.
    pub enrol_peers: enrol::zds::AllowedPeers,
    /// Records of the pods ztunnel-cni enrolled, enrolled again at start
    /// (None: not read).
    pub cni_state_dir: Option<PathBuf>,
    /// Istio's node agent socket, which ztunnel dials (None: disabled).
    pub node_agent_socket: Option<PathBuf>,
    /// How long to wait for pods to be re-enrolled before removing the
    /// kernel state an earlier ztunnel left for them.
    pub reconcile_grace: Duration,
    /// Data-plane worker threads.
    pub worker_threads: usize,
    /// Where workload certificates come from.
    pub ca: CaSource,
    /// Lifetime of issued workload certificates.
    pub cert_lifetime: Duration,
    /// Idle pooled HBONE connections are closed after this long.
    pub pool_idle_timeout: Duration,
    /// Connections between two pods of this node skip TLS (identities and
    /// policy still apply).
    pub local_fastpath: bool,
    /// Admin, metrics and readiness addresses.
    pub admin: crate::admin::Addresses,
    /// eBPF (default) or iptables capture.
    pub capture: crate::capture::Backend,
    /// How long open connections may run after SIGTERM.
    pub drain_timeout: Duration,
    /// Limits on each phase where a peer can stall a connection.
    pub timeouts: crate::timeouts::Timeouts,
    /// Limits on connections, handshakes and enrolment clients.
    pub limits: crate::limits::Limits,
}

/// Where workload certificates come from.
#[derive(Debug, Clone)]
pub enum CaSource {
    /// The built-in development CA, kept in this folder (shared by every
    /// node of a local-mode mesh, generated on first use).
    Development(PathBuf),
    /// A CA certificate and key; with `root`, the certificate is an
    /// intermediate and `root` the trust anchor.
    Files {
        /// Signing certificate (PEM).
        cert: PathBuf,
        /// Its private key (PEM).
        key: PathBuf,
        /// Root, when `cert` is an intermediate.
        root: Option<PathBuf>,
    },
    /// Istio's CA (istiod): certificates are asked for, no CA key is on
    /// the node.
    Istio(IstioCa),
}

/// How to reach istiod's xDS, and who ztunnel is to it.
#[derive(Debug, Clone)]
pub struct Xds {
    /// Address, root, credentials, node id and metadata.
    pub settings: crate::xds::XdsSettings,
}

/// How to reach Istio's CA, and who ztunnel is to it.
#[derive(Debug, Clone)]
pub struct IstioCa {
    /// `host:port`.
    pub address: String,
    /// Root certificate(s): istiod's TLS and the mesh's trust anchors.
    pub root_cert: PathBuf,
    /// Bearer token file.
    pub token: PathBuf,
    /// Cluster id (`clusterid`).
    pub cluster_id: String,
    /// ztunnel's own namespace.
    pub namespace: String,
    /// ztunnel's own service account.
    pub service_account: String,
}

/// Why the daemon stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// cgroup trouble.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// bpffs trouble.
    #[error(transparent)]
    Bpffs(#[from] BpffsError),
    /// Loading trouble.
    #[error(transparent)]
    Loader(#[from] Box<LoaderError>),
    /// Attaching trouble.
    #[error(transparent)]
    Capture(#[from] Box<CaptureError>),
    /// The initial config is bad.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Enrolment trouble.
    #[error(transparent)]
    Enrol(#[from] Box<EnrolError>),
    /// Enrolment socket trouble.
    #[error(transparent)]
    Zds(#[from] ZdsError),
    /// Runtime trouble.
    #[error("runtime: {0}")]
    Io(#[from] std::io::Error),
    /// The CA could not be loaded or created.
    #[error(transparent)]
    Identity(#[from] crate::identity::IdentityError),
    /// The admin servers could not start.
    #[error(transparent)]
    Admin(#[from] crate::admin::AdminError),
    /// The xDS client could not be set up.
    #[error(transparent)]
    Xds(#[from] crate::xds::XdsError),
}

/// Runs the daemon until SIGTERM/SIGINT, then drains.
pub fn run(settings: &Settings, log_control: crate::admin::LogControl) -> Result<(), AppError> {
    if let (Some(listen), Some(dial)) = (&settings.enrol_socket, &settings.node_agent_socket)
        && listen == dial
    {
        return Err(AppError::Zds(ZdsError::Refused(format!(
            "--enrol-socket and --node-agent-socket are both {}: ztunnel cannot listen where \
             the node agent listens; give --enrol-socket another path",
            listen.display()
        ))));
    }
    // With istio-cni capturing, ztunnel touches neither cgroups nor bpffs:
    // it needs no BPF capability and no mount of either.
    let kernel = settings.capture != capture::Backend::IstioCni;
    let cgroup_dir = match &settings.cgroup {
        Some(dir) => dir.clone(),
        None if kernel => cgroup::cgroup2_mount()?,
        None => PathBuf::new(),
    };
    if kernel {
        cgroup::validate(&cgroup_dir)?;
    }
    // Read the config before touching the kernel: a bad file must not leave
    // half a setup behind.
    let mut initial = settings.config.as_deref().map(local::load).transpose()?;
    if let (Some(config), Some(td)) = (initial.as_mut(), &settings.trust_domain) {
        config.trust_domain.clone_from(td);
    }
    let trust_domain = initial.as_ref().map_or_else(
        || local::DEFAULT_TRUST_DOMAIN.to_owned(),
        |c| c.trust_domain.clone(),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(settings.worker_threads.max(1))
        .thread_name("dataplane")
        .enable_all()
        .build()?;
    let certs = Arc::new(match &settings.ca {
        CaSource::Development(dir) => CertManager::new(
            CertificateAuthority::development(dir, &trust_domain)?,
            settings.cert_lifetime,
        ),
        CaSource::Files { cert, key, root } => CertManager::new(
            CertificateAuthority::from_files(cert, key, root.as_deref())?,
            settings.cert_lifetime,
        ),
        CaSource::Istio(istio) => {
            let own_identity =
                Identity::new(&trust_domain, &istio.namespace, &istio.service_account);
            // The gRPC channel and the request tasks live on the runtime.
            let _in_runtime = runtime.enter();
            let client = crate::identity::istio_ca::IstioCa::new(IstioCaSettings {
                address: istio.address.clone(),
                root_cert: istio.root_cert.clone(),
                token: istio.token.clone(),
                cluster_id: istio.cluster_id.clone(),
                own_identity: own_identity.clone(),
                ttl: settings.cert_lifetime,
            })?;
            tracing::info!(
                ca = %istio.address,
                server_name = client.server_name(),
                root = %istio.root_cert.display(),
                identity = %own_identity,
                "workload certificates come from the Istio CA (no CA key on this node)"
            );
            CertManager::istio(client, settings.cert_lifetime)?
        }
    });
    // Checked before the kernel is touched, like the config file.
    let xds = match &settings.xds {
        Some(xds) => {
            let _in_runtime = runtime.enter();
            let mut xds_settings = xds.settings.clone();
            xds_settings.trust_domain.clone_from(&trust_domain);
            let client = crate::xds::XdsClient::new(xds_settings)?;
            tracing::info!(
                xds = %xds.settings.address,
                server_name = client.server_name(),
                node_id = %xds.settings.node_id,
                "workloads, services and policies come from istiod (xDS)"
            );
            Some(client)
        }
        None => None,
    };
    let mut base = initial.clone().unwrap_or_default();
    base.trust_domain.clone_from(&trust_domain);
    // Run from istiod, ztunnel refuses every connection until istiod's
    // first push (an empty state would pass meshed traffic in clear).
    let initial_state = if settings.xds.is_some() {
        MeshState::awaiting_control_plane(base)
    } else {
        MeshState::new(base)
    };
    let state = StateHandle::for_node(initial_state, &settings.node_name);
    let metrics = crate::telemetry::Metrics::new();
    let limits = crate::limits::NodeLimits::new(settings.limits, Arc::clone(&metrics));
    // A socket in the sockhash receives redirected bytes in a queue of its
    // own, which splice (it reads the TCP receive queue) would miss.
    let pipes = (settings.splice_pipes > 0 && !settings.sockmap).then(|| {
        crate::proxy::relay::Pipes::new(
            settings.splice_pipes,
            settings.splice_pipes_per_pod,
            Arc::clone(&metrics),
        )
    });
    let shared = Shared {
        state: state.clone(),
        connections: Arc::default(),
        certs: Arc::clone(&certs),
        pool: Arc::new(HbonePool::new(
            certs,
            PoolSettings {
                idle_timeout: settings.pool_idle_timeout,
                timeouts: settings.timeouts,
            },
            Arc::clone(&metrics),
        )),
        local_pods: settings.local_fastpath.then(Default::default),
        metrics,
        draining: Arc::new(tokio::sync::watch::channel(false).0),
        timeouts: settings.timeouts,
        limits,
        pipes,
    };

    let pins = if kernel {
        PinRoot::prepare(&settings.bpffs)?
    } else {
        PinRoot::unused(&settings.bpffs)
    };
    let mut programs = if kernel {
        Some(loader::load(&pins).map_err(Box::new)?)
    } else {
        None
    };
    if let Some(programs) = programs
        .as_mut()
        .filter(|_| settings.capture == capture::Backend::Ebpf)
    {
        // Before anything is attached: a mode the kernel lacks is a start-up
        // error, not a failure of every pod's enrolment later.
        settings.tc_mode.check().map_err(Box::new)?;
        let attached = capture::cgroup::attach(
            &mut programs.ebpf,
            &pins,
            &cgroup_dir,
            capture::cgroup::KernelSettings {
                sockmap: settings.sockmap,
                max_pod_pending: settings.max_pod_pending_connects,
            },
        )
        .map_err(Box::new)?;
        capture::maps::set_exclusions(&mut programs.ebpf, &settings.exclusions)
            .map_err(Box::new)?;
        tracing::info!(
            cgroup = %attached.cgroup.display(),
            took_over = attached.took_over,
            sockmap = settings.sockmap,
            tc_mode = ?settings.tc_mode.resolve(),
            "capture programs attached"
        );
    } else if settings.capture == capture::Backend::Iptables {
        // The programs are loaded (their maps back the counters and the
        // dump) but nothing is attached: pods get iptables rules instead.
        tracing::info!("capture backend: iptables (REDIRECT rules in each pod)");
    } else {
        tracing::info!(
            "capture backend: istio-cni (its rules in each pod; ztunnel loads no eBPF and attaches nothing)"
        );
    }

    let registry = Arc::new(
        PodRegistry::new(
            programs,
            pins.clone(),
            settings.tc_mode,
            runtime.handle().clone(),
            shared,
            settings.capture,
            settings.exclusions.clone(),
        )
        .map_err(Box::new)?,
    );

    let xds_status = xds.as_ref().map(crate::xds::XdsClient::status);
    let xds_synced = xds.map(|client| {
        let (synced, watch) = tokio::sync::watch::channel(false);
        runtime.spawn(client.run(
            xds_publisher(Arc::clone(&registry), settings.node_name.clone()),
            synced,
        ));
        watch
    });

    // Dialled before readiness is served: readiness waits for its snapshot.
    let node_agent = match &settings.node_agent_socket {
        Some(path) => {
            tracing::info!(socket = %path.display(), "dialling the node agent (ZDS)");
            Some(enrol::zds::node_agent::start(
                path.clone(),
                Arc::clone(&registry),
            )?)
        }
        None => None,
    };
    let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let metrics = Arc::clone(&registry.shared().metrics);
    crate::admin::start(
        settings.admin,
        Arc::new(crate::admin::AdminState {
            registry: Arc::clone(&registry),
            metrics: Arc::clone(&metrics),
            ready: Arc::clone(&ready),
            log_control,
            cgroup: cgroup_dir.clone(),
            node_agent: node_agent.clone(),
            xds: xds_status,
        }),
    )?;
    if let Some(config) = &initial {
        apply_config(&registry, config, &settings.node_name);
    }
    if let Some(path) = &settings.config {
        watch_config(
            path.clone(),
            Arc::clone(&registry),
            settings.node_name.clone(),
            settings.trust_domain.clone(),
        );
    }
    if let Some(dir) = &settings.cni_state_dir {
        replay_pod_records(&registry, dir);
    }
    let socket_file = match &settings.enrol_socket {
        Some(socket) => {
            let file =
                enrol::zds::serve(socket, Arc::clone(&registry), settings.enrol_peers.clone())?;
            tracing::info!(socket = %socket.display(), "enrolment socket listening");
            Some(file)
        }
        None => None,
    };
    {
        let registry = Arc::clone(&registry);
        let grace = settings.reconcile_grace;
        let node_agent = node_agent.clone();
        std::thread::spawn(move || {
            // The node agent's pods are known only once its snapshot is in:
            // until then their kernel state (fail closed) is not stale.
            if let Some(agent) = &node_agent {
                while !agent.synced() {
                    if *registry.shared().draining.borrow() {
                        return;
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
            std::thread::sleep(grace);
            match registry.remove_stale_kernel_state() {
                Ok(removed) => tracing::debug!(removed, "stale kernel state check done"),
                Err(e) => tracing::warn!(error = %e, "removing stale kernel state failed"),
            }
        });
    }
    // Signal handlers go in before "ready": a SIGTERM right after start-up
    // must drain and clean up, not kill the process.
    let (mut term, mut int) = {
        let _guard = runtime.enter();
        (
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?,
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?,
        )
    };
    // Programs attached, pods enrolled (their certificates issued on
    // enrolment), first config applied; with xDS, once istiod's first
    // workloads and policies are in (a ztunnel that knows no policy yet
    // must not be sent traffic).
    let becoming_ready = match xds_synced {
        None => {
            crate::admin::set_ready(&ready, true);
            tracing::info!("ztunnel ready");
            None
        }
        Some(mut synced) => {
            tracing::info!(
                "waiting for istiod's first workloads and policies before reporting ready"
            );
            let ready = Arc::clone(&ready);
            Some(runtime.spawn(async move {
                if synced.wait_for(|s| *s).await.is_ok() {
                    crate::admin::set_ready(&ready, true);
                    tracing::info!("ztunnel ready");
                }
            }))
        }
    };
    crate::memory::release_startup_heap();
    runtime.block_on(async {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    });

    // Drain: stop accepting, let open connections finish until the
    // deadline; a second signal exits at once.
    if let Some(task) = becoming_ready {
        task.abort();
    }
    crate::admin::set_ready(&ready, false);
    registry.stop_listeners();
    registry.shared().draining.send_replace(true);
    tracing::info!(
        deadline_s = settings.drain_timeout.as_secs(),
        active = metrics.active_connections(),
        "draining"
    );
    let deadline = tokio::time::Instant::now() + settings.drain_timeout;
    runtime.block_on(async {
        loop {
            if metrics.active_connections() <= 0 {
                tracing::info!("drained: no connection left");
                break;
            }
            tokio::select! {
                _ = int.recv() => std::process::exit(0),
                _ = term.recv() => {
                    tracing::warn!("second signal during drain: exiting now");
                    std::process::exit(0);
                }
                () = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(active = metrics.active_connections(), "drain deadline reached: closing the rest");
                    break;
                }
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    });
    tracing::info!("shutting down");
    // The old half of an upgrade: a newer ztunnel took over the programs
    // (and opened its listeners beside ours). Everything pinned, every map
    // entry, pod routing and the socket file are its now.
    let superseded = registry
        .with_programs(|p| capture::cgroup::superseded(&p.ebpf, &pins))
        .ok()
        .flatten()
        == Some(true);
    if superseded {
        tracing::info!(
            "another ztunnel has taken over: leaving every attachment, pin and the enrolment socket to it"
        );
        runtime.shutdown_timeout(Duration::from_secs(1));
        return Ok(());
    }
    if let Some(file) = &socket_file {
        file.remove_if_ours();
    }
    if !kernel {
        registry.remove_all().map_err(Box::new)?;
    } else if settings.cleanup || registry.is_empty() {
        registry.remove_all().map_err(Box::new)?;
        capture::cgroup::unpin(&pins).map_err(Box::new)?;
        drop(registry);
        pins.remove_all()?;
        tracing::info!(bpffs = %settings.bpffs.display(), "removed every attachment and pin");
    } else {
        tracing::info!(
            pods = registry.len(),
            "leaving attachments pinned: enrolled pods fail closed until ztunnel is back"
        );
    }
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// What the xDS client does with each new state: publishes it (closing
/// open connections it no longer allows), and keeps certificates for the
/// identities of this node's meshed workloads as istiod lists them, not
/// only once a pod connects; an identity istiod no longer lists for this
/// node is dropped unless an enrolled pod still has it.
fn xds_publisher(
    registry: Arc<PodRegistry>,
    node: String,
) -> impl Fn(LocalConfig) + Send + Sync + 'static {
    let listed: std::sync::Mutex<HashSet<Identity>> = std::sync::Mutex::default();
    move |config| {
        let state = MeshState::new(config);
        let shared = registry.shared();
        let wanted: HashSet<Identity> = state
            .config()
            .workloads
            .iter()
            .filter(|w| w.node == node && w.protocol == crate::state::WorkloadProtocol::Hbone)
            .map(|w| state.identity(w))
            .collect();
        for identity in &wanted {
            shared.certs.prefetch(identity);
        }
        {
            let mut listed = listed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for gone in listed.difference(&wanted) {
                if !registry.identity_in_use(gone) && shared.certs.forget(gone) {
                    tracing::info!(identity = %gone, "certificate dropped: istiod lists no workload of this node with it");
                }
            }
            *listed = wanted;
        }
        let closed = shared.publish_state(state);
        if closed > 0 {
            tracing::info!(closed, "open connections closed by the new policy");
        }
        registry.withdraw_addresses();
    }
}

/// Enrols this node's pods from `config` and removes config pods that are
/// gone. Problems with one pod are logged and do not stop the others.
pub fn apply_config(registry: &PodRegistry, config: &LocalConfig, node: &str) {
    let mut keep = HashSet::new();
    for w in config.workloads.iter().filter(|w| w.node == node) {
        let Some(path) = &w.netns else { continue };
        keep.insert(w.uid.clone());
        let netns = match PodNetns::open(path) {
            Ok(ns) => ns,
            Err(e) => {
                tracing::error!(pod = %w.uid, error = %e, "cannot enrol pod");
                continue;
            }
        };
        let request = EnrolRequest {
            uid: w.uid.clone(),
            netns,
            capture: w.capture,
            identity: Identity::new(&config.trust_domain, &w.namespace, &w.service_account),
            source: Source::Config,
        };
        if let Err(e) = registry.enrol(request) {
            tracing::error!(pod = %w.uid, error = %e, "cannot enrol pod");
        }
    }
    match registry.reconcile(Source::Config, &keep) {
        Ok(removed) if !removed.is_empty() => tracing::info!(?removed, "pods removed from config"),
        Ok(_) => {}
        Err(e) => tracing::error!(error = %e, "reconciling config pods failed"),
    }
}

/// Enrols again the pods ztunnel-cni recorded (`enrol::pod_record`), so
/// that a restart keeps them captured; they count as enrolled over the
/// socket. A record whose network namespace is gone is deleted (the pod
/// is); one that cannot be read or enrolled is logged, and such a pod keeps
/// whatever capture an earlier ztunnel left (fail closed).
fn replay_pod_records(registry: &PodRegistry, dir: &Path) {
    use crate::enrol::pod_record;
    let records = pod_record::read_all(dir);
    if records.is_empty() {
        return;
    }
    let (mut enrolled, mut gone, mut failed) = (0, 0, 0);
    for record in records {
        let record = match record {
            Ok(record) => record,
            Err(e) => {
                failed += 1;
                tracing::error!(error = %e, "cannot read a pod record");
                continue;
            }
        };
        let uid = record.uid.clone();
        if !record.netns.exists() {
            gone += 1;
            tracing::info!(pod = %uid, netns = %record.netns.display(), "recorded pod's network namespace is gone: record removed");
            let _ = pod_record::remove(dir, &uid);
            continue;
        }
        let outcome = PodNetns::open(&record.netns)
            .map_err(|e| e.to_string())
            .and_then(|netns| {
                registry.name_pod(
                    &uid,
                    &record.namespace,
                    &record.name,
                    &record.service_account,
                );
                let identity = registry
                    .identity_for(&uid, &record.namespace, &record.service_account)
                    .ok_or_else(|| "no identity (namespace or service account empty)".to_owned())?;
                registry
                    .enrol(EnrolRequest {
                        uid: uid.clone(),
                        netns,
                        capture: crate::state::CaptureOptOut::default(),
                        identity,
                        source: Source::Socket,
                    })
                    .map_err(|e| e.to_string())
            });
        match outcome {
            Ok(_) => enrolled += 1,
            Err(e) => {
                failed += 1;
                tracing::error!(pod = %uid, record = %dir.display(), error = %e, "cannot enrol a recorded pod again");
            }
        }
    }
    tracing::info!(enrolled, gone, failed, dir = %dir.display(), "pods recorded by ztunnel-cni enrolled again");
}

/// How often the config file is read for changes.
const CONFIG_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// After a change is seen, the file is read again this much later and only
/// taken when both reads agree: a writer that truncates and then writes
/// (`cat >`, most editors) is usually done by then, so a half-written file
/// is rarely even parsed. Short, because it delays every reload.
const CONFIG_SETTLE_DELAY: Duration = Duration::from_millis(200);

/// What one read of the config file saw: its text, or why it could not be
/// read (compared between polls, so one problem is logged once).
type ConfigRead = Result<String, String>;

fn read_config(path: &Path) -> ConfigRead {
    std::fs::read_to_string(path).map_err(|e| e.to_string())
}

/// Polls the config file; a changed, valid file is applied. A file that
/// cannot be read, is empty, does not parse or fails validation is rejected
/// (logged once with the file and the problem, and counted in
/// `ztunnel_config_reloads_total{result="rejected",reason=...}`) and the last
/// good state is kept: pods are removed only when a valid document no longer
/// lists them.
fn watch_config(
    path: PathBuf,
    registry: Arc<PodRegistry>,
    node: String,
    trust_domain: Option<String>,
) {
    let stamp = |p: &Path| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH)
    };
    let mut last = stamp(&path);
    let mut last_read = read_config(&path);
    std::thread::Builder::new()
        .name("config-watch".into())
        .spawn(move || {
            let mut last_retry = Instant::now();
            loop {
                std::thread::sleep(CONFIG_POLL_INTERVAL);
                // A draining process changes no enrolment any more: during
                // an upgrade its successor owns the pods' kernel state, and
                // an enrolment from here would take its listeners' place.
                if *registry.shared().draining.borrow() {
                    tracing::debug!("draining: config no longer watched");
                    return;
                }
                let now = stamp(&path);
                let read = read_config(&path);
                if now == last && read == last_read {
                    if registry.failed(Source::Config) > 0
                        && last_retry.elapsed() >= ENROL_RETRY_INTERVAL
                    {
                        last_retry = Instant::now();
                        retry_failed(&registry, &path, &read, &node, trust_domain.as_deref());
                    }
                    continue;
                }
                std::thread::sleep(CONFIG_SETTLE_DELAY);
                if read_config(&path) != read {
                    // Still being written: look again at the next poll.
                    continue;
                }
                last = now;
                last_read.clone_from(&read);
                let parsed = read
                    .map_err(|e| ConfigError::Read {
                        path: path.clone(),
                        source: std::io::Error::other(e),
                    })
                    .and_then(|text| local::parse(&text, &path));
                reload(&registry, &path, parsed, &node, trust_domain.as_deref());
            }
        })
        .ok();
}

/// How often pods of the config whose enrolment failed are tried again.
const ENROL_RETRY_INTERVAL: Duration = Duration::from_secs(5);

/// Enrols again the config's pods whose enrolment failed (the enrolled ones
/// are untouched: enrolling them again is a no-op).
fn retry_failed(
    registry: &PodRegistry,
    path: &Path,
    read: &ConfigRead,
    node: &str,
    trust_domain: Option<&str>,
) {
    let Ok(text) = read else { return };
    let Ok(mut config) = local::parse(text, path) else {
        return;
    };
    if let Some(td) = trust_domain {
        td.clone_into(&mut config.trust_domain);
    }
    tracing::info!(
        failed = registry.failed(Source::Config),
        "retrying pods whose enrolment failed"
    );
    apply_config(registry, &config, node);
}

/// Applies one reload outcome: a valid config replaces the state (closing
/// open connections it no longer allows) and is enrolled; an error changes
/// nothing and is logged and counted.
fn reload(
    registry: &PodRegistry,
    path: &Path,
    parsed: Result<LocalConfig, ConfigError>,
    node: &str,
    trust_domain: Option<&str>,
) {
    let shared = registry.shared();
    match parsed {
        Ok(mut config) => {
            if let Some(td) = trust_domain {
                td.clone_into(&mut config.trust_domain);
            }
            tracing::info!(config = %path.display(), "config changed: applying");
            let closed = shared.publish_state(MeshState::new(config.clone()));
            if closed > 0 {
                tracing::info!(closed, "open connections closed by the new policy");
            }
            registry.withdraw_addresses();
            shared.metrics.reload(Ok(()));
            apply_config(registry, &config, node);
        }
        Err(e) => {
            shared.metrics.reload(Err(e.kind()));
            tracing::error!(
                config = %path.display(),
                reason = e.kind(),
                error = %e,
                "config change rejected; keeping the last good config"
            );
        }
    }
}
