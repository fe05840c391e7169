//! Map names, sizes and the layout of every key and value.
//!
//! Who writes and who reads each map is documented next to its name; the
//! kernel side declares the statics with exactly these names so userspace can
//! find them with `Ebpf::map_mut(NAME)`.

/// netns cookie (`u64`) -> [`PodCapture`]. Written by userspace on enrolment,
/// read by `capture_connect4/6` to decide whether a `connect()` is captured.
pub const MAP_POD_CAPTURE: &str = "POD_CAPTURE";
/// Socket-local storage (`BPF_MAP_TYPE_SK_STORAGE`) holding the
/// [`OrigDst`] of each captured socket. Written by `capture_connect4/6` when
/// they rewrite a destination (no record, no rewrite: the connect is
/// refused); read by `capture_sockops` (to fill [`MAP_ORIG_DST`]) and by
/// `capture_getpeername4/6`, so the application's `getpeername()` shows the
/// destination it asked for. The kernel frees an entry with its socket, so
/// nothing accumulates with connection churn and the record is right for the
/// whole life of the connection.
pub const MAP_ORIG_DST_BY_SOCKET: &str = "ORIG_DST_BY_SOCKET";
/// Socket-local storage (`BPF_MAP_TYPE_SK_STORAGE`) holding a
/// [`ZtunnelSocket`] for every socket ztunnel itself opened inside a pod.
/// Written by userspace only (`bpf(BPF_MAP_UPDATE_ELEM)` with the socket's
/// fd as key, right after `socket()` and before `connect()`); read by
/// `capture_connect4/6`, which let exactly these sockets through uncaptured.
/// This is how ztunnel's own connections are told apart from the pod's: a
/// pod can set any `SO_MARK` it likes (`CAP_NET_RAW` is a container
/// runtime's default), but it cannot write to a map pinned in the node's
/// bpffs. The kernel frees an entry with its socket.
pub const MAP_ZTUNNEL_SOCKETS: &str = "ZTUNNEL_SOCKETS";
/// [`OrigDstKey`] -> [`OrigDst`]. Written by `capture_sockops` when a
/// captured socket sends its SYN (the client's port is known by then); read
/// and deleted by userspace when the outbound listener accepts the
/// connection, and deleted by `capture_sockops` when a captured socket
/// closes without having been accepted. A plain hash, not an LRU: an entry
/// is never evicted while its connection waits in the accept queue, and a
/// full map makes that one connection fail (ztunnel finds no record and
/// resets it) instead of silently dropping someone else's record.
pub const MAP_ORIG_DST: &str = "ORIG_DST";
/// Per-CPU array of `u64`, indexed by [`Counter`]. Written by every program,
/// read (summed over CPUs) by userspace for metrics and tests.
pub const MAP_COUNTERS: &str = "CAPTURE_COUNTERS";
/// Destination port (`u16`, host order) -> `u8` (1). Written by userspace from
/// `--exclude-outbound-ports`; read by `capture_connect4/6`.
pub const MAP_OUTBOUND_EXCLUDED_PORTS: &str = "OUTBOUND_EXCLUDED_PORTS";
/// Destination port (`u16`, host order) -> `u8` (1). Written by userspace from
/// `--exclude-inbound-ports`; read by `capture_ingress`.
pub const MAP_INBOUND_EXCLUDED_PORTS: &str = "INBOUND_EXCLUDED_PORTS";
/// LPM trie over [`IpBytes`] (IPv4 as v4-mapped IPv6) -> `u8` (1). Written by
/// userspace from `--exclude-outbound-cidrs`; read by `capture_connect4/6`.
pub const MAP_OUTBOUND_EXCLUDED_CIDRS: &str = "OUTBOUND_EXCLUDED_CIDRS";
/// LPM trie over [`IpBytes`] -> `u8` (1). Written by userspace from
/// `--exclude-inbound-cidrs` (e.g. the node's health-probe address); read by
/// `capture_ingress` against the packet's source.
pub const MAP_INBOUND_EXCLUDED_CIDRS: &str = "INBOUND_EXCLUDED_CIDRS";
/// [`SockKey`] -> socket. Filled by `capture_sockops` with both ends of each
/// pod-local leg (application <-> ztunnel listener) when acceleration is on;
/// `accelerate_local_leg` (`sk_msg`) redirects payload between them.
pub const MAP_LOCAL_LEG_SOCKETS: &str = "LOCAL_LEG_SOCKETS";
/// [`SockKey`] of a sending socket -> `u8` (1). Written by
/// `accelerate_local_leg` the first time a payload of that socket could not
/// be redirected (the peer was not in the sockhash yet) and so went through
/// TCP; from then on that direction always uses TCP. Mixing the two paths in
/// one direction could reorder bytes at the receiver, which reads the
/// redirected queue first. LRU, so closed sockets age out.
pub const MAP_LOCAL_LEG_TCP_ONLY: &str = "LOCAL_LEG_TCP_ONLY";
/// [`ListenerKey`] -> listening socket. Written by userspace on enrolment
/// with each pod's plaintext-inbound (15006) and HBONE (15008) listeners,
/// under each of the pod's addresses; read by `capture_lookup` (`sk_lookup`),
/// which hands every new inbound connection to one of them. The kernel
/// removes a socket from the map when it closes, so a dead ztunnel leaves no
/// listener to steer to and `capture_lookup` drops (fail closed).
pub const MAP_POD_LISTENERS: &str = "POD_LISTENERS";
/// [`LegKey`] -> `u8` (1). Written by userspace just before one of
/// ztunnel's transparent legs to a pod's application connects (source = the
/// original client's address, so `sk_lookup` cannot tell it from that client
/// by its addresses or by its interface: the kernel reports the interface
/// holding the pod's address, not `lo`, for locally delivered packets), and
/// deleted once the connect returns; read by `capture_lookup`, which leaves
/// such a SYN to the normal lookup so it reaches the application instead of
/// being steered back to ztunnel.
pub const MAP_INBOUND_LEGS: &str = "INBOUND_LEGS";
/// Array with one [`CaptureSettings`]. Written by userspace at start-up; read
/// by `capture_sockops`.
pub const MAP_SETTINGS: &str = "CAPTURE_SETTINGS";
/// netns cookie (`u64`) -> [`PodPending`]: each pod's share of
/// [`MAP_ORIG_DST`]. Written by `capture_sockops` (one more when a captured
/// socket's SYN is recorded, one less when that socket leaves `SYN_SENT`,
/// one more `refused` when the pod is at its share); read by userspace for
/// `/metrics`, and the pod's entry deleted when it is removed. A pod whose
/// connects hang (it drops its own SYNs) can thereby hold at most its share
/// of the node-wide map, not all of it.
pub const MAP_POD_PENDING: &str = "POD_PENDING";

