//! `sock_ops` on the capture cgroup: runs when a TCP socket of a process in
//! the cgroup becomes established.
//!
//! - Active side of a captured connection: the client's local port is now
//!   known, so the original destination recorded by `capture_connect4/6`
//!   under the socket cookie is copied to `ORIG_DST`, keyed by what ztunnel's
//!   `accept()` sees as the peer address (plus the pod's netns cookie).
//! - With `--sockmap on`, both ends of a pod-local leg (the application and
//!   ztunnel's outbound listener, over loopback) go into `LOCAL_LEG_SOCKETS`,
//!   where `accelerate_local_leg` moves payload between them directly.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB},
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::sock_ops,
    programs::SockOpsContext,
};
use core::mem::MaybeUninit;

use ztunnel_common::{Counter, OUTBOUND_PORT, OrigDstKey, SockKey};

use crate::{
    maps::{LOCAL_LEG_SOCKETS, ORIG_DST, ORIG_DST_BY_COOKIE, POD_CAPTURE, count, sockmap_enabled},
    net::{SockFields, is_loopback, remote_port_host, snapshot_sock_ops, sock_ops_op},
};

#[sock_ops]
pub fn capture_sockops(ctx: SockOpsContext) -> u32 {
    // SAFETY: the context pointer is valid for the program's run.
    let _ = unsafe { try_capture_sockops(&ctx) };
    // sock_ops return values only matter for callbacks we do not handle.
    1
}

unsafe fn try_capture_sockops(ctx: &SockOpsContext) -> Result<(), ()> {
    // SAFETY: the live context.
    let op = unsafe { sock_ops_op(ctx.ops) };
    let active = op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB;
    if !active && op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB {
        return Ok(());
    }
    count(Counter::SockopsEstablished);

    let mut fields = MaybeUninit::<SockFields>::uninit();
    // SAFETY: the live context and a stack slot the function fills entirely.
    let fields = unsafe {
        snapshot_sock_ops(ctx.ops, fields.as_mut_ptr());
        fields.assume_init()
    };
    let Some((local, remote)) = fields.addrs() else {
        return Ok(());
    };
    let local_port = fields.local_port as u16;
    let remote_port = remote_port_host(fields.remote_port);
    // SAFETY: valid context pointer for this helper in sock_ops programs.
    let netns = unsafe { bpf_get_netns_cookie(ctx.ops.cast()) };

    if active {
        // SAFETY: valid context pointer for this helper in sock_ops programs.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
        // SAFETY: plain-data value, copied out before the entry is removed.
        if let Some(orig) = unsafe { ORIG_DST_BY_COOKIE.get(&cookie) }.copied() {
            let key = OrigDstKey {
                netns_cookie: netns,
                client_addr: local,
                client_port: local_port,
                _pad: [0; 6],
            };
            if ORIG_DST.insert(&key, &orig, 0).is_ok() {
                count(Counter::OrigDstRecorded);
            }
            // The by-cookie entry stays: getpeername() still needs it.
        }
    }

    if !sockmap_enabled() || !is_loopback(&local) || !is_loopback(&remote) {
        return Ok(());
    }
    let local_leg = if active {
        remote_port == OUTBOUND_PORT
    } else {
        local_port == OUTBOUND_PORT
    };
    // SAFETY: plain-data value, only tested for presence.
    if !local_leg || unsafe { POD_CAPTURE.get(&netns) }.is_none() {
        return Ok(());
    }
    let mut key = SockKey {
        netns_cookie: netns,
        local_addr: local,
        remote_addr: remote,
        local_port: u32::from(local_port),
        remote_port: u32::from(remote_port),
    };
    // SAFETY: `ops` is the kernel's live context for this socket.
    let ops = unsafe { &mut *ctx.ops };
    if LOCAL_LEG_SOCKETS
        .update(&mut key, ops, u64::from(BPF_ANY))
        .is_ok()
    {
        count(Counter::LocalLegInserted);
    }
    Ok(())
}
