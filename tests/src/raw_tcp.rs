//! Hand-made TCP over raw IP sockets, for the `zt-raw` attacker binary.
//!
//! The privileged tests need a hostile client outside the mesh that does
//! what a normal `connect(2)` never does: split its SYN into IPv4 fragments
//! so that the first fragment carries the ports but not the TCP flags, or
//! hide TCP behind an IPv6 Destination Options header. A capture program that
//! only looks at "the TCP header right after the IP header" misses such a SYN.
//!
//! This module holds the pieces, each small and testable on its own:
//! - checksums (RFC 1071) with the IPv4 and IPv6 pseudo-headers;
//! - [`Segment`] encodes one TCP segment (no options), [`parse_tcp`] and
//!   [`ipv4_transport`] read what comes back, without trusting a single byte;
//! - [`ip_packets`] wraps a segment into the IP packets of one [`Shape`]
//!   (plain, 8-byte IPv4 fragments, IPv6 with Destination Options);
//! - [`RawSender`] (`IPPROTO_RAW`, header included) and [`RawReceiver`]
//!   (`SOCK_RAW`/`IPPROTO_TCP`, a copy of every incoming TCP segment);
//! - [`Outcome`], the one JSON line the binary prints, and its parser.
//!
//! The session itself (SYN, SYN-ACK, ACK, data, RST) lives in the binary,
//! `src/bin/zt-raw.rs`, which also keeps the attacker's own kernel from
//! answering the peer with RSTs.

use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::PathBuf,
    time::Instant,
};

/// TCP flag bits (byte 13 of the TCP header).
pub const FIN: u8 = 0x01;
/// See [`FIN`].
pub const SYN: u8 = 0x02;
/// See [`FIN`].
pub const RST: u8 = 0x04;
/// See [`FIN`].
pub const PSH: u8 = 0x08;
/// See [`FIN`].
pub const ACK: u8 = 0x10;

/// A TCP header without options: what every segment built here carries.
pub const TCP_HEADER_LEN: usize = 20;
/// An IPv4 header without options.
pub const IPV4_HEADER_LEN: usize = 20;
/// The fixed IPv6 header.
pub const IPV6_HEADER_LEN: usize = 40;
/// The Destination Options header of [`Shape::Destopts6`]: one PadN option.
pub const DESTOPTS_LEN: usize = 8;
/// IP protocol number / IPv6 next header of TCP.
pub const PROTO_TCP: u8 = 6;
/// IPv6 next header of a Destination Options header.
pub const NEXT_HEADER_DESTOPTS: u8 = 60;
/// Payload bytes per IPv4 fragment in [`Shape::Frag4`]: the smallest legal
/// fragment (offsets count 8-byte units), so the first fragment holds only
/// the ports and the sequence number, and the flags land in the second.
pub const FRAGMENT_PAYLOAD: usize = 8;
/// TTL / hop limit of every packet sent: Linux's default.
const HOP_LIMIT: u8 = 64;

/// How the attacker wraps its TCP segments into IP packets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Shape {
    /// One ordinary IPv4 or IPv6 packet per segment.
    Plain,
    /// IPv4 only: each segment split into fragments of
    /// [`FRAGMENT_PAYLOAD`] bytes.
    Frag4,
    /// IPv6 only: a Destination Options header (one PadN option) between
    /// the IPv6 header and TCP.
    Destopts6,
}

/// Source and destination address of one session, of one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddrPair {
    /// IPv4.
    V4 {
        /// The attacker's address.
        src: Ipv4Addr,
        /// The target's address.
        dst: Ipv4Addr,
    },
    /// IPv6.
    V6 {
        /// The attacker's address.
        src: Ipv6Addr,
        /// The target's address.
        dst: Ipv6Addr,
    },
}

impl AddrPair {
    /// `None` when the two addresses are of different families.
    pub fn new(src: IpAddr, dst: IpAddr) -> Option<Self> {
        match (src, dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => Some(Self::V4 { src, dst }),
            (IpAddr::V6(src), IpAddr::V6(dst)) => Some(Self::V6 { src, dst }),
            _ => None,
        }
    }

