//! `sock_ops` on the capture cgroup: runs at points in the life of the TCP
//! sockets of processes in the cgroup.
//!
//! - `TCP_CONNECT_CB` (a captured socket is about to send its SYN): the
//!   client's local port is known by now, so the original destination that
//!   `capture_connect4/6` put in the socket's storage is copied to
//!   `ORIG_DST`, keyed by what ztunnel's `accept()` sees as the peer address
//!   (plus the pod's netns cookie), before ztunnel can possibly accept. The
//!   socket is also asked for state callbacks.
//! - `STATE_CB` to `CLOSE` of such a socket: its `ORIG_DST` entry is deleted.
//!   ztunnel deletes the entries it takes at `accept()`; this removes those
//!   of connections that ended before ztunnel accepted them, so the map
//!   never fills up with churn.
//! - Fair shares of `ORIG_DST`: each pod may have at most
//!   `--max-pod-pending-connects` recorded sockets in `SYN_SENT`
//!   (`POD_PENDING`, counted up at `TCP_CONNECT_CB`, down when the socket
//!   leaves `SYN_SENT`). A connect beyond it gets no record, so ztunnel
//!   resets it: a pod whose connects hang (it drops its own SYNs) holds its
//!   share and no more. Established connections ztunnel has not accepted
//!   yet are bounded by the pod's own listener backlog.
//! - With `--sockmap on`, both ends of a pod-local leg (the application and
//!   ztunnel's outbound listener, over loopback) go into `LOCAL_LEG_SOCKETS`,
//!   where `accelerate_local_leg` moves payload between them directly.

use aya_ebpf::{
    bindings::{
        BPF_ANY, BPF_NOEXIST, BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG,
        BPF_SOCK_OPS_TCP_CONNECT_CB, BPF_TCP_CLOSE, BPF_TCP_SYN_SENT, bpf_sock_ops,
    },
    helpers::{bpf_get_netns_cookie, bpf_sock_ops_cb_flags_set},
    macros::sock_ops,
    programs::SockOpsContext,
};
use core::{
    intrinsics::{AtomicOrdering, atomic_xadd},
    mem::MaybeUninit,
};

use ztunnel_common::{Counter, ORIG_DST_COUNTED, OUTBOUND_PORT, OrigDstKey, PodPending, SockKey};

