//! A thread per enrolled pod that creates ztunnel's upstream sockets inside
//! the pod's network namespace.
//!
//! `socket()` puts a socket in the calling thread's namespace, and tokio's
//! workers live in the node's. Rather than `setns()` a worker back and forth
//! per connection, each pod gets one small thread parked in its namespace
//! that hands out ready, non-blocking sockets carrying ztunnel's mark (so the
//! capture programs leave them alone). It exits when the pod is removed
//! (its request channel closes).

use std::{
    net::{SocketAddr, TcpStream},
    sync::{Arc, mpsc},
};

use socket2::{Domain, Protocol, Socket, Type};
use tokio::sync::oneshot;
use ztunnel_common::{INBOUND_MARK, ZTUNNEL_MARK};

use crate::{capture::maps::InboundLegTable, netns::PodNetns};

struct Request {
    v6: bool,
    /// Transparent source address (inbound legs), or `None`.
    source: Option<std::net::IpAddr>,
    reply: oneshot::Sender<std::io::Result<TcpStream>>,
}

/// Handle to one pod's factory thread.
#[derive(Debug, Clone)]
pub struct SocketFactory {
    requests: mpsc::Sender<Request>,
    /// Where transparent legs are listed while they connect (eBPF capture);
    /// `None` with the iptables backend, which has no `sk_lookup` to avoid.
    legs: Option<Arc<InboundLegTable>>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("v6", &self.v6)
            .finish_non_exhaustive()
    }
}

impl SocketFactory {
    /// Starts the thread inside `netns`.
    pub fn start(netns: &PodNetns, legs: Option<Arc<InboundLegTable>>) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Request>();
        let ns = netns.try_clone()?;
        let name = format!("sockets-{}", ns.name().rsplit('/').next().unwrap_or("pod"));
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::Builder::new().name(name).spawn(move || {
            let entered = nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET);
            let _ = ready_tx.send(entered.map_err(std::io::Error::from));
            if entered.is_err() {
                return;
            }
            // Ends when every sender is dropped.
            while let Ok(req) = rx.recv() {
                let _ = req.reply.send(marked_stream_socket(req.v6, req.source));
            }
        })?;
        ready_rx
            .recv()
            .map_err(|_| std::io::Error::other("socket factory thread died"))??;
        Ok(Self { requests: tx, legs })
    }

    /// A fresh, unconnected, non-blocking TCP socket inside the pod, marked;
    /// with `source`, transparent and bound to that (foreign) address.
    pub async fn socket(
        &self,
        v6: bool,
        source: Option<std::net::IpAddr>,
    ) -> Option<std::io::Result<TcpStream>> {
        let (reply, rx) = oneshot::channel();
        self.requests.send(Request { v6, source, reply }).ok()?;
        rx.await.ok()
    }

    /// Connects to `dst` from inside the pod with a marked socket.
    pub async fn connect(
        &self,
        dst: SocketAddr,
    ) -> Result<tokio::net::TcpStream, super::ProxyError> {
        self.connect_from(dst, None).await
    }

    /// Connects to `dst` from inside the pod; with `source`, the connection
    /// comes from that IP (the original client), so the application sees
    /// the real peer.
    pub async fn connect_from(
        &self,
        dst: SocketAddr,
        source: Option<std::net::IpAddr>,
    ) -> Result<tokio::net::TcpStream, super::ProxyError> {
        // A v4 client towards a v6 destination (or the reverse) cannot be
        // spoofed; fall back to the pod's own address.
        let source = source.filter(|s| s.is_ipv6() == dst.is_ipv6());
        let std_stream = self
            .socket(dst.is_ipv6(), source)
            .await
            .ok_or(super::ProxyError::FactoryGone)?
            .map_err(|source| super::ProxyError::Connect { dst, source })?;
        // A transparent leg's SYN looks like the client's own to the pod's
        // `sk_lookup` program; list it so it reaches the application rather
        // than ztunnel again. Unlisted, it must not connect at all.
        let listed = match (&self.legs, source) {
            (Some(legs), Some(_)) => {
                let bound = std_stream.local_addr()?;
                Some(
                    legs.list(bound, dst)
                        .map_err(|e| super::ProxyError::Connect {
                            dst,
                            source: std::io::Error::other(e),
                        })?,
                )
            }
            _ => None,
        };
        let socket = tokio::net::TcpSocket::from_std_stream(std_stream);
        let stream = socket
            .connect(dst)
            .await
            .map_err(|source| super::ProxyError::Connect { dst, source });
        drop(listed);
        let stream = stream?;
        stream.set_nodelay(true)?;
        Ok(stream)
    }
}

fn marked_stream_socket(v6: bool, source: Option<std::net::IpAddr>) -> std::io::Result<TcpStream> {
    let domain = if v6 { Domain::IPV6 } else { Domain::IPV4 };
    let socket = Socket::new(domain, Type::STREAM.cloexec(), Some(Protocol::TCP))?;
    if let Some(source) = source {
        socket.set_mark(INBOUND_MARK)?;
        set_transparent(&socket, v6)?;
        socket.bind(&SocketAddr::new(source, 0).into())?;
    } else {
        socket.set_mark(ZTUNNEL_MARK)?;
    }
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// `IP_TRANSPARENT` / `IPV6_TRANSPARENT`: lets the socket bind a foreign
/// address (the client's).
fn set_transparent(socket: &Socket, v6: bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let (level, name) = if v6 {
        (libc::SOL_IPV6, libc::IPV6_TRANSPARENT)
    } else {
        (libc::SOL_IP, libc::IP_TRANSPARENT)
    };
    let one: libc::c_int = 1;
    // SAFETY: valid fd and a c_int option value of the declared size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            (&raw const one).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
