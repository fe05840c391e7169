//! Ports and marks that the kernel programs and the proxy share.

/// Outbound capture listener, inside each enrolled pod (Istio's value).
pub const OUTBOUND_PORT: u16 = 15001;
/// Plaintext inbound listener, inside each enrolled pod (Istio's value).
pub const INBOUND_PLAINTEXT_PORT: u16 = 15006;
/// HBONE (mTLS + HTTP/2 CONNECT) inbound listener (Istio's value; peers dial it).
pub const INBOUND_HBONE_PORT: u16 = 15008;
/// SOCKS5 listener for clients that opt in explicitly.
pub const SOCKS5_PORT: u16 = 15080;

/// `SO_MARK` carried by every socket ztunnel opens on behalf of a pod.
/// Istio's in-pod ztunnel uses the same value (0x539 = 1337), so operators'
/// existing rules that key on it keep working, and the iptables and
/// istio-cni modes (whose rules can see nothing else) exempt it from
/// capture. The eBPF capture does not trust it: a pod can set any mark
/// (`CAP_NET_RAW`), so ztunnel's own sockets are recognised by their entry
/// in [`crate::MAP_ZTUNNEL_SOCKETS`] instead.
pub const ZTUNNEL_MARK: u32 = 0x539;
/// The bits of a socket mark that the iptables and istio-cni modes compare
/// with [`ZTUNNEL_MARK`] (Istio's `0x539/0xfff`).
pub const ZTUNNEL_MARK_MASK: u32 = 0xfff;
/// Mark of ztunnel's transparent sockets towards a pod's applications
/// (source = the remote client's IP). It carries [`ZTUNNEL_MARK`] in its low
/// bits (what the iptables modes exempt) plus [`INBOUND_REPLY_BIT`]: with
/// `tcp_fwmark_accept=1` the application's accepted socket inherits the
/// mark, and an `ip rule fwmark INBOUND_REPLY_BIT lookup` [`REPLY_ROUTE_TABLE`]
/// routes its replies back to ztunnel over `lo` instead of out of `eth0`.
pub const INBOUND_MARK: u32 = ZTUNNEL_MARK | INBOUND_REPLY_BIT;
/// The bit that marks replies to be routed back to ztunnel.
pub const INBOUND_REPLY_BIT: u32 = 0x1000;
/// Routing table (inside each pod namespace) holding `local default dev lo`.
pub const REPLY_ROUTE_TABLE: u32 = 1337;

/// `AF_INET` as the kernel reports it in socket contexts.
pub const AF_INET: u16 = 2;
/// `AF_INET6` as the kernel reports it in socket contexts.
pub const AF_INET6: u16 = 10;
