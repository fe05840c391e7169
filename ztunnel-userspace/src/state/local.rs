//! The local-mode config file: one YAML document describing the mesh.
//!
//! ```yaml
//! trustDomain: cluster.local
//! workloads:
//!   - uid: pod-a1
//!     name: app-a1
//!     namespace: demo
//!     serviceAccount: a1
//!     node: node-a
//!     ips: [10.244.1.10]
//!     netns: /var/run/netns/app-a1
//!     protocol: HBONE          # or TCP for a pod outside the mesh
//!     capture: {inbound: true, outbound: true}
//! services:
//!   - name: web
//!     namespace: demo
//!     vips: [10.96.0.10]
//!     ports: [{port: 80, targetPort: 8080}]
//!     endpoints: [pod-a1]       # workload uids
//!     waypoint: {hostname: wp.demo.svc.cluster.local}  # optional; or
//!                               # {address: IP}; also on workloads
//! outboundTrafficPolicy: ALLOW_ANY   # or REGISTRY_ONLY
//! ```
//!
//! [`parse`] is a pure function from text to state; syntax and type errors
//! carry the line and column, and every semantic problem is reported at
//! once, each naming the field at fault (`workloads[2].uid`).
//!
//! A file with no document in it (zero bytes, only whitespace, comments or
//! `---`) is an error, not an empty mesh: that is what an editor or
//! `cat > mesh.yaml` leaves for a moment while saving, and taking it as "no
//! workloads" would un-enrol every pod until the next read, letting their
//! traffic bypass the mesh. A mesh without workloads on purpose is written
//! as a document, e.g. `workloads: []`.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

use serde::Deserialize;

use super::{Service, Workload, mesh::OutboundTrafficPolicy};

/// Default trust domain (Istio's).
pub const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";

/// The whole file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LocalConfig {
    /// SPIFFE trust domain of this mesh.
    #[serde(default = "default_td")]
    pub trust_domain: String,
    /// Every workload of the mesh (all nodes).
    #[serde(default)]
    pub workloads: Vec<Workload>,
    /// Services (VIPs in front of workloads).
    #[serde(default)]
    pub services: Vec<Service>,
    /// What to do with destinations the mesh does not know.
    #[serde(default)]
    pub outbound_traffic_policy: OutboundTrafficPolicy,
    /// L4 authorization policies.
    #[serde(default)]
    pub policies: Vec<super::policy::Policy>,
    /// mTLS modes.
    #[serde(default)]
    pub peer_authentications: Vec<super::policy::PeerAuthentication>,
}

fn default_td() -> String {
    DEFAULT_TRUST_DOMAIN.into()
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            trust_domain: default_td(),
            workloads: Vec::new(),
            services: Vec::new(),
            outbound_traffic_policy: OutboundTrafficPolicy::default(),
            policies: Vec::new(),
            peer_authentications: Vec::new(),
        }
    }
}

/// Why a config file was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// YAML syntax or a field of the wrong type (with line and column).
    #[error("config {path}: {message}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// serde_yaml's message, which includes "at line L column C".
        message: String,
    },
    /// The file holds no document at all (zero bytes, whitespace, comments).
    #[error(
        "config {path} is empty (no YAML document, only whitespace or comments); \
         write `workloads: []` for a mesh without workloads"
    )]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// The document parsed but says something impossible.
    #[error("config {path} is invalid:\n  - {}", problems.join("\n  - "))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem found.
        problems: Vec<String>,
    },
}

impl ConfigError {
    /// A short label for metrics and logs: `unreadable`, `empty`, `syntax`
    /// or `invalid`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Read { .. } => "unreadable",
            Self::Empty { .. } => "empty",
            Self::Syntax { .. } => "syntax",
            Self::Invalid { .. } => "invalid",
        }
    }
}

/// Reads and parses a config file.
pub fn load(path: &Path) -> Result<LocalConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text, path)
}

