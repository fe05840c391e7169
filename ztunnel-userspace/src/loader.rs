//! Loads the embedded kernel object: probes the kernel, raises memlock,
//! reuses or creates the pinned maps, loads every program, and keeps the
//! aya-log reader alive, draining kernel log records into `tracing`.

use std::{
    os::fd::{AsFd as _, AsRawFd as _},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
};

use aya::{
    Ebpf, EbpfLoader,
    programs::{CgroupSockAddr, SchedClassifier, SkLookup, SkMsg, SockOps},
};

use crate::{
    bpffs::{BpffsError, PinRoot},
    probe::{self, ProbeError},
};

/// The kernel object built by `cargo xtask build-ebpf`.
pub static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ztunnel-ebpf.o"));

/// Program names in the object (the Rust function names).
pub mod program {
    /// `cgroup/connect4`.
    pub const CONNECT4: &str = "capture_connect4";
    /// `cgroup/connect6`.
    pub const CONNECT6: &str = "capture_connect6";
    /// `cgroup/getpeername4`.
    pub const GETPEERNAME4: &str = "capture_getpeername4";
    /// `cgroup/getpeername6`.
    pub const GETPEERNAME6: &str = "capture_getpeername6";
    /// `sockops`.
    pub const SOCKOPS: &str = "capture_sockops";
    /// `sk_msg` on the local-leg sockhash.
    pub const SK_MSG: &str = "accelerate_local_leg";
    /// TC ingress on pod `eth0` (counters only).
    pub const INGRESS: &str = "capture_ingress";
    /// TC egress guard (pod `eth0`).
    pub const EGRESS: &str = "guard_egress";
    /// `sk_lookup` in each enrolled pod's network namespace.
    pub const LOOKUP: &str = "capture_lookup";
}

/// Errors of loading.
#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    /// The binary was built (as `cargo check`/`cargo build` on a fresh
    /// clone do) before `cargo xtask build-ebpf` made the kernel object.
    #[error(
        "this ztunnel binary carries no eBPF object: it was built before `cargo xtask \
         build-ebpf` ran (e.g. a plain `cargo build` on a fresh clone). Rebuild with \
         `cargo xtask build-ebpf` followed by `cargo build`, or use `--capture iptables`"
    )]
    NoObject,
    /// The kernel is not fit to run us.
    #[error(transparent)]
    Probe(#[from] ProbeError),
    /// The pin folder is unusable.
    #[error(transparent)]
    Bpffs(#[from] BpffsError),
    /// aya could not load the object (verifier, map creation, ...).
    #[error("loading the eBPF object failed: {0}")]
    Load(#[from] aya::EbpfError),
    /// A program could not be loaded into the kernel.
    #[error("loading program {name} failed: {source}")]
    Program {
        /// The program.
        name: &'static str,
        /// What aya said (includes the verifier log).
        source: aya::programs::ProgramError,
    },
    /// A pinned map was made by a build whose map layout differs.
    #[error(
        "pinned map {path} was made by another ztunnel build ({found}; this build needs \
         {wanted}): stop that ztunnel with `--cleanup` (or remove the pin folder once no pod \
         is enrolled) before starting this one; reusing it would break capture"
    )]
    IncompatiblePin {
        /// The pin.
        path: std::path::PathBuf,
        /// What the pinned map is.
        found: String,
        /// What this build's object declares.
        wanted: String,
    },
    /// The embedded object cannot be parsed.
    #[error("the embedded eBPF object cannot be parsed: {0}")]
    Parse(String),
    /// The object lacks something we expect (a build mismatch).
    #[error("the embedded eBPF object has no {0}: rebuild with `cargo xtask build-ebpf`")]
    Missing(String),
}

/// The loaded object plus its log reader.
pub struct KernelPrograms {
    /// aya's handle: programs, maps.
    pub ebpf: Ebpf,
    log_stop: Arc<AtomicBool>,
    log_thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for KernelPrograms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelPrograms").finish_non_exhaustive()
    }
}

impl Drop for KernelPrograms {
    fn drop(&mut self) {
        self.log_stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.log_thread.take() {
            let _ = thread.join();
        }
    }
}

/// Raises `RLIMIT_MEMLOCK` for kernels that still charge BPF memory to it
/// (before 5.11); harmless elsewhere.
fn raise_memlock() {
    let limit = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: plain setrlimit(2) with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &raw const limit) } != 0 {
        tracing::debug!("could not raise RLIMIT_MEMLOCK; fine on kernels >= 5.11");
    }
}

/// Raises `RLIMIT_NOFILE` to its hard limit: every proxied connection
/// holds two or three sockets.
pub fn raise_nofile() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &raw const lim);
        }
    }
}