    /// Whether this is an IPv6 pair.
    pub fn is_v6(self) -> bool {
        matches!(self, Self::V6 { .. })
    }

    /// The target's address.
    pub fn dst(self) -> IpAddr {
        match self {
            Self::V4 { dst, .. } => IpAddr::V4(dst),
            Self::V6 { dst, .. } => IpAddr::V6(dst),
        }
    }

    /// Whether `shape` can be sent between these addresses.
    pub fn fits(self, shape: Shape) -> bool {
        match shape {
            Shape::Plain => true,
            Shape::Frag4 => !self.is_v6(),
            Shape::Destopts6 => self.is_v6(),
        }
    }
}

/// Adds `data` as big-endian 16-bit words (an odd last byte is padded with
/// zero, RFC 1071). `u64` so that no realistic length can overflow before
/// [`fold`].
fn sum_words(data: &[u8], mut acc: u64) -> u64 {
    let mut words = data.chunks_exact(2);
    for w in &mut words {
        acc += u64::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = words.remainder() {
        acc += u64::from(*last) << 8;
    }
    acc
}

/// Folds the carries back in and complements: the checksum field's value.
fn fold(mut acc: u64) -> u16 {
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// The Internet checksum (RFC 1071) of `data`, e.g. of an IPv4 header with
/// its checksum field zeroed. Over data that includes a correct checksum,
/// the result is 0.
pub fn checksum(data: &[u8]) -> u16 {
    fold(sum_words(data, 0))
}

/// The TCP checksum of `segment` (checksum field zeroed) under the IPv4
/// pseudo-header: source, destination, zero, protocol 6, TCP length.
pub fn tcp_checksum_v4(src: Ipv4Addr, dst: Ipv4Addr, segment: &[u8]) -> u16 {
    let mut acc = sum_words(&src.octets(), 0);
    acc = sum_words(&dst.octets(), acc);
    acc += u64::from(PROTO_TCP);
    acc += segment.len() as u64;
    fold(sum_words(segment, acc))
}

/// The TCP checksum of `segment` (checksum field zeroed) under the IPv6
/// pseudo-header (RFC 8200 section 8.1): source, destination, the
/// upper-layer length and next header 6. Extension headers between the IPv6
/// header and TCP are not part of it: the length is TCP's, the next header is
/// TCP's, whatever the IPv6 header's own next header field says.
pub fn tcp_checksum_v6(src: Ipv6Addr, dst: Ipv6Addr, segment: &[u8]) -> u16 {
    let mut acc = sum_words(&src.octets(), 0);
    acc = sum_words(&dst.octets(), acc);
    acc += segment.len() as u64;
    acc += u64::from(PROTO_TCP);
    fold(sum_words(segment, acc))
}

/// One outgoing TCP segment, without options.
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// Sequence number.
    pub seq: u32,
    /// Acknowledgment number (sent as is; meaningful with [`ACK`]).
    pub ack: u32,
    /// Flag bits ([`SYN`], [`ACK`], ...).
    pub flags: u8,
    /// Receive window.
    pub window: u16,
    /// Data.
    pub payload: &'a [u8],
}

impl Segment<'_> {
    /// The segment's bytes, checksummed for `addrs`.
    pub fn encode(&self, addrs: AddrPair) -> Vec<u8> {
        let mut out = Vec::with_capacity(TCP_HEADER_LEN + self.payload.len());
        out.extend_from_slice(&self.sport.to_be_bytes());
        out.extend_from_slice(&self.dport.to_be_bytes());
        out.extend_from_slice(&self.seq.to_be_bytes());
        out.extend_from_slice(&self.ack.to_be_bytes());
        out.push(((TCP_HEADER_LEN / 4) as u8) << 4); // data offset, in words
        out.push(self.flags);
        out.extend_from_slice(&self.window.to_be_bytes());
        out.extend_from_slice(&[0, 0, 0, 0]); // checksum (below), urgent pointer
        out.extend_from_slice(self.payload);
        let sum = match addrs {
            AddrPair::V4 { src, dst } => tcp_checksum_v4(src, dst, &out),
            AddrPair::V6 { src, dst } => tcp_checksum_v6(src, dst, &out),
        };
        out[16..18].copy_from_slice(&sum.to_be_bytes());
        out
    }
}

