//! The local-mode config file: `state::local::parse` (YAML, types, then
//! validation), and the mesh state built from whatever it accepts.
//!
//! Asserts: no panic and no hang (libFuzzer's -timeout); every rejection
//! has one of the documented kinds; an accepted config keeps the promises
//! validation makes (unique uids and addresses, absolute netns paths,
//! services with VIPs and known endpoints), serializes and parses back to
//! itself, gives every workload an identity that reads back as itself, and
//! the state built from it routes and resolves its own addresses and names
//! without panicking.

#![no_main]

use std::{collections::HashSet, net::SocketAddr, path::Path};

use libfuzzer_sys::fuzz_target;
use ztunnel::{
    identity::Identity,
    state::{MeshState, Route, local},
};

fuzz_target!(|data: &[u8]| {
    // `load` reads the file with read_to_string: text that is not UTF-8
    // never reaches the parser.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("fuzz.yaml");
    let config = match local::parse(text, path) {
        Ok(config) => config,
        Err(e) => {
            assert!(matches!(e.kind(), "empty" | "syntax" | "invalid"), "{e:?}");
            assert!(e.to_string().contains("fuzz.yaml"), "{e}");
            return;
        }
    };

    let mut uids = HashSet::new();
    let mut ips = HashSet::new();
    for w in &config.workloads {
        assert!(
            uids.insert(w.uid.as_str()),
            "duplicate uid {:?} accepted",
            w.uid
        );
        for ip in &w.ips {
            assert!(ips.insert(*ip), "address {ip} of two workloads accepted");
        }
        if let Some(netns) = &w.netns {
            assert!(netns.is_absolute());
        }
        // A workload may carry its own trust domain (istiod's, per workload).
        let trust_domain = w.trust_domain.as_deref().unwrap_or(&config.trust_domain);
        let identity = Identity::new(trust_domain, &w.namespace, &w.service_account);
        assert_eq!(
            Identity::parse(&w.identity(&config.trust_domain)).ok(),
            Some(identity),
            "workload {:?} has an identity that does not read back",
            w.uid
        );
    }
    for s in &config.services {
        assert!(!s.vips.is_empty());
        assert!(s.endpoints.iter().all(|uid| uids.contains(uid.as_str())));
    }

    let yaml = serde_yaml::to_string(&config).expect("an accepted config serializes");
    let again = local::parse(&yaml, path)
        .unwrap_or_else(|e| panic!("a serialized config is rejected: {e}\n{yaml}"));
    assert_eq!(again, config, "parse(serialize(x)) != x\n{yaml}");

    let state = MeshState::new(config.clone());
    for w in &config.workloads {
        assert_eq!(state.workload(&w.uid).map(|f| &f.uid), Some(&w.uid));
        let _ = state.resolve_name(&w.name, 80, false);
        let _ = state.resolve_name(&format!("{}.{}", w.name, w.namespace), 80, true);
        for ip in &w.ips {
            assert_eq!(state.workload_by_ip(*ip).map(|f| &f.uid), Some(&w.uid));
            let _ = state.route(SocketAddr::new(*ip, 8080));
            let _ = state.endpoint(SocketAddr::new(*ip, 8080));
        }
    }
    for s in &config.services {
        let _ = state.resolve_name(&format!("{}.{}.svc", s.name, s.namespace), 80, false);
        for vip in &s.vips {
            for port in &s.ports {
                match state.route(SocketAddr::new(*vip, port.port)) {
                    // Through a waypoint the authority is what was dialled.
                    Route::Hbone {
                        target,
                        waypoint: true,
                        ..
                    } => assert_eq!(target, SocketAddr::new(*vip, port.port)),
                    Route::Hbone { target, .. } | Route::Passthrough { target } => {
                        // The first entry for a port wins (duplicates are not
                        // an error).
                        assert_eq!(Some(target.port()), s.target_port(port.port));
                        assert_eq!(target.is_ipv6(), vip.is_ipv6());
                    }
                    Route::Deny { .. } => {}
                }
            }
        }
    }
});
