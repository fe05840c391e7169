//! Certificate verification by SPIFFE identity instead of DNS name.

use std::sync::Arc;

use rustls::{
    DigitallySignedStruct, DistinguishedName, Error, RootCertStore, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature},
    pki_types::{CertificateDer, ServerName, UnixTime},
    server::{
        ParsedCertificate, WebPkiClientVerifier,
        danger::{ClientCertVerified, ClientCertVerifier},
    },
};

use crate::identity::{Identity, identity_of, uri_sans};

/// The client's check of the server: chain to our roots, then the leaf's
/// SPIFFE id must be one the destination is expected to have.
#[derive(Debug)]
pub struct SpiffeServerVerifier {
    roots: RootCertStore,
    expected: Vec<Identity>,
    provider: Arc<CryptoProvider>,
}

impl SpiffeServerVerifier {
    /// Accepts servers presenting any of `expected`.
    pub fn new(
        roots: RootCertStore,
        expected: Vec<Identity>,
        provider: Arc<CryptoProvider>,
    ) -> Self {
        Self {
            roots,
            expected,
            provider,
        }
    }
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        match identity_of(end_entity) {
            Some(id) if self.expected.contains(&id) => Ok(ServerCertVerified::assertion()),
            _ => {
                let got = uri_sans(end_entity).join(",");
                let want: Vec<String> = self.expected.iter().map(ToString::to_string).collect();
                tracing::warn!(presented = %got, expected = %want.join(","), "peer did not present the expected SAN");
                Err(Error::General(format!(
                    "peer did not present the expected SAN: presented [{got}], expected one of [{}]",
                    want.join(", ")
                )))
            }
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The server's check of the client: webpki's chain and clientAuth check,
/// then a SPIFFE id in our trust domain.
#[derive(Debug)]
pub struct SpiffeClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    trust_domain: String,
}

impl SpiffeClientVerifier {
    /// Requires client certificates chained to `roots` from `trust_domain`.
    pub fn new(
        roots: RootCertStore,
        trust_domain: &str,
        provider: Arc<CryptoProvider>,
    ) -> Result<Self, rustls::server::VerifierBuilderError> {
        let inner =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build()?;
        Ok(Self {
            inner,
            trust_domain: trust_domain.to_owned(),
        })
    }
}

impl ClientCertVerifier for SpiffeClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        self.inner
            .verify_client_cert(end_entity, intermediates, now)?;
        match identity_of(end_entity) {
            Some(id) if id.trust_domain == self.trust_domain => Ok(ClientCertVerified::assertion()),
            _ => Err(Error::General(format!(
                "client certificate has no SPIFFE id in trust domain {} (URI SANs: [{}])",
                self.trust_domain,
                uri_sans(end_entity).join(",")
            ))),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}