/// IPv4 flag: more fragments follow.
const IPV4_MF: u16 = 0x2000;
/// IPv4 flag: do not fragment.
const IPV4_DF: u16 = 0x4000;

/// An IPv4 header without options, with its checksum. `flags_offset` is the
/// 16-bit flags + fragment offset word (offset in 8-byte units).
pub fn ipv4_header(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    id: u16,
    flags_offset: u16,
    payload_len: usize,
) -> [u8; IPV4_HEADER_LEN] {
    let total = (IPV4_HEADER_LEN + payload_len) as u16;
    let mut h = [0u8; IPV4_HEADER_LEN];
    h[0] = 0x45; // version 4, 5 words
    h[2..4].copy_from_slice(&total.to_be_bytes());
    h[4..6].copy_from_slice(&id.to_be_bytes());
    h[6..8].copy_from_slice(&flags_offset.to_be_bytes());
    h[8] = HOP_LIMIT;
    h[9] = PROTO_TCP;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let sum = checksum(&h);
    h[10..12].copy_from_slice(&sum.to_be_bytes());
    h
}

/// The Destination Options header of [`Shape::Destopts6`]: next header,
/// length 0 (8 bytes in all), and one PadN option (type 1) padding the other
/// 6 bytes: a header any stack must skip and accept.
pub fn destopts_padn(next_header: u8) -> [u8; DESTOPTS_LEN] {
    [next_header, 0, 1, 4, 0, 0, 0, 0]
}

/// An IPv6 header; `payload_len` counts everything after it (extension
/// headers included).
pub fn ipv6_header(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    next_header: u8,
    payload_len: usize,
) -> [u8; IPV6_HEADER_LEN] {
    let mut h = [0u8; IPV6_HEADER_LEN];
    h[0] = 0x60; // version 6, traffic class and flow label 0
    h[4..6].copy_from_slice(&(payload_len as u16).to_be_bytes());
    h[6] = next_header;
    h[7] = HOP_LIMIT;
    h[8..24].copy_from_slice(&src.octets());
    h[24..40].copy_from_slice(&dst.octets());
    h
}

/// The IP packets that carry `segment` between `addrs` in `shape`; `ip_id`
/// is the IPv4 identification (every fragment of one segment shares it).
/// Empty when the shape does not fit the family (see [`AddrPair::fits`]).
pub fn ip_packets(addrs: AddrPair, shape: Shape, ip_id: u16, segment: &[u8]) -> Vec<Vec<u8>> {
    match (addrs, shape) {
        (AddrPair::V4 { src, dst }, Shape::Plain) => {
            let mut p = ipv4_header(src, dst, ip_id, IPV4_DF, segment.len()).to_vec();
            p.extend_from_slice(segment);
            vec![p]
        }
        (AddrPair::V4 { src, dst }, Shape::Frag4) => segment
            .chunks(FRAGMENT_PAYLOAD)
            .enumerate()
            .map(|(i, chunk)| {
                let offset_units = (i * FRAGMENT_PAYLOAD / 8) as u16;
                let last = (i + 1) * FRAGMENT_PAYLOAD >= segment.len();
                let flags = if last { 0 } else { IPV4_MF };
                let mut p =
                    ipv4_header(src, dst, ip_id, flags | offset_units, chunk.len()).to_vec();
                p.extend_from_slice(chunk);
                p
            })
            .collect(),
        (AddrPair::V6 { src, dst }, Shape::Plain) => {
            let mut p = ipv6_header(src, dst, PROTO_TCP, segment.len()).to_vec();
            p.extend_from_slice(segment);
            vec![p]
        }
        (AddrPair::V6 { src, dst }, Shape::Destopts6) => {
            let len = DESTOPTS_LEN + segment.len();
            let mut p = ipv6_header(src, dst, NEXT_HEADER_DESTOPTS, len).to_vec();
            p.extend_from_slice(&destopts_padn(PROTO_TCP));
            p.extend_from_slice(segment);
            vec![p]
        }
        (AddrPair::V4 { .. }, Shape::Destopts6) | (AddrPair::V6 { .. }, Shape::Frag4) => vec![],
    }
}

