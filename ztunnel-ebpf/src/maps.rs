//! The map statics. Names, sizes and layouts come from `ztunnel-common`.
//! Every map is declared pinned-by-name: userspace loads with a pin folder
//! under bpffs, so a restarted ztunnel finds and reuses the same maps (and the
//! enrolled pods in them) instead of starting empty. `ztunnel-common` says
//! who writes and who reads each map.

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_SK_STORAGE_GET_F_CREATE, bpf_map_type},
    helpers::generated::bpf_sk_storage_get,
    macros::{btf_map, map},
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, SockHash},
};
use ztunnel_common::{
    CaptureSettings, Counter, DEFAULT_MAX_POD_PENDING, IpBytes, LegKey, ListenerKey,
    MAX_EXCLUSIONS, MAX_LOCAL_LEG_SOCKETS, MAX_PENDING_CONNECTIONS, MAX_POD_LISTENERS, MAX_PODS,
    OrigDst, OrigDstKey, PodCapture, PodPending, SockKey, ZTUNNEL_SOCKET_OWN, ZtunnelSocket,
};

/// `BPF_F_NO_PREALLOC`: LPM tries require it.
const NO_PREALLOC: u32 = 1;

#[map(name = "POD_CAPTURE")]
pub static POD_CAPTURE: HashMap<u64, PodCapture> = HashMap::pinned(MAX_PODS, 0);

#[btf_map(name = "ORIG_DST_BY_SOCKET")]
pub static ORIG_DST_BY_SOCKET: PinnedSkStorage<OrigDst> = PinnedSkStorage::new();

/// Pinned like every map: during an upgrade the old and the new ztunnel
/// write to, and their programs read, the same one.
#[btf_map(name = "ZTUNNEL_SOCKETS")]
pub static ZTUNNEL_SOCKETS: PinnedSkStorage<ZtunnelSocket> = PinnedSkStorage::new();

/// Whether ztunnel listed socket `sk` as its own. Only userspace writes the
/// map, and no program asks it to create an entry, so a pod cannot.
///
/// # Safety
/// As for [`PinnedSkStorage::get`].
#[inline(always)]
pub unsafe fn is_ztunnel_socket(sk: *mut core::ffi::c_void) -> bool {
    // SAFETY: forwarded from the caller.
    unsafe { ZTUNNEL_SOCKETS.get(sk) }.is_some_and(|s| s.owner == ZTUNNEL_SOCKET_OWN)
}

#[map(name = "ORIG_DST")]
pub static ORIG_DST: HashMap<OrigDstKey, OrigDst> = HashMap::pinned(MAX_PENDING_CONNECTIONS, 0);

#[map(name = "INBOUND_LEGS")]
pub static INBOUND_LEGS: HashMap<LegKey, u8> = HashMap::pinned(MAX_PENDING_CONNECTIONS, 0);

#[map(name = "POD_LISTENERS")]
pub static POD_LISTENERS: SockHash<ListenerKey> = SockHash::pinned(MAX_POD_LISTENERS, 0);

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

/// Twice the pods: a pod's entry can outlive its enrolment by the moment
/// its last socket takes to close, and a full map only loses fairness (the
/// node-wide limit still holds), never a record.
#[map(name = "POD_PENDING")]
pub static POD_PENDING: HashMap<u64, PodPending> = HashMap::pinned(MAX_PODS * 2, 0);

#[map(name = "CAPTURE_SETTINGS")]
pub static CAPTURE_SETTINGS: Array<CaptureSettings> = Array::pinned(1, 0);

/// `LIBBPF_PIN_BY_NAME`: the loader pins the map under its name.
const PIN_BY_NAME: usize = 1;

/// A socket-local storage map (`BPF_MAP_TYPE_SK_STORAGE`), declared the BTF
/// way because the kernel wants BTF for the value of such maps. aya-ebpf's
/// own `SkStorage` has no `pinning` member and only works from `sock_addr`
/// programs; this one is pinned like every other map (a restarted ztunnel
/// keeps the records of connections that are already open) and takes the
/// socket pointer from any program type. The members are never read: the
/// loader reads their BTF types (`[i32; N]` encodes the number N).
#[repr(C)]
pub struct PinnedSkStorage<T> {
    r#type: *const [i32; bpf_map_type::BPF_MAP_TYPE_SK_STORAGE as usize],
    key: *const i32,
    value: *const T,
    max_entries: *const [i32; 0],
    map_flags: *const [i32; BPF_F_NO_PREALLOC as usize],
    pinning: *const [i32; PIN_BY_NAME],
}

// SAFETY: the members are placeholders that are never dereferenced; the
// kernel does its own locking on the storage itself.
unsafe impl<T> Sync for PinnedSkStorage<T> {}

impl<T> PinnedSkStorage<T> {
    /// The placeholder value the loader replaces with the map.
    pub const fn new() -> Self {
        Self {
            r#type: core::ptr::null(),
            key: core::ptr::null(),
            value: core::ptr::null(),
            max_entries: core::ptr::null(),
            map_flags: core::ptr::null(),
            pinning: core::ptr::null(),
        }
    }

    /// The storage of socket `sk`, if it has one.
    ///
    /// # Safety
    /// `sk` must be a socket pointer the verifier accepts for
    /// `bpf_sk_storage_get` (a full socket from the program's context).
    // The storage belongs to the kernel, not to `self`; like every map
    // value it is handed out as a mutable pointer.
    #[allow(clippy::mut_from_ref)]
    #[inline(always)]
    pub unsafe fn get(&self, sk: *mut core::ffi::c_void) -> Option<&mut T> {
        // SAFETY: forwarded from the caller; the map pointer is this static.
        let ptr = unsafe {
            bpf_sk_storage_get(
                core::ptr::from_ref(self).cast_mut().cast(),
                sk,
                core::ptr::null_mut(),
                0,
            )
        };
        // SAFETY: a non-null result points to this socket's value.
        unsafe { ptr.cast::<T>().as_mut() }
    }

    /// The storage of socket `sk`, created (zeroed) when missing. `None`
    /// when the kernel could not allocate it.
    ///
    /// # Safety
    /// As for [`Self::get`].
    #[allow(clippy::mut_from_ref)]
    #[inline(always)]
    pub unsafe fn get_or_create(&self, sk: *mut core::ffi::c_void) -> Option<&mut T> {
        // SAFETY: as above.
        let ptr = unsafe {
            bpf_sk_storage_get(
                core::ptr::from_ref(self).cast_mut().cast(),
                sk,
                core::ptr::null_mut(),
                u64::from(BPF_SK_STORAGE_GET_F_CREATE),
            )
        };
        // SAFETY: as above.
        unsafe { ptr.cast::<T>().as_mut() }
    }
}

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
    unsafe { map.get(port).is_some() }
}

/// A pod's share of `ORIG_DST` (`--max-pod-pending-connects`).
#[inline(always)]
pub fn max_pod_pending() -> u32 {
    match CAPTURE_SETTINGS.get(0).map_or(0, |s| s.max_pod_pending) {
        0 => DEFAULT_MAX_POD_PENDING,
        n => n,
    }
}

/// Whether `--sockmap on` was given.
#[inline(always)]
pub fn sockmap_enabled() -> bool {
    CAPTURE_SETTINGS
        .get(0)
        .is_some_and(|settings| settings.sockmap_enabled != 0)
}
