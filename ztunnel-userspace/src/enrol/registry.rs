//! The enrolled pods.

use std::{
    collections::{BTreeMap, HashSet},
    sync::{Arc, Mutex},
};

use tokio::task::AbortHandle;
use ztunnel_common::{
    INBOUND_HBONE_PORT, INBOUND_PLAINTEXT_PORT, ListenerKey, POD_CAPTURE_INBOUND,
    POD_CAPTURE_OUTBOUND,
};

use super::rollback::Rollback;
use crate::{
    bpffs::PinRoot,
    capture::{
        CaptureError,
        lookup::{self, InboundListener},
        maps::{self, InboundLegTable, OrigDstTable, OwnSocketTable},
        tc::{self, PodTc, TcHook, TcMode},
    },
    hbone::server::HboneServer,
    identity::Identity,
    loader::KernelPrograms,
    netns::{NetnsError, PodNetns},
    proxy::{
        PodContext, Shared,
        inbound::{self, InboundContext},
        listeners::{self, ListenError},
        outbound::{self, OutboundContext},
        pod_routing,
        socket_factory::{SocketFactory, SocketTables},
    },
    state::CaptureOptOut,
};

/// The interface inside each pod that carries its traffic.
pub const POD_INTERFACE: &str = "eth0";

/// Who asked for a pod to be enrolled; reconciliation only touches pods of
/// the same source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The local config file.
    Config,
    /// The listening enrolment socket (our CNI plugin or `ztunnel enrol`).
    Socket,
    /// Istio's node agent (istio-cni), which ztunnel dials.
    NodeAgent,
}

/// A request to enrol one pod.
#[derive(Debug)]
pub struct EnrolRequest {
    /// Unique pod id.
    pub uid: String,
    /// The pod's network namespace.
    pub netns: PodNetns,
    /// Opt-outs.
    pub capture: CaptureOptOut,
    /// The pod's workload identity.
    pub identity: Identity,
    /// Who asked.
    pub source: Source,
}

/// Errors of enrolment; each names the pod.
#[derive(Debug, thiserror::Error)]
pub enum EnrolError {
    /// Kernel-side failure.
    #[error("pod {uid}: {source}")]
    Capture {
        /// The pod.
        uid: String,
        /// What failed (boxed: the kernel errors are large).
        source: Box<CaptureError>,
    },
    /// Namespace failure.
    #[error("pod {uid}: {source}")]
    Netns {
        /// The pod.
        uid: String,
        /// What failed.
        source: Box<NetnsError>,
    },
    /// Listener failure.
    #[error("pod {uid}: {source}")]
    Listen {
        /// The pod.
        uid: String,
        /// What failed.
        source: Box<ListenError>,
    },
    /// Thread or socket setup failure.
    #[error("pod {uid}: {source}")]
    Io {
        /// The pod.
        uid: String,
        /// What failed.
        source: std::io::Error,
    },
    /// An address of the pod is another enrolled pod's.
    #[error(
        "pod {uid}: address {ip} is already enrolled pod {owner}'s: refused (two pods cannot share an address)"
    )]
    AddressTaken {
        /// The pod being enrolled.
        uid: String,
        /// The address.
        ip: std::net::IpAddr,
        /// The pod that has it.
        owner: String,
    },
    /// A lock was poisoned by a panic elsewhere.
    #[error("internal state poisoned")]
    Poisoned,
    /// A kernel step was asked of a ztunnel that loaded no programs
    /// (`--capture istio-cni`).
    #[error("no eBPF programs are loaded (--capture istio-cni)")]
    NoPrograms,
}

impl EnrolError {
    /// Wraps a kernel-side error of pod `uid`.
    fn capture(uid: &str) -> impl Fn(CaptureError) -> Self + Copy + '_ {
        move |e| Self::Capture {
            uid: uid.to_owned(),
            source: Box::new(e),
        }
    }
}

/// One enrolled pod and what it owns.
#[derive(Debug)]
struct EnrolledPod {
    netns_name: String,
    cookie: u64,
    /// What the proxy keeps for the pod (pool slots by source address, the
    /// certificate by identity) is dropped with it.
    identity: Identity,
    ips: Vec<std::net::IpAddr>,
    source: Source,
    netns: PodNetns,
    /// TC attachments, in the order they were made.
    tc: Vec<PodTc>,
    lookup: Option<PodLookup>,
    tasks: Vec<AbortHandle>,
}

/// A pod's `sk_lookup` attachment and the listener entries it steers to.
#[derive(Debug, Clone)]
struct PodLookup {
    pin: std::path::PathBuf,
    keys: Vec<ListenerKey>,
}