/// One received TCP segment, read from untrusted bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpView<'a> {
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// Sequence number.
    pub seq: u32,
    /// Acknowledgment number.
    pub ack: u32,
    /// Flag bits.
    pub flags: u8,
    /// Data after the header and its options.
    pub payload: &'a [u8],
}

/// Reads a TCP segment; `None` when it is too short or its data offset
/// points outside it. The checksum is not checked: over veth the sender's
/// checksum may legitimately still be a partial one (offload), and the
/// kernel has not validated it yet when raw sockets get their copy.
pub fn parse_tcp(segment: &[u8]) -> Option<TcpView<'_>> {
    let header = segment.get(..TCP_HEADER_LEN)?;
    let data_offset = usize::from(header[12] >> 4) * 4;
    if data_offset < TCP_HEADER_LEN {
        return None;
    }
    Some(TcpView {
        sport: u16::from_be_bytes([header[0], header[1]]),
        dport: u16::from_be_bytes([header[2], header[3]]),
        seq: u32::from_be_bytes([header[4], header[5], header[6], header[7]]),
        ack: u32::from_be_bytes([header[8], header[9], header[10], header[11]]),
        flags: header[13],
        payload: segment.get(data_offset..)?,
    })
}

/// What an `AF_INET` raw socket hands over: the IPv4 header, then TCP.
/// Returns source, destination and the TCP bytes; `None` for anything that
/// is not a whole, unfragmented IPv4 TCP packet (the kernel reassembles
/// before raw delivery, so a fragment here would be a surprise, not data).
pub fn ipv4_transport(packet: &[u8]) -> Option<(Ipv4Addr, Ipv4Addr, &[u8])> {
    let first = *packet.first()?;
    let header_len = usize::from(first & 0x0f) * 4;
    if first >> 4 != 4 || header_len < IPV4_HEADER_LEN || packet.len() < header_len {
        return None;
    }
    let total = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
    let flags_offset = u16::from_be_bytes([packet[6], packet[7]]);
    if packet[9] != PROTO_TCP || flags_offset & (IPV4_MF | 0x1fff) != 0 || total < header_len {
        return None;
    }
    let src = Ipv4Addr::new(packet[12], packet[13], packet[14], packet[15]);
    let dst = Ipv4Addr::new(packet[16], packet[17], packet[18], packet[19]);
    // Trailing bytes past the total length (Ethernet padding) are not TCP.
    Some((src, dst, packet.get(header_len..total)?))
}

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
        Ok(Self { fd })
    }

    /// Sends one packet to `dst` (the address only picks the route; the
    /// header inside `packet` is what goes on the wire).
    pub fn send(&self, packet: &[u8], dst: IpAddr) -> io::Result<()> {
        let addr = SockAddr::new(dst);
        let (ptr, len): (*const libc::sockaddr, usize) = match &addr {
            SockAddr::V4(sa) => ((&raw const *sa).cast(), size_of::<libc::sockaddr_in>()),
            SockAddr::V6(sa) => ((&raw const *sa).cast(), size_of::<libc::sockaddr_in6>()),
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
            Err(_) => Err(io::Error::last_os_error()),
        }
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

/// Random bytes from the kernel (getrandom(2)): initial sequence numbers,
/// IP ids and ports must not repeat between runs.
pub fn random_u32() -> io::Result<u32> {
    let mut bytes = [0u8; 4];
    // SAFETY: a writable buffer of the length passed.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n == 4 {
        Ok(u32::from_ne_bytes(bytes))
    } else {
        Err(io::Error::last_os_error())
    }
}

/// What one `zt-raw` session saw; printed as one JSON line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// The target answered the SYN with a SYN-ACK.
    pub syn_ack: bool,
    /// Data the target sent back (lossy UTF-8; may be empty).
    pub data: String,
    /// The target closed its side (FIN).
    pub fin: bool,
    /// The target reset the connection (to the SYN or later).
    pub rst: bool,
    /// The attacker's source port.
    pub sport: u16,
}

