//! The TC side of capture: `capture_ingress` on an enrolled pod's `eth0`.
//! It only counts (fragments, IPv6 extension headers, TCP packets); the
//! steering of inbound connections is `sk_lookup`'s job (see [`super::lookup`]).
//!
//! Two ways to attach, both of which coexist with a CNI's own programs:
//! - **tcx** (kernel >= 6.6): a link appended to the interface's ingress
//!   chain. It does not touch qdiscs at all. The link is pinned, so it
//!   outlives ztunnel (fail closed) and a restart swaps the program in place.
//! - **netlink** (older kernels): a `clsact` filter with ztunnel's own
//!   priority and handle. An existing `clsact` qdisc is reused, never
//!   replaced; if ztunnel had to add the qdisc it removes it again on
//!   detach, but only when no other filter is left on it.
//!
//! All work happens on a thread inside the pod's namespace, because
//! interface names and indexes are per namespace.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use aya::{
    Ebpf,
    programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        links::{FdLink, Link as _, PinnedLink},
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    },
};

use super::CaptureError;
use crate::{
    bpffs::PinRoot,
    loader::{program, program_mut},
    netns::PodNetns,
    probe,
};

/// clsact filter priority used in netlink mode. Low enough to be easy to
/// spot in `tc filter show`, high enough to run after a CNI's usual prio-1
/// filters, which keep precedence.
pub const NETLINK_PRIORITY: u16 = 100;
/// clsact filter handle used in netlink mode.
pub const NETLINK_HANDLE: TcHandle = TcHandle::new(0, 0x7a7);

/// How to attach TC programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TcMode {
    /// tcx where the kernel has it (>= 6.6), else netlink.
    #[default]
    Auto,
    /// tcx links only.
    Tcx,
    /// clsact filters over netlink only.
    Netlink,
}

impl TcMode {
    /// Refuses `Tcx` on a kernel that has no tcx, naming the kernel.
    pub fn check(self) -> Result<(), CaptureError> {
        if self == Self::Tcx && !probe::has_tcx() {
            let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map_or_else(|_| "unknown".to_owned(), |r| r.trim().to_owned());
            return Err(CaptureError::TcxUnavailable { kernel });
        }
        Ok(())
    }

    /// Resolves `Auto` against the running kernel.
    #[must_use]
    pub fn resolve(self) -> Self {
        match self {
            Self::Auto if probe::has_tcx() => Self::Tcx,
            Self::Auto => Self::Netlink,
            other => other,
        }
    }
}

/// One pod's ingress attachment, as needed to detach it later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodIngress {
    /// A pinned tcx link.
    Tcx {
        /// The interface inside the pod.
        iface: String,
        /// Where the link is pinned.
        pin: PathBuf,
    },
    /// A clsact filter.
    Netlink {
        /// The interface inside the pod.
        iface: String,
        /// Whether ztunnel added the clsact qdisc (and may remove it).
        created_qdisc: bool,
    },
}

/// Name of the pin of a pod's tcx link. Pod ids are sanitised so that any
/// uid is a valid single path component.
pub fn pin_name(pod_id: &str) -> String {
    format!("tc_{}", super::pin_component(pod_id))
}

/// Attaches the ingress program to `iface` inside `netns`.
pub fn attach(
    ebpf: &mut Ebpf,
    pins: &PinRoot,
    netns: &PodNetns,
    pod_id: &str,
    iface: &str,
    mode: TcMode,
) -> Result<PodIngress, CaptureError> {
    mode.check()?;
    let prog: &mut SchedClassifier = program_mut(ebpf, program::INGRESS)?;
    let target = format!("{iface} in {}", netns.name());
    match mode.resolve() {
        TcMode::Tcx | TcMode::Auto => {
            let pin = pins.link(&pin_name(pod_id));
            netns.run(|| attach_tcx(prog, iface, &pin, &target))??;
            Ok(PodIngress::Tcx {
                iface: iface.to_owned(),
                pin,
            })
        }
        TcMode::Netlink => {
            let created_qdisc = netns.run(|| attach_netlink(prog, iface, &target))??;
            Ok(PodIngress::Netlink {
                iface: iface.to_owned(),
                created_qdisc,
            })
        }
    }
}

