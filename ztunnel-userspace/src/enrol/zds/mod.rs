//! ZDS: the protocol by which a node agent hands pods to ztunnel.
//!
//! The messages are generated from `proto/zds.proto`, which carries Istio's
//! package, names and field numbers; golden byte fixtures below pin them to
//! the wire. The transport is a `SOCK_SEQPACKET` unix socket (one message
//! per packet; the pod's netns fd travels with `add` as `SCM_RIGHTS`).
//!
//! Two ways in, one handling ([`session`]):
//! - [`node_agent`]: ztunnel dials Istio's node agent (istio-cni) at
//!   `INPOD_UDS` (default `/var/run/ztunnel/ztunnel.sock`), says
//!   `ZdsHello{V1}`, and takes the snapshot and the changes after it.
//!   Reconnects with back-off; readiness waits for the first snapshot.
//! - [`server`]: ztunnel listens (local mode), for our own CNI plugin and
//!   `ztunnel enrol` ([`client`]).
//! - [`wire`]: packets and fds.

pub mod client;
pub mod node_agent;
pub mod server;
pub mod session;
pub mod wire;

use std::path::PathBuf;

pub use crate::proto::zds::*;
pub use client::{CLIENT_TIMEOUT, request, request_within};
pub use server::{AllowedPeers, SocketFile, serve};

/// Default path of the socket: where Istio's node agent listens
/// (`INPOD_UDS`), and where ztunnel listens in local mode.
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";

/// Errors of the ZDS sockets.
#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    /// Socket setup or I/O.
    #[error("enrolment socket {path}: {source}")]
    Socket {
        /// The socket path.
        path: PathBuf,
        /// The OS error.
        source: nix::Error,
    },
    /// Creating the socket's folder failed.
    #[error("cannot create {path}: {source}")]
    Dir {
        /// The folder.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The peer sent something that is not the expected message.
    #[error("malformed enrolment message: {0}")]
    Decode(#[from] prost::DecodeError),
    /// The daemon refused the request.
    #[error("ztunnel refused: {0}")]
    Refused(String),
    /// The peer closed the connection early.
    #[error("connection closed before an answer")]
    Closed,
    /// The daemon did not accept, take or answer a request in time.
    #[error("enrolment socket {path}: no answer within {after:?}")]
    Timeout {
        /// The socket path.
        path: PathBuf,
        /// The bound that ran out.
        after: std::time::Duration,
    },
}

/// Checks an `add` as far as it can be without the registry: a uid, the
/// network namespace fd (`F`: an `OwnedFd` in the daemon; the fuzz target
/// passes a stand-in) and complete workload information. The error is the
/// `ack` the enroller gets. Pure, so that the fuzz target checks the real
/// rules.
pub fn check_add<F>(add: &AddWorkload, fd: Option<F>) -> Result<(&WorkloadInfo, F), String> {
    if add.uid.is_empty() {
        return Err("add: uid is empty".into());
    }
    let fd = fd.ok_or_else(|| {
        format!(
            "add {}: no network namespace fd (SCM_RIGHTS) attached",
            add.uid
        )
    })?;
    Ok((workload_info(add)?, fd))
}

/// The workload information of an `add`, which must name the namespace and
/// service account: they make the pod's identity, and guessing them (say,
/// `default/default`) would hand the pod a certificate, and the policies,
/// of another workload. The error names the pod and what is missing.
fn workload_info(add: &AddWorkload) -> Result<&WorkloadInfo, String> {
    let info = add.workload_info.as_ref().ok_or_else(|| {
        format!(
            "add {}: workload_info is missing (namespace and service account are required)",
            add.uid
        )
    })?;
    let fields = [
        ("workload_info.namespace", &info.namespace),
        ("workload_info.service_account", &info.service_account),
    ];
    let missing: Vec<&str> = fields
        .iter()
        .filter(|(_, value)| value.trim().is_empty())
        .map(|(field, _)| *field)
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "add {}: {} must not be empty",
            add.uid,
            missing.join(" and ")
        ));
    }
    // Both are path segments of the SPIFFE id: a `/` in one would make an
    // identity that peers cannot parse back, or that reads as another
    // (namespace `a/sa/b` + account `c` and namespace `a` + account
    // `b/sa/c` would share one certificate name). Found by fuzzing.
    let slashed: Vec<&str> = fields
        .iter()
        .filter(|(_, value)| value.contains('/'))
        .map(|(field, _)| *field)
        .collect();
    if slashed.is_empty() {
        Ok(info)
    } else {
        Err(format!(
            "add {}: {} must not contain '/' (it separates the SPIFFE id's segments)",
            add.uid,
            slashed.join(" and ")
        ))
    }
}

