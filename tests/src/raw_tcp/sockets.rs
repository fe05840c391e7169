//! The two raw sockets of a session: [`RawSender`] puts whole IP packets the
//! caller built on the wire, [`RawReceiver`] gets a copy of every TCP segment
//! that arrives, with its sender's address. Every wait is bounded by the
//! caller's deadline.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Instant,
};

use super::ipv4_transport;

/// Opens a socket and takes ownership of its fd.
fn socket(domain: i32, kind: i32, protocol: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe { libc::socket(domain, kind | libc::SOCK_CLOEXEC, protocol) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sets an integer socket option.
fn set_int(fd: &OwnedFd, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: valid fd, and a pointer to an int of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&raw const value).cast(),
            size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Owns a `sockaddr_in`/`sockaddr_in6` for sendto(2).
enum SockAddr {
    V4(libc::sockaddr_in),
    V6(libc::sockaddr_in6),
}

impl SockAddr {
    /// Port 0: raw sockets read the port field as a protocol number, and 0
    /// means "the socket's own".
    fn new(addr: IpAddr) -> Self {
        match addr {
            IpAddr::V4(a) => {
                // SAFETY: all-zero is a valid sockaddr_in.
                let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
                sa.sin_family = libc::AF_INET as libc::sa_family_t;
                sa.sin_addr.s_addr = u32::from_ne_bytes(a.octets());
                Self::V4(sa)
            }
            IpAddr::V6(a) => {
                // SAFETY: all-zero is a valid sockaddr_in6.
                let mut sa: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
                sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                sa.sin6_addr.s6_addr = a.octets();
                Self::V6(sa)
            }
        }
    }
}

/// Sends whole IP packets the caller built (header included), so the
/// kernel adds nothing and fragments nothing.
pub struct RawSender {
    fd: OwnedFd,
    /// For a packet socket: the link to send on.
    link: Option<libc::sockaddr_ll>,
}

impl RawSender {
    /// An `IPPROTO_RAW` socket of the family of `v6`, with the header
    /// included and every packet marked with `mark` (`SO_MARK`), so a
    /// firewall rule can tell these packets from the kernel's own.
    pub fn open(v6: bool, mark: u32) -> io::Result<Self> {
        let (domain, level, hdrincl) = if v6 {
            (libc::AF_INET6, libc::IPPROTO_IPV6, libc::IPV6_HDRINCL)
        } else {
            (libc::AF_INET, libc::IPPROTO_IP, libc::IP_HDRINCL)
        };
        let fd = socket(domain, libc::SOCK_RAW, libc::IPPROTO_RAW)?;
        // IPPROTO_RAW implies it on Linux; saying it costs nothing.
        set_int(&fd, level, hdrincl, 1)?;
        set_int(&fd, libc::SOL_SOCKET, libc::SO_MARK, mark as i32)?;
        Ok(Self { fd, link: None })
    }

    /// A packet socket (`AF_PACKET`, `SOCK_DGRAM`: the kernel adds the
    /// Ethernet header) that sends on interface `ifindex` to `mac`. Its
    /// packets pass no IP layer and no netfilter hook of the sender's.
    pub fn open_packet(v6: bool, ifindex: u32, mac: [u8; 6]) -> io::Result<Self> {
        let ethertype: u16 = if v6 { 0x86dd } else { 0x0800 };
        let fd = socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM,
            i32::from(ethertype.to_be()),
        )?;
        // SAFETY: all-zero is a valid sockaddr_ll.
        let mut link: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        link.sll_family = libc::AF_PACKET as u16;
        link.sll_protocol = ethertype.to_be();
        link.sll_ifindex = ifindex as i32;
        link.sll_halen = 6;
        link.sll_addr[..6].copy_from_slice(&mac);
        Ok(Self {
            fd,
            link: Some(link),
        })
    }

    /// Sends one packet to `dst` (the address only picks the route; the
    /// header inside `packet` is what goes on the wire).
    pub fn send(&self, packet: &[u8], dst: IpAddr) -> io::Result<()> {
        let addr = SockAddr::new(dst);
        let (ptr, len): (*const libc::sockaddr, usize) = match (&self.link, &addr) {
            (Some(link), _) => ((&raw const *link).cast(), size_of::<libc::sockaddr_ll>()),
            (None, SockAddr::V4(sa)) => ((&raw const *sa).cast(), size_of::<libc::sockaddr_in>()),
            (None, SockAddr::V6(sa)) => ((&raw const *sa).cast(), size_of::<libc::sockaddr_in6>()),
        };
        // SAFETY: valid fd; buffer and address with their true lengths.
        let sent = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                ptr,
                len as libc::socklen_t,
            )
        };
        match usize::try_from(sent) {
            Ok(n) if n == packet.len() => Ok(()),
            Ok(n) => Err(io::Error::other(format!(
                "short raw send: {n} of {} bytes",
                packet.len()
            ))),
            Err(_) => {
                let error = io::Error::last_os_error();
                // A packet socket's send goes straight to the device queue,
                // and the kernel reports a packet that a TC program dropped
                // there as ENOBUFS. For the session that is a packet lost
                // on the way, which is what the caller wants to observe.
                if self.link.is_some() && error.raw_os_error() == Some(libc::ENOBUFS) {
                    Ok(())
                } else {
                    Err(error)
                }
            }
        }
    }
}

