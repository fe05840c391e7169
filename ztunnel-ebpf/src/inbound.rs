//! Inbound capture: TC ingress on an enrolled pod's `eth0` (tcx link where
//! the kernel has it, else a clsact filter with ztunnel's own priority).
//!
//! Only TCP SYNs (SYN without ACK) are ever acted on; every other packet,
//! including the rest of a connection we steered, finds its socket through
//! the kernel's normal lookup because the accepted socket carries the
//! original 4-tuple. For a SYN:
//! - to the HBONE port 15008: let through to ztunnel's HBONE listener;
//! - from an excluded source CIDR or to an excluded port: let through;
//! - matching an existing socket (a retransmitted SYN, or a reply to a
//!   connection ztunnel itself opened): let through;
//! - otherwise: `bpf_sk_assign` it to the pod's plaintext-inbound listener
//!   (15006). The accepted socket's local address is the original
//!   destination, which is how ztunnel learns it.
//! - If that listener does not exist (ztunnel gone), the SYN is dropped:
//!   reaching the application directly would bypass the mesh.
//!
//! Packets we do not act on return `TC_ACT_UNSPEC`, which lets the next
//! program in the chain (tcx) or the next filter (clsact) decide, so a CNI's
//! own programs keep working.

use core::mem::size_of;

use aya_ebpf::{
    bindings::{BPF_F_CURRENT_NETNS, TC_ACT_OK, TC_ACT_SHOT, bpf_sock, bpf_sock_tuple},
    helpers::{bpf_sk_assign, bpf_sk_release, bpf_skc_lookup_tcp},
    macros::classifier,
    programs::TcContext,
};
use aya_log_ebpf::warn;
use ztunnel_common::{Counter, INBOUND_HBONE_PORT, INBOUND_PLAINTEXT_PORT, IpBytes, v4_mapped};

use crate::maps::{INBOUND_EXCLUDED_CIDRS, INBOUND_EXCLUDED_PORTS, count, in_cidrs, port_listed};

/// Let the next program or filter decide (tcx: `TCX_NEXT`).
const TC_ACT_UNSPEC: i32 = -1;
const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const IPV6_HLEN: usize = 40;
const TCP_FLAG_SYN: u8 = 0x02;
const TCP_FLAG_ACK: u8 = 0x10;
const TCP_LISTEN: u32 = 10;

/// What the program needs from one packet's headers.
struct Syn {
    v6: bool,
    saddr: IpBytes,
    daddr: IpBytes,
    /// Ports as they are on the wire (network order).
    sport_be: u16,
    dport_be: u16,
}

#[classifier]
pub fn capture_ingress(ctx: TcContext) -> i32 {
    let Some(syn) = parse_syn(&ctx) else {
        return TC_ACT_UNSPEC;
    };
    let dport = u16::from_be(syn.dport_be);
    if dport == INBOUND_HBONE_PORT {
        count(Counter::IngressHbonePassed);
        return TC_ACT_UNSPEC;
    }
    if port_listed(&INBOUND_EXCLUDED_PORTS, dport) || in_cidrs(&INBOUND_EXCLUDED_CIDRS, syn.saddr) {
        count(Counter::IngressExcluded);
        return TC_ACT_UNSPEC;
    }
    // SAFETY: helper calls with a valid context and a stack tuple.
    unsafe { steer(&ctx, &syn) }
}

/// Looks up the existing socket or the plaintext-inbound listener and assigns.
unsafe fn steer(ctx: &TcContext, syn: &Syn) -> i32 {
    let mut tuple = make_tuple(syn, syn.dport_be);
    let size = tuple_size(syn.v6);
    // SAFETY: valid skb context and a stack tuple of the declared size.
    let existing = unsafe { lookup(ctx, &mut tuple, size) };
    if !existing.is_null() {
        // SAFETY: non-null socket from the lookup; `state` is readable on
        // sock_common, and every acquired reference is released.
        let state = unsafe { (*existing).state };
        unsafe { bpf_sk_release(existing.cast()) };
        if state != TCP_LISTEN {
            return TC_ACT_UNSPEC;
        }
    }

    let mut tuple = make_tuple(syn, INBOUND_PLAINTEXT_PORT.to_be());
    // SAFETY: as above.
    let listener = unsafe { lookup(ctx, &mut tuple, size) };
    if listener.is_null() {
        count(Counter::IngressNoListener);
        warn!(
            ctx,
            "inbound SYN dropped: no plaintext-inbound listener (ztunnel down?)"
        );
        return TC_ACT_SHOT;
    }
    // SAFETY: non-null socket from the lookup.
    let state = unsafe { (*listener).state };
    let assigned = state == TCP_LISTEN
        // SAFETY: the skb is the context; the socket reference is ours.
        && unsafe { bpf_sk_assign(ctx.skb.skb.cast(), listener.cast(), 0) } == 0;
    // SAFETY: releases the reference taken by the lookup.
    unsafe { bpf_sk_release(listener.cast()) };
    if assigned {
        count(Counter::IngressAssigned);
        TC_ACT_OK
    } else {
        count(Counter::IngressNoListener);
        TC_ACT_SHOT
    }
}

