//! TLS for HBONE, with rustls.
//!
//! - TLS 1.3 only; suites `TLS_AES_256_GCM_SHA384` and
//!   `TLS_AES_128_GCM_SHA256`; key exchange X25519, P-256, P-384 (the set
//!   Istio's ztunnel offers, minus the optional X25519MLKEM768, which the
//!   `ring` provider does not have).
//! - Crypto provider: `ring`. It has every suite and group above and builds
//!   with nothing but a C compiler. `aws-lc-rs` was measured twice against
//!   it (docs/performance.md): a few percent more bulk throughput, but more
//!   idle memory, and with it for the handshakes too more CPU per request.
//! - ALPN `h2` on both sides; a client that does not offer it is refused
//!   with `no_application_protocol`. No SNI (the client names the server by
//!   IP, which rustls never sends), no session resumption.
//! - [`verify`]: the client accepts only a chain to our roots whose leaf
//!   carries exactly one of the expected SPIFFE ids; the server requires a
//!   client certificate chained to our roots with a SPIFFE id in our trust
//!   domain, and hands that identity to the proxy.

pub mod verify;

use std::sync::Arc;

use rustls::{
    ClientConfig, ServerConfig,
    client::{ResolvesClientCert, Resumption},
    crypto::CryptoProvider,
    server::{ClientHello, NoServerSessionStorage, ResolvesServerCert},
    sign::CertifiedKey,
};

use crate::identity::{CertManager, Identity};

/// ALPN of HBONE.
pub const ALPN_H2: &[u8] = b"h2";

/// The crypto provider restricted to the HBONE suites and groups.
pub fn provider() -> Arc<CryptoProvider> {
    use rustls::crypto::ring::{cipher_suite, default_provider, kx_group};
    Arc::new(CryptoProvider {
        cipher_suites: vec![
            cipher_suite::TLS13_AES_256_GCM_SHA384,
            cipher_suite::TLS13_AES_128_GCM_SHA256,
        ],
        kx_groups: vec![kx_group::X25519, kx_group::SECP256R1, kx_group::SECP384R1],
        ..default_provider()
    })
}

/// Errors building TLS configurations.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
    /// The client verifier could not be built.
    #[error("client verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

/// Presents the current certificate of one identity (rotation-aware).
#[derive(Debug)]
struct IdentityCert {
    certs: Arc<CertManager>,
    identity: Identity,
}

impl IdentityCert {
    fn current(&self) -> Option<Arc<CertifiedKey>> {
        match self.certs.certified_key(&self.identity) {
            Ok(key) => Some(key),
            Err(e) => {
                tracing::error!(identity = %self.identity, error = %e, "no certificate to present");
                None
            }
        }
    }
}

impl ResolvesServerCert for IdentityCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current()
    }
}

impl ResolvesClientCert for IdentityCert {
    fn resolve(
        &self,
        _hints: &[&[u8]],
        _schemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.current()
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Server side of HBONE for a pod whose identity is `identity`.
pub fn server_config(
    certs: &Arc<CertManager>,
    identity: &Identity,
) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = provider();
    let verifier = verify::SpiffeClientVerifier::new(
        certs.roots(),
        &identity.trust_domain,
        Arc::clone(&provider),
    )?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(Arc::new(verifier))
        .with_cert_resolver(Arc::new(IdentityCert {
            certs: Arc::clone(certs),
            identity: identity.clone(),
        }));
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    config.session_storage = Arc::new(NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

/// Client side of HBONE: present `source`'s certificate and accept only a
/// server presenting one of `expected`.
pub fn client_config(
    certs: &Arc<CertManager>,
    source: &Identity,
    expected: Vec<Identity>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = provider();
    let verifier =
        verify::SpiffeServerVerifier::new(certs.roots(), expected, Arc::clone(&provider));
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_cert_resolver(Arc::new(IdentityCert {
            certs: Arc::clone(certs),
            identity: source.clone(),
        }));
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    config.resumption = Resumption::disabled();
    config.enable_sni = false;
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rustls::pki_types::ServerName;

    use super::*;
    use crate::identity::ca::CertificateAuthority;

    fn certs(tag: &str) -> Arc<CertManager> {
        let dir = std::env::temp_dir().join(format!("zt-tls-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = CertificateAuthority::development(&dir, "cluster.local").expect("ca");
        Arc::new(CertManager::new(ca, Duration::from_secs(3600)))
    }

    async fn handshake(
        client: Arc<ClientConfig>,
        server: Arc<ServerConfig>,
    ) -> (Result<(), String>, Result<(), String>) {
        let (c, s) = tokio::io::duplex(64 * 1024);
        let connector = tokio_rustls::TlsConnector::from(client);
        let acceptor = tokio_rustls::TlsAcceptor::from(server);
        let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
        let (cr, sr) = tokio::join!(connector.connect(name, c), acceptor.accept(s));
        (
            cr.map(|_| ()).map_err(|e| e.to_string()),
            sr.map(|_| ()).map_err(|e| e.to_string()),
        )
    }

    #[tokio::test]
    async fn mutual_tls_with_the_expected_identity_succeeds() {
        let certs = certs("ok");
        let a = Identity::new("cluster.local", "demo", "a");
        let b = Identity::new("cluster.local", "demo", "b");
        let (c, s) = handshake(
            client_config(&certs, &a, vec![b.clone()]).expect("client"),
            server_config(&certs, &b).expect("server"),
        )
        .await;
        assert!(c.is_ok() && s.is_ok(), "{c:?} {s:?}");
    }

    #[tokio::test]
    async fn two_processes_sharing_the_ca_folder_trust_each_other() {
        let first = certs("shared");
        let dir = std::env::temp_dir().join(format!("zt-tls-shared-{}", std::process::id()));
        let second = Arc::new(CertManager::new(
            CertificateAuthority::development(&dir, "cluster.local").expect("reload"),
            Duration::from_secs(3600),
        ));
        let a = Identity::new("cluster.local", "demo", "a");
        let b = Identity::new("cluster.local", "demo", "b");
        let (c, s) = handshake(
            client_config(&second, &a, vec![b.clone()]).expect("client"),
            server_config(&first, &b).expect("server"),
        )
        .await;
        assert!(c.is_ok() && s.is_ok(), "{c:?} {s:?}");
    }

    #[tokio::test]
    async fn a_server_with_another_identity_is_refused_by_name() {
        let certs = certs("san");
        let a = Identity::new("cluster.local", "demo", "a");
        let b = Identity::new("cluster.local", "demo", "b");
        let impostor = Identity::new("cluster.local", "demo", "mallory");
        let (c, _) = handshake(
            client_config(&certs, &a, vec![b]).expect("client"),
            server_config(&certs, &impostor).expect("server"),
        )
        .await;
        let err = c.expect_err("must fail");
        assert!(
            err.contains("peer did not present the expected SAN"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_client_without_h2_gets_no_application_protocol() {
        let certs = certs("alpn");
        let a = Identity::new("cluster.local", "demo", "a");
        let b = Identity::new("cluster.local", "demo", "b");
        let mut client = (*client_config(&certs, &a, vec![b.clone()]).expect("client")).clone();
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        let (c, s) = handshake(Arc::new(client), server_config(&certs, &b).expect("server")).await;
        assert!(
            c.expect_err("client fails")
                .contains("NoApplicationProtocol")
        );
        assert!(s.is_err());
    }
}
