//! ztunnel's kernel programs.
//!
//! | program                | hook                     | reads                                   | writes                         |
//! |------------------------|--------------------------|-----------------------------------------|--------------------------------|
//! | `capture_connect4/6`   | `cgroup/connect4`/`6`    | `POD_CAPTURE`, exclusions, socket mark  | `ORIG_DST_BY_COOKIE`, the dst    |
//! | `capture_sockops`      | `sockops` (cgroup)       | `ORIG_DST_BY_COOKIE`, `CAPTURE_SETTINGS`  | `ORIG_DST`, `LOCAL_LEG_SOCKETS`|
//! | `accelerate_local_leg` | `sk_msg` on the sockhash | `LOCAL_LEG_SOCKETS`                     | (redirects payload)            |
//! | `capture_ingress`      | TC ingress on pod `eth0` | packet headers, exclusions, sockets     | `bpf_sk_assign` to 15006       |
//!
//! Every program counts what it did in `CAPTURE_COUNTERS`. None of them
//! rejects a `connect()` or drops a packet it does not own, with one
//! exception that is deliberate: an inbound SYN for an enrolled pod whose
//! plaintext-inbound listener is gone is dropped, because letting it reach
//! the application would bypass the mesh (fail closed).
#![no_std]
#![no_main]

mod accel;
mod inbound;
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
