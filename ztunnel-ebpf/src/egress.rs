//! TC egress on an enrolled pod's `eth0` (tcx link, first in the chain, where
//! the kernel has it; else a clsact filter with ztunnel's own priority):
//! drops TCP that no TCP socket sent.
//!
//! The connect hooks capture every TCP `connect()` of the pod, but a process
//! with `CAP_NET_RAW` (a container runtime's default) does not need one: a
//! raw IP socket (`IP_HDRINCL`) or a packet socket writes a SYN and then its
//! data straight onto the wire, around ztunnel. What TCP itself sends always
//! belongs to a TCP socket (ztunnel's, or an application's on an excluded
//! port or CIDR) or to the kernel on behalf of one (a request socket's
//! SYN-ACK, a `TIME_WAIT` socket's ACK): those pass. Everything else that
//! carries TCP comes from a raw or packet socket, and only what cannot open
//! a connection or carry a byte passes: a segment without SYN and without
//! payload (the kernel's own resets and ACKs for segments that match no
//! socket go out on a raw control socket, so a rule on the socket alone
//! would drop them). TCP that the program cannot see into from such a
//! socket (IP fragments, an IPv6 fragment header, too many extension
//! headers, IP-in-IP, GRE, ESP, a VLAN tag) is dropped as well.
//!
//! The packet starts with an Ethernet header: userspace attaches the
//! program only to an Ethernet interface (an L3 device would put the IP
//! header where this reads the EtherType) and refuses the enrolment
//! otherwise. What stays possible is written down in docs/threat-model.md:
//! a packet socket with `PACKET_QDISC_BYPASS`, and AF_XDP, skip TC egress
//! altogether.

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, bpf_sock},
    helpers::generated::bpf_sk_fullsock,
    macros::classifier,
    programs::TcContext,
};
use ztunnel_common::{AF_INET, AF_INET6, Counter};

use crate::{
    maps::count,
    net::{ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IP_MF_OR_OFFSET, IPPROTO_TCP, TC_ACT_UNSPEC},
};

/// 802.1Q and 802.1ad: a tag in front of the IP header.
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const SOCK_STREAM: u32 = 1;
/// Protocols that can carry TCP inside where this program does not look:
/// IPv4-in-IP, IPv6-in-IP, GRE, ESP.
const ENCAPSULATIONS: [u8; 4] = [4, 41, 47, 50];
/// IPv6 extension headers walked over: hop-by-hop, routing, destination
/// options (length in 8-octet units past the first 8), authentication
/// (length in 4-octet units past the first 8).
const IPV6_HOP_BY_HOP: u8 = 0;
const IPV6_ROUTING: u8 = 43;
const IPV6_FRAGMENT: u8 = 44;
const IPV6_DEST_OPTS: u8 = 60;
const IPV6_AUTH: u8 = 51;
/// Extension headers walked at most; a packet with more is not looked into.
const MAX_IPV6_EXT: usize = 4;
const TCP_FLAG_SYN: u8 = 0x02;

#[classifier]
pub fn guard_egress(ctx: TcContext) -> i32 {
    match decide(&ctx) {
        Verdict::Pass => TC_ACT_UNSPEC,
        Verdict::ForeignTcp => {
            count(Counter::EgressForeignTcpDropped);
            TC_ACT_SHOT
        }
        Verdict::Hidden => {
            count(Counter::EgressHiddenDropped);
            TC_ACT_SHOT
        }
    }
}

enum Verdict {
    Pass,
    /// A SYN or a payload from a socket that is not a TCP socket.
    ForeignTcp,
    /// From such a socket, with a transport this program cannot see.
    Hidden,
}

#[inline(always)]
fn decide(ctx: &TcContext) -> Verdict {
    // SAFETY: the live context; the verifier checks the access.
    if unsafe { from_tcp_or_kernel(ctx.skb.skb) } {
        return Verdict::Pass;
    }
    let Ok(ethertype) = ctx.load::<u16>(12) else {
        return Verdict::Pass;
    };
    match u16::from_be(ethertype) {
        ETH_P_IP => ipv4(ctx),
        ETH_P_IPV6 => ipv6(ctx),
        ETH_P_8021Q | ETH_P_8021AD => Verdict::Hidden,
        _ => Verdict::Pass,
    }
}