/// Enrolled pods per node. Kubernetes' default is 110 pods per node; 4096
/// leaves room for dense nodes without costing much (16 bytes an entry).
pub const MAX_PODS: u32 = 4096;
/// Connections whose original destination is in flight between the SYN and
/// ztunnel's `accept()` (or the client's close). Only a burst of
/// simultaneous connects is ever in here.
pub const MAX_PENDING_CONNECTIONS: u32 = 65536;
/// A pod's default share of [`MAX_PENDING_CONNECTIONS`] (connects in
/// `SYN_SENT`), when [`CaptureSettings::max_pod_pending`] is 0. An eighth of
/// the map: it takes eight pods whose connects all hang to fill it, and a
/// pod making this many simultaneous connects is far beyond what an
/// application does.
pub const DEFAULT_MAX_POD_PENDING: u32 = MAX_PENDING_CONNECTIONS / 8;
/// Sockets in the acceleration map: two per accelerated local leg.
pub const MAX_LOCAL_LEG_SOCKETS: u32 = 65536;
/// Listener entries: two ports per pod address, two addresses (v4 + v6) per
/// pod, [`MAX_PODS`] pods.
pub const MAX_POD_LISTENERS: u32 = MAX_PODS * 4;
/// Configured exclusion entries (ports or CIDRs) per list.
pub const MAX_EXCLUSIONS: u32 = 1024;

/// An IP address as 16 bytes in network order. IPv4 is stored v4-mapped
/// (`::ffff:a.b.c.d`) so one key type and one LPM trie serve both families.
pub type IpBytes = [u8; 16];

/// Capture flags of one enrolled pod, the value of [`MAP_POD_CAPTURE`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodCapture {
    /// Bit set of `POD_CAPTURE_*`.
    pub flags: u32,
    /// Explicit padding so the layout has no holes.
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<PodCapture>() == 8);

/// The pod's outbound `connect()`s are redirected to its outbound listener.
pub const POD_CAPTURE_OUTBOUND: u32 = 1 << 0;
/// The pod's inbound connections are steered to ztunnel (informational in the
/// map: the inbound program is only attached to pods that want it).
pub const POD_CAPTURE_INBOUND: u32 = 1 << 1;