impl Outcome {
    /// The JSON line, fields in a fixed order (no trailing newline).
    pub fn to_json_line(&self) -> String {
        format!(
            r#"{{"syn_ack":{},"data":{},"fin":{},"rst":{},"sport":{}}}"#,
            self.syn_ack,
            serde_json::Value::String(self.data.clone()),
            self.fin,
            self.rst,
            self.sport
        )
    }

    /// Reads the line `zt-raw` printed; `None` if it is not one.
    pub fn parse(line: &str) -> Option<Self> {
        let v: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
        Some(Self {
            syn_ack: v.get("syn_ack")?.as_bool()?,
            data: v.get("data")?.as_str()?.to_owned(),
            fin: v.get("fin")?.as_bool()?,
            rst: v.get("rst")?.as_bool()?,
            sport: u16::try_from(v.get("sport")?.as_u64()?).ok()?,
        })
    }
}

/// Path of the `zt-raw` binary, next to the running test binary's target
/// directory (like [`crate::probe_bin`]).
pub fn bin_path() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe dir");
    let dir = if dir.ends_with("deps") {
        dir.parent().expect("target dir")
    } else {
        dir
    };
    let bin = dir.join("zt-raw");
    assert!(
        bin.is_file(),
        "{} missing: build the ztunnel-tests package's binaries",
        bin.display()
    );
    bin
}

