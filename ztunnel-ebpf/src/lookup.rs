//! Inbound capture: `sk_lookup`, attached to each enrolled pod's network
//! namespace.
//!
//! The kernel runs this program where TCP picks the listening socket for a
//! connection that matches no established socket: for every new SYN, after
//! IP reassembly and after IPv6 extension headers were walked, and again
//! when a SYN hits a `TIME_WAIT` socket and the kernel looks the listener up
//! anew. Steering here cannot be walked around with crafted packets the way
//! a program reading raw headers at TC could.
//!
//! For a TCP lookup:
//! - arriving on the pod's loopback (`lo`, i.e. to 127.0.0.0/8 or `::1`):
//!   left to the normal lookup; nothing from outside the pod arrives there.
//! - the SYN of one of ztunnel's transparent legs to the application
//!   (listed in `INBOUND_LEGS` by ztunnel for the moment of its connect):
//!   left to the normal lookup. Such a leg carries the original client's
//!   address and, being delivered to the pod's own address, the kernel
//!   reports the interface holding that address (`eth0`), not `lo`; the
//!   tuple is the only thing that tells it from the client itself.
//! - to the HBONE port (15008): handed to ztunnel's HBONE listener;
//! - to an excluded port, or from an excluded source CIDR (e.g. the node's
//!   health-probe address): left to the normal lookup;
//! - anything else: handed to ztunnel's plaintext-inbound listener (15006).
//!   The accepted socket's local address is the original destination.
//! - When the listener is missing from `POD_LISTENERS` (ztunnel is gone,
//!   which closes its sockets and so removes them from the map, or the
//!   destination is not one of the pod's known addresses) the connection is
//!   dropped: reaching the application directly would bypass the mesh.

use aya_ebpf::{bindings::bpf_sk_lookup, macros::sk_lookup, programs::SkLookupContext};
use ztunnel_common::{
    AF_INET, Counter, INBOUND_HBONE_PORT, INBOUND_PLAINTEXT_PORT, IpBytes, LegKey, ListenerKey,
};

use crate::{
    maps::{
        INBOUND_EXCLUDED_CIDRS, INBOUND_EXCLUDED_PORTS, INBOUND_LEGS, POD_LISTENERS, count,
        in_cidrs, port_listed,
    },
    net::{ip4_key, ip6_key},
};

/// Verdict: use the socket selected (or, with none, the normal lookup).
const SK_PASS: u32 = 1;
/// Verdict: refuse the connection.
const SK_DROP: u32 = 0;
const IPPROTO_TCP: u32 = 6;
/// The loopback device's index, the same in every network namespace.
const LOOPBACK_IFINDEX: u32 = 1;

#[sk_lookup]
pub fn capture_lookup(ctx: SkLookupContext) -> u32 {
    // SAFETY: the context pointer is valid for the program's run.
    unsafe { try_capture_lookup(&ctx) }
}

unsafe fn try_capture_lookup(ctx: &SkLookupContext) -> u32 {
    let lookup = ctx.lookup;
    // SAFETY: the live context; each access is its own out-of-line load.
    let (protocol, ifindex) =
        unsafe { (ctx_access::protocol(lookup), ctx_access::ifindex(lookup)) };
    if protocol != IPPROTO_TCP {
        return SK_PASS;
    }
    if ifindex == LOOPBACK_IFINDEX {
        count(Counter::LookupLoopbackPassed);
        return SK_PASS;
    }
    // SAFETY: as above.
    let (local, remote, port) = unsafe { addresses(lookup) };
    // SAFETY: as above.
    let remote_port = u16::from_be(unsafe { ctx_access::remote_port_be(lookup) });
    let leg = LegKey {
        local_addr: local,
        remote_addr: remote,
        local_port: port as u16,
        remote_port,
    };
    // SAFETY: plain-data value, only tested for presence.
    if unsafe { INBOUND_LEGS.get(leg) }.is_some() {
        count(Counter::LookupLegPassed);
        return SK_PASS;
    }
    let target = if port == u32::from(INBOUND_HBONE_PORT) {
        INBOUND_HBONE_PORT
    } else {
        if port_listed(&INBOUND_EXCLUDED_PORTS, port as u16)
            || in_cidrs(&INBOUND_EXCLUDED_CIDRS, remote)
        {
            count(Counter::LookupExcluded);
            return SK_PASS;
        }
        INBOUND_PLAINTEXT_PORT
    };
    let key = ListenerKey {
        addr: local,
        port: u32::from(target),
    };
    if POD_LISTENERS.redirect_sk_lookup(ctx, key, 0).is_ok() {
        count(if target == INBOUND_HBONE_PORT {
            Counter::LookupSteeredHbone
        } else {
            Counter::LookupSteeredPlaintext
        });
        SK_PASS
    } else {
        count(Counter::LookupNoListener);
        SK_DROP
    }
}

/// Local address, remote address and local port (host order).
unsafe fn addresses(lookup: *mut bpf_sk_lookup) -> (IpBytes, IpBytes, u32) {
    // SAFETY: forwarded from the caller.
    unsafe {
        let port = ctx_access::local_port(lookup);
        if ctx_access::family(lookup) == u32::from(AF_INET) {
            (
                ip4_key(ctx_access::local_ip4(lookup)),
                ip4_key(ctx_access::remote_ip4(lookup)),
                port,
            )
        } else {
            (
                ip6_key(ctx_access::local_ip6(lookup)),
                ip6_key(ctx_access::remote_ip6(lookup)),
                port,
            )
        }
    }
}

/// Context accessors, out of line for the reason given in `outbound.rs`:
/// the verifier wants each context access as a load at a constant offset
/// from the bare context pointer.
mod ctx_access {
    use aya_ebpf::bindings::bpf_sk_lookup;

    macro_rules! field {
        ($name:ident, $field:ident) => {
            #[inline(never)]
            pub unsafe fn $name(ctx: *mut bpf_sk_lookup) -> u32 {
                // SAFETY: the caller passes the live context.
                unsafe { (*ctx).$field }
            }
        };
    }
    field!(protocol, protocol);
    field!(family, family);
    field!(ifindex, ingress_ifindex);
    field!(local_port, local_port);
    field!(local_ip4, local_ip4);
    field!(remote_ip4, remote_ip4);

    /// `remote_port` is a `__be16` (2-byte loads are what the kernel
    /// accepts for it since 5.19; older kernels took 4 bytes with the port
    /// in the low half, which reads the same on little-endian).
    #[inline(never)]
    pub unsafe fn remote_port_be(ctx: *mut bpf_sk_lookup) -> u16 {
        // SAFETY: the caller passes the live context.
        unsafe { (*ctx).remote_port }
    }

    #[inline(never)]
    pub unsafe fn local_ip6(ctx: *mut bpf_sk_lookup) -> [u32; 4] {
        // SAFETY: the caller passes the live context.
        unsafe {
            [
                (*ctx).local_ip6[0],
                (*ctx).local_ip6[1],
                (*ctx).local_ip6[2],
                (*ctx).local_ip6[3],
            ]
        }
    }

    #[inline(never)]
    pub unsafe fn remote_ip6(ctx: *mut bpf_sk_lookup) -> [u32; 4] {
        // SAFETY: the caller passes the live context.
        unsafe {
            [
                (*ctx).remote_ip6[0],
                (*ctx).remote_ip6[1],
                (*ctx).remote_ip6[2],
                (*ctx).remote_ip6[3],
            ]
        }
    }
}