/// A pod whose last enrolment failed and that nobody has removed since.
#[derive(Debug, Clone, Copy)]
struct FailedPod {
    cookie: u64,
    source: Source,
    /// An earlier ztunnel's kernel state for its namespace was left in
    /// place (the pod fails closed).
    kept: bool,
}

/// A row of [`PodRegistry::list`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PodSummary {
    /// Pod uid.
    pub uid: String,
    /// Namespace path or name.
    pub netns: String,
    /// netns cookie.
    pub netns_cookie: u64,
    /// Whether outbound/inbound capture is on.
    pub outbound: bool,
    /// Whether inbound capture is on.
    pub inbound: bool,
}

/// The enrolled pods of this node, plus the kernel programs they use.
pub struct PodRegistry {
    /// `None` with `--capture istio-cni`, which loads no programs.
    programs: Mutex<Option<KernelPrograms>>,
    pins: PinRoot,
    tc_mode: TcMode,
    orig_dst: Option<Arc<Mutex<OrigDstTable>>>,
    tables: SocketTables,
    pods: Mutex<BTreeMap<String, EnrolledPod>>,
    /// Pods that are wanted but whose enrolment failed, by uid.
    failed: Mutex<BTreeMap<String, FailedPod>>,
    /// Held for the whole of every operation that changes which pods are
    /// enrolled (enrol, remove, reconcile, the stale-state sweep). An
    /// enrolment writes the kernel maps long before the pod appears in
    /// `pods`; without this, the sweep at start-up saw the new map entry
    /// as stale and deleted it, leaving an enrolled pod uncaptured (seen on
    /// slow kernels in QEMU).
    changes: Mutex<()>,
    runtime: tokio::runtime::Handle,
    shared: Shared,
    backend: crate::capture::Backend,
    exclusions: crate::capture::maps::Exclusions,
}

impl std::fmt::Debug for PodRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodRegistry").finish_non_exhaustive()
    }
}

impl PodRegistry {
    /// Takes ownership of the loaded programs (none with `--capture
    /// istio-cni`).
    pub fn new(
        mut programs: Option<KernelPrograms>,
        pins: PinRoot,
        tc_mode: TcMode,
        runtime: tokio::runtime::Handle,
        shared: Shared,
        backend: crate::capture::Backend,
        exclusions: crate::capture::maps::Exclusions,
    ) -> Result<Self, CaptureError> {
        let (orig_dst, tables) = match programs.as_mut() {
            Some(p) => (
                Some(Arc::new(Mutex::new(OrigDstTable::take(&mut p.ebpf)?))),
                if backend == crate::capture::Backend::Ebpf {
                    SocketTables {
                        legs: Some(Arc::new(InboundLegTable::take(&mut p.ebpf)?)),
                        own: Some(Arc::new(OwnSocketTable::take(&mut p.ebpf)?)),
                    }
                } else {
                    SocketTables::default()
                },
            ),
            None => (None, SocketTables::default()),
        };
        Ok(Self {
            programs: Mutex::new(programs),
            pins,
            tc_mode,
            orig_dst,
            tables,
            pods: Mutex::new(BTreeMap::new()),
            failed: Mutex::new(BTreeMap::new()),
            changes: Mutex::new(()),
            runtime,
            shared,
            backend,
            exclusions,
        })
    }

    /// Runs `f` with the loaded programs (counters, exclusions, dumps);
    /// `Err(NoPrograms)` when none are loaded.
    pub fn with_programs<R>(
        &self,
        f: impl FnOnce(&mut KernelPrograms) -> R,
    ) -> Result<R, EnrolError> {
        let mut programs = self.programs.lock().map_err(|_| EnrolError::Poisoned)?;
        programs.as_mut().map(f).ok_or(EnrolError::NoPrograms)
    }

