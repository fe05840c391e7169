//! Creates ztunnel's upstream sockets inside an enrolled pod's network
//! namespace.
//!
//! `socket()` puts a socket in the calling thread's namespace, and tokio's
//! workers live in the node's. The worker that needs a socket enters the
//! pod's namespace for the `socket()` call alone and goes back at once
//! (two `setns()` calls, a few microseconds). This replaced a thread per pod
//! that handed sockets out over a channel: that hop cost two cross-thread
//! wake-ups per connection (a wake-up round trip across the two vCPUs of our
//! benchmark machine is about 22 us, against well under that for the pair
//! of `setns()`) and a futex pair on each side. Sockets keep the namespace
//! they were made in, so everything after `socket()` (bind, connect, I/O)
//! happens on the node's side of the thread as usual.
//!
//! If a worker could not return to the node's namespace, every socket it
//! made afterwards (listeners, istiod, other pods' upstreams) would land in
//! the wrong namespace and bypass the mesh; ztunnel aborts instead (fail
//! closed), after logging why.

use std::{
    cell::OnceCell,
    net::{SocketAddr, TcpStream},
    os::fd::{AsFd, OwnedFd},
    sync::Arc,
};

use nix::sched::{CloneFlags, setns};
use socket2::{Domain, Protocol, Socket, Type};
use ztunnel_common::{INBOUND_MARK, ZTUNNEL_MARK};

use crate::{
    capture::maps::{InboundLegTable, OwnSocketTable},
    netns::PodNetns,
};

/// The kernel tables that ztunnel's pod sockets are listed in under eBPF
/// capture (none with the iptables and istio-cni backends, whose rules
/// recognise ztunnel's sockets by their mark alone).
#[derive(Debug, Clone, Default)]
pub struct SocketTables {
    /// Where transparent legs are listed while they connect, so that
    /// `sk_lookup` lets their SYN reach the application.
    pub legs: Option<Arc<InboundLegTable>>,
    /// Where every socket ztunnel makes in a pod is listed as its own, so
    /// that the connect hooks do not capture it.
    pub own: Option<Arc<OwnSocketTable>>,
}

/// Makes marked sockets inside one pod's network namespace.
#[derive(Debug, Clone)]
pub struct SocketFactory {
    netns: Arc<PodNetns>,
    tables: SocketTables,
    /// The pod's counters: its share of the legs listed at once.
    limit: Option<Arc<crate::limits::PodLimit>>,
}

thread_local! {
    /// The namespace this thread started in (the node's), opened the first
    /// time the thread makes a pod socket, before it has ever left it.
    static HOME: OnceCell<OwnedFd> = const { OnceCell::new() };
}

/// Back to the thread's own namespace when dropped; aborts if that fails.
struct Inside<'a>(&'a OwnedFd);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        if let Err(e) = setns(self.0.as_fd(), CloneFlags::CLONE_NEWNET) {
            tracing::error!(
                error = %e,
                "cannot return a worker thread to the node's network namespace; \
                 aborting rather than create sockets in a pod's"
            );
            std::process::abort();
        }
    }
}

impl SocketFactory {
    /// A factory for the pod whose namespace is `netns`.
    pub fn new(netns: &PodNetns, tables: SocketTables) -> std::io::Result<Self> {
        Ok(Self {
            netns: Arc::new(netns.try_clone()?),
            tables,
            limit: None,
        })
    }

    /// Counts the pod's transparent legs against `limit`'s share of
    /// `INBOUND_LEGS` (`--max-pod-pending-legs`).
    #[must_use]
    pub fn with_limit(mut self, limit: Arc<crate::limits::PodLimit>) -> Self {
        self.limit = Some(limit);
        self
    }

