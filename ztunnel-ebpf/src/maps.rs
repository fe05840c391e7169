//! The map statics. Names, sizes and layouts come from `ztunnel-common`.
//! Every map is declared pinned-by-name: userspace loads with a pin folder
//! under bpffs, so a restarted ztunnel finds and reuses the same maps (and the
//! enrolled pods in them) instead of starting empty. `ztunnel-common` says
//! who writes and who reads each map.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, SockHash},
};
use ztunnel_common::{
    CaptureSettings, Counter, IpBytes, MAX_EXCLUSIONS, MAX_LOCAL_LEG_SOCKETS,
    MAX_PENDING_CONNECTIONS, MAX_PODS, OrigDst, OrigDstKey, PodCapture, SockKey,
};

/// `BPF_F_NO_PREALLOC`: LPM tries require it.
const NO_PREALLOC: u32 = 1;

#[map(name = "POD_CAPTURE")]
pub static POD_CAPTURE: HashMap<u64, PodCapture> = HashMap::pinned(MAX_PODS, 0);

#[map(name = "ORIG_DST_BY_COOKIE")]
pub static ORIG_DST_BY_COOKIE: LruHashMap<u64, OrigDst> =
    LruHashMap::pinned(MAX_PENDING_CONNECTIONS, 0);

#[map(name = "ORIG_DST")]
pub static ORIG_DST: LruHashMap<OrigDstKey, OrigDst> =
    LruHashMap::pinned(MAX_PENDING_CONNECTIONS, 0);

#[map(name = "CAPTURE_COUNTERS")]
pub static CAPTURE_COUNTERS: PerCpuArray<u64> = PerCpuArray::pinned(Counter::COUNT, 0);

#[map(name = "OUTBOUND_EXCLUDED_PORTS")]
pub static OUTBOUND_EXCLUDED_PORTS: HashMap<u16, u8> = HashMap::pinned(MAX_EXCLUSIONS, 0);

#[map(name = "INBOUND_EXCLUDED_PORTS")]
pub static INBOUND_EXCLUDED_PORTS: HashMap<u16, u8> = HashMap::pinned(MAX_EXCLUSIONS, 0);

#[map(name = "OUTBOUND_EXCLUDED_CIDRS")]
pub static OUTBOUND_EXCLUDED_CIDRS: LpmTrie<IpBytes, u8> =
    LpmTrie::pinned(MAX_EXCLUSIONS, NO_PREALLOC);

#[map(name = "INBOUND_EXCLUDED_CIDRS")]
pub static INBOUND_EXCLUDED_CIDRS: LpmTrie<IpBytes, u8> =
    LpmTrie::pinned(MAX_EXCLUSIONS, NO_PREALLOC);

#[map(name = "LOCAL_LEG_SOCKETS")]
pub static LOCAL_LEG_SOCKETS: SockHash<SockKey> = SockHash::pinned(MAX_LOCAL_LEG_SOCKETS, 0);

#[map(name = "LOCAL_LEG_TCP_ONLY")]
pub static LOCAL_LEG_TCP_ONLY: LruHashMap<SockKey, u8> =
    LruHashMap::pinned(MAX_LOCAL_LEG_SOCKETS, 0);

#[map(name = "CAPTURE_SETTINGS")]
pub static CAPTURE_SETTINGS: Array<CaptureSettings> = Array::pinned(1, 0);

/// Adds one to a counter. Per-CPU, so no atomics are needed.
#[inline(always)]
pub fn count(counter: Counter) {
    if let Some(slot) = CAPTURE_COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: the pointer comes from the map lookup and is valid for this
        // CPU for the duration of the program.
        unsafe { *slot += 1 };
    }
}

/// Whether `addr` falls in one of the CIDRs of `trie`.
#[inline(always)]
pub fn in_cidrs(trie: &LpmTrie<IpBytes, u8>, addr: IpBytes) -> bool {
    trie.get(aya_ebpf::maps::lpm_trie::Key::new(128, addr))
        .is_some()
}

/// Whether the port is in one of the exclusion port maps.
#[inline(always)]
pub fn port_listed(map: &HashMap<u16, u8>, port: u16) -> bool {
    // SAFETY: the value is a plain `u8` that we only test for presence.
    unsafe { map.get(&port).is_some() }
}

/// Whether `--sockmap on` was given.
#[inline(always)]
pub fn sockmap_enabled() -> bool {
    CAPTURE_SETTINGS
        .get(0)
        .is_some_and(|settings| settings.sockmap_enabled != 0)
}
