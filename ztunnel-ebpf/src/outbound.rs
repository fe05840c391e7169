//! Outbound capture: `cgroup/connect4` and `cgroup/connect6`.
//!
//! Runs on every `connect()` made by a process in the attached cgroup (or
//! below it). A TCP connect from an enrolled pod's network namespace, to a
//! destination that is not loopback or excluded, by a socket that ztunnel
//! did not open itself, is rewritten to the pod's own outbound listener on
//! loopback (127.0.0.1:15001, or `[::1]:15001`). ztunnel's own sockets are
//! the ones it listed in `ZTUNNEL_SOCKETS`, never those that merely carry its
//! mark: a pod with `CAP_NET_RAW` (a container runtime's default) can set any
//! mark. The original destination is
//! stored in the socket's own storage (`ORIG_DST_BY_SOCKET`), which lives
//! exactly as long as the socket; `capture_sockops` copies it to a key that
//! ztunnel can compute from `accept()` once the client's port is known.
//!
//! Fail closed: a connect whose original destination cannot be stored is
//! refused (`EPERM`), never let through un-rewritten. If ztunnel is gone the
//! listener is gone too and the application gets "connection refused".

use aya_ebpf::{
    helpers::bpf_get_netns_cookie, macros::cgroup_sock_addr, programs::SockAddrContext,
};
use ztunnel_common::{
    AF_INET, AF_INET6, Counter, IpBytes, OUTBOUND_PORT, OrigDst, POD_CAPTURE_OUTBOUND,
    ZTUNNEL_MARK, ZTUNNEL_MARK_MASK,
};

use crate::{
    maps::{
        ORIG_DST_BY_SOCKET, OUTBOUND_EXCLUDED_CIDRS, OUTBOUND_EXCLUDED_PORTS, POD_CAPTURE, count,
        in_cidrs, is_ztunnel_socket, port_listed,
    },
    net::{ip4_key, ip6_key, is_loopback, is_v4_mapped},
};

/// Verdict that lets the `connect()` proceed (rewritten or not).
const ALLOW: i32 = 1;
/// Verdict that fails the `connect()` with `EPERM`.
const REFUSE: i32 = 0;
const IPPROTO_TCP: u32 = 6;

#[cgroup_sock_addr(connect4)]
pub fn capture_connect4(ctx: SockAddrContext) -> i32 {
    // SAFETY: the context pointer is valid for the program's run.
    verdict(unsafe { try_capture(&ctx, false) })
}

#[cgroup_sock_addr(connect6)]
pub fn capture_connect6(ctx: SockAddrContext) -> i32 {
    // SAFETY: as above.
    verdict(unsafe { try_capture(&ctx, true) })
}

/// What the connect hook decided.
enum Decision {
    /// Not ours to capture: proceed unchanged.
    LeftAlone,
    /// Rewritten to the pod's outbound listener.
    Captured,
    /// Captured, but the record could not be stored: refuse.
    Refused,
}

#[inline(always)]
fn verdict(decision: Decision) -> i32 {
    match decision {
        Decision::LeftAlone | Decision::Captured => ALLOW,
        Decision::Refused => REFUSE,
    }
}

/// Decides and, where captured, rewrites.
unsafe fn try_capture(ctx: &SockAddrContext, v6: bool) -> Decision {
    match unsafe { classify(ctx, v6) } {
        // SAFETY: forwarded from the caller.
        Some((sk, orig)) => unsafe { capture(ctx, v6, sk, &orig) },
        None => Decision::LeftAlone,
    }
}

