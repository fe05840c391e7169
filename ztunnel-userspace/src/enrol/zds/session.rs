//! One ZDS connection's rules, whoever dialled.
//!
//! - `add` carries exactly one fd (the pod's netns) and workload info;
//!   every other request carries none. Breaking that, `keep` after the
//!   snapshot, a second `snapshot_sent`, or bytes that are not a request
//!   are protocol errors: they are answered and the connection is closed
//!   (the node agent reconnects and starts over with a snapshot).
//! - An `add` that cannot be served as sent (no uid, incomplete workload
//!   info, an fd that is not a network namespace) is refused (`ack` with
//!   an error); the pod is not enrolled.
//! - An `add` whose proxy cannot start (listeners, kernel attachments) is
//!   refused too, but kept pending and retried every
//!   [`PENDING_RETRY_INTERVAL`]: the node agent sends it only once.
//! - Re-adding a uid with the same netns is a no-op; with another netns it
//!   replaces the enrolment (the registry's rule).
//! - At `snapshot_sent`, every pod of this source that was not added (or
//!   is pending) or kept on this connection is removed.
//! - One `ack` per request, sent once the pod's listeners are up.

use std::{
    collections::{BTreeMap, HashSet},
    os::fd::{AsFd as _, AsRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use prost::Message as _;

use super::{AddWorkload, WorkloadRequest, check_add, wire, workload_request::Payload};
use crate::{
    enrol::{EnrolRequest, PodRegistry, Source},
    netns::PodNetns,
    state::CaptureOptOut,
};

/// How often an `add` whose proxy could not start is tried again (Istio's
/// ztunnel retries at the same pace).
pub const PENDING_RETRY_INTERVAL: Duration = Duration::from_secs(5);

/// How long a connection waits for a request before it looks at the
/// pending pods and whether the process is draining.
const IDLE_WAKE: Duration = Duration::from_secs(1);

/// What to answer, and whether the connection goes on.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// Answer (empty: success) and read the next request.
    Ack(String),
    /// Answer, then close: the peer broke the protocol.
    Close(String),
}

/// An `add` that was refused because the proxy could not start, kept to be
/// tried again.
#[derive(Debug)]
struct Pending {
    add: AddWorkload,
    netns: PodNetns,
    last_try: Instant,
}

/// The state of one connection.
pub struct Session<'a> {
    registry: &'a PodRegistry,
    source: Source,
    /// Added (or pending) or kept on this connection.
    seen: HashSet<String>,
    snapshot_done: bool,
    pending: BTreeMap<String, Pending>,
}

impl<'a> Session<'a> {
    /// A new connection whose pods are of `source`.
    pub fn new(registry: &'a PodRegistry, source: Source) -> Self {
        Self {
            registry,
            source,
            seen: HashSet::new(),
            snapshot_done: false,
            pending: BTreeMap::new(),
        }
    }

    /// Whether this connection's snapshot has been applied.
    pub fn snapshot_done(&self) -> bool {
        self.snapshot_done
    }

    /// Pods refused because their proxy could not start, waiting for a
    /// retry.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Handles one packet.
    pub fn handle(&mut self, packet: wire::Packet) -> Reply {
        let request = match WorkloadRequest::decode(packet.bytes.as_slice()) {
            Ok(request) => request,
            Err(e) => {
                return Reply::Close(format!(
                    "malformed ZDS message (expected a WorkloadRequest): {e}"
                ));
            }
        };
        let mut fds = packet.fds;
        let Some(payload) = request.payload else {
            return Reply::Close("empty WorkloadRequest (no payload)".into());
        };
        let kind = match &payload {
            Payload::Add(_) => "add",
            Payload::Keep(_) => "keep",
            Payload::Del(_) => "del",
            Payload::SnapshotSent(_) => "snapshot_sent",
        };
        let expected = usize::from(kind == "add");
        if fds.len() != expected {
            return Reply::Close(format!(
                "{kind} must carry {expected} fd(s) (SCM_RIGHTS), got {}",
                fds.len()
            ));
        }
        match payload {
            Payload::Add(add) => {
                if add.workload_info.is_none() {
                    return Reply::Close(format!(
                        "add {}: workload_info is missing (namespace and service account are required)",
                        add.uid
                    ));
                }
                Reply::Ack(self.add(add, fds.pop()).err().unwrap_or_default())
            }
            Payload::Keep(keep) => {
                if self.snapshot_done {
                    return Reply::Close(format!(
                        "keep {}: keep is only valid before snapshot_sent",
                        keep.uid
                    ));
                }
                self.seen.insert(keep.uid);
                Reply::Ack(String::new())
            }
            Payload::Del(del) => {
                if del.uid.is_empty() {
                    return Reply::Ack("del: uid is empty".into());
                }
                self.seen.remove(&del.uid);
                if self.pending.remove(&del.uid).is_some() {
                    tracing::info!(pod = %del.uid, "pending pod deleted before it could be enrolled");
                }
                Reply::Ack(
                    self.registry
                        .remove(&del.uid)
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                        .err()
                        .unwrap_or_default(),
                )
            }
            Payload::SnapshotSent(_) => {
                if self.snapshot_done {
                    return Reply::Close(
                        "snapshot_sent was already received on this connection".into(),
                    );
                }
                self.snapshot_done = true;
                let keep: HashSet<String> = self
                    .seen
                    .iter()
                    .chain(self.pending.keys())
                    .cloned()
                    .collect();
                match self.registry.reconcile(self.source, &keep) {
                    Ok(removed) => {
                        if !removed.is_empty() {
                            tracing::info!(
                                ?removed,
                                "snapshot reconciled: removed pods not re-sent"
                            );
                        }
                        Reply::Ack(String::new())
                    }
                    Err(e) => Reply::Ack(e.to_string()),
                }
            }
        }
    }