use crate::{
    maps::{
        LOCAL_LEG_SOCKETS, ORIG_DST, ORIG_DST_BY_SOCKET, POD_CAPTURE, POD_PENDING, count,
        max_pod_pending, sockmap_enabled,
    },
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
    if op == BPF_SOCK_OPS_TCP_CONNECT_CB {
        // SAFETY: forwarded.
        return unsafe { record_orig_dst(ctx) };
    }
    if op == BPF_SOCK_OPS_STATE_CB {
        // SAFETY: forwarded.
        return unsafe { forget_orig_dst(ctx) };
    }
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

    if !sockmap_enabled() || !is_loopback(&local) || !is_loopback(&remote) {
        return Ok(());
    }
    let local_leg = if active {
        remote_port == OUTBOUND_PORT
    } else {
        local_port == OUTBOUND_PORT
    };
    // SAFETY: plain-data value, only tested for presence.
    if !local_leg || unsafe { POD_CAPTURE.get(netns) }.is_none() {
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

/// The `ORIG_DST` key of the client socket this callback is about.
unsafe fn client_key(ctx: &SockOpsContext) -> Option<OrigDstKey> {
    let mut fields = MaybeUninit::<SockFields>::uninit();
    // SAFETY: the live context and a stack slot the function fills entirely.
    let fields = unsafe {
        snapshot_sock_ops(ctx.ops, fields.as_mut_ptr());
        fields.assume_init()
    };
    let (local, _) = fields.addrs()?;
    // SAFETY: valid context pointer for this helper in sock_ops programs.
    let netns = unsafe { bpf_get_netns_cookie(ctx.ops.cast()) };
    Some(OrigDstKey {
        netns_cookie: netns,
        client_addr: local,
        client_port: fields.local_port as u16,
        _pad: [0; 6],
    })
}

/// Adds `delta` (wrapping: `u64::MAX` takes one away) to a counter in a
/// map value that other CPUs update too. The result is not used, so this is
/// the plain atomic add every kernel we support has.
#[inline(always)]
unsafe fn atomic_add(slot: *mut u64, delta: u64) {
    // SAFETY: the caller passes a pointer into a map value, valid and
    // aligned for the program's run.
    let _ = unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(slot, delta) };
}

/// Pod `netns`'s entry in `POD_PENDING`, made when missing. `None` when the
/// map is full: that pod is then limited by the node-wide map only.
#[inline(always)]
fn pod_pending(netns: u64) -> Option<*mut PodPending> {
    if let Some(slot) = POD_PENDING.get_ptr_mut(netns) {
        return Some(slot);
    }
    // NOEXIST: two CPUs racing to make it must not reset each other's count.
    let _ = POD_PENDING.insert(netns, PodPending::default(), u64::from(BPF_NOEXIST));
    POD_PENDING.get_ptr_mut(netns)
}

/// `TCP_CONNECT_CB`: a socket whose storage holds an original destination
/// (so `capture_connect4/6` redirected it) publishes it under its client
/// address for ztunnel, if its pod is within its share, and asks for state
/// callbacks so the entry can be removed at close.
unsafe fn record_orig_dst(ctx: &SockOpsContext) -> Result<(), ()> {
    // SAFETY: the live context.
    let sk = unsafe { sock_ops_sk(ctx.ops) };
    if sk.is_null() {
        return Err(());
    }
    // SAFETY: a full socket from the context.
    let slot = unsafe { ORIG_DST_BY_SOCKET.get(sk.cast()) }.ok_or(())?;
    let orig = *slot;
    // SAFETY: forwarded.
    let key = unsafe { client_key(ctx) }.ok_or(())?;
    let share = pod_pending(key.netns_cookie);
    if let Some(share) = share {
        // A plain read: CPUs racing past the check at once overshoot the
        // share by at most their number.
        // SAFETY: a pointer into the map value, valid for the program's run.
        if unsafe { (*share).pending } >= u64::from(max_pod_pending()) {
            // SAFETY: as above.
            unsafe { atomic_add(&raw mut (*share).refused, 1) };
            count(Counter::OrigDstPodShareFull);
            // No record: the connection reaches the outbound listener,
            // where ztunnel finds none and resets it.
            return Ok(());
        }
    }
    if ORIG_DST.insert(key, orig, u64::from(BPF_ANY)).is_ok() {
        count(Counter::OrigDstRecorded);
        if let Some(share) = share {
            // SAFETY: as above.
            unsafe { atomic_add(&raw mut (*share).pending, 1) };
            slot.flags |= ORIG_DST_COUNTED;
        }
    } else {
        // Fail closed without a bypass: the connection still goes to the
        // outbound listener, where ztunnel finds no record and resets it.
        count(Counter::OrigDstInsertFailed);
    }
    // SAFETY: the live context; only this program sets callback flags.
    unsafe { bpf_sock_ops_cb_flags_set(ctx.ops, BPF_SOCK_OPS_STATE_CB_FLAG as i32) };
    Ok(())
}

/// `STATE_CB`: a counted socket leaving `SYN_SENT` gives its place in the
/// pod's share back; when a captured socket reaches `CLOSE`, its `ORIG_DST`
/// entry (if ztunnel never took it) goes too.
unsafe fn forget_orig_dst(ctx: &SockOpsContext) -> Result<(), ()> {
    // SAFETY: the live context.
    let (old_state, new_state) = unsafe { (sock_ops_arg0(ctx.ops), sock_ops_arg1(ctx.ops)) };
    if old_state == BPF_TCP_SYN_SENT {
        // SAFETY: forwarded.
        unsafe { give_back_share(ctx) };
    }
    if new_state != BPF_TCP_CLOSE {
        return Ok(());
    }
    // SAFETY: forwarded.
    let key = unsafe { client_key(ctx) }.ok_or(())?;
    if ORIG_DST.remove(key).is_ok() {
        count(Counter::OrigDstRemovedAtClose);
    }
    Ok(())
}

/// Takes one from the pod's pending count if this socket was counted, once.
unsafe fn give_back_share(ctx: &SockOpsContext) {
    // SAFETY: the live context.
    let sk = unsafe { sock_ops_sk(ctx.ops) };
    if sk.is_null() {
        return;
    }
    // SAFETY: a full socket from the context.
    let Some(slot) = (unsafe { ORIG_DST_BY_SOCKET.get(sk.cast()) }) else {
        return;
    };
    if slot.flags & ORIG_DST_COUNTED == 0 {
        return;
    }
    slot.flags &= !ORIG_DST_COUNTED;
    // SAFETY: valid context pointer for this helper in sock_ops programs.
    let netns = unsafe { bpf_get_netns_cookie(ctx.ops.cast()) };
    if let Some(share) = POD_PENDING.get_ptr_mut(netns) {
        // Never below zero: an entry made again after the pod's removal
        // starts at zero while older sockets still give back.
        // SAFETY: a pointer into the map value, valid for the program's run.
        if unsafe { (*share).pending } > 0 {
            // SAFETY: as above.
            unsafe { atomic_add(&raw mut (*share).pending, u64::MAX) };
        }
    }
}

/// `bpf_sock_ops.sk`, out of line so the access is a plain context load.
#[inline(never)]
unsafe fn sock_ops_sk(ctx: *const bpf_sock_ops) -> *mut aya_ebpf::bindings::bpf_sock {
    // SAFETY: the caller passes the live context.
    unsafe { (*ctx).__bindgen_anon_2.sk }
}

/// `bpf_sock_ops.args[0]` (the old state in `STATE_CB`), out of line for
/// the same reason.
#[inline(never)]
unsafe fn sock_ops_arg0(ctx: *const bpf_sock_ops) -> u32 {
    // SAFETY: the caller passes the live context.
    unsafe { (*ctx).__bindgen_anon_1.args[0] }
}

/// `bpf_sock_ops.args[1]` (the new state in `STATE_CB`), out of line for
/// the same reason.
#[inline(never)]
unsafe fn sock_ops_arg1(ctx: *const bpf_sock_ops) -> u32 {
    // SAFETY: the caller passes the live context.
    unsafe { (*ctx).__bindgen_anon_1.args[1] }
}