/// The socket address form of a pair's target, for messages.
pub fn target(addrs: AddrPair, port: u16) -> SocketAddr {
    match addrs {
        AddrPair::V4 { dst, .. } => SocketAddr::V4(SocketAddrV4::new(dst, port)),
        AddrPair::V6 { dst, .. } => SocketAddr::V6(SocketAddrV6::new(dst, port, 0, 0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V4: AddrPair = AddrPair::V4 {
        src: Ipv4Addr::new(10, 250, 0, 1),
        dst: Ipv4Addr::new(10, 250, 0, 2),
    };

    fn syn() -> Segment<'static> {
        Segment {
            sport: 40001,
            dport: 8080,
            seq: 0x0102_0304,
            ack: 0,
            flags: SYN,
            window: 65535,
            payload: &[],
        }
    }

    #[test]
    fn checksum_matches_rfc1071_example() {
        // RFC 1071 section 3: the words sum to 0xddf2, so the checksum is
        // its complement.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(checksum(&data), !0xddf2);
        // An odd length pads the last byte on the right.
        assert_eq!(checksum(&[0x12]), !0x1200);
    }

    #[test]
    fn ipv4_header_checksum_matches_known_header() {
        // The textbook header 192.168.0.1 -> 192.168.0.199, UDP, total
        // length 0x73, DF, whose checksum is 0xb861.
        let h = ipv4_header(
            Ipv4Addr::new(192, 168, 0, 1),
            Ipv4Addr::new(192, 168, 0, 199),
            0,
            IPV4_DF,
            0x73 - IPV4_HEADER_LEN,
        );
        let mut udp = h;
        udp[9] = 17; // the known header is UDP; ours says TCP
        udp[10..12].copy_from_slice(&[0, 0]);
        assert_eq!(checksum(&udp), 0xb861);
        assert_eq!(checksum(&h), 0, "our own header verifies");
    }

    #[test]
    fn tcp_checksum_v4_matches_known_segment() {
        // smoltcp's TCP test segment: 192.168.1.1 -> 192.168.1.2, ports
        // 48896 -> 80, with one option and 4 data bytes; checksum 0x01b6.
        let mut segment = [
            0xbf, 0x00, 0x00, 0x50, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x60, 0x35,
            0x01, 0x23, 0x00, 0x00, 0x02, 0x01, 0x03, 0x03, 0x0c, 0x01, 0xaa, 0x00, 0x00, 0xff,
        ];
        let (src, dst) = (Ipv4Addr::new(192, 168, 1, 1), Ipv4Addr::new(192, 168, 1, 2));
        assert_eq!(tcp_checksum_v4(src, dst, &segment), 0x01b6);
        segment[16..18].copy_from_slice(&[0x01, 0xb6]);
        assert_eq!(tcp_checksum_v4(src, dst, &segment), 0, "verifies");
    }

    #[test]
    fn tcp_checksum_v6_uses_upper_layer_length_and_tcp() {
        // Computed independently (a few lines of Python summing the RFC 8200
        // pseudo-header and the segment) for fd00:250::1 -> fd00:250::2.
        let addrs = AddrPair::V6 {
            src: "fd00:250::1".parse().unwrap(),
            dst: "fd00:250::2".parse().unwrap(),
        };
        let bytes = syn().encode(addrs);
        assert_eq!(u16::from_be_bytes([bytes[16], bytes[17]]), 0xf166);
        let AddrPair::V6 { src, dst } = addrs else {
            unreachable!()
        };
        assert_eq!(tcp_checksum_v6(src, dst, &bytes), 0, "verifies");
        // The Destination Options header changes nothing in the checksum.
        let packet = &ip_packets(addrs, Shape::Destopts6, 0, &bytes)[0];
        assert_eq!(&packet[IPV6_HEADER_LEN + DESTOPTS_LEN..], &bytes[..]);
    }

    #[test]
    fn segment_layout() {
        let bytes = syn().encode(V4);
        assert_eq!(bytes.len(), TCP_HEADER_LEN);
        assert_eq!(&bytes[..4], &[0x9c, 0x41, 0x1f, 0x90]);
        assert_eq!(&bytes[4..8], &[1, 2, 3, 4]);
        assert_eq!(bytes[12], 0x50);
        assert_eq!(bytes[13], SYN);
        let view = parse_tcp(&bytes).unwrap();
        assert_eq!(
            (view.sport, view.dport, view.seq),
            (40001, 8080, 0x0102_0304)
        );
        assert_eq!(view.flags, SYN);
        assert!(view.payload.is_empty());
    }

    #[test]
    fn frag4_splits_the_syn_into_three_8_byte_fragments() {
        let segment = syn().encode(V4);
        let frags = ip_packets(V4, Shape::Frag4, 0x1234, &segment);
        assert_eq!(frags.len(), 3);
        let mut reassembled = Vec::new();
        for (i, frag) in frags.iter().enumerate() {
            let word = u16::from_be_bytes([frag[6], frag[7]]);
            let more = word & IPV4_MF != 0;
            assert_eq!(usize::from(word & 0x1fff), i, "offset in 8-byte units");
            assert_eq!(more, i < 2, "MF on all but the last");
            assert_eq!(word & IPV4_DF, 0, "fragments never say DF");
            assert_eq!(u16::from_be_bytes([frag[4], frag[5]]), 0x1234, "one id");
            let total = usize::from(u16::from_be_bytes([frag[2], frag[3]]));
            assert_eq!(total, frag.len());
            assert_eq!(checksum(&frag[..IPV4_HEADER_LEN]), 0, "header checksum");
            reassembled.extend_from_slice(&frag[IPV4_HEADER_LEN..]);
        }
        let lens: Vec<usize> = frags.iter().map(|f| f.len() - IPV4_HEADER_LEN).collect();
        assert_eq!(lens, [8, 8, 4]);
        assert_eq!(reassembled, segment);
        // The first fragment holds ports and sequence number, not the flags.
        assert_eq!(&frags[0][IPV4_HEADER_LEN..], &segment[..8]);
        assert_eq!(frags[1][IPV4_HEADER_LEN + 13 - 8], SYN);
    }

    #[test]
    fn frag4_data_segment_and_plain_v4() {
        let data = Segment {
            flags: PSH | ACK,
            payload: b"HELLO\n",
            ..syn()
        }
        .encode(V4);
        let frags = ip_packets(V4, Shape::Frag4, 7, &data);
        let lens: Vec<usize> = frags.iter().map(|f| f.len() - IPV4_HEADER_LEN).collect();
        assert_eq!(lens, [8, 8, 8, 2]);
        let plain = &ip_packets(V4, Shape::Plain, 7, &data)[0];
        assert_eq!(u16::from_be_bytes([plain[6], plain[7]]), IPV4_DF);
        let (src, dst, tcp) = ipv4_transport(plain).unwrap();
        assert_eq!((IpAddr::V4(dst), tcp), (V4.dst(), &data[..]));
        assert_eq!(src, Ipv4Addr::new(10, 250, 0, 1));
        assert!(
            ipv4_transport(&frags[0]).is_none(),
            "fragments are not data"
        );
    }

    #[test]
    fn destopts6_header_bytes() {
        assert_eq!(destopts_padn(PROTO_TCP), [6, 0, 1, 4, 0, 0, 0, 0]);
        let addrs = AddrPair::V6 {
            src: Ipv6Addr::LOCALHOST,
            dst: Ipv6Addr::LOCALHOST,
        };
        let segment = syn().encode(addrs);
        let packet = &ip_packets(addrs, Shape::Destopts6, 0, &segment)[0];
        assert_eq!(
            packet.len(),
            IPV6_HEADER_LEN + DESTOPTS_LEN + TCP_HEADER_LEN
        );
        assert_eq!(packet[0] >> 4, 6);
        assert_eq!(u16::from_be_bytes([packet[4], packet[5]]), 28, "ext + TCP");
        assert_eq!(packet[6], NEXT_HEADER_DESTOPTS);
        assert_eq!(packet[7], HOP_LIMIT);
        assert_eq!(&packet[40..48], &destopts_padn(PROTO_TCP));
        let plain = &ip_packets(addrs, Shape::Plain, 0, &segment)[0];
        assert_eq!((plain[6], plain.len()), (PROTO_TCP, 60));
    }

    #[test]
    fn shapes_fit_their_family_only() {
        assert!(ip_packets(V4, Shape::Destopts6, 1, &[0; 20]).is_empty());
        assert!(!V4.fits(Shape::Destopts6) && V4.fits(Shape::Frag4));
        let v6 = AddrPair::new("::1".parse().unwrap(), "::1".parse().unwrap()).unwrap();
        assert!(!v6.fits(Shape::Frag4) && v6.fits(Shape::Destopts6));
        assert!(AddrPair::new("::1".parse().unwrap(), V4.dst()).is_none());
    }

    #[test]
    fn parsers_reject_malformed_input_without_panicking() {
        assert!(parse_tcp(&[0; 19]).is_none());
        let mut bad_offset = [0u8; 20];
        bad_offset[12] = 0x40; // 16 bytes: shorter than the fixed header
        assert!(parse_tcp(&bad_offset).is_none());
        bad_offset[12] = 0xf0; // 60 bytes: longer than the segment
        assert!(parse_tcp(&bad_offset).is_none());
        assert!(ipv4_transport(&[]).is_none());
        assert!(ipv4_transport(&[0x4f; 20]).is_none(), "IHL past the end");
        let mut short_total = ip_packets(V4, Shape::Plain, 1, &[0; 20]).remove(0);
        short_total[2..4].copy_from_slice(&10u16.to_be_bytes());
        assert!(ipv4_transport(&short_total).is_none());
        let mut long_total = ip_packets(V4, Shape::Plain, 1, &[0; 20]).remove(0);
        long_total[2..4].copy_from_slice(&100u16.to_be_bytes());
        assert!(ipv4_transport(&long_total).is_none());
        // Every prefix of a real packet, and of garbage, parses or not,
        // but never panics.
        let real = ip_packets(V4, Shape::Plain, 1, &syn().encode(V4)).remove(0);
        for n in 0..=real.len() {
            let _ = ipv4_transport(&real[..n]).and_then(|(_, _, t)| parse_tcp(t));
            let _ = parse_tcp(&real[..n]);
        }
    }

    #[test]
    fn outcome_round_trips_through_its_json_line() {
        let out = Outcome {
            syn_ack: true,
            data: "HELLO\n\"x\"".into(),
            fin: false,
            rst: true,
            sport: 40001,
        };
        let line = out.to_json_line();
        assert_eq!(
            line,
            r#"{"syn_ack":true,"data":"HELLO\n\"x\"","fin":false,"rst":true,"sport":40001}"#
        );
        assert_eq!(Outcome::parse(&line), Some(out));
        assert_eq!(Outcome::parse("READY"), None);
    }
}
