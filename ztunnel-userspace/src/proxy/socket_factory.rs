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
    sync::mpsc,
};

use socket2::{Domain, Protocol, Socket, Type};
use tokio::sync::oneshot;
use ztunnel_common::ZTUNNEL_MARK;

use crate::netns::PodNetns;

struct Request {
    v6: bool,
    reply: oneshot::Sender<std::io::Result<TcpStream>>,
}

/// Handle to one pod's factory thread.
#[derive(Debug, Clone)]
pub struct SocketFactory {
    requests: mpsc::Sender<Request>,
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
    pub fn start(netns: &PodNetns) -> std::io::Result<Self> {
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
                let _ = req.reply.send(marked_stream_socket(req.v6));
            }
        })?;
        ready_rx
            .recv()
            .map_err(|_| std::io::Error::other("socket factory thread died"))??;
        Ok(Self { requests: tx })
    }

    /// A fresh, unconnected, non-blocking TCP socket inside the pod, marked.
    pub async fn socket(&self, v6: bool) -> Option<std::io::Result<TcpStream>> {
        let (reply, rx) = oneshot::channel();
        self.requests.send(Request { v6, reply }).ok()?;
        rx.await.ok()
    }

    /// Connects to `dst` from inside the pod with a marked socket.
    pub async fn connect(
        &self,
        dst: SocketAddr,
    ) -> Result<tokio::net::TcpStream, super::ProxyError> {
        let std_stream = self
            .socket(dst.is_ipv6())
            .await
            .ok_or(super::ProxyError::FactoryGone)?
            .map_err(|source| super::ProxyError::Connect { dst, source })?;
        let socket = tokio::net::TcpSocket::from_std_stream(std_stream);
        let stream = socket
            .connect(dst)
            .await
            .map_err(|source| super::ProxyError::Connect { dst, source })?;
        stream.set_nodelay(true)?;
        Ok(stream)
    }
}

fn marked_stream_socket(v6: bool) -> std::io::Result<TcpStream> {
    let domain = if v6 { Domain::IPV6 } else { Domain::IPV4 };
    let socket = Socket::new(domain, Type::STREAM.cloexec(), Some(Protocol::TCP))?;
    socket.set_mark(ZTUNNEL_MARK)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}
