//! The TC side of capture, on an enrolled pod's `eth0`:
//! - `capture_ingress` (ingress) only counts (fragments, IPv6 extension
//!   headers, TCP packets); the steering of inbound connections is
//!   `sk_lookup`'s job (see [`super::lookup`]);
//! - `guard_egress` (egress, pods with outbound capture) drops TCP that a
//!   raw or packet socket of the pod sends around the connect hooks.
//!
//! Two ways to attach, both of which coexist with a CNI's own programs:
//! - **tcx** (kernel >= 6.6): a link in the interface's chain (the counter
//!   last, the guard first, so no program before it can pass a packet it
//!   would drop). It does not touch qdiscs at all. The link is pinned, so
//!   it outlives ztunnel (fail closed) and a restart swaps the program in
//!   place.
//! - **netlink** (older kernels): a `clsact` filter with ztunnel's own
//!   priority and handle. An existing `clsact` qdisc is reused, never
//!   replaced; if ztunnel had to add the qdisc it removes it again on
//!   detach, but only when no filter at all is left on it.
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
/// clsact filter handle used in netlink mode (its minor number; the major is 0).
const NETLINK_HANDLE_MINOR: u16 = 0x7a7;
/// clsact filter handle used in netlink mode.
pub const NETLINK_HANDLE: TcHandle = TcHandle::new(0, NETLINK_HANDLE_MINOR);

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

/// One of a pod's two TC hooks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcHook {
    /// `capture_ingress`: counting only.
    Ingress,
    /// `guard_egress`: drops TCP that no TCP socket sent.
    Egress,
}

impl TcHook {
    /// Both hooks, in the order they are attached.
    pub const ALL: [Self; 2] = [Self::Egress, Self::Ingress];

    /// The program attached there.
    pub const fn program(self) -> &'static str {
        match self {
            Self::Ingress => program::INGRESS,
            Self::Egress => program::EGRESS,
        }
    }

    const fn attach_type(self) -> TcAttachType {
        match self {
            Self::Ingress => TcAttachType::Ingress,
            Self::Egress => TcAttachType::Egress,
        }
    }

    /// Where in a tcx chain: the counter last, so it sees what the others
    /// let through; the guard first, so that no program before it can
    /// pass (`TCX_PASS`) a packet it would drop.
    const fn order(self) -> LinkOrder {
        match self {
            Self::Ingress => LinkOrder::last(),
            Self::Egress => LinkOrder::first(),
        }
    }

    /// Name of the pin of a pod's tcx link for this hook. Pod ids are
    /// sanitised so that any uid is a valid single path component.
    pub fn pin_name(self, pod_id: &str) -> String {
        let prefix = match self {
            Self::Ingress => PIN_PREFIX_INGRESS,
            Self::Egress => PIN_PREFIX_EGRESS,
        };
        format!("{prefix}{}", super::pin_component(pod_id))
    }
}

/// Pin name prefixes of the per-pod tcx links (the stale sweep knows a pod's
/// pins by them).
pub const PIN_PREFIX_INGRESS: &str = "tc_";
/// See [`PIN_PREFIX_INGRESS`].
pub const PIN_PREFIX_EGRESS: &str = "tcout_";

/// One of a pod's TC attachments, as needed to detach it later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodTc {
    /// A pinned tcx link.
    Tcx {
        /// The hook.
        hook: TcHook,
        /// The interface inside the pod.
        iface: String,
        /// Where the link is pinned.
        pin: PathBuf,
    },
    /// A clsact filter.
    Netlink {
        /// The hook.
        hook: TcHook,
        /// The interface inside the pod.
        iface: String,
        /// Whether ztunnel added the clsact qdisc (and may remove it).
        created_qdisc: bool,
    },
}

