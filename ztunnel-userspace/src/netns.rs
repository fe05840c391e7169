//! Pod network namespaces: opening them, running code inside them, and
//! identifying them.
//!
//! ztunnel itself stays in the node's namespace. Work that must happen inside
//! a pod (opening its listeners, attaching TC to its `eth0`, connecting to
//! its applications) runs on a short-lived thread that `setns()`s into the
//! pod first. Sockets keep the namespace they were created in, so listeners
//! opened that way stay inside the pod after the thread is gone.

use std::{
    fs::File,
    io,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use nix::sched::{CloneFlags, setns};

/// Errors of namespace handling; each names the namespace at fault.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace path could not be opened.
    #[error("cannot open network namespace {path}: {source}")]
    Open {
        /// The path given.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// `setns()` into the namespace failed.
    #[error("cannot enter network namespace {name}: {source}")]
    Enter {
        /// The namespace's name or path.
        name: String,
        /// The OS error.
        source: nix::Error,
    },
    /// The worker thread died.
    #[error("the thread working inside network namespace {0} panicked")]
    ThreadPanicked(String),
    /// A socket operation used to identify the namespace failed.
    #[error("cannot read the cookie of network namespace {name}: {source}")]
    Cookie {
        /// The namespace's name or path.
        name: String,
        /// The OS error.
        source: io::Error,
    },
}

/// An open handle on a pod's network namespace.
#[derive(Debug)]
pub struct PodNetns {
    name: String,
    fd: OwnedFd,
}

impl PodNetns {
    /// Opens a namespace by path (e.g. `/var/run/netns/pod-a`).
    pub fn open(path: &Path) -> Result<Self, NetnsError> {
        let file = File::open(path).map_err(|source| NetnsError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Self {
            name: path.display().to_string(),
            fd: file.into(),
        })
    }

    /// Wraps a namespace fd received from elsewhere (e.g. over `SCM_RIGHTS`).
    pub fn from_fd(name: impl Into<String>, fd: OwnedFd) -> Self {
        Self {
            name: name.into(),
            fd,
        }
    }

    /// A name for logs and errors.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Duplicates the handle (for handing to another thread or process).
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(Self {
            name: self.name.clone(),
            fd: self.fd.try_clone()?,
        })
    }

    /// Runs `f` on a fresh thread that has entered this namespace, and waits.
    pub fn run<F, R>(&self, f: F) -> Result<R, NetnsError>
    where
        F: FnOnce() -> R + Send,
        R: Send,
    {
        std::thread::scope(|scope| {
            let handle = scope.spawn(|| {
                setns(self.fd.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| {
                    NetnsError::Enter {
                        name: self.name.clone(),
                        source,
                    }
                })?;
                Ok(f())
            });
            handle
                .join()
                .map_err(|_| NetnsError::ThreadPanicked(self.name.clone()))?
        })
    }

    /// The namespace's cookie, the same value `bpf_get_netns_cookie()` returns
    /// in the kernel programs. Read through a throw-away socket created in it.
    pub fn cookie(&self) -> Result<u64, NetnsError> {
        let err = |source| NetnsError::Cookie {
            name: self.name.clone(),
            source,
        };
        self.run(|| {
            // SAFETY: plain socket(2) call; the fd is owned right away.
            let raw =
                unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
            if raw < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `raw` is a fresh, valid fd we own.
            let sock = unsafe { OwnedFd::from_raw_fd(raw) };
            socket_netns_cookie(&sock)
        })?
        .map_err(err)
    }
}

impl PodNetns {
    /// The addresses of the namespace's interfaces, loopback and link-local
    /// excluded (a pod's own IPs).
    pub fn addresses(&self) -> Result<Vec<std::net::IpAddr>, NetnsError> {
        self.run(|| {
            let mut out = Vec::new();
            if let Ok(addrs) = nix::ifaddrs::getifaddrs() {
                for a in addrs {
                    let Some(addr) = a.address else { continue };
                    let ip: Option<std::net::IpAddr> = if let Some(v4) = addr.as_sockaddr_in() {
                        Some(v4.ip().into())
                    } else {
                        addr.as_sockaddr_in6().map(|v6| v6.ip().into())
                    };
                    if let Some(ip) = ip {
                        let link_local = matches!(ip, std::net::IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80);
                        if !ip.is_loopback() && !link_local && !out.contains(&ip) {
                            out.push(ip);
                        }
                    }
                }
            }
            out
        })
    }
}

impl AsFd for PodNetns {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// `SO_NETNS_COOKIE` (Linux 5.14+): the cookie of the namespace a socket
/// lives in.
pub fn socket_netns_cookie(sock: &impl AsRawFd) -> io::Result<u64> {
    const SO_NETNS_COOKIE: libc::c_int = 71;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: valid fd, out-pointer to a u64 of the declared length.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &raw mut len,
        )
    };
    if rc == 0 {
        Ok(cookie)
    } else {
        Err(io::Error::last_os_error())
    }
}
