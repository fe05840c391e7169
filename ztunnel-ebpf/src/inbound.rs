//! TC ingress on an enrolled pod's `eth0` (tcx link where the kernel has it,
//! else a clsact filter with ztunnel's own priority): counting only.
//!
//! This program used to steer inbound SYNs with `bpf_sk_assign`. Reading
//! raw headers before the IP layer can be walked around: a SYN split into
//! IPv4 fragments or behind an IPv6 extension header does not look like a
//! SYN here, and a SYN that hits a `TIME_WAIT` socket is matched to a
//! listener again later, past any decision taken here. Steering therefore
//! lives in `capture_lookup` (`sk_lookup`), which sees what TCP sees.
//!
//! What stays here is visibility into exactly that kind of traffic, which
//! only a packet-level hook sees: TCP packets, IPv4 fragments, and IPv6
//! packets with extension headers arriving at enrolled pods, as counters an
//! operator can graph and alert on. The program never decides anything: it
//! always returns `TC_ACT_UNSPEC`, so the next program in the chain (tcx) or
//! the next filter (clsact) decides and a CNI's own programs keep working.

use aya_ebpf::{macros::classifier, programs::TcContext};
use ztunnel_common::Counter;

use crate::{
    maps::count,
    net::{ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IP_MF_OR_OFFSET, IPPROTO_TCP, TC_ACT_UNSPEC},
};

/// IPv6 next-header values of the extension headers that can precede TCP:
/// hop-by-hop, routing, fragment, destination options.
const IPV6_EXT_HEADERS: [u8; 4] = [0, 43, 44, 60];

#[classifier]
pub fn capture_ingress(ctx: TcContext) -> i32 {
    observe(&ctx);
    TC_ACT_UNSPEC
}

#[inline(always)]
fn observe(ctx: &TcContext) {
    let Ok(ethertype) = ctx.load::<u16>(12) else {
        return;
    };
    match u16::from_be(ethertype) {
        ETH_P_IP => {
            let (Ok(frag_be), Ok(proto)) =
                (ctx.load::<u16>(ETH_HLEN + 6), ctx.load::<u8>(ETH_HLEN + 9))
            else {
                return;
            };
            if u16::from_be(frag_be) & IP_MF_OR_OFFSET != 0 {
                count(Counter::IngressFragmentSeen);
            }
            if proto == IPPROTO_TCP {
                count(Counter::IngressTcpSeen);
            }
        }
        ETH_P_IPV6 => {
            let Ok(next) = ctx.load::<u8>(ETH_HLEN + 6) else {
                return;
            };
            if next == IPPROTO_TCP {
                count(Counter::IngressTcpSeen);
            } else if IPV6_EXT_HEADERS.contains(&next) {
                count(Counter::IngressIpv6ExtSeen);
            }
        }
        _ => {}
    }
}
