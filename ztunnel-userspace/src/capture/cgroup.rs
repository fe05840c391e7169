//! The cgroup side of capture: `connect4`, `connect6` and `sock_ops` on the
//! capture cgroup, and `sk_msg` on the local-leg sockhash.
//!
//! Cgroup programs are attached so that they run alongside whatever else is
//! attached there (a CNI's or a security agent's programs) and never replace
//! it: as `bpf_link`s on kernels >= 5.7 (link attachments are always
//! multi-attach, and the kernel wants no flags for them), and with
//! `BPF_F_ALLOW_MULTI` on older kernels. Each link is pinned; a
//! restarted ztunnel finds the pin and swaps its freshly loaded program into
//! the existing link with `BPF_LINK_UPDATE`, so there is no moment in which
//! connects are not captured.

use std::{
    fs::File,
    os::{
        fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{Array, MapData, SockHash},
    programs::{CgroupAttachMode, CgroupSockAddr, SkMsg, SockOps, links::FdLink},
};
use ztunnel_common::{CaptureSettings, MAP_LOCAL_LEG_SOCKETS, MAP_SETTINGS, SockKey};

use super::{CaptureError, map_err};
use crate::{
    bpffs::PinRoot,
    loader::{program, program_mut},
};

/// The cgroup programs, in attach order.
pub const CGROUP_PROGRAMS: [&str; 5] = [
    program::CONNECT4,
    program::CONNECT6,
    program::GETPEERNAME4,
    program::GETPEERNAME6,
    program::SOCKOPS,
];

/// Name of the pin of a cgroup program's link.
pub fn pin_name(program: &str) -> String {
    format!("cgroup_{program}")
}

/// What [`attach`] did, for logs and the admin dump.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupAttachment {
    /// The cgroup the programs run on.
    pub cgroup: PathBuf,
    /// The pinned links, one per program.
    pub pins: Vec<PathBuf>,
    /// Whether an existing pinned link was taken over instead of created.
    pub took_over: bool,
}

/// What the cgroup programs are told at start-up (`CAPTURE_SETTINGS`).
#[derive(Debug, Clone, Copy)]
pub struct KernelSettings {
    /// sk_msg acceleration of pod-local legs.
    pub sockmap: bool,
    /// A pod's share of `ORIG_DST` (sockets in `SYN_SENT`).
    pub max_pod_pending: u32,
}

impl Default for KernelSettings {
    fn default() -> Self {
        Self {
            sockmap: false,
            max_pod_pending: ztunnel_common::DEFAULT_MAX_POD_PENDING,
        }
    }
}

/// Attaches (or takes over) the cgroup programs on `cgroup`, writes the
/// settings, and sets up acceleration when `sockmap` is on.
pub fn attach(
    ebpf: &mut Ebpf,
    pins: &PinRoot,
    cgroup: &Path,
    settings: KernelSettings,
) -> Result<CgroupAttachment, CaptureError> {
    let dir = File::open(cgroup).map_err(|source| CaptureError::Io {
        what: format!("opening cgroup {}", cgroup.display()),
        source,
    })?;
    let mut out = CgroupAttachment {
        cgroup: cgroup.to_path_buf(),
        pins: Vec::new(),
        took_over: false,
    };
    for name in CGROUP_PROGRAMS {
        let pin = pins.link(&pin_name(name));
        let mut prog = CgroupProgram::get(ebpf, name)?;
        let prog_fd = prog
            .raw_fd()
            .map_err(|source| attach_err(name, cgroup, source))?;
        if pin.exists() {
            take_over(&pin, prog_fd)?;
            out.took_over = true;
        } else {
            let link = prog
                .attach_and_take(&dir)
                .map_err(|source| attach_err(name, cgroup, source))?;
            let link = link.map_err(|e| link_err(&pin, e))?;
            link.pin(&pin).map_err(|e| link_err(&pin, e))?;
        }
        out.pins.push(pin);
    }
    configure(ebpf, settings)?;
    Ok(out)
}

