//! Workload identities and their certificates.
//!
//! - `Identity`: `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`.
//! - [`ca`]: where certificates come from: the built-in development CA
//!   (persisted in a folder so every node of a local-mode mesh shares it), or
//!   a CA certificate and key given as files (optionally an intermediate with
//!   its root).
//!   Or [`istio_ca`]: istiod's certificate service, so that no node holds
//!   the mesh's signing key.
//! - [`manager`]: holds each local workload's certificate, gets it (signed
//!   in place, or asked of Istio's CA in the background) and replaces it
//!   once half its lifetime has passed. TLS handshakes ask the manager for
//!   the current certificate, so rotation never touches connections that
//!   are already open.

pub mod ca;
pub mod istio_ca;
pub mod manager;

use std::fmt;

pub use manager::CertManager;

/// A SPIFFE workload identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    /// Trust domain, e.g. `cluster.local`.
    pub trust_domain: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Service account.
    pub service_account: String,
}

/// Errors of identity handling.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// A string is not a SPIFFE id of the Istio form.
    #[error("{0:?} is not a SPIFFE id of the form spiffe://<td>/ns/<ns>/sa/<sa>")]
    NotSpiffe(String),
    /// Certificate generation or signing failed.
    #[error("issuing a certificate for {identity}: {message}")]
    Issue {
        /// For whom.
        identity: String,
        /// What rcgen said.
        message: String,
    },
    /// Istio's CA refused, failed or answered something unusable.
    #[error("Istio CA at {address}, certificate for {identity}: {message}")]
    Ca {
        /// The CA's address.
        address: String,
        /// The identity asked for.
        identity: String,
        /// What went wrong.
        message: String,
    },
    /// The CA address is not `host:port`.
    #[error("CA address {address:?}: {message}")]
    CaAddress {
        /// The address as given.
        address: String,
        /// What is wrong with it.
        message: String,
    },
    /// No certificate for this identity yet: it is being asked for.
    #[error("no certificate for {0} yet: it is being asked of the Istio CA")]
    NotYet(String),
    /// No certificate arrived within the wait.
    #[error("no certificate for {identity}: {message}")]
    Unavailable {
        /// The identity.
        identity: String,
        /// The CA's last error, or the wait that ran out.
        message: String,
    },
    /// A CA file could not be read or parsed.
    #[error("CA file {path}: {message}")]
    CaFile {
        /// The file.
        path: std::path::PathBuf,
        /// What went wrong.
        message: String,
    },
}

impl Identity {
    /// Builds an identity.
    pub fn new(trust_domain: &str, namespace: &str, service_account: &str) -> Self {
        Self {
            trust_domain: trust_domain.to_owned(),
            namespace: namespace.to_owned(),
            service_account: service_account.to_owned(),
        }
    }

    /// Parses `spiffe://td/ns/NS/sa/SA`.
    pub fn parse(uri: &str) -> Result<Self, IdentityError> {
        let err = || IdentityError::NotSpiffe(uri.to_owned());
        let rest = uri.strip_prefix("spiffe://").ok_or_else(err)?;
        let mut parts = rest.split('/');
        let td = parts.next().filter(|s| !s.is_empty()).ok_or_else(err)?;
        let (Some("ns"), Some(ns), Some("sa"), Some(sa), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(err());
        };
        if ns.is_empty() || sa.is_empty() {
            return Err(err());
        }
        Ok(Self::new(td, ns, sa))
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

/// The URI SANs of a DER certificate (empty if it does not parse).
pub fn uri_sans(der: &[u8]) -> Vec<String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(uri) => Some((*uri).to_owned()),
            _ => None,
        })
        .collect()
}

/// The end of a DER certificate's validity (None if it does not parse).
pub fn not_after(der: &[u8]) -> Option<std::time::SystemTime> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    let seconds = u64::try_from(cert.validity().not_after.timestamp()).ok()?;
    Some(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(seconds))
}

/// When a TLS connection stops being good for new streams: the earlier end
/// of the two leaves' validity (ours and the peer's). Open streams go on;
/// new ones go over a connection made with current certificates, so an
/// expired (e.g. not renewed, revoked by the CA) certificate is never what
/// lets a new stream through.
pub fn connection_expiry(
    own: &rustls::sign::CertifiedKey,
    peer: Option<&[rustls::pki_types::CertificateDer<'_>]>,
) -> std::time::SystemTime {
    let ends = [
        own.cert.first().and_then(|c| not_after(c)),
        peer.and_then(|p| p.first()).and_then(|c| not_after(c)),
    ];
    ends.into_iter()
        .flatten()
        .min()
        .unwrap_or(std::time::SystemTime::UNIX_EPOCH)
}

/// The identity a certificate carries: its single SPIFFE URI SAN.
pub fn identity_of(der: &[u8]) -> Option<Identity> {
    let sans = uri_sans(der);
    match sans.as_slice() {
        [one] => Identity::parse(one).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_spiffe_ids() {
        let id = Identity::parse("spiffe://cluster.local/ns/demo/sa/a1").expect("valid");
        assert_eq!(id, Identity::new("cluster.local", "demo", "a1"));
        assert_eq!(id.to_string(), "spiffe://cluster.local/ns/demo/sa/a1");
    }

    #[test]
    fn rejects_other_shapes() {
        for bad in [
            "https://cluster.local/ns/a/sa/b",
            "spiffe://cluster.local/ns/a",
            "spiffe:///ns/a/sa/b",
            "spiffe://td/ns/a/sa/b/extra",
            "spiffe://td/sa/a/ns/b",
        ] {
            assert!(Identity::parse(bad).is_err(), "{bad}");
        }
    }
}
