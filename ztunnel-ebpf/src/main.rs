//! ztunnel's kernel programs.
//!
//! | program                | hook                          | reads                                       | writes                                  |
//! |------------------------|-------------------------------|---------------------------------------------|-----------------------------------------|
//! | `capture_connect4/6`   | `cgroup/connect4`/`6`         | `POD_CAPTURE`, `ZTUNNEL_SOCKETS`, exclusions | `ORIG_DST_BY_SOCKET`, the destination  |
//! | `capture_getpeername4/6` | `cgroup/getpeername4`/`6`   | `ORIG_DST_BY_SOCKET`                        | the address `getpeername()` returns     |
//! | `capture_sockops`      | `sockops` (cgroup)            | `ORIG_DST_BY_SOCKET`, `CAPTURE_SETTINGS`    | `ORIG_DST`, `POD_PENDING`, `LOCAL_LEG_SOCKETS` |
//! | `accelerate_local_leg` | `sk_msg` on the sockhash      | `LOCAL_LEG_SOCKETS`                         | (redirects payload)                     |
//! | `capture_lookup`       | `sk_lookup` in each pod netns | `POD_LISTENERS`, exclusions                 | the listener a new connection goes to   |
//! | `capture_ingress`      | TC ingress on pod `eth0`      | packet headers                              | counters only                           |
//! | `guard_egress`         | TC egress on pod `eth0`       | the packet's socket, packet headers         | drops TCP that no TCP socket sent       |
//!
//! Every program counts what it did in `CAPTURE_COUNTERS`. Three refuse on
//! purpose, to fail closed: `capture_connect4/6` refuse a connect whose
//! original destination cannot be stored, `capture_lookup` drops a new
//! inbound connection of an enrolled pod when ztunnel has no listener for
//! it, and `guard_egress` drops TCP that a raw or packet socket of the pod
//! sends around the connect hooks. Nothing else is rejected or dropped.
#![no_std]
#![no_main]
// The BPF target has no atomic read-modify-write types; the intrinsic is
// the one way to an atomic add (`sockops.rs`).
#![feature(core_intrinsics)]
#![allow(internal_features)]
// aya's program macros hand each program its context by value.
#![allow(clippy::needless_pass_by_value)]
// Small helpers are forced inline on purpose: a BPF-to-BPF call costs
// stack frames (512 bytes for the whole chain) and some context-derived
// pointers must not cross a call for the verifier to keep their types.
#![allow(clippy::inline_always)]

mod accel;
mod egress;
mod inbound;
mod lookup;
mod maps;
mod net;
mod outbound;
mod sockops;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any program that could reach this; it only exists
    // because `no_std` binaries must name a panic handler.
    loop {}
}

/// A GPL-compatible licence string, so the verifier lets us call every helper
/// we need (some, such as `bpf_probe_read`, are GPL-only).
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
