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
    /// The path or fd is something else than a network namespace (a
    /// regular file, a directory, another kind of namespace).
    #[error("{name} is not a network namespace: it is {what}")]
    NotNetns {
        /// The path given, or the name the fd came with.
        name: String,
        /// What it is instead.
        what: String,
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
    /// Opens a namespace by path (e.g. `/var/run/netns/pod-a`); a path
    /// that is not a network namespace is refused, named.
    pub fn open(path: &Path) -> Result<Self, NetnsError> {
        let file = File::open(path).map_err(|source| NetnsError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let name = path.display().to_string();
        check_netns(file.as_fd(), &name)?;
        Ok(Self {
            name,
            fd: file.into(),
        })
    }

    /// Like [`Self::from_fd`], but refuses an fd that is not a network
    /// namespace (checked before anything tries to enter it, so the error
    /// names what was sent instead of a failing step further on).
    pub fn checked_from_fd(name: impl Into<String>, fd: OwnedFd) -> Result<Self, NetnsError> {
        let name = name.into();
        check_netns(fd.as_fd(), &name)?;
        Ok(Self { name, fd })
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

/// `NS_GET_NSTYPE` (`_IO(0xb7, 0x3)`, Linux 4.11+): the `CLONE_NEW*` type
/// of a namespace fd; other fds fail with `ENOTTY`.
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;

/// Checks that `fd` is a network namespace; otherwise says what it is.
pub fn check_netns(fd: std::os::fd::BorrowedFd<'_>, name: &str) -> Result<(), NetnsError> {
    // SAFETY: an ioctl without an argument on a valid fd.
    let kind = unsafe { libc::ioctl(fd.as_raw_fd(), NS_GET_NSTYPE as _) };
    if kind == libc::CLONE_NEWNET {
        return Ok(());
    }
    let what = if kind >= 0 {
        "a namespace of another type".to_owned()
    } else {
        describe_file(fd)
    };
    Err(NetnsError::NotNetns {
        name: name.to_owned(),
        what,
    })
}

/// "a regular file", "a directory", ... for an fd that is no namespace.
fn describe_file(fd: std::os::fd::BorrowedFd<'_>) -> String {
    let Ok(stat) = nix::sys::stat::fstat(fd) else {
        return "not a namespace".to_owned();
    };
    match stat.st_mode & libc::S_IFMT {
        libc::S_IFREG => "a regular file",
        libc::S_IFDIR => "a directory",
        libc::S_IFCHR | libc::S_IFBLK => "a device",
        libc::S_IFIFO => "a pipe",
        libc::S_IFSOCK => "a socket",
        _ => "not a namespace",
    }
    .to_owned()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_that_is_not_a_network_namespace_is_named_with_what_it_is() {
        let e = PodNetns::open(Path::new("/etc/passwd")).expect_err("a file");
        assert_eq!(
            e.to_string(),
            "/etc/passwd is not a network namespace: it is a regular file"
        );
        let e = PodNetns::open(Path::new("/")).expect_err("a directory");
        assert_eq!(
            e.to_string(),
            "/ is not a network namespace: it is a directory"
        );
        let e = PodNetns::open(Path::new("/proc/self/ns/uts")).expect_err("uts");
        assert!(e.to_string().contains("another type"), "{e}");
        PodNetns::open(Path::new("/proc/self/ns/net")).expect("our own netns");
    }
}
