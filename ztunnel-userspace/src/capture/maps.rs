//! Userspace writes to the capture maps: enrolled pods, exclusions, and
//! taking original destinations out of `ORIG_DST`.

use std::net::{IpAddr, SocketAddr};

use aya::{
    Ebpf,
    maps::{HashMap, LpmTrie, MapData, SkStorage, lpm_trie::Key},
};
use ztunnel_common::{
    IpBytes, LegKey, MAP_INBOUND_EXCLUDED_CIDRS, MAP_INBOUND_EXCLUDED_PORTS, MAP_INBOUND_LEGS,
    MAP_ORIG_DST, MAP_OUTBOUND_EXCLUDED_CIDRS, MAP_OUTBOUND_EXCLUDED_PORTS, MAP_POD_CAPTURE,
    MAP_POD_PENDING, MAP_ZTUNNEL_SOCKETS, OrigDst, OrigDstKey, PodCapture, PodPending,
    ZTUNNEL_SOCKET_OWN, ZtunnelSocket, v4_mapped,
};

use super::{CaptureError, map_err};

/// An address as the maps store it (IPv4 v4-mapped).
pub fn ip_bytes(ip: IpAddr) -> IpBytes {
    match ip {
        IpAddr::V4(v4) => v4_mapped(v4.octets()),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The inverse of [`ip_bytes`]: v4-mapped becomes IPv4 again.
pub fn ip_from_bytes(bytes: IpBytes) -> IpAddr {
    let v6 = std::net::Ipv6Addr::from(bytes);
    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
}

/// A CIDR, e.g. `10.0.0.0/8` or `fd00::/8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    /// Network address.
    pub addr: IpAddr,
    /// Prefix length in the address's own family.
    pub prefix: u8,
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (addr, prefix) = s.split_once('/').unwrap_or((s, ""));
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?}: not an IP address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = if prefix.is_empty() {
            max
        } else {
            prefix
                .parse()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: prefix must be 0..={max}"))?
        };
        Ok(Self { addr, prefix })
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl Cidr {
    /// The LPM key: IPv4 prefixes live under the v4-mapped `::ffff:0:0/96`.
    fn key(&self) -> Key<IpBytes> {
        let bits = if self.addr.is_ipv4() {
            96 + u32::from(self.prefix)
        } else {
            u32::from(self.prefix)
        };
        Key::new(bits, ip_bytes(self.addr))
    }
}

/// Node-wide capture exclusions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exclusions {
    /// Outbound destination ports never captured.
    pub outbound_ports: Vec<u16>,
    /// Outbound destination CIDRs never captured.
    pub outbound_cidrs: Vec<Cidr>,
    /// Inbound destination ports never captured.
    pub inbound_ports: Vec<u16>,
    /// Inbound source CIDRs never captured (e.g. the kubelet's probe address).
    pub inbound_cidrs: Vec<Cidr>,
}

/// Replaces the exclusion maps' contents with `exclusions`.
pub fn set_exclusions(ebpf: &mut Ebpf, exclusions: &Exclusions) -> Result<(), CaptureError> {
    for (name, ports) in [
        (MAP_OUTBOUND_EXCLUDED_PORTS, &exclusions.outbound_ports),
        (MAP_INBOUND_EXCLUDED_PORTS, &exclusions.inbound_ports),
    ] {
        let map = ebpf
            .map_mut(name)
            .ok_or_else(|| map_err(name, "not in the object"))?;
        let mut map: HashMap<&mut MapData, u16, u8> =
            HashMap::try_from(map).map_err(|e| map_err(name, e))?;
        let old: Vec<u16> = map.keys().filter_map(Result::ok).collect();
        for port in old {
            let _ = map.remove(&port);
        }
        for port in ports {
            map.insert(port, 1, 0).map_err(|e| map_err(name, e))?;
        }
    }
    for (name, cidrs) in [
        (MAP_OUTBOUND_EXCLUDED_CIDRS, &exclusions.outbound_cidrs),
        (MAP_INBOUND_EXCLUDED_CIDRS, &exclusions.inbound_cidrs),
    ] {
        let map = ebpf
            .map_mut(name)
            .ok_or_else(|| map_err(name, "not in the object"))?;
        let mut trie: LpmTrie<&mut MapData, IpBytes, u8> =
            LpmTrie::try_from(map).map_err(|e| map_err(name, e))?;
        let old: Vec<Key<IpBytes>> = trie.keys().filter_map(Result::ok).collect();
        for key in old {
            let _ = trie.remove(&key);
        }
        for cidr in cidrs {
            trie.insert(&cidr.key(), 1, 0)
                .map_err(|e| map_err(name, e))?;
        }
    }
    Ok(())
}

/// Marks a pod's namespace as enrolled with `flags`.
pub fn set_pod(ebpf: &mut Ebpf, netns_cookie: u64, flags: u32) -> Result<(), CaptureError> {
    let map = ebpf
        .map_mut(MAP_POD_CAPTURE)
        .ok_or_else(|| map_err(MAP_POD_CAPTURE, "not in the object"))?;
    let mut map: HashMap<&mut MapData, u64, PodCapture> =
        HashMap::try_from(map).map_err(|e| map_err(MAP_POD_CAPTURE, e))?;
    map.insert(netns_cookie, PodCapture { flags, _pad: 0 }, 0)
        .map_err(|e| map_err(MAP_POD_CAPTURE, e))
}

