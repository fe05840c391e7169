//! A packet sniffer for the fabric bridge: proves what crosses the wire.
//!
//! It opens an `AF_PACKET` socket on an interface inside a namespace the
//! test created, records every frame for as long as it runs, and reports
//! whether a marker byte string appeared in any of them.

use std::{
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use ztunnel::netns::PodNetns;

/// A running capture.
pub struct Sniffer {
    stop: Arc<AtomicBool>,
    frames: Arc<AtomicU64>,
    thread: Option<JoinHandle<bool>>,
}

impl Sniffer {
    /// Starts capturing on every interface of the namespace at `netns`,
    /// looking for `marker`. (On a bridge, frames forwarded between ports
    /// never pass through the bridge device itself, so listening on the
    /// bridge alone would see almost nothing: all ports are watched.)
    pub fn start(netns: &Path, marker: &[u8]) -> Self {
        let ns = PodNetns::open(netns).expect("open netns");
        let marker = marker.to_vec();
        let stop = Arc::new(AtomicBool::new(false));
        let frames = Arc::new(AtomicU64::new(0));
        let (stop2, frames2) = (Arc::clone(&stop), Arc::clone(&frames));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("enter netns");
            let proto = (libc::ETH_P_ALL as u16).to_be();
            // SAFETY: plain socket(2); the fd is owned right away.
            let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto)) };
            assert!(
                raw >= 0,
                "AF_PACKET socket: {}",
                std::io::Error::last_os_error()
            );
            // SAFETY: fresh fd.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            // SAFETY: zeroed sockaddr_ll is valid; we fill family, protocol, ifindex.
            let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = proto;
            sll.sll_ifindex = 0; // every interface
            // SAFETY: valid fd and sockaddr of the declared size.
            let rc = unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    (&raw const sll).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            assert_eq!(rc, 0, "bind AF_PACKET: {}", std::io::Error::last_os_error());
            let _ = ready_tx.send(());
            let mut found = false;
            let mut buf = vec![0u8; 65536];
            while !stop2.load(Ordering::Relaxed) {
                let mut pfd = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd; bounded wait.
                if unsafe { libc::poll(&raw mut pfd, 1, 100) } <= 0 {
                    continue;
                }
                // SAFETY: buffer of the given length.
                let n = unsafe {
                    libc::recv(
                        fd.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        libc::MSG_DONTWAIT,
                    )
                };
                if n > 0 {
                    frames2.fetch_add(1, Ordering::Relaxed);
                    if buf[..n as usize]
                        .windows(marker.len())
                        .any(|w| w == marker.as_slice())
                    {
                        found = true;
                    }
                }
            }
            found
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("sniffer ready");
        Self {
            stop,
            frames,
            thread: Some(thread),
        }
    }

    /// Stops and returns (marker seen, frames captured).
    pub fn finish(mut self) -> (bool, u64) {
        self.stop.store(true, Ordering::Relaxed);
        let found = self
            .thread
            .take()
            .is_some_and(|t| t.join().expect("sniffer thread"));
        (found, self.frames.load(Ordering::Relaxed))
    }
}

impl Drop for Sniffer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