/// Original destination of a captured connection, the value of
/// [`MAP_ORIG_DST_BY_SOCKET`] and [`MAP_ORIG_DST`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OrigDst {
    /// Destination address, network order (IPv4 v4-mapped).
    pub addr: IpBytes,
    /// Destination port, host order.
    pub port: u16,
    /// `AF_INET` or `AF_INET6`: the family the application connected with.
    pub family: u16,
    /// Bit set of `ORIG_DST_*` (kernel bookkeeping; 0 in [`MAP_ORIG_DST`]'s
    /// copy is not guaranteed, userspace ignores it).
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<OrigDst>() == 24);

/// The socket is counted in its pod's [`PodPending::pending`] (set when its
/// SYN was recorded, cleared when the count is given back).
pub const ORIG_DST_COUNTED: u32 = 1 << 0;

/// A pod's use of [`MAP_ORIG_DST`], the value of [`MAP_POD_PENDING`].
/// 64-bit counters: the BPF target's atomic add is 64-bit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodPending {
    /// The pod's captured sockets in `SYN_SENT` that have a record.
    pub pending: u64,
    /// Connects that got no record because the pod was at its share.
    pub refused: u64,
}
const _: () = assert!(core::mem::size_of::<PodPending>() == 16);

/// The value of [`MAP_ZTUNNEL_SOCKETS`]: that ztunnel made the socket.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZtunnelSocket {
    /// [`ZTUNNEL_SOCKET_OWN`]; anything else is not ztunnel's.
    pub owner: u32,
}
const _: () = assert!(core::mem::size_of::<ZtunnelSocket>() == 4);

/// [`ZtunnelSocket::owner`] of a socket ztunnel opened. Not zero, so that a
/// zeroed entry (what the kernel creates for a program that asks with
/// `F_CREATE`) never counts as ztunnel's.
pub const ZTUNNEL_SOCKET_OWN: u32 = 0x5a54;

/// Key of [`MAP_ORIG_DST`]: the client end of a captured connection, as the
/// outbound listener sees it in `accept()`'s peer address, qualified by the
/// pod's network namespace (every pod has its own 127.0.0.1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct OrigDstKey {
    /// Cookie of the pod's network namespace (`SO_NETNS_COOKIE`).
    pub netns_cookie: u64,
    /// Client's local address, network order (IPv4 v4-mapped).
    pub client_addr: IpBytes,
    /// Client's local port, host order.
    pub client_port: u16,
    /// Explicit padding.
    pub _pad: [u8; 6],
}
const _: () = assert!(core::mem::size_of::<OrigDstKey>() == 32);

/// Key of [`MAP_POD_LISTENERS`]: a pod address and one of ztunnel's inbound
/// ports. Keyed by address rather than network namespace because an
/// `sk_lookup` program cannot read its namespace's cookie; pod addresses are
/// unique on a node, and a destination address that is not a known pod
/// address finds no listener and is dropped.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ListenerKey {
    /// The pod's address, network order (IPv4 v4-mapped).
    pub addr: IpBytes,
    /// [`crate::INBOUND_PLAINTEXT_PORT`] or [`crate::INBOUND_HBONE_PORT`],
    /// host order.
    pub port: u32,
}
const _: () = assert!(core::mem::size_of::<ListenerKey>() == 20);

/// Key of [`MAP_INBOUND_LEGS`]: the 4-tuple of a leg's SYN as the pod
/// receives it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LegKey {
    /// The pod's address the leg connects to, network order (v4-mapped).
    pub local_addr: IpBytes,
    /// The leg's (transparent) source address, network order (v4-mapped).
    pub remote_addr: IpBytes,
    /// The application's port, host order.
    pub local_port: u16,
    /// The leg's source port, host order.
    pub remote_port: u16,
}
const _: () = assert!(core::mem::size_of::<LegKey>() == 36);

/// Key of [`MAP_LOCAL_LEG_SOCKETS`]: one end of a pod-local TCP connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockKey {
    /// Cookie of the network namespace the socket lives in.
    pub netns_cookie: u64,
    /// Local address, network order (IPv4 v4-mapped).
    pub local_addr: IpBytes,
    /// Remote address, network order (IPv4 v4-mapped).
    pub remote_addr: IpBytes,
    /// Local port, host order.
    pub local_port: u32,
    /// Remote port, host order.
    pub remote_port: u32,
}
const _: () = assert!(core::mem::size_of::<SockKey>() == 48);

