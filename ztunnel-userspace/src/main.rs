//! The `ztunnel` binary: argument parsing and start-up; everything else is
//! in the library.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context as _, Result};
use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;
use ztunnel::{
    app,
    capture::{self, maps::Cidr},
    enrol::zds::{
        self, AddWorkload, DelWorkload, KeepWorkload, SnapshotSent, WorkloadInfo, WorkloadRequest,
        workload_request::Payload,
    },
    limits, probe, timeouts,
};

/// jemalloc, for the reasons in `ztunnel::memory`.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc reads its settings from this symbol (its own definition is
/// weak) when it initialises, before `main`.
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
static malloc_conf: Option<&'static std::ffi::c_char> =
    // SAFETY: a pointer to the first byte of a 'static C string.
    Some(unsafe { &*ztunnel::memory::JEMALLOC_CONF.as_ptr() });

/// Default pin folder on bpffs.
const DEFAULT_BPFFS: &str = "/sys/fs/bpf/ztunnel";

#[derive(Parser)]
#[command(
    name = "ztunnel",
    version,
    about = "eBPF-accelerated node proxy for sidecar-less service meshes",
    long_about = "ztunnel captures the TCP traffic of enrolled pods with eBPF (cgroup connect \
                  hooks, sock_ops, sk_lookup; no iptables) and carries it between nodes in \
                  HBONE tunnels (mTLS + HTTP/2 CONNECT)."
)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `ztunnel=debug`.
    /// Every directive needs a level; a filter without a default level gets
    /// `info` for the rest, and the access log (target `access`) stays on
    /// unless named (`warn,access=off`).
    #[arg(long, env = "ZTUNNEL_LOG", default_value = "info", global = true)]
    log: String,
    /// Log line format.
    #[arg(long, env = "ZTUNNEL_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node proxy until SIGINT/SIGTERM.
    Run(Box<RunArgs>),
    /// Check that this kernel has every hook ztunnel needs, and exit.
    Probe,
    /// Enrol or remove pods in a running ztunnel over its enrolment socket.
    Enrol(EnrolArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// cgroup v2 directory to attach the connect, getpeername and sock_ops
    /// programs to.
    /// Default: the root of the cgroup v2 hierarchy (from /proc/self/mounts).
    /// Tests pass a cgroup they created; production may use the root.
    #[arg(long, env = "ZTUNNEL_CGROUP")]
    cgroup: Option<PathBuf>,
    /// Folder on bpffs where maps and links are pinned.
    #[arg(long, env = "ZTUNNEL_BPFFS", default_value = DEFAULT_BPFFS)]
    bpffs: PathBuf,
    /// Move payload between an app and its pod's ztunnel listener with
    /// sk_msg/sockhash instead of loopback TCP. Off by default: on current
    /// kernels a socket in a sockhash can return EAGAIN from a blocking
    /// read when another thread writes to it at the same time, which breaks
    /// thread-per-connection applications (event-loop applications are
    /// unaffected). See docs/sockmap.md.
    #[arg(long, env = "ZTUNNEL_SOCKMAP", value_enum, default_value_t = OnOff::Off)]
    sockmap: OnOff,
    /// Let the kernel move the bytes of plain TCP relays (passthrough,
    /// plaintext inbound, the same-node fast path) with splice(2) once a
    /// direction streams, instead of copying them through ztunnel.
    /// Request/response traffic is copied either way. Forced off while
    /// --sockmap is on.
    #[arg(long, env = "ZTUNNEL_SPLICE", value_enum, default_value_t = OnOff::On)]
    splice: OnOff,
    /// Pipes the node's relays may splice with at once (each: two file
    /// descriptors, up to 256 KiB in flight). A streaming direction that
    /// finds none left is copied instead.
    #[arg(long, env = "ZTUNNEL_SPLICE_PIPES", default_value_t = ztunnel::proxy::relay::DEFAULT_PIPES)]
    splice_pipes: usize,
    /// Of those, pipes one pod's relays may hold at once (the client pod of
    /// an outbound or same-node connection, the destination pod of a
    /// plaintext inbound one); past it the pod's streaming directions are
    /// copied (limit="pod_splice_pipes"), so a pod streaming into peers
    /// that never read cannot leave the other pods copying.
    #[arg(long, env = "ZTUNNEL_MAX_POD_SPLICE_PIPES", default_value_t = ztunnel::proxy::relay::DEFAULT_PIPES_PER_POD)]
    max_pod_splice_pipes: usize,
    /// How pods' traffic is captured: the eBPF programs, or iptables
    /// REDIRECT rules inside each pod (the Istio-style fallback and the
    /// benchmark's baseline; needs the iptables commands).
    #[arg(long, env = "ZTUNNEL_CAPTURE", value_enum, default_value_t = capture::Backend::Ebpf)]
    capture: capture::Backend,
    /// How to attach the counting-only TC ingress program: tcx links
    /// (>= 6.6) or clsact filters. Inbound steering is sk_lookup either way.
    #[arg(long, env = "ZTUNNEL_TC_MODE", value_enum, default_value_t = capture::tc::TcMode::Auto)]
    tc_mode: capture::tc::TcMode,
    /// On exit, remove every attachment and pin ztunnel made. Without it
    /// they stay (while pods are enrolled) so that capture fails closed and
    /// a restarted ztunnel takes over without a window. Either way nothing
    /// is removed when another ztunnel has taken over (an upgrade).
    #[arg(long, env = "ZTUNNEL_CLEANUP")]
    cleanup: bool,
    /// Local-mode config file (workloads, services; watched for changes).
    #[arg(long, env = "ZTUNNEL_CONFIG", conflicts_with = "xds_address")]
    config: Option<PathBuf>,
    /// istiod's xDS address, `host:port` (Istio's is
    /// istiod.istio-system.svc:15012). With it ztunnel learns workloads,
    /// services and policies from istiod (delta ADS) and is ready only once
    /// both were received; without it, from --config (local mode).
    #[arg(long, env = "XDS_ADDRESS")]
    xds_address: Option<String>,
    /// Root certificate(s) (PEM) istiod's xDS certificate must chain to.
    #[arg(
        long,
        env = "XDS_ROOT_CA",
        default_value = "/var/run/secrets/istio/root-cert.pem"
    )]
    xds_root_cert: PathBuf,
    /// This ztunnel's pod name (the xDS node id and metadata).
    #[arg(long, env = "POD_NAME", default_value = "ztunnel")]
    pod_name: String,
    /// This ztunnel's pod IP (the xDS node id and `INSTANCE_IPS`).
    #[arg(long, env = "INSTANCE_IP", default_value = "")]
    instance_ip: String,
    /// Trust domain of the mesh; overrides the config file's `trustDomain`.
    #[arg(long, env = "ZTUNNEL_TRUST_DOMAIN")]
    trust_domain: Option<String>,
    /// This node's name: workloads whose `node` matches (and that have a
    /// `netns`) are enrolled.
    #[arg(long, env = "NODE_NAME", default_value = "node")]
    node_name: String,
    /// Outbound destination ports never captured (comma-separated).
    #[arg(long, env = "ZTUNNEL_EXCLUDE_OUTBOUND_PORTS", value_delimiter = ',')]
    exclude_outbound_ports: Vec<u16>,
    /// Outbound destination CIDRs never captured (comma-separated).
    #[arg(long, env = "ZTUNNEL_EXCLUDE_OUTBOUND_CIDRS", value_delimiter = ',')]
    exclude_outbound_cidrs: Vec<Cidr>,
    /// Inbound destination ports never captured (comma-separated).
    #[arg(long, env = "ZTUNNEL_EXCLUDE_INBOUND_PORTS", value_delimiter = ',')]
    exclude_inbound_ports: Vec<u16>,
    /// Inbound source CIDRs never captured, e.g. the node's health-probe
    /// address (comma-separated).
    #[arg(long, env = "ZTUNNEL_EXCLUDE_INBOUND_CIDRS", value_delimiter = ',')]
    exclude_inbound_cidrs: Vec<Cidr>,
    /// Enrolment socket ztunnel listens on (ZDS messages), for the
    /// ztunnel-cni plugin and `ztunnel enrol`. Default
    /// /var/run/ztunnel/ztunnel.sock, except with --capture istio-cni, where
    /// that path is istio-cni's and ztunnel listens on none unless told.
    #[arg(long, env = "ZTUNNEL_ENROL_SOCKET")]
    enrol_socket: Option<PathBuf>,
    /// Uids besides root allowed to use the enrolment socket (checked with
    /// `SO_PEERCRED`; comma-separated). The file itself is mode 0600, so a
    /// uid listed here also needs the file made reachable to it.
    #[arg(long, env = "ZTUNNEL_ENROL_UIDS", value_delimiter = ',')]
    enrol_uid: Vec<u32>,
    /// Folder of the records ztunnel-cni keeps of the pods it enrolled
    /// (its `stateDir`): at start, each pod whose network namespace still
    /// exists is enrolled again, so a restart keeps them captured. Not
    /// read with --capture istio-cni.
    #[arg(long, env = "ZTUNNEL_CNI_STATE_DIR", default_value = ztunnel::enrol::pod_record::DEFAULT_DIR)]
    cni_state_dir: PathBuf,
    /// Istio's node agent (istio-cni) socket, which ztunnel dials to be
    /// given pods (ZDS, as Istio's ztunnel). Default
    /// /var/run/ztunnel/ztunnel.sock with --capture istio-cni, otherwise
    /// none.
    #[arg(long, env = "INPOD_UDS")]
    node_agent_socket: Option<PathBuf>,
    /// Seconds to wait for pods to be re-enrolled after a restart before the
    /// kernel state left for them is removed.
    #[arg(long, env = "ZTUNNEL_RECONCILE_GRACE", default_value_t = 10)]
    reconcile_grace: u64,
    /// Data-plane worker threads.
    #[arg(long, env = "ZTUNNEL_WORKER_THREADS", default_value_t = 2)]
    worker_threads: usize,
    /// Folder of the built-in development CA (created on first use; point
    /// every node of a local-mode mesh at the same one). Ignored with
    /// --ca-cert.
    #[arg(
        long,
        env = "ZTUNNEL_CA_DIR",
        default_value = "/var/lib/ztunnel/dev-ca"
    )]
    ca_dir: PathBuf,
    /// CA certificate (PEM) to issue workload certificates with, instead of
    /// the development CA. Needs --ca-key.
    #[arg(long, env = "ZTUNNEL_CA_CERT", requires = "ca_key")]
    ca_cert: Option<PathBuf>,
    /// Private key (PEM) of --ca-cert.
    #[arg(long, env = "ZTUNNEL_CA_KEY", requires = "ca_cert")]
    ca_key: Option<PathBuf>,
    /// Root certificate (PEM) when --ca-cert is an intermediate.
    #[arg(long, env = "ZTUNNEL_CA_ROOT", requires = "ca_cert")]
    ca_root: Option<PathBuf>,
    /// Istio's CA (istiod) to ask for workload certificates, `host:port`
    /// (Istio's is istiod.istio-system.svc:15012). With it no CA key is
    /// read or kept on this node; without it the local CA above signs.
    #[arg(long, env = "CA_ADDRESS", conflicts_with_all = ["ca_cert", "ca_key", "ca_root"])]
    ca_address: Option<String>,
    /// Root certificate(s) (PEM) istiod's TLS certificate and every
    /// workload certificate must chain to (with --ca-address).
    #[arg(
        long,
        env = "CA_ROOT_CA",
        default_value = "/var/run/secrets/istio/root-cert.pem"
    )]
    ca_root_cert: PathBuf,
    /// Token file sent to istiod as `authorization: Bearer` (read again for
    /// every request: the kubelet rotates it).
    #[arg(
        long,
        env = "AUTH_TOKEN",
        default_value = "/var/run/secrets/tokens/istio-token"
    )]
    auth_token: PathBuf,
    /// Cluster id sent to istiod (`clusterid`).
    #[arg(long, env = "ISTIO_META_CLUSTER_ID", default_value = "Kubernetes")]
    cluster_id: String,
    /// ztunnel's own namespace: with --service-account, its own identity,
    /// for which no impersonation is sent to the CA.
    #[arg(long, env = "POD_NAMESPACE", default_value = "istio-system")]
    pod_namespace: String,
    /// ztunnel's own service account.
    #[arg(long, env = "SERVICE_ACCOUNT", default_value = "ztunnel")]
    service_account: String,
    /// Lifetime of workload certificates: seconds, or a duration such as
    /// `24h` or `24h0m0s` (Istio's SECRET_TTL). Renewed at half-life; values
    /// under a minute are only useful for tests.
    #[arg(long, env = "SECRET_TTL", value_parser = parse_lifetime, default_value = "24h")]
    cert_lifetime: Duration,
    /// Seconds after which an idle pooled HBONE connection is closed.
    #[arg(long, env = "ZTUNNEL_POOL_IDLE_TIMEOUT", default_value_t = 300)]
    pool_idle_timeout: u64,
    /// Carry connections between two pods of this node in-process, without
    /// TLS (both identities are known here; policy still applies).
    #[arg(long, env = "ZTUNNEL_LOCAL_FASTPATH", value_enum, default_value_t = OnOff::On)]
    local_fastpath: OnOff,
    /// Admin server (config dump, logging, healthz); keep it on loopback.
    #[arg(long, env = "ZTUNNEL_ADMIN_ADDR", default_value = "127.0.0.1:15000")]
    admin_addr: std::net::SocketAddr,
    /// Prometheus metrics server.
    #[arg(long, env = "ZTUNNEL_METRICS_ADDR", default_value = "0.0.0.0:15020")]
    metrics_addr: std::net::SocketAddr,
    /// Readiness server (`/healthz/ready`).
    #[arg(long, env = "ZTUNNEL_READINESS_ADDR", default_value = "0.0.0.0:15021")]
    readiness_addr: std::net::SocketAddr,
    /// Seconds open connections may keep running after SIGTERM before they
    /// are closed (a second SIGTERM exits at once).
    #[arg(long, env = "ZTUNNEL_DRAIN_TIMEOUT", default_value_t = 30)]
    drain_timeout: u64,
    /// Milliseconds an upstream TCP connect may take (to a peer's HBONE
    /// port, to an application inside a pod, to a passthrough destination)
    /// before the connection is closed.
    #[arg(long, env = "ZTUNNEL_CONNECT_TIMEOUT_MS", value_parser = positive_ms(), default_value_t = millis(timeouts::DEFAULT_CONNECT))]
    connect_timeout_ms: u64,
    /// Milliseconds a TLS handshake may take, as HBONE client or server
    /// (port 15008), before the connection is closed.
    #[arg(long, env = "ZTUNNEL_TLS_HANDSHAKE_TIMEOUT_MS", value_parser = positive_ms(), default_value_t = millis(timeouts::DEFAULT_TLS_HANDSHAKE))]
    tls_handshake_timeout_ms: u64,
    /// Milliseconds the HTTP/2 handshake after TLS may take, as HBONE
    /// client or server, before the connection is closed.
    #[arg(long, env = "ZTUNNEL_H2_HANDSHAKE_TIMEOUT_MS", value_parser = positive_ms(), default_value_t = millis(timeouts::DEFAULT_H2_HANDSHAKE))]
    h2_handshake_timeout_ms: u64,
    /// Milliseconds an HBONE client waits for a stream slot and the answer
    /// to its CONNECT before the connection is closed.
    #[arg(long, env = "ZTUNNEL_CONNECT_RESPONSE_TIMEOUT_MS", value_parser = positive_ms(), default_value_t = millis(timeouts::DEFAULT_CONNECT_RESPONSE))]
    connect_response_timeout_ms: u64,
    /// Milliseconds a SOCKS5 client (port 15080) may take to send its
    /// greeting and request before the connection is closed.
    #[arg(long, env = "ZTUNNEL_SOCKS5_TIMEOUT_MS", value_parser = positive_ms(), default_value_t = millis(timeouts::DEFAULT_SOCKS5))]
    socks5_timeout_ms: u64,
    /// Open connections one pod may have on each side: inbound (15006,
    /// 15008 and each HBONE stream, same-node connections into it) and
    /// outbound (15001, 15080), counted apart. A new one beyond it is
    /// reset at once (a stream answered 503), counted in
    /// ztunnel_limit_reached_total{limit="pod_connections"} and logged.
    #[arg(long, env = "ZTUNNEL_MAX_CONNECTIONS_PER_POD", value_parser = at_least_one(), default_value_t = limits::DEFAULT_CONNECTIONS_PER_POD as u64)]
    max_connections_per_pod: u64,
    /// Open connections on all pods' listeners of this node together
    /// (limit="node_connections"). When they are all taken, a new one
    /// closes the oldest HBONE connection still in its handshake (of the
    /// pod holding the most) and takes its place; with none, it is reset.
    #[arg(long, env = "ZTUNNEL_MAX_CONNECTIONS_PER_NODE", value_parser = at_least_one(), default_value_t = limits::DEFAULT_CONNECTIONS_PER_NODE as u64)]
    max_connections_per_node: u64,
    /// HBONE connections (port 15008, all pods) in their TLS or HTTP/2
    /// handshake at once. When they are all taken, a new one to a pod takes
    /// the oldest place of the pod holding the most, if that leaves the
    /// holder at least as many as the newcomer's pod; otherwise it is reset
    /// at once (limit="hbone_handshakes").
    #[arg(long, env = "ZTUNNEL_MAX_HBONE_HANDSHAKES", value_parser = at_least_one(), default_value_t = limits::DEFAULT_HBONE_HANDSHAKES as u64)]
    max_hbone_handshakes: u64,
    /// HBONE connections to one pod in their TLS or HTTP/2 handshake at
    /// once; one more is reset at once (limit="pod_hbone_handshakes"), so
    /// a flood against one pod leaves the node's other places to the rest.
    #[arg(long, env = "ZTUNNEL_MAX_POD_HBONE_HANDSHAKES", value_parser = at_least_one(), default_value_t = limits::DEFAULT_HBONE_HANDSHAKES_PER_POD as u64)]
    max_pod_hbone_handshakes: u64,
    /// Clients connected to the enrolment socket at once; one more is
    /// answered with an error and closed (limit="enrol_clients").
    #[arg(long, env = "ZTUNNEL_MAX_ENROL_CLIENTS", value_parser = at_least_one(), default_value_t = limits::DEFAULT_ENROL_CLIENTS as u64)]
    max_enrol_clients: u64,
    /// Captured connects of one pod that may wait for their handshake with
    /// the pod's outbound listener at once (sockets in SYN_SENT, each
    /// holding an entry of the node's 65,536-entry ORIG_DST map). The
    /// kernel gives a connect beyond it no record, so ztunnel resets it:
    /// only that pod's connection fails, and a pod whose connects hang
    /// cannot fill the map for the others. Counted in
    /// ztunnel_pod_limit_reached_total{limit="pod_pending_connects"}.
    #[arg(long, env = "ZTUNNEL_MAX_POD_PENDING_CONNECTS", value_parser = clap::value_parser!(u32).range(1..=i64::from(ztunnel_common::MAX_PENDING_CONNECTIONS)), default_value_t = ztunnel_common::DEFAULT_MAX_POD_PENDING)]
    max_pod_pending_connects: u32,
    /// ztunnel's connections to one pod's application that may be
    /// connecting at once (each holds an entry of the node's 65,536-entry
    /// INBOUND_LEGS map until its connect returns); one more is refused
    /// (limit="pod_pending_legs"), so a pod whose application never
    /// accepts cannot fill the map for the others.
    #[arg(long, env = "ZTUNNEL_MAX_POD_PENDING_LEGS", value_parser = at_least_one(), default_value_t = limits::DEFAULT_PENDING_LEGS_PER_POD as u64)]
    max_pod_pending_legs: u64,
}