/// An `ack`, as one response.
pub fn ack(error: String) -> WorkloadResponse {
    WorkloadResponse {
        payload: Some(workload_response::Payload::Ack(Ack { error })),
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;

    fn add(info: Option<WorkloadInfo>) -> AddWorkload {
        AddWorkload {
            uid: "pod-7".into(),
            workload_info: info,
        }
    }

    fn info(name: &str, namespace: &str, service_account: &str) -> WorkloadInfo {
        WorkloadInfo {
            name: name.into(),
            namespace: namespace.into(),
            service_account: service_account.into(),
        }
    }

    fn request(payload: workload_request::Payload) -> Vec<u8> {
        WorkloadRequest {
            payload: Some(payload),
        }
        .encode_to_vec()
    }

    // Golden bytes, written by hand from Istio's field numbers (tag byte =
    // field << 3 | wire type; 2 = length-delimited, 0 = varint). They fail
    // if a number in proto/zds.proto drifts from Istio's.

    #[test]
    fn hello_is_version_1_in_field_1() {
        let hello = ZdsHello {
            version: Version::V1.into(),
        };
        assert_eq!(hello.encode_to_vec(), [0x08, 0x01]);
    }

    #[test]
    fn add_is_field_1_with_uid_1_and_info_2() {
        let bytes = request(workload_request::Payload::Add(AddWorkload {
            uid: "u1".into(),
            workload_info: Some(info("n", "ns", "sa")),
        }));
        #[rustfmt::skip]
        let golden = [
            0x0a, 0x11, // WorkloadRequest.add (1), 17 bytes
            0x0a, 0x02, b'u', b'1', // AddWorkload.uid (1)
            0x12, 0x0b, // AddWorkload.workload_info (2), 11 bytes
            0x0a, 0x01, b'n', // WorkloadInfo.name (1)
            0x12, 0x02, b'n', b's', // WorkloadInfo.namespace (2)
            0x1a, 0x02, b's', b'a', // WorkloadInfo.service_account (3)
        ];
        assert_eq!(bytes, golden);
        let back = WorkloadRequest::decode(&golden[..]).expect("decode");
        assert_eq!(back.encode_to_vec(), golden);
    }

    #[test]
    fn del_is_field_2_with_uid_in_field_2() {
        // DelWorkload.uid is field 2 in Istio's proto: a field-1 uid (our
        // first, hand-written struct) decodes there as an empty uid.
        let golden = [0x12, 0x04, 0x12, 0x02, b'u', b'1'];
        assert_eq!(
            request(workload_request::Payload::Del(DelWorkload {
                uid: "u1".into()
            })),
            golden
        );
        match WorkloadRequest::decode(&golden[..])
            .expect("decode")
            .payload
        {
            Some(workload_request::Payload::Del(del)) => assert_eq!(del.uid, "u1"),
            other => panic!("decoded {other:?}"),
        }
        // A uid in field 1 is an unknown field: skipped, not taken.
        match WorkloadRequest::decode(&[0x12, 0x04, 0x0a, 0x02, b'u', b'1'][..])
            .expect("decode")
            .payload
        {
            Some(workload_request::Payload::Del(del)) => assert_eq!(del.uid, ""),
            other => panic!("decoded {other:?}"),
        }
    }

    #[test]
    fn snapshot_sent_is_field_3_and_keep_field_5() {
        assert_eq!(
            request(workload_request::Payload::SnapshotSent(SnapshotSent {})),
            [0x1a, 0x00]
        );
        assert_eq!(
            request(workload_request::Payload::Keep(KeepWorkload {
                uid: "u1".into()
            })),
            [0x2a, 0x04, 0x0a, 0x02, b'u', b'1']
        );
    }

    #[test]
    fn ack_is_field_1_with_error_in_field_1() {
        assert_eq!(ack(String::new()).encode_to_vec(), [0x0a, 0x00]);
        assert_eq!(
            ack("x".into()).encode_to_vec(),
            [0x0a, 0x03, 0x0a, 0x01, b'x']
        );
    }

    #[test]
    fn an_add_without_workload_info_is_refused_naming_the_pod_and_field() {
        let err = workload_info(&add(None)).expect_err("no workload info");
        assert!(
            err.contains("pod-7") && err.contains("workload_info is missing"),
            "{err}"
        );
        let err = workload_info(&add(Some(info("web", "demo", "")))).expect_err("no sa");
        assert!(
            err.contains("pod-7") && err.contains("workload_info.service_account"),
            "{err}"
        );
        assert!(!err.contains("workload_info.namespace"), "{err}");
        let err = workload_info(&add(Some(WorkloadInfo::default()))).expect_err("nothing");
        assert!(
            err.contains("workload_info.namespace and workload_info.service_account"),
            "{err}"
        );
        let full = add(Some(info("web", "demo", "web")));
        assert_eq!(workload_info(&full).expect("complete").namespace, "demo");
    }

    #[test]
    fn a_slash_in_namespace_or_service_account_is_refused() {
        // Regression (fuzz target zds_message): namespace `dem/` was
        // accepted and made the unparsable identity
        // spiffe://cluster.local/ns/dem//sa/a1.
        for (namespace, service_account, field) in [
            ("dem/", "a1", "workload_info.namespace"),
            ("demo", "a/sa/b", "workload_info.service_account"),
        ] {
            let err = workload_info(&add(Some(info("web", namespace, service_account))))
                .expect_err("slash");
            assert!(
                err.contains("pod-7") && err.contains(field) && err.contains("'/'"),
                "{err}"
            );
        }
    }

    #[test]
    fn garbage_is_a_decode_error_not_a_panic() {
        assert!(WorkloadRequest::decode(&[0xff, 0xff, 0xff][..]).is_err());
    }
}