/// The socket and original destination of a connect that must be captured,
/// or `None` for one that is not ours.
unsafe fn classify(
    ctx: &SockAddrContext,
    v6: bool,
) -> Option<(*mut aya_ebpf::bindings::bpf_sock, OrigDst)> {
    let sa = ctx.sock_addr;
    // SAFETY: `sa` is the kernel's context; the verifier checks each access.
    let (protocol, sk) = unsafe { (ctx_access::protocol(sa), ctx_access::sk(sa)) };
    if protocol != IPPROTO_TCP {
        return None;
    }
    count(if v6 {
        Counter::Connect6Seen
    } else {
        Counter::Connect4Seen
    });

    if sk.is_null() {
        return None;
    }
    // SAFETY: `sk` is non-null and a full socket in connect hooks.
    if unsafe { is_ztunnel_socket(sk.cast()) } {
        count(Counter::ConnectSkippedOwn);
        return None;
    }

    // SAFETY: valid context pointer for this helper in sock_addr programs.
    let netns = unsafe { bpf_get_netns_cookie(sa.cast()) };
    // SAFETY: plain-data value, only read.
    let Some(pod) = (unsafe { POD_CAPTURE.get(netns) }) else {
        count(Counter::ConnectNotEnrolled);
        return None;
    };
    if pod.flags & POD_CAPTURE_OUTBOUND == 0 {
        count(Counter::ConnectNotEnrolled);
        return None;
    }
    // Counted only: the mark exempts nothing here, but an operator should
    // see a pod trying (or a tool of theirs that relied on it).
    // SAFETY: `sk` is non-null and a full socket in connect hooks.
    if unsafe { (*sk).mark } & ZTUNNEL_MARK_MASK == ZTUNNEL_MARK {
        count(Counter::ConnectForgedMark);
    }

    // SAFETY: `sa` is the live context.
    let (dst, port_be, family) = unsafe {
        if v6 {
            (
                ip6_key(ctx_access::user_ip6(sa)),
                ctx_access::user_port(sa),
                AF_INET6,
            )
        } else {
            (
                ip4_key(ctx_access::user_ip4(sa)),
                ctx_access::user_port(sa),
                AF_INET,
            )
        }
    };
    let port = u16::from_be(port_be as u16);
    if excluded(&dst, port) {
        count(Counter::ConnectExcluded);
        return None;
    }

    let orig = OrigDst {
        addr: dst,
        port,
        family,
        flags: 0,
    };
    Some((sk, orig))
}

/// Stores the record in the socket's storage, then rewrites the destination.
unsafe fn capture(
    ctx: &SockAddrContext,
    v6: bool,
    sk: *mut aya_ebpf::bindings::bpf_sock,
    orig: &OrigDst,
) -> Decision {
    let sa = ctx.sock_addr;
    // Without a record ztunnel could not know where to send the connection,
    // and letting it through un-rewritten would bypass the mesh: refuse.
    // SAFETY: `sk` is the context's full socket (checked non-null).
    let Some(slot) = (unsafe { ORIG_DST_BY_SOCKET.get_or_create(sk.cast()) }) else {
        count(Counter::ConnectRefusedNoRecord);
        return Decision::Refused;
    };
    *slot = *orig;
    let dst = orig.addr;

    let listener_port_be = u32::from(OUTBOUND_PORT.to_be());
    // SAFETY: writes to the user_* fields are what connect hooks are for.
    unsafe {
        if v6 {
            // A v4-mapped destination stays v4-mapped so that a pod with IPv6
            // disabled still reaches the 127.0.0.1 listener.
            let words = if is_v4_mapped(&dst) {
                [
                    0,
                    0,
                    u32::from_ne_bytes([0, 0, 0xff, 0xff]),
                    u32::from_ne_bytes([127, 0, 0, 1]),
                ]
            } else {
                [0, 0, 0, u32::from_ne_bytes([0, 0, 0, 1])]
            };
            ctx_access::set_user_ip6(sa, &words);
        } else {
            ctx_access::set_user_ip4(sa, u32::from_ne_bytes([127, 0, 0, 1]));
        }
        ctx_access::set_user_port(sa, listener_port_be);
    }
    count(Counter::ConnectRedirected);
    Decision::Captured
}

#[cgroup_sock_addr(getpeername4)]
pub fn capture_getpeername4(ctx: SockAddrContext) -> i32 {
    // SAFETY: the context pointer is valid for the program's run.
    let _ = unsafe { restore_peername(&ctx, false) };
    ALLOW
}

#[cgroup_sock_addr(getpeername6)]
pub fn capture_getpeername6(ctx: SockAddrContext) -> i32 {
    // SAFETY: as above.
    let _ = unsafe { restore_peername(&ctx, true) };
    ALLOW
}