/// A duration as whole milliseconds (for flag defaults).
const fn millis(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// Limits are at least one: zero would refuse everything.
fn at_least_one() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(1..)
}

/// Timeouts are at least one millisecond: zero would fail every connection.
fn positive_ms() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(1..)
}

/// A certificate lifetime: plain seconds (`86400`) or a duration with
/// units (`24h`, `24h0m0s`, `90m`), as Istio writes `SECRET_TTL`.
fn parse_lifetime(text: &str) -> Result<Duration, String> {
    let lifetime = match text.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => humantime::parse_duration(text)
            .map_err(|e| format!("{text:?} is neither seconds nor a duration like 24h: {e}"))?,
    };
    if lifetime.is_zero() {
        return Err("a certificate lifetime must be more than zero".to_owned());
    }
    Ok(lifetime)
}

#[derive(clap::Args)]
struct EnrolArgs {
    /// The daemon's enrolment socket.
    #[arg(long, default_value = zds::DEFAULT_SOCKET)]
    socket: PathBuf,
    #[command(subcommand)]
    action: EnrolAction,
}

#[derive(Subcommand)]
enum EnrolAction {
    /// Enrol a pod: its network namespace is passed to the daemon as an fd.
    Add {
        /// Pod uid.
        #[arg(long)]
        uid: String,
        /// Path of the pod's network namespace (e.g. /var/run/netns/pod).
        #[arg(long)]
        netns: PathBuf,
        /// Pod name (for logs; default: the uid).
        #[arg(long)]
        name: Option<String>,
        /// Kubernetes namespace. Required: with the service account it makes
        /// the pod's identity, which ztunnel will not guess.
        #[arg(long)]
        namespace: String,
        /// Service account (Kubernetes' own default is `default`; say so).
        #[arg(long)]
        service_account: String,
    },
    /// Remove a pod.
    Del {
        /// Pod uid.
        #[arg(long)]
        uid: String,
    },
    /// Declare the complete set of pods: every socket-enrolled pod not named
    /// here is removed.
    Snapshot {
        /// Pod uids that stay.
        #[arg(long)]
        keep: Vec<String>,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable `key=value` lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum OnOff {
    On,
    Off,
}

fn main() -> Result<()> {
    let thp = ztunnel::memory::no_transparent_huge_pages();
    let cli = Cli::parse();
    let log_control = init_logging(&cli.log, cli.log_format)?;
    if let Err(e) = thp {
        tracing::warn!(error = %e, "could not turn transparent huge pages off; memory may be given back late");
    }
    match cli.command {
        Command::Probe => {
            probe::check_kernel()?;
            let mode = capture::tc::TcMode::Auto.resolve();
            println!("kernel ok: every required hook is available (TC attach mode: {mode:?})");
            Ok(())
        }
        Command::Run(args) => Ok(app::run(&settings(*args), log_control)?),
        Command::Enrol(args) => enrol(args),
    }
}

/// Installs the subscriber (text or JSON on stderr) with a reloadable
/// filter, and returns the handle the admin `/logging` endpoint uses.
fn init_logging(filter: &str, format: LogFormat) -> Result<ztunnel::admin::LogControl> {
    use tracing_subscriber::{fmt, prelude::*, reload};
    // The same rules as `/logging`: no bare words, a default level, and the
    // access log only off when named.
    let filter = ztunnel::telemetry::log_filter::complete(filter)
        .map_err(|e| anyhow::anyhow!("invalid --log filter: {e}"))?;
    let (filter, handle) =
        reload::Layer::new(EnvFilter::try_new(&filter).context("invalid --log filter")?);
    let text = (format == LogFormat::Text).then(|| fmt::layer().with_writer(std::io::stderr));
    let json = (format == LogFormat::Json).then(|| {
        fmt::layer()
            .json()
            .flatten_event(true)
            .with_writer(std::io::stderr)
    });
    tracing_subscriber::registry()
        .with(filter)
        .with(text)
        .with(json)
        .init();
    Ok(std::sync::Arc::new(move |new: &str| {
        let filter = EnvFilter::try_new(new).map_err(|e| e.to_string())?;
        handle.reload(filter).map_err(|e| e.to_string())
    }))
}

/// Flags to settings: a pure mapping, kept apart from reading them.
fn settings(args: RunArgs) -> app::Settings {
    app::Settings {
        cgroup: args.cgroup,
        bpffs: args.bpffs,
        sockmap: args.sockmap == OnOff::On,
        max_pod_pending_connects: args.max_pod_pending_connects,
        splice_pipes: if args.splice == OnOff::On {
            args.splice_pipes
        } else {
            0
        },
        splice_pipes_per_pod: args.max_pod_splice_pipes,
        tc_mode: args.tc_mode,
        cleanup: args.cleanup,
        config: args.config,
        xds: args.xds_address.map(|address| app::Xds {
            settings: ztunnel::xds::XdsSettings {
                address,
                root_cert: args.xds_root_cert,
                token: args.auth_token.clone(),
                cluster_id: args.cluster_id.clone(),
                node_id: ztunnel::xds::node_id(
                    &args.instance_ip,
                    &args.pod_name,
                    &args.pod_namespace,
                ),
                metadata: ztunnel::xds::node_metadata(
                    &args.pod_name,
                    &args.pod_namespace,
                    &args.instance_ip,
                    &args.node_name,
                    &args.cluster_id,
                    std::env::vars(),
                ),
                // Set by the app from the resolved trust domain.
                trust_domain: String::new(),
            },
        }),
        trust_domain: args.trust_domain,
        node_name: args.node_name,
        exclusions: capture::maps::Exclusions {
            outbound_ports: args.exclude_outbound_ports,
            outbound_cidrs: args.exclude_outbound_cidrs,
            inbound_ports: args.exclude_inbound_ports,
            inbound_cidrs: args.exclude_inbound_cidrs,
        },
        enrol_socket: args.enrol_socket.or_else(|| {
            (args.capture != capture::Backend::IstioCni).then(|| zds::DEFAULT_SOCKET.into())
        }),
        enrol_peers: zds::AllowedPeers {
            uids: args.enrol_uid,
        },
        cni_state_dir: (args.capture != capture::Backend::IstioCni).then_some(args.cni_state_dir),
        node_agent_socket: args.node_agent_socket.or_else(|| {
            (args.capture == capture::Backend::IstioCni).then(|| zds::DEFAULT_SOCKET.into())
        }),
        reconcile_grace: Duration::from_secs(args.reconcile_grace),
        worker_threads: args.worker_threads,
        ca: match (args.ca_address, args.ca_cert, args.ca_key) {
            (Some(address), _, _) => app::CaSource::Istio(app::IstioCa {
                address,
                root_cert: args.ca_root_cert,
                token: args.auth_token,
                cluster_id: args.cluster_id,
                namespace: args.pod_namespace,
                service_account: args.service_account,
            }),
            (None, Some(cert), Some(key)) => app::CaSource::Files {
                cert,
                key,
                root: args.ca_root,
            },
            _ => app::CaSource::Development(args.ca_dir),
        },
        cert_lifetime: args.cert_lifetime.max(Duration::from_secs(2)),
        pool_idle_timeout: Duration::from_secs(args.pool_idle_timeout.max(1)),
        local_fastpath: args.local_fastpath == OnOff::On,
        admin: ztunnel::admin::Addresses {
            admin: args.admin_addr,
            metrics: args.metrics_addr,
            readiness: args.readiness_addr,
        },
        drain_timeout: Duration::from_secs(args.drain_timeout),
        capture: args.capture,
        timeouts: timeouts::Timeouts {
            connect: Duration::from_millis(args.connect_timeout_ms),
            tls_handshake: Duration::from_millis(args.tls_handshake_timeout_ms),
            h2_handshake: Duration::from_millis(args.h2_handshake_timeout_ms),
            connect_response: Duration::from_millis(args.connect_response_timeout_ms),
            socks5: Duration::from_millis(args.socks5_timeout_ms),
        },
        limits: limits::Limits {
            connections_per_pod: usize::try_from(args.max_connections_per_pod)
                .unwrap_or(usize::MAX),
            connections_per_node: usize::try_from(args.max_connections_per_node)
                .unwrap_or(usize::MAX),
            hbone_handshakes: usize::try_from(args.max_hbone_handshakes).unwrap_or(usize::MAX),
            hbone_handshakes_per_pod: usize::try_from(args.max_pod_hbone_handshakes)
                .unwrap_or(usize::MAX),
            pending_legs_per_pod: usize::try_from(args.max_pod_pending_legs).unwrap_or(usize::MAX),
            enrol_clients: usize::try_from(args.max_enrol_clients).unwrap_or(usize::MAX),
        },
    }
}

fn enrol(args: EnrolArgs) -> Result<()> {
    let requests = match args.action {
        EnrolAction::Add {
            uid,
            netns,
            name,
            namespace,
            service_account,
        } => {
            // Checked here so that a wrong path is named as given, with
            // what it is, before anything is sent to the daemon.
            let netns = ztunnel::netns::PodNetns::open(&netns)?;
            let fd: std::os::fd::OwnedFd = std::os::fd::AsFd::as_fd(&netns).try_clone_to_owned()?;
            let info = WorkloadInfo {
                name: name.unwrap_or_else(|| uid.clone()),
                namespace,
                service_account,
            };
            vec![(
                WorkloadRequest {
                    payload: Some(Payload::Add(AddWorkload {
                        uid,
                        workload_info: Some(info),
                    })),
                },
                Some(fd),
            )]
        }
        EnrolAction::Del { uid } => vec![(
            WorkloadRequest {
                payload: Some(Payload::Del(DelWorkload { uid })),
            },
            None,
        )],
        EnrolAction::Snapshot { keep } => keep
            .into_iter()
            .map(|uid| {
                (
                    WorkloadRequest {
                        payload: Some(Payload::Keep(KeepWorkload { uid })),
                    },
                    None,
                )
            })
            .chain(std::iter::once((
                WorkloadRequest {
                    payload: Some(Payload::SnapshotSent(SnapshotSent {})),
                },
                None,
            )))
            .collect(),
    };
    zds::request(&args.socket, requests)?;
    println!("ok");
    Ok(())
}
