//! Keeping the footprint small, and giving memory back.
//!
//! The `ztunnel` binary allocates with jemalloc (`main.rs`), not glibc's
//! malloc. glibc mixes objects of every size on its heaps: after a burst
//! of connections, the few long-lived objects left among the freed ones
//! (the log subscriber's span slots, pooled connections' stream tables)
//! pin the pages around them, so 10,000 closed connections left more than
//! 50 MiB resident for good, `malloc_trim` or not. jemalloc keeps objects
//! of one size class together in their own slabs, and its background
//! thread returns pages that stay unused for a few seconds without waiting
//! for the next allocation (docs/performance.md has the A/B).
//!
//! Start-up is the allocation peak of an idle process (aya parses the
//! kernel's BTF, rcgen issues certificates): [`release_startup_heap`]
//! returns it at once instead of after the decay time.
//!
//! Transparent huge pages are turned off for the process
//! ([`no_transparent_huge_pages`]). Where the kernel gives them to every
//! anonymous mapping (`enabled = always`, the default of Debian's and
//! RHEL's kernels), jemalloc's heap was backed by 2 MiB pages: the idle
//! process held 15 MiB of private memory instead of 2.7 MiB, and after
//! 10,000 idle connections closed, half of what they had taken stayed
//! resident (a huge page is only given back when all of it is free),
//! found with the memory test on Debian's 6.1 kernel in QEMU.

use std::ptr;

/// jemalloc's settings, read when it initialises (before `main`):
/// - `background_thread`: a thread that purges unused pages on time, so
///   memory comes back after a burst even when the process then goes quiet
///   (without it, purging only happens inside later allocations);
/// - `dirty_decay_ms:5000`, `muzzy_decay_ms:0`: freed pages unused for
///   about 5 s are returned with `MADV_DONTNEED` (which lowers RSS at once;
///   the "muzzy" `MADV_FREE` stage would keep them counted until the kernel
///   needs them). Short enough to see memory come back within seconds,
///   long enough not to return and refault pages under steady churn;
/// - `narenas:2`: arenas for the data plane's workers (default 2) and
///   everyone else share them; jemalloc's default of four per CPU would
///   spread a quiet process's few allocations over dozens of arenas, each
///   with its own partly used pages.
pub const JEMALLOC_CONF: &std::ffi::CStr =
    c"background_thread:true,dirty_decay_ms:5000,muzzy_decay_ms:0,narenas:2";

/// Asks the kernel not to back this process's memory with transparent huge
/// pages (`PR_SET_THP_DISABLE`), whatever the node's setting. Call first
/// thing in `main`, before the heap grows. A kernel that refuses only costs
/// memory, so that is logged by the caller, never fatal.
pub fn no_transparent_huge_pages() -> std::io::Result<()> {
    // SAFETY: prctl with PR_SET_THP_DISABLE takes integer arguments only.
    let rc = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `MALLCTL_ARENAS_ALL`: "every arena" in jemalloc's `arena.<i>.*` names.
const PURGE_ALL_ARENAS: &std::ffi::CStr = c"arena.4096.purge";

/// Returns the memory freed after start-up to the kernel. Call once the
/// programs are loaded and the first pods enrolled.
pub fn release_startup_heap() {
    // SAFETY: `arena.<i>.purge` takes and returns nothing; the name is a
    // valid C string. Without jemalloc as the global allocator (the
    // library's own tests) it only purges jemalloc's empty arenas.
    let rc = unsafe {
        tikv_jemalloc_sys::mallctl(
            PURGE_ALL_ARENAS.as_ptr(),
            ptr::null_mut(),
            ptr::null_mut(),
            ptr::null_mut(),
            0,
        )
    };
    if rc != 0 {
        tracing::debug!(rc, "jemalloc purge failed");
    }
}