/// The two program types that attach to a cgroup.
enum CgroupProgram<'a> {
    SockAddr(&'a mut CgroupSockAddr),
    SockOps(&'a mut SockOps),
}

impl<'a> CgroupProgram<'a> {
    fn get(ebpf: &'a mut Ebpf, name: &str) -> Result<Self, CaptureError> {
        Ok(if name == program::SOCKOPS {
            Self::SockOps(program_mut(ebpf, name)?)
        } else {
            Self::SockAddr(program_mut(ebpf, name)?)
        })
    }

    fn raw_fd(&self) -> Result<i32, aya::programs::ProgramError> {
        Ok(match self {
            Self::SockAddr(p) => p.fd()?.as_fd().as_raw_fd(),
            Self::SockOps(p) => p.fd()?.as_fd().as_raw_fd(),
        })
    }

    /// Attaches to the cgroup and takes the link out of aya's bookkeeping
    /// (so dropping the program does not detach it).
    fn attach_and_take(
        &mut self,
        dir: &File,
    ) -> Result<Result<FdLink, aya::programs::links::LinkError>, aya::programs::ProgramError> {
        Ok(match self {
            Self::SockAddr(p) => {
                let id = p.attach(dir, attach_mode())?;
                FdLink::try_from(p.take_link(id)?)
            }
            Self::SockOps(p) => {
                let id = p.attach(dir, attach_mode())?;
                FdLink::try_from(p.take_link(id)?)
            }
        })
    }
}

/// The attach mode that coexists with other programs on this kernel.
fn attach_mode() -> CgroupAttachMode {
    let links = aya::util::KernelVersion::current()
        .is_ok_and(|v| v >= aya::util::KernelVersion::new(5, 7, 0));
    if links {
        // aya uses bpf_link_create here, which is multi-attach by nature and
        // rejects the ALLOW_MULTI flag.
        CgroupAttachMode::Single
    } else {
        CgroupAttachMode::AllowMultiple
    }
}

/// Writes the settings and attaches `sk_msg` to the sockhash when sockmap
/// is on.
fn configure(ebpf: &mut Ebpf, wanted: KernelSettings) -> Result<(), CaptureError> {
    let enabled = wanted.sockmap;
    {
        let map = ebpf
            .map_mut(MAP_SETTINGS)
            .ok_or_else(|| map_err(MAP_SETTINGS, "not in the object"))?;
        let mut settings: Array<&mut MapData, CaptureSettings> =
            Array::try_from(map).map_err(|e| map_err(MAP_SETTINGS, e))?;
        settings
            .set(
                0,
                CaptureSettings {
                    sockmap_enabled: u32::from(enabled),
                    max_pod_pending: wanted.max_pod_pending,
                },
                0,
            )
            .map_err(|e| map_err(MAP_SETTINGS, e))?;
    }
    if !enabled {
        return Ok(());
    }
    let map_fd = {
        let map = ebpf
            .map(MAP_LOCAL_LEG_SOCKETS)
            .ok_or_else(|| map_err(MAP_LOCAL_LEG_SOCKETS, "not in the object"))?;
        let hash: SockHash<&MapData, SockKey> =
            SockHash::try_from(map).map_err(|e| map_err(MAP_LOCAL_LEG_SOCKETS, e))?;
        hash.fd().try_clone().map_err(|source| CaptureError::Io {
            what: "duplicating the sockhash fd".into(),
            source,
        })?
    };
    let prog: &mut SkMsg = program_mut(ebpf, program::SK_MSG)?;
    prog.attach(&map_fd)
        .map_err(|source| CaptureError::Attach {
            program: program::SK_MSG,
            target: MAP_LOCAL_LEG_SOCKETS.into(),
            source,
        })?;
    Ok(())
}

/// Swaps `prog_fd` into the pinned link at `pin` (`BPF_LINK_UPDATE`).
fn take_over(pin: &Path, prog_fd: i32) -> Result<(), CaptureError> {
    let link = obj_get(pin).map_err(|e| link_err(pin, e))?;
    link_update(&link, prog_fd).map_err(|e| link_err(pin, e))?;
    // Dropping the fd leaves the link alive: the pin still holds it.
    drop(link);
    Ok(())
}

/// Whether another ztunnel has taken over this one's cgroup links: the
/// pinned `connect4` link now runs a program other than the one this
/// process loaded (a newer process swapped its own in with
/// `BPF_LINK_UPDATE`). Then this process is the old half of an upgrade and
/// must leave every pin, map entry and attachment to the new one. `None`
/// when there is no such link to ask (the iptables backend, or nothing
/// attached).
pub fn superseded(ebpf: &Ebpf, pins: &PinRoot) -> Option<bool> {
    let pin = pins.link(&pin_name(program::CONNECT4));
    let ours = ebpf
        .program(program::CONNECT4)
        .and_then(|p| <&CgroupSockAddr>::try_from(p).ok())
        .and_then(|p| p.info().ok())
        .map(|info| info.id())?;
    let link = obj_get(&pin).ok()?;
    let running = link_prog_id(&link).ok()?;
    Some(running != ours)
}

/// `bpf(BPF_OBJ_GET_INFO_BY_FD)` on a link: the id of the program it runs.
fn link_prog_id(link: &impl AsFd) -> std::io::Result<u32> {
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    // struct bpf_link_info starts with type, id, prog_id (all u32); the
    // rest (a union per link type) is not needed, and a shorter buffer is
    // allowed.
    let mut info = [0u32; 3];
    let attr = InfoAttr {
        bpf_fd: link.as_fd().as_raw_fd() as u32,
        info_len: std::mem::size_of_val(&info) as u32,
        info: info.as_mut_ptr() as u64,
    };
    // SAFETY: bpf(2) with a valid attr; `info` outlives the call and is as
    // long as `info_len` says.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            &raw const attr,
            std::mem::size_of::<InfoAttr>(),
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(info[2])
}

/// `bpf(BPF_OBJ_GET)`: opens a pinned object.
pub(crate) fn obj_get(pin: &Path) -> std::io::Result<OwnedFd> {
    const BPF_OBJ_GET: libc::c_long = 7;
    #[repr(C)]
    struct ObjGetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    let path = std::ffi::CString::new(pin.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let attr = ObjGetAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    // SAFETY: bpf(2) with a valid attr; `path` outlives the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            &raw const attr,
            std::mem::size_of::<ObjGetAttr>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a fresh fd that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `bpf(BPF_LINK_UPDATE)`: atomically replaces the program behind a link.
pub(crate) fn link_update(link: &impl AsFd, prog_fd: i32) -> std::io::Result<()> {
    const BPF_LINK_UPDATE: libc::c_long = 29;
    #[repr(C)]
    struct LinkUpdateAttr {
        link_fd: u32,
        new_prog_fd: u32,
        flags: u32,
        old_prog_fd: u32,
    }
    let attr = LinkUpdateAttr {
        link_fd: link.as_fd().as_raw_fd() as u32,
        new_prog_fd: prog_fd as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    // SAFETY: bpf(2) with a correctly sized, initialised attr for this command.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_UPDATE,
            &raw const attr,
            std::mem::size_of::<LinkUpdateAttr>(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Removes the cgroup links' pins. Once no fd refers to a link any more the
/// kernel detaches it.
pub fn unpin(pins: &PinRoot) -> Result<(), CaptureError> {
    for name in CGROUP_PROGRAMS {
        let pin = pins.link(&pin_name(name));
        match std::fs::remove_file(&pin) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(link_err(&pin, e)),
        }
    }
    Ok(())
}

fn attach_err(
    program: &'static str,
    cgroup: &Path,
    source: aya::programs::ProgramError,
) -> CaptureError {
    CaptureError::Attach {
        program,
        target: format!("cgroup {}", cgroup.display()),
        source,
    }
}

fn link_err(pin: &Path, e: impl std::fmt::Display) -> CaptureError {
    CaptureError::Link {
        path: pin.to_path_buf(),
        message: e.to_string(),
    }
}