/// Removes a pod's namespace from the enrolled set (absent is fine), and
/// its share count: netns cookies are never reused, so the entry would
/// only take a place.
pub fn remove_pod(ebpf: &mut Ebpf, netns_cookie: u64) -> Result<(), CaptureError> {
    if let Some(map) = ebpf.map_mut(MAP_POD_PENDING)
        && let Ok(mut map) = HashMap::<&mut MapData, u64, PodPending>::try_from(map)
    {
        // Best effort: a leftover entry costs a place, never a connection.
        let _ = map.remove(&netns_cookie);
    }
    let map = ebpf
        .map_mut(MAP_POD_CAPTURE)
        .ok_or_else(|| map_err(MAP_POD_CAPTURE, "not in the object"))?;
    let mut map: HashMap<&mut MapData, u64, PodCapture> =
        HashMap::try_from(map).map_err(|e| map_err(MAP_POD_CAPTURE, e))?;
    match map.remove(&netns_cookie) {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.kind() == std::io::ErrorKind::NotFound =>
        {
            Ok(())
        }
        Err(e) => Err(map_err(MAP_POD_CAPTURE, e)),
    }
}

/// Pod `netns_cookie`'s use of its `ORIG_DST` share (zero when it has no
/// entry yet).
pub fn pod_pending(ebpf: &Ebpf, netns_cookie: u64) -> Result<PodPending, CaptureError> {
    let map = ebpf
        .map(MAP_POD_PENDING)
        .ok_or_else(|| map_err(MAP_POD_PENDING, "not in the object"))?;
    let map: HashMap<&MapData, u64, PodPending> =
        HashMap::try_from(map).map_err(|e| map_err(MAP_POD_PENDING, e))?;
    match map.get(&netns_cookie, 0) {
        Ok(v) => Ok(v),
        Err(aya::maps::MapError::KeyNotFound) => Ok(PodPending::default()),
        Err(e) => Err(map_err(MAP_POD_PENDING, e)),
    }
}

/// The netns cookies currently in `POD_CAPTURE`.
pub fn pod_cookies(ebpf: &Ebpf) -> Result<Vec<u64>, CaptureError> {
    let map = ebpf
        .map(MAP_POD_CAPTURE)
        .ok_or_else(|| map_err(MAP_POD_CAPTURE, "not in the object"))?;
    let map: HashMap<&MapData, u64, PodCapture> =
        HashMap::try_from(map).map_err(|e| map_err(MAP_POD_CAPTURE, e))?;
    Ok(map.keys().filter_map(Result::ok).collect())
}

/// The `ORIG_DST` map, taken out of the object so that accepts can use it
/// without locking the programs.
pub struct OrigDstTable {
    map: HashMap<MapData, OrigDstKey, OrigDst>,
}

impl std::fmt::Debug for OrigDstTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OrigDstTable")
    }
}

impl OrigDstTable {
    /// Takes the map out of `ebpf`.
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, CaptureError> {
        let map = ebpf
            .take_map(MAP_ORIG_DST)
            .ok_or_else(|| map_err(MAP_ORIG_DST, "not in the object"))?;
        Ok(Self {
            map: HashMap::try_from(map).map_err(|e| map_err(MAP_ORIG_DST, e))?,
        })
    }

    /// Looks up and deletes the original destination of the connection whose
    /// client end is `client` in the namespace `netns_cookie`.
    pub fn take_entry(&mut self, netns_cookie: u64, client: SocketAddr) -> Option<SocketAddr> {
        let key = OrigDstKey {
            netns_cookie,
            client_addr: ip_bytes(client.ip()),
            client_port: client.port(),
            _pad: [0; 6],
        };
        let value = self.map.get(&key, 0).ok()?;
        let _ = self.map.remove(&key);
        Some(SocketAddr::new(ip_from_bytes(value.addr), value.port))
    }
}

/// The `INBOUND_LEGS` map, taken out of the object: ztunnel lists each of
/// its transparent legs to an application there for the moment of the
/// connect, so `capture_lookup` does not steer the leg's SYN back to ztunnel.
pub struct InboundLegTable {
    map: std::sync::Mutex<HashMap<MapData, LegKey, u8>>,
    /// Entries found at start-up, removed later by
    /// [`Self::remove_left_at_start`].
    left_at_start: std::sync::Mutex<Vec<LegKey>>,
}

impl std::fmt::Debug for InboundLegTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InboundLegTable")
    }
}

/// A listed leg; dropping it removes the entry (the connect has returned,
/// or failed, by then).
#[derive(Debug)]
pub struct ListedLeg<'a> {
    table: &'a InboundLegTable,
    key: LegKey,
}

