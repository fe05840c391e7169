//! The plugin's side of the enrolment socket: add, delete and "are you
//! there" for one pod, each bounded by `ztunnelTimeoutMs`, and the errors
//! turned into CNI errors that say what to do.

use std::{
    collections::HashSet, fs::File, net::SocketAddr, os::fd::OwnedFd, path::Path, time::Duration,
};

use super::{
    http::{self, Server},
    spec::{CniError, NetConf, code},
};
use crate::enrol::zds::{
    self, AddWorkload, DelWorkload, KeepWorkload, WorkloadInfo, WorkloadRequest, ZdsError,
    workload_request::Payload,
};

/// A pod as ztunnel is told about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    /// Pod uid.
    pub uid: String,
    /// Pod name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Service account (the identity).
    pub service_account: String,
}

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

/// Whether the error says that nobody listens on the socket: no file, or a
/// file nobody accepts on (a ztunnel that died without removing it).
pub fn not_running(error: &ZdsError) -> bool {
    matches!(
        error,
        ZdsError::Socket {
            source: nix::Error::ENOENT | nix::Error::ECONNREFUSED,
            ..
        }
    )
}

/// A CNI error for a failed exchange with ztunnel about `what`.
fn cni_error(error: ZdsError, what: &str, socket: &Path) -> CniError {
    let socket = socket.display();
    match error {
        ZdsError::Refused(reason) => CniError::new(
            code::ZTUNNEL_REFUSED,
            format!("ztunnel refused to {what}: {reason}"),
            "",
        ),
        ZdsError::Timeout { after, .. } => CniError::new(
            code::TRY_AGAIN_LATER,
            format!(
                "cannot {what}: ztunnel did not answer on its enrolment socket {socket} within {after:?}"
            ),
            "",
        ),
        e if not_running(&e) => CniError::new(
            code::TRY_AGAIN_LATER,
            format!(
                "cannot {what}: ztunnel is not running (nothing listens on its enrolment socket {socket})"
            ),
            e.to_string(),
        ),
        e => CniError::new(
            code::TRY_AGAIN_LATER,
            format!("cannot {what}: enrolment socket {socket}"),
            e.to_string(),
        ),
    }
}

/// Enrols the pod whose network namespace is `netns`. Any failure fails
/// the pod's `ADD`: a pod must not start outside the mesh it was put in.
pub fn enrol(conf: &NetConf, netns: &Path, pod: &Workload) -> Result<(), CniError> {
    let fd: OwnedFd = File::open(netns)
        .map_err(|e| {
            CniError::new(
                code::IO_FAILURE,
                format!(
                    "cannot open the pod's network namespace CNI_NETNS={}",
                    netns.display()
                ),
                e.to_string(),
            )
        })?
        .into();
    let request = WorkloadRequest {
        payload: Some(Payload::Add(AddWorkload {
            uid: pod.uid.clone(),
            workload_info: Some(WorkloadInfo {
                name: pod.name.clone(),
                namespace: pod.namespace.clone(),
                service_account: pod.service_account.clone(),
            }),
        })),
    };
    zds::request_within(
        &conf.ztunnel_socket,
        vec![(request, Some(fd))],
        conf.ztunnel_timeout,
    )
    .map_err(|e| cni_error(e, &format!("enrol pod {pod}"), &conf.ztunnel_socket))
}

/// What `DEL` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// ztunnel removed the pod, or never had it.
    Removed,
    /// ztunnel is not running, so it holds nothing of the pod in memory;
    /// see [`remove`] for why that is a success.
    NotRunning,
}