fn attach_tcx(
    prog: &mut SchedClassifier,
    iface: &str,
    pin: &Path,
    target: &str,
) -> Result<(), CaptureError> {
    let err = |source| CaptureError::Attach {
        program: program::INGRESS,
        target: target.to_owned(),
        source,
    };
    let id = if pin.exists() {
        // Restart: swap the new program into the existing link.
        let old = PinnedLink::from_pin(pin).map_err(|e| link_err(pin, e))?;
        let link =
            SchedClassifierLink::try_from(FdLink::from(old)).map_err(|e| link_err(pin, e))?;
        prog.attach_to_link(link).map_err(err)?
    } else {
        let id = prog
            .attach_with_options(
                iface,
                TcAttachType::Ingress,
                TcAttachOptions::TcxOrder(LinkOrder::default()),
            )
            .map_err(err)?;
        let link = prog.take_link(id).map_err(err)?;
        let fd = FdLink::try_from(link).map_err(|e| link_err(pin, e))?;
        fd.pin(pin).map_err(|e| link_err(pin, e))?;
        return Ok(());
    };
    // Release our fd; the pin keeps the link.
    let link = prog.take_link(id).map_err(err)?;
    drop(FdLink::try_from(link).map_err(|e| link_err(pin, e))?);
    Ok(())
}

fn attach_netlink(
    prog: &mut SchedClassifier,
    iface: &str,
    target: &str,
) -> Result<bool, CaptureError> {
    let err = |source| CaptureError::Attach {
        program: program::INGRESS,
        target: target.to_owned(),
        source,
    };
    // A filter at our priority and handle is our own, left on purpose by a
    // ztunnel that stopped without detaching (fail closed). Take it over:
    // adding ours next to it fails with EEXIST, which left a restarted
    // ztunnel unable to enrol the pod on kernels without tcx. The program
    // only counts (steering is sk_lookup's), so the moment without it
    // opens no path around the mesh.
    let took_over = SchedClassifierLink::attached(
        iface,
        TcAttachType::Ingress,
        NETLINK_PRIORITY,
        NETLINK_HANDLE,
        None,
    )
    .is_ok_and(|old| old.detach().is_ok());
    // Adding clsact fails with EEXIST when someone already has one: reuse it.
    // Taken over with no other filter on it, the qdisc is ours as well.
    let created_qdisc =
        tc::qdisc_add_clsact(iface).is_ok() || (took_over && !other_filters(iface)?);
    if took_over {
        tracing::info!(target = %target, "took over the ingress filter of an earlier ztunnel");
    }
    let options = NlOptions {
        priority: NETLINK_PRIORITY,
        handle: NETLINK_HANDLE,
        ..NlOptions::default()
    };
    let id = prog
        .attach_with_options(
            iface,
            TcAttachType::Ingress,
            TcAttachOptions::Netlink(options),
        )
        .map_err(err)?;
    // Forget the link so that the filter stays when this process exits
    // (fail closed); detach finds it again by priority and handle.
    let link = prog.take_link(id).map_err(err)?;
    std::mem::forget(link);
    Ok(created_qdisc)
}

/// Detaches a pod's ingress program and removes what ztunnel created.
pub fn detach(netns: &PodNetns, ingress: &PodIngress) -> Result<(), CaptureError> {
    match ingress {
        PodIngress::Tcx { pin, .. } => match std::fs::remove_file(pin) {
            // The pin was the link's last reference: the kernel detaches it.
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(link_err(pin, e)),
        },
        PodIngress::Netlink {
            iface,
            created_qdisc,
        } => netns.run(|| detach_netlink(iface, *created_qdisc))?,
    }
}

fn detach_netlink(iface: &str, created_qdisc: bool) -> Result<(), CaptureError> {
    let io_err = |what: String| move |source| CaptureError::Io { what, source };
    let link = SchedClassifierLink::attached(
        iface,
        TcAttachType::Ingress,
        NETLINK_PRIORITY,
        NETLINK_HANDLE,
        None,
    )
    .map_err(io_err(format!("finding our filter on {iface}")))?;
    link.detach().map_err(|source| CaptureError::Attach {
        program: program::INGRESS,
        target: format!("{iface} (detach)"),
        source,
    })?;
    if created_qdisc && !other_filters(iface)? {
        Command::new("tc")
            .args(["qdisc", "del", "dev", iface, "clsact"])
            .status()
            .map_err(io_err("running `tc qdisc del`".into()))?;
    }
    Ok(())
}

/// Whether any ingress filter is on `iface` (ours detached by now).
fn other_filters(iface: &str) -> Result<bool, CaptureError> {
    let filters = Command::new("tc")
        .args(["filter", "show", "dev", iface, "ingress"])
        .output()
        .map_err(|source| CaptureError::Io {
            what: "running `tc filter show`".into(),
            source,
        })?;
    Ok(!String::from_utf8_lossy(&filters.stdout).trim().is_empty())
}

fn link_err(pin: &Path, e: impl std::fmt::Display) -> CaptureError {
    CaptureError::Link {
        path: pin.to_path_buf(),
        message: e.to_string(),
    }
}
