//! Hand-made TCP over raw IP sockets, for the `zt-raw` attacker binary.
//!
//! The privileged tests need a hostile client outside the mesh that does
//! what a normal `connect(2)` never does: split its SYN into IPv4 fragments
//! so that the first fragment carries the ports but not the TCP flags, or
//! hide TCP behind an IPv6 Destination Options header. A capture program that
//! only looks at "the TCP header right after the IP header" misses such a SYN.
//!
//! The parts, each small and testable on its own, in the order a segment
//! goes out and an answer comes back:
//! - `addrs`: [`AddrPair`], the two ends of one session, of one family;
//! - `checksum`: the Internet checksum (RFC 1071), plain and under the IPv4
//!   and IPv6 pseudo-headers;
//! - `segment`: the TCP flags and [`Segment`], which encodes one TCP segment
//!   (no options) checksummed for an [`AddrPair`];
//! - `shape`: [`ip_packets`] wraps the encoded segment into the IP packets of
//!   one [`Shape`] (plain, 8-byte IPv4 fragments, IPv6 with a Destination
//!   Options header), with the IPv4/IPv6 header builders it uses;
//! - `sockets`: [`RawSender`] (`IPPROTO_RAW`, header included) puts those
//!   packets on the wire, [`RawReceiver`] (`SOCK_RAW`/`IPPROTO_TCP`) gets a
//!   copy of every incoming TCP segment;
//! - `parse`: [`ipv4_transport`] and [`parse_tcp`] read what the receiver
//!   got, without trusting a single byte;
//! - `rst_filter`: the firewall rule that keeps the attacker's own kernel
//!   from answering the target with RSTs while a session runs, and the check
//!   that refuses to install it in the host's network namespace;
//! - `session`: [`run`] drives one [`SessionPlan`] (SYN, SYN-ACK, ACK, data,
//!   RST) over the two sockets, inside the filter, and says what happened;
//! - `outcome`: [`Outcome`], the one JSON line the binary prints, and its
//!   parser for the tests, with [`bin_path`] to find the binary.
//!
//! The binary, `src/bin/zt-raw.rs`, only checks its command line into a
//! [`SessionPlan`], turns signals into the flag [`run`] watches, and prints
//! the [`Outcome`].

mod addrs;
mod checksum;
mod outcome;
mod parse;
mod rst_filter;
mod segment;
mod session;
mod shape;
mod sockets;

pub use addrs::{AddrPair, target};
pub use checksum::{checksum, tcp_checksum_v4, tcp_checksum_v6};
pub use outcome::{Outcome, bin_path};
pub use parse::{TcpView, ipv4_transport, parse_tcp};
pub use segment::{ACK, FIN, PROTO_TCP, PSH, RST, SYN, Segment, TCP_HEADER_LEN};
pub use session::{SessionPlan, Via, random_u32, run};
pub use shape::{
    DESTOPTS_LEN, FRAGMENT_PAYLOAD, IPV4_HEADER_LEN, IPV6_HEADER_LEN, NEXT_HEADER_DESTOPTS, Shape,
    destopts_padn, ip_packets, ipv4_header, ipv6_header,
};
pub use sockets::{RawReceiver, RawSender};

/// Test data shared by the parts' unit tests.
#[cfg(test)]
mod fixtures {
    use std::net::Ipv4Addr;

    use super::{AddrPair, SYN, Segment};

    /// An IPv4 pair on a made-up link.
    pub(super) const V4: AddrPair = AddrPair::V4 {
        src: Ipv4Addr::new(10, 250, 0, 1),
        dst: Ipv4Addr::new(10, 250, 0, 2),
    };

    /// A SYN without data: 20 bytes of TCP.
    pub(super) fn syn() -> Segment<'static> {
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
}