    /// The loaded programs, locked (`None` inside: none are loaded).
    fn kernel(&self) -> Result<std::sync::MutexGuard<'_, Option<KernelPrograms>>, EnrolError> {
        self.programs.lock().map_err(|_| EnrolError::Poisoned)
    }

    /// Enrols a pod. Enrolling the same uid with the same namespace again
    /// is a no-op; with another namespace it replaces the old enrolment.
    ///
    /// All or nothing: a step that fails undoes the ones before it (see
    /// [`super::rollback`]). Kernel state an earlier ztunnel left for this
    /// very namespace is the exception: it keeps the pod failing closed
    /// while ztunnel is away, so a failed enrolment leaves it in place, and
    /// the pod is remembered as failed so that the stale-state sweep spares
    /// it until it is enrolled or removed.
    pub fn enrol(&self, req: EnrolRequest) -> Result<bool, EnrolError> {
        let _change = self.changes.lock().map_err(|_| EnrolError::Poisoned)?;
        let uid = req.uid.clone();
        let cookie = req.netns.cookie().map_err(|e| EnrolError::Netns {
            uid: uid.clone(),
            source: Box::new(e),
        })?;
        {
            let pods = self.pods.lock().map_err(|_| EnrolError::Poisoned)?;
            if let Some(existing) = pods.get(&uid)
                && existing.cookie == cookie
            {
                return Ok(false);
            }
        }
        self.remove_enrolled(&uid)?;
        // A retry of a failed enrolment keeps what keeps the pod failing
        // closed; a new namespace for the uid makes the old state stale.
        let retry_of = self
            .failed
            .lock()
            .map_err(|_| EnrolError::Poisoned)?
            .get(&uid)
            .map(|f| f.cookie);
        if retry_of.is_some_and(|c| c != cookie) {
            self.forget_failed(&uid)?;
        }
        let kept = self.left_by_earlier_ztunnel(cookie, &uid)?;
        let source = req.source;
        let mut rollback = Rollback::new(&uid);
        match self.build(req, cookie, kept, &mut rollback) {
            Ok(pod) => {
                drop(rollback);
                self.failed
                    .lock()
                    .map_err(|_| EnrolError::Poisoned)?
                    .remove(&uid);
                self.pods
                    .lock()
                    .map_err(|_| EnrolError::Poisoned)?
                    .insert(uid, pod);
                Ok(true)
            }
            Err(e) => {
                let undone = rollback.run();
                tracing::error!(pod = %uid, error = %e, ?undone, kept_fail_closed = kept, "enrolment failed and was rolled back");
                self.failed
                    .lock()
                    .map_err(|_| EnrolError::Poisoned)?
                    .insert(
                        uid,
                        FailedPod {
                            cookie,
                            source,
                            kept,
                        },
                    );
                Err(e)
            }
        }
    }

    /// Whether an earlier ztunnel left kernel state for this namespace (its
    /// `POD_CAPTURE` entry or the pod's `sk_lookup` link pin).
    fn left_by_earlier_ztunnel(&self, cookie: u64, uid: &str) -> Result<bool, EnrolError> {
        let programs = self.kernel()?;
        let Some(programs) = programs.as_ref() else {
            return Ok(false);
        };
        let captured = maps::pod_cookies(&programs.ebpf)
            .map_err(EnrolError::capture(uid))?
            .contains(&cookie);
        Ok(captured || self.pins.link(&lookup::pin_name(uid)).exists())
    }

    /// The steps of [`Self::enrol`]; each one that changes something
    /// outside this process records its undo in `rollback`.
    fn build<'a>(
        &'a self,
        req: EnrolRequest,
        cookie: u64,
        kept: bool,
        rollback: &mut Rollback<'a>,
    ) -> Result<EnrolledPod, EnrolError> {
        let uid = req.uid.clone();
        let capture_err = EnrolError::capture(&uid);
        let io = |source: std::io::Error| EnrolError::Io {
            uid: uid.clone(),
            source,
        };
        // Get the pod's certificate now rather than on its first
        // connection: a local CA signs it here (readiness promises it
        // exists); Istio's CA is asked in the background.
        self.shared.certs.prefetch(&req.identity);
        // The listeners close when dropped.
        let sockets = SocketFactory::new(&req.netns, self.tables.clone())
            .map_err(io)?
            .with_limit(self.shared.limits.pod(&uid));
        let listeners = listeners::open(&req.netns).map_err(|e| EnrolError::Listen {
            uid: uid.clone(),
            source: Box::new(e),
        })?;

        let mut flags = 0;
        if req.capture.outbound {
            flags |= POD_CAPTURE_OUTBOUND;
        }
        if req.capture.inbound {
            flags |= POD_CAPTURE_INBOUND;
        }
        let found = req.netns.addresses().map_err(|e| EnrolError::Netns {
            uid: uid.clone(),
            source: Box::new(e),
        })?;
        let ips = self.addresses_of(&uid, &found)?;
        let backend = self.backend;
        if backend == crate::capture::Backend::Iptables {
            crate::capture::iptables::install(&req.netns, &self.exclusions)
                .map_err(|e| io(std::io::Error::other(e)))?;
            let netns = req.netns.try_clone().map_err(io)?;
            rollback.push("iptables rules", move || {
                crate::capture::iptables::remove(&netns).map_err(|e| e.to_string())
            });
        }
        let ebpf = backend == crate::capture::Backend::Ebpf;
        let (tc, lookup) = if ebpf {
            let mut programs = self.kernel()?;
            let programs = programs.as_mut().ok_or(EnrolError::NoPrograms)?;
            self.attach_kernel(
                &mut programs.ebpf,
                &req,
                (cookie, flags, kept),
                &ips,
                &listeners,
            )
            .map_err(capture_err)?
        } else {
            (Vec::new(), None)
        };
        if ebpf {
            let netns = req.netns.try_clone().map_err(io)?;
            let (tc, lookup) = (tc.clone(), lookup.clone());
            rollback.push("kernel attachments", move || {
                self.detach_kernel(&netns, cookie, &tc, lookup.as_ref(), kept)
            });
        }

        if backend.owns_pod_routing() {
            pod_routing::install(&req.netns).map_err(|e| io(std::io::Error::other(e)))?;
            let netns = req.netns.try_clone().map_err(io)?;
            rollback.push("reply routing", move || {
                pod_routing::remove(&netns).map_err(|e| e.to_string())
            });
        }
        let context = PodContext {
            uid: uid.clone(),
            identity: req.identity.clone(),
            ips,
            netns_cookie: cookie,
            sockets,
            orig_dst_sockopt: backend.original_dst_from_sockopt(),
        };
        // The last step that can fail: it stops what it started itself.
        let tasks = self.spawn_listeners(&context, listeners)?;
        if let Some(local) = &self.shared.local_pods
            && let Ok(mut local) = local.write()
        {
            for ip in &context.ips {
                local.insert(*ip, context.clone());
            }
        }
        let pod = EnrolledPod {
            netns_name: req.netns.name().to_owned(),
            cookie,
            identity: context.identity.clone(),
            ips: context.ips.clone(),
            source: req.source,
            netns: req.netns,
            tc,
            lookup,
            tasks,
        };
        tracing::info!(pod = %uid, netns = %pod.netns_name, cookie, identity = %req.identity, outbound = req.capture.outbound, inbound = req.capture.inbound, "pod enrolled");
        Ok(pod)
    }

    /// The addresses pod `uid` is enrolled with, of those `found` on its
    /// interfaces (see [`super::addresses`]).
    fn addresses_of(
        &self,
        uid: &str,
        found: &[std::net::IpAddr],
    ) -> Result<Vec<std::net::IpAddr>, EnrolError> {
        let state = self.shared.state.current();
        let pods = self.pods.lock().map_err(|_| EnrolError::Poisoned)?;
        let enrolled = pods.iter().map(|(u, p)| (u.as_str(), p.ips.as_slice()));
        match super::addresses::decide(uid, found, &state, enrolled) {
            Ok(decided) => {
                for (ip, why) in &decided.ignored {
                    tracing::warn!(pod = %uid, %ip, %why, "address on the pod's interfaces ignored");
                }
                Ok(decided.kept)
            }
            Err(taken) => Err(EnrolError::AddressTaken {
                uid: uid.to_owned(),
                ip: taken.ip,
                owner: taken.owner,
            }),
        }
    }

    /// Undoes [`Self::attach_kernel`]. With `kept` (state an earlier
    /// ztunnel left for this namespace, which keeps the pod failing
    /// closed) only this process's listener entries are withdrawn.
    fn detach_kernel(
        &self,
        netns: &PodNetns,
        cookie: u64,
        tc: &[PodTc],
        lookup: Option<&PodLookup>,
        kept: bool,
    ) -> Result<(), String> {
        let text = |e: CaptureError| e.to_string();
        let mut guard = self
            .programs
            .lock()
            .map_err(|_| "kernel programs poisoned".to_owned())?;
        let Some(programs) = guard.as_mut() else {
            return Ok(());
        };
        if let Some(lookup) = lookup {
            lookup::withdraw_listeners(&mut programs.ebpf, &lookup.keys).map_err(text)?;
        }
        if kept {
            return Ok(());
        }
        maps::remove_pod(&mut programs.ebpf, cookie).map_err(text)?;
        if let Some(lookup) = lookup {
            lookup::detach(&lookup.pin).map_err(text)?;
        }
        drop(guard);
        for attached in tc.iter().rev() {
            tc::detach(netns, attached).map_err(text)?;
        }
        Ok(())
    }

    /// The kernel side of an enrolment, all or nothing: the egress guard
    /// attached (outbound), the listeners published and `sk_lookup`
    /// attached, the counting TC program attached (inbound), and the
    /// namespace marked in `POD_CAPTURE` (outbound), in that order, so the
    /// pod's raw sockets are guarded before its connects are captured. A
    /// step that fails undoes the ones before it, so a half-enrolled pod
    /// never keeps programs that no registry entry will remove. With
    /// `kept` (an earlier ztunnel left the pod captured), the undo leaves
    /// the links and filters in place and only withdraws this process's
    /// listener entries: the pod then fails closed (its `sk_lookup` finds
    /// no listener) instead of walking around the mesh. On kernels without
    /// tcx a TC step can fail after the `sk_lookup` link was taken over,
    /// and removing it then left the pod uncaptured (found on 6.1).
    fn attach_kernel(
        &self,
        ebpf: &mut aya::Ebpf,
        req: &EnrolRequest,
        (cookie, flags, kept): (u64, u32, bool),
        ips: &[std::net::IpAddr],
        listeners: &listeners::PodListeners,
    ) -> Result<(Vec<PodTc>, Option<PodLookup>), CaptureError> {
        let mut tc = Vec::new();
        let undo_tc = |tc: &[PodTc]| {
            if kept {
                return;
            }
            for attached in tc.iter().rev() {
                let _ = tc::detach(&req.netns, attached);
            }
        };
        let attach_tc = |ebpf: &mut aya::Ebpf, hook| {
            tc::attach(
                ebpf,
                &self.pins,
                &req.netns,
                &req.uid,
                POD_INTERFACE,
                self.tc_mode,
                hook,
            )
        };
        if req.capture.outbound {
            tc.push(attach_tc(ebpf, TcHook::Egress)?);
        }
        let lookup = if req.capture.inbound {
            match self.attach_inbound(ebpf, req, ips, listeners) {
                Ok(lookup) => Some(lookup),
                Err(e) => {
                    undo_tc(&tc);
                    return Err(e);
                }
            }
        } else {
            None
        };
        let undo_lookup = |ebpf: &mut aya::Ebpf| {
            if let Some(lookup) = &lookup {
                if !kept {
                    let _ = lookup::detach(&lookup.pin);
                }
                let _ = lookup::withdraw_listeners(ebpf, &lookup.keys);
            }
        };
        if req.capture.inbound {
            match attach_tc(ebpf, TcHook::Ingress) {
                Ok(attached) => tc.push(attached),
                Err(e) => {
                    undo_lookup(ebpf);
                    undo_tc(&tc);
                    return Err(e);
                }
            }
        }
        if let Err(e) = maps::set_pod(ebpf, cookie, flags) {
            undo_tc(&tc);
            undo_lookup(ebpf);
            return Err(e);
        }
        Ok((tc, lookup))
    }

    /// Publishes the pod's inbound listeners and attaches its `sk_lookup`
    /// program; undoes the first if the second fails.
    fn attach_inbound(
        &self,
        ebpf: &mut aya::Ebpf,
        req: &EnrolRequest,
        ips: &[std::net::IpAddr],
        listeners: &listeners::PodListeners,
    ) -> Result<PodLookup, CaptureError> {
        let inbound: Vec<InboundListener<'_>> = listeners
            .inbound_plaintext
            .iter()
            .map(|socket| InboundListener {
                port: INBOUND_PLAINTEXT_PORT,
                socket,
            })
            .chain(
                listeners
                    .inbound_hbone
                    .iter()
                    .map(|socket| InboundListener {
                        port: INBOUND_HBONE_PORT,
                        socket,
                    }),
            )
            .collect();
        let keys = lookup::publish_listeners(ebpf, ips, &inbound)?;
        match lookup::attach(ebpf, &self.pins, &req.netns, &req.uid) {
            Ok(pin) => Ok(PodLookup { pin, keys }),
            Err(e) => {
                let _ = lookup::withdraw_listeners(ebpf, &keys);
                Err(e)
            }
        }
    }

    fn spawn_listeners(
        &self,
        pod: &PodContext,
        listeners: listeners::PodListeners,
    ) -> Result<Vec<AbortHandle>, EnrolError> {
        let _guard = self.runtime.enter();
        let uid = pod.uid.clone();
        let io = |source| EnrolError::Io {
            uid: uid.clone(),
            source,
        };
        let tls = crate::tls::server_config(&self.shared.certs, &pod.identity).map_err(|e| {
            EnrolError::Io {
                uid: uid.clone(),
                source: std::io::Error::other(e),
            }
        })?;
        let mut tasks = Vec::new();
        let out_ctx = OutboundContext {
            pod: pod.clone(),
            orig_dst: self.orig_dst.clone(),
            shared: self.shared.clone(),
        };
        let in_ctx = InboundContext::new(pod, &self.shared);
        let hbone = HboneServer {
            pod: pod.uid.clone(),
            identity: pod.identity.clone(),
            tls,
            sockets: pod.sockets.clone(),
            shared: self.shared.clone(),
        };
        // Everything that can fail happens before the first task starts, so
        // a failure leaves no task serving a pod that is not enrolled.
        let convert = |ls: Vec<std::net::TcpListener>| {
            ls.into_iter()
                .map(tokio::net::TcpListener::from_std)
                .collect::<Result<Vec<_>, _>>()
                .map_err(io)
        };
        let outbound = convert(listeners.outbound)?;
        let plaintext = convert(listeners.inbound_plaintext)?;
        let socks5 = convert(listeners.socks5)?;
        let hbone_listeners = convert(listeners.inbound_hbone)?;
        for l in outbound {
            tasks.push(
                self.runtime
                    .spawn(outbound::serve(l, out_ctx.clone()))
                    .abort_handle(),
            );
        }
        for l in plaintext {
            tasks.push(
                self.runtime
                    .spawn(inbound::serve_plaintext(l, in_ctx.clone()))
                    .abort_handle(),
            );
        }
        for l in socks5 {
            tasks.push(
                self.runtime
                    .spawn(crate::proxy::socks5::serve(l, out_ctx.clone()))
                    .abort_handle(),
            );
        }
        for l in hbone_listeners {
            tasks.push(
                self.runtime
                    .spawn(crate::hbone::server::serve(l, hbone.clone()))
                    .abort_handle(),
            );
        }
        Ok(tasks)
    }

    /// Takes from each enrolled pod the addresses the current mesh state
    /// does not give it (see [`super::addresses`]): its inbound steering
    /// entries for them and its place in the same-node path. A pod enrolled
    /// before the state listed it (a restart before istiod's first push)
    /// kept every address of its interfaces, including one it added to
    /// steal a neighbour's traffic; the first state that lists the pods
    /// takes that away. Addresses are only ever taken, never added (an
    /// address the pod gains needs a new enrolment). Returns how many were
    /// withdrawn.
    pub fn withdraw_addresses(&self) -> usize {
        let Ok(_change) = self.changes.lock() else {
            return 0;
        };
        let state = self.shared.state.current();
        let Ok(mut pods) = self.pods.lock() else {
            return 0;
        };
        let mut withdrawn = 0;
        for (uid, pod) in pods.iter_mut() {
            // A workload listed without addresses (not yet given any) says
            // nothing about them; taking them all would leave the pod
            // without steering until it enrols again.
            if state.workload(uid).is_some_and(|w| w.ips.is_empty()) {
                continue;
            }
            let Ok(decided) = super::addresses::decide(uid, &pod.ips, &state, []) else {
                continue;
            };
            if decided.ignored.is_empty() {
                continue;
            }
            for (ip, why) in &decided.ignored {
                tracing::warn!(pod = %uid, %ip, %why, "address withdrawn from the pod: the mesh state does not give it to it");
            }
            let gone: Vec<std::net::IpAddr> = decided.ignored.iter().map(|(ip, _)| *ip).collect();
            if let Some(lookup) = &mut pod.lookup {
                let (drop, keep): (Vec<ListenerKey>, Vec<ListenerKey>) = lookup
                    .keys
                    .iter()
                    .partition(|k| gone.iter().any(|ip| maps::ip_bytes(*ip) == k.addr));
                if let Ok(mut guard) = self.programs.lock()
                    && let Some(programs) = guard.as_mut()
                    && let Err(e) = lookup::withdraw_listeners(&mut programs.ebpf, &drop)
                {
                    tracing::error!(pod = %uid, error = %e, "cannot withdraw the steering entries of a withdrawn address");
                    continue;
                }
                lookup.keys = keep;
            }
            if let Some(local) = &self.shared.local_pods
                && let Ok(mut local) = local.write()
            {
                local.retain(|ip, p| !(p.uid == *uid && gone.contains(ip)));
            }
            pod.ips.retain(|ip| !gone.contains(ip));
            withdrawn += gone.len();
        }
        withdrawn
    }

    /// Removes a pod: closes its listeners, deletes its map entry, detaches
    /// its TC program. Returns whether it was enrolled.
    pub fn remove(&self, uid: &str) -> Result<bool, EnrolError> {
        let _change = self.changes.lock().map_err(|_| EnrolError::Poisoned)?;
        self.remove_locked(uid)
    }

    /// [`Self::remove`] for a caller that holds `changes`.
    fn remove_locked(&self, uid: &str) -> Result<bool, EnrolError> {
        self.forget_failed(uid)?;
        self.shared
            .state
            .pods()
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(uid);
        self.remove_enrolled(uid)
    }

    /// Removes `uid` if it is enrolled (not its failed-enrolment record).
    fn remove_enrolled(&self, uid: &str) -> Result<bool, EnrolError> {
        let (pod, identity_in_use) = {
            let mut pods = self.pods.lock().map_err(|_| EnrolError::Poisoned)?;
            let Some(pod) = pods.remove(uid) else {
                return Ok(false);
            };
            let in_use = pods.values().any(|p| p.identity == pod.identity);
            (pod, in_use)
        };
        self.shared
            .forget_pod(&pod.ips, (!identity_in_use).then_some(&pod.identity));
        self.shared.metrics.forget_pod_limits(uid);
        for task in &pod.tasks {
            task.abort();
        }
        if let Some(local) = &self.shared.local_pods
            && let Ok(mut local) = local.write()
        {
            local.retain(|_, p| p.uid != uid);
        }
        let capture_err = EnrolError::capture(uid);
        if let Some(programs) = self.kernel()?.as_mut() {
            maps::remove_pod(&mut programs.ebpf, pod.cookie).map_err(capture_err)?;
            if let Some(lookup) = &pod.lookup {
                lookup::detach(&lookup.pin).map_err(capture_err)?;
                lookup::withdraw_listeners(&mut programs.ebpf, &lookup.keys)
                    .map_err(capture_err)?;
            }
        }
        for attached in pod.tc.iter().rev() {
            tc::detach(&pod.netns, attached).map_err(capture_err)?;
        }
        if self.backend == crate::capture::Backend::Iptables
            && let Err(e) = crate::capture::iptables::remove(&pod.netns)
        {
            tracing::warn!(pod = %uid, error = %e, "could not remove iptables rules");
        }
        if self.backend.owns_pod_routing()
            && let Err(e) = pod_routing::remove(&pod.netns)
        {
            tracing::warn!(pod = %uid, error = %e, "could not remove reply routing");
        }
        tracing::info!(pod = %uid, netns = %pod.netns_name, "pod removed");
        Ok(true)
    }

    /// Drops the failed-enrolment record of `uid`, and the kernel state an
    /// earlier ztunnel left for it: the pod is no longer wanted, so it no
    /// longer needs to fail closed.
    fn forget_failed(&self, uid: &str) -> Result<(), EnrolError> {
        let Some(failed) = self
            .failed
            .lock()
            .map_err(|_| EnrolError::Poisoned)?
            .remove(uid)
        else {
            return Ok(());
        };
        if failed.kept {
            if let Some(programs) = self.kernel()?.as_mut() {
                maps::remove_pod(&mut programs.ebpf, failed.cookie)
                    .map_err(EnrolError::capture(uid))?;
            }
            let tc_pins = TcHook::ALL.map(|hook| hook.pin_name(uid));
            for pin in tc_pins.iter().chain([&lookup::pin_name(uid)]) {
                let _ = std::fs::remove_file(self.pins.link(pin));
            }
        }
        tracing::info!(pod = %uid, "pod whose enrolment had failed is no longer wanted");
        Ok(())
    }

    /// How many pods of `source` are wanted but failed to enrol (to be
    /// retried).
    pub fn failed(&self, source: Source) -> usize {
        self.failed
            .lock()
            .map_or(0, |f| f.values().filter(|p| p.source == source).count())
    }

    /// Removes every pod of `source` whose uid is not in `keep`.
    pub fn reconcile(
        &self,
        source: Source,
        keep: &HashSet<String>,
    ) -> Result<Vec<String>, EnrolError> {
        let _change = self.changes.lock().map_err(|_| EnrolError::Poisoned)?;
        let stale: Vec<String> = self
            .pods
            .lock()
            .map_err(|_| EnrolError::Poisoned)?
            .iter()
            .filter(|(uid, pod)| pod.source == source && !keep.contains(*uid))
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in &stale {
            self.remove_locked(uid)?;
        }
        let unwanted: Vec<String> = self
            .failed
            .lock()
            .map_err(|_| EnrolError::Poisoned)?
            .iter()
            .filter(|(uid, pod)| pod.source == source && !keep.contains(*uid))
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in &unwanted {
            self.forget_failed(uid)?;
        }
        Ok(stale)
    }

    /// Removes kernel state left by an earlier ztunnel for pods that are not
    /// enrolled now: `POD_CAPTURE` entries and `tc_*`/`lookup_*` link pins.
    /// Pods that are wanted but failed to enrol keep theirs: it is what
    /// keeps them failing closed.
    pub fn remove_stale_kernel_state(&self) -> Result<usize, EnrolError> {
        let _change = self.changes.lock().map_err(|_| EnrolError::Poisoned)?;
        let pods = self.pods.lock().map_err(|_| EnrolError::Poisoned)?;
        let failed = self.failed.lock().map_err(|_| EnrolError::Poisoned)?;
        let cookies: HashSet<u64> = pods
            .values()
            .map(|p| p.cookie)
            .chain(failed.values().map(|p| p.cookie))
            .collect();
        let pins: HashSet<String> = pods
            .keys()
            .chain(failed.keys())
            .flat_map(|uid| {
                [
                    TcHook::Ingress.pin_name(uid),
                    TcHook::Egress.pin_name(uid),
                    lookup::pin_name(uid),
                ]
            })
            .collect();
        drop((pods, failed));
        let mut removed = 0;
        let mut guard = self.kernel()?;
        let Some(programs) = guard.as_mut() else {
            // Nothing of ours is in the kernel (--capture istio-cni).
            return Ok(0);
        };
        let err = EnrolError::capture("(stale)");
        for cookie in maps::pod_cookies(&programs.ebpf).map_err(err)? {
            if !cookies.contains(&cookie) {
                maps::remove_pod(&mut programs.ebpf, cookie).map_err(err)?;
                removed += 1;
            }
        }
        if let Ok(entries) = std::fs::read_dir(self.pins.links()) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let per_pod = name.starts_with(tc::PIN_PREFIX_INGRESS)
                    || name.starts_with(tc::PIN_PREFIX_EGRESS)
                    || name.starts_with("lookup_");
                if per_pod && !pins.contains(&name) {
                    let _ = std::fs::remove_file(entry.path());
                    removed += 1;
                }
            }
        }
        if let Some(legs) = &self.tables.legs {
            removed += legs.remove_left_at_start();
        }
        if removed > 0 {
            tracing::info!(removed, "removed kernel state of pods no longer enrolled");
        }
        Ok(removed)
    }

    /// Whether an enrolled pod has `identity`.
    pub fn identity_in_use(&self, identity: &Identity) -> bool {
        self.pods
            .lock()
            .is_ok_and(|pods| pods.values().any(|p| &p.identity == identity))
    }

    /// The enrolled pods.
    pub fn list(&self) -> Vec<PodSummary> {
        self.pods.lock().map_or_else(
            |_| Vec::new(),
            |pods| {
                pods.iter()
                    .map(|(uid, p)| PodSummary {
                        uid: uid.clone(),
                        netns: p.netns_name.clone(),
                        netns_cookie: p.cookie,
                        outbound: true,
                        inbound: p.lookup.is_some(),
                    })
                    .collect()
            },
        )
    }

    /// Number of enrolled pods.
    pub fn len(&self) -> usize {
        self.pods.lock().map_or(0, |p| p.len())
    }

    /// Whether no pod is enrolled.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stops accepting on every pod's listeners (drain); attachments stay.
    pub fn stop_listeners(&self) {
        if let Ok(pods) = self.pods.lock() {
            for pod in pods.values() {
                for task in &pod.tasks {
                    task.abort();
                }
            }
        }
    }

    /// Removes every pod (listeners, map entries, TC attachments).
    pub fn remove_all(&self) -> Result<(), EnrolError> {
        let _change = self.changes.lock().map_err(|_| EnrolError::Poisoned)?;
        let uids: Vec<String> = self
            .pods
            .lock()
            .map_err(|_| EnrolError::Poisoned)?
            .keys()
            .cloned()
            .collect();
        for uid in uids {
            self.remove_locked(&uid)?;
        }
        Ok(())
    }

    /// Records the names an enroller gave pod `uid`, so that it is matched
    /// to a workload of the control plane that names it differently
    /// ([`crate::state::PodName`]). Called before [`Self::identity_for`].
    pub fn name_pod(&self, uid: &str, namespace: &str, name: &str, service_account: &str) {
        self.shared
            .state
            .pods()
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(
                uid.to_owned(),
                crate::state::PodName {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                    service_account: service_account.to_owned(),
                },
            );
    }

    /// The identity of pod `uid`: its workload's from the mesh state, or
    /// built from the namespace and service account the enroller sent.
    /// `None` when neither gives one: ztunnel never guesses an identity
    /// (a made-up `default/default` would let a pod speak as another).
    pub fn identity_for(
        &self,
        uid: &str,
        namespace: &str,
        service_account: &str,
    ) -> Option<Identity> {
        let state = self.shared.state.current();
        if let Some(w) = state.workload(uid) {
            let identity = state.identity(w);
            if (!namespace.is_empty() && namespace != identity.namespace)
                || (!service_account.is_empty() && service_account != identity.service_account)
            {
                tracing::warn!(pod = %uid, %identity, namespace, service_account, "the enroller's workload info differs from the mesh config; the config's identity is used");
            }
            return Some(identity);
        }
        if namespace.is_empty() || service_account.is_empty() {
            return None;
        }
        Some(Identity::new(
            state.trust_domain(),
            namespace,
            service_account,
        ))
    }

    /// The shared proxy parts.
    pub fn shared(&self) -> &Shared {
        &self.shared
    }

    /// The pin root.
    pub fn pins(&self) -> &PinRoot {
        &self.pins
    }

    /// Consumes the registry and returns the programs (for final cleanup).
    pub fn into_programs(self) -> Option<KernelPrograms> {
        self.programs.into_inner().ok().flatten()
    }
}