    fn add(&mut self, add: AddWorkload, fd: Option<OwnedFd>) -> Result<(), String> {
        let (_, fd) = check_add(&add, fd)?;
        // Checked before anything enters it, so that the error names what
        // was sent (a file, another namespace type).
        let netns = PodNetns::checked_from_fd(pod_name(&add), fd)
            .map_err(|e| format!("add {}: {e}", add.uid))?;
        self.seen.insert(add.uid.clone());
        self.pending.remove(&add.uid);
        let keep = netns
            .try_clone()
            .map_err(|e| format!("add {}: cannot keep the netns fd: {e}", add.uid))?;
        match self.enrol(&add, netns) {
            Ok(()) => Ok(()),
            Err(EnrolFailure::Refused(e)) => Err(e),
            Err(EnrolFailure::ProxyNotStarted(e)) => {
                let uid = add.uid.clone();
                self.pending.insert(
                    uid.clone(),
                    Pending {
                        add,
                        netns: keep,
                        last_try: Instant::now(),
                    },
                );
                Err(format!(
                    "{e} (pod {uid} kept pending: retried every {} s)",
                    PENDING_RETRY_INTERVAL.as_secs()
                ))
            }
        }
    }

    fn enrol(&self, add: &AddWorkload, netns: PodNetns) -> Result<(), EnrolFailure> {
        let info = add.workload_info.clone().unwrap_or_default();
        // Before the identity is looked up: with istiod's workloads the pod
        // is found by these names, not by its uid.
        self.registry
            .name_pod(&add.uid, &info.namespace, &info.name, &info.service_account);
        let identity = self
            .registry
            .identity_for(&add.uid, &info.namespace, &info.service_account)
            .ok_or_else(|| {
                EnrolFailure::Refused(format!(
                    "add {}: no identity (workload info lacks namespace or service account)",
                    add.uid
                ))
            })?;
        self.registry
            .enrol(EnrolRequest {
                uid: add.uid.clone(),
                netns,
                capture: CaptureOptOut::default(),
                identity,
                source: self.source,
            })
            .map(|_| ())
            .map_err(|e| EnrolFailure::ProxyNotStarted(e.to_string()))
    }

    /// Tries the pending pods whose last try is [`PENDING_RETRY_INTERVAL`]
    /// old again.
    pub fn retry_pending(&mut self) {
        let due: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, p)| p.last_try.elapsed() >= PENDING_RETRY_INTERVAL)
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in due {
            let Some(pending) = self.pending.get_mut(&uid) else {
                continue;
            };
            pending.last_try = Instant::now();
            let netns = match pending.netns.try_clone() {
                Ok(netns) => netns,
                Err(e) => {
                    tracing::warn!(pod = %uid, error = %e, "cannot retry pending pod");
                    continue;
                }
            };
            let add = pending.add.clone();
            match self.enrol(&add, netns) {
                Ok(()) => {
                    tracing::info!(pod = %uid, "pending pod enrolled on retry");
                    self.pending.remove(&uid);
                }
                Err(EnrolFailure::Refused(e) | EnrolFailure::ProxyNotStarted(e)) => {
                    tracing::warn!(pod = %uid, error = %e, "pending pod still cannot be enrolled");
                }
            }
        }
    }

    /// Serves requests on `conn` until the peer closes, breaks the
    /// protocol, or `stop` says so (looked at least every second).
    /// `changed` runs after every request and retry (readiness follows it).
    pub fn serve(
        &mut self,
        conn: &OwnedFd,
        stop: &dyn Fn() -> bool,
        changed: &mut dyn FnMut(&Self),
    ) -> Result<(), nix::Error> {
        loop {
            if stop() {
                return Ok(());
            }
            if !wire::readable(conn.as_fd(), IDLE_WAKE)? {
                self.retry_pending();
                changed(self);
                continue;
            }
            let Some(packet) = wire::receive(conn.as_raw_fd())? else {
                return Ok(());
            };
            let reply = self.handle(packet);
            changed(self);
            match reply {
                Reply::Ack(error) => {
                    if !error.is_empty() {
                        tracing::warn!(%error, "enrolment request refused");
                    }
                    wire::send_ack(conn, &error)?;
                }
                Reply::Close(error) => {
                    tracing::warn!(%error, "enrolment protocol error: closing the connection");
                    wire::send_ack(conn, &error)?;
                    return Ok(());
                }
            }
            self.retry_pending();
        }
    }
}

/// Why an enrolment did not happen.
enum EnrolFailure {
    /// The request cannot be served as sent; retrying will not help.
    Refused(String),
    /// The proxy could not start; a retry may succeed.
    ProxyNotStarted(String),
}

/// The pod's name for logs: `namespace/name`, or the uid.
fn pod_name(add: &AddWorkload) -> String {
    let info = add.workload_info.clone().unwrap_or_default();
    let name = if info.name.is_empty() {
        &add.uid
    } else {
        &info.name
    };
    format!("{}/{name}", info.namespace)
}
