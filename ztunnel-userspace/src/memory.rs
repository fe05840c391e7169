//! Keeping the idle footprint small.
//!
//! Start-up is the allocation peak of the process: aya parses the kernel's
//! BTF (several MiB) and the embedded object, rcgen issues certificates and
//! the config is parsed. glibc keeps most of that freed memory in its heap
//! (it only gives back the top of it), so without help an idle ztunnel
//! carries megabytes of free heap for its whole life. Capping the number of
//! malloc arenas keeps every short-lived helper thread (enrolment, socket
//! factories, config watch) from growing an arena of its own.

/// malloc arenas: the data plane's workers plus one for everyone else.
/// glibc's default is 8 per core, which on a big node means dozens of
/// mostly idle arenas.
pub fn limit_arenas(worker_threads: usize) {
    let arenas = i32::try_from(worker_threads.saturating_add(1)).unwrap_or(i32::MAX);
    // SAFETY: mallopt only changes allocator tuning; called before the
    // worker threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, arenas);
    }
}

/// Returns the heap freed after start-up to the kernel. Call once the
/// programs are loaded and the first pods enrolled.
pub fn release_startup_heap() {
    // SAFETY: malloc_trim only releases free memory; it is thread safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
