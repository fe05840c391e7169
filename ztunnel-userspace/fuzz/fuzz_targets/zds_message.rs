//! The enrolment socket: one packet as the daemon receives it (decoded as a
//! ZDS `WorkloadRequest`, then an `add` checked as `serve_client` does), and
//! as `ztunnel enrol` reads the daemon's answer (`WorkloadResponse`).
//!
//! Asserts: no panic; decode(encode(x)) == x; an `add` without a netns fd is
//! refused; an accepted `add` has a uid, a namespace and a service account,
//! and the identity made from them reads back as the same identity; a
//! refusal names the pod.

#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use ztunnel::{
    enrol::zds::{self, WorkloadRequest, WorkloadResponse, workload_request::Payload},
    identity::Identity,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = WorkloadRequest::decode(data) {
        let bytes = request.encode_to_vec();
        assert_eq!(bytes.len(), request.encoded_len());
        let again = WorkloadRequest::decode(bytes.as_slice()).expect("re-encoded request decodes");
        assert_eq!(again, request, "decode(encode(x)) != x");
        if let Some(Payload::Add(add)) = &request.payload {
            check_add(add);
        }
    }
    if let Ok(response) = WorkloadResponse::decode(data) {
        let bytes = response.encode_to_vec();
        let again =
            WorkloadResponse::decode(bytes.as_slice()).expect("re-encoded response decodes");
        assert_eq!(again, response, "decode(encode(x)) != x");
    }
});

fn check_add(add: &zds::AddWorkload) {
    let without_fd = zds::check_add::<()>(add, None).expect_err("an add without a netns fd");
    assert!(
        add.uid.is_empty() || without_fd.contains(&add.uid),
        "{without_fd}"
    );
    match zds::check_add(add, Some(())) {
        Ok((info, ())) => {
            assert!(!add.uid.is_empty());
            assert!(!info.namespace.trim().is_empty());
            assert!(!info.service_account.trim().is_empty());
            // The identity is what the pod's certificate carries and what
            // peers parse back out of it: it must not be ambiguous.
            let identity = Identity::new("cluster.local", &info.namespace, &info.service_account);
            assert_eq!(
                Identity::parse(&identity.to_string()).ok(),
                Some(identity.clone()),
                "accepted workload info makes an identity that does not read back: {identity}"
            );
        }
        Err(refusal) => assert!(
            add.uid.is_empty() || refusal.contains(&add.uid),
            "a refusal must name the pod: {refusal}"
        ),
    }
}