/// Attaches `hook`'s program to `iface` inside `netns`.
pub fn attach(
    ebpf: &mut Ebpf,
    pins: &PinRoot,
    netns: &PodNetns,
    pod_id: &str,
    iface: &str,
    mode: TcMode,
    hook: TcHook,
) -> Result<PodTc, CaptureError> {
    mode.check()?;
    let prog: &mut SchedClassifier = program_mut(ebpf, hook.program())?;
    let target = format!("{iface} in {}", netns.name());
    if hook == TcHook::Egress {
        // The guard reads Ethernet frames; on another kind of device it
        // would read the wrong bytes and let everything pass. Refuse.
        let kind = netns
            .run(|| link_type(iface))?
            .map_err(|source| CaptureError::Io {
                what: format!("reading the link type of {target}"),
                source,
            })?;
        if kind != libc::ARPHRD_ETHER {
            return Err(CaptureError::Io {
                what: format!(
                    "{target} is not an Ethernet device (link type {kind}): the egress guard reads Ethernet frames and is not attached to it"
                ),
                source: std::io::Error::from(std::io::ErrorKind::Unsupported),
            });
        }
    }
    match mode.resolve() {
        TcMode::Tcx | TcMode::Auto => {
            let pin = pins.link(&hook.pin_name(pod_id));
            netns.run(|| attach_tcx(prog, hook, iface, &pin, &target))??;
            Ok(PodTc::Tcx {
                hook,
                iface: iface.to_owned(),
                pin,
            })
        }
        TcMode::Netlink => {
            let created_qdisc = netns.run(|| attach_netlink(prog, hook, iface, &target))??;
            Ok(PodTc::Netlink {
                hook,
                iface: iface.to_owned(),
                created_qdisc,
            })
        }
    }
}

fn attach_tcx(
    prog: &mut SchedClassifier,
    hook: TcHook,
    iface: &str,
    pin: &Path,
    target: &str,
) -> Result<(), CaptureError> {
    let err = |source| CaptureError::Attach {
        program: hook.program(),
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
                hook.attach_type(),
                TcAttachOptions::TcxOrder(hook.order()),
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
    hook: TcHook,
    iface: &str,
    target: &str,
) -> Result<bool, CaptureError> {
    let err = |source| CaptureError::Attach {
        program: hook.program(),
        target: target.to_owned(),
        source,
    };
    // A filter at our priority and handle is our own, left on purpose by a
    // ztunnel that stopped without detaching (fail closed). Take it over:
    // adding ours next to it fails with EEXIST, which left a restarted
    // ztunnel unable to enrol the pod on kernels without tcx. For the guard
    // the moment between the two is the width of one netlink round trip.
    let took_over = SchedClassifierLink::attached(
        iface,
        hook.attach_type(),
        NETLINK_PRIORITY,
        NETLINK_HANDLE,
        None,
    )
    .is_ok_and(|old| old.detach().is_ok());
    // Adding clsact fails with EEXIST when someone already has one: reuse it.
    // Taken over with no filter but ztunnel's own on it, the qdisc is ours
    // as well. When the filters cannot be listed (no `tc` binary) it is
    // not claimed: nothing may fail after the earlier filter is gone (a
    // take-over that failed here left the pod without it, found on 6.1),
    // and a qdisc that may hold others' filters is never ours to remove.
    let created_qdisc = tc::qdisc_add_clsact(iface).is_ok()
        || (took_over
            && !foreign_filters(iface).unwrap_or_else(|e| {
                tracing::warn!(%iface, error = %e, "cannot list TC filters: the clsact qdisc is not claimed");
                true
            }));
    if took_over {
        tracing::info!(target = %target, hook = ?hook, "took over the TC filter of an earlier ztunnel");
    }
    let options = NlOptions {
        priority: NETLINK_PRIORITY,
        handle: NETLINK_HANDLE,
        ..NlOptions::default()
    };
    let id = prog
        .attach_with_options(iface, hook.attach_type(), TcAttachOptions::Netlink(options))
        .map_err(err)?;
    // Forget the link so that the filter stays when this process exits
    // (fail closed); detach finds it again by priority and handle.
    let link = prog.take_link(id).map_err(err)?;
    std::mem::forget(link);
    Ok(created_qdisc)
}

/// Detaches a pod's TC program and removes what ztunnel created. Detach a
/// pod's attachments newest first (the reverse of [`TcHook::ALL`]).
pub fn detach(netns: &PodNetns, attached: &PodTc) -> Result<(), CaptureError> {
    match attached {
        PodTc::Tcx { pin, .. } => match std::fs::remove_file(pin) {
            // The pin was the link's last reference: the kernel detaches it.
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(link_err(pin, e)),
        },
        PodTc::Netlink {
            hook,
            iface,
            created_qdisc,
        } => netns.run(|| detach_netlink(*hook, iface, *created_qdisc))?,
    }
}

fn detach_netlink(hook: TcHook, iface: &str, created_qdisc: bool) -> Result<(), CaptureError> {
    let io_err = |what: String| move |source| CaptureError::Io { what, source };
    let link = SchedClassifierLink::attached(
        iface,
        hook.attach_type(),
        NETLINK_PRIORITY,
        NETLINK_HANDLE,
        None,
    )
    .map_err(io_err(format!("finding our {hook:?} filter on {iface}")))?;
    link.detach().map_err(|source| CaptureError::Attach {
        program: hook.program(),
        target: format!("{iface} (detach)"),
        source,
    })?;
    // Any filter left, ztunnel's own other hook included, keeps the qdisc:
    // removing it would take that filter with it. When the filters cannot
    // be listed (no `tc` binary), the qdisc stays too: an empty clsact
    // costs nothing, removing someone's filter would break their network.
    // Our own filter is gone either way, so the detach itself succeeded
    // (an enrolment's rollback on 6.1 failed here and undid nothing).
    let remaining = match filter_lines(iface) {
        Ok(lines) => lines,
        Err(e) => {
            tracing::warn!(%iface, error = %e, "cannot list TC filters: the clsact qdisc ztunnel added is left in place");
            return Ok(());
        }
    };
    if created_qdisc && remaining.is_empty() {
        Command::new("tc")
            .args(["qdisc", "del", "dev", iface, "clsact"])
            .status()
            .map_err(io_err("running `tc qdisc del`".into()))?;
    }
    Ok(())
}

/// The link type (`ARPHRD_*`) of interface `iface` in the calling thread's
/// network namespace.
fn link_type(iface: &str) -> std::io::Result<u16> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: all-zero is a valid ifreq.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    let name = iface.as_bytes();
    if name.len() >= req.ifr_name.len() {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(name) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFHWADDR fills the ifreq passed, of the right type.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFHWADDR, &raw mut req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFHWADDR set the hardware address member of the union.
    Ok(unsafe { req.ifr_ifru.ifru_hwaddr.sa_family })
}

/// The `tc filter show` lines of both of `iface`'s clsact hooks.
fn filter_lines(iface: &str) -> Result<Vec<String>, CaptureError> {
    let mut lines = Vec::new();
    for direction in ["ingress", "egress"] {
        let filters = Command::new("tc")
            .args(["filter", "show", "dev", iface, direction])
            .output()
            .map_err(|source| CaptureError::Io {
                what: "running `tc filter show`".into(),
                source,
            })?;
        lines.extend(
            String::from_utf8_lossy(&filters.stdout)
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_owned),
        );
    }
    Ok(lines)
}