impl SockKey {
    /// The key under which the other end of the same connection is stored.
    #[must_use]
    pub const fn peer(&self) -> Self {
        Self {
            netns_cookie: self.netns_cookie,
            local_addr: self.remote_addr,
            remote_addr: self.local_addr,
            local_port: self.remote_port,
            remote_port: self.local_port,
        }
    }
}

/// Node-wide switches, the single value of [`MAP_SETTINGS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CaptureSettings {
    /// 1 when `--sockmap on`: pod-local legs are put in the sockhash.
    pub sockmap_enabled: u32,
    /// `--max-pod-pending-connects`: a pod's share of [`MAP_ORIG_DST`]
    /// (0: [`DEFAULT_MAX_POD_PENDING`], what a map pinned by an older build
    /// holds in this slot).
    pub max_pod_pending: u32,
}
const _: () = assert!(core::mem::size_of::<CaptureSettings>() == 8);

/// Maps an IPv4 address (network-order bytes) into the v4-mapped form.
#[must_use]
pub const fn v4_mapped(octets: [u8; 4]) -> IpBytes {
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, octets[0], octets[1], octets[2], octets[3],
    ]
}

/// Indices into [`MAP_COUNTERS`]. Append only: the value is the map index.
/// (Indices 13 to 16 counted the TC steering decisions before steering moved
/// to `sk_lookup`; they now count the `sk_lookup` decisions.)
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// `connect4` invocations for TCP sockets.
    Connect4Seen = 0,
    /// `connect6` invocations for TCP sockets.
    Connect6Seen,
    /// Connects redirected to an outbound listener.
    ConnectRedirected,
    /// Connects let through because the socket is one ztunnel opened (listed in [`MAP_ZTUNNEL_SOCKETS`]).
    ConnectSkippedOwn,
    /// Connects let through because of a configured exclusion or loopback.
    ConnectExcluded,
    /// Connects from a namespace that is not enrolled.
    ConnectNotEnrolled,
    /// `getpeername()` answers rewritten back to the original destination.
    PeernameRestored,
    /// `sock_ops` established callbacks seen.
    SockopsEstablished,
    /// Original destinations put into [`MAP_ORIG_DST`].
    OrigDstRecorded,
    /// Sockets put into [`MAP_LOCAL_LEG_SOCKETS`].
    LocalLegInserted,
    /// `sk_msg` payloads redirected to the peer socket.
    LocalLegRedirected,
    /// `sk_msg` payloads that went the normal way (peer not in the map).
    LocalLegPassed,
    /// TCP packets seen by `capture_ingress` (TC, counting only).
    IngressTcpSeen,
    /// New inbound connections `capture_lookup` handed to the plaintext-inbound listener (15006).
    LookupSteeredPlaintext,
    /// New inbound connections `capture_lookup` handed to the HBONE listener (15008).
    LookupSteeredHbone,
    /// New inbound connections left to the normal lookup because of a configured exclusion.
    LookupExcluded,
    /// New inbound connections dropped because the pod has no ztunnel listener for them (ztunnel gone, or an address that is not the pod's): fail closed.
    LookupNoListener,
    /// Connects refused (`EPERM`) because the original destination could not be stored: fail closed.
    ConnectRefusedNoRecord,
    /// Original destinations that could not be put into [`MAP_ORIG_DST`]; ztunnel finds no record and resets the connection.
    OrigDstInsertFailed,
    /// [`MAP_ORIG_DST`] entries removed because their connection closed before ztunnel accepted it.
    OrigDstRemovedAtClose,
    /// New connections from the pod's own loopback (its applications, ztunnel's legs to them) left to the normal lookup.
    LookupLoopbackPassed,
    /// IPv4 fragments seen by `capture_ingress` (TC, counting only).
    IngressFragmentSeen,
    /// IPv6 packets with an extension header before the transport header, seen by `capture_ingress`.
    IngressIpv6ExtSeen,
    /// SYNs of ztunnel's own transparent legs to an application, left to the normal lookup.
    LookupLegPassed,
    /// Connects by a pod socket that carries ztunnel's mark (`mark & 0xfff == 0x539`) but is not ztunnel's: captured like any other (a pod cannot exempt itself).
    ConnectForgedMark,
    /// TCP packets leaving an enrolled pod's `eth0` from a socket that is not a TCP socket (raw or packet sockets): dropped by `guard_egress`.
    EgressForeignTcpDropped,
    /// IPv4 fragments and IPv6 packets whose transport is hidden (fragment header, too many extension headers) from such a socket: dropped by `guard_egress`.
    EgressHiddenDropped,
    /// Captured connects that got no [`MAP_ORIG_DST`] record because their pod was at its share (`--max-pod-pending-connects`); ztunnel finds no record and resets them.
    OrigDstPodShareFull,
}

