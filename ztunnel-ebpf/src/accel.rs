//! `sk_msg` on `LOCAL_LEG_SOCKETS`: runs on every `sendmsg()` of a socket in
//! the map and hands the payload straight to the receive queue of the socket
//! at the other end of the same pod-local connection, skipping TCP/IP on
//! loopback. When the peer is not (yet) in the map the payload goes the normal
//! way, and that direction of the connection stays on TCP from then on
//! (`LOCAL_LEG_TCP_ONLY`), so bytes are never reordered.
//!
//! Only writes of up to `MAX_REDIRECT_BYTES` are redirected. The kernel's
//! sockmap ingress path has no back-pressure: when the receiving socket is
//! full it fails the writer's `sendmsg()` with `ENOMEM` instead of making it
//! wait (seen on 6.18 with iperf3's 128 KiB writes towards a ztunnel that
//! was itself held back by HTTP/2 flow control). Request/response traffic,
//! where skipping loopback TCP pays, writes small messages; a bulk writer's
//! first large write sends that direction through TCP for good, where
//! back-pressure works and the saved copy would be small next to TLS anyway.

use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::{BPF_F_INGRESS, sk_action::SK_PASS},
    helpers::bpf_get_netns_cookie,
    macros::sk_msg,
    programs::SkMsgContext,
};
use ztunnel_common::{Counter, SockKey};

use crate::{
    maps::{LOCAL_LEG_SOCKETS, LOCAL_LEG_TCP_ONLY, count},
    net::{SockFields, remote_port_host, snapshot_sk_msg},
};

/// Largest write handed over directly (see the module comment).
const MAX_REDIRECT_BYTES: u32 = 16 * 1024;

#[sk_msg]
pub fn accelerate_local_leg(ctx: SkMsgContext) -> u32 {
    let mut fields = MaybeUninit::<SockFields>::uninit();
    // SAFETY: the live context and a stack slot the function fills entirely.
    let fields = unsafe {
        snapshot_sk_msg(ctx.msg, fields.as_mut_ptr());
        fields.assume_init()
    };
    let Some((local, remote)) = fields.addrs() else {
        return SK_PASS;
    };
    // SAFETY: valid context pointer for this helper in sk_msg programs.
    let netns = unsafe { bpf_get_netns_cookie(ctx.msg.cast()) };
    let me = SockKey {
        netns_cookie: netns,
        local_addr: local,
        remote_addr: remote,
        local_port: fields.local_port,
        remote_port: u32::from(remote_port_host(fields.remote_port)),
    };
    // SAFETY: plain-data value, only tested for presence.
    if unsafe { LOCAL_LEG_TCP_ONLY.get(me) }.is_some() {
        count(Counter::LocalLegPassed);
        return SK_PASS;
    }
    if ctx.size() > MAX_REDIRECT_BYTES {
        // Bytes redirected earlier are read before these (the receiver
        // drains its sockmap queue first), so switching to TCP here keeps
        // the order; switching back never happens.
        let _ = LOCAL_LEG_TCP_ONLY.insert(me, 1, 0);
        count(Counter::LocalLegPassed);
        return SK_PASS;
    }
    let mut peer = me.peer();
    let verdict = LOCAL_LEG_SOCKETS.redirect_msg(&ctx, &mut peer, u64::from(BPF_F_INGRESS));
    if verdict == i64::from(SK_PASS) {
        count(Counter::LocalLegRedirected);
    } else {
        // Once bytes of this direction went through TCP, later bytes must
        // too, or the receiver could read them out of order.
        let _ = LOCAL_LEG_TCP_ONLY.insert(me, 1, 0);
        count(Counter::LocalLegPassed);
    }
    SK_PASS
}