/// Whether a filter that is not ztunnel's is on either of `iface`'s hooks.
fn foreign_filters(iface: &str) -> Result<bool, CaptureError> {
    Ok(filter_lines(iface)?.iter().any(|l| is_foreign_filter(l)))
}

/// Whether one line of `tc filter show` is a filter of someone else's: a
/// filter line with a handle that is not at ztunnel's priority and handle.
/// (The line per priority without a handle, and the lines of a filter's
/// details, say nothing about whose it is.)
fn is_foreign_filter(line: &str) -> bool {
    let ours_pref = format!(" pref {NETLINK_PRIORITY} ");
    let ours_handle = format!(" handle {NETLINK_HANDLE_MINOR:#x} ");
    line.starts_with("filter ")
        && line.contains(" handle ")
        && !(line.contains(&ours_pref) && line.contains(&ours_handle))
}

fn link_err(pin: &Path, e: impl std::fmt::Display) -> CaptureError {
    CaptureError::Link {
        path: pin.to_path_buf(),
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_other_peoples_filters_are_foreign() {
        let ours = "filter protocol all pref 100 bpf chain 0 handle 0x7a7 guard_egress direct-action not_in_hw id 41 tag 1";
        let header = "filter protocol all pref 100 bpf chain 0 ";
        let cni =
            "filter protocol all pref 1 bpf chain 0 handle 0x1 cil_from_container direct-action";
        let same_prio = "filter protocol all pref 100 bpf chain 0 handle 0x2 other direct-action";
        assert!(!is_foreign_filter(ours));
        assert!(!is_foreign_filter(header));
        assert!(!is_foreign_filter("  action order 1: gact action drop"));
        assert!(is_foreign_filter(cni));
        assert!(is_foreign_filter(same_prio));
    }

    #[test]
    fn the_link_type_of_an_interface_is_read() {
        assert_eq!(link_type("lo").expect("lo"), libc::ARPHRD_LOOPBACK);
        assert!(link_type("no-such-if0").is_err());
    }

    #[test]
    fn each_hook_has_its_own_pin_and_program() {
        assert_eq!(TcHook::Ingress.pin_name("p/1"), "tc_p_1");
        assert_eq!(TcHook::Egress.pin_name("p/1"), "tcout_p_1");
        assert_ne!(TcHook::Ingress.program(), TcHook::Egress.program());
    }
}