/// The link-layer address of `dst` on `iface`, from the neighbour table.
/// Until it is there, a UDP datagram to `dst`'s discard port makes the
/// kernel resolve it (ARP or neighbour discovery); bounded by `limit`.
pub fn neighbour_mac(dst: IpAddr, iface: &str, limit: std::time::Duration) -> io::Result<[u8; 6]> {
    let deadline = Instant::now() + limit;
    let unspecified: IpAddr = if dst.is_ipv6() {
        Ipv6Addr::UNSPECIFIED.into()
    } else {
        Ipv4Addr::UNSPECIFIED.into()
    };
    let nudge = std::net::UdpSocket::bind((unspecified, 0))?;
    loop {
        let out = std::process::Command::new("ip")
            .args(["neigh", "show", "to", &dst.to_string(), "dev", iface])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        if let Some(mac) = text
            .split_whitespace()
            .skip_while(|w| *w != "lladdr")
            .nth(1)
            .and_then(parse_mac)
        {
            return Ok(mac);
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no neighbour entry for {dst} on {iface}: {text:?}"),
            ));
        }
        let _ = nudge.send_to(b"?", (dst, 9));
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// `aa:bb:cc:dd:ee:ff` as six bytes.
fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        *byte = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// The index of interface `iface` in this namespace.
pub fn ifindex(iface: &str) -> io::Result<u32> {
    let name = std::ffi::CString::new(iface).map_err(io::Error::other)?;
    // SAFETY: a NUL-terminated name.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(index)
    }
}

/// Receives a copy of every TCP segment addressed to this namespace (the
/// kernel's TCP still gets the original).
pub struct RawReceiver {
    fd: OwnedFd,
    v6: bool,
}

impl RawReceiver {
    /// A `SOCK_RAW`/`IPPROTO_TCP` socket of the family of `v6`. IPv4 raw
    /// sockets deliver the IP header too; IPv6 ones deliver only what
    /// follows the IPv6 header and its extension headers.
    pub fn open(v6: bool) -> io::Result<Self> {
        let domain = if v6 { libc::AF_INET6 } else { libc::AF_INET };
        let fd = socket(domain, libc::SOCK_RAW, libc::IPPROTO_TCP)?;
        Ok(Self { fd, v6 })
    }

    /// Waits until `deadline` for one packet; returns its sender and its TCP
    /// bytes (`Ok(None)` on timeout). Packets that are not TCP-shaped are
    /// returned with an empty slice rather than skipped, so one call never
    /// waits for more than one packet: the caller counts them.
    pub fn recv<'b>(
        &self,
        buf: &'b mut [u8],
        deadline: Instant,
    ) -> io::Result<Option<(IpAddr, &'b [u8])>> {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Ok(None);
        }
        let mut pfd = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // Round up so a sub-millisecond remainder still waits, not spins.
        let ms = i32::try_from(remaining.as_millis() + 1).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd; the wait is bounded by `ms`.
        match unsafe { libc::poll(&raw mut pfd, 1, ms) } {
            0 => return Ok(None),
            n if n < 0 => return Err(io::Error::last_os_error()),
            _ => {}
        }
        // SAFETY: all-zero is a valid sockaddr_storage.
        let mut from: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut from_len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: valid fd, buffer and address storage with their true sizes;
        // MSG_DONTWAIT so a packet that vanished since poll cannot block us.
        let n = unsafe {
            libc::recvfrom(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
                (&raw mut from).cast(),
                &raw mut from_len,
            )
        };
        let Ok(n) = usize::try_from(n) else {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => {
                    Ok(Some((IpAddr::V4(Ipv4Addr::UNSPECIFIED), &[])))
                }
                _ => Err(e),
            };
        };
        let packet = &buf[..n.min(buf.len())];
        if self.v6 {
            // SAFETY: the kernel filled an AF_INET6 socket's peer address,
            // a sockaddr_in6, which fits in sockaddr_storage.
            let sa: libc::sockaddr_in6 = unsafe { std::ptr::read((&raw const from).cast()) };
            Ok(Some((
                IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr)),
                packet,
            )))
        } else {
            Ok(Some(ipv4_transport(packet).map_or(
                (IpAddr::V4(Ipv4Addr::UNSPECIFIED), &[][..]),
                |(src, _dst, tcp)| (IpAddr::V4(src), tcp),
            )))
        }
    }
}
