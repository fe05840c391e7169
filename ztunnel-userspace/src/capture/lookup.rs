//! The socket-lookup side of inbound capture: `capture_lookup` (`sk_lookup`)
//! attached to each enrolled pod's network namespace, and the pod's inbound
//! listeners published in `POD_LISTENERS` for it to hand connections to.
//!
//! Order matters for fail-closed behaviour without a gap: the listeners go
//! into the map before the program is attached (so a new pod never drops
//! connections it could have taken), and the link is pinned, so if ztunnel
//! dies the program stays, finds no listener (the kernel removes closed
//! sockets from the map) and drops, instead of letting connections reach
//! the application directly. A restarted ztunnel swaps its program into the
//! pinned link (`BPF_LINK_UPDATE`) and publishes its new listeners.

use std::{
    net::{IpAddr, TcpListener},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{MapData, SockHash},
    programs::{SkLookup, links::FdLink},
};
use ztunnel_common::{ListenerKey, MAP_POD_LISTENERS};

use super::{CaptureError, cgroup, map_err, maps::ip_bytes, pin_component};
use crate::{
    bpffs::PinRoot,
    loader::{program, program_mut},
    netns::PodNetns,
};

/// Name of the pin of a pod's `sk_lookup` link.
pub fn pin_name(pod_id: &str) -> String {
    format!("lookup_{}", pin_component(pod_id))
}

/// One inbound listener of a pod: ztunnel's port and the socket.
#[derive(Debug, Clone, Copy)]
pub struct InboundListener<'a> {
    /// 15006 or 15008.
    pub port: u16,
    /// The listening socket (bound to the wildcard address of its family).
    pub socket: &'a TcpListener,
}

/// Publishes a pod's inbound listeners under each of its addresses, and
/// returns the keys written (to remove them with the pod). A listener is
/// used for the addresses of its own family.
pub fn publish_listeners(
    ebpf: &mut Ebpf,
    addrs: &[IpAddr],
    listeners: &[InboundListener<'_>],
) -> Result<Vec<ListenerKey>, CaptureError> {
    let map = ebpf
        .map_mut(MAP_POD_LISTENERS)
        .ok_or_else(|| map_err(MAP_POD_LISTENERS, "not in the object"))?;
    let mut map: SockHash<&mut MapData, ListenerKey> =
        SockHash::try_from(map).map_err(|e| map_err(MAP_POD_LISTENERS, e))?;
    let mut keys = Vec::new();
    for ip in addrs {
        for listener in listeners {
            let family_matches = listener
                .socket
                .local_addr()
                .is_ok_and(|a| a.is_ipv4() == ip.is_ipv4());
            if !family_matches {
                continue;
            }
            let key = ListenerKey {
                addr: ip_bytes(*ip),
                port: u32::from(listener.port),
            };
            map.insert(key, listener.socket.as_raw_fd(), 0)
                .map_err(|e| {
                    map_err(
                        MAP_POD_LISTENERS,
                        format!("{ip} port {}: {e}", listener.port),
                    )
                })?;
            keys.push(key);
        }
    }
    Ok(keys)
}

/// Removes a pod's listener entries (absent ones are fine: the kernel drops
/// entries of closed sockets by itself).
pub fn withdraw_listeners(ebpf: &mut Ebpf, keys: &[ListenerKey]) -> Result<(), CaptureError> {
    let map = ebpf
        .map_mut(MAP_POD_LISTENERS)
        .ok_or_else(|| map_err(MAP_POD_LISTENERS, "not in the object"))?;
    let mut map: SockHash<&mut MapData, ListenerKey> =
        SockHash::try_from(map).map_err(|e| map_err(MAP_POD_LISTENERS, e))?;
    for key in keys {
        let _ = map.remove(key);
    }
    Ok(())
}

/// Attaches `capture_lookup` to the pod's namespace with a pinned link, or
/// takes over the link an earlier ztunnel pinned. Returns the pin.
pub fn attach(
    ebpf: &mut Ebpf,
    pins: &PinRoot,
    netns: &PodNetns,
    pod_id: &str,
) -> Result<PathBuf, CaptureError> {
    let pin = pins.link(&pin_name(pod_id));
    let prog: &mut SkLookup = program_mut(ebpf, program::LOOKUP)?;
    let err = |source| CaptureError::Attach {
        program: program::LOOKUP,
        target: format!("network namespace {}", netns.name()),
        source,
    };
    if pin.exists() {
        let prog_fd = {
            use std::os::fd::{AsFd as _, AsRawFd as _};
            prog.fd().map_err(err)?.as_fd().as_raw_fd()
        };
        let link = cgroup::obj_get(&pin).map_err(|e| link_err(&pin, e))?;
        cgroup::link_update(&link, prog_fd).map_err(|e| link_err(&pin, e))?;
        return Ok(pin);
    }
    let id = prog.attach(netns).map_err(err)?;
    let link = FdLink::from(prog.take_link(id).map_err(err)?);
    link.pin(&pin).map_err(|e| link_err(&pin, e))?;
    Ok(pin)
}

/// Detaches a pod's `sk_lookup` program: the pin was the link's last
/// reference, so removing it detaches.
pub fn detach(pin: &Path) -> Result<(), CaptureError> {
    match std::fs::remove_file(pin) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(link_err(pin, e)),
    }
}

fn link_err(pin: &Path, e: impl std::fmt::Display) -> CaptureError {
    CaptureError::Link {
        path: pin.to_path_buf(),
        message: e.to_string(),
    }
}