impl Counter {
    /// Number of counters (the array's size).
    pub const COUNT: u32 = Self::OrigDstPodShareFull as u32 + 1;
    /// All counters, in index order.
    pub const ALL: [Self; Self::COUNT as usize] = [
        Self::Connect4Seen,
        Self::Connect6Seen,
        Self::ConnectRedirected,
        Self::ConnectSkippedOwn,
        Self::ConnectExcluded,
        Self::ConnectNotEnrolled,
        Self::PeernameRestored,
        Self::SockopsEstablished,
        Self::OrigDstRecorded,
        Self::LocalLegInserted,
        Self::LocalLegRedirected,
        Self::LocalLegPassed,
        Self::IngressTcpSeen,
        Self::LookupSteeredPlaintext,
        Self::LookupSteeredHbone,
        Self::LookupExcluded,
        Self::LookupNoListener,
        Self::ConnectRefusedNoRecord,
        Self::OrigDstInsertFailed,
        Self::OrigDstRemovedAtClose,
        Self::LookupLoopbackPassed,
        Self::IngressFragmentSeen,
        Self::IngressIpv6ExtSeen,
        Self::LookupLegPassed,
        Self::ConnectForgedMark,
        Self::EgressForeignTcpDropped,
        Self::EgressHiddenDropped,
        Self::OrigDstPodShareFull,
    ];

    /// Snake-case name used in metrics and dumps.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Connect4Seen => "connect4_seen",
            Self::Connect6Seen => "connect6_seen",
            Self::ConnectRedirected => "connect_redirected",
            Self::ConnectSkippedOwn => "connect_skipped_own",
            Self::ConnectExcluded => "connect_excluded",
            Self::ConnectNotEnrolled => "connect_not_enrolled",
            Self::PeernameRestored => "peername_restored",
            Self::SockopsEstablished => "sockops_established",
            Self::OrigDstRecorded => "orig_dst_recorded",
            Self::LocalLegInserted => "local_leg_inserted",
            Self::LocalLegRedirected => "local_leg_redirected",
            Self::LocalLegPassed => "local_leg_passed",
            Self::IngressTcpSeen => "ingress_tcp_seen",
            Self::LookupSteeredPlaintext => "lookup_steered_plaintext",
            Self::LookupSteeredHbone => "lookup_steered_hbone",
            Self::LookupExcluded => "lookup_excluded",
            Self::LookupNoListener => "lookup_no_listener",
            Self::ConnectRefusedNoRecord => "connect_refused_no_record",
            Self::OrigDstInsertFailed => "orig_dst_insert_failed",
            Self::OrigDstRemovedAtClose => "orig_dst_removed_at_close",
            Self::LookupLoopbackPassed => "lookup_loopback_passed",
            Self::IngressFragmentSeen => "ingress_fragment_seen",
            Self::IngressIpv6ExtSeen => "ingress_ipv6_ext_seen",
            Self::LookupLegPassed => "lookup_leg_passed",
            Self::ConnectForgedMark => "connect_forged_mark",
            Self::EgressForeignTcpDropped => "egress_foreign_tcp_dropped",
            Self::EgressHiddenDropped => "egress_hidden_dropped",
            Self::OrigDstPodShareFull => "orig_dst_pod_share_full",
        }
    }
}

#[cfg(feature = "user")]
mod pod_impls {
    // SAFETY: all of these are `#[repr(C)]`, `Copy`, contain only integers and
    // byte arrays, and have explicit padding (checked by the size asserts), so
    // every bit pattern is valid and there are no uninitialised bytes.
    unsafe impl aya::Pod for super::PodCapture {}
    unsafe impl aya::Pod for super::OrigDst {}
    unsafe impl aya::Pod for super::OrigDstKey {}
    unsafe impl aya::Pod for super::SockKey {}
    unsafe impl aya::Pod for super::ListenerKey {}
    unsafe impl aya::Pod for super::LegKey {}
    unsafe impl aya::Pod for super::CaptureSettings {}
    unsafe impl aya::Pod for super::ZtunnelSocket {}
    unsafe impl aya::Pod for super::PodPending {}
}