/// Removes the pod with `uid`.
///
/// When ztunnel is not running (no socket file, or nothing accepting on
/// it), this succeeds: the specification asks `DEL` to succeed when what
/// it removes is already gone, and the kubelet retries a failing `DEL`
/// forever, holding the pod's sandbox. Nothing is lost: a ztunnel that
/// starts again only re-enrols the pods it is told about, and after its
/// reconcile grace it removes the kernel state of every pod nobody
/// re-enrolled, this one included. A running ztunnel that refuses or does
/// not answer in time does hold the pod (its listeners, its pinned
/// programs, a reference to the namespace): that fails the `DEL`, so that
/// the kubelet tries again.
pub fn remove(conf: &NetConf, uid: &str) -> Result<Removal, CniError> {
    let request = WorkloadRequest {
        payload: Some(Payload::Del(DelWorkload {
            uid: uid.to_owned(),
        })),
    };
    match zds::request_within(
        &conf.ztunnel_socket,
        vec![(request, None)],
        conf.ztunnel_timeout,
    ) {
        Ok(()) => Ok(Removal::Removed),
        Err(e) if not_running(&e) => Ok(Removal::NotRunning),
        Err(e) => Err(cni_error(
            e,
            &format!("remove pod uid {uid}"),
            &conf.ztunnel_socket,
        )),
    }
}

/// What `CHECK` could establish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Presence {
    /// The admin endpoint lists the pod among the enrolled ones.
    Enrolled,
    /// The socket answered, and the admin endpoint could not be asked (the
    /// reason): the pod's enrolment is not confirmed, only that ztunnel
    /// runs and takes requests.
    SocketAnswered(String),
}

/// Checks that ztunnel runs and, when its admin endpoint answers, that it
/// has the pod enrolled. The socket is asked with a `keep` for the pod:
/// ZDS has no query, and a `keep` on a connection that sends no snapshot
/// changes nothing.
pub fn check(conf: &NetConf, pod: &Workload) -> Result<Presence, CniError> {
    let request = WorkloadRequest {
        payload: Some(Payload::Keep(KeepWorkload {
            uid: pod.uid.clone(),
        })),
    };
    zds::request_within(
        &conf.ztunnel_socket,
        vec![(request, None)],
        conf.ztunnel_timeout,
    )
    .map_err(|e| cni_error(e, &format!("check pod {pod}"), &conf.ztunnel_socket))?;
    let enrolled = match enrolled_uids(conf.ztunnel_admin, conf.ztunnel_timeout) {
        Ok(uids) => uids,
        Err(why) => return Ok(Presence::SocketAnswered(why)),
    };
    if enrolled.contains(&pod.uid) {
        Ok(Presence::Enrolled)
    } else {
        Err(CniError::new(
            code::NOT_ENROLLED,
            format!(
                "ztunnel does not have pod {pod} enrolled (its /config_dump at {} lists {} other pods)",
                conf.ztunnel_admin,
                enrolled.len()
            ),
            "",
        ))
    }
}

/// The uids in `enrolledPods` of ztunnel's `/config_dump`; the error says
/// why they could not be had.
fn enrolled_uids(admin: SocketAddr, timeout: Duration) -> Result<HashSet<String>, String> {
    #[derive(serde::Deserialize)]
    struct Dump {
        #[serde(rename = "enrolledPods")]
        enrolled_pods: Vec<Enrolled>,
    }
    #[derive(serde::Deserialize)]
    struct Enrolled {
        uid: String,
    }
    let server = Server {
        host: admin.ip().to_string(),
        port: admin.port(),
        path_prefix: String::new(),
        tls: None,
    };
    let runtime = super::runtime().map_err(|e| e.to_string())?;
    let (status, body) = runtime
        .block_on(http::get(&server, "/config_dump", &[], timeout))
        .map_err(|e| format!("admin endpoint {admin}: {e}"))?;
    if status != 200 {
        return Err(format!(
            "admin endpoint {admin}: /config_dump answered {status}"
        ));
    }
    let dump: Dump = serde_json::from_slice(&body)
        .map_err(|e| format!("admin endpoint {admin}: /config_dump is not ztunnel's: {e}"))?;
    Ok(dump.enrolled_pods.into_iter().map(|p| p.uid).collect())
}