/// Parses and validates config text; `path` only labels errors.
pub fn parse(text: &str, path: &Path) -> Result<LocalConfig, ConfigError> {
    let syntax = |e: serde_yaml::Error| ConfigError::Syntax {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    // Emptiness is judged on the document, not the bytes, so that a file of
    // comments (or a bare `---`) counts too. A YAML error here is reported
    // by the typed parse below, which names the same line.
    if text.trim().is_empty()
        || serde_yaml::from_str::<serde_yaml::Value>(text).is_ok_and(|v| v.is_null())
    {
        return Err(ConfigError::Empty {
            path: path.to_path_buf(),
        });
    }
    let config: LocalConfig = serde_yaml::from_str(text).map_err(syntax)?;
    let problems = validate(&config);
    if problems.is_empty() {
        Ok(config)
    } else {
        Err(ConfigError::Invalid {
            path: path.to_path_buf(),
            problems,
        })
    }
}

fn validate(config: &LocalConfig) -> Vec<String> {
    let mut problems = Vec::new();
    if config.trust_domain.is_empty() || config.trust_domain.contains('/') {
        problems.push(format!(
            "trustDomain: {:?} is not a valid trust domain",
            config.trust_domain
        ));
    }
    let mut uids = HashSet::new();
    let mut ips = HashSet::new();
    for (i, w) in config.workloads.iter().enumerate() {
        let at = |field: &str| format!("workloads[{i}].{field}");
        for (field, value) in [
            ("uid", &w.uid),
            ("name", &w.name),
            ("namespace", &w.namespace),
            ("serviceAccount", &w.service_account),
            ("node", &w.node),
        ] {
            if value.trim().is_empty() {
                problems.push(format!("{}: must not be empty", at(field)));
            }
        }
        // Path segments of the workload's SPIFFE id: a `/` would make an
        // identity that peers cannot parse back, or that reads as another
        // workload's. Found by fuzzing (enrolment socket, same rule there).
        for (field, value) in [
            ("namespace", &w.namespace),
            ("serviceAccount", &w.service_account),
        ] {
            if value.contains('/') {
                problems.push(format!(
                    "{}: {value:?} must not contain '/' (it separates the SPIFFE id's segments)",
                    at(field)
                ));
            }
        }
        if !w.uid.is_empty() && !uids.insert(w.uid.clone()) {
            problems.push(format!("{}: duplicate uid {:?}", at("uid"), w.uid));
        }
        for ip in &w.ips {
            if !ips.insert(*ip) {
                problems.push(format!(
                    "{}: {ip} is already used by another workload",
                    at("ips")
                ));
            }
        }
        if let Some(netns) = &w.netns
            && !netns.is_absolute()
        {
            problems.push(format!(
                "{}: {} is not an absolute path",
                at("netns"),
                netns.display()
            ));
        }
        if let Some(problem) = w.waypoint.as_ref().and_then(super::Waypoint::problem) {
            problems.push(format!("{}: {problem}", at("waypoint")));
        }
    }
    let mut vips = HashSet::new();
    for (i, svc) in config.services.iter().enumerate() {
        let at = |field: &str| format!("services[{i}].{field}");
        if svc.vips.is_empty() {
            problems.push(format!("{}: at least one VIP is needed", at("vips")));
        }
        for vip in &svc.vips {
            if !vips.insert(*vip) || ips.contains(vip) {
                problems.push(format!("{}: {vip} is already used", at("vips")));
            }
        }
        for uid in &svc.endpoints {
            if !uids.contains(uid) {
                problems.push(format!("{}: no workload with uid {uid:?}", at("endpoints")));
            }
        }
        if let Some(problem) = svc.waypoint.as_ref().and_then(super::Waypoint::problem) {
            problems.push(format!("{}: {problem}", at("waypoint")));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "
trustDomain: cluster.local
workloads:
  - uid: a1
    name: app-a1
    namespace: demo
    serviceAccount: a1
    node: node-a
    ips: [10.244.1.10]
    netns: /var/run/netns/a1
  - uid: b1
    name: app-b1
    namespace: demo
    node: node-b
    ips: [10.244.2.10]
    protocol: TCP
    capture: {inbound: false}
";

    #[test]
    fn parses_a_good_file() {
        let c = parse(GOOD, Path::new("x.yaml")).expect("valid");
        assert_eq!(c.workloads.len(), 2);
        assert_eq!(
            c.workloads[0].identity(&c.trust_domain),
            "spiffe://cluster.local/ns/demo/sa/a1"
        );
        assert_eq!(c.workloads[1].service_account, "default");
        assert!(!c.workloads[1].capture.inbound && c.workloads[1].capture.outbound);
    }

    #[test]
    fn type_errors_name_the_line() {
        let bad = GOOD.replace("ips: [10.244.1.10]", "ips: [10.244.1.999]");
        let err = parse(&bad, Path::new("x.yaml"))
            .expect_err("bad ip")
            .to_string();
        assert!(err.contains("line 9"), "{err}");
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let bad = GOOD.replace("node: node-b", "node: node-b\n    nodee: typo");
        let err = parse(&bad, Path::new("x.yaml"))
            .expect_err("unknown field")
            .to_string();
        assert!(err.contains("nodee"), "{err}");
    }

    #[test]
    fn every_semantic_problem_is_reported_at_once() {
        let bad = GOOD
            .replace("uid: b1", "uid: a1")
            .replace("10.244.2.10", "10.244.1.10")
            .replace("/var/run/netns/a1", "relative/ns");
        let err = parse(&bad, Path::new("x.yaml"))
            .expect_err("invalid")
            .to_string();
        assert!(err.contains("workloads[1].uid: duplicate uid"), "{err}");
        assert!(err.contains("workloads[1].ips"), "{err}");
        assert!(err.contains("workloads[0].netns"), "{err}");
    }

    #[test]
    fn a_slash_in_namespace_or_service_account_is_invalid() {
        let bad = GOOD
            .replace(
                "namespace: demo\n    serviceAccount: a1",
                "namespace: demo\n    serviceAccount: a/sa/b",
            )
            .replace(
                "name: app-b1\n    namespace: demo",
                "name: app-b1\n    namespace: dem/",
            );
        let err = parse(&bad, Path::new("x.yaml"))
            .expect_err("slashes")
            .to_string();
        assert!(err.contains("workloads[0].serviceAccount"), "{err}");
        assert!(err.contains("workloads[1].namespace"), "{err}");
    }

    #[test]
    fn a_file_without_a_document_is_rejected_naming_the_file() {
        for text in ["", "   \n\t\n", "# saving...\n  # more\n", "---\n", "~\n"] {
            let err = parse(text, Path::new("/etc/mesh.yaml"))
                .expect_err(&format!("{text:?} must be rejected"));
            assert!(
                matches!(err, ConfigError::Empty { .. }),
                "{text:?}: {err:?}"
            );
            assert_eq!(err.kind(), "empty");
            let shown = err.to_string();
            assert!(
                shown.contains("/etc/mesh.yaml") && shown.contains("empty"),
                "{shown}"
            );
        }
    }

    #[test]
    fn an_explicitly_empty_mesh_is_valid() {
        for text in ["workloads: []\n", "trustDomain: cluster.local\n"] {
            let c = parse(text, Path::new("x")).expect("explicit empty mesh is valid");
            assert!(c.workloads.is_empty(), "{text:?}");
        }
    }

    #[test]
    fn error_kinds_label_what_went_wrong() {
        let syntax = parse("workloads: [", Path::new("x")).expect_err("syntax");
        assert_eq!(syntax.kind(), "syntax", "{syntax}");
        let invalid = parse("trustDomain: \"a/b\"\n", Path::new("x")).expect_err("invalid");
        assert_eq!(invalid.kind(), "invalid", "{invalid}");
        let unreadable = load(Path::new("/nonexistent/mesh.yaml")).expect_err("unreadable");
        assert_eq!(unreadable.kind(), "unreadable", "{unreadable}");
        assert!(unreadable.to_string().contains("/nonexistent/mesh.yaml"));
    }
}