/// Whether the packet's socket is a TCP socket (or a request socket, whose
/// full socket is its listener), or it has none (a `TIME_WAIT` socket, or
/// no socket at all: forwarded or made by the kernel).
///
/// # Safety
/// `skb` must be the program's context.
#[inline(never)]
unsafe fn from_tcp_or_kernel(skb: *mut aya_ebpf::bindings::__sk_buff) -> bool {
    // SAFETY: the context field the kernel exposes to TC programs.
    let sk = unsafe { (*skb).__bindgen_anon_2.sk };
    if sk.is_null() {
        return true;
    }
    // SAFETY: a non-null socket pointer from the context.
    let full: *mut bpf_sock = unsafe { bpf_sk_fullsock(sk) };
    if full.is_null() {
        return true;
    }
    // SAFETY: a full socket: every `bpf_sock` field may be read.
    let (family, kind, protocol) = unsafe { ((*full).family, (*full).type_, (*full).protocol) };
    (family == u32::from(AF_INET) || family == u32::from(AF_INET6))
        && kind == SOCK_STREAM
        && protocol == u32::from(IPPROTO_TCP)
}

#[inline(always)]
fn ipv4(ctx: &TcContext) -> Verdict {
    let (Ok(vihl), Ok(total_be), Ok(frag_be), Ok(proto)) = (
        ctx.load::<u8>(ETH_HLEN),
        ctx.load::<u16>(ETH_HLEN + 2),
        ctx.load::<u16>(ETH_HLEN + 6),
        ctx.load::<u8>(ETH_HLEN + 9),
    ) else {
        return Verdict::Hidden;
    };
    if ENCAPSULATIONS.contains(&proto) {
        return Verdict::Hidden;
    }
    if proto != IPPROTO_TCP {
        return Verdict::Pass;
    }
    if u16::from_be(frag_be) & IP_MF_OR_OFFSET != 0 {
        return Verdict::Hidden;
    }
    let header = usize::from(vihl & 0x0f) * 4;
    let total = usize::from(u16::from_be(total_be));
    // A total length of 0 (what BIG TCP puts in its giant segments, which
    // receivers size by the packet instead) hides the payload's size.
    if total == 0 {
        return Verdict::Hidden;
    }
    tcp(ctx, ETH_HLEN + header, total.saturating_sub(header))
}

#[inline(always)]
fn ipv6(ctx: &TcContext) -> Verdict {
    let (Ok(payload_be), Ok(mut next)) =
        (ctx.load::<u16>(ETH_HLEN + 4), ctx.load::<u8>(ETH_HLEN + 6))
    else {
        return Verdict::Hidden;
    };
    let payload = usize::from(u16::from_be(payload_be));
    // Payload length 0 with a hop-by-hop header is a jumbogram, whose size
    // is in an option this program does not read.
    if payload == 0 {
        return Verdict::Hidden;
    }
    let mut offset = ETH_HLEN + 40;
    let mut used = 0usize;
    for _ in 0..MAX_IPV6_EXT {
        let length = match next {
            IPV6_HOP_BY_HOP | IPV6_ROUTING | IPV6_DEST_OPTS => {
                let Ok(units) = ctx.load::<u8>(offset + 1) else {
                    return Verdict::Hidden;
                };
                (usize::from(units) + 1) * 8
            }
            IPV6_AUTH => {
                let Ok(units) = ctx.load::<u8>(offset + 1) else {
                    return Verdict::Hidden;
                };
                (usize::from(units) + 2) * 4
            }
            IPV6_FRAGMENT => return Verdict::Hidden,
            IPPROTO_TCP => return tcp(ctx, offset, payload.saturating_sub(used)),
            other if ENCAPSULATIONS.contains(&other) => return Verdict::Hidden,
            _ => return Verdict::Pass,
        };
        let Ok(following) = ctx.load::<u8>(offset) else {
            return Verdict::Hidden;
        };
        next = following;
        offset += length;
        used += length;
    }
    match next {
        IPV6_HOP_BY_HOP | IPV6_ROUTING | IPV6_DEST_OPTS | IPV6_AUTH | IPV6_FRAGMENT
        | IPPROTO_TCP => Verdict::Hidden,
        other if ENCAPSULATIONS.contains(&other) => Verdict::Hidden,
        _ => Verdict::Pass,
    }
}

/// A TCP segment at `offset` whose IP payload is `segment` bytes: passes
/// only without SYN and without payload.
#[inline(always)]
fn tcp(ctx: &TcContext, offset: usize, segment: usize) -> Verdict {
    let (Ok(data_offset), Ok(flags)) = (ctx.load::<u8>(offset + 12), ctx.load::<u8>(offset + 13))
    else {
        return Verdict::Hidden;
    };
    let header = usize::from(data_offset >> 4) * 4;
    if flags & TCP_FLAG_SYN != 0 || segment > header {
        Verdict::ForeignTcp
    } else {
        Verdict::Pass
    }
}
