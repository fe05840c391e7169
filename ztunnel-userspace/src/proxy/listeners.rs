//! Opens ztunnel's listeners inside a pod's namespace.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};

use socket2::{Domain, Protocol, Socket, Type};
use ztunnel_common::{INBOUND_HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT, SOCKS5_PORT};

use crate::netns::{NetnsError, PodNetns};

/// Listen backlog: bursts of hundreds of simultaneous connects are normal.
const BACKLOG: i32 = 1024;

/// The listeners of one pod, still as std sockets (made non-blocking).
#[derive(Debug)]
pub struct PodListeners {
    /// 15001 on 127.0.0.1 and, when IPv6 is up, `[::1]`.
    pub outbound: Vec<TcpListener>,
    /// 15006 on 0.0.0.0 and `[::]`.
    pub inbound_plaintext: Vec<TcpListener>,
    /// 15008 on 0.0.0.0 and `[::]`.
    pub inbound_hbone: Vec<TcpListener>,
    /// 15080 (SOCKS5) on 127.0.0.1 and `[::1]`: only the pod's own
    /// applications can use it.
    pub socks5: Vec<TcpListener>,
}

/// Why listeners could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// Entering the namespace failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// A sysctl the listeners rely on could not be set.
    #[error("cannot set {name} in {pod}: {source}")]
    Sysctl {
        /// The pod namespace.
        pod: String,
        /// The sysctl.
        name: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// Binding failed (the port is taken inside the pod?).
    #[error("cannot listen on {addr} in {pod}: {source}")]
    Bind {
        /// The pod namespace.
        pod: String,
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let domain = if addr.is_ipv6() {
        Domain::IPV6
    } else {
        Domain::IPV4
    };
    let socket = Socket::new(domain, Type::STREAM.cloexec(), Some(Protocol::TCP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_reuse_address(true)?;
    // A second ztunnel (an upgrade with two running for a while) opens the
    // same ports beside ours; with `tcp_migrate_req` the connections still
    // queued on the listeners of the one that stops move to the other.
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// Opens all listeners inside `netns`. IPv4 ones are required; IPv6 ones
/// are skipped when the pod has IPv6 disabled.
///
/// Also sets `net.ipv4.tcp_migrate_req = 1` in the pod (it covers IPv6
/// too): when one of two ztunnels sharing a port closes its listener, the
/// connections in its accept queue (and half-open ones) move to the other
/// listener of the `SO_REUSEPORT` group instead of being reset. That is
/// what makes an upgrade lose no new connection.
pub fn open(netns: &PodNetns) -> Result<PodListeners, ListenError> {
    let pod = netns.name().to_owned();
    netns.run(move || {
        std::fs::write("/proc/sys/net/ipv4/tcp_migrate_req", "1").map_err(|source| {
            ListenError::Sysctl {
                pod: pod.clone(),
                name: "net.ipv4.tcp_migrate_req",
                source,
            }
        })?;
        let v4 = |ip: Ipv4Addr, port| -> Result<TcpListener, ListenError> {
            let addr = SocketAddr::from((ip, port));
            listen(addr).map_err(|source| ListenError::Bind {
                pod: pod.clone(),
                addr,
                source,
            })
        };
        let v6 = |ip: Ipv6Addr, port| listen(SocketAddr::from((ip, port))).ok();
        let mut out = PodListeners {
            outbound: vec![v4(Ipv4Addr::LOCALHOST, OUTBOUND_PORT)?],
            inbound_plaintext: vec![v4(Ipv4Addr::UNSPECIFIED, INBOUND_PLAINTEXT_PORT)?],
            inbound_hbone: vec![v4(Ipv4Addr::UNSPECIFIED, INBOUND_HBONE_PORT)?],
            socks5: vec![v4(Ipv4Addr::LOCALHOST, SOCKS5_PORT)?],
        };
        out.socks5.extend(v6(Ipv6Addr::LOCALHOST, SOCKS5_PORT));
        out.outbound.extend(v6(Ipv6Addr::LOCALHOST, OUTBOUND_PORT));
        out.inbound_plaintext
            .extend(v6(Ipv6Addr::UNSPECIFIED, INBOUND_PLAINTEXT_PORT));
        out.inbound_hbone
            .extend(v6(Ipv6Addr::UNSPECIFIED, INBOUND_HBONE_PORT));
        Ok(out)
    })?
}