/// Probes the kernel and loads every program, with maps pinned under `pins`.
pub fn load(pins: &PinRoot) -> Result<KernelPrograms, LoaderError> {
    if EBPF_OBJECT.is_empty() {
        return Err(LoaderError::NoObject);
    }
    probe::check_kernel()?;
    check_pinned_maps(pins)?;
    raise_memlock();
    raise_nofile();
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(pins.maps())
        .load(EBPF_OBJECT)?;

    let (log_stop, log_thread) = start_log_reader(&mut ebpf);

    for name in [
        program::CONNECT4,
        program::CONNECT6,
        program::GETPEERNAME4,
        program::GETPEERNAME6,
    ] {
        let prog: &mut CgroupSockAddr = program_mut(&mut ebpf, name)?;
        prog.load()
            .map_err(|source| LoaderError::Program { name, source })?;
    }
    let prog: &mut SockOps = program_mut(&mut ebpf, program::SOCKOPS)?;
    prog.load().map_err(|source| LoaderError::Program {
        name: program::SOCKOPS,
        source,
    })?;
    let prog: &mut SkMsg = program_mut(&mut ebpf, program::SK_MSG)?;
    prog.load().map_err(|source| LoaderError::Program {
        name: program::SK_MSG,
        source,
    })?;
    for name in [program::INGRESS, program::EGRESS] {
        let prog: &mut SchedClassifier = program_mut(&mut ebpf, name)?;
        prog.load()
            .map_err(|source| LoaderError::Program { name, source })?;
    }
    let prog: &mut SkLookup = program_mut(&mut ebpf, program::LOOKUP)?;
    prog.load().map_err(|source| LoaderError::Program {
        name: program::LOOKUP,
        source,
    })?;

    Ok(KernelPrograms {
        ebpf,
        log_stop,
        log_thread,
    })
}

/// Refuses to start over pinned maps whose type, key, value or size differ
/// from this build's. aya reuses a pinned map by name without comparing:
/// after an upgrade that changed a map, the programs would run against the
/// old shape (counters silently lost, lookups failing) instead of failing
/// loudly here.
fn check_pinned_maps(pins: &PinRoot) -> Result<(), LoaderError> {
    let object =
        aya_obj::Object::parse(EBPF_OBJECT).map_err(|e| LoaderError::Parse(e.to_string()))?;
    for (name, map) in &object.maps {
        let path = pins.maps().join(name);
        if !path.exists() {
            continue;
        }
        let shape = |kind: u32, key: u32, value: u32, entries: u32| {
            format!("type {kind}, key {key} B, value {value} B, {entries} entries")
        };
        let wanted = shape(
            map.map_type(),
            map.key_size(),
            map.value_size(),
            map.max_entries(),
        );
        let found = match aya::maps::MapData::from_pin(&path).and_then(|m| m.info()) {
            Ok(info) => shape(
                info.map_type().map_or(u32::MAX, |t| t as u32),
                info.key_size(),
                info.value_size(),
                info.max_entries(),
            ),
            Err(e) => format!("unreadable: {e}"),
        };
        if found != wanted {
            return Err(LoaderError::IncompatiblePin {
                path,
                found,
                wanted,
            });
        }
    }
    Ok(())
}

/// Looks a program up by name and converts it to its concrete type.
pub fn program_mut<'a, T>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut T, LoaderError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program>,
{
    ebpf.program_mut(name)
        .ok_or_else(|| LoaderError::Missing(format!("program {name}")))?
        .try_into()
        .map_err(|_| LoaderError::Missing(format!("program {name} of the expected type")))
}

/// Starts the thread that drains aya-log records into `log` (and so into
/// `tracing`). The logger must live as long as the programs: dropping it
/// closes the log map and breaks later loads.
fn start_log_reader(ebpf: &mut Ebpf) -> (Arc<AtomicBool>, Option<JoinHandle<()>>) {
    let stop = Arc::new(AtomicBool::new(false));
    let mut logger = match aya_log::EbpfLogger::init(ebpf) {
        Ok(logger) => logger,
        Err(error) => {
            tracing::warn!(%error, "kernel program logs unavailable");
            return (stop, None);
        }
    };
    let flag = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name("ebpf-log".into())
        .spawn(move || {
            let fd = logger.as_fd().as_raw_fd();
            while !flag.load(Ordering::Relaxed) {
                let mut pfd = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd; bounded wait so stop is noticed.
                let ready = unsafe { libc::poll(&raw mut pfd, 1, 200) };
                if ready > 0 {
                    logger.flush();
                }
            }
            logger.flush();
        })
        .ok();
    (stop, thread)
}