/// `getpeername()` of a captured socket would reveal the outbound listener
/// (127.0.0.1:15001); answer with the destination the application asked
/// for, so that nothing in the application can tell it was redirected.
unsafe fn restore_peername(ctx: &SockAddrContext, v6: bool) -> Result<(), ()> {
    let sa = ctx.sock_addr;
    // SAFETY: the live context.
    let sk = unsafe { ctx_access::sk(sa) };
    if sk.is_null() {
        return Err(());
    }
    // SAFETY: a full socket from the context; the value is copied out.
    let orig = unsafe { ORIG_DST_BY_SOCKET.get(sk.cast()) }
        .map(|o| *o)
        .ok_or(())?;
    // SAFETY: writes to the user_* fields are what these hooks are for.
    unsafe {
        if v6 {
            let b = orig.addr;
            let words = [
                u32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
                u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
                u32::from_ne_bytes([b[8], b[9], b[10], b[11]]),
                u32::from_ne_bytes([b[12], b[13], b[14], b[15]]),
            ];
            ctx_access::set_user_ip6(sa, &words);
        } else {
            if !is_v4_mapped(&orig.addr) {
                return Err(());
            }
            let b = orig.addr;
            ctx_access::set_user_ip4(sa, u32::from_ne_bytes([b[12], b[13], b[14], b[15]]));
        }
        ctx_access::set_user_port(sa, u32::from(orig.port.to_be()));
    }
    count(Counter::PeernameRestored);
    Ok(())
}

#[inline(always)]
fn excluded(dst: &IpBytes, port: u16) -> bool {
    is_loopback(dst)
        || port_listed(&OUTBOUND_EXCLUDED_PORTS, port)
        || in_cidrs(&OUTBOUND_EXCLUDED_CIDRS, *dst)
}

/// Context accessors. The verifier accepts a context access only as a load or
/// store of the field's exact size at a constant offset from the context
/// pointer itself. Inlined into a large function, LLVM likes to keep
/// `ctx + offset` in a register or on the stack and dereference that, which
/// the verifier rejects ("dereference of modified ctx ptr"). Out-of-line
/// functions receive the bare context pointer in R1, so each access is
/// `*(u32 *)(r1 + off)`.
mod ctx_access {
    use aya_ebpf::bindings::{bpf_sock, bpf_sock_addr};

    #[inline(never)]
    pub unsafe fn protocol(sa: *mut bpf_sock_addr) -> u32 {
        // SAFETY: caller passes the live context.
        unsafe { (*sa).protocol }
    }

    #[inline(never)]
    pub unsafe fn sk(sa: *mut bpf_sock_addr) -> *mut bpf_sock {
        // SAFETY: caller passes the live context.
        unsafe { (*sa).__bindgen_anon_1.sk }
    }

    #[inline(never)]
    pub unsafe fn user_ip4(sa: *mut bpf_sock_addr) -> u32 {
        // SAFETY: caller passes the live context.
        unsafe { (*sa).user_ip4 }
    }

    #[inline(never)]
    pub unsafe fn user_ip6(sa: *mut bpf_sock_addr) -> [u32; 4] {
        // SAFETY: caller passes the live context.
        unsafe {
            [
                (*sa).user_ip6[0],
                (*sa).user_ip6[1],
                (*sa).user_ip6[2],
                (*sa).user_ip6[3],
            ]
        }
    }

    #[inline(never)]
    pub unsafe fn user_port(sa: *mut bpf_sock_addr) -> u32 {
        // SAFETY: caller passes the live context.
        unsafe { (*sa).user_port }
    }

    #[inline(never)]
    pub unsafe fn set_user_ip4(sa: *mut bpf_sock_addr, value: u32) {
        // SAFETY: caller passes the live context.
        unsafe { (*sa).user_ip4 = value };
    }

    #[inline(never)]
    pub unsafe fn set_user_ip6(sa: *mut bpf_sock_addr, words: &[u32; 4]) {
        // SAFETY: caller passes the live context.
        unsafe {
            (*sa).user_ip6[0] = words[0];
            (*sa).user_ip6[1] = words[1];
            (*sa).user_ip6[2] = words[2];
            (*sa).user_ip6[3] = words[3];
        }
    }

    #[inline(never)]
    pub unsafe fn set_user_port(sa: *mut bpf_sock_addr, value: u32) {
        // SAFETY: caller passes the live context.
        unsafe { (*sa).user_port = value };
    }
}