    /// A fresh, unconnected, non-blocking TCP socket inside the pod, marked
    /// and listed as ztunnel's own; with `source`, transparent and bound to
    /// that (foreign) address.
    pub fn socket(&self, v6: bool, source: Option<std::net::IpAddr>) -> std::io::Result<TcpStream> {
        HOME.with(|home| {
            let home = if let Some(fd) = home.get() {
                fd
            } else {
                let fd: OwnedFd = std::fs::File::open("/proc/thread-self/ns/net")?.into();
                home.get_or_init(|| fd)
            };
            setns(self.netns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|e| {
                std::io::Error::other(format!(
                    "cannot enter network namespace {}: {e}",
                    self.netns.name()
                ))
            })?;
            let inside = Inside(home);
            // Only socket() needs the pod's namespace; the options and the
            // bind work on the socket wherever the thread is.
            let socket = new_socket(v6);
            drop(inside);
            let socket = socket?;
            if let Some(own) = &self.tables.own {
                own.list(&socket).map_err(std::io::Error::other)?;
            }
            configure(socket, source)
        })
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
            .map_err(|source| super::ProxyError::Connect { dst, source })?;
        // A transparent leg's SYN looks like the client's own to the pod's
        // `sk_lookup` program; list it so it reaches the application rather
        // than ztunnel again. Unlisted, it must not connect at all.
        let listed = match (&self.tables.legs, source) {
            (Some(legs), Some(_)) => {
                // The pod's share of the map (counted and logged by the
                // limit when taken).
                let place = match &self.limit {
                    Some(limit) => Some(limit.leg().ok_or_else(|| {
                        super::ProxyError::Connect {
                            dst,
                            source: std::io::Error::other(format!(
                                "pod {}'s share of transparent legs connecting at once (--max-pod-pending-legs) is taken",
                                limit.uid()
                            )),
                        }
                    })?),
                    None => None,
                };
                let bound = std_stream.local_addr()?;
                let entry = legs
                    .list(bound, dst)
                    .map_err(|e| super::ProxyError::Connect {
                        dst,
                        source: std::io::Error::other(e),
                    })?;
                Some((entry, place))
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

fn new_socket(v6: bool) -> std::io::Result<Socket> {
    let domain = if v6 { Domain::IPV6 } else { Domain::IPV4 };
    Socket::new(domain, Type::STREAM.cloexec(), Some(Protocol::TCP))
}

fn configure(socket: Socket, source: Option<std::net::IpAddr>) -> std::io::Result<TcpStream> {
    if let Some(source) = source {
        socket.set_mark(INBOUND_MARK)?;
        set_transparent(&socket, source.is_ipv6())?;
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

#[cfg(test)]
mod tests {
    use std::os::{fd::AsRawFd as _, unix::fs::MetadataExt as _};

    use super::*;
    use crate::netns::socket_netns_cookie;

    /// The inode of the calling thread's network namespace.
    fn thread_netns() -> u64 {
        std::fs::metadata("/proc/thread-self/ns/net")
            .expect("own netns")
            .ino()
    }

    /// A fresh namespace, kept alive by the returned handle only.
    fn scratch_netns() -> PodNetns {
        std::thread::spawn(|| {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
            PodNetns::open(std::path::Path::new("/proc/thread-self/ns/net")).expect("open")
        })
        .join()
        .expect("thread")
    }

    #[test]
    fn sockets_are_born_in_the_pod_and_the_thread_comes_home() {
        if !nix::unistd::geteuid().is_root() {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI runs as root: this test must not skip"
            );
            eprintln!("skipped: creating a network namespace needs root");
            return;
        }
        let pod = scratch_netns();
        let home = thread_netns();
        let factory = SocketFactory::new(&pod, SocketTables::default()).expect("factory");
        for v6 in [false, true] {
            let socket = factory.socket(v6, None).expect("socket");
            assert_eq!(
                socket_netns_cookie(&socket).expect("cookie"),
                pod.cookie().expect("pod cookie"),
                "the socket lives in the pod's namespace"
            );
            assert_eq!(thread_netns(), home, "the worker is back in its own");
            assert!(socket.as_raw_fd() >= 0);
        }
        // A namespace that cannot be entered is named, and the thread stays home.
        let bogus = PodNetns::from_fd(
            "not-a-netns",
            std::fs::File::open("/proc/self/ns/uts")
                .expect("uts")
                .into(),
        );
        let err = SocketFactory::new(&bogus, SocketTables::default())
            .expect("factory")
            .socket(false, None)
            .expect_err("uts is not a network namespace");
        assert!(err.to_string().contains("not-a-netns"), "{err}");
        assert_eq!(thread_netns(), home);
    }
}
