//! Address helpers shared by the programs.

use ztunnel_common::{IpBytes, v4_mapped};

/// Let the next TC program or filter decide (tcx: `TCX_NEXT`).
pub const TC_ACT_UNSPEC: i32 = -1;
/// Ethernet header length: where the IP header starts in a TC program.
pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const IPPROTO_TCP: u8 = 6;
/// IPv4 flags + fragment offset: "more fragments" and the 13-bit offset.
pub const IP_MF_OR_OFFSET: u16 = 0x3fff;

/// A `u32` that the kernel stored in network order, as its four bytes.
#[inline(always)]
pub fn ip4_bytes(raw_be: u32) -> [u8; 4] {
    raw_be.to_ne_bytes()
}

/// An IPv4 address (kernel `u32`, network order) as [`IpBytes`].
#[inline(always)]
pub fn ip4_key(raw_be: u32) -> IpBytes {
    v4_mapped(ip4_bytes(raw_be))
}

/// An IPv6 address (kernel `[u32; 4]`, network order) as [`IpBytes`].
#[inline(always)]
pub fn ip6_key(raw_be: [u32; 4]) -> IpBytes {
    let mut out = [0u8; 16];
    let mut i = 0;
    while i < 4 {
        let b = raw_be[i].to_ne_bytes();
        out[i * 4] = b[0];
        out[i * 4 + 1] = b[1];
        out[i * 4 + 2] = b[2];
        out[i * 4 + 3] = b[3];
        i += 1;
    }
    out
}

/// Loopback in either family: 127.0.0.0/8, `::1`, or v4-mapped 127/8.
#[inline(always)]
pub fn is_loopback(addr: &IpBytes) -> bool {
    if is_v4_mapped(addr) {
        return addr[12] == 127;
    }
    addr[..15].iter().all(|b| *b == 0) && addr[15] == 1
}

/// Whether the address is an IPv4 address in v4-mapped form.
#[inline(always)]
pub fn is_v4_mapped(addr: &IpBytes) -> bool {
    addr[..10].iter().all(|b| *b == 0) && addr[10] == 0xff && addr[11] == 0xff
}

/// Host-order port from the `remote_port` field of `bpf_sock_ops` and
/// `sk_msg_md`: the kernel puts the network-order port in the upper 16 bits
/// of the `u32` on little-endian machines.
#[inline(always)]
pub fn remote_port_host(raw: u32) -> u16 {
    u16::from_be((raw >> 16) as u16)
}

/// The socket fields `sock_ops` and `sk_msg` programs need, copied out of
/// the context in one go.
#[derive(Clone, Copy)]
pub struct SockFields {
    pub family: u32,
    pub local_ip4: u32,
    pub remote_ip4: u32,
    pub local_ip6: [u32; 4],
    pub remote_ip6: [u32; 4],
    /// Host order.
    pub local_port: u32,
    /// Raw kernel form: see [`remote_port_host`].
    pub remote_port: u32,
}

impl SockFields {
    /// Local and remote address as [`IpBytes`], or `None` for other families.
    #[inline(always)]
    pub fn addrs(&self) -> Option<(IpBytes, IpBytes)> {
        if self.family == 2 {
            Some((ip4_key(self.local_ip4), ip4_key(self.remote_ip4)))
        } else if self.family == 10 {
            Some((ip6_key(self.local_ip6), ip6_key(self.remote_ip6)))
        } else {
            None
        }
    }
}

/// Copies the fields out of a `bpf_sock_ops`/`sk_msg_md`-shaped context.
///
/// Out of line on purpose: the verifier accepts context accesses only as
/// exact-size loads at a constant offset from the context pointer, and a
/// separate function receives the bare pointer in R1, so LLVM cannot keep a
/// `ctx + offset` pointer around and dereference that ("dereference of
/// modified ctx ptr").
macro_rules! snapshot_fn {
    ($name:ident, $ty:ty) => {
        #[inline(never)]
        pub unsafe fn $name(ctx: *const $ty, out: *mut SockFields) {
            // SAFETY: the caller passes the live context and a stack slot.
            unsafe {
                (*out).family = (*ctx).family;
                (*out).local_ip4 = (*ctx).local_ip4;
                (*out).remote_ip4 = (*ctx).remote_ip4;
                (*out).local_ip6[0] = (*ctx).local_ip6[0];
                (*out).local_ip6[1] = (*ctx).local_ip6[1];
                (*out).local_ip6[2] = (*ctx).local_ip6[2];
                (*out).local_ip6[3] = (*ctx).local_ip6[3];
                (*out).remote_ip6[0] = (*ctx).remote_ip6[0];
                (*out).remote_ip6[1] = (*ctx).remote_ip6[1];
                (*out).remote_ip6[2] = (*ctx).remote_ip6[2];
                (*out).remote_ip6[3] = (*ctx).remote_ip6[3];
                (*out).local_port = (*ctx).local_port;
                (*out).remote_port = (*ctx).remote_port;
            }
        }
    };
}
snapshot_fn!(snapshot_sock_ops, aya_ebpf::bindings::bpf_sock_ops);
snapshot_fn!(snapshot_sk_msg, aya_ebpf::bindings::sk_msg_md);

/// `bpf_sock_ops.op`, out of line for the same reason as above.
#[inline(never)]
pub unsafe fn sock_ops_op(ctx: *const aya_ebpf::bindings::bpf_sock_ops) -> u32 {
    // SAFETY: the caller passes the live context.
    unsafe { (*ctx).op }
}