unsafe fn lookup(ctx: &TcContext, tuple: &mut bpf_sock_tuple, size: u32) -> *mut bpf_sock {
    // SAFETY: forwarded from the callers' contract.
    unsafe {
        bpf_skc_lookup_tcp(
            ctx.skb.skb.cast(),
            tuple,
            size,
            BPF_F_CURRENT_NETNS as u64,
            0,
        )
    }
}

fn tuple_size(v6: bool) -> u32 {
    if v6 {
        // saddr + daddr + sport + dport
        (16 + 16 + 2 + 2) as u32
    } else {
        (4 + 4 + 2 + 2) as u32
    }
}

fn make_tuple(syn: &Syn, dport_be: u16) -> bpf_sock_tuple {
    // SAFETY: an all-zero tuple is a valid value of this plain C union.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    if syn.v6 {
        // SAFETY: writing the ipv6 arm of the union.
        let t = unsafe { &mut tuple.__bindgen_anon_1.ipv6 };
        t.saddr = words(&syn.saddr);
        t.daddr = words(&syn.daddr);
        t.sport = syn.sport_be;
        t.dport = dport_be;
    } else {
        // SAFETY: writing the ipv4 arm of the union.
        let t = unsafe { &mut tuple.__bindgen_anon_1.ipv4 };
        t.saddr = u32::from_ne_bytes([syn.saddr[12], syn.saddr[13], syn.saddr[14], syn.saddr[15]]);
        t.daddr = u32::from_ne_bytes([syn.daddr[12], syn.daddr[13], syn.daddr[14], syn.daddr[15]]);
        t.sport = syn.sport_be;
        t.dport = dport_be;
    }
    tuple
}

fn words(addr: &IpBytes) -> [u32; 4] {
    [
        u32::from_ne_bytes([addr[0], addr[1], addr[2], addr[3]]),
        u32::from_ne_bytes([addr[4], addr[5], addr[6], addr[7]]),
        u32::from_ne_bytes([addr[8], addr[9], addr[10], addr[11]]),
        u32::from_ne_bytes([addr[12], addr[13], addr[14], addr[15]]),
    ]
}

/// Parses Ethernet + IPv4/IPv6 + TCP and returns the fields of a bare SYN.
/// IPv6 extension headers are not walked: such SYNs are left alone (and
/// counted as seen), which matches what pod traffic looks like in practice.
fn parse_syn(ctx: &TcContext) -> Option<Syn> {
    let ethertype = u16::from_be(ctx.load::<u16>(12).ok()?);
    let (v6, saddr, daddr, l4) = match ethertype {
        ETH_P_IP => {
            let vihl: u8 = ctx.load(ETH_HLEN).ok()?;
            let proto: u8 = ctx.load(ETH_HLEN + 9).ok()?;
            if proto != IPPROTO_TCP {
                return None;
            }
            let s: [u8; 4] = ctx.load(ETH_HLEN + 12).ok()?;
            let d: [u8; 4] = ctx.load(ETH_HLEN + 16).ok()?;
            let ihl = usize::from(vihl & 0x0f) * 4;
            (false, v4_mapped(s), v4_mapped(d), ETH_HLEN + ihl)
        }
        ETH_P_IPV6 => {
            let next: u8 = ctx.load(ETH_HLEN + 6).ok()?;
            if next != IPPROTO_TCP {
                return None;
            }
            let s: [u8; 16] = ctx.load(ETH_HLEN + 8).ok()?;
            let d: [u8; 16] = ctx.load(ETH_HLEN + 24).ok()?;
            (true, s, d, ETH_HLEN + IPV6_HLEN)
        }
        _ => return None,
    };
    count(Counter::IngressTcpSeen);
    let flags: u8 = ctx.load(l4 + 13).ok()?;
    if flags & TCP_FLAG_SYN == 0 || flags & TCP_FLAG_ACK != 0 {
        return None;
    }
    let sport_be: u16 = ctx.load(l4).ok()?;
    let dport_be: u16 = ctx.load(l4 + 2).ok()?;
    Some(Syn {
        v6,
        saddr,
        daddr,
        sport_be,
        dport_be,
    })
}

const _: () = assert!(size_of::<bpf_sock_tuple>() >= 36);
