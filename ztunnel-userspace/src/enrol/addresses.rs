//! Which addresses an enrolling pod is given.
//!
//! A pod's addresses decide where inbound connections are steered
//! (`POD_LISTENERS` is keyed by address) and which pod the same-node path
//! delivers to. They were read from the pod's own interfaces, so a pod with
//! `CAP_NET_ADMIN` that added a neighbour's address to one of them took
//! over the neighbour's steering entries at the next ztunnel restart:
//! plaintext for the neighbour landed in the thief's application.
//!
//! Now the mesh state (YAML or istiod) says which addresses the pod has,
//! and the interfaces are only checked against it, once, at enrolment:
//! - when the state lists the pod's workload, the pod keeps those of its
//!   interfaces' addresses that the workload has, and nothing else;
//! - when it does not (the pod gets no traffic until it does: see
//!   `state::mesh::WORKLOAD_UNKNOWN`), an address the state gives to a
//!   workload is never the pod's;
//! - an address another enrolled pod already has is refused, with both
//!   pods named.
//!
//! What the pod adds to its interfaces later is never read: `sk_lookup`
//! finds no listener for it and drops (fail closed).

use std::net::IpAddr;

use crate::state::MeshState;

/// The outcome for one enrolling pod.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PodAddresses {
    /// The addresses the pod is enrolled with.
    pub kept: Vec<IpAddr>,
    /// Addresses found on its interfaces and not given to it, with why.
    pub ignored: Vec<(IpAddr, String)>,
}

/// An address two pods claim.
#[derive(Debug, PartialEq, Eq)]
pub struct AddressTaken {
    /// The address.
    pub ip: IpAddr,
    /// The enrolled pod that has it.
    pub owner: String,
}

/// Decides the addresses of pod `uid` from those `found` on its interfaces,
/// the mesh `state`, and the addresses of the pods already enrolled
/// (`enrolled`: uid and addresses, the pod itself excluded).
pub fn decide<'a>(
    uid: &str,
    found: &[IpAddr],
    state: &MeshState,
    enrolled: impl IntoIterator<Item = (&'a str, &'a [IpAddr])>,
) -> Result<PodAddresses, AddressTaken> {
    let mut out = PodAddresses::default();
    let own = state.workload(uid);
    for ip in found {
        let why = match own {
            Some(w) if w.ips.contains(ip) => None,
            Some(w) => Some(format!(
                "not an address of workload {} in the mesh state",
                w.name
            )),
            None => state
                .workload_by_ip(*ip)
                .map(|other| format!("the mesh state gives it to workload {}", other.name)),
        };
        match why {
            None => out.kept.push(*ip),
            Some(why) => out.ignored.push((*ip, why)),
        }
    }
    for (other, ips) in enrolled {
        if other == uid {
            continue;
        }
        if let Some(ip) = out.kept.iter().find(|ip| ips.contains(ip)) {
            return Err(AddressTaken {
                ip: *ip,
                owner: other.to_owned(),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::local::parse;

    fn state() -> MeshState {
        MeshState::new(
            parse(
                "
workloads:
  - {uid: victim, name: victim, namespace: demo, node: n1, ips: [10.0.0.1, 'fd00::1']}
  - {uid: thief, name: thief, namespace: demo, node: n1, ips: [10.0.0.2]}
",
                std::path::Path::new("t"),
            )
            .expect("valid"),
        )
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn a_listed_pod_keeps_only_its_workloads_addresses() {
        let found = [ip("10.0.0.2"), ip("10.0.0.1"), ip("192.168.7.7")];
        let got = decide("thief", &found, &state(), []).expect("no conflict");
        assert_eq!(got.kept, vec![ip("10.0.0.2")]);
        let ignored: Vec<IpAddr> = got.ignored.iter().map(|(ip, _)| *ip).collect();
        assert_eq!(ignored, vec![ip("10.0.0.1"), ip("192.168.7.7")]);
        assert!(got.ignored[0].1.contains("workload thief"), "{got:?}");
    }

    #[test]
    fn an_unlisted_pod_never_gets_a_listed_workloads_address() {
        let found = [ip("10.0.0.1"), ip("fd00::1"), ip("10.0.0.9")];
        let got = decide("stranger", &found, &state(), []).expect("no conflict");
        assert_eq!(got.kept, vec![ip("10.0.0.9")]);
        assert!(got.ignored[0].1.contains("workload victim"), "{got:?}");
    }

    #[test]
    fn an_address_another_enrolled_pod_has_is_refused_with_both_named() {
        let taken = [ip("10.0.0.9")];
        let err = decide(
            "stranger",
            &[ip("10.0.0.9")],
            &state(),
            [("other", &taken[..])],
        )
        .expect_err("conflict");
        assert_eq!(
            err,
            AddressTaken {
                ip: ip("10.0.0.9"),
                owner: "other".into()
            }
        );
        // Re-enrolling the same pod is not a conflict with itself.
        let mine = [ip("10.0.0.2")];
        assert!(decide("thief", &mine, &state(), [("thief", &mine[..])]).is_ok());
    }
}