impl Drop for ListedLeg<'_> {
    fn drop(&mut self) {
        if let Ok(mut map) = self.table.map.lock() {
            let _ = map.remove(&self.key);
        }
    }
}

impl InboundLegTable {
    /// Takes the map out of `ebpf`.
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, CaptureError> {
        let map = ebpf
            .take_map(MAP_INBOUND_LEGS)
            .ok_or_else(|| map_err(MAP_INBOUND_LEGS, "not in the object"))?;
        let map: HashMap<MapData, LegKey, u8> =
            HashMap::try_from(map).map_err(|e| map_err(MAP_INBOUND_LEGS, e))?;
        // Entries left by a process that died in the middle of a connect
        // would stay forever (the map is pinned), but one found now may as
        // well belong to a predecessor that is still running (an upgrade)
        // and connecting right now: removing it would steer that leg's SYN
        // to our own listener. Noted now, removed later if still there.
        let left_at_start: Vec<LegKey> = map.keys().filter_map(Result::ok).collect();
        Ok(Self {
            map: std::sync::Mutex::new(map),
            left_at_start: std::sync::Mutex::new(left_at_start),
        })
    }

    /// Removes the entries that were there at start-up and still are. A
    /// leg is listed only for its connect (bounded by the connect timeout),
    /// so an entry that outlived the reconcile grace has no connect behind
    /// it. Returns how many were removed.
    pub fn remove_left_at_start(&self) -> usize {
        let left = self
            .left_at_start
            .lock()
            .map(|mut l| std::mem::take(&mut *l))
            .unwrap_or_default();
        let Ok(mut map) = self.map.lock() else {
            return 0;
        };
        left.iter().filter(|key| map.remove(key).is_ok()).count()
    }

    /// Lists the leg from `source` (ztunnel's bound transparent address) to
    /// `dst` (the application) until the returned guard is dropped. An
    /// error means the leg must not connect: its SYN would be steered back
    /// to ztunnel.
    pub fn list(&self, source: SocketAddr, dst: SocketAddr) -> Result<ListedLeg<'_>, CaptureError> {
        let key = LegKey {
            local_addr: ip_bytes(dst.ip()),
            remote_addr: ip_bytes(source.ip()),
            local_port: dst.port(),
            remote_port: source.port(),
        };
        let mut map = self
            .map
            .lock()
            .map_err(|_| map_err(MAP_INBOUND_LEGS, "lock poisoned"))?;
        map.insert(key, 1, 0)
            .map_err(|e| map_err(MAP_INBOUND_LEGS, format!("{source} -> {dst}: {e}")))?;
        Ok(ListedLeg { table: self, key })
    }
}

/// `ZTUNNEL_SOCKETS`: the kernel's list of the sockets ztunnel opened in
/// pods, the only thing `capture_connect4/6` let through uncaptured.
pub struct OwnSocketTable {
    map: std::sync::Mutex<SkStorage<MapData, ZtunnelSocket>>,
}

impl std::fmt::Debug for OwnSocketTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OwnSocketTable")
    }
}

impl OwnSocketTable {
    /// Takes the map out of `ebpf`.
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, CaptureError> {
        let map = ebpf
            .take_map(MAP_ZTUNNEL_SOCKETS)
            .ok_or_else(|| map_err(MAP_ZTUNNEL_SOCKETS, "not in the object"))?;
        let map = SkStorage::try_from(map).map_err(|e| map_err(MAP_ZTUNNEL_SOCKETS, e))?;
        Ok(Self {
            map: std::sync::Mutex::new(map),
        })
    }

    /// Lists `socket` as ztunnel's, before it connects. An error means it
    /// must not connect: its connect would be captured back to ztunnel.
    pub fn list(&self, socket: &impl std::os::fd::AsRawFd) -> Result<(), CaptureError> {
        let mut map = self
            .map
            .lock()
            .map_err(|_| map_err(MAP_ZTUNNEL_SOCKETS, "lock poisoned"))?;
        map.insert(
            socket,
            ZtunnelSocket {
                owner: ZTUNNEL_SOCKET_OWN,
            },
            0,
        )
        .map_err(|e| map_err(MAP_ZTUNNEL_SOCKETS, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_is_stored_v4_mapped_and_comes_back() {
        let ip: IpAddr = "10.244.1.10".parse().expect("ip");
        let bytes = ip_bytes(ip);
        assert_eq!(&bytes[10..], &[0xff, 0xff, 10, 244, 1, 10]);
        assert_eq!(ip_from_bytes(bytes), ip);
        let v6: IpAddr = "fd00::1".parse().expect("ip");
        assert_eq!(ip_from_bytes(ip_bytes(v6)), v6);
    }

    #[test]
    fn cidrs_parse_and_reject_bad_prefixes() {
        let c: Cidr = "10.0.0.0/8".parse().expect("cidr");
        assert_eq!(c.prefix, 8);
        assert_eq!(c.key().prefix_len(), 104);
        assert_eq!("10.1.2.3".parse::<Cidr>().expect("host").prefix, 32);
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("nope/8".parse::<Cidr>().is_err());
    }
}
